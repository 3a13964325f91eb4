"""Training helpers: optimizers, gradient checkpointing and accumulation, distributed training."""
