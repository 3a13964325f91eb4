"""The forward a newcomer reads is the forward that runs: a LoRA Linear's default training forward on the
CPU, traced call by call from ``layer(x)`` to the autograd op, passes few loragen files and functions."""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from torch import nn

import loragen
from loragen import LoraConfig
from loragen.ops.fused import LoraLinearFunction

PACKAGE = Path(loragen.__file__).resolve().parent
MAX_FILES = 6


def _trace(call: Any) -> list[tuple[str, str]]:
    """``(file relative to loragen/, function)`` of every loragen Python function ``call()`` enters, in
    order, up to the first entry into the CPU autograd op's forward (included)."""
    target = LoraLinearFunction.forward.__code__
    seen: list[tuple[str, str]] = []
    done = False

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal done
        if done or event != "call":
            return
        path = Path(frame.f_code.co_filename).resolve()
        if PACKAGE in path.parents:
            seen.append((path.relative_to(PACKAGE).as_posix(), frame.f_code.co_qualname))
        done = frame.f_code is target

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    assert done, f"the forward never reached LoraLinearFunction.forward: {seen}"
    return seen


def _model(dropout: float) -> nn.Module:
    model = nn.Sequential(nn.Linear(16, 16))
    loragen.get_lora_model(model, LoraConfig(r=4, lora_dropout=dropout, target_modules=["0"]))
    return model.train()


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_linear_training_forward_passes_at_most_six_loragen_files(dropout: float) -> None:
    model = _model(dropout)
    x = torch.randn(3, 16, requires_grad=True)
    calls = _trace(lambda: model(x))
    files = list(dict.fromkeys(file for file, _ in calls))
    assert len(files) <= MAX_FILES, calls
    # it reads as the layer's own code: LoraLayer.forward, then the Linear's fused op
    functions = [function for _, function in calls]
    assert functions.index("LoraLayer.forward") < functions.index("LoraLinearMixin._adapted_output")
    assert calls[-1] == ("ops/fused.py", "LoraLinearFunction.forward")
    assert len(calls) <= 15, calls


def test_the_traced_path_is_the_module_call() -> None:
    """The trace starts inside loragen: nothing of the path is outside what the test counts."""
    model = _model(0.0)
    calls = _trace(lambda: model(torch.randn(2, 16)))
    assert calls[0][0] == "layers/base.py"
