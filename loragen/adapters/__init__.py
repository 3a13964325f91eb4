"""Adapters on disk in peft's format: reading (``folder``), ``save``, ``load``, several named adapters
(``named``, ``weighted``), ``loragen merge`` (``offline_merge``), ``loragen inspect`` (``summary``).
"""
