"""Peak memory of ``loragen merge`` on a small and a multi-GB checkpoint with the same tensor shapes.

The claim under test: the streaming merge holds a few copies of the largest merged tensor, so its peak
RSS does not grow with the checkpoint's size. Both checkpoints are Llama-7B-shaped bf16 shards
(hidden 4096, MLP 11008, vocab 32000) that differ only in their number of layers; the adapter is rank 16
on every linear layer (fp32 factors). Each merge runs the ``loragen merge`` subcommand in a fresh process
whose peak RSS is its ``VmHWM``; runs are interleaved (small, large, small, large, ...) and medians
reported. For contrast, a naive merge (``safetensors.torch.load_file`` every shard, merge, save) is
measured on the small checkpoint.

    python benchmarks/bench_merge.py                      # ~5.3 GB + ~1 GB checkpoints in /tmp
    python benchmarks/bench_merge.py --large-layers 4     # a quicker run

Everything generated goes to ``--workdir`` (default: a fresh folder in /tmp) and is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HIDDEN, MLP, VOCAB, RANK = 4096, 11008, 32000, 16
SHARD_BYTES = 2 << 30
LINEARS = {
    "self_attn.q_proj": (HIDDEN, HIDDEN),
    "self_attn.k_proj": (HIDDEN, HIDDEN),
    "self_attn.v_proj": (HIDDEN, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (MLP, HIDDEN),
    "mlp.up_proj": (MLP, HIDDEN),
    "mlp.down_proj": (HIDDEN, MLP),
}


def checkpoint_layout(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor names and shapes of a Llama-shaped checkpoint with ``layers`` decoder layers."""
    names = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(layers):
        names += [(f"model.layers.{i}.{n}.weight", shape) for n, shape in LINEARS.items()]
        names += [
            (f"model.layers.{i}.input_layernorm.weight", (HIDDEN,)),
            (f"model.layers.{i}.post_attention_layernorm.weight", (HIDDEN,)),
        ]
    return [*names, ("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]


def write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...]]], seed: int) -> None:
    """Write random bf16 tensors as a safetensors file, one tensor in memory at a time."""
    header, offset = {}, 0
    for name, shape in tensors:
        size = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    g = torch.Generator().manual_seed(seed)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for _, shape in tensors:
            fh.write(
                torch.randn(shape, generator=g).mul_(0.02).to(torch.bfloat16).view(torch.uint8).numpy().data
            )


def write_checkpoint(folder: Path, layers: int) -> int:
    """A sharded checkpoint with an index in ``folder``; returns its size in bytes."""
    folder.mkdir(parents=True)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in checkpoint_layout(layers):
        nbytes = math.prod(shape) * 2
        if size + nbytes > SHARD_BYTES and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_shard(folder / name, tensors, seed=i)
        weight_map.update({t: name for t, _ in tensors})
        total += (folder / name).stat().st_size
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def write_adapter(folder: Path, layers: int) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(1)
    tensors = {}
    for i in range(layers):
        for name, (out_features, in_features) in LINEARS.items():
            key = f"base_model.model.model.layers.{i}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, in_features, generator=g) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, RANK, generator=g) * 0.01
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "r": RANK,
        "lora_alpha": 32,
        "target_modules": [n.split(".")[1] for n in LINEARS],
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))


# The child's own high-water mark. (ru_maxrss from wait4 would also count the parent's memory that the
# child had between fork and exec.)
REPORT_PEAK = """
print(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM:")))
"""

# ``loragen merge ARGS`` with only the merge subcommand imported (the other subcommands' imports would
# add their own constant memory to every measurement)
LORAGEN_MERGE = (
    """
import sys
from loragen.cli import main
status = main(sys.argv[1:])
"""
    + REPORT_PEAK
)

NAIVE = (
    """
import sys, json, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
base, adapter, out = map(Path, sys.argv[1:])
lora = load_file(adapter / "adapter_model.safetensors")
state = {}
for shard in sorted(base.glob("*.safetensors")):
    state.update(load_file(shard))
for key, a in lora.items():
    if key.endswith("lora_A.weight"):
        target = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight"
        b = lora[key.replace("lora_A", "lora_B")]
        state[target] = (state[target].float() + 2.0 * (b @ a)).to(state[target].dtype)
save_file(state, str(out))
"""
    + REPORT_PEAK
)


def peak_rss(command: list[str]) -> tuple[float, float]:
    """Run ``command`` (a script ending in REPORT_PEAK); return (its peak RSS in MiB, wall seconds)."""
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{' '.join(command[:3])} failed ({proc.returncode}):\n{proc.stderr}")
    return int(proc.stdout.split()[-1]) / 1024, seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small-layers", type=int, default=1)
    parser.add_argument("--large-layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    args = parser.parse_args()

    work = args.workdir or Path(tempfile.mkdtemp(prefix="loragen-bench-merge-"))
    try:
        sizes = {}
        for label, layers in (("small", args.small_layers), ("large", args.large_layers)):
            sizes[label] = write_checkpoint(work / label, layers)
            write_adapter(work / f"{label}-adapter", layers)
        baseline, _ = peak_rss(
            [sys.executable, "-c", "import torch, loragen.adapters.offline_merge" + REPORT_PEAK]
        )
        results: dict[str, list[tuple[float, float]]] = {"small": [], "large": []}
        for _ in range(args.repeats):
            for label in ("small", "large"):
                out = work / f"{label}-merged"
                command = [
                    sys.executable,
                    "-c",
                    LORAGEN_MERGE,
                    "merge",
                    "--base",
                    str(work / label),
                    "--adapter",
                    str(work / f"{label}-adapter"),
                    "-o",
                    str(out),
                    "--quiet",
                ]
                results[label].append(peak_rss(command))
                shutil.rmtree(out)
        naive_out = work / "naive.safetensors"
        naive, naive_s = peak_rss(
            [sys.executable, "-c", NAIVE, str(work / "small"), str(work / "small-adapter"), str(naive_out)]
        )
        naive_out.unlink()

        largest = max(math.prod(s) for n, s in checkpoint_layout(1) if "layers" in n) * 2 / 2**20
        print(
            f"python + torch + loragen.adapters.offline_merge imported: {baseline:.0f} MiB peak RSS; "
            f"largest merged tensor {largest:.0f} MiB (bf16)"
        )
        print("| checkpoint | layers | size | merged tensors | peak RSS (median) | wall (median) |")
        print("|---|---|---|---|---|---|")
        for label, layers in (("small", args.small_layers), ("large", args.large_layers)):
            rss = statistics.median(r for r, _ in results[label])
            wall = statistics.median(s for _, s in results[label])
            print(
                f"| {label} | {layers} | {sizes[label] / 2**30:.2f} GiB | {7 * layers} "
                f"| {rss:.0f} MiB | {wall:.1f} s |"
            )
        print(
            f"| small, naive load_file + merge + save_file | {args.small_layers} | "
            f"{sizes['small'] / 2**30:.2f} GiB | {7 * args.small_layers} "
            f"| {naive:.0f} MiB | {naive_s:.1f} s |"
        )
        print(
            "runs (MiB, s):",
            json.dumps({k: [(round(r), round(s, 1)) for r, s in v] for k, v in results.items()}),
        )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
