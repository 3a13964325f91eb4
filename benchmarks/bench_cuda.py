"""GPU benchmark of loragen's CUDA LoRA kernels against peft and the frozen base (issue 6).

    python benchmarks/bench_cuda.py                 # everything, about 3 minutes on an H100
    python benchmarks/bench_cuda.py --only layer    # layer, kernels, model
    python benchmarks/bench_cuda.py --json out.json

Without a CUDA device it says so and exits 0. Reports, in order:

1. the device and its two measured ceilings: device-to-device copy bandwidth (bytes read + written)
   and a bf16 8192^3 matrix product on random data;
2. one layer, Linear 4096x4096 (no bias), 4096 tokens, r=16, bf16 base and float32 adapter (both
   libraries' default), forward + backward with grad_x: frozen base, peft, loragen, p = 0 and 0.1;
3. each loragen kernel alone on that layer: time, the minimum bytes it must move, achieved bandwidth
   against the measured copy bandwidth;
4. a Llama-shaped model built from a config (hidden 2048, 8 layers, seq 2048, batch 1, LoRA r=16 on
   all seven projections, dropout 0.05), one training step with AdamW: frozen base, peft, loragen;
   step time and peak memory.

Timing: CUDA events around each call, warm-up first, variants interleaved round by round (the order
rotates), medians. Inputs are random (B is not left at zero). Copy the printed tables to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import torch
from torch import nn

GiB = float(1 << 30)
MB = 1e6


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
    variants: dict[str, Callable[[], object]], rounds: int, inner: int = 1, warmup: int = 3
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


# ---- 1. ceilings --------------------------------------------------------------------------------------


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
    limits = {"copy_GBps": copy_bandwidth(), "bf16_gemm_TFLOPs": gemm_rate()}
    torch.cuda.empty_cache()
    return limits


# ---- 2. one layer ---------------------------------------------------------------------------------------


class Holder(nn.Module):
    """peft needs a parent module to find the target in."""

    def __init__(self, proj: nn.Linear) -> None:
        super().__init__()
        self.proj = proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def layer_benchmark(tokens: int, features: int, rank: int, dropout: float, rounds: int) -> dict[str, float]:
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

    def step(module: nn.Module) -> Callable[[], None]:
        params = [p for p in module.parameters() if p.requires_grad]

        def run() -> None:
            x.grad = None
            for p in params:
                p.grad = None
            module(x).backward(grad)

        return run

    return interleaved(
        {"frozen base": step(base), "peft": step(peft_model), "loragen": step(loragen_layer)}, rounds, inner=5
    )


# ---- 3. kernels alone ----------------------------------------------------------------------------------------


def kernel_benchmark(
    tokens: int, features: int, rank: int, dropout: float, rounds: int, copy_GBps: float
) -> list[dict]:
    from loragen import philox
    from loragen.cuda import passes
    from loragen.cuda.launch import default_launcher

    torch.manual_seed(0)
    n, k, o = tokens, features, features
    b = 2  # bf16
    x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(n, o, device="cuda", dtype=torch.bfloat16)
    a32 = torch.randn(rank, k, device="cuda") / k**0.5
    bt32 = torch.randn(rank, o, device="cuda")
    plan = passes.Plan(x, o, rank, default_launcher())
    drop = (
        (philox.random_seed(), 0, philox.keep_threshold(dropout), philox.keep_scale(dropout))
        if dropout
        else (0, 0, 0, 1.0)
    )
    h = passes.down(plan, x, a32, drop)
    dh, _ = passes.grad_out(plan, g, h, bt32, 1.0)
    out = torch.zeros(n, o, device="cuda", dtype=torch.bfloat16)  # the base product lora_up adds onto
    R = plan.variant.rank_bucket

    def up() -> None:
        passes.up(plan, h, bt32, None, 1.0, out)

    # minimum bytes: each large operand read or written once (partial sums and small operands included)
    kernels = {
        "lora_down  (h = drop(x) A^T)": (
            lambda: passes.down(plan, x, a32, drop),
            n * k * b + n * R * 4 + rank * k * 4,
        ),
        "lora_up    (y += s h B^T, in place)": (up, 2 * n * o * b + n * R * 4 + rank * o * 4),
        "lora_grad_out (dh, dB)": (
            lambda: passes.grad_out(plan, g, h, bt32, 1.0),
            n * o * b + 2 * n * R * 4 + o * R * 4,
        ),
        "lora_grad_in  (dA, gx0)": (
            lambda: passes.grad_in(plan, x, dh, a32, drop, True),
            2 * n * k * b + n * R * 4 + R * k * 4,
        ),
    }
    times = interleaved({name: fn for name, (fn, _) in kernels.items()}, rounds, inner=10)
    rows = []
    for name, (_, nbytes) in kernels.items():
        ms = times[name]
        rows.append(
            {
                "kernel": name,
                "us": ms * 1e3,
                "min_MB": nbytes / MB,
                "GBps": nbytes / (ms * 1e-3) / 1e9,
                "of_copy": nbytes / (ms * 1e-3) / 1e9 / copy_GBps,
            }
        )
    return rows


# ---- 4. a Llama-shaped model -------------------------------------------------------------------------------------

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_model(kind: str, rank: int, dropout: float) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
        max_position_embeddings=2048,
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
    if kind == "frozen base":
        model.requires_grad_(False)
        # gradients still flow through every layer, as in a LoRA step, minus the adapters
        model.get_input_embeddings().register_forward_hook(lambda module, args, out: out.requires_grad_(True))
    elif kind == "peft":
        import peft

        model = peft.get_peft_model(
            model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout, target_modules=TARGETS)
        )
    else:
        import loragen

        model = loragen.get_lora_model(
            model,
            loragen.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout, target_modules=TARGETS),
        )
    model.train()
    for name, param in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param, std=0.02)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, (torch.optim.AdamW(trainable, lr=1e-4) if trainable else None)


def model_step(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, ids: torch.Tensor
) -> Callable[[], None]:
    def run() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return run


def model_benchmark(seq: int, rank: int, dropout: float, rounds: int) -> dict[str, dict[str, float]]:
    kinds = ["frozen base", "peft", "loragen"]
    ids = torch.randint(0, 32000, (1, seq), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    results: dict[str, dict[str, float]] = {kind: {} for kind in kinds}
    for kind in kinds:  # peak memory with one model resident at a time
        model, optimizer = build_model(kind, rank, dropout)
        step = model_step(model, optimizer, ids)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        results[kind]["peak_GiB"] = torch.cuda.max_memory_allocated() / GiB
        results[kind]["step_above_resident_GiB"] = (torch.cuda.max_memory_allocated() - resident) / GiB
        del model, optimizer, step
        torch.cuda.empty_cache()
    steps = {}
    for kind in kinds:  # then time them interleaved, all resident
        model, optimizer = build_model(kind, rank, dropout)
        steps[kind] = model_step(model, optimizer, ids)
    for kind, ms in interleaved(steps, rounds).items():
        results[kind]["step_ms"] = ms
    return results


# ---- main ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["layer", "model"], help="run one part only")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", help="write all numbers to this file")
    args = parser.parse_args(argv)

    import loragen.cuda
    import loragen.switches

    if not loragen.cuda.is_available():
        print("bench_cuda: no CUDA device (or cuda-python missing); nothing measured.")
        return 0
    report: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "capability": "sm_{}{}".format(*torch.cuda.get_device_capability()),
    }
    report["ceilings"] = limits = ceilings()
    print(f"device: {report['device']} ({report['capability']}), torch {torch.__version__}")
    print(
        f"measured: copy {limits['copy_GBps']:.0f} GB/s (read + write), bf16 GEMM {limits['bf16_gemm_TFLOPs']:.0f} TFLOP/s"
    )

    if args.only in (None, "layer"):
        layer = {}
        for p in (0.0, 0.1):
            times = layer_benchmark(4096, 4096, 16, p, args.rounds)
            layer[f"p={p}"] = times
            base, peft_ms, ours = times["frozen base"], times["peft"], times["loragen"]
            print(f"\nlayer 4096x4096, 4096 tokens, r=16, bf16, fwd+bwd, lora_dropout={p}")
            print("| variant | ms | vs frozen base | vs peft |\n|---|---|---|---|")
            for name, ms in times.items():
                print(f"| {name} | {ms:.3f} | {ms / base:.2f}x | {ms / peft_ms:.2f}x |")
            print(
                f"targets: loragen <= 1.10x base ({ours / base:.2f}x), <= 0.80x peft ({ours / peft_ms:.2f}x)"
            )
        report["layer"] = layer
        for p in (0.0, 0.1):
            rows = kernel_benchmark(4096, 4096, 16, p, args.rounds, limits["copy_GBps"])
            report[f"kernels p={p}"] = rows
            print(f"\nloragen kernels alone, same layer, lora_dropout={p}")
            print("| kernel | us | min MB | GB/s | of copy bandwidth |\n|---|---|---|---|---|")
            for row in rows:
                print(
                    f"| {row['kernel']} | {row['us']:.1f} | {row['min_MB']:.1f} | {row['GBps']:.0f} | {row['of_copy']:.0%} |"
                )

    if args.only in (None, "model"):
        results = model_benchmark(2048, 16, 0.05, max(5, args.rounds // 3))
        report["model"] = results
        peft_r = results["peft"]
        print(
            "\nLlama-shaped model (hidden 2048, 8 layers, seq 2048, batch 1), LoRA r=16 on 7 projections, dropout 0.05"
        )
        print(
            "| variant | step ms | vs peft | peak GiB | vs peft | step memory above resident GiB |\n|---|---|---|---|---|---|"
        )
        for kind, r in results.items():
            print(
                f"| {kind} | {r['step_ms']:.1f} | {r['step_ms'] / peft_r['step_ms']:.2f}x | {r['peak_GiB']:.2f} | "
                f"{r['peak_GiB'] / peft_r['peak_GiB']:.2f}x | {r['step_above_resident_GiB']:.2f} |"
            )
        ours = results["loragen"]
        print(
            f"targets: step <= 0.85x peft ({ours['step_ms'] / peft_r['step_ms']:.2f}x), "
            f"peak memory <= 0.75x peft ({ours['peak_GiB'] / peft_r['peak_GiB']:.2f}x)"
        )

    from loragen.cuda.selfcheck import default_checker

    report["selfcheck"] = outcomes = default_checker().outcomes()
    report["cuda_kernels_switch"] = loragen.switches.cuda_kernels.get()
    print(f"\nself-check outcomes (LORAGEN_CUDA_KERNELS={report['cuda_kernels_switch']}):")
    for variant, outcome in outcomes.items():
        print(f"  {variant}: {outcome}")
    if any(outcome != "ok" for outcome in outcomes.values()):
        print("  WARNING: variants above run on the torch path: the loragen numbers measure that path")

    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
