"""Shared helpers of the side-by-side benchmarks: interleaved timing, saved-for-backward bytes, tables.

A benchmark is a list of :class:`Variant` (one training step each, plus a forward used to count what
autograd saves). :func:`run_variants` times them round-robin -- every round runs every variant once,
starting from a different one each round -- so that load from other processes and clock drift hit all
of them alike, and reports medians; it writes a progress line per round to stderr. Saved bytes are
counted once per variant with ``torch.autograd.graph.saved_tensors_hooks``, deduplicated by storage,
leaving out parameters and buffers (they live regardless of training). The frozen base is measured the
same way: what it saves is what backward needs to pass gradients through it to earlier layers (a whole
network's activations; nothing for a single frozen ``nn.Linear``, whose ``dx = g W`` needs only the
weight). A ``saved / X`` ratio column is shown only where ``X`` saved something; otherwise a note under
the table says why it is missing.

:func:`format_table` also records each table (with every timing) in the active :func:`recording`, which
is how ``loragen bench --json`` gets the numbers without parsing Markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import copy
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch
from torch import Tensor, nn

__all__ = [
    "add_timing_arguments",
    "benchmark_main",
    "causal_lm_training_variant",
    "dropout_tables",
    "MiB",
    "Recording",
    "Result",
    "Table",
    "Variant",
    "format_table",
    "machine_summary",
    "plain_composition",
    "recording",
    "run_variants",
    "saved_bytes",
    "timing",
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


@dataclass
class Table:
    """One benchmark table: its title, its variants' results, and the variants ratios are taken to."""

    title: str
    results: list[Result]
    ratio_to: list[str]

    def _by_name(self) -> dict[str, Result]:
        return {r.name: r for r in self.results}

    def saved_refs(self) -> list[str]:
        """The references of the ``saved / X`` columns: those that saved something (a ratio to 0 is none)."""
        by_name = self._by_name()
        return [n for n in self.ratio_to if by_name[n].saved > 0]

    def markdown(self) -> str:
        """The table in Markdown: median time, ratios to each reference, saved MiB and saved ratios."""
        by_name = self._by_name()
        refs, saved_refs = self.ratio_to, self.saved_refs()
        head = [
            "variant",
            "median ms",
            *[f"time / {n}" for n in refs],
            "saved MiB",
            *[f"saved / {n}" for n in saved_refs],
        ]
        lines = [f"**{self.title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.results:
            cells = [r.name, f"{r.median * 1e3:.1f}"]
            cells += [f"{r.median / by_name[n].median:.3f}" for n in refs]
            cells.append(f"{r.saved / MiB:.2f}")
            cells += [f"{r.saved / by_name[n].saved:.3f}" for n in saved_refs]
            lines.append("| " + " | ".join(cells) + " |")
        rounds = min(len(r.times) for r in self.results)
        lines += ["", f"medians of {rounds} interleaved rounds"]
        for n in refs:
            if n not in saved_refs:
                lines[-1] += (
                    f"; {n} saves nothing for backward beyond its parameters here, "
                    f"so there is no saved / {n} column"
                )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The table as plain data: per variant the median and every timed round (seconds), the saved
        bytes, and the ratios to each reference (``None`` where the reference saved nothing)."""
        by_name = self._by_name()
        return {
            "title": self.title,
            "rounds": min(len(r.times) for r in self.results),
            "ratio_to": list(self.ratio_to),
            "variants": [
                {
                    "name": r.name,
                    "median_s": r.median,
                    "times_s": list(r.times),
                    "saved_bytes": r.saved,
                    "time_ratio": {n: r.median / by_name[n].median for n in self.ratio_to},
                    "saved_ratio": {
                        n: r.saved / by_name[n].saved if by_name[n].saved else None for n in self.ratio_to
                    },
                }
                for r in self.results
            ],
        }


@dataclass
class Recording:
    """What a benchmark run produced while :func:`recording` was active: the machine line, every table
    in order, and where progress lines go (``None``: nowhere)."""

    progress: TextIO | None = None
    machine: str | None = None
    tables: list[Table] = field(default_factory=list)
    runs: int = 0


_RECORDING: contextvars.ContextVar[Recording | None] = contextvars.ContextVar("loragen_bench", default=None)


@contextlib.contextmanager
def recording(progress: TextIO | None = None) -> Iterator[Recording]:
    """Record the tables :func:`format_table` makes inside the block; progress lines go to ``progress``
    (``None``: none). Outside any recording, progress goes to ``sys.stderr``."""
    record = Recording(progress=progress)
    token = _RECORDING.set(record)
    try:
        yield record
    finally:
        _RECORDING.reset(token)


def _progress(message: str) -> None:
    active = _RECORDING.get()
    stream = sys.stderr if active is None else active.progress
    if stream is not None:
        stream.write(f"bench: {message}\n")
        stream.flush()


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


def causal_lm_training_variant(name: str, model: nn.Module, ids: Tensor) -> Variant:
    """A training step of a causal LM on ``ids`` (labels = inputs): AdamW over what requires grad
    (no optimizer when nothing does, as for a frozen base whose input embeddings take the gradient)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4) if trainable else None

    def forward() -> Tensor:
        return model(input_ids=ids, labels=ids).loss

    def step() -> None:
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        forward().backward()
        if optimizer is not None:
            optimizer.step()

    return Variant(name, step, forward, module_tensors(model))


