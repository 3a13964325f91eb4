"""Host work of a q/k/v sibling group on the CUDA path: one group node against three separate LoRA layers,
counted on the CPU.

    python benchmarks/cuda_group_host.py            # counts per forward + backward, as a table
    python benchmarks/cuda_group_host.py --time     # and host time per group (medians, interleaved)
    python benchmarks/cuda_group_host.py --instructions   # and CPU instructions per group (callgrind)

Three LoRA linears read one x (64 tokens, 1024 -> 1024 each, r = 16, no dropout, float32 adapters); one
step is their forward and one backward of the three outputs. The kernels go to the null driver of
benchmarks/cuda_host.py (every launch's parameter block written, nothing run), so what is counted is the
host path: Python calls, torch ops, allocations and launches (:func:`cuda_host.count_host_work`). Kinds:

* ``3 ops`` / ``group op``: three :func:`~loragen.cuda.linear_op.lora_linear_cuda` calls, or one
  :func:`~loragen.cuda.group_op.lora_group_cuda` call (autograd then adds no x-gradients);
* ``3 layers`` / ``group layers``: a module whose q, k and v are loragen LoRA layers, run as on a GPU --
  each layer's CUDA op, or sibling fusion's CUDA group -- on CPU tensors (the layers' CPU op replaced by
  the CUDA op, and sibling fusion routed to the CUDA group, both on the null driver): what a model pays,
  the layers' own Python (adapter lookups, eligibility, the leader's hand-out) included;
* ``frozen``: the three base linears alone (``F.linear``, x's gradient only), for scale.

Host time (``--time``): microseconds per group's forward + backward on tiny tensors (8 tokens, 64
features) on one thread, rounds of each kind interleaved, medians. What it leaves out on a GPU: the
driver's own work per launch (about 2 us each for ``cuLaunchKernel`` on an H100 host), the caching
allocator's, and cuBLAS's host work per product.

CPU instructions (``--instructions``): per group's forward + backward on the same tiny tensors, counted by
valgrind's callgrind around the measured steps only (as benchmarks/host_instructions.py counts them), the
kernels launched through loragen's real CUDA launcher (:class:`~loragen.cuda.launch.DriverLauncher` and
cuda-python) on the stand-in driver library of benchmarks/stand_in_libcuda.c: a figure that does not move
with the machine's load. Needs valgrind with its headers, a C compiler and cuda-python.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import importlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any
from unittest import mock

import torch
from torch import nn

__all__ = ["KINDS", "group_counts", "group_instructions", "group_step", "group_times", "main"]

KINDS = ("frozen", "3 ops", "group op", "3 layers", "group layers")


def _sibling(name: str) -> Any:
    """benchmarks/<name>.py, as a package module or from this folder."""
    if __package__:
        return importlib.import_module(f"{__package__}.{name}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    return importlib.import_module(name)


def _cuda_host() -> Any:
    return _sibling("cuda_host")


class _QKV(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.q = nn.Linear(features, features, bias=False)
        self.k = nn.Linear(features, features, bias=False)
        self.v = nn.Linear(features, features, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = self.q(x)
        k = self.k(x)
        v = self.v(x)
        return q, k, v


@contextlib.contextmanager
def _as_on_a_gpu(launcher: object) -> Iterator[None]:
    """loragen's layers take the CUDA path on CPU tensors: each layer's CUDA op, and sibling fusion's
    CUDA group, on ``launcher``."""
    from loragen.cuda.linear_op import lora_linear_cuda
    from loragen.ops import dispatch, siblings

    class _CudaOp:
        @staticmethod
        def apply(
            x: Any, w: Any, b: Any, a: Any, bb: Any, s: float, p: float, rng: Any, seed: Any, fifo: bool
        ) -> Any:
            return lora_linear_cuda(x, w, b, a, bb, s, p, True, fan_in_fan_out=fifo, launcher=launcher)  # type: ignore[arg-type]

    def runner(x: torch.Tensor) -> Any:
        return siblings._cuda_group

    with (
        mock.patch.object(dispatch, "LoraLinearFunction", _CudaOp),
        mock.patch.object(siblings, "_runner", runner),
        mock.patch.object(siblings, "_cuda_launcher", launcher),
    ):
        yield


def group_step(
    kind: str,
    launcher: object,
    *,
    tokens: int = 64,
    features: int = 1024,
    rank: int = 16,
    dtype: torch.dtype = torch.float32,
) -> Callable[[], None]:
    """One forward + backward of three LoRA linears reading one x, as ``kind`` (see the module docstring);
    the layer kinds must run inside :func:`_as_on_a_gpu`.

    Raises:
        ValueError: an unknown ``kind``.
    """
    import loragen
    from loragen import switches
    from loragen.cuda.group_op import lora_group_cuda
    from loragen.cuda.linear_op import lora_linear_cuda

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, features, generator=gen).to(dtype).requires_grad_()
    grads = [torch.randn(tokens, features, generator=gen).to(dtype) for _ in range(3)]
    weights = [(torch.randn(features, features, generator=gen) / features**0.5).to(dtype) for _ in range(3)]
    factors = [
        (
            (torch.randn(rank, features, generator=gen) / features**0.5).requires_grad_(),
            (torch.randn(features, rank, generator=gen) * 0.02).requires_grad_(),
        )
        for _ in range(3)
    ]
    leaves = [x] + [t for pair in factors for t in pair]
    if kind == "frozen":

        def forward() -> tuple[torch.Tensor, ...]:
            return tuple(torch.nn.functional.linear(x, w) for w in weights)
    elif kind == "3 ops":

        def forward() -> tuple[torch.Tensor, ...]:
            return tuple(
                lora_linear_cuda(x, w, None, a, b, 2.0, 0.0, True, launcher=launcher)  # type: ignore[arg-type]
                for w, (a, b) in zip(weights, factors)
            )
    elif kind == "group op":
        members = [(w, None, a, b, 2.0, False) for w, (a, b) in zip(weights, factors)]

        def forward() -> tuple[torch.Tensor, ...]:
            outputs = lora_group_cuda(x, members, launcher=launcher)  # type: ignore[arg-type]
            assert outputs is not None  # the benchmark's own shapes: a group the kernels take
            return outputs
    elif kind in ("3 layers", "group layers"):
        torch.manual_seed(0)
        model = loragen.get_lora_model(
            _QKV(features).to(dtype),
            loragen.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q", "k", "v"]),
        )
        leaves = [x] + [p for p in model.parameters() if p.requires_grad]
        fuse = kind == "group layers"

        def forward() -> tuple[torch.Tensor, ...]:
            with switches.sibling_fusion.using(fuse):
                outputs: tuple[torch.Tensor, ...] = model(x)
            return outputs
    else:
        raise ValueError(f"group_step: kind={kind!r}; expected one of {', '.join(map(repr, KINDS))}")

    def step() -> None:
        for t in leaves:
            t.grad = None
        torch.autograd.backward(list(forward()), grads)

    return step


def group_counts(dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """:class:`cuda_host.Counts` per forward + backward of each of :data:`KINDS`."""
    cuda_host = _cuda_host()
    results = {}
    for kind in KINDS:
        launcher = cuda_host.NullLauncher()
        with _as_on_a_gpu(launcher):
            results[kind] = cuda_host.count_host_work(group_step(kind, launcher, dtype=dtype), launcher)
    return results


def group_times(
    dtype: torch.dtype = torch.float32,
    *,
    rounds: int = 15,
    calls: int = 50,
    tokens: int = 8,
    features: int = 64,
) -> dict[str, float]:
    """Median host microseconds per group's forward + backward of each of :data:`KINDS`, on one thread,
    the kinds interleaved within each round."""
    cuda_host = _cuda_host()
    launcher = cuda_host.NullLauncher()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    try:
        with _as_on_a_gpu(launcher):
            steps = {
                kind: group_step(kind, launcher, dtype=dtype, tokens=tokens, features=features)
                for kind in KINDS
            }
            for step in steps.values():
                for _ in range(5):
                    step()
            for _ in range(rounds):
                for kind, step in steps.items():
                    launcher.launches.clear()
                    start = time.perf_counter()
                    for _ in range(calls):
                        step()
                    times[kind].append((time.perf_counter() - start) / calls * 1e6)
    finally:
        torch.set_num_threads(threads)
    return {kind: statistics.median(values) for kind, values in times.items()}


def _child(steps: int, kinds: list[str]) -> None:
    """Inside valgrind: each kind's steps between the instrumentation switches."""
    cuda_host = _cuda_host()
    control = ctypes.CDLL(os.environ["LORAGEN_MEASURE_LIBRARY"])
    torch.set_num_threads(1)
    with cuda_host.stand_in_device() as launcher, _as_on_a_gpu(launcher):
        for kind in kinds:
            step = group_step(kind, launcher, tokens=8, features=64)
            for _ in range(5):
                step()
            control.measure_start()
            for _ in range(steps):
                step()
            control.measure_stop()


