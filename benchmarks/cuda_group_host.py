"""Host work of a q/k/v sibling group on the CUDA path: one group node against three separate LoRA layers,
counted on the CPU.

    python benchmarks/cuda_group_host.py            # counts per forward + backward, as a table
    python benchmarks/cuda_group_host.py --time     # and host time per group (medians, interleaved)
    python benchmarks/cuda_group_host.py --instructions   # and CPU instructions per group (callgrind)
    python benchmarks/cuda_group_host.py --device-work    # and the kernels a GPU would run, at model sizes
    python benchmarks/cuda_group_host.py --model          # and a small Llama's step, fusion off and on
    python benchmarks/cuda_group_host.py --autocast       # the counts with the forward under bf16 autocast

Three LoRA linears read one x (64 tokens, 1024 -> 1024 each, r = 16, no dropout, float32 adapters); one
step is their forward and one backward of the three outputs. The kernels go to the null driver of
benchmarks/cuda_host.py (every launch's parameter block written, nothing run), so what is counted is the
host path: Python calls, torch ops, allocations and launches (:func:`cuda_host.count_host_work`). Kinds:

* ``separate ops`` / ``group op``: one :func:`~loragen.cuda.linear_op.lora_linear_cuda` calls, or one
  :func:`~loragen.cuda.group_op.lora_group_cuda` call (autograd then adds no x-gradients);
* ``separate layers`` / ``group layers``: a module whose q, k and v (or gate and up) are loragen LoRA layers, run as on a GPU --
  each layer's CUDA op, or sibling fusion's CUDA group -- on CPU tensors (the layers' CPU op replaced by
  the CUDA op, and sibling fusion routed to the CUDA group, both on the null driver): what a model pays,
  the layers' own Python (adapter lookups, eligibility, the leader's hand-out) included;
* ``frozen``: the three base linears alone (``F.linear``, x's gradient only), for scale.

Under autocast (``--autocast``): the counts of float32 x and weights with each forward under the CPU's
bf16 autocast, as Trainer's ``bf16=True`` runs a float32 model's forward (on CPU tensors the op follows the
CPU's autocast as it follows CUDA's on a GPU): each layer's op and the group cast x and the weights to
bf16 and run as without autocast.

Host time (``--time``): microseconds per group's forward + backward on tiny tensors (8 tokens, 64
features) on one thread, rounds of each kind interleaved, medians. What it leaves out on a GPU: the
driver's own work per launch (about 2 us each for ``cuLaunchKernel`` on an H100 host), the caching
allocator's, and cuBLAS's host work per product.

Kernels a GPU would run (``--device-work``): per group's forward + backward at a model's sizes (2048
tokens, 2048 features, r = 16, bfloat16 x), on ``meta`` tensors (shapes, no values): loragen's launches
and the torch ops that launch a kernel of their own on a CUDA device (products, copies, concatenations,
sums and fills; not views or allocations), as each costs the host a launch.

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
import importlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "GROUPS",
    "KINDS",
    "device_work",
    "group_counts",
    "group_instructions",
    "group_step",
    "group_times",
    "main",
]

KINDS = ("frozen", "separate ops", "group op", "separate layers", "group layers")
# each group's members' output features, as multiples of the input's (as in a Llama of hidden 2048 and
# intermediate 5504, the model of benchmarks/bench_cuda.py)
GROUPS: dict[str, tuple[float, ...]] = {"q, k, v": (1.0, 1.0, 1.0), "gate, up": (2.6875, 2.6875)}


def _outs(group: str, features: int) -> tuple[int, ...]:
    return tuple(int(features * ratio) // 8 * 8 for ratio in GROUPS[group])


def _sibling(name: str) -> Any:
    """benchmarks/<name>.py, as a package module or from this folder."""
    if __package__:
        return importlib.import_module(f"{__package__}.{name}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    return importlib.import_module(name)


def _cuda_host() -> Any:
    return _sibling("cuda_host")


class _QKV(nn.Module):
    def __init__(self, features: int, outs: tuple[int, ...]) -> None:
        super().__init__()
        self.q = nn.Linear(features, outs[0], bias=False)
        self.k = nn.Linear(features, outs[1], bias=False)
        self.v = nn.Linear(features, outs[2], bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = self.q(x)
        k = self.k(x)
        v = self.v(x)
        return q, k, v


class _GateUp(nn.Module):
    def __init__(self, features: int, outs: tuple[int, ...]) -> None:
        super().__init__()
        self.gate = nn.Linear(features, outs[0], bias=False)
        self.up = nn.Linear(features, outs[1], bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate = self.gate(x)
        up = self.up(x)
        return gate, up


@contextlib.contextmanager
def _as_on_a_gpu(launcher: object) -> Iterator[None]:
    """loragen's layers take the CUDA path on CPU tensors: each layer's CUDA op, and sibling fusion's
    CUDA group, on ``launcher``."""
    from loragen.ops import siblings

    def runner(x: torch.Tensor) -> Any:
        return siblings._cuda_group

    with (
        _cuda_host().cuda_op_on_cpu_tensors([launcher]),
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
    device: str = "cpu",
    outs: tuple[int, ...] | None = None,
    autocast: bool = False,
) -> Callable[[], None]:
    """One forward + backward of LoRA linears reading one x -- q, k and v of ``features`` outputs each, or
    with ``outs`` two (gate and up) or three of those sizes --, as ``kind`` (see the module docstring);
    the layer kinds must run inside :func:`_as_on_a_gpu`. ``autocast``: the forward under bf16 autocast
    of ``device``.

    Raises:
        ValueError: an unknown ``kind``.
    """
    import loragen
    from loragen import switches
    from loragen.cuda.group_op import lora_group_cuda
    from loragen.cuda.linear_op import lora_linear_cuda

    gen = torch.Generator().manual_seed(0)

    def random(*shape: int, scale: float = 1.0, to: torch.dtype = torch.float32) -> torch.Tensor:
        if device == "meta":
            return torch.empty(shape, dtype=to, device=device)
        return (torch.randn(shape, generator=gen) * scale).to(to)

    outs = (features,) * 3 if outs is None else outs
    x = random(tokens, features, to=dtype).requires_grad_()
    grads = [random(tokens, out, to=dtype) for out in outs]
    weights = [random(out, features, scale=features**-0.5, to=dtype) for out in outs]
    factors = [
        (
            random(rank, features, scale=features**-0.5).requires_grad_(),
            random(out, rank, scale=0.02).requires_grad_(),
        )
        for out in outs
    ]
    leaves = [x] + [t for pair in factors for t in pair]
    if kind == "frozen":

        def forward() -> tuple[torch.Tensor, ...]:
            return tuple(torch.nn.functional.linear(x, w) for w in weights)
    elif kind == "separate ops":

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
    elif kind in ("separate layers", "group layers"):
        torch.manual_seed(0)
        module = (_QKV if len(outs) == 3 else _GateUp)(features, outs).to(dtype)
        targets = [name for name, _ in module.named_children()]
        model = loragen.get_lora_model(
            module, loragen.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets)
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

    if not autocast:
        return step
    grads_bf16 = [g.to(torch.bfloat16) for g in grads]  # the outputs' dtype under autocast

    def step_under_autocast() -> None:
        for t in leaves:
            t.grad = None
        with torch.autocast(device, dtype=torch.bfloat16):
            outputs = forward()
        torch.autograd.backward(list(outputs), grads_bf16)

    return step_under_autocast


# ops that only make views or allocate: no kernel of their own on a CUDA device
_NO_KERNEL = frozenset(
    {
        "view",
        "_unsafe_view",
        "t",
        "transpose",
        "select",
        "slice",
        "narrow",
        "split",
        "split_with_sizes",
        "unbind",
        "as_strided",
        "reshape",
        "expand",
        "detach",
        "alias",
        "squeeze",
        "unsqueeze",
        "permute",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "resolve_conj",
        "resolve_neg",
    }
)


class _KernelOps(TorchDispatchMode):
    """Records the torch ops dispatched inside it that would launch a kernel on a CUDA device."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        name = func.overloadpacket.__name__
        if name not in _NO_KERNEL:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def device_work(
    group: str = "q, k, v",
    tokens: int = 2048,
    features: int = 2048,
    rank: int = 16,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, dict[str, int]]:
    """Per forward + backward of ``group`` (a key of :data:`GROUPS`) at these sizes, for "separate ops" and "group op": loragen's kernel
    launches and torch's kernel-launching ops, each op by name (on ``meta`` tensors, the null driver)."""
    cuda_host = _cuda_host()
    results = {}
    for kind in ("separate ops", "group op"):
        launcher = cuda_host.NullLauncher()
        step = group_step(
            kind,
            launcher,
            tokens=tokens,
            features=features,
            rank=rank,
            dtype=dtype,
            device="meta",
            outs=_outs(group, features),
        )
        step()  # plans and caches
        launcher.launches.clear()
        recorder = _KernelOps()
        with recorder:
            step()
        found: dict[str, int] = {
            "loragen launches": len(launcher.launches),
            "torch kernels": len(recorder.ops),
        }
        for name in sorted(set(recorder.ops)):
            found[name] = recorder.ops.count(name)
        results[kind] = found
    return results


