"""Adapters on disk: safetensors reading, peft keys, save/load, the streaming merge and summaries."""
