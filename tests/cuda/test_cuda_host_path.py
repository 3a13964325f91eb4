"""The CUDA op's host path on the CPU: counted work under ceilings (null driver), what is cached between
calls, the custom ops' fake implementations and schemas, and torch.compile without graph breaks.

The kernels' launches go to a null driver (benchmarks/cuda_host.py) or to the torch path
(:class:`loragen.cuda.selfcheck.TorchKernels`, which computes what each kernel computes), so all of
this runs without a GPU.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from loragen import philox
from loragen._benchmarks.cuda_host import (
    KINDS,
    NullLauncher,
    SyncRecorder,
    count_host_work,
    count_syncs,
    counts_table,
    host_counts,
    lora_step,
)
from loragen.cuda import kernels as kern
from loragen.cuda import launch, linear_op
from loragen.cuda.linear_op import CudaLoraError, draw_rng, launcher_handle, lora_linear_cuda, seed_rng
from loragen.cuda.selfcheck import TorchKernels, rng_values
from loragen.reference import lora_linear_reference
from tests.cuda.raw_writes import RawWriteSGD

# Ceilings per forward + backward (64 tokens, 1024 -> 1024, r=16, dropout 0.05), Python calls / C calls /
# torch ops / allocations, torch 2.13, plus a margin. The kernel path (null driver): 97 / 123 / 39 / 9 for
# float32 and bfloat16 x (96 / 123 before the forward asked once whether a CUDA graph is being captured,
# which on a GPU its two factor lookups asked each), about 30 of those Python calls torch's own
# (autograd.Function.apply and backward: shape comparisons, generator expressions, a logging level read),
# whose number moves by a few
# with torch's version and its internal caches, hence the Python calls' margin (92 / 119 / 39 / 9 on an
# earlier torch; before grids kept in the plan, the forward's plan, factors and 2-D x handed to
# backward, no-op casts skipped and the parameter block packed in one call: 139 / 185 / 45 / 9 and
# 139 / 179 / 45 / 9; before the cached host path: 170 / 355 / 65 / 12 and 168 / 359 / 76 / 15).
CEILINGS = {
    torch.float32: {"python_calls": 100, "c_calls": 125, "torch_ops": 41, "allocations": 10},
    torch.bfloat16: {"python_calls": 100, "c_calls": 125, "torch_ops": 41, "allocations": 10},
}
# The torch route (the reference composition with torch's autograd, the kernels' Philox mask made from
# torch operations), torch 2.13: 59 / 58 / 449 / 236 (float32 x) and 59 / 58 / 471 / 241 (bfloat16 x)
# with dropout, 33 / 42 / 86 / 14 and 33 / 42 / 108 / 19 without. The mask costs about 360 torch ops (ten
# Philox rounds on int64 words) and no Python beyond its one call.
TORCH_PATH_CEILINGS = {
    (torch.float32, 0.05): {"python_calls": 62, "c_calls": 61, "torch_ops": 460, "allocations": 245},
    (torch.bfloat16, 0.05): {"python_calls": 62, "c_calls": 61, "torch_ops": 485, "allocations": 250},
    (torch.float32, 0.0): {"python_calls": 36, "c_calls": 45, "torch_ops": 90, "allocations": 16},
    (torch.bfloat16, 0.0): {"python_calls": 36, "c_calls": 45, "torch_ops": 112, "allocations": 21},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_work_per_step_stays_under_its_ceilings(dtype):
    launcher = NullLauncher()
    counts = count_host_work(lora_step(launcher, dtype=dtype), launcher)
    print(f"\n{dtype}: {counts}")
    assert counts.launches == 4
    for name, ceiling in CEILINGS[dtype].items():
        assert getattr(counts, name) <= ceiling, (name, counts)


@pytest.mark.parametrize("dropout", [0.05, 0.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_host_work_stays_under_its_ceilings(dtype, dropout):
    counts = count_host_work(lora_step(None, dtype=dtype, dropout=dropout, kind="torch path"))
    print(f"\n{dtype}, dropout {dropout}: {counts}")
    for name, ceiling in TORCH_PATH_CEILINGS[(dtype, dropout)].items():
        assert getattr(counts, name) <= ceiling, (name, counts)


@pytest.mark.parametrize("seed", [None, 2**64 - 5])
@pytest.mark.parametrize("path", ["kernels", "torch path"])
def test_no_step_waits_for_the_device(path, seed):
    """No read of a device value and no host <-> device copy in a forward + backward, on the kernel path
    or on either form of the torch path, with a drawn or an explicit seed: at batch 1 each would stall the
    launch queue, and none is allowed in CUDA-graph capture. (Before the torch path read seed and offset on
    the device it had four per step -- ``rng.tolist()`` in forward and backward, and the Philox constants
    copied to the device --, and an explicit seed was copied to the device on every call.)"""
    launcher = NullLauncher() if path == "kernels" else TorchKernels()
    for dtype in (torch.float32, torch.bfloat16):
        syncs = count_syncs(launcher, dtype=dtype, seed=seed)
        assert syncs == []


def test_the_sync_recorder_sees_each_kind_of_wait():
    """What :func:`count_syncs` relies on: on a non-CPU tensor each of these is seen, with its reason."""
    recorder = SyncRecorder()
    t = torch.ones(2, dtype=torch.int64, device="meta")
    with recorder.watching():
        assert t.tolist() == [0, 0]
        t[0].item()
        bool(t[0])
        t.cpu()
        torch.tensor([1, 2], device="meta")
        torch.as_tensor([3], device="meta")
        torch.cuda.synchronize()
        torch.as_tensor(t)  # no copy: not a sync
        t.to(torch.int32)  # on the device: not a sync
    reasons = [entry.split(" at ")[0] for entry in recorder.syncs]
    assert reasons == [
        "_to_copy (host <-> device copy)",  # tolist copies the tensor to the host
        "_local_scalar_dense",
        "_local_scalar_dense",
        "_to_copy (host <-> device copy)",
        "torch.tensor (host -> device copy)",
        "torch.as_tensor (host -> device copy)",
        "torch.cuda.synchronize",
    ]


def test_null_driver_sees_the_four_passes_and_the_table_prints_them():
    launcher = NullLauncher()
    lora_step(launcher)()
    assert [name for name, _, _ in launcher.launches] == [
        "lora_down",
        "lora_up",
        "lora_grad_out",
        "lora_grad_in",
    ]
    assert launcher.launches[1][1] == "float32-r16-aligned"  # lora_up's float32 variant
    results = host_counts()
    assert results["loragen"].syncs == results["torch path"].syncs == 0
    assert results["composition"].syncs is None
    table = counts_table(results)
    assert table.splitlines()[0].startswith("| variant | Python calls")
    assert [line.split(" | ")[0] for line in table.splitlines()[2:]] == [f"| {kind}" for kind in KINDS]


class RoutingLauncher(TorchKernels):
    """The torch path, counting how often the op asks which launcher runs a variant."""

    def __init__(self) -> None:
        self.routes = 0

    def route(self, variant: kern.Variant, device: torch.device) -> TorchKernels:
        self.routes += 1
        return self


def _inputs(dtype=torch.float32, n=12, k=24, o=16, r=5, bias=True):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, n // 2, k, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(o, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(o, generator=gen).to(dtype) if bias else None
    a = (torch.randn(r, k, generator=gen) / k**0.5).requires_grad_()
    bb = torch.randn(o, r, generator=gen).requires_grad_()
    return x, w, b, a, bb


class CountingTorchKernels(TorchKernels):
    """The torch path, counting the passes launched on it."""

    def __init__(self, whole_op: bool = True) -> None:
        super().__init__(whole_op)
        self.launches = 0

    def launch(self, spec, variant, grid, args, device) -> None:
        self.launches += 1
        super().launch(spec, variant, grid, args, device)


@pytest.mark.parametrize("how", ["failed self-check", "switch", "launcher passed in"])
def test_the_torch_path_runs_as_one_composition(monkeypatch, how):
    """However a call gets to the torch path -- its variant failed the self-check (here: kernels that
    compute nothing), ``LORAGEN_CUDA_KERNELS=torch``, or a ``TorchKernels`` launcher passed in -- the eager
    op runs the reference composition (no pass is launched) and gives its result;
    ``TorchKernels(whole_op=False)`` keeps the passes."""
    from loragen import switches
    from loragen.cuda import selfcheck

    composed = []
    real = linear_op.lora_linear_reference
    monkeypatch.setattr(
        linear_op, "lora_linear_reference", lambda *args, **kw: composed.append(1) or real(*args, **kw)
    )
    torch_kernels = CountingTorchKernels()
    if how == "launcher passed in":
        launcher = torch_kernels
    else:
        launcher = selfcheck.CheckedLauncher(NullLauncher(), torch_kernels, isolate=False)
    x, w, b, a, bb = _inputs()
    with switches.cuda_kernels.using("torch" if how == "switch" else "check"):
        with pytest.warns(RuntimeWarning) if how == "failed self-check" else contextlib.nullcontext():
            lora_linear_cuda(x, w, b, a, bb, 1.5, 0.0, True, launcher=launcher)  # routed (and checked)
        checked = torch_kernels.launches  # the self-check's reference passes
        y = lora_linear_cuda(x, w, b, a, bb, 1.5, 0.0, True, launcher=launcher)
        y.sum().backward()
    assert torch_kernels.launches == checked and len(composed) == 2
    torch.testing.assert_close(y, lora_linear_reference(x, w, b, a, bb, 1.5, 0.0, False))
    passes = CountingTorchKernels(whole_op=False)
    lora_linear_cuda(x, w, b, a, bb, 1.5, 0.0, True, launcher=passes).sum().backward()
    assert passes.launches == 4 and len(composed) == 2


def test_plan_is_routed_once_per_shape_and_factors_refresh_only_when_the_parameter_changes():
    launcher = RoutingLauncher()
    x, w, b, a, bb = _inputs()
    for _ in range(3):
        lora_linear_cuda(x, w, b, a, bb, 1.5, 0.0, True, launcher=launcher).sum().backward()
    assert launcher.routes == 1  # forward and backward of three steps share one plan

    plan = linear_op.plan_for(x.reshape(-1, 24), 16, 5, launcher_handle(launcher))
    first = linear_op.factor(a, plan, False, False)
    assert linear_op.factor(a, plan, False, False) is first  # one buffer per parameter
    assert torch.equal(first[:5], a.detach()) and not first[5:].any()  # padded to the rank bucket
    with torch.no_grad():
        a.mul_(2)  # an optimizer step: _version changes
    refreshed = linear_op.factor(a, plan, False, False)
    assert refreshed is first and torch.equal(refreshed[:5], a.detach())
    bt = linear_op.factor(bb, plan, True, False)
    assert bt.shape == (8, 16) and torch.equal(bt[:5], bb.detach().t())
    # the result follows the change too
    want = lora_linear_reference(x, w, b, a, bb, 1.5, 0.0, False)
    got = lora_linear_cuda(x, w, b, a, bb, 1.5, 0.0, True, launcher=launcher)
    torch.testing.assert_close(got, want)


def test_the_plan_table_stays_bounded_over_ever_new_sequence_lengths(monkeypatch):
    monkeypatch.setattr(linear_op, "MAX_PLANS", 3)
    monkeypatch.setattr(linear_op, "_plans", {})
    launcher = TorchKernels(whole_op=False)
    _x, w, b, a, bb = _inputs()
    for rows in range(1, 9):
        x = torch.randn(rows, 24)
        got = lora_linear_cuda(x, w, b, a, bb, 1.5, 0.0, True, launcher=launcher)
        torch.testing.assert_close(got, lora_linear_reference(x, w, b, a, bb, 1.5, 0.0, False))
        assert len(linear_op._plans) <= 3


@pytest.mark.parametrize(("k", "o"), [(0, 8), (8, 0)], ids=["no-in-features", "no-out-features"])
def test_a_layer_without_features_takes_the_composition(k, o):
    x = torch.randn(4, k, requires_grad=True)
    w = torch.randn(o, k, requires_grad=True)
    a = torch.randn(2, k, requires_grad=True)
    bb = torch.randn(o, 2, requires_grad=True)
    y = lora_linear_cuda(x, w, None, a, bb, 2.0, 0.0, True, launcher=TorchKernels(whole_op=False))
    assert y.shape == (4, o)
    y.sum().backward()
    assert x.grad.shape == x.shape and a.grad.shape == a.shape and bb.grad.shape == bb.shape


def test_a_float32_factor_at_the_bucket_rank_is_used_without_a_copy():
    x, _w, _b, _, _ = _inputs()
    a = torch.randn(8, 24)  # r = 8 is its own bucket
    plan = linear_op.plan_for(x.detach().reshape(-1, 24), 16, 8, launcher_handle(TorchKernels()))
    assert linear_op.factor(a, plan, False, False).data_ptr() == a.data_ptr()


def test_factor_cache_entry_goes_with_its_parameter():
    x, _w, _b, a, _bb = _inputs()
    plan = linear_op.plan_for(x.detach().reshape(-1, 24), 16, 5, launcher_handle(TorchKernels()))
    linear_op.factor(a, plan, False, False)
    key = (id(a), False)
    assert key in linear_op._factors
    del a
    assert key not in linear_op._factors


def test_a_factor_a_capture_has_read_is_copied_on_every_call_after_it(monkeypatch):
    """A CUDA graph's replay changes parameters in place without moving their version counters (a captured
    optimizer step), so once a capture has read a factor every call copies it again: an eager call after
    replays computes with the values the replays left. (Changes through ``.data`` stand in for a replay's:
    they do not move the version counter either.)"""
    launcher = TorchKernels(whole_op=False)  # the four passes, through the cached factors
    x, w, b, a, bb = _inputs()
    lora_linear_cuda(x, w, b, a, bb, 1.5, 0.0, True, launcher=launcher)  # cached outside any capture
    monkeypatch.setattr(launch, "capturing", lambda device: True)
    lora_linear_cuda(x, w, b, a, bb, 1.5, 0.0, True, launcher=launcher)
    monkeypatch.setattr(launch, "capturing", lambda device: False)
    for step in range(2):
        versions = a._version, bb._version
        a.data.mul_(-2.0)
        bb.data.add_(1.0)
        assert (a._version, bb._version) == versions
        got = lora_linear_cuda(x, w, b, a, bb, 1.5, 0.0, True, launcher=launcher)
        torch.testing.assert_close(got, lora_linear_reference(x, w, b, a, bb, 1.5, 0.0, False), msg=str(step))


def test_a_factor_buffer_made_inside_a_capture_is_zeroed_until_a_call_outside_one_does_it():
    """Work queued inside a CUDA-graph capture runs only when the graph replays, so a factor buffer first
    made there has no zeros yet; each call inside a capture queues the zeroing again (a graph may replay
    alone), and the first call outside one writes it. (Inside a real capture the fill does not run; NaN
    stands in for what the buffer holds then.)"""
    x, _w, _b, _a, bb = _inputs()
    plan = linear_op.plan_for(x.detach().reshape(-1, 24), 16, 5, launcher_handle(TorchKernels()))
    buffer = linear_op.factor(bb, plan, True, in_capture=True)
    entry = linear_op._factors[(id(bb), True)]
    assert buffer.shape == (8, 16) and not entry.zeroed and entry.captured
    buffer[5:] = float("nan")
    assert linear_op.factor(bb, plan, True, in_capture=True) is buffer
    assert not buffer[5:].any() and not entry.zeroed
    buffer[5:] = float("nan")
    assert linear_op.factor(bb, plan, True, in_capture=False) is buffer
    assert entry.zeroed and not buffer[5:].any() and torch.equal(buffer[:5], bb.detach().t())


def test_factors_are_copied_again_after_an_optimizer_step_that_keeps_version_counters():
    """Judged against float64 with a float32 budget (any BLAS's summation order passes), and each step
    moves the output by far more than that budget, so a call that read the previous step's cached
    factors fails."""
    launcher = TorchKernels(whole_op=False)  # the four passes, through the cached factors
    x, w, b, a, bb = _inputs()
    optimizer = RawWriteSGD([a, bb])

    def exact() -> torch.Tensor:
        args = (t.detach().double() for t in (x, w, b, a, bb))
        return lora_linear_reference(*args, 1.5, 0.0, False)

    before = None
    for step in range(3):
        versions = a._version, bb._version
        y = lora_linear_cuda(x, w, b, a, bb, 1.5, 0.0, True, launcher=launcher)
        want = exact()
        budget = 1e-5 * want.abs().max().item()  # float32 rounding of sums over 24 and 5 terms, x 10
        assert (y.detach().double() - want).abs().max().item() <= budget, f"step {step}"
        if before is not None:  # what stale factors would give is far outside the budget
            assert (before - want).abs().max().item() > 100 * budget, f"step {step}"
        before = want
        y.square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        assert (a._version, bb._version) == versions  # only the step count tells the cache
    # no step in between (gradient accumulation, inference): the cached copies are used as they are
    plan = linear_op.plan_for(x.detach().reshape(-1, 24), 16, 5, launcher_handle(launcher))
    kept = linear_op.factor(bb, plan, True, False)
    with torch.no_grad():
        kept[0, 0] += 1.0  # marks the buffer: a copy would overwrite the mark
    assert linear_op.factor(bb, plan, True, False)[0, 0] == kept[0, 0]


def test_factors_first_cached_under_inference_mode_train_afterwards():
    """An evaluation under ``torch.inference_mode`` (Lightning's validation) before a training step: the
    buffers it made must take the next optimizer step's values outside inference mode."""
    launcher = TorchKernels(whole_op=False)
    x, w, b, a, bb = _inputs()
    with torch.inference_mode():
        lora_linear_cuda(x, w, b, a, bb, 1.5, 0.0, False, launcher=launcher)
    for _ in range(2):
        lora_linear_cuda(x, w, b, a, bb, 1.5, 0.0, True, launcher=launcher).sum().backward()
        with torch.no_grad():
            a.sub_(0.1 * a.grad)
            bb.sub_(0.1 * bb.grad)
        a.grad = bb.grad = None
    got = lora_linear_cuda(x, w, b, a, bb, 1.5, 0.0, True, launcher=launcher)
    torch.testing.assert_close(got, lora_linear_reference(x, w, b, a, bb, 1.5, 0.0, False))


def test_a_factor_whose_rank_shrinks_within_its_bucket_keeps_zero_padding():
    launcher = TorchKernels(whole_op=False)
    x, w, b, a, bb = _inputs()  # r = 5, bucket 8
    lora_linear_cuda(x, w, b, a, bb, 1.5, 0.0, False, launcher=launcher)
    a.data, bb.data = a.data[:3].clone(), bb.data[:, :3].clone()  # a pruned adapter, the same parameters
    got = lora_linear_cuda(x, w, b, a, bb, 1.5, 0.0, False, launcher=launcher)
    torch.testing.assert_close(got, lora_linear_reference(x, w, b, a, bb, 1.5, 0.0, False))


def test_backward_refuses_a_factor_changed_after_the_forward():
    """Backward reuses the forward's float32 copies of A and B^T; a factor changed in between would make
    them stale, and autograd refuses it (the factors are saved tensors)."""
    x, w, b, a, bb = _inputs()
    y = lora_linear_cuda(x, w, b, a, bb, 1.5, 0.0, True, launcher=TorchKernels())
    with torch.no_grad():
        a.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("launcher", [TorchKernels(), NullLauncher()], ids=["torch path", "null driver"])
def test_backward_of_a_strided_input_and_a_layer_used_twice(launcher):
    """The forward hands backward the 2-D x it prepared (here a copy of a strided 3-D x) and its plan:
    gradients equal the composition's, also when one layer runs twice before the backward."""
    _, w, b, a, bb = _inputs()
    w.requires_grad_()  # a trainable base as well: every gradient the op has
    b.requires_grad_()
    gen = torch.Generator().manual_seed(11)
    strided = torch.randn(6, 2, 24, generator=gen).transpose(0, 1).requires_grad_()  # (2, 6, 24), strided
    grad = torch.randn(2, 6, 16, generator=gen)

    def run(op, **kwargs):
        for t in (strided, w, b, a, bb):
            t.grad = None
        y = op(strided, w, b, a, bb, 1.5, 0.0, True, **kwargs)
        y2 = op(
            y.detach()[..., :16].repeat(1, 1, 24 // 16 + 1)[..., :24], w, b, a, bb, 1.5, 0.0, True, **kwargs
        )
        (y * grad).sum().add((y2 * grad).sum()).backward()
        return [t.grad.clone() for t in (strided, w, b, a, bb)], y.detach()

    want, y_want = run(lora_linear_reference)
    got, y_got = run(lora_linear_cuda, launcher=launcher)
    if isinstance(launcher, NullLauncher):  # runs nothing: only the shapes of what comes back are known
        assert [g.shape for g in got] == [g.shape for g in want]
        return
    torch.testing.assert_close(y_got, y_want)
    for g, wg in zip(got, want):  # float32 sums added in another order than autograd's: an error
        # relative to the gradient's largest entries, not to each entry (some are sums that nearly cancel)
        torch.testing.assert_close(g, wg, rtol=1e-5, atol=1e-5 * wg.abs().max().item())


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_matches_the_composition_with_the_drawn_mask(p, dtype):
    x, w, b, a, bb = _inputs(dtype)
    torch.manual_seed(7)
    y = lora_linear_cuda(x, w, b, a, bb, 0.5, p, True, launcher=TorchKernels())
    torch.manual_seed(7)
    seed, offset = rng_values(draw_rng(torch.device("cpu")))
    keep = philox.dropout_keep_mask((12, 24), p, seed, offset).view(2, 6, 24)
    xd = x.detach().float() * keep / (1 - p)
    want = x.detach().float() @ w.float().t() + b.float() + 0.5 * (xd @ a.detach().t()) @ bb.detach().t()
    torch.testing.assert_close(y.float(), want, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=2e-2)


def test_explicit_seed_is_stored_as_int64_bits():
    rng = seed_rng(2**64 - 5, torch.device("cpu"), offset=2**63)
    assert rng.dtype == torch.int64 and rng_values(rng) == (2**64 - 5, 2**63)
    with pytest.raises(CudaLoraError, match=r"offset=-1; expected an unsigned 64-bit integer"):
        seed_rng(0, torch.device("cpu"), offset=-1)


def test_launcher_handles_are_stable():
    launcher = TorchKernels()
    assert launcher_handle(None) == 0
    assert launcher_handle(launcher) == launcher_handle(launcher) != 0
    assert launcher_handle(TorchKernels()) != launcher_handle(launcher)


def test_custom_op_passes_opcheck():
    x, w, b, a, bb = _inputs()
    handle = launcher_handle(TorchKernels())
    rng = seed_rng(1234, torch.device("cpu"), 5)
    for args in (
        (x, w, b, a, bb, rng, 0.5, 0.25, False, handle),
        (x, w.t().contiguous(), None, a, bb, None, 2.0, 0.0, True, handle),
    ):
        result = torch.library.opcheck(torch.ops.loragen.lora_linear.default, args)
        assert set(result.values()) == {"SUCCESS"}, result
    g = torch.randn(2, 6, 16)
    h = torch.ops.loragen.lora_linear(x, w, b, a, bb, rng, 0.5, 0.25, False, handle)[1]
    result = torch.library.opcheck(
        torch.ops.loragen.lora_linear_backward.default,
        (
            g,
            x.detach(),
            w,
            a.detach(),
            bb.detach(),
            h,
            rng,
            0.5,
            0.25,
            False,
            [True, True, True, True, True],
            handle,
        ),
    )
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("fifo", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_implementations_agree_with_the_real_outputs(dtype, fifo):
    x, w, b, a, bb = _inputs(dtype, bias=not fifo)
    if fifo:
        w = w.t().contiguous()
    handle = launcher_handle(TorchKernels())
    rng = seed_rng(99, torch.device("cpu"))
    args = (x, w, b, a, bb, rng, 0.5, 0.1, fifo, handle)
    real = torch.ops.loragen.lora_linear(*args)
    g = torch.randn_like(real[0])
    needs = [True, True, b is not None, True, True]
    real_grads = torch.ops.loragen.lora_linear_backward(
        g, x.detach(), w, a.detach(), bb.detach(), real[1], rng, 0.5, 0.1, fifo, needs, handle
    )
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = tuple(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args)
        fake = torch.ops.loragen.lora_linear(*fake_args)
        fake_grads = torch.ops.loragen.lora_linear_backward(
            mode.from_tensor(g),
            *fake_args[:1],
            fake_args[1],
            fake_args[3],
            fake_args[4],
            fake[1],
            fake_args[5],
            0.5,
            0.1,
            fifo,
            needs,
            handle,
        )
    for got, want in zip((*fake, *fake_grads), (*real, *real_grads)):
        assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride())
    assert len(real_grads) == sum(needs)


def test_torch_compile_traces_the_op_without_graph_breaks():
    x, w, b, a, bb = _inputs()
    launcher = TorchKernels()

    def step(x, a, bb):
        return lora_linear_cuda(x, w, b, a, bb, 0.5, 0.0, True, launcher=launcher).square().sum()

    want = step(x, a, bb)  # eager first: the launcher is registered outside tracing
    want.backward()
    wanted = [t.grad.clone() for t in (x, a, bb)]
    for t in (x, a, bb):
        t.grad = None
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss = compiled(x, a, bb)
    loss.backward()
    torch.testing.assert_close(loss, want)
    for want_grad, t in zip(wanted, (x, a, bb)):
        torch.testing.assert_close(t.grad, want_grad)


def test_torch_compile_refuses_a_launcher_it_has_not_seen_outside_tracing():
    x, w, b, a, bb = _inputs()
    launcher = TorchKernels()
    compiled = torch.compile(
        lambda x: lora_linear_cuda(x, w, b, a, bb, 0.5, 0.0, True, launcher=launcher),
        fullgraph=True,
        backend="aot_eager",
    )
    with pytest.raises(Exception, match=r"launcher=TorchKernels is first used inside torch\.compile"):
        compiled(x)
    lora_linear_cuda(x, w, b, a, bb, 0.5, 0.0, True, launcher=launcher)  # registered now
    torch.testing.assert_close(
        compiled(x), lora_linear_cuda(x, w, b, a, bb, 0.5, 0.0, True, launcher=launcher)
    )


def test_torch_compile_with_dropout_draws_a_fresh_mask_per_call():
    x, w, _b, a, bb = _inputs()
    launcher = TorchKernels()
    lora_linear_cuda(x, w, None, a, bb, 1.0, 0.5, True, launcher=launcher)  # registers the launcher
    compiled = torch.compile(
        lambda x: lora_linear_cuda(x, w, None, a, bb, 1.0, 0.5, True, launcher=launcher),
        fullgraph=True,
        backend="aot_eager",
    )
    first, second = compiled(x), compiled(x)
    assert not torch.equal(first, second)
