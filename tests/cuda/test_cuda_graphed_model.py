"""A LoRA model's whole training step captured in one CUDA graph equals the eager step
(tests/cuda/graphed_model.py: a tiny Llama, LoRA on all seven projections, bf16 base, float32 adapters,
SGD): the losses of every replay and the trained parameters after them. On the CPU: the eager half runs, so the comparison's own code is exercised in CI.
"""

from __future__ import annotations

import math

import pytest
import torch

import loragen.cuda
from tests.cuda import graphed_model

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
def test_a_captured_training_step_equals_the_eager_one():
    assert graphed_model.compare() == []
