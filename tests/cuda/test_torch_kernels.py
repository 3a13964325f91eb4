"""The torch path's dropout (loragen.cuda.torch_dropout) on CPU tensors: the vectorised Philox
formulation against loragen.philox, the jiterator source as torch will read it, and how many torch
operations a training step of the torch path dispatches.

tests/cuda/test_torch_kernels_gpu.py runs the jiterator kernel itself against this formulation."""

from __future__ import annotations

import collections
import ctypes
import inspect
import math
import re
import shutil
import subprocess

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from loragen import philox
from loragen.cuda import streams, torch_dropout, torch_kernels, torch_path
from loragen.cuda.linear_op import lora_linear_cuda
from loragen.cuda.specs import LORA_DOWN, LORA_GRAD_IN, LORA_GRAD_OUT, LORA_UP
from loragen.cuda.torch_dropout import dropped, keep_mask, rng_tensor
from loragen.cuda.torch_kernels import TorchKernels
from loragen.reference import lora_linear_reference
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
    keyword arguments in their declared order after the tensors, then the outputs of a function that
    returns them by reference: all must line up with the C++ parameter list."""
    from torch.cuda import jiterator

    source, kwargs, outputs = torch_dropout.JIT_FUNCTIONS[name]
    if outputs:
        fn = jiterator._create_multi_output_jit_fn(source, outputs, **kwargs)
    else:
        fn = jiterator._create_jit_fn(source, **kwargs)
    entry = {
        "keep_bits": "loragen_keep_bits",
        "keep": "loragen_keep",
        "apply": "loragen_apply_keep",
        "apply_pair": "loragen_apply_keep_pair",
    }[name]
    assert fn.kernel_name == entry
    assert fn.num_outputs == max(outputs, 1) and fn.return_by_ref == bool(outputs)
    signature = re.search(rf"{entry}\((.*?)\)\s*\{{", source, re.DOTALL)
    assert signature is not None
    params = [param.split() for param in signature.group(1).split(",")]
    tensors = {"keep_bits": 3, "keep": 3, "apply": 3, "apply_pair": 4}[name]
    names = [param[-1] for param in params]
    assert names[tensors : len(names) - outputs] == list(fn.kwargs_dict) == list(kwargs)
    assert all(param[0] == "T&" for param in params[len(params) - outputs :])  # the outputs, by reference
    assert source.lstrip().startswith("template <typename T>\n" + ("void" if outputs else "T"))


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
    """One forward + backward of the torch path (one composition with torch's autograd): without dropout
    49 dispatches (51 on the four passes, 86 before they ran over whole tensors and the padded rank); with
    dropout the Philox mask adds about 100 (six per round, and the constants made on the device from
    aranges: no host-to-device copy), made once in forward and reused by backward (on the passes: made in
    both, 255 in all). Before the vectorised formulation, a step dispatched 814 operations."""
    without = _training_step_dispatches(0.0)
    with_dropout = _training_step_dispatches(0.1)
    assert sum(without.values()) <= 52
    assert sum(with_dropout.values()) - sum(without.values()) <= 110
    # one int64 product per Philox round and one for the key schedule; one scaling per masked tensor
    # (x in forward, its gradient in backward)
    assert with_dropout["aten.mul.Tensor"] - without["aten.mul.Tensor"] <= 11 + 2


def test_a_jiterator_step_makes_no_constants_and_launches_one_kernel(monkeypatch):
    """On the jiterator branch (stand-ins that allocate and run nothing, as on a GPU) a step after the
    first makes no group numbers or flag table (views of the cached counter, the cached table) and calls
    one jiterator function: the keep bits in forward, looked up as x's bool keep-mask, which autograd keeps
    for backward. (Before: the keep bits and x masked in forward, the keep bits again and x and dh A masked
    together in backward, four calls; before that, four aranges and five jiterator calls per step.)"""
    from loragen._benchmarks.cuda_host import lora_step, null_jiterator

    step = lora_step(None, tokens=16, features=64, dropout=0.1, kind="torch path (GPU)")
    with null_jiterator():
        step()
        calls: collections.Counter[str] = collections.Counter()
        for name, function in list(torch_dropout._jit_functions.items()):

            def counted(*args, _name=name, _function=function, **kwargs):
                calls[_name] += 1
                return _function(*args, **kwargs)

            monkeypatch.setitem(torch_dropout._jit_functions, name, counted)
        with _Dispatches() as mode:
            step()
    assert calls == {"keep_bits": 1}
    assert not [op for op in mode.counts if "arange" in op or "full" in op]
    assert mode.counts["aten.embedding.default"] == 1  # the keep bits' rows of the flag table
    assert mode.counts["aten.unbind.int"] == 1  # seed and offset, read on the device


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


@pytest.mark.parametrize("fan_in_fan_out", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_torch_path_composition_matches_the_passes_and_the_reference(p, dtype, fan_in_fan_out):
    """The torch path as one composition (the default) against its four passes (``whole_op=False``) and the
    float64 reference with the kernels' Philox mask: output and every gradient, the base trainable too, for
    a 3-D x with a bias; the composition rounds the output once (base product in x's dtype, then bias and
    the rank-r term added in float32), as the passes do."""
    results = []
    for launcher in (TorchKernels(), TorchKernels(whole_op=False)):
        (x, w, b, a, bb), high = make_inputs(42, 40, 24, 5, dtype, seed=13, fan_in_fan_out=fan_in_fan_out)
        x3 = x.detach().view(6, 7, 40).requires_grad_()
        y = lora_linear_cuda(
            x3, w, b, a, bb, 0.75, p, True, fan_in_fan_out=fan_in_fan_out, seed=321, launcher=launcher
        )
        grad = torch.randn(6, 7, 24, generator=torch.Generator().manual_seed(2)).to(dtype)
        y.backward(grad)
        results.append([t.detach() for t in (y, x3.grad, w.grad, b.grad, a.grad, bb.grad)])
    keep = None if p == 0 else philox.dropout_keep_mask((42, 40), p, 321).double() / (1 - p)
    xr, wr, br, ar, bbr = high
    want = reference(xr, wr, br, ar, bbr, 0.75, keep, fan_in_fan_out)
    want.backward(grad.view(42, 24).double())
    bound = 1e-5 if dtype == torch.float32 else 1.5e-2
    for got, passes, expected in zip(
        results[0], results[1], (want, xr.grad, wr.grad, br.grad, ar.grad, bbr.grad)
    ):
        assert relative_error(got.reshape(expected.shape), expected) < bound
        assert relative_error(got.reshape(expected.shape), passes.reshape(expected.shape).double()) < bound


def test_torch_path_mask_made_in_spans_is_the_whole_mask(monkeypatch):
    """Past BLOCK_ELEMENTS the torch formulation makes the composition's mask in spans (bounding its int64
    temporaries): the same mask, so the same output and gradients, bit for bit."""

    def step() -> list[torch.Tensor]:
        (x, w, b, a, bb), _ = make_inputs(37, 24, 16, 4, torch.float32, seed=4)
        y = lora_linear_cuda(x, w, b, a, bb, 0.5, 0.4, True, seed=99, launcher=TorchKernels())
        y.square().sum().backward()
        return [y.detach(), x.grad, a.grad, bb.grad]

    whole = step()
    monkeypatch.setattr(torch_path, "BLOCK_ELEMENTS", 8 * 13)  # 9 spans, the last one partial
    for got, want in zip(step(), whole):
        assert torch.equal(got, want)


def test_torch_path_backward_can_be_differentiated_through_the_mask():
    """The torch path's mask is its own adjoint: a gradient of a gradient (here d/dA of ||grad_x||^2) goes
    through the same keep-mask, equal to the plain composition with that mask."""
    p, seed = 0.4, 77
    (x, w, b, a, bb), _ = make_inputs(16, 24, 12, 4, torch.float32, seed=3)
    grad = torch.randn(16, 12, generator=torch.Generator().manual_seed(4))
    keep = philox.dropout_keep_mask((16, 24), p, seed)

    def second_order(op, **kwargs):
        y = op(x, w, b, a, bb, 1.5, p, True, **kwargs)
        (gx,) = torch.autograd.grad(y, x, grad, create_graph=True)
        (ga,) = torch.autograd.grad(gx.square().sum(), a)
        return gx.detach(), ga

    got = second_order(lora_linear_cuda, seed=seed, launcher=TorchKernels())
    want = second_order(lora_linear_reference, keep=keep)
    for g, expected in zip(got, want):
        torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("spec", [LORA_DOWN, LORA_UP, LORA_GRAD_OUT, LORA_GRAD_IN], ids=lambda s: s.name)
def test_each_torch_kernel_takes_its_kernels_arguments_in_order(spec):
    """The torch path reads a launch's arguments by position: its functions name them as the kernel does."""
    assert list(inspect.signature(torch_kernels.KERNELS[spec.name]).parameters) == [
        p.name for p in spec.params
    ]


