"""Stage 1: the bundled model file (``digits_model.py``), its rewrite by ``loragen rewrite``, and loading
a model class from source."""

from __future__ import annotations

import difflib
import types
from importlib import resources
from pathlib import Path

from torch import nn

from loragen import LoraConfig, rewrite_source

from .options import TARGET_MODULES, DemoError

__all__ = [
    "MODEL_CLASS_NAME",
    "MODEL_FILE_NAME",
    "bundled_model_file",
    "load_model_class",
    "rewrite_model_file",
]

MODEL_FILE_NAME = "digits_model.py"
MODEL_CLASS_NAME = "DigitsNet"


def bundled_model_file() -> Path:
    """Path of the bundled ``digits_model.py``: from the installed package, else the checkout's ``examples/``.

    Raises:
        DemoError: neither location has the file.
    """
    try:
        packaged = resources.files("loragen._examples").joinpath(MODEL_FILE_NAME)
        if packaged.is_file():
            return Path(str(packaged))
    except ModuleNotFoundError:
        pass
    in_repo = Path(__file__).resolve().parent.parent / MODEL_FILE_NAME
    if in_repo.is_file():
        return in_repo
    raise DemoError(
        f"cannot find the bundled model file {MODEL_FILE_NAME}: looked in the package loragen._examples "
        f"and in {in_repo.parent}; run the demo from a loragen checkout or reinstall loragen"
    )


def load_model_class(source: str, module_name: str, filename: str) -> type[nn.Module]:
    """Execute a model file's ``source`` as module ``module_name`` and return its ``DigitsNet`` class.

    Raises:
        DemoError: the source does not define ``DigitsNet``.
    """
    module = types.ModuleType(module_name)
    module.__file__ = filename
    exec(compile(source, filename, "exec"), module.__dict__)  # our own bundled example
    cls = module.__dict__.get(MODEL_CLASS_NAME)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise DemoError(f"{filename}: defines no nn.Module class {MODEL_CLASS_NAME!r}")
    return cls


def rewrite_model_file(path: Path, config: LoraConfig) -> tuple[str, str]:
    """Rewrite the model file at ``path`` with ``loragen.rewrite_source``.

    Returns:
        ``(new_source, unified_diff)``.

    Raises:
        DemoError: the rewriter reported errors or changed nothing.
    """
    code = path.read_text(encoding="utf-8")
    result = rewrite_source(code, config, filename=str(path))
    if result.errors:
        raise DemoError(f"rewrite of {path} failed: " + "; ".join(map(str, result.errors)))
    new_code = result.code
    if new_code == code:
        raise DemoError(
            f"rewrite of {path} changed nothing; expected {', '.join(TARGET_MODULES)} to become LoRA layers"
        )
    diff = "".join(
        difflib.unified_diff(
            code.splitlines(keepends=True),
            new_code.splitlines(keepends=True),
            fromfile=f"a/{path.name}",
            tofile=f"b/{path.name}",
        )
    )
    return new_code, diff
