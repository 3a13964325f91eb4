"""A QLoRA training step on the tiny Llama: a frozen 4-bit model (the floor) vs peft vs loragen, side by side.

The model of BENCHMARKS.md (hidden 512, intermediate 1376, 4 layers, 8 heads, vocab 1000; batch 4 x seq
256, fp32) is saved with ``save_pretrained`` and loaded back through transformers' ``BitsAndBytesConfig``
(nf4, double quantization, float32 compute by default) on the CPU, once per variant. LoRA r=16, alpha 32,
dropout 0.05 on q, k, v, o, gate, up, down; each library's ``prepare_model_for_kbit_training`` without
gradient checkpointing; AdamW on what trains. The frozen model trains nothing and takes gradients to its
input embeddings only: every 4-bit layer still dequantizes its weight twice (forward and the input
gradient), which is the floor a LoRA step cannot go below.

Time and saved-for-backward bytes come from :mod:`benchmarks.harness` (interleaved rounds, medians). Peak
memory is each variant's own process (``--peak-of NAME``, Linux): the peak resident set during two training
steps (reset through ``/proc/self/clear_refs`` after loading) minus the resident set before them.

    python -m benchmarks.bench_qlora                     # dropout 0.05, 10 rounds, peaks
    python -m benchmarks.bench_qlora --quick             # tiny sizes, a smoke test
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from .bench_llama import SIZES, TARGETS, _llama
from .harness import (
    Variant,
    add_timing_arguments,
    causal_lm_training_variant,
    format_table,
    machine_summary,
    proc_status_bytes,
    run_variants,
    timing,
)

__all__ = ["VARIANTS", "build_variant", "main", "run"]

VARIANTS = ("frozen 4-bit", "peft", "loragen")
FULL = SIZES
# bitsandbytes quantizes in blocks of 64: the quick model's layers are at least that wide
QUICK = {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "vocab": 100, "batch": 2, "seq": 16}


def save_model(path: Path, shape: dict[str, int]) -> None:
    """The tiny Llama of :mod:`benchmarks.bench_llama` (seed 0) written with ``save_pretrained`` to ``path``."""
    torch.manual_seed(0)
    model = _llama(*(shape[k] for k in ("hidden", "intermediate", "layers", "heads", "vocab", "seq")))
    model.save_pretrained(path)


def load_4bit(path: Path, compute: str) -> nn.Module:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=getattr(torch, compute),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, device_map="cpu")
    return model.train()


def build_variant(name: str, path: Path, shape: dict[str, int], dropout: float, compute: str) -> Variant:
    """One contestant on its own freshly loaded 4-bit model."""
    import peft

    import loragen

    model = load_4bit(path, compute)
    if name == "frozen 4-bit":
        model.requires_grad_(False)
        model.enable_input_require_grads()  # gradients flow to the input embeddings and nowhere else
    elif name == "peft":
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        model = peft.get_peft_model(
            model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=dropout, target_modules=TARGETS)
        )
    elif name == "loragen":
        model = loragen.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        model = loragen.get_lora_model(
            model, loragen.LoraConfig(r=16, lora_alpha=32, lora_dropout=dropout, target_modules=TARGETS)
        )
    else:
        raise ValueError(f"unknown variant {name!r}; expected one of {VARIANTS}")
    model.train()
    ids = torch.randint(
        0, shape["vocab"], (shape["batch"], shape["seq"]), generator=torch.Generator().manual_seed(1)
    )
    return causal_lm_training_variant(name, model, ids)


def _peak_growth(name: str, path: Path, shape: dict[str, int], dropout: float, compute: str) -> int:
    """In this process: build ``name``, run two steps, return the growth of the peak RSS in bytes."""
    variant = build_variant(name, path, shape, dropout, compute)
    Path("/proc/self/clear_refs").write_text("5")  # Linux: resets the peak (VmHWM) to the current RSS
    before = proc_status_bytes("VmRSS")
    for _ in range(2):
        variant.step()
    return proc_status_bytes("VmHWM") - before


def _peaks(path: Path, args: argparse.Namespace) -> dict[str, int]:
    peaks = {}
    for name in VARIANTS:
        command = [
            sys.executable,
            "-m",
            "benchmarks.bench_qlora",
            "--peak-of",
            name,
            "--model",
            str(path),
            "--dropout",
            str(args.dropout),
            "--compute-dtype",
            args.compute_dtype,
        ]
        if args.quick:
            command.append("--quick")
        done = subprocess.run(
            command, capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent
        )
        peaks[name] = json.loads(done.stdout.strip().splitlines()[-1])["peak_growth"]
    return peaks


def run(args: argparse.Namespace) -> str:
    """Run the benchmark; returns the Markdown table (and the peak-memory lines)."""
    shape = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(prefix="bench_qlora_") as folder:
        path = Path(folder)
        save_model(path, shape)
        variants = [build_variant(name, path, shape, args.dropout, args.compute_dtype) for name in VARIANTS]
        results = run_variants(variants, *timing(args))
        del variants
        peaks = {} if args.no_peak else _peaks(path, args)
    title = (
        f"QLoRA step, tiny Llama (hidden {shape['hidden']}, intermediate {shape['intermediate']}, "
        f"{shape['layers']} layers, batch {shape['batch']} x seq {shape['seq']}), nf4 + double quantization, "
        f"{args.compute_dtype} compute, r=16, alpha 32, dropout {args.dropout:g}: training step with AdamW"
    )
    lines = [f"machine: {machine_summary()}", format_table(results, title, ratio_to=["frozen 4-bit", "peft"])]
    if peaks:
        lines.append(
            "peak RSS growth over the loaded model during two steps (own process per variant): "
            + ", ".join(f"{name} {peak / (1 << 20):.1f} MiB" for name, peak in peaks.items())
            + (f"; loragen / peft {peaks['loragen'] / peaks['peft']:.3f}" if peaks["peft"] else "")
        )
    return "\n\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_qlora", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--dropout", type=float, default=0.05, help="LoRA dropout (default 0.05)")
    parser.add_argument(
        "--compute-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="bnb_4bit_compute_dtype (default float32)",
    )
    add_timing_arguments(parser, rounds=10, quick="a 2-layer hidden-64 model and 3 rounds")
    parser.add_argument("--no-peak", action="store_true", help="skip the peak-memory processes")
    parser.add_argument("--peak-of", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peak_of:
        shape = QUICK if args.quick else FULL
        print(
            json.dumps(
                {
                    "peak_growth": _peak_growth(
                        args.peak_of, args.model, shape, args.dropout, args.compute_dtype
                    )
                }
            )
        )
        return 0
    print(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
