"""Performance model of loragen's CUDA LoRA kernels on an H100 SXM (issue 16): predictions, not timings.

    python benchmarks/cuda_perf_model.py                  # markdown tables (BENCHMARKS.md, "performance model")
    python benchmarks/cuda_perf_model.py --json model.json

For bf16 activations (float32 adapter), in = out = d = 4096, N = 4k..64k tokens and the rank buckets
8..64, each kernel gets:

* bytes: the minimum it must move (each large tensor once), what it moves to and from HBM (plus the
  float32 partial sums of split reductions, written and read back by torch), and what it reads from L2
  again (rank tiles re-reading x or g, A and B^T streamed per row group);
* FLOPs: 2 N d R per rank-R product (the padded rank: R, not r, is what runs), on CUDA cores or tensor
  cores (``specs.uses_mma``);
* resources from the cubin: registers from ptxas (NVRTC, sm_90), and from nvdisasm the instructions of
  the main loop (the backward branch whose body holds the most FFMA/HMMA): load and store widths, HMMA,
  and the FFMA share of the issued instructions (dropout's Philox code included, so it is a p > 0 share). Without NVRTC the registers recorded in :data:`RECORDED` are used and
  the tables say so;
* bytes in flight per SM: resident warps (registers and grid) x 32 lanes x the bytes of x or g each lane
  loads before first use (counted from the tile shape: every such load is hoisted in the templates);
* predicted time = the largest of: HBM bytes / (3.35 TB/s x min(1, in flight / Little's-law need)),
  L2 bytes / L2 bandwidth, CUDA-core FLOPs / (67 TFLOP/s x FFMA share of the issued instructions),
  tensor FLOPs / mma.sync rate. Overlap is assumed perfect, so this is optimistic by construction.

The binding floor is the larger of the HBM floor (minimum bytes / 3.35 TB/s) and the FLOP floor of
the units the kernel uses (67 TFLOP/s FP32 FMA; tensor cores 989 TFLOP/s dense bf16). The target is
predicted >= 70% of it; ``vs HBM floor`` shows how far each variant is from the memory-bound ideal.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from loragen.cuda import specs

# ---- the machine (H100 SXM5) and the assumptions ----------------------------------------------------------
HBM = 3.35e12  # bytes/s
SMS = 132
FP32_FMA = 67e12  # FLOP/s, CUDA cores: 132 SMs x 128 FP32 lanes x 2 FLOP x 1.98 GHz
TENSOR_DENSE = 989e12  # FLOP/s, bf16 dense (wgmma): the tensor FLOP floor
MMA_SYNC = 0.6 * TENSOR_DENSE  # assumed: mma.sync m16n8k16 reaches about 60% of the wgmma peak
L2 = 5.5e12  # bytes/s, assumed L2 hit bandwidth (conservative)
LATENCY = 600e-9  # s, assumed loaded DRAM latency; Little's law: HBM / SMS x LATENCY bytes in flight per SM
REGISTERS_PER_SM = 65536
MAX_WARPS_PER_SM = 64
TARGET_BLOCKS = 2 * SMS  # what DriverLauncher.target_blocks returns on an H100
ELEMENT = 2  # bf16
D = 4096
TOKENS = (4096, 16384, 65536)

# ptxas registers per thread (sm_90, bf16, aligned) recorded with NVRTC 13.5 on 2026-11-24: used when
# NVRTC is not installed.
RECORDED: dict[tuple[str, int], int] = {
    **{("lora_down", r): n for r, n in ((8, 254), (16, 126), (32, 168), (64, 214))},
    **{("lora_up", r): n for r, n in ((8, 168), (16, 225), (32, 80), (64, 142))},
    **{("lora_grad_out", r): n for r, n in ((8, 255), (16, 115), (32, 180), (64, 180))},
    **{("lora_grad_in", r): n for r, n in ((8, 219), (16, 239), (32, 239), (64, 239))},
}


@dataclass(frozen=True)
class Sass:
    """What the model reads from a cubin."""

    registers: int
    source: str  # "ptxas+nvdisasm", "ptxas" or "recorded"
    counts: dict[str, int]  # opcode (with width suffix) -> static count in the main loop

    def share(self, prefix: str) -> float:
        total = sum(self.counts.values())
        return sum(n for op, n in self.counts.items() if op.startswith(prefix)) / total if total else 0.0


def _nvdisasm() -> str | None:
    try:
        import nvidia  # type: ignore[import-not-found]
    except ImportError:
        return shutil.which("nvdisasm")
    for root in map(Path, nvidia.__path__):
        for found in root.glob("*/bin/nvdisasm"):
            return str(found)
    return shutil.which("nvdisasm")


_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)")


def inspect(name: str, rank: int) -> Sass:
    """Registers and static opcode counts of kernel ``name`` for bf16, aligned, rank bucket ``rank``."""
    try:
        from loragen.cuda.nvrtc import compile_kernel
        from loragen.cuda.render import render_kernel

        spec = specs.KERNELS[name]
        compiled = compile_kernel(
            render_kernel(name, specs.render_params(spec, specs.Variant("bfloat16", rank, True))), "sm_90"
        )
    except ImportError:
        return Sass(RECORDED[(name, rank)], "recorded", {})
    registers = compiled.resources[name].registers
    tool = _nvdisasm()
    if tool is None:
        return Sass(registers, "ptxas", {})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.cubin)
        cubin.flush()
        text = subprocess.run([tool, "-c", cubin.name], capture_output=True, text=True, check=True).stdout
    return Sass(registers, "ptxas+nvdisasm", main_loop(text))


_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"BRA\s+`?\(?(\.L_x_\d+)")


def main_loop(sass: str) -> dict[str, int]:
    """Opcode counts of the kernel's main loop: of the backward branches' bodies, the one with the most
    FFMA + HMMA instructions (the whole kernel when it has no loop)."""
    opcodes: list[str] = []
    labels: dict[str, int] = {}
    loops: list[tuple[int, int]] = []
    for line in sass.splitlines():
        if label := _LABEL.match(line):
            labels[label.group(1)] = len(opcodes)
        elif op := _OPCODE.search(line):
            opcodes.append(op.group(1))
            branch = _BRANCH.search(line)
            if branch and branch.group(1) in labels:
                loops.append((labels[branch.group(1)], len(opcodes)))

    def work(span: tuple[int, int]) -> int:
        return sum(op.startswith(("FFMA", "HMMA")) for op in opcodes[span[0] : span[1]])

    best = max(loops, key=work, default=(0, len(opcodes)))
    start, end = best if work(best) else (0, len(opcodes))  # fully unrolled: the whole kernel
    return dict(collections.Counter(opcodes[start:end]))


@dataclass(frozen=True)
class Prediction:
    kernel: str
    rank: int
    tokens: int
    grid_blocks: int
    mma: bool
    registers: int
    resources_from: str
    warps_per_sm: int
    inflight_per_sm: int  # bytes of x or g loads in flight, 0 for a store-bound kernel
    min_bytes: float
    hbm_bytes: float
    l2_bytes: float
    core_flops: float
    tensor_flops: float
    ffma_share: float
    t_hbm: float
    t_l2: float
    t_core: float
    t_tensor: float
    predicted: float
    hbm_floor: float
    floor: float

    @property
    def bound(self) -> str:
        times = {"HBM": self.t_hbm, "L2": self.t_l2, "FP32 FMA": self.t_core, "tensor": self.t_tensor}
        return max(times, key=lambda k: times[k])


def _occupancy(registers: int, warps: int, grid_blocks: int, shared: int = 0) -> int:
    per_block = math.ceil(registers / 8) * 8 * warps * 32
    blocks = min(REGISTERS_PER_SM // per_block, MAX_WARPS_PER_SM // warps)
    if shared:
        blocks = min(blocks, (228 * 1024) // shared)
    return min(blocks, math.ceil(grid_blocks / SMS)) * warps


def predict(name: str, rank: int, n: int, sass: Sass) -> Prediction:
    """The model of kernel ``name`` for bf16, aligned, rank bucket ``rank``, N = ``n``, d = in = out = 4096."""
    v = specs.Variant("bfloat16", rank, True)
    tile = specs.KERNELS[name].tile(v)
    big = n * D * ELEMENT  # one pass over x, g, y or grad_x
    adapter = rank * D * 4  # A or B^T, float32, padded
    small = n * rank * 4  # h or dh, float32
    flops = 2.0 * n * D * rank
    mma = False
    if name == "lora_down":
        plan = specs.plan_down(n, D, v, TARGET_BLOCKS)
        blocks = plan.grid[0] * plan.grid[1]
        mma = bool(tile["mma"])
        per_lane = (2 * tile["rows_per_warp"] // 16 if mma else tile["rows_per_warp"]) * tile["steps"] * 16
        row_blocks = plan.grid[0]  # (row blocks x rank tiles): each reads its tile of A over all columns
        min_bytes = big + adapter + small
        hbm = big + adapter + small * (2 * plan.splits if plan.splits > 1 else 1)
        l2 = big * (specs.rank_tiles(specs.LORA_DOWN, v) - 1) + row_blocks * adapter / specs.rank_tiles(
            specs.LORA_DOWN, v
        )
        core, tensor = (0.0, flops) if mma else (flops, 0.0)
    elif name == "lora_up":
        grid = specs.plan_up(n, D, v)
        blocks = grid[0] * grid[1]
        mma = bool(tile["mma"])
        per_lane = 0  # out is written once; stores do not wait
        min_bytes = hbm = big + adapter + small
        l2 = grid[0] * adapter + grid[1] * small  # B^T per row tile, h per column tile
        core, tensor = (0.0, flops) if mma else (flops, 0.0)
    else:
        plan = (specs.plan_grad_out if name == "lora_grad_out" else specs.plan_grad_in)(
            n, D, v, TARGET_BLOCKS
        )
        spec = specs.KERNELS[name]
        tiles = specs.rank_tiles(spec, v)
        blocks = plan.grid[0] * plan.grid[1]
        mma = bool(tile.get("mma"))
        # bytes of g or x each lane loads before first use: with mma, rows g and g + 8 of every chunk
        per_lane = 2 * tile["col_chunks"] * 16 if mma else tile["rows_per_step"] * 16
        if name == "lora_grad_out":
            min_bytes = big + adapter + 2 * small + adapter
            partials = plan.col_blocks * small + plan.splits * adapter
            hbm = big + adapter + small + 2 * partials
            l2 = big * (tiles - 1) + plan.col_blocks * small
        else:
            min_bytes = 2 * big + small + 2 * adapter
            hbm = 2 * big + small + adapter + 2 * plan.splits * adapter
            # x again per extra rank tile; grad_x streams A (all ranks, the block's 256 columns) once per
            # step of the block's warps together (they share the columns: L1 serves the other warps)
            l2 = (
                big * (tiles - 1)
                + n / (tile["rows_per_step"] * tile["warps"]) * adapter
                + plan.col_blocks * small * 2
            )
        core, tensor = (0.0, 2 * flops) if mma else (2 * flops, 0.0)
    shared = 2 * tile["warps"] * tile.get("rows_per_step", 0) * tile.get("rank_tile", 0) * 4
    warps = _occupancy(sass.registers, tile["warps"], blocks, shared if name == "lora_grad_out" else 0)
    inflight = warps * 32 * per_lane
    need = HBM / SMS * LATENCY
    bandwidth = HBM * (min(1.0, inflight / need) if per_lane else 1.0)
    ffma = sass.share("FFMA") if sass.counts else 0.75  # no SASS: assume 3 of 4 issued instructions are FFMA
    t_core = core / (FP32_FMA * max(ffma, 1e-3)) if core else 0.0
    t_tensor = tensor / MMA_SYNC
    t_hbm, t_l2 = hbm / bandwidth, l2 / L2
    hbm_floor = min_bytes / HBM
    floor = max(hbm_floor, core / FP32_FMA, tensor / TENSOR_DENSE)
    return Prediction(
        name, rank, n, blocks, mma, sass.registers, sass.source, warps, inflight,
        min_bytes, hbm, l2, core, tensor, ffma,
        t_hbm, t_l2, t_core, t_tensor, max(t_hbm, t_l2, t_core, t_tensor), hbm_floor, floor,
    )  # fmt: skip


def table(predictions: list[Prediction]) -> str:
    """The markdown table of BENCHMARKS.md's performance model section."""
    lines = [
        "| kernel | R | N | grid | regs | warps/SM | in flight/SM | HBM MB (min) | L2 MB | GFLOP | FFMA share "
        "| bound by | predicted µs | binding floor µs | % of floor | % of HBM floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in predictions:
        unit = "tensor" if p.mma else "cores"
        lines.append(
            f"| {p.kernel}{' (mma)' if p.mma else ''} | {p.rank} | {p.tokens // 1024}k | {p.grid_blocks} "
            f"| {p.registers} | {p.warps_per_sm} | {p.inflight_per_sm / 1024:.1f} KB "
            f"| {p.hbm_bytes / 1e6:.0f} ({p.min_bytes / 1e6:.0f}) | {p.l2_bytes / 1e6:.0f} "
            f"| {(p.core_flops + p.tensor_flops) / 1e9:.1f} {unit} | {p.ffma_share:.2f} | {p.bound} "
            f"| {p.predicted * 1e6:.1f} | {p.floor * 1e6:.1f} | {100 * p.floor / p.predicted:.0f}% "
            f"| {100 * p.hbm_floor / p.predicted:.0f}% |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--json", type=Path, help="also write every prediction as JSON")
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    args = parser.parse_args(argv)
    predictions = []
    sources = set()
    for name in specs.KERNELS:
        for rank in specs.RANK_BUCKETS:
            sass = inspect(name, rank)
            sources.add(sass.source)
            predictions.extend(predict(name, rank, n, sass) for n in args.tokens)
    print(
        f"resources from: {', '.join(sorted(sources))}; Little's-law need {HBM / SMS * LATENCY / 1024:.1f} KB/SM"
    )
    print(table(predictions))
    short = [p for p in predictions if p.floor / p.predicted < 0.7]
    print(
        f"\n{len(predictions) - len(short)} of {len(predictions)} variants predicted >= 70% of the binding floor"
    )
    if args.json:
        args.json.write_text(json.dumps([asdict(p) for p in predictions], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