@pytest.mark.parametrize("cols", [24, 21])
def test_row_blocks_give_the_whole_tensor_results(monkeypatch, cols):
    """Past BLOCK_ELEMENTS the torch path works in row blocks (8-row multiples, so every block starts on a
    Philox group): the same masks, and results equal up to float32 summation order."""

    def step() -> list[torch.Tensor]:
        (x, w, b, a, bb), _ = make_inputs(37, cols, 16, 4, torch.float32, seed=4)
        y = lora_linear_cuda(x, w, b, a, bb, 0.5, 0.4, True, seed=99, launcher=TorchKernels(whole_op=False))
        y.square().sum().backward()
        return [y.detach(), x.grad, a.grad, bb.grad]

    whole = step()
    monkeypatch.setattr(torch_kernels, "BLOCK_ELEMENTS", 8 * cols)  # blocks of 8 rows: 5 blocks
    assert len(torch_kernels._row_blocks(37, cols)) == 5
    blocked = step()
    for got, want in zip(blocked, whole):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(blocked[1] == 0, whole[1] == 0)  # grad_x: the same dropped elements


class _EmulatedJiterator:
    """CPU stand-ins for the jiterator functions that compute what their CUDA sources compute, from
    loragen.philox (not from the torch formulation): the torch path's wiring of the jiterator branch --
    argument order, shapes, group and element numbers, lanes -- checked on the CPU."""

    @staticmethod
    def _keep(
        elements: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor, threshold: int
    ) -> torch.Tensor:
        """Keep flags (int64 0/1) of the flat mask elements ``elements``, by loragen.philox's layout."""
        s, o = (int(t) & (2**64 - 1) for t in (seed, offset))
        flat = elements.reshape(-1)
        groups = flat // 8
        counter = torch.stack(
            [
                groups & 0xFFFFFFFF,
                groups >> 32,
                torch.full_like(groups, o & 0xFFFFFFFF),
                torch.full_like(groups, o >> 32),
            ],
            dim=-1,
        )
        words = philox.philox4x32_10(counter, (s & 0xFFFFFFFF, s >> 32))  # (n, 4)
        lane = flat % 8
        bits = (words.gather(1, (lane // 2).unsqueeze(1)).squeeze(1) >> (16 * (lane % 2))) & 0xFFFF
        return (bits >= threshold).to(torch.int64).view(elements.shape)

    def keep_bits(self, group, seed, offset, *, first_group, threshold):
        assert group.dtype == seed.dtype == offset.dtype == torch.int64 and seed.dim() == offset.dim() == 0
        elements = (first_group + group).unsqueeze(-1) * 8 + torch.arange(8)
        flags = self._keep(elements, seed, offset, threshold)
        return (flags << torch.arange(8)).sum(-1)

    def keep(self, element, seed, offset, *, start, threshold):
        assert element.dtype == seed.dtype == offset.dtype == torch.int64 and seed.dim() == offset.dim() == 0
        return self._keep(start + element, seed, offset, threshold)

    @staticmethod
    def apply(values, bits, lanes, *, keep_scale):
        assert lanes.dtype == torch.float32  # what makes jiterator's common dtype float32
        kept = (bits.to(torch.int64) >> lanes.to(torch.int64)) & 1
        return torch.where(kept.bool(), values.float() * keep_scale, 0.0)

    def apply_pair(self, first, second, bits, lanes, *, keep_scale):
        assert first.shape == second.shape
        return self.apply(first, bits, lanes, keep_scale=keep_scale), self.apply(
            second, bits, lanes, keep_scale=keep_scale
        )


@pytest.mark.parametrize(
    ("rows", "cols", "start"), [(1, 8, 0), (37, 45, 3), (30, 40, 40 * 7), (5, 7, 2**36 + 5), (6, 16, 2**36)]
)
def test_jiterator_branch_draws_the_philox_mask(monkeypatch, rows, cols, start):
    emulated = _EmulatedJiterator()
    monkeypatch.setattr(torch_dropout, "JIT_DEVICE_TYPES", frozenset({"cpu"}))
    monkeypatch.setattr(
        torch_dropout,
        "_jit_functions",
        {
            "keep_bits": emulated.keep_bits,
            "keep": emulated.keep,
            "apply": emulated.apply,
            "apply_pair": emulated.apply_pair,
        },
    )
    seed, offset, p = 2**64 - 17, 2**33 + 1, 0.3
    threshold, scale = philox.keep_threshold(p), philox.keep_scale(p)
    keep = keep_mask(start, rows * cols, threshold, seed, offset, CPU).view(rows, cols)
    drop = torch_dropout.BlockDropout(rng_tensor(seed, offset, CPU), start, threshold, scale)
    for dtype in (torch.bfloat16, torch.float32):  # the keep bits are made once and serve both
        values = torch.randn(rows, cols).to(dtype)
        got = drop(values)
        assert got.dtype == torch.float32 and torch.equal(got, torch.where(keep, values.float() * scale, 0.0))
    assert torch_dropout.jiterator_status() == "ok"


def _emulated_functions(calls: collections.Counter[str]) -> dict[str, object]:
    """The emulated jiterator functions, each call counted by name in ``calls``."""
    emulated = _EmulatedJiterator()

    def counted(name: str):
        function = getattr(emulated, name)

        def call(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return call

    return {name: counted(name) for name in torch_dropout.JIT_FUNCTIONS}


@pytest.mark.parametrize(
    ("rows", "cols", "block_rows", "grouped", "per_element"),
    [(37, 24, None, 1, 0), (37, 24, 8, 5, 0), (9, 21, None, 0, 1), (10, 21, 8, 1, 1)],
)
def test_jiterator_branch_step_on_the_passes_equals_the_torch_formulation_step(
    monkeypatch, rows, cols, block_rows, grouped, per_element
):
    """A whole forward + backward of the torch path's four passes (``TorchKernels(whole_op=False)``, what
    the self-check compares the kernels with) on the jiterator branch (functions emulated from
    loragen.philox) gives exactly the torch formulation's output and gradients: the wiring of the keep bits,
    the apply kernel in forward and the pair kernel in backward. Per row block: one Philox kernel and one
    apply in forward, one Philox kernel and one pair kernel in backward; the Philox kernel per group of 8
    (``grouped`` blocks) or, for a block whose size or start is not a multiple of 8, per element."""

    def step() -> list[torch.Tensor]:
        (x, w, b, a, bb), _ = make_inputs(rows, cols, 16, 4, torch.bfloat16, seed=5)
        launcher = TorchKernels(whole_op=False)
        y = lora_linear_cuda(x, w, b, a, bb, 0.5, 0.4, True, seed=2**64 - 9, launcher=launcher)
        y.float().square().sum().backward()
        return [y.detach(), x.grad, a.grad, bb.grad]

    if block_rows is not None:  # row blocks of 8 rows, each its own span of the mask
        monkeypatch.setattr(torch_kernels, "BLOCK_ELEMENTS", block_rows * cols)
    want = step()
    calls: collections.Counter[str] = collections.Counter()
    monkeypatch.setattr(torch_dropout, "JIT_DEVICE_TYPES", frozenset({"cpu"}))
    monkeypatch.setattr(torch_dropout, "_jit_functions", _emulated_functions(calls))
    got = step()
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    blocks = grouped + per_element
    want_calls = {"keep_bits": 2 * grouped, "keep": 2 * per_element, "apply": blocks, "apply_pair": blocks}
    assert calls == collections.Counter({name: n for name, n in want_calls.items() if n})
    assert torch_dropout.jiterator_status() == "ok"


@pytest.mark.parametrize(("shape", "philox"), [((37, 24), "keep_bits"), ((3, 3, 7), "keep")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_jiterator_branch_step_equals_the_torch_formulation_step(monkeypatch, shape, philox, dtype):
    """The torch path as one composition (the default ``TorchKernels()``) on the jiterator branch
    (functions emulated from loragen.philox): exactly the torch formulation's output and gradients, with one
    Philox kernel (per group of 8, or per element for an element count off 8) in forward and its mask kept
    by autograd for backward; and the same output and gradients as the four passes, up to float32
    rounding."""

    def step(launcher: TorchKernels) -> list[torch.Tensor]:
        (x, w, b, a, bb), _ = make_inputs(math.prod(shape[:-1]), shape[-1], 16, 4, dtype, seed=5)
        x3 = x.detach().view(shape).requires_grad_()
        y = lora_linear_cuda(x3, w, b, a, bb, 0.5, 0.4, True, seed=2**64 - 9, launcher=launcher)
        y.float().square().sum().backward()
        return [y.detach(), x3.grad, a.grad, bb.grad]

    want = step(TorchKernels())
    passes = step(TorchKernels(whole_op=False))
    calls: collections.Counter[str] = collections.Counter()
    monkeypatch.setattr(torch_dropout, "JIT_DEVICE_TYPES", frozenset({"cpu"}))
    monkeypatch.setattr(torch_dropout, "_jit_functions", _emulated_functions(calls))
    got = step(TorchKernels())
    for g, w, p in zip(got, want, passes):
        assert torch.equal(g, w)
        tolerance = 1e-5 if dtype == torch.float32 else 1.6e-2
        torch.testing.assert_close(
            g.float(), p.float(), rtol=tolerance, atol=tolerance * p.abs().max().item()
        )
    assert calls == {philox: 1}
    assert torch_dropout.jiterator_status() == "ok"


def test_group_numbers_are_views_of_one_counter_per_device_and_stream(monkeypatch):
    monkeypatch.setattr(torch_dropout, "_counters", {})
    monkeypatch.setattr(torch_dropout, "_group_views", {})
    groups, lanes = torch_dropout.group_numbers(CPU, 5)
    assert groups.shape == (5, 1) and groups.dtype == torch.int64
    assert torch.equal(groups.view(-1), torch.arange(5))
    assert lanes.dtype == torch.float32 and torch.equal(lanes, torch.arange(8, dtype=torch.float32))
    # one counter of the smallest size serves every count up to it: views, no new tensor
    entry = torch_dropout._counters[(CPU, 0)]
    assert entry.counter.numel() == torch_dropout._MIN_GROUPS
    again, same_lanes = torch_dropout.group_numbers(CPU, 5)
    assert again is groups and same_lanes is lanes  # cached: no operation at all
    other, _ = torch_dropout.group_numbers(CPU, 300)
    assert other.data_ptr() == groups.data_ptr() == entry.counter.data_ptr()
    assert torch.equal(other.view(-1), torch.arange(300))
    # past it: the counter doubles to the next power of two, the old one is kept (a captured graph may read it)
    old = entry.counter
    big, big_lanes = torch_dropout.group_numbers(CPU, torch_dropout._MIN_GROUPS * 3 + 1)
    assert entry.counter.numel() == torch_dropout._MIN_GROUPS * 4 and entry.retired == [old]
    assert torch.equal(big.view(-1), torch.arange(torch_dropout._MIN_GROUPS * 3 + 1))
    assert big_lanes is lanes
    # each device its own
    meta, meta_lanes = torch_dropout.group_numbers(torch.device("meta"), 5)
    assert meta.device.type == "meta" and meta_lanes.device.type == "meta"
    assert set(torch_dropout._counters) == {(CPU, 0), (torch.device("meta"), 0)}


def test_group_numbers_view_cache_starts_over_when_full(monkeypatch):
    monkeypatch.setattr(torch_dropout, "_counters", {})
    monkeypatch.setattr(torch_dropout, "_group_views", {})
    monkeypatch.setattr(torch_dropout, "_MAX_VIEWS", 4)
    for count in range(1, 10):
        groups, _ = torch_dropout.group_numbers(CPU, count)
        assert torch.equal(groups.view(-1), torch.arange(count))
        assert len(torch_dropout._group_views) <= 4
    assert len(torch_dropout._counters) == 1  # the views go, the counter stays


def test_group_numbers_inside_a_capture_make_nothing_for_the_cache(monkeypatch):
    """A tensor made inside a CUDA-graph capture holds its values only once the graph replays: a capture
    that finds no counter big enough gets tensors of its own, cached nowhere; one made before the capture
    serves it."""
    monkeypatch.setattr(torch_dropout, "_counters", {})
    monkeypatch.setattr(torch_dropout, "_group_views", {})
    monkeypatch.setattr(streams, "capturing", lambda device: True)
    groups, lanes = torch_dropout.group_numbers(CPU, 7)
    assert torch.equal(groups.view(-1), torch.arange(7)) and torch.equal(lanes, torch.arange(8.0))
    assert torch_dropout._counters == {} and torch_dropout._group_views == {}
    monkeypatch.setattr(streams, "capturing", lambda device: False)
    before, before_lanes = torch_dropout.group_numbers(CPU, 7)  # made outside the capture
    monkeypatch.setattr(streams, "capturing", lambda device: True)
    inside, inside_lanes = torch_dropout.group_numbers(CPU, 9)
    assert inside.data_ptr() == before.data_ptr() and inside_lanes is before_lanes
    huge, _ = torch_dropout.group_numbers(CPU, torch_dropout._MIN_GROUPS + 1)  # would need a bigger counter
    assert huge.data_ptr() != before.data_ptr()
    assert torch_dropout._counters[(CPU, 0)].counter.numel() == torch_dropout._MIN_GROUPS
    assert torch_dropout._counters[(CPU, 0)].retired == []


# ---- the jiterator sources, built on the host with g++ -------------------------------------------------
# Each source is the C++ function torch's jiterator inlines into its elementwise kernel, called per element
# with the inputs converted to the common dtype (int64 for the Philox kernels, float32 for the apply
# kernels) and the keyword arguments as int64 / double. The only CUDA intrinsic they use is __umulhi.
_JIT_HARNESS = r"""
#include <cstdint>
static inline unsigned __umulhi(unsigned a, unsigned b) {
    return static_cast<unsigned>((static_cast<unsigned long long>(a) * b) >> 32);
}
SOURCES
extern "C" void keep_bits(const int64_t* group, int64_t n, int64_t seed, int64_t offset, int64_t first_group,
                          int64_t threshold, int64_t* out) {
    for (int64_t i = 0; i < n; ++i) out[i] = loragen_keep_bits<int64_t>(group[i], seed, offset, first_group, threshold);
}
extern "C" void keep(const int64_t* element, int64_t n, int64_t seed, int64_t offset, int64_t start,
                     int64_t threshold, int64_t* out) {
    for (int64_t i = 0; i < n; ++i) out[i] = loragen_keep<int64_t>(element[i], seed, offset, start, threshold);
}
extern "C" void apply(const float* value, const float* bits, const float* lane, int64_t n, double keep_scale,
                      float* out) {
    for (int64_t i = 0; i < n; ++i) out[i] = loragen_apply_keep<float>(value[i], bits[i], lane[i], keep_scale);
}
extern "C" void apply_pair(const float* first, const float* second, const float* bits, const float* lane,
                           int64_t n, double keep_scale, float* first_out, float* second_out) {
    for (int64_t i = 0; i < n; ++i)
        loragen_apply_keep_pair<float>(first[i], second[i], bits[i], lane[i], keep_scale, first_out[i], second_out[i]);
}
"""


@pytest.fixture(scope="module")
def jit_sources_on_host(tmp_path_factory) -> ctypes.CDLL:
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("g++ is needed to build the jiterator sources on the host")
    sources = "".join(source for source, _, _ in torch_dropout.JIT_FUNCTIONS.values())
    work = tmp_path_factory.mktemp("jiterator_sources")
    (work / "harness.cpp").write_text(_JIT_HARNESS.replace("SOURCES", sources))
    subprocess.run(
        [
            cxx,
            "-std=c++17",
            "-O1",
            "-Wall",
            "-Werror",
            "-shared",
            "-fPIC",
            str(work / "harness.cpp"),
            "-o",
            str(work / "harness.so"),
        ],
        check=True,
        capture_output=True,
    )
    return ctypes.CDLL(str(work / "harness.so"))


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def _i64(value: int) -> ctypes.c_int64:
    """An unsigned 64-bit value as the int64 bits the kernels receive."""
    return ctypes.c_int64(value - 2**64 if value >= 2**63 else value)


@settings(max_examples=25, deadline=None)
@given(first=st.integers(0, 2**40), p=st.floats(0.01, 0.95), seed=u64, offset=u64)
def test_jiterator_philox_sources_draw_the_philox_mask(jit_sources_on_host, first, p, seed, offset):
    """KEEP_BITS_SOURCE and KEEP_SOURCE, compiled as C++, against loragen.philox's mask: group bits and
    per-element flags, at counters past 2**32 groups and for seeds and offsets with the top bit set."""
    threshold = philox.keep_threshold(p)
    groups = torch.arange(40, dtype=torch.int64)
    bits = torch.empty(40, dtype=torch.int64)
    jit_sources_on_host.keep_bits(
        _ptr(groups),
        ctypes.c_int64(40),
        _i64(seed),
        _i64(offset),
        ctypes.c_int64(first),
        ctypes.c_int64(threshold),
        _ptr(bits),
    )
    keep = keep_mask(8 * first, 8 * 40, threshold, seed, offset, CPU).view(40, 8).to(torch.int64)
    assert torch.equal(bits, (keep << torch.arange(8)).sum(1))
    start = 8 * first + 3  # mid-group
    elements = torch.arange(45, dtype=torch.int64)
    flags = torch.empty(45, dtype=torch.int64)
    jit_sources_on_host.keep(
        _ptr(elements),
        ctypes.c_int64(45),
        _i64(seed),
        _i64(offset),
        ctypes.c_int64(start),
        ctypes.c_int64(threshold),
        _ptr(flags),
    )
    assert torch.equal(flags, keep_mask(start, 45, threshold, seed, offset, CPU).to(torch.int64))


def test_jiterator_apply_sources_mask_and_scale(jit_sources_on_host):
    """APPLY_SOURCE and APPLY_PAIR_SOURCE, compiled as C++: bit ``lane`` of the group's bits keeps an element
    (times keep_scale, rounded to float32 as torch's float32 product is) or drops it; the pair kernel applies
    one bit to both of its inputs, exactly as two applies would."""
    n = 64 * 8
    gen = torch.Generator().manual_seed(1)
    first, second = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e3
    bits = torch.randint(0, 256, (n // 8,), generator=gen).repeat_interleave(8).float()
    lanes = torch.arange(8, dtype=torch.float32).repeat(n // 8)
    scale = philox.keep_scale(0.3)
    kept = ((bits.long() >> lanes.long()) & 1).bool()
    out, pair_first, pair_second = (torch.empty(n) for _ in range(3))
    jit_sources_on_host.apply(
        _ptr(first), _ptr(bits), _ptr(lanes), ctypes.c_int64(n), ctypes.c_double(scale), _ptr(out)
    )
    jit_sources_on_host.apply_pair(
        _ptr(first),
        _ptr(second),
        _ptr(bits),
        _ptr(lanes),
        ctypes.c_int64(n),
        ctypes.c_double(scale),
        _ptr(pair_first),
        _ptr(pair_second),
    )
    assert torch.equal(out, torch.where(kept, first * scale, 0.0))
    assert torch.equal(pair_first, out)
    assert torch.equal(pair_second, torch.where(kept, second * scale, 0.0))
    assert 0 < int(kept.sum()) < n


# each source called as jiterator's kernel calls it: per element, keyword arguments as int64 / double,
# outputs by reference for the pair
_JIT_DEVICE_WRAPPERS = r"""
extern "C" __global__ void keep_bits(const long long* g, const long long* s, const long long* o, long long first,
                                     long long threshold, long long* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = loragen_keep_bits<long long>(g[i], *s, *o, first, threshold);
}
extern "C" __global__ void keep(const long long* e, const long long* s, const long long* o, long long start,
                                long long threshold, long long* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = loragen_keep<long long>(e[i], *s, *o, start, threshold);
}
extern "C" __global__ void apply(const float* v, const float* b, const float* l, double scale, float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = loragen_apply_keep<float>(v[i], b[i / 8], l[i % 8], scale);
}
extern "C" __global__ void apply_pair(const float* v, const float* w, const float* b, const float* l, double scale,
                                      float* first, float* second, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) loragen_apply_keep_pair<float>(v[i], w[i], b[i / 8], l[i % 8], scale, first[i], second[i]);
}
"""


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_jiterator_sources_compile_with_nvrtc(nvrtc_available, arch):
    """The jiterator sources as NVRTC compiles them (jiterator's options: C++17, unannotated functions
    compiled for the device), each called as jiterator calls it: they compile, and use no local memory."""
    from cuda.bindings import nvrtc

    from loragen.cuda.nvrtc import parse_ptxas_log

    source = "".join(text for text, _, _ in torch_dropout.JIT_FUNCTIONS.values()) + _JIT_DEVICE_WRAPPERS
    _, program = nvrtc.nvrtcCreateProgram(source.encode(), b"jiterator_sources.cu", 0, [], [])
    options = [
        b"--std=c++17",
        b"-default-device",
        f"--gpu-architecture={arch}".encode(),
        b"--ptxas-options=-v",
    ]
    try:
        (status,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
        _, size = nvrtc.nvrtcGetProgramLogSize(program)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(program, log)
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    text = log.rstrip(b"\x00").decode(errors="replace")
    assert status == nvrtc.nvrtcResult.NVRTC_SUCCESS, text
    resources = parse_ptxas_log(text)
    assert set(resources) == {"keep_bits", "keep", "apply", "apply_pair"}
    for name, used in resources.items():
        assert used.stack_frame_bytes == used.spill_store_bytes == 0, (name, used)
