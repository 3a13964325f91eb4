"""GPU benchmark of loragen's CUDA LoRA op against peft and the frozen base.

    python benchmarks/bench_cuda.py --quick --json bench.json   # everything, about 3 minutes on an H100
    python benchmarks/bench_cuda.py                             # the same with more rounds
    python benchmarks/bench_cuda.py --only model --batches 8 --dropouts 0.05
    python benchmarks/bench_cuda.py --only host                 # host-work counts (no GPU needed)
    python benchmarks/bench_cuda.py --only model --batches 1 --autocast  # forward under bf16 autocast

Without a CUDA device (or cuda-python) it says so and exits 2, except ``--only host``. Parts, in order:

1. ``layer``: the device and two measured ceilings (device-to-device copy bandwidth, a bf16 8192^3
   product); Linear 4096x4096 (no bias), 4096 tokens, r=16, bf16 base and float32 adapter,
   forward + backward with grad_x: frozen base, peft, loragen, p = 0 and 0.1, and the frozen base and
   loragen captured in CUDA graphs (their ratio is the adapter's device-side cost, host work aside);
2. ``kernels``: each loragen kernel alone on that layer: time, minimum bytes, achieved bandwidth;
3. ``small``: host overhead, Linear 1024x1024, 64 tokens, r=16: frozen base, peft, loragen, and the
   frozen base and loragen steps captured in CUDA graphs (``torch.cuda.graphs``) and replayed;
4. ``model``: a Llama-shaped model (hidden 2048, 8 layers, intermediate 5504, 16 heads, seq 2048, LoRA
   r=16 on all seven projections, bf16 base, float32 adapters, AdamW), one training step at batch 1 and
   8, dropout 0 and 0.05: frozen base, peft, loragen, and the frozen base's and loragen's whole steps
   captured in CUDA graphs (AdamW with ``capturable=True``); step time, peak memory (for a graphed step:
   the device memory it holds, its graph's pool included);
5. ``host``: Python calls, torch ops and allocations per forward + backward (benchmarks/cuda_host.py).

Timing: CUDA events around each call, warm-up first, variants interleaved round by round (the order
rotates), medians. Inputs are random (B is not left at zero). The last lines are one markdown table of
every case (ratios loragen/peft and loragen/frozen); ``--json`` writes all numbers.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

GiB = float(1 << 30)
MB = 1e6
PARTS = ("layer", "kernels", "small", "model", "host")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def cuda_time(fn: Callable[[], object], inner: int = 1) -> float:
    """Milliseconds per call of ``fn`` over ``inner`` back-to-back calls, measured with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(inner):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / inner


def interleaved(
    variants: Mapping[str, Callable[[], object]], rounds: int, inner: int = 1, warmup: int = 3
) -> dict[str, float]:
    """Median milliseconds per call of each variant, timed round-robin with a rotating order."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(cuda_time(variants[name], inner))
    return {name: statistics.median(values) for name, values in times.items()}


class Replay:
    """A step captured into a CUDA graph; calling it replays the graph. It holds the step, and through it
    the model, optimizer and inputs the graph reads: a ``CUDAGraph`` keeps none of them alive, and a graph
    whose tensors were freed (their memory handed back to the driver by the next ``empty_cache``) reads
    unmapped memory when it replays."""

    __slots__ = ("graph", "step")

    def __init__(self, graph: torch.cuda.CUDAGraph, step: Callable[[], object]) -> None:
        self.graph = graph
        self.step = step

    def __call__(self) -> None:
        self.graph.replay()


def captured(step: Callable[[], object], warmup: int = 3) -> Replay:
    """``step`` captured into a CUDA graph (after a warm-up on a side stream); returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return Replay(graph, step)


# ---- ceilings -----------------------------------------------------------------------------------------


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    ms = statistics.median(cuda_time(lambda: dst.copy_(src)) for _ in range(20))
    return 2 * (1 << 30) / (ms * 1e-3) / 1e9


def gemm_rate() -> float:
    """TFLOP/s of an 8192^3 bf16 matrix product on random data."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    ms = statistics.median(cuda_time(lambda: a @ b) for _ in range(10))
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def ceilings() -> dict[str, float]:
    """The device's measured copy bandwidth and bf16 GEMM rate."""
    limits = {"copy_GBps": copy_bandwidth(), "bf16_gemm_TFLOPs": gemm_rate()}
    torch.cuda.empty_cache()
    return limits


