"""Host work of the CUDA LoRA op, counted on the CPU: Python calls, torch ops, tensor allocations, and
reads of device values on the host (syncs).

    python benchmarks/cuda_host.py                  # counts per forward + backward, as a table
    python benchmarks/cuda_host.py --time           # and host time per forward + backward
    python benchmarks/bench_cuda.py --only host     # the counts, from the GPU benchmark

A null driver (:class:`NullLauncher`) takes every kernel launch the op makes and runs nothing: per
launch it writes the arguments into a prebuilt parameter block exactly as the CUDA driver launcher does
(:class:`loragen.cuda.launch._LaunchRecord`), so what is counted is the op's host path -- everything but
the two driver calls of a launch (``cuCtxGetCurrent``, ``cuLaunchKernel``) and the kernels themselves.
The torch route (``LORAGEN_CUDA_KERNELS=torch``: the composition with the kernels' Philox mask made
from torch operations) is counted as it runs on CPU tensors. CPU tensors stand in for CUDA ones: the few
steps that differ by device (the CUDA-graph capture check, the raw stream handle) are not counted.
tests/cuda/test_cuda_host_path.py holds the op to ceilings on these counts.

Counted per forward + backward of one LoRA linear (64 tokens, 1024 -> 1024, r=16, dropout 0.05,
float32 adapters), after a warm-up call:

* Python calls: ``call`` events of :func:`sys.setprofile` (Python functions) and ``c_call`` events
  (builtins and C methods);
* torch ops: ``aten::`` events of the torch profiler on the CPU, nested ones included;
* allocations: ops in that profile that allocated tensor memory themselves (``self_cpu_memory_usage``
  above 0), so torch ops that allocate, one each;
* syncs (:func:`count_syncs`): the op's forward and backward run on ``meta`` tensors (no values, no GPU
  needed; ``.tolist()`` of a non-CPU tensor dispatches an op, which it does not on a CPU tensor), each
  torch op that would make the host wait for the device recorded with the loragen
  line that called it: reads of device values (``.item()``, ``.tolist()``, ``bool()``, ``nonzero``, ...,
  all :data:`DEVICE_READS`), copies between host and device memory, and ``torch.cuda.synchronize``. Any
  of them stalls the launch queue, which at small batches leaves the GPU idle while Python catches up,
  and none is allowed inside CUDA-graph capture.

Host time (:func:`host_times`, ``--time``): microseconds per forward + backward of each kind on tiny CPU
tensors (8 tokens, 64 -> 64, r = 16, one thread), where the arithmetic costs next to nothing and the time
is the host path: dispatch, autograd, Python. A step chains 8 calls and runs one backward, as the layers
of a model do, and the time is per call. Rounds of each kind are interleaved and medians reported.
What it leaves out on a GPU: the driver's own work in a launch, the caching allocator's work.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import loragen
from loragen.cuda.kernels import KernelSpec, Variant
from loragen.cuda.launch import _LaunchRecord
from loragen.cuda.selfcheck import TorchKernels

__all__ = [
    "DEVICE_READS",
    "KINDS",
    "Counts",
    "NullLauncher",
    "SyncRecorder",
    "count_host_work",
    "count_syncs",
    "counts_table",
    "cuda_op_on_cpu_tensors",
    "host_counts",
    "host_times",
    "lora_step",
    "main",
]

# what each row of the table runs: the frozen base, peft's composition, and loragen's CUDA op on the null
# driver and on the torch route
KINDS = ("frozen", "composition", "loragen", "torch path")


class NullLauncher:
    """A kernel launcher that records launches and runs nothing (the outputs keep whatever they held).

    ``launches`` lists ``(kernel name, variant label, grid)``; ``target_blocks`` is what an H100's
    driver launcher reports (2 blocks on each of 132 multiprocessors), so grids split as on that card.
    """

    def __init__(self, target_blocks: int = 264) -> None:
        self._target_blocks = target_blocks
        self._records: dict[tuple[str, Variant], _LaunchRecord] = {}
        self.launches: list[tuple[str, str, tuple[int, int]]] = []

    def target_blocks(self, device: torch.device) -> int:
        return self._target_blocks

    def launch(
        self,
        spec: KernelSpec,
        variant: Variant,
        grid: tuple[int, int],
        args: Sequence[object],
        device: torch.device,
    ) -> None:
        record = self._records.get((spec.name, variant))
        if record is None:
            record = self._records[(spec.name, variant)] = _LaunchRecord(spec, variant, None, None)
        record.fill(args)
        self.launches.append((spec.name, record.label, grid))


@contextlib.contextmanager
def cuda_op_on_cpu_tensors(launchers: list[object]) -> Iterator[None]:
    """Inside, loragen's layers run the CUDA op on ``launchers[0]`` (which the caller may change) where CPU
    tensors would take the CPU op, under autocast too (as CUDA tensors do; CPU ones would take the
    composition)."""
    from loragen.cuda.linear_op import lora_linear_cuda
    from loragen.ops import fused

    class _CudaOp:
        @staticmethod
        def apply(x: Any, w: Any, b: Any, a: Any, bb: Any, s: float, p: float, seed: Any, fifo: bool) -> Any:
            return lora_linear_cuda(x, w, b, a, bb, s, p, True, fan_in_fan_out=fifo, launcher=launchers[0])  # type: ignore[arg-type]

    def no_fallback(x: Any, dropout: float) -> None:
        return None

    with (
        mock.patch.object(fused, "LoraLinearFunction", _CudaOp),
        mock.patch.object(fused, "fallback_reason", no_fallback),
    ):
        yield


@dataclass(frozen=True)
class Counts:
    """Host work of one call of a step function."""

    python_calls: int  # Python function calls
    c_calls: int  # calls of builtins and C methods
    torch_ops: int  # aten ops, nested ones included
    allocations: int  # tensor allocations
    launches: int  # kernel launches (null driver)
    syncs: int | None = None  # ops that make the host wait for the device (None: not counted)


def _inputs(tokens: int, features: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """x, weight, A, B and the output gradient (A and B float32), random on the CPU."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, features, generator=gen).to(dtype)
    weight = (torch.randn(features, features, generator=gen) / features**0.5).to(dtype)
    a = torch.randn(rank, features, generator=gen) / features**0.5
    b = torch.randn(features, rank, generator=gen) * 0.02
    grad = torch.randn(tokens, features, generator=gen).to(dtype)
    return x, weight, a, b, grad


