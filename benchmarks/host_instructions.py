"""Host work of a LoRA layer's forward + backward as CPU instructions, counted by valgrind's callgrind:
a figure that does not move with the machine's load, unlike a time.

    python benchmarks/host_instructions.py               # every kind, 5 steps of 8 chained layers
    python benchmarks/host_instructions.py --steps 10 --kinds composition "loragen op"
    python benchmarks/host_instructions.py --dropout 0  # without dropout
    python benchmarks/host_instructions.py --autocast --kinds "frozen module" "peft layer" "loragen layer"

Each kind runs steps of 8 chained layers and one backward (as the layers of a model), on tiny CPU tensors
(8 tokens, 64 -> 64, r = 16, dropout 0.05 unless ``--dropout`` says otherwise, float32), where the
arithmetic costs next to nothing: what is counted is the host path (Python, torch's dispatch, autograd). After a warm-up, callgrind counts only the
measured steps (a small library built here switches its instrumentation on and off around them). Kinds:

* ``frozen``: ``F.linear`` alone; ``composition``: peft's way as functions (base linear, dropout, A and B
  as separate products), :func:`loragen.reference.lora_linear_reference`;
* ``loragen op``: :func:`loragen.cuda.linear_op.lora_linear_cuda` on the null driver of
  benchmarks/cuda_host.py (everything but the launch calls); ``loragen op, CUDA launcher``: the same
  through loragen's :class:`~loragen.cuda.launch.DriverLauncher` and cuda-python on the stand-in driver
  library of benchmarks/stand_in_libcuda.c (every driver entry point returns at once);
* ``torch path (GPU)``: the op on its torch path with the jiterator kernels stood in;
* ``loragen op, native host``, ``loragen layer, native host``: the same with the C++ host path
  (:mod:`loragen.cuda.native_host`, ``LORAGEN_CUDA_NATIVE_HOST=1``) on the stand-in driver;
* ``frozen module``, ``peft layer``, ``loragen layer``: whole modules -- a model of 8 ``nn.Linear``
  frozen, with peft's LoRA layers, and with loragen's, whose op runs through the CUDA launcher on the
  stand-in driver (CPU tensors take the CUDA op's path in place of the CPU op); ``loragen layer, torch
  path``: loragen's layers with the op on a :class:`~loragen.cuda.torch_kernels.TorchKernels` launcher
  (the torch path, as ``LORAGEN_CUDA_KERNELS=torch`` routes it), the jiterator kernels stood in.

``--autocast`` runs the whole-module kinds' forward under bf16 autocast and their backward after it, as
Trainer's ``bf16=True`` runs a step (the CPU's autocast here, which the op follows as it follows CUDA's
on a GPU).

Needs valgrind with its headers (``valgrind/callgrind.h``), a C compiler and cuda-python.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from loragen import switches
from loragen.cuda.torch_kernels import TorchKernels

__all__ = ["KINDS", "MODULE_KINDS", "count_instructions", "main"]

KINDS = (
    "frozen",
    "composition",
    "loragen op",
    "loragen op, CUDA launcher",
    "torch path (GPU)",
    "frozen module",
    "peft layer",
    "loragen layer",
    "loragen layer, torch path",
    "loragen op, native host",
    "loragen layer, native host",
)
_NATIVE = ", native host"
DEPTH = 8  # chained layers per step

# switches callgrind's instrumentation on for the measured steps only (client requests from Python)
_CONTROL_SOURCE = """
#include <valgrind/callgrind.h>
void measure_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void measure_stop(void) { CALLGRIND_DUMP_STATS; CALLGRIND_STOP_INSTRUMENTATION; }
"""


def _cuda_host() -> Any:
    """benchmarks/cuda_host.py, as a package module or from this folder."""
    import importlib

    if __package__:
        return importlib.import_module(f"{__package__}.cuda_host")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    return importlib.import_module("cuda_host")


MODULE_KINDS = (
    "frozen module",
    "peft layer",
    "loragen layer",
    "loragen layer, torch path",
    "loragen layer, native host",
)


def _module_step(kind: str, launcher: object, dropout: float, autocast: bool = False) -> Callable[[], None]:
    """One forward (under bf16 autocast with ``autocast``) + backward of a model of 8 LoRA (or frozen)
    linears 64 -> 64."""
    import peft

    import loragen

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(DEPTH)])
    config = {
        "r": 16,
        "lora_alpha": 32,
        "lora_dropout": dropout,
        "target_modules": [str(i) for i in range(DEPTH)],
    }
    if kind == "peft layer":
        model = peft.get_peft_model(model, peft.LoraConfig(**config))
    elif kind == "loragen layer":
        model = loragen.get_lora_model(model, loragen.LoraConfig(**config))
    else:
        model.requires_grad_(False)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    x = torch.randn(8, 64, requires_grad=True)
    grad = torch.randn(8, 64, dtype=torch.bfloat16 if autocast else torch.float32)
    # entering torch.autocast costs host work of its own (even disabled): none where it is not asked for
    context: Callable[[], contextlib.AbstractContextManager[Any]] = (
        functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext
    )

    def step() -> None:
        x.grad = None
        for p in trainable:
            p.grad = None
        with context():
            y = model(x)
        y.backward(grad)

    return step


def _child(steps: int, dropout: float, autocast: bool, kinds: list[str]) -> None:
    """Inside valgrind: run each kind's steps between the instrumentation switches."""
    cuda_host = _cuda_host()
    control = ctypes.CDLL(os.environ["LORAGEN_MEASURE_LIBRARY"])
    torch.set_num_threads(1)
    with contextlib.ExitStack() as stack:
        launcher = stack.enter_context(cuda_host.stand_in_device())
        layers_launcher: list[object] = [launcher]
        stack.enter_context(cuda_host.cuda_op_on_cpu_tensors(layers_launcher))
        stack.enter_context(cuda_host.null_jiterator())
        for kind in kinds:
            native = kind.endswith(_NATIVE)  # the C++ host path, on the stand-in driver
            base = kind.removesuffix(_NATIVE)
            with switches.cuda_native_host.using(native):
                if base == "loragen layer, torch path":
                    layers_launcher[0] = TorchKernels()
                    step = _module_step("loragen layer", launcher, dropout, autocast)
                elif base in ("frozen module", "peft layer", "loragen layer"):
                    layers_launcher[0] = launcher
                    step = _module_step(base, launcher, dropout, autocast)
                else:
                    runs_on = {
                        "loragen op": launcher if native else cuda_host.NullLauncher(),
                        "loragen op, CUDA launcher": launcher,
                    }
                    op_kind = "loragen" if base.startswith("loragen op") else base
                    step = cuda_host.lora_step(
                        runs_on.get(base), kind=op_kind, tokens=8, features=64, depth=DEPTH, dropout=dropout
                    )
                measured_steps(control, step, steps)


