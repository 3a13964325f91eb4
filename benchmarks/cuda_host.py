"""Host work of the CUDA LoRA op, counted on the CPU: Python calls, torch ops and tensor allocations.

    python benchmarks/cuda_host.py                  # counts per forward + backward, as a table
    python benchmarks/bench_cuda.py --only host     # the same, from the GPU benchmark

A null driver (:class:`NullLauncher`) takes every kernel launch the op makes and runs nothing: per
launch it writes the arguments into a prebuilt parameter block exactly as the CUDA driver launcher does
(:class:`loragen.cuda.launch._LaunchRecord`), so what is counted is the op's host path -- everything but
the two driver calls of a launch (``cuCtxGetCurrent``, ``cuLaunchKernel``) and the kernels themselves.
CPU tensors stand in for CUDA ones: the few steps that differ by device (the CUDA-graph capture check,
the raw stream handle) are not counted. tests/cuda/test_cuda_host_counts.py holds the op to ceilings
on these counts.

Counted per forward + backward of one LoRA linear (64 tokens, 1024 -> 1024, r=16, dropout 0.05,
float32 adapters), after a warm-up call:

* Python calls: ``call`` events of :func:`sys.setprofile` (Python functions) and ``c_call`` events
  (builtins and C methods);
* torch ops: ``aten::`` events of the torch profiler on the CPU, nested ones included;
* allocations: ops in that profile that allocated tensor memory themselves (``self_cpu_memory_usage``
  above 0), so torch ops that allocate, one each.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from loragen.cuda.kernel_variants import Variant
from loragen.cuda.launch import _LaunchRecord
from loragen.cuda.specs import KernelSpec

__all__ = ["Counts", "NullLauncher", "count_host_work", "counts_table", "lora_step", "main"]


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


@dataclass(frozen=True)
class Counts:
    """Host work of one call of a step function."""

    python_calls: int  # Python function calls
    c_calls: int  # calls of builtins and C methods
    torch_ops: int  # aten ops, nested ones included
    allocations: int  # tensor allocations
    launches: int  # kernel launches (null driver)


def lora_step(
    launcher: NullLauncher | None,
    *,
    tokens: int = 64,
    features: int = 1024,
    rank: int = 16,
    dropout: float = 0.05,
    dtype: torch.dtype = torch.float32,
    kind: str = "loragen",
) -> Callable[[], None]:
    """One forward + backward of a LoRA linear on CPU tensors: ``kind`` "loragen" (the CUDA op on
    ``launcher``), "composition" (peft's way: base linear plus dropout, A and B as separate products)
    or "frozen" (the base linear alone, grad_x only).

    Raises:
        ValueError: an unknown ``kind``, or "loragen" without a launcher.
    """
    from loragen.cuda.linear_op import lora_linear_cuda
    from loragen.reference import lora_linear_reference

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, features, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(features, features, generator=gen) / features**0.5).to(dtype)
    a = (torch.randn(rank, features, generator=gen) / features**0.5).requires_grad_()
    b = (torch.randn(features, rank, generator=gen) * 0.02).requires_grad_()
    grad = torch.randn(tokens, features, generator=gen).to(dtype)
    if kind == "loragen":
        if launcher is None:
            raise ValueError("lora_step: kind 'loragen' needs a launcher")

        def forward() -> torch.Tensor:
            return lora_linear_cuda(x, weight, None, a, b, 2.0, dropout, True, launcher=launcher)
    elif kind == "composition":

        def forward() -> torch.Tensor:
            return lora_linear_reference(x, weight, None, a.to(dtype), b.to(dtype), 2.0, dropout, True)
    elif kind == "frozen":

        def forward() -> torch.Tensor:
            return torch.nn.functional.linear(x, weight)
    else:
        raise ValueError(f"lora_step: kind={kind!r}; expected 'loragen', 'composition' or 'frozen'")

    def step() -> None:
        x.grad = a.grad = b.grad = None
        forward().backward(grad)

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
    launches = (len(launcher.launches) - before) if launcher is not None else 0
    events = prof.events()
    ops = sum(1 for e in events if e.name.startswith("aten::"))
    allocations = sum(1 for e in events if e.self_cpu_memory_usage > 0)
    return Counts(calls["call"], calls["c_call"], ops, allocations, launches)


def host_counts(dtype: torch.dtype = torch.float32, dropout: float = 0.05) -> dict[str, Counts]:
    """Counts for the frozen base, the composition and loragen's CUDA op (null driver)."""
    results = {}
    for kind in ("frozen", "composition", "loragen"):
        launcher = NullLauncher() if kind == "loragen" else None
        step = lora_step(launcher, dtype=dtype, dropout=dropout, kind=kind)
        results[kind] = count_host_work(step, launcher)
    return results


def counts_table(results: dict[str, Counts]) -> str:
    """A markdown table of :func:`host_counts`' results."""
    lines = [
        "| variant | Python calls | C calls | torch ops | allocations | launches |",
        "|---|---|---|---|---|---|",
    ]
    for name, c in results.items():
        lines.append(
            f"| {name} | {c.python_calls} | {c.c_calls} | {c.torch_ops} | {c.allocations} | {c.launches} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, dict[str, dict[str, int]]]:
    """Print the counts for float32 and bfloat16 x (float32 adapters); return them as plain dicts."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dropout", type=float, default=0.05)
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
    return report


if __name__ == "__main__":
    main()
