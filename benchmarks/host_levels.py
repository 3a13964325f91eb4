"""Where a LoRA layer's host work goes, level by level, on the C++ host path: callgrind instructions per
layer (forward + backward) when the same chain of 8 layers is entered at each level of the call, from
the model down to the registered C++ op.

    python benchmarks/host_levels.py                 # dropout 0
    python benchmarks/host_levels.py --dropout 0.05

Each level calls the next one down directly, so the difference between two rows is what the upper level
adds per layer (its Python, the calls it makes before the next level). The layers are loragen's LoRA
linears 64 -> 64 (r = 16, 8 tokens, float32) with the op on CPU tensors through the C++ host path and the
stand-in driver of benchmarks/stand_in_libcuda.c, as "loragen layer, native host" in
benchmarks/host_instructions.py (whose callgrind harness this uses). Levels:

* ``model``: ``model(x)``, an ``nn.Sequential`` of the layers;
* ``module call``: each layer's ``nn.Module.__call__`` (``layer(h)``);
* ``forward``: :meth:`loragen.LoraLayer.forward`, merge guard included;
* ``forward, unguarded``: the same without the merge guard;
* ``variant``: the adapter variant's ``fused_linear`` (parameter reads, the layout);
* ``dispatch``: :func:`loragen.ops.lora_linear` (on these CPU tensors through the CPU branch's checks, a
  little more than a CUDA tensor's route);
* ``CUDA op``: :func:`loragen.cuda.linear_op.lora_linear_cuda`;
* ``C++ path``: :func:`loragen.cuda.native_host.try_lora_linear` (plan lookup, dropout constants);
* ``op entry``: the C++ op as the C++ path calls it -- its direct Python entry where the library has one,
  else ``torch.ops.loragen_host.lora_linear`` (its boxing included) -- then the C++ forward, and
  autograd's engine running its backward;
* ``registered op``, below the table and not a level of it: ``torch.ops.loragen_host.lora_linear``
  called from Python, for comparison with the direct entry.

Needs what benchmarks/host_instructions.py needs (valgrind with its headers, a C compiler, cuda-python) and
a C++ compiler for the host path.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from loragen import switches

__all__ = ["EXTRA", "LEVELS", "count_levels", "main"]

LEVELS = (
    "model",
    "module call",
    "forward",
    "forward, unguarded",
    "variant",
    "dispatch",
    "CUDA op",
    "C++ path",
    "op entry",
)
EXTRA = ("registered op",)  # counted after the levels, not one of them
SCALING = 2.0  # lora_alpha 32 / r 16


def _host_instructions() -> Any:
    """benchmarks/host_instructions.py, as a package module or from this folder."""
    if __package__:
        return importlib.import_module(f"{__package__}.host_instructions")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    return importlib.import_module("host_instructions")


host_instructions = _host_instructions()
DEPTH = host_instructions.DEPTH


def _calls(launcher: Any, layers: list[Any], dropout: float) -> dict[str, Callable[[Any, Any], Any]]:
    """One call per level: ``call(layer, h) -> output``."""
    from loragen.cuda import hostcache, linear_op, native_host
    from loragen.ops import dispatch

    forward = type(layers[0]).forward
    handle = hostcache.launcher_handle(launcher)
    first = layers[0]
    plan = native_host.plan_id(torch.zeros(8, 64), first.lora_A, first.lora_B, False, handle)
    if plan is None:
        raise RuntimeError(f"the C++ host path did not take the layer: {native_host.status()}")
    rng, threshold, keep_scale = hostcache.dropout_args(None, dropout)

    def variant(layer: Any, h: Any) -> Any:
        adapter = layer.running_adapter()
        return adapter.variant.fused_linear(layer, h, adapter)

    # the levels below the variant take the layer's tensors read beforehand, as the variant hands them on
    tensors = {id(layer): (layer.weight, layer.bias, layer.lora_A, layer.lora_B) for layer in layers}

    def dispatched(layer: Any, h: Any) -> Any:
        weight, bias, lora_a, lora_b = tensors[id(layer)]
        return dispatch.lora_linear(h, weight, bias, lora_a, lora_b, SCALING, dropout, True)

    def cuda_op(layer: Any, h: Any) -> Any:
        weight, bias, lora_a, lora_b = tensors[id(layer)]
        return linear_op.lora_linear_cuda(
            h, weight, bias, lora_a, lora_b, SCALING, dropout, True, launcher=launcher
        )

    def cpp_path(layer: Any, h: Any) -> Any:
        weight, bias, lora_a, lora_b = tensors[id(layer)]
        return native_host.try_lora_linear(
            h, weight, bias, lora_a, lora_b, SCALING, dropout, True, False, None, handle
        )

    entry, registered_op = native_host._op[0], torch.ops.loragen_host.lora_linear.default
    args = (rng, True, plan, SCALING, threshold, keep_scale, False)

    def op_entry(layer: Any, h: Any) -> Any:
        weight, bias, lora_a, lora_b = tensors[id(layer)]
        return entry(h, weight, bias, lora_a, lora_b, *args)

    def registered(layer: Any, h: Any) -> Any:
        weight, bias, lora_a, lora_b = tensors[id(layer)]
        return registered_op(h, weight, bias, lora_a, lora_b, *args)

    return {
        "module call": lambda layer, h: layer(h),
        "forward": forward,
        "forward, unguarded": forward.__wrapped__,
        "variant": variant,
        "dispatch": dispatched,
        "CUDA op": cuda_op,
        "C++ path": cpp_path,
        "op entry": op_entry,
        "registered op": registered,
    }


def _child(steps: int, dropout: float) -> None:
    """Inside valgrind: each level's steps between the instrumentation switches."""
    import loragen
    from loragen.layers.base import LoraLayer

    cuda_host = host_instructions._cuda_host()
    control = ctypes.CDLL(os.environ["LORAGEN_MEASURE_LIBRARY"])
    torch.set_num_threads(1)
    with contextlib.ExitStack() as stack:
        launcher = stack.enter_context(cuda_host.stand_in_device())
        stack.enter_context(cuda_host.cuda_op_on_cpu_tensors([launcher]))
        stack.enter_context(switches.cuda_native_host.using(True))
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(DEPTH)])
        config = loragen.LoraConfig(
            r=16, lora_alpha=32, lora_dropout=dropout, target_modules=[str(i) for i in range(DEPTH)]
        )
        model = loragen.get_lora_model(model, config).train()
        layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
        trainable = [p for p in model.parameters() if p.requires_grad]
        x = torch.randn(8, 64, requires_grad=True)
        grad = torch.randn(8, 64)
        calls = _calls(launcher, layers, dropout)
        for level in (*LEVELS, *EXTRA):
            call = calls.get(level)

            def step(call: Callable[[Any, Any], Any] | None = call) -> None:
                x.grad = None
                for p in trainable:
                    p.grad = None
                if call is None:
                    h = model(x)
                else:
                    h = x
                    for layer in layers:
                        h = call(layer, h)
                h.backward(grad)

            host_instructions.measured_steps(control, step, steps)