def _launcher(kind: str, launcher: object | None) -> object:
    if kind == "loragen":
        if launcher is None:
            raise ValueError("lora_step: kind 'loragen' needs a launcher")
        return launcher
    return TorchKernels() if launcher is None else launcher


def lora_step(
    launcher: object | None,
    *,
    tokens: int = 64,
    features: int = 1024,
    rank: int = 16,
    dropout: float = 0.05,
    dtype: torch.dtype = torch.float32,
    kind: str = "loragen",
    device: str = "cpu",
    seed: int | None = None,
    depth: int = 1,
) -> Callable[[], None]:
    """One forward + backward of a LoRA linear on CPU tensors: ``kind`` "loragen" (the CUDA op on
    ``launcher``), "torch path" (the CUDA op on the torch route, ``launcher`` or a :class:`TorchKernels`),
    "composition" (peft's way: base
    linear plus dropout, A and B as separate products) or "frozen" (the base linear alone, grad_x only).
    ``device``: where the tensors are (``"meta"`` for :func:`count_syncs`); ``seed``: an explicit dropout
    seed for the CUDA op (None: drawn per call); ``depth``: how many calls the forward chains, each
    taking the previous output, before one backward (as the layers of a model; needs a square weight).

    Raises:
        ValueError: an unknown ``kind``, or "loragen" without a launcher.
    """
    from loragen.cuda.linear_op import lora_linear_cuda
    from loragen.reference import lora_linear_reference

    x, weight, a, b, grad = (t.to(device) for t in _inputs(tokens, features, rank, dtype))
    for t in (x, a, b):
        t.requires_grad_()
    if kind in ("loragen", "torch path"):
        runs_on = _launcher(kind, launcher)

        def layer(h: torch.Tensor) -> torch.Tensor:
            return lora_linear_cuda(h, weight, None, a, b, 2.0, dropout, True, seed=seed, launcher=runs_on)  # type: ignore[arg-type]
    elif kind == "composition":

        def layer(h: torch.Tensor) -> torch.Tensor:
            return lora_linear_reference(h, weight, None, a.to(dtype), b.to(dtype), 2.0, dropout, True)
    elif kind == "frozen":

        def layer(h: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(h, weight)
    else:
        raise ValueError(f"lora_step: kind={kind!r}; expected one of {', '.join(map(repr, KINDS))}")

    def step() -> None:
        x.grad = a.grad = b.grad = None
        h = x
        for _ in range(depth):
            h = layer(h)
        h.backward(grad)

    return step


def count_host_work(
    step: Callable[[], None], launcher: NullLauncher | None = None, warmup: int = 2
) -> Counts:
    """Count the host work of one call of ``step`` (after ``warmup`` calls); see the module docstring."""
    for _ in range(warmup):
        step()
    calls = {"call": 0, "c_call": 0}

    def profile(frame: object, event: str, arg: object) -> None:
        if event in calls:
            calls[event] += 1

    # the garbage of earlier work is collected first and not during the counted steps: a collection there
    # would count other objects' finalizers as the step's calls
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        sys.setprofile(profile)
        try:
            step()
        finally:
            sys.setprofile(None)
        before = len(launcher.launches) if launcher is not None else 0
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        ) as prof:
            step()
    finally:
        if collecting:
            gc.enable()
    launches = (len(launcher.launches) - before) if launcher is not None else 0
    events = prof.events()
    ops = sum(1 for e in events if e.name.startswith("aten::"))
    allocations = sum(1 for e in events if e.self_cpu_memory_usage > 0)
    return Counts(calls["call"], calls["c_call"], ops, allocations, launches)


