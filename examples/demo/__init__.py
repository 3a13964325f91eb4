"""``loragen demo``: the main job end to end on data that ships with scikit-learn.

One module per stage, run in this order by :func:`run_demo` (:mod:`.run`):

1. :mod:`.model_file` — rewrite the bundled model file (``examples/digits_model.py``) with
   ``loragen rewrite`` and return the diff.
2. :mod:`.data` — scikit-learn's 8x8 handwritten digits: the *source* domain is the upright digits, the
   *shifted* domain the same digits rotated by 90 degrees.
3. and 4. :mod:`.training` — train the plain model on upright digits (a genuinely trained base), then
   convert it with ``get_lora_model`` (LoRA on the convolutions and the hidden linear layer, the
   classifier head trained fully as ``modules_to_save``) and fine-tune on the rotated digits; progress
   from :mod:`.progress` (a bar on a terminal, plain lines in a log).
5. and 6. :mod:`.checks` — save the adapter in peft's format, load it into a fresh base, check it
   reproduces the trained model, merge, check merged == unmerged; and the rewritten file's model,
   given the base checkpoint and the adapter, computes the same outputs.
7. :mod:`.plot` and :mod:`.report` — ``training_curves.png`` (loss and accuracy, phases labelled),
   ``summary.md`` and ``metrics.json``.

:mod:`.options` holds the settings (:class:`DemoOptions`) and the adapter's config. Everything is seeded:
the same ``seed`` gives the same numbers (on the same machine and thread count).
"""

from .checks import MATCH_TOLERANCE, AdapterCheck, check_adapter_roundtrip, check_rewritten_model
from .data import DigitsData, load_digits_domains, rotate
from .model_file import bundled_model_file, load_model_class, rewrite_model_file
from .options import MODULES_TO_SAVE, TARGET_MODULES, DemoError, DemoOptions, demo_config
from .plot import FIGURE_NAME, plot_training
from .progress import Progress
from .report import DemoResult, metrics_record, summary_table
from .run import resolve_device, run_demo
from .training import EvalPoint, Metrics, TrainLog, evaluate, finetune_lora, pretrain_base

__all__ = [
    "run_demo",
    "DemoOptions",
    "DemoError",
    "DemoResult",
    "demo_config",
    "TARGET_MODULES",
    "MODULES_TO_SAVE",
    "bundled_model_file",
    "load_model_class",
    "rewrite_model_file",
    "DigitsData",
    "load_digits_domains",
    "rotate",
    "Metrics",
    "EvalPoint",
    "TrainLog",
    "evaluate",
    "pretrain_base",
    "finetune_lora",
    "Progress",
    "MATCH_TOLERANCE",
    "AdapterCheck",
    "check_adapter_roundtrip",
    "check_rewritten_model",
    "FIGURE_NAME",
    "plot_training",
    "metrics_record",
    "summary_table",
    "resolve_device",
]
