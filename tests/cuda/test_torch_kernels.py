"""The torch path's dropout (loragen.cuda.torch_dropout) on CPU tensors: the vectorised Philox
formulation against loragen.philox, the jiterator source as torch will read it, and how many torch
operations a training step of the torch path dispatches.

tests/cuda/test_torch_kernels_gpu.py runs the jiterator kernel itself against this formulation."""

from __future__ import annotations

import collections
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from loragen import philox
from loragen.cuda import torch_dropout
from loragen.cuda.linear_op import lora_linear_cuda
from loragen.cuda.torch_dropout import dropped, keep_mask, rng_tensor
from loragen.cuda.torch_kernels import TorchKernels
from tests.cuda.lora_reference import make_inputs, mask_for, reference, relative_error

CPU = torch.device("cpu")
u64 = st.integers(0, 2**64 - 1)


@settings(max_examples=60, deadline=None)
@given(start=st.integers(0, 2**40), numel=st.integers(1, 300), p=st.floats(0.01, 0.95), seed=u64, offset=u64)
def test_keep_mask_is_the_philox_mask(start, numel, p, seed, offset):
    """Any span of the mask, including spans starting mid-group and counters past 2**32 groups."""
    threshold = philox.keep_threshold(p)
    got = keep_mask(start, numel, threshold, seed, offset, CPU)
    assert got.shape == (numel,) and got.dtype == torch.bool
    # the documented layout at the true position, through loragen.philox.philox4x32_10
    first = start // 8 * 8
    groups = torch.arange(first // 8, (start + numel + 7) // 8, dtype=torch.int64)
    counter = torch.stack(
        [
            groups & 0xFFFFFFFF,
            groups >> 32,
            torch.full_like(groups, offset & 0xFFFFFFFF),
            torch.full_like(groups, offset >> 32),
        ],
        dim=-1,
    )
    words = philox.philox4x32_10(counter, (seed & 0xFFFFFFFF, seed >> 32))
    lanes = torch.arange(8)
    bits = (words[:, lanes // 2] >> (16 * (lanes % 2))) & 0xFFFF
    want = (bits >= threshold).reshape(-1)[start - first : start - first + numel]
    assert torch.equal(got, want)


@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (3, 5), (17, 40), (64, 8)])
def test_keep_mask_matches_dropout_keep_mask(rows, cols):
    seed, offset, p = 2**64 - 3, 2**63 + 11, 0.3
    want = philox.dropout_keep_mask((rows, cols), p, seed, offset).reshape(-1)
    got = keep_mask(0, rows * cols, philox.keep_threshold(p), seed, offset, CPU)
    assert torch.equal(got, want)
    # every row block on its own, as the torch path generates them
    for begin in range(rows):
        part = keep_mask(begin * cols, cols, philox.keep_threshold(p), seed, offset, CPU)
        assert torch.equal(part, want[begin * cols : (begin + 1) * cols])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_dropped_scales_kept_elements_and_zeroes_the_rest(dtype):
    x = torch.randn(13, 24).to(dtype)
    p, seed = 0.25, 99
    rng = rng_tensor(seed, 0, CPU)
    out = dropped(x[5:], rng, 5 * 24, philox.keep_threshold(p), philox.keep_scale(p))
    keep = philox.dropout_keep_mask((13, 24), p, seed)[5:]
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.where(keep, x[5:].float() * (1 / (1 - p)), 0.0))
    same = dropped(x.float(), rng, 0, 0, 1.0)
    assert torch.equal(same, x.float())


@pytest.mark.parametrize("name", sorted(torch_dropout.JIT_FUNCTIONS))
def test_jiterator_sources_parse_into_their_declared_arguments(name):
    """torch reads each source with a regular expression (the entry is the last function) and passes the
    keyword arguments in their declared order after the tensors: both must line up with the C++
    parameter list."""
    from torch.cuda import jiterator

    source, kwargs = torch_dropout.JIT_FUNCTIONS[name]
    fn = jiterator._create_jit_fn(source, **kwargs)
    entry = {"keep_bits": "loragen_keep_bits", "keep": "loragen_keep", "apply": "loragen_apply_keep"}[name]
    assert fn.kernel_name == entry
    signature = re.search(rf"{entry}\((.*?)\)\s*\{{", source, re.DOTALL)
    assert signature is not None
    names = [param.split()[-1] for param in signature.group(1).split(",")]
    tensors = {"keep_bits": 3, "keep": 3, "apply": 3}[name]
    assert names[tensors:] == list(fn.kwargs_dict) == list(kwargs)


class _Dispatches(TorchDispatchMode):
    """Counts every aten operation dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _training_step_dispatches(p: float) -> collections.Counter[str]:
    x = torch.randn(4, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 64, dtype=torch.bfloat16)
    a = torch.randn(8, 64, requires_grad=True)
    b = torch.randn(48, 8, requires_grad=True)
    with _Dispatches() as mode:
        y = lora_linear_cuda(x, w, None, a, b, 2.0, p, True, launcher=TorchKernels())
        y.float().sum().backward()
    return mode.counts


def test_a_training_step_dispatches_few_operations():
    """One forward + backward of the torch path: without dropout 56 dispatches (86 before the products
    ran over whole tensors and the padded rank); with dropout each Philox mask adds about 100 (six per
    round, and the constants made on the device from aranges: no host-to-device copy), made once in
    forward and once in backward. Before the vectorised formulation, a step dispatched 814 operations."""
    without = _training_step_dispatches(0.0)
    with_dropout = _training_step_dispatches(0.1)
    assert sum(without.values()) <= 60
    assert sum(with_dropout.values()) - sum(without.values()) <= 2 * 105
    # per mask one int64 product per Philox round and one for the key schedule; one scaling per masked
    # tensor (x twice, dh A)
    assert with_dropout["aten.mul.Tensor"] - without["aten.mul.Tensor"] <= 2 * 11 + 3


def test_torch_path_step_matches_the_float64_reference_with_dropout():
    (x, w, b, a, bb), (xr, wr, br, ar, bbr) = make_inputs(70, 72, 40, 8, torch.bfloat16, seed=12)
    state = torch.get_rng_state()
    y = lora_linear_cuda(x, w, b, a, bb, 0.5, 0.2, True, launcher=TorchKernels())
    want = reference(xr, wr, br, ar, bbr, 0.5, mask_for(state, (70, 72), 0.2), False)
    assert relative_error(y, want) < 1.5e-2
    grad = torch.randn(70, 40, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    y.backward(grad)
    want.backward(grad.double())
    for got, expected in ((x, xr), (a, ar), (bb, bbr)):
        assert relative_error(got.grad, expected.grad) < 1.5e-2


def test_checkpoint_recomputes_the_torch_paths_mask():
    from torch.utils.checkpoint import checkpoint

    def run(use_checkpoint: bool) -> tuple[torch.Tensor, ...]:
        (x, w, b, a, bb), _ = make_inputs(33, 40, 24, 4, torch.float32, seed=8)
        torch.manual_seed(7)
        args = (x, w, b, a, bb, 1.0, 0.4, True)
        if use_checkpoint:
            y = checkpoint(lora_linear_cuda, *args, use_reentrant=False, launcher=TorchKernels())
        else:
            y = lora_linear_cuda(*args, launcher=TorchKernels())
        y.square().sum().backward()
        return y.detach(), a.grad, x.grad

    for got, want in zip(run(True), run(False)):
        assert torch.equal(got, want)