MODEL_KINDS = ("frozen model", "separate layers model", "group layers model")


def model_step(kind: str, *, hidden: int = 64, layers: int = 2, seq: int = 16) -> Callable[[], None]:
    """One training step (forward, loss, backward) of a small Llama (``hidden``, intermediate 2.6875 x
    hidden, ``layers`` layers, 4 heads, vocabulary 128, one sequence of ``seq`` tokens, float32) as
    ``kind``: frozen (the input embeddings' gradient only), or with LoRA (r = 16, no dropout) on q, k, v,
    o, gate, up and down, sibling fusion off or on; the LoRA kinds must run inside :func:`_as_on_a_gpu`.

    Raises:
        ValueError: an unknown ``kind``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    import loragen
    from loragen import switches

    if kind not in MODEL_KINDS:
        raise ValueError(f"model_step: kind={kind!r}; expected one of {', '.join(map(repr, MODEL_KINDS))}")
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.6875) // 8 * 8,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=128,
        max_position_embeddings=max(seq, 16),
    )
    model: nn.Module = LlamaForCausalLM(config)
    if kind == "frozen model":
        model.requires_grad_(False)
    else:
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = loragen.get_lora_model(model, loragen.LoraConfig(r=16, lora_alpha=32, target_modules=targets))
    model.train()
    gen = torch.Generator().manual_seed(1)
    embeds = torch.randn(1, seq, hidden, generator=gen).requires_grad_()
    labels = torch.randint(0, 128, (1, seq), generator=gen)
    leaves = [embeds] + [p for p in model.parameters() if p.requires_grad]
    fuse = kind == "group layers model"

    def step() -> None:
        for t in leaves:
            t.grad = None
        with switches.sibling_fusion.using(fuse):
            model(inputs_embeds=embeds, labels=labels).loss.backward()

    return step


def group_counts(
    group: str = "q, k, v", dtype: torch.dtype = torch.float32, autocast: bool = False
) -> dict[str, Any]:
    """:class:`cuda_host.Counts` per forward + backward of ``group`` for each of :data:`KINDS` (64 tokens,
    1024 features); ``autocast``: the forwards under bf16 autocast."""
    cuda_host = _cuda_host()
    results = {}
    for kind in KINDS:
        launcher = cuda_host.NullLauncher()
        with _as_on_a_gpu(launcher):
            step = group_step(kind, launcher, dtype=dtype, outs=_outs(group, 1024), autocast=autocast)
            results[kind] = cuda_host.count_host_work(step, launcher)
    return results


def group_times(
    dtype: torch.dtype = torch.float32,
    outs: tuple[int, ...] | None = None,
    *,
    rounds: int = 15,
    calls: int = 50,
    tokens: int = 8,
    features: int = 64,
) -> dict[str, float]:
    """Median host microseconds per group's forward + backward of each of :data:`KINDS`, on one thread,
    the kinds interleaved within each round."""
    launcher = _cuda_host().NullLauncher()
    with _as_on_a_gpu(launcher):
        steps = {
            kind: group_step(kind, launcher, dtype=dtype, tokens=tokens, features=features, outs=outs)
            for kind in KINDS
        }
        return _interleaved(steps, launcher, rounds, calls)


def model_times(rounds: int = 9, calls: int = 10) -> dict[str, float]:
    """Median host milliseconds per training step of :func:`model_step`'s model, each of
    :data:`MODEL_KINDS`, on one thread, interleaved."""
    launcher = _cuda_host().NullLauncher()
    with _as_on_a_gpu(launcher):
        steps = {kind: model_step(kind) for kind in MODEL_KINDS}
        return {kind: t / 1000 for kind, t in _interleaved(steps, launcher, rounds, calls).items()}


def _interleaved(
    steps: dict[str, Callable[[], None]], launcher: Any, rounds: int, calls: int
) -> dict[str, float]:
    """Median microseconds per call of each step, on one thread, the steps interleaved within each round."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {kind: [] for kind in steps}
    try:
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