def measured_steps(control: Any, step: Callable[[], None], steps: int, warmup: int = 5) -> None:
    """Inside valgrind: ``warmup`` calls of ``step``, then ``steps`` calls between ``control``'s
    measure_start and measure_stop (one callgrind dump)."""
    for _ in range(warmup):
        step()
    control.measure_start()
    for _ in range(steps):
        step()
    control.measure_stop()


def callgrind_totals(script: str, child_args: list[str], dumps: int) -> list[int]:
    """Run ``script --child *child_args`` under callgrind, with the stand-in driver library and the
    measure_start/measure_stop switch (``LORAGEN_MEASURE_LIBRARY``) its child loads; return the
    instruction totals of its ``dumps`` measured spans, in order.

    Raises:
        RuntimeError: valgrind, its headers or a C compiler missing, or the run failed.
    """
    valgrind, compiler = shutil.which("valgrind"), shutil.which("cc") or shutil.which("gcc")
    if valgrind is None or compiler is None:
        raise RuntimeError("counting instructions needs valgrind and a C compiler (cc or gcc) on PATH")
    cuda_host = _cuda_host()
    with tempfile.TemporaryDirectory() as folder:
        env = cuda_host.stand_in_driver_env(folder)
        control = os.path.join(folder, "measure.c")
        with open(control, "w") as out:
            out.write(_CONTROL_SOURCE)
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
        python = os.path.realpath(sys.executable)  # the interpreter itself, not a wrapper script
        command = [valgrind, "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={output}"]
        run = subprocess.run(
            [*command, python, os.path.abspath(script), "--child", *child_args],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if run.returncode != 0:
            raise RuntimeError(f"the callgrind run failed:\n{run.stdout[-4000:]}{run.stderr[-4000:]}")
        parts = sorted(glob.glob(output + ".*"), key=lambda path: int(path.rsplit(".", 1)[1]))
        if len(parts) != dumps:
            raise RuntimeError(f"expected {dumps} callgrind dumps, found {len(parts)}")
        totals = []
        for part in parts:
            with open(part) as dump:
                found = re.search(r"^totals: (\d+)", dump.read(), re.MULTILINE)
            if found is None:
                raise RuntimeError(f"no totals line in {part}")
            totals.append(int(found.group(1)))
    return totals


def count_instructions(
    steps: int = 5, kinds: tuple[str, ...] = KINDS, dropout: float = 0.05, autocast: bool = False
) -> dict[str, int]:
    """Instructions per layer (forward + backward) of each kind, counted by callgrind; with ``autocast``
    the forward runs under bf16 autocast (whole-module kinds only, :data:`MODULE_KINDS`).

    Raises:
        ValueError: ``autocast`` with a kind that is not a whole module.
        RuntimeError: valgrind, its headers or a C compiler missing, or the run failed.
    """
    if autocast and (ops := [kind for kind in kinds if kind not in MODULE_KINDS]):
        raise ValueError(f"--autocast measures whole modules ({list(MODULE_KINDS)}), not {ops}")
    totals = callgrind_totals(__file__, [str(steps), str(dropout), str(int(autocast)), *kinds], len(kinds))
    return {kind: total // (steps * DEPTH) for kind, total in zip(kinds, totals)}


def main(argv: list[str] | None = None) -> dict[str, int]:
    """Print the instructions per layer of each kind as a markdown table; return them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="measured steps of 8 layers per kind")
    parser.add_argument(
        "--kinds", nargs="+", choices=KINDS, help="default: every kind (with --autocast, every module kind)"
    )
    parser.add_argument("--dropout", type=float, default=0.05, help="the LoRA layers' dropout")
    parser.add_argument(
        "--autocast", action="store_true", help="forward under bf16 autocast (whole-module kinds only)"
    )
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(int(args.child[0]), float(args.child[1]), args.child[2] == "1", args.child[3:])
        return {}
    kinds = tuple(args.kinds or (MODULE_KINDS if args.autocast else KINDS))
    try:
        counts = count_instructions(args.steps, kinds, args.dropout, args.autocast)
    except ValueError as error:
        parser.error(str(error))
    base = counts.get("composition")
    print(
        "host instructions per layer, forward + backward "
        f"(8 tokens, 64 -> 64, r=16, dropout {args.dropout}, float32"
        f"{', forward under bf16 autocast' if args.autocast else ''})"
    )
    print("| kind | instructions | / composition |")
    print("|---|---|---|")
    for kind, count in counts.items():
        ratio = f"{count / base:.2f}" if base else "-"
        print(f"| {kind} | {count:,} | {ratio} |")
    return counts


if __name__ == "__main__":
    main()
