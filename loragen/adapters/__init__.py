"""Adapters on disk in peft's format: reading and ``loragen inspect`` (``folder``), ``save``, ``load``,
several named adapters (``named``), ``loragen merge`` (``offline_merge``).
"""