def _child(steps: int, group: str, kinds: list[str]) -> None:
    """Inside valgrind: each kind's steps between the instrumentation switches."""
    cuda_host = _cuda_host()
    control = ctypes.CDLL(os.environ["LORAGEN_MEASURE_LIBRARY"])
    torch.set_num_threads(1)
    with cuda_host.stand_in_device() as launcher, _as_on_a_gpu(launcher):
        for kind in kinds:
            if group == "llama":
                step = model_step(kind)
            else:
                step = group_step(kind, launcher, tokens=8, features=64, outs=_outs(group, 64))
            _sibling("host_instructions").measured_steps(control, step, steps)


def group_instructions(
    group: str = "q, k, v", steps: int = 5, kinds: tuple[str, ...] = KINDS
) -> dict[str, int]:
    """CPU instructions per forward + backward of ``group`` of each kind, counted by callgrind (8 tokens,
    64 features); ``group`` "llama": per training step of :func:`model_step`'s model, of each of
    :data:`MODEL_KINDS`.

    Raises:
        RuntimeError: valgrind, its headers, a C compiler or cuda-python missing, or the run failed.
    """
    host_instructions = _sibling("host_instructions")
    totals = host_instructions.callgrind_totals(__file__, [str(steps), group, *kinds], len(kinds))
    return {kind: total // steps for kind, total in zip(kinds, totals)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Print the counts (and with ``--time`` the host times) for float32 and bfloat16 x."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--time", action="store_true", help="also time the host path of each kind")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="also count CPU instructions per kind (callgrind, minutes)",
    )
    parser.add_argument(
        "--device-work", action="store_true", help="also count the kernels a GPU would run at model sizes"
    )
    parser.add_argument(
        "--model",
        action="store_true",
        help="also a small Llama's training step, sibling fusion off and on (times; with --instructions, callgrind)",
    )
    parser.add_argument(
        "--autocast",
        action="store_true",
        help="also the counts of float32 x and weights with the forward under bf16 autocast",
    )
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(int(args.child[0]), args.child[1], args.child[2:])
        return {}
    cuda_host = _cuda_host()
    report: dict[str, Any] = {}
    for group in GROUPS:
        found: dict[str, Any] = report.setdefault(group, {})
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            counts = group_counts(group, dtype)
            outs = " + ".join(map(str, _outs(group, 1024)))
            print(f"\nhost work per forward + backward of {group}: 64 tokens, 1024 -> {outs}, r=16, x {name}")
            print(cuda_host.counts_table(counts))
            found[name] = {kind: asdict(c) for kind, c in counts.items()}
        if args.autocast:
            counts = group_counts(group, torch.float32, autocast=True)
            outs = " + ".join(map(str, _outs(group, 1024)))
            print(
                f"\nhost work per forward + backward of {group}: 64 tokens, 1024 -> {outs}, r=16, x float32,"
                " forward under bf16 autocast"
            )
            print(cuda_host.counts_table(counts))
            found["autocast"] = {kind: asdict(c) for kind, c in counts.items()}
        if args.time:
            print(f"\nhost time per forward + backward of {group} (us, median), 8 tokens, 64 features, r=16")
            print("| x | " + " | ".join(KINDS) + " |")
            print("|---" * (len(KINDS) + 1) + "|")
            for dtype in (torch.float32, torch.bfloat16):
                name = str(dtype).removeprefix("torch.")
                times = group_times(dtype, outs=_outs(group, 64))
                print(f"| {name} | " + " | ".join(f"{times[k]:.0f}" for k in KINDS) + " |")
                found[name]["time_us"] = times
        if args.device_work:
            work = device_work(group)
            outs = " + ".join(map(str, _outs(group, 2048)))
            print(
                f"\nkernels per forward + backward of {group}: 2048 tokens, 2048 -> {outs}, r=16, x bfloat16"
            )
            names = sorted(
                {n for counted in work.values() for n in counted} - {"loragen launches", "torch kernels"}
            )
            print("| kind | loragen launches | torch kernels | " + " | ".join(names) + " |")
            print("|---" * (3 + len(names)) + "|")
            for kind, counted in work.items():
                cells = [str(counted["loragen launches"]), str(counted["torch kernels"])]
                cells += [str(counted.get(n, 0)) for n in names]
                print(f"| {kind} | " + " | ".join(cells) + " |")
            found["device_work"] = work
        if args.instructions:
            instructions = group_instructions(group)
            print(
                f"\nCPU instructions per forward + backward of {group} (8 tokens, 64 features, r=16, float32)"
            )
            print("| kind | instructions | / separate layers |")
            print("|---|---|---|")
            for kind, count in instructions.items():
                print(f"| {kind} | {count:,} | {count / instructions['separate layers']:.2f} |")
            found["instructions"] = instructions
    if args.model:
        found = report.setdefault("llama", {})
        print(
            "\nsmall Llama (hidden 64, 2 layers, 16 tokens), LoRA r=16 on q, k, v, o, gate, up, down, no dropout"
        )
        found["time_ms"] = times = model_times()
        print("host ms per step (median): " + ", ".join(f"{kind} {t:.2f}" for kind, t in times.items()))
        if args.instructions:
            found["instructions"] = counts = group_instructions("llama", steps=3, kinds=MODEL_KINDS)
            print("CPU instructions per step: " + ", ".join(f"{kind} {n:,}" for kind, n in counts.items()))
    return report


if __name__ == "__main__":
    main()
