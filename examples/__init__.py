"""Runnable examples; ``digits_model.py`` is the model file ``loragen demo`` rewrites and trains."""
