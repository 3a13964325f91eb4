"""Adapters on disk, in peft's format; one concern per module, in dependency order:

* :mod:`~loragen.adapters.files`: JSON read defensively, safetensors headers and a lazy, row-range reader;
* :mod:`~loragen.adapters.folder`: peft file keys <-> model keys, LoRA factor pairs (from the registry),
  reading an adapter folder (config + tensors; pickles refused);
* :mod:`~loragen.adapters.save`, :mod:`~loragen.adapters.load`: ``save_adapter`` / ``load_adapter``;
* :mod:`~loragen.adapters.checkpoint`: a safetensors checkpoint (file or sharded folder), headers only, and
  which checkpoint tensor each adapter tensor changes (one to one);
* :mod:`~loragen.adapters.merge_plan`, :mod:`~loragen.adapters.offline_merge`: ``loragen merge``, streaming;
* :mod:`~loragen.adapters.summary`: ``loragen inspect``.
"""
