"""Jinja templates for generated Python code (shipped in the wheel as ``loragen._templates``)."""