def run_variants(variants: list[Variant], rounds: int, warmup: int = 2) -> list[Result]:
    """Time ``variants`` round-robin for ``rounds`` rounds after ``warmup`` untimed ones; a progress line
    per round (to stderr, or where the active :func:`recording` says)."""
    active = _RECORDING.get()
    if active is not None:
        active.runs += 1
    label = f"table {active.runs}" if active is not None else "table"
    results = [Result(v.name) for v in variants]
    start = time.perf_counter()
    for v, r in zip(variants, results):
        r.saved = saved_bytes(v.forward, v.keep)
    for i in range(warmup):
        for v in variants:
            v.step()
        _progress(f"{label}: warm-up round {i + 1}/{warmup} ({time.perf_counter() - start:.1f} s)")
    timed = time.perf_counter()
    for i in range(rounds):
        for j in range(len(variants)):
            k = (i + j) % len(variants)
            step_start = time.perf_counter()
            variants[k].step()
            results[k].times.append(time.perf_counter() - step_start)
        per_round = (time.perf_counter() - timed) / (i + 1)
        _progress(
            f"{label}: round {i + 1}/{rounds} of {len(variants)} variants "
            f"({per_round:.2f} s/round, ~{per_round * (rounds - i - 1):.0f} s left)"
        )
    return results


def format_table(results: list[Result], title: str, ratio_to: Iterable[str]) -> str:
    """A Markdown table: median time, ratios to each variant named in ``ratio_to``, saved MiB and the
    saved ratio to those of the same variants that saved something (see :meth:`Table.markdown`). The
    table is also recorded in the active :func:`recording`."""
    names = {r.name for r in results}
    table = Table(title, results, [n for n in ratio_to if n in names])
    active = _RECORDING.get()
    if active is not None:
        active.tables.append(table)
    return table.markdown()


def machine_summary() -> str:
    """One line naming the machine and the library versions."""
    import peft
    import transformers

    line = (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}, peft {peft.__version__}, transformers {transformers.__version__}, "
        f"python {platform.python_version()}"
    )
    active = _RECORDING.get()
    if active is not None:
        active.machine = line
    return line


# ---- the command line of a timed benchmark -------------------------------------------------------------


def add_timing_arguments(
    parser: argparse.ArgumentParser,
    *,
    rounds: int,
    warmup: int = 2,
    quick: str,
    dropout: Sequence[float] | None = None,
) -> None:
    """The options of a benchmark timed by :func:`run_variants`: ``--rounds``, ``--warmup``, ``--quick``
    (``quick`` says what it shrinks to) and, where ``dropout`` gives its defaults, ``--dropout``."""
    if dropout is not None:
        parser.add_argument(
            "--dropout", type=float, nargs="+", default=list(dropout), help="LoRA dropout values"
        )
    parser.add_argument(
        "--rounds", type=int, default=rounds, help=f"timed interleaved rounds (default {rounds})"
    )
    parser.add_argument("--warmup", type=int, default=warmup, help=f"untimed rounds first (default {warmup})")
    parser.add_argument("--quick", action="store_true", help=f"{quick}: a smoke test")


def timing(args: argparse.Namespace) -> tuple[int, int]:
    """(rounds, warm-up rounds): the options' (:func:`add_timing_arguments`), or 3 and 1 with ``--quick``."""
    return (3, 1) if args.quick else (args.rounds, args.warmup)


def dropout_tables(
    args: argparse.Namespace,
    build: Callable[..., list[Variant]],
    *,
    sizes: Mapping[str, int],
    quick_sizes: Mapping[str, int],
    title: Callable[[Mapping[str, int], float], str],
    ratio_to: Iterable[str],
) -> str:
    """One table per ``--dropout`` value: ``build(dropout=p)`` -- with ``quick_sizes`` as keyword arguments
    under ``--quick``, ``build``'s own defaults (``sizes``) otherwise -- timed by :func:`run_variants` and
    titled ``title(shape, p)``; the machine's line first. Returns the Markdown."""
    override = dict(quick_sizes) if args.quick else {}
    shape = {**sizes, **override}
    rounds, warmup = timing(args)
    tables = [f"machine: {machine_summary()}"]
    for p in args.dropout:
        results = run_variants(build(dropout=p, **override), rounds, warmup)
        tables.append(format_table(results, title(shape, p), ratio_to=ratio_to))
    return "\n\n".join(tables)


def benchmark_main(
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], str],
) -> int:
    """A benchmark module's ``main``: its options (``add_arguments``) parsed from ``argv``, and what ``run``
    returns printed."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    print(run(parser.parse_args(argv)))
    return 0


# ---- process memory (Linux) ------------------------------------------------------------------------------


def proc_status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...) in bytes; Linux only."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} (peak memory needs Linux)")
