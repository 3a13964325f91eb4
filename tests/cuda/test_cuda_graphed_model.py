"""A LoRA model's whole training step captured in one CUDA graph equals the eager step
(tests/cuda/graphed_model.py: a tiny Llama, LoRA on all seven projections, bf16 base, float32 adapters,
SGD): the losses of every replay and the trained parameters after them, on each host path and with CUDA
sibling groups. On the CPU: the eager half runs, so the comparison's own code is exercised in CI.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import loragen.cuda
from loragen import switches
from tests.cuda import graphed_model

ROOT = Path(__file__).resolve().parents[2]
needs_gpu = pytest.mark.skipif(not loragen.cuda.is_available(), reason="needs a CUDA device and cuda-python")


def test_the_eager_half_trains_on_the_cpu():
    losses, model = graphed_model.eager_losses("cpu", 3)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    initial, _, _ = graphed_model.build("cpu")
    changed = [
        name
        for (name, got), (_, before) in zip(model.named_parameters(), initial.named_parameters())
        if got.requires_grad and not torch.equal(got, before)
    ]
    assert len(changed) == 2 * len(graphed_model.TARGETS) * 2  # A and B of 7 projections in 2 layers


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("native", [False, True], ids=["python host path", "c++ host path"])
def test_a_captured_training_step_equals_the_eager_one(native):
    from loragen.cuda import native_host

    if native and not native_host.available():
        pytest.skip(f"the C++ host path did not build: {native_host.status()}")
    with switches.cuda_native_host.using(native):
        assert graphed_model.compare() == []


@pytest.mark.gpu
@needs_gpu
def test_a_captured_training_step_with_cuda_sibling_groups_equals_the_eager_one():
    """In a process of its own: a step with CUDA groups on, captured beside an eager model, once ended in
    an illegal memory access, which leaves the device unusable for every test after it."""
    env = {**os.environ, "LORAGEN_CUDA_SIBLING_FUSION": "1", "LORAGEN_CUDA_NATIVE_HOST": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.cuda.graphed_model"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
