"""Shared helpers of the side-by-side benchmarks: interleaved timing, saved-for-backward bytes, tables.

A benchmark is a list of :class:`Variant` (one training step each, plus a forward used to count what
autograd saves). :func:`run_variants` times them round-robin -- every round runs every variant once,
starting from a different one each round -- so that load from other processes and clock drift hit all
of them alike, and reports medians. Saved bytes are counted once per variant with
``torch.autograd.graph.saved_tensors_hooks``, deduplicated by storage, leaving out parameters and
buffers (they live regardless of training).
"""

from __future__ import annotations

import copy
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

__all__ = [
    "MiB", "Result", "Variant", "format_table", "machine_summary", "plain_composition", "run_variants", "saved_bytes",
]

MiB = float(1 << 20)


@dataclass
class Variant:
    """One contestant.

    Attributes:
        name: row label.
        step: one full training step (zero grads, forward, backward, optimizer step if any).
        forward: one forward pass returning the graph's output; run under the saved-tensor hooks.
        keep: tensors whose storages are not counted as saved (parameters, buffers).
    """

    name: str
    step: Callable[[], None]
    forward: Callable[[], Tensor]
    keep: Iterable[Tensor] = ()


@dataclass
class Result:
    """Median step time and saved bytes of one variant."""

    name: str
    times: list[float] = field(default_factory=list)
    saved: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def _storage_key(t: Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def saved_bytes(forward: Callable[[], Tensor], keep: Iterable[Tensor] = ()) -> int:
    """Bytes autograd holds for backward after ``forward()``: every tensor passed to a pack hook,
    counted once per storage (whole storage, so a saved view costs what it keeps alive), leaving out
    the storages of ``keep``.
    """
    kept = {_storage_key(t) for t in keep}
    seen: dict[tuple[str, int], int] = {}

    def pack(t: Tensor) -> Tensor:
        if t.layout == torch.strided and t.device.type != "meta":
            key = _storage_key(t)
            if key not in kept:
                seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    return sum(seen.values())


def plain_composition(model: nn.Module) -> nn.Module:
    """A copy of a loragen model whose LoRA layers run peft's plain composition (``fused = False``)."""
    import loragen

    unfused = copy.deepcopy(model)
    for layer in loragen.convert.find_lora_layers(unfused).values():
        layer.fused = False
    return unfused


def module_tensors(*modules: nn.Module) -> list[Tensor]:
    """Parameters and buffers of ``modules`` (the ``keep`` list of a variant)."""
    return [t for m in modules for t in (*m.parameters(), *m.buffers())]


def run_variants(variants: list[Variant], rounds: int, warmup: int = 2) -> list[Result]:
    """Time ``variants`` round-robin for ``rounds`` rounds after ``warmup`` untimed ones."""
    results = [Result(v.name) for v in variants]
    for v, r in zip(variants, results):
        r.saved = saved_bytes(v.forward, v.keep)
    for _ in range(warmup):
        for v in variants:
            v.step()
    for i in range(rounds):
        for j in range(len(variants)):
            k = (i + j) % len(variants)
            start = time.perf_counter()
            variants[k].step()
            results[k].times.append(time.perf_counter() - start)
    return results


def format_table(results: list[Result], title: str, ratio_to: Iterable[str]) -> str:
    """A Markdown table: median time, ratios to each variant named in ``ratio_to``, saved MiB and
    the saved ratio to the same variants."""
    by_name = {r.name: r for r in results}
    refs = [n for n in ratio_to if n in by_name]
    head = ["variant", "median ms", *[f"time / {n}" for n in refs], "saved MiB", *[f"saved / {n}" for n in refs]]
    lines = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [r.name, f"{r.median * 1e3:.1f}"]
        cells += [f"{r.median / by_name[n].median:.3f}" for n in refs]
        cells.append(f"{r.saved / MiB:.2f}")
        cells += [f"{r.saved / by_name[n].saved:.3f}" if by_name[n].saved else "-" for n in refs]
        lines.append("| " + " | ".join(cells) + " |")
    rounds = min(len(r.times) for r in results)
    lines += ["", f"medians of {rounds} interleaved rounds"]
    return "\n".join(lines)


def machine_summary() -> str:
    """One line naming the machine and the library versions."""
    import peft
    import transformers

    return (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}, peft {peft.__version__}, transformers {transformers.__version__}, "
        f"python {platform.python_version()}"
    )
