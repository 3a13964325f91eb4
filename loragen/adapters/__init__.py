"""Adapters on disk in peft's format: reading (``folder``), ``save``, ``load``, several named adapters
(``named``), ``loragen merge`` (``offline_merge``), ``loragen inspect`` (``summary``).
"""