# ---- one layer ----------------------------------------------------------------------------------------


class Holder(nn.Module):
    """peft needs a parent module to find the target in."""

    def __init__(self, proj: nn.Linear) -> None:
        super().__init__()
        self.proj = proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def layer_benchmark(
    tokens: int,
    features: int,
    rank: int,
    dropout: float,
    rounds: int,
    inner: int = 5,
    graph: bool = False,
) -> dict[str, float]:
    """Median ms of forward + backward (grad_x) of one layer: frozen base, peft, loragen (and, with
    ``graph``, the frozen base and loragen replayed from CUDA graphs: their ratio is the device-side cost
    of the adapter, with no host work in the way)."""
    import peft

    from loragen.layers import LoraLinear

    torch.manual_seed(0)
    dtype = torch.bfloat16
    base = nn.Linear(features, features, bias=False, device="cuda", dtype=dtype).requires_grad_(False)
    x = torch.randn(tokens, features, device="cuda", dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, features, device="cuda", dtype=dtype)
    peft_model = peft.get_peft_model(
        Holder(nn.Linear(features, features, bias=False, device="cuda", dtype=dtype)),
        peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout, target_modules=["proj"]),
    )
    loragen_layer = LoraLinear.from_module(
        base, r=rank, lora_alpha=2 * rank, lora_dropout=dropout, use_rslora=False, init_lora_weights=True
    )
    for model in (peft_model, loragen_layer):
        model.train()
        for name, param in model.named_parameters():
            if "lora_B" in name:
                nn.init.normal_(param, std=0.02)  # never time on zeros

    def step(module: nn.Module, inputs: torch.Tensor = x, keep_grads: bool = False) -> Callable[[], None]:
        params = [p for p in module.parameters() if p.requires_grad]

        def run() -> None:
            if not keep_grads:  # a captured step accumulates into the grads its warm-up allocated
                inputs.grad = None
                for p in params:
                    p.grad = None
            module(inputs).backward(grad)

        return run

    variants = {"frozen base": step(base), "peft": step(peft_model), "loragen": step(loragen_layer)}
    if graph:
        # a graph accumulates into gradient tensors of its own input and layer: the eager steps set x's and
        # their layers' .grad to None, which would free the tensors a graph shared with them writes into
        for kind, layer in (("frozen base graphed", base), ("loragen graphed", loragen_layer)):
            own = x.detach().clone().requires_grad_(True)
            variants[kind] = captured(step(copy.deepcopy(layer), own, keep_grads=True))
    return interleaved(variants, rounds, inner=inner)


def kernel_benchmark(
    tokens: int, features: int, rank: int, dropout: float, rounds: int, copy_GBps: float
) -> list[dict]:
    """Each loragen kernel alone on the layer: us, minimum MB moved, GB/s, share of copy bandwidth."""
    from loragen import philox
    from loragen.cuda import kernels
    from loragen.cuda.launch import default_launcher
    from loragen.cuda.linear_op import seed_rng

    torch.manual_seed(0)
    n, k, o, b = tokens, features, features, 2  # bf16
    x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(n, o, device="cuda", dtype=torch.bfloat16)
    R = kernels.rank_bucket(rank)
    a32 = torch.zeros(R, k, device="cuda")
    a32[:rank] = torch.randn(rank, k, device="cuda") / k**0.5
    bt32 = torch.zeros(R, o, device="cuda")
    bt32[:rank] = torch.randn(rank, o, device="cuda")
    plan = kernels.Plan(x, o, rank, default_launcher())
    rng = seed_rng(1234, x.device)
    drop = (rng, philox.keep_threshold(dropout), philox.keep_scale(dropout)) if dropout else (None, 0, 1.0)
    h = kernels.down(plan, x, a32, drop)
    dh, _ = kernels.grad_out(plan, g, h, bt32, 1.0)
    out = torch.zeros(n, o, device="cuda", dtype=torch.bfloat16)  # the base product lora_up adds onto
    R = plan.variant.rank_bucket

    def up() -> None:
        kernels.up(plan, h, bt32, None, 1.0, out)

    timed = {  # minimum bytes: each large operand read or written once
        "lora_down  (h = drop(x) A^T)": (
            lambda: kernels.down(plan, x, a32, drop),
            n * k * b + n * R * 4 + rank * k * 4,
        ),
        "lora_up    (y += s h B^T, in place)": (up, 2 * n * o * b + n * R * 4 + rank * o * 4),
        "lora_grad_out (dh, dB)": (
            lambda: kernels.grad_out(plan, g, h, bt32, 1.0),
            n * o * b + 2 * n * R * 4 + o * R * 4,
        ),
        "lora_grad_in  (dA, gx0)": (
            lambda: kernels.grad_in(plan, x, dh, a32, drop, True),
            2 * n * k * b + n * R * 4 + R * k * 4,
        ),
    }
    times = interleaved({name: fn for name, (fn, _) in timed.items()}, rounds, inner=10)
    rows = []
    for name, (_, nbytes) in timed.items():
        gbps = nbytes / (times[name] * 1e-3) / 1e9
        rows.append(
            {
                "kernel": name,
                "us": times[name] * 1e3,
                "min_MB": nbytes / MB,
                "GBps": gbps,
                "of_copy": gbps / copy_GBps,
            }
        )
    return rows