def group_instructions(steps: int = 5, kinds: tuple[str, ...] = KINDS) -> dict[str, int]:
    """CPU instructions per group's forward + backward of each kind, counted by callgrind.

    Raises:
        RuntimeError: valgrind, its headers, a C compiler or cuda-python missing, or the run failed.
    """
    valgrind, compiler = shutil.which("valgrind"), shutil.which("cc") or shutil.which("gcc")
    if valgrind is None or compiler is None:
        raise RuntimeError("counting instructions needs valgrind and a C compiler (cc or gcc) on PATH")
    cuda_host, host_instructions = _cuda_host(), _sibling("host_instructions")
    with tempfile.TemporaryDirectory() as folder:
        env = cuda_host.stand_in_driver_env(folder)
        control = os.path.join(folder, "measure.c")
        with open(control, "w") as out:
            out.write(host_instructions._CONTROL_SOURCE)
        library = os.path.join(folder, "libmeasure.so")
        built = subprocess.run(
            [compiler, "-O1", "-shared", "-fPIC", "-o", library, control],
            capture_output=True,
            text=True,
            check=False,
        )
        if built.returncode != 0:
            raise RuntimeError(
                f"building the callgrind switch failed (valgrind headers missing?):\n{built.stderr}"
            )
        env["LORAGEN_MEASURE_LIBRARY"] = library
        output = os.path.join(folder, "callgrind.out")
        run = subprocess.run(
            [
                valgrind,
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--callgrind-out-file={output}",
                os.path.realpath(sys.executable),
                os.path.abspath(__file__),
                "--child",
                str(steps),
                *kinds,
            ],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if run.returncode != 0:
            raise RuntimeError(f"the callgrind run failed:\n{run.stdout[-4000:]}{run.stderr[-4000:]}")
        parts = sorted(glob.glob(output + ".*"), key=lambda path: int(path.rsplit(".", 1)[1]))
        if len(parts) != len(kinds):
            raise RuntimeError(f"expected {len(kinds)} callgrind dumps, found {len(parts)}")
        counts = {}
        for kind, part in zip(kinds, parts):
            with open(part) as dump:
                found = re.search(r"^totals: (\d+)", dump.read(), re.MULTILINE)
            if found is None:
                raise RuntimeError(f"no totals line in {part}")
            counts[kind] = int(found.group(1)) // steps
    return counts


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Print the counts (and with ``--time`` the host times) for float32 and bfloat16 x."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--time", action="store_true", help="also time the host path of each kind")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="also count CPU instructions per kind (callgrind, minutes)",
    )
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(int(args.child[0]), args.child[1:])
        return {}
    cuda_host = _cuda_host()
    report: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        counts = group_counts(dtype)
        print(f"\nhost work per forward + backward of q, k, v: 64 tokens, 1024 -> 1024, r=16, x {name}")
        print(cuda_host.counts_table(counts))
        report[name] = {kind: asdict(c) for kind, c in counts.items()}
    if args.time:
        print("\nhost time per forward + backward of q, k, v (us, median), 8 tokens, 64 -> 64, r=16")
        print("| x | " + " | ".join(KINDS) + " |")
        print("|---" * (len(KINDS) + 1) + "|")
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            times = group_times(dtype)
            print(f"| {name} | " + " | ".join(f"{times[k]:.0f}" for k in KINDS) + " |")
            report[name]["time_us"] = times
    if args.instructions:
        counts = group_instructions()
        print(
            "\nCPU instructions per forward + backward of q, k, v (8 tokens, 64 -> 64, r=16, float32, callgrind)"
        )
        print("| kind | instructions | / 3 layers |")
        print("|---|---|---|")
        for kind, count in counts.items():
            print(f"| {kind} | {count:,} | {count / counts['3 layers']:.2f} |")
        report["instructions"] = counts
    return report


if __name__ == "__main__":
    main()
