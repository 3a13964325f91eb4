"""The dropout path's three masked rank-r products, each compiled kernel variant this CPU runs
(loragen.ops.cpu_kernels: avx512, avx2) vs numpy + BLAS (loragen.ops' fallback), on the tiny Llama's
shapes: N = 1024 rows, in = 512 and 1376, r = 16, p = 0.05, float32.

"hot" repeats the product on the same x; "cold" first streams 256 MiB through the caches, as a
training step does between forward and backward. Medians of interleaved repetitions.

    python -m benchmarks.bench_cpu_kernels            # 2 threads unless --threads
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from loragen import ops, switches
from loragen.ops import cpu_kernels
from loragen.ops.masks import KeepMask

__all__ = ["main", "run"]


def _numpy_products(x: Tensor, bits: Tensor, a: Tensor, gh: Tensor) -> dict[str, Callable[[], Tensor]]:
    n, width = x.shape
    keep = KeepMask(bits, width, torch.float32)
    buffer = torch.empty(n, width)
    return {
        "h = (x*m) A^T": lambda: torch.mm(keep.apply(x, keep.block(0, n), buffer), a.t()),
        "dA = gh^T (x*m)": lambda: torch.mm(gh.t(), keep.apply(x, keep.block(0, n), buffer)),
        "dx = (gh A)*m": lambda: keep.apply(torch.mm(gh, a), keep.block(0, n), buffer),
    }


def _kernel_products(x: Tensor, bits: Tensor, a: Tensor, gh: Tensor) -> dict[str, Callable[[], Tensor]]:
    return {
        "h = (x*m) A^T": lambda: cpu_kernels.masked_down(x, bits, a, 1.0),
        "dA = gh^T (x*m)": lambda: cpu_kernels.masked_grad_a(x, bits, gh),
        "dx = (gh A)*m": lambda: cpu_kernels.masked_grad_x(gh, a, bits),
    }


@contextmanager
def _variant(name: str) -> Iterator[None]:
    with switches.cpu_kernels.using(True), switches.cpu_kernel_variant.using(name):
        yield


def _runnable() -> list[str]:
    names = []
    for name in cpu_kernels.VARIANTS:
        with _variant(name):
            if cpu_kernels.available():
                names.append(name)
    return names


def run(rounds: int = 40) -> str:
    """Time every product on every path, hot and cold; returns a Markdown table."""
    variants = _runnable()
    if not variants:
        return f"no compiled kernel variant runs here: {cpu_kernels.status()}"
    paths = [*variants, "numpy + BLAS"]
    flush = torch.empty(64 << 20)  # 256 MiB
    header = " | ".join(f"{state}: {path} ms" for state in ("hot", "cold") for path in paths)
    lines = [
        f"{torch.get_num_threads()} threads, N = 1024, r = 16, p = 0.05, float32; medians of {rounds}",
        "",
        f"| product | in | {header} |",
        "|---|---|" + "---|" * (2 * len(paths)),
    ]
    for width in (512, 1376):
        g = torch.Generator().manual_seed(0)
        x, a, gh = (
            torch.randn(1024, width, generator=g),
            torch.randn(16, width, generator=g),
            torch.randn(1024, 16),
        )
        bits = ops.dropout_keep_bits(x.numel(), 0.05, 1)
        products = {path: _kernel_products(x, bits, a, gh) for path in variants}
        products["numpy + BLAS"] = _numpy_products(x, bits, a, gh)
        for name in products["numpy + BLAS"]:
            cells = []
            for cold in (False, True):
                times: dict[str, list[float]] = {path: [] for path in paths}
                for i in range(rounds + 3):
                    for path in paths:  # interleaved: load from other processes hits every path alike
                        with _variant(path if path in variants else "auto"):
                            if cold:
                                flush.add_(1.0)
                            start = time.perf_counter()
                            products[path][name]()
                            if i >= 3:
                                times[path].append(time.perf_counter() - start)
                cells += [f"{statistics.median(times[path]) * 1e3:.3f}" for path in paths]
            lines.append(f"| {name} | {width} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_cpu_kernels", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rounds", type=int, default=40, help="timed repetitions (default 40)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(run(args.rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