# ---- syncs ---------------------------------------------------------------------------------------------
# aten ops that return a device value to the host (the host waits for the device to reach them)
DEVICE_READS = frozenset(
    {
        "_local_scalar_dense",  # .item(), .tolist(), int(t), float(t), bool(t)
        "is_nonzero",  # bool(t), if t:
        "nonzero",  # its output size depends on the values
        "masked_select",
        "equal",
        "allclose",
        "repeat_interleave",  # with tensor repeats and no output_size
        "_unique2",
        "unique_dim",
        "unique_consecutive",
    }
)
_PACKAGE_ROOT = os.path.dirname(os.path.abspath(loragen.__file__))


def _loragen_line() -> str:
    """The innermost loragen line on the stack (this module's own lines left out), as path:line."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path.startswith(_PACKAGE_ROOT + os.sep) and path != os.path.abspath(__file__):
            return f"{os.path.relpath(path, os.path.dirname(_PACKAGE_ROOT))}:{frame.lineno}"
    return "<outside loragen>"


def _sync_reason(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    name = func.overloadpacket.__name__
    if name in DEVICE_READS:
        return name
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if name == "_to_copy" and tensors and "device" in kwargs:
        devices = {tensors[0].device.type, torch.device(kwargs["device"]).type}
    elif name in ("copy_", "_copy_from") and len(tensors) >= 2:
        devices = {tensors[0].device.type, tensors[1].device.type}
    else:
        return None
    return f"{name} (host <-> device copy)" if "cpu" in devices and len(devices) > 1 else None


class SyncRecorder(TorchDispatchMode):
    """Records each torch op inside it that makes the host wait for the device, as ``"op at
    loragen/path.py:line"`` in :attr:`syncs` (and, inside :meth:`watching`, ``torch.cuda.synchronize``
    and device tensors made from host data). A read of a device value
    returns 0, a copy to the host zeros (a meta tensor has no value to read), so that the run goes on."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        reason = _sync_reason(func, args, kwargs)
        if reason is not None:
            self.syncs.append(f"{reason} at {_loragen_line()}")
            source = args[0]
            if reason == "_local_scalar_dense":
                return False if source.dtype == torch.bool else 0
            if func.overloadpacket.__name__ == "_to_copy" and torch.device(kwargs["device"]).type == "cpu":
                return torch.zeros(source.shape, dtype=kwargs.get("dtype") or source.dtype)
        return func(*args, **kwargs)

    def _synchronize(self, device: object = None) -> None:
        self.syncs.append(f"torch.cuda.synchronize at {_loragen_line()}")

    def _from_data(self, name: str, make: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``make`` (``torch.tensor``, ``torch.as_tensor``), recording a tensor made on a device from host
        data: a host-to-device copy that dispatches no op a dispatch mode could see."""

        def made(data: object, *args: Any, **kwargs: Any) -> torch.Tensor:
            result = make(data, *args, **kwargs)
            if result.device.type != "cpu" and not isinstance(data, torch.Tensor):
                self.syncs.append(f"{name} (host -> device copy) at {_loragen_line()}")
            return result

        return made

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Inside: the dispatch mode, and ``torch.cuda.synchronize``, ``torch.tensor`` and
        ``torch.as_tensor`` recorded as well."""
        with (
            mock.patch.object(torch.cuda, "synchronize", self._synchronize),
            mock.patch.object(torch, "tensor", self._from_data("torch.tensor", torch.tensor)),
            mock.patch.object(torch, "as_tensor", self._from_data("torch.as_tensor", torch.as_tensor)),
            self,
        ):
            yield


def count_syncs(
    launcher: object,
    *,
    tokens: int = 64,
    features: int = 1024,
    rank: int = 16,
    dropout: float = 0.05,
    dtype: torch.dtype = torch.float32,
    seed: int | None = None,
) -> list[str]:
    """The syncs of one forward + backward of the CUDA op on ``launcher`` (a :class:`NullLauncher` for the
    kernel path, a :class:`TorchKernels` for the torch route): one entry per sync, naming
    the op and the loragen line that called it (empty when the step never waits for the device). ``seed``
    passes an explicit dropout seed.

    The tensors are on torch's ``meta`` device, which stands in for a GPU: they have shapes, dtypes and a
    device but no values, so any read of a value or copy to or from the host is an op on a non-CPU
    tensor that :class:`SyncRecorder` sees (a read of a CPU tensor's value dispatches no op at all). What
    differs on a CUDA device is not seen: the CUDA-graph capture check, autocast (both host-only).
    """
    step = lora_step(
        launcher,
        tokens=tokens,
        features=features,
        rank=rank,
        dropout=dropout,
        dtype=dtype,
        kind="loragen",
        device="meta",
        seed=seed,
    )
    recorder = SyncRecorder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with recorder.watching():
            step()  # the first call plans and fills the caches
            recorder.syncs.clear()
            step()
    return recorder.syncs


def host_counts(dtype: torch.dtype = torch.float32, dropout: float = 0.05) -> dict[str, Counts]:
    """Counts for each of :data:`KINDS`, syncs for loragen's op (peft's composition runs torch's own
    dropout and products, which never wait for the device, and is not counted)."""
    results = {}
    for kind in KINDS:
        launcher = NullLauncher() if kind == "loragen" else None
        step = lora_step(launcher, dtype=dtype, dropout=dropout, kind=kind)
        counts = count_host_work(step, launcher)
        if kind not in ("frozen", "composition"):
            syncs = count_syncs(
                NullLauncher() if kind == "loragen" else TorchKernels(),
                dtype=dtype,
                dropout=dropout,
            )
            counts = Counts(**{**asdict(counts), "syncs": len(syncs)})
        results[kind] = counts
    return results


def host_times(
    dtype: torch.dtype = torch.float32,
    dropout: float = 0.05,
    *,
    tokens: int = 8,
    features: int = 64,
    rounds: int = 15,
    calls: int = 50,
    depth: int = 8,
) -> dict[str, float]:
    """Median host time per layer's forward + backward, in microseconds, for each of :data:`KINDS` (see
    the module docstring): steps of ``depth`` chained calls and one backward (so that autograd's start-up,
    once per backward, is shared as in a model), ``rounds`` rounds of ``calls`` steps, the kinds
    interleaved within a round."""
    steps = {
        kind: lora_step(
            NullLauncher() if kind == "loragen" else None,
            kind=kind,
            dtype=dtype,
            dropout=dropout,
            tokens=tokens,
            features=features,
            depth=depth,
        )
        for kind in KINDS
    }
    return _interleaved_times(steps, rounds, calls, depth)


def _interleaved_times(
    steps: dict[str, Callable[[], None]], rounds: int, calls: int, depth: int
) -> dict[str, float]:
    """Median microseconds per chained call of each step, on one thread, the steps interleaved."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {kind: [] for kind in steps}
    try:
        for step in steps.values():
            for _ in range(max(2, calls // 10)):
                step()
        for _ in range(rounds):
            for kind, step in steps.items():
                start = time.perf_counter()
                for _ in range(calls):
                    step()
                times[kind].append((time.perf_counter() - start) / (calls * depth) * 1e6)
    finally:
        torch.set_num_threads(threads)
    return {kind: statistics.median(values) for kind, values in times.items()}


def counts_table(results: dict[str, Counts]) -> str:
    """A markdown table of :func:`host_counts`' results."""
    lines = [
        "| variant | Python calls | C calls | torch ops | allocations | launches | syncs |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, c in results.items():
        syncs = "-" if c.syncs is None else str(c.syncs)
        lines.append(
            f"| {name} | {c.python_calls} | {c.c_calls} | {c.torch_ops} | {c.allocations} | {c.launches} "
            f"| {syncs} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, dict[str, dict[str, int | None]]]:
    """Print the counts for float32 and bfloat16 x (float32 adapters); return them as plain dicts."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dropout", type=float, default=0.05)
    parser.add_argument(
        "--time", action="store_true", help="also time the host path of each kind (about a minute)"
    )
    args = parser.parse_args(argv)
    report = {}
    for dtype in (torch.float32, torch.bfloat16):
        results = host_counts(dtype, args.dropout)
        name = str(dtype).removeprefix("torch.")
        print(
            f"\nhost work per forward + backward, 64 tokens, 1024 -> 1024, r=16, x {name}, dropout {args.dropout}"
        )
        print(counts_table(results))
        report[name] = {kind: asdict(c) for kind, c in results.items()}
    if args.time:
        print(
            f"\nhost time per layer, forward + backward (us, median; 8 chained per backward), 8 tokens, "
            f"64 -> 64, r=16, dropout {args.dropout}"
        )
        print("| x | " + " | ".join(KINDS) + " |")
        print("|---" * (len(KINDS) + 1) + "|")
        for dtype in (torch.float32, torch.bfloat16):
            times = host_times(dtype, args.dropout)
            name = str(dtype).removeprefix("torch.")
            print(f"| {name} | " + " | ".join(f"{times[k]:.0f}" for k in KINDS) + " |")
            report[name]["time_us"] = times
    return report


if __name__ == "__main__":
    main()