# ---- a Llama-shaped model -----------------------------------------------------------------------------


def build_model(kind: str, rank: int, dropout: float) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """The model of part 4 on the GPU: "frozen base", "peft", "loragen", "frozen base graphed" or
    "loragen graphed" (the graphed loragen with a capturable AdamW)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=2048,
        intermediate_size=5504,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
        max_position_embeddings=2048,
    )
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model: nn.Module = LlamaForCausalLM(config).bfloat16()
    if kind.startswith("frozen base"):
        model.requires_grad_(False)
        # gradients still flow through every layer, as in a LoRA step, minus the adapters
        embeddings = model.get_input_embeddings()  # type: ignore[operator]  # nn.Module's __getattr__
        embeddings.register_forward_hook(lambda module, args, out: out.requires_grad_(True))
    elif kind == "peft":
        import peft

        peft_config = peft.LoraConfig(
            r=rank, lora_alpha=2 * rank, lora_dropout=dropout, target_modules=TARGETS
        )
        model = peft.get_peft_model(model, peft_config)
    else:
        import loragen

        lora = loragen.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout, target_modules=TARGETS)
        model = loragen.get_lora_model(model, lora)
    model.train()
    for name, param in model.named_parameters():
        if "lora_" in name and param.dtype != torch.float32:
            param.data = param.data.float()  # float32 adapters on the bf16 base, as peft makes them
        if "lora_B" in name:
            nn.init.normal_(param, std=0.02)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = (
        torch.optim.AdamW(trainable, lr=1e-4, capturable=kind.endswith("graphed")) if trainable else None
    )
    return model, optimizer


def model_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    ids: torch.Tensor,
    graphed: bool = False,
    autocast: bool = False,
) -> Callable[[], None]:
    """One training step; ``graphed``: the step is captured once and replayed (grads stay allocated);
    ``autocast``: the forward under bf16 autocast, the backward after it."""

    def run() -> None:
        if graphed and optimizer is not None:
            optimizer.zero_grad(set_to_none=False)  # the grads live in the graph's memory: zero them there
        # a captured step must not keep autocast's cast copies across replays: no cache when graphed
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast, cache_enabled=not graphed):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            if not graphed:
                optimizer.zero_grad(set_to_none=True)

    if not graphed:
        return run
    return captured(run)


def model_benchmark(
    seq: int,
    batch: int,
    rank: int,
    dropout: float,
    rounds: int,
    graph: bool,
    autocast: bool = False,
) -> dict[str, dict[str, float]]:
    """Step ms, resident and peak memory of each kind; all kinds resident, timed interleaved; with
    ``autocast`` each forward runs under bf16 autocast.

    A graphed kind's temporaries live in its graph's private memory pool, which the allocator no longer
    counts as allocated once capture ends; its peak is the device memory it holds after capture (the
    allocator's reserved bytes, unused cache released before and after): parameters, optimizer states and
    the graph's pool together."""
    kinds = ["frozen base", "peft", "loragen"]
    kinds += ["frozen base graphed", "loragen graphed"] if graph else []
    ids = torch.randint(
        0, 32000, (batch, seq), device="cuda", generator=torch.Generator("cuda").manual_seed(0)
    )
    results: dict[str, dict[str, float]] = {}
    steps = {}
    for kind in kinds:
        graphed = kind.endswith("graphed")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before, reserved_before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        try:
            model, optimizer = build_model(kind, rank, dropout)
            step = model_step(model, optimizer, ids, graphed=graphed, autocast=autocast)
            for _ in range(2):  # grads and optimizer states exist from here on
                step()
        except Exception as exc:  # a failed capture is reported, the other kinds still run
            print(f"  {kind}: could not run ({type(exc).__name__}: {str(exc)[:300]})")
            torch.cuda.synchronize()
            continue
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated() - before
        if graphed:
            torch.cuda.empty_cache()
            held = torch.cuda.memory_reserved() - reserved_before
            results[kind] = {"resident_GiB": resident / GiB, "peak_GiB": held / GiB}
            steps[kind] = step
            continue
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        above = torch.cuda.max_memory_allocated() - start
        results[kind] = {
            "resident_GiB": resident / GiB,
            "step_above_resident_GiB": above / GiB,
            "peak_GiB": (resident + above) / GiB,
        }
        steps[kind] = step
    for kind, ms in interleaved(steps, rounds, warmup=1).items():
        results[kind]["step_ms"] = ms
    del steps
    torch.cuda.empty_cache()
    return results


# ---- tables -------------------------------------------------------------------------------------------


def summary_rows(report: dict) -> list[dict[str, object]]:
    """One row per measured case of ``report`` (as :func:`main` builds it): ms of each variant, ratios
    loragen/peft and loragen/frozen, and peak GiB where measured."""
    rows: list[dict[str, object]] = []
    cases: list[tuple[str, dict[str, float], dict[str, dict[str, float]]]]
    cases = [(f"layer 4096, {p}", t, {}) for p, t in report.get("layer", {}).items()]
    cases += [(f"small 1024x64, {p}", t, {}) for p, t in report.get("small", {}).items()]
    for case, kinds in report.get("model", {}).items():
        cases.append((f"model {case}", {k: v["step_ms"] for k, v in kinds.items() if "step_ms" in v}, kinds))
    for case, times, memory in cases:
        base, peft_ms, ours = times.get("frozen base"), times.get("peft"), times.get("loragen")
        row: dict[str, object] = {"case": case, **{f"{k} ms": v for k, v in times.items()}}
        if ours is not None and peft_ms:
            row["loragen/peft"] = ours / peft_ms
        if ours is not None and base:
            row["loragen/frozen"] = ours / base
        graphed_base, graphed_ours = times.get("frozen base graphed"), times.get("loragen graphed")
        if graphed_base and graphed_ours is not None:
            row["graphed loragen/frozen"] = graphed_ours / graphed_base
        # a graph replays only the device's work: above 1 where capture itself costs device time
        if graphed_base and base:
            row["frozen graphed/eager"] = graphed_base / base
        if graphed_ours is not None and ours:
            row["loragen graphed/eager"] = graphed_ours / ours
        for kind, numbers in memory.items():
            row[f"{kind} peak GiB"] = numbers["peak_GiB"]
        rows.append(row)
    return rows


def markdown_table(rows: Sequence[dict[str, object]]) -> str:
    """``rows`` as one markdown table; columns in first-seen order, numbers with 3 significant digits
    (ratios as 0.00x), missing cells empty."""
    columns: list[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]

    def cell(column: str, value: object) -> str:
        if value is None:
            return ""
        if isinstance(value, float):
            return f"{value:.2f}x" if "/" in column else f"{value:.3g}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(c, row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; ``--quick`` sets rounds to 5 (model rounds 3) unless given."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", action="append", choices=PARTS, help="run this part (repeatable); default: all"
    )
    parser.add_argument(
        "--rounds", type=int, help="interleaved rounds per layer case (default 20, --quick 5)"
    )
    parser.add_argument("--model-rounds", type=int, help="rounds per model case (default 10, --quick 3)")
    parser.add_argument(
        "--quick", action="store_true", help="few rounds: everything in about 3 minutes on an H100"
    )
    parser.add_argument("--batches", default="1,8", help="model batch sizes (default 1,8)")
    parser.add_argument("--dropouts", default="0,0.05", help="model LoRA dropouts (default 0,0.05)")
    parser.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph variants")
    parser.add_argument(
        "--autocast", action="store_true", help="model steps with the forward under bf16 autocast"
    )
    parser.add_argument("--json", help="write all numbers to this file")
    args = parser.parse_args(argv)
    args.parts = tuple(args.only or PARTS)
    args.rounds = args.rounds or (5 if args.quick else 20)
    args.model_rounds = args.model_rounds or (3 if args.quick else 10)
    try:
        args.batch_list = [int(b) for b in args.batches.split(",")]
        args.dropout_list = [float(p) for p in args.dropouts.split(",")]
    except ValueError:
        parser.error(f"--batches {args.batches!r} / --dropouts {args.dropouts!r}: comma-separated numbers")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import loragen.cuda
    import loragen.switches

    report: dict[str, object] = {}
    if "host" in args.parts:
        # benchmarks.cuda_host as a package module, or from benchmarks/ (sys.path[0]) when run as a script
        cuda_host = importlib.import_module(f"{__package__}.cuda_host" if __package__ else "cuda_host")
        report["host"] = cuda_host.main([])
    gpu_parts = [p for p in args.parts if p != "host"]
    if gpu_parts and not loragen.cuda.is_available():
        print(
            f"bench_cuda: parts {', '.join(gpu_parts)} need a CUDA device and cuda-python "
            f"(torch.cuda.is_available() = {torch.cuda.is_available()}); nothing measured",
            file=sys.stderr,
        )
        return 2
    if gpu_parts:
        report.update(device=torch.cuda.get_device_name(), torch=torch.__version__)
        report["capability"] = "sm_{}{}".format(*torch.cuda.get_device_capability())
        report["ceilings"] = limits = ceilings()
        print(f"device: {report['device']} ({report['capability']}), torch {torch.__version__}")
        print(
            f"measured: copy {limits['copy_GBps']:.0f} GB/s (read + write), bf16 GEMM {limits['bf16_gemm_TFLOPs']:.0f} TFLOP/s"
        )
    if "layer" in args.parts:
        report["layer"] = {
            f"p={p}": layer_benchmark(4096, 4096, 16, p, args.rounds, graph=not args.no_graph)
            for p in (0.0, 0.1)
        }
    if "kernels" in args.parts:
        for p in (0.0, 0.1):
            report[f"kernels p={p}"] = rows = kernel_benchmark(
                4096, 4096, 16, p, args.rounds, limits["copy_GBps"]
            )
            print(f"\nloragen kernels alone, layer 4096x4096, 4096 tokens, r=16, bf16, lora_dropout={p}")
            print(markdown_table(rows))
    if "small" in args.parts:
        graph = not args.no_graph
        report["small"] = {
            f"p={p}": layer_benchmark(64, 1024, 16, p, args.rounds, inner=20, graph=graph)
            for p in (0.0, 0.05)
        }
    if "model" in args.parts:
        report["model"] = model = {}
        for batch in args.batch_list:
            for p in args.dropout_list:
                case = f"batch {batch}, p={p}" + (", autocast" if args.autocast else "")
                print(f"\nmodel: {case}", flush=True)
                model[case] = model_benchmark(
                    2048, batch, 16, p, args.model_rounds, not args.no_graph, args.autocast
                )

    if gpu_parts:
        from loragen.cuda.selfcheck import default_checker

        report["selfcheck"] = outcomes = default_checker().outcomes()
        report["cuda_kernels_switch"] = loragen.switches.cuda_kernels.get()
        print(f"\nself-check outcomes (LORAGEN_CUDA_KERNELS={report['cuda_kernels_switch']}):")
        for variant, outcome in outcomes.items():
            print(f"  {variant}: {outcome}")
        if any(outcome != "ok" for outcome in outcomes.values()):
            print("  WARNING: variants above run on the torch path: the loragen numbers measure that path")
        rows = summary_rows(report)
        report["summary"] = rows
        print(
            "\nsummary: ms per forward+backward (layer, small) or per training step (model, seq 2048), medians of "
            "interleaved rounds (CUDA events); peak GiB = resident + step peak"
        )
        print(markdown_table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