def count_levels(steps: int = 5, dropout: float = 0.0) -> dict[str, int]:
    """Instructions per layer (forward + backward) entered at each level, counted by callgrind.

    Raises:
        RuntimeError: valgrind, its headers or a compiler missing, or the run failed.
    """
    names = (*LEVELS, *EXTRA)
    totals = host_instructions.callgrind_totals(__file__, [str(steps), str(dropout)], len(names))
    return {level: total // (steps * DEPTH) for level, total in zip(names, totals)}


def main(argv: list[str] | None = None) -> dict[str, int]:
    """Print the instructions per layer at each level, and what each level adds, as a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="measured steps of 8 layers per level")
    parser.add_argument("--dropout", type=float, default=0.0, help="the LoRA layers' dropout")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(int(args.child[0]), float(args.child[1]))
        return {}
    counts = count_levels(args.steps, args.dropout)
    print(f"host instructions per layer entered at each level (C++ host path, dropout {args.dropout})")
    print("| level | instructions | the level adds |")
    print("|---|---|---|")
    levels = [counts[level] for level in LEVELS]
    below: list[int | None] = [*levels[1:], None]
    for level, count, lower in zip(LEVELS, levels, below):
        added = "" if lower is None else f"{count - lower:,}"
        print(f"| {level} | {count:,} | {added} |")
    for extra in EXTRA:
        print(f"\n{extra} (torch.ops, beside the op entry): {counts[extra]:,}")
    return counts


if __name__ == "__main__":
    main()
