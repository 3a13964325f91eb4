"""Performance model of loragen's CUDA LoRA kernels on an H100 SXM (issue 16): predictions, not timings.

    python benchmarks/cuda_perf_model.py                  # markdown tables (BENCHMARKS.md, "performance model")
    python benchmarks/cuda_perf_model.py --json model.json

For bf16 activations (float32 adapter), in = out = d = 4096, N = 4k..64k tokens and the rank buckets
8..64, each kernel gets:

* bytes: the minimum it must move (each large tensor once), what it moves to and from HBM (plus the
  float32 partial sums of split reductions, written and read back by torch), and what it reads from L2
  again (rank tiles re-reading x or g, A and B^T streamed per row group);
* FLOPs: 2 N d R per rank-R product (the padded rank: R, not r, is what runs), on CUDA cores or tensor
  cores (``kernel_variants.uses_mma``);
* resources from the cubin: registers from ptxas (NVRTC, sm_90), and from nvdisasm the instructions of
  the main loop (the backward branch whose body holds the most FFMA/HMMA): load and store widths, HMMA,
  and the FFMA share of the issued instructions (dropout's Philox code included, so it is a p > 0 share). Without NVRTC the registers recorded in :data:`RECORDED` are used and
  the tables say so;
* bytes in flight per SM: resident warps (registers, launch bounds and grid) x 32 lanes x the bytes of
  x, g or out each lane loads before first use (counted from the tile shape: every such load is hoisted
  in the templates);
* predicted time = the largest of: HBM bytes / (3.35 TB/s x min(1, in flight / Little's-law need)),
  L2 bytes / L2 bandwidth, CUDA-core FLOPs / (67 TFLOP/s x FFMA share x issue efficiency), tensor
  FLOPs / mma.sync rate, and for tensor-core kernels the issue slots of every instruction: HMMA
  instructions (tensor FLOPs / 4096) / HMMA share of the main loop / (132 SMs x 4 schedulers x
  1.98 GHz x issue efficiency). That last term is the FFMA term written for HMMA (67 TFLOP/s is the
  same 4 warp instructions per SM and clock), with the same fitted issue efficiency: nothing new is
  fitted. Without it a tensor-core kernel's Philox, transposes, conversions and address arithmetic
  cost nothing. Tensor FLOPs count what runs: a 16-bit operand split into two terms (hi + lo) is two
  mma. Overlap is assumed perfect. ``waves`` (grid blocks / (SMs x resident blocks)) is reported, not
  modelled.

Calibration (issue 20). Nsight Compute on an H100 SXM, 4096 x 4096 layer, 4096 tokens, r = 16, bf16,
measured the kernels of the first design against this model's first predictions (which assumed a
600 ns DRAM latency and full issue rate at any occupancy):

=============  ===========  =========  =======================================================
kernel         predicted    measured   what the old model missed
=============  ===========  =========  =======================================================
lora_down      12.6 us      23 us      8 warps/SM, 0.48 waves: loads come in bursts per loop step
lora_up        10.2 us      56 us      the op ran the float32 variant (64 MB of float32 stores)
lora_grad_out  13.9 us      30 us      as lora_down (0.48 waves)
lora_grad_in   40.0 us      124 us     FP32 issue at 8 warps/SM (2 per scheduler) far below peak
=============  ===========  =========  =======================================================

So the model now assumes (fitted, not derived): :data:`LATENCY` = 1.9 us, the time one load-then-use
loop step of these kernels holds its bytes (the median of lora_down's 2.4 us and lora_grad_out's
1.4 us implied by Little's law from the measured bandwidth), and an FP32 issue efficiency of
min(1, warps per SM / 24) (lora_grad_in's 124 us at 8 warps/SM). Both are fitted to one layer shape
on one GPU: the predictions for the redesigned kernels below are predictions, to be checked with Nsight
Compute, and the fit redone with the new measurements.

Issue 20, second round (tensor cores in every bf16 kernel at R >= 16): the fit is unchanged; the
issue term of tensor-core kernels (above) is new and reuses the fitted issue efficiency. Predictions
for the 4096 x 4096 layer, 4096 tokens, R = 16, bf16 (before -> now, binding floor): lora_down 12.6
-> 12.6 us (10.2), lora_up 39.6 -> 23.8 us (20.2), lora_grad_out 34.7 -> 26.0 us (10.3), lora_grad_in
99.4 -> 23.8 us (20.3, now bound by issue slots). lora_grad_out stays under 60% of its floor: its
float32 partial sums (dh per 256-column block, dB per row split, 24 MB written and read back) are
what a grid of two waves costs, so even at full bandwidth it would take 17.6 us (58%).

The calibration points under the fitted model. The first design's kernels (commit 72a10e2: its
templates, tiles and grids, compiled with NVRTC for sm_90; registers 126 / 225 / 115 / 239 as ptxas
reported then), run through this model without and with the issue term (measured, predicted without
-> with, ratio to measured): lora_down 23 us, 19.1 -> 20.3 us (0.83 -> 0.88, now issue-bound),
lora_up 56 us, 26.6 us both (0.48; float32 variant, 64 MB of float32 stores at full bandwidth, FP32
issue-bound), lora_grad_out 30 us, 42.3 us both (1.41; HBM-bound, the issue term 20.7 us is below it),
lora_grad_in 124 us, 119.9 us both (0.97; CUDA cores, no HMMA). So the issue term moves no point
further from its measurement. The misses are the fit's own: one LATENCY for lora_down's implied
2.4 us and lora_grad_out's 1.4 us is 17% short on one and 41% long on the other, and nothing in the
model accounts for lora_up's measured 56 us. lora_down's issue term counts the Philox code of its
loop (p > 0); the dropout of the Nsight run is not recorded, and at p = 0 that code does not run.

The binding floor is the larger of the HBM floor (minimum bytes / 3.35 TB/s) and the FLOP floor of
the units the kernel uses (67 TFLOP/s FP32 FMA; tensor cores 989 TFLOP/s dense bf16).

The forward's output (N x out, bf16, E = 2 bytes) costs 3 E per element now -- cuBLAS writes x W^T,
lora_up reads it, adds bias and the rank-r term in float32 and writes it once more -- against
4 + 4 + 4 + 4 + E = 18 bytes before (the float32 term written by lora_up, read as cuBLAS's C, the
float32 D written, read by the copy, the copy's write): 96 MB instead of 288 MB at 4096 tokens x 4096
features, about 57 us less at 3.35 TB/s.
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

from loragen.cuda import kernel_variants, specs

# ---- the machine (H100 SXM5) and the assumptions ----------------------------------------------------------
HBM = 3.35e12  # bytes/s
SMS = 132
FP32_FMA = 67e12  # FLOP/s, CUDA cores: 132 SMs x 128 FP32 lanes x 2 FLOP x 1.98 GHz
TENSOR_DENSE = 989e12  # FLOP/s, bf16 dense (wgmma): the tensor FLOP floor
ISSUE_RATE = SMS * 4 * 1.98e9  # warp instructions/s: 4 schedulers per SM, one instruction per clock each
HMMA_FLOPS = 2 * 16 * 8 * 16  # one mma.sync m16n8k16 = one HMMA.16816 instruction
MMA_SYNC = 0.6 * TENSOR_DENSE  # assumed: mma.sync m16n8k16 reaches about 60% of the wgmma peak
L2 = 5.5e12  # bytes/s, assumed L2 hit bandwidth (conservative)
LATENCY = 1.9e-6  # s, fitted (see the docstring): how long a loop step holds its loads' bytes
ISSUE_WARPS = 24  # fitted: FP32 issue efficiency = min(1, warps per SM / ISSUE_WARPS)
REGISTERS_PER_SM = 65536
MAX_WARPS_PER_SM = 64
TARGET_BLOCKS = 2 * SMS  # what DriverLauncher.target_blocks returns on an H100
ELEMENT = 2  # bf16
D = 4096
TOKENS = (4096, 16384, 65536)

# ptxas registers per thread (sm_90, bf16, aligned) recorded with NVRTC 13.5 on 2026-11-26: used when
# NVRTC is not installed (benchmarks/kernel_sass.json has every variant).
RECORDED: dict[tuple[str, int], int] = {
    **{("lora_down", r): n for r, n in ((8, 167), (16, 128), (32, 127), (64, 128))},
    **{("lora_up", r): n for r, n in ((8, 160), (16, 92), (32, 113), (64, 168))},
    **{("lora_grad_out", r): n for r, n in ((8, 255), (16, 101), (32, 124), (64, 122))},
    **{("lora_grad_in", r): n for r, n in ((8, 168), (16, 157), (32, 164), (64, 222))},
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
        import nvidia  # type: ignore[import-not-found,unused-ignore]
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
            render_kernel(name, specs.render_params(spec, kernel_variants.Variant("bfloat16", rank, True))),
            "sm_90",
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
    warps_per_sm: float
    waves: float  # grid blocks / (SMs x resident blocks per SM)
    inflight_per_sm: float  # bytes of x or g loads in flight, 0 for a store-bound kernel
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
    t_issue: float  # tensor-core kernels: every issued instruction, from the HMMA count and share
    predicted: float
    hbm_floor: float
    floor: float

    @property
    def bound(self) -> str:
        times = {
            "HBM": self.t_hbm,
            "L2": self.t_l2,
            "FP32 FMA": self.t_core,
            "tensor": self.t_tensor,
            "issue": self.t_issue,
        }
        return max(times, key=lambda k: times[k])


def _resident_blocks(registers: int, warps: int, shared: int = 0) -> int:
    per_block = math.ceil(registers / 8) * 8 * warps * 32
    blocks = min(REGISTERS_PER_SM // per_block, MAX_WARPS_PER_SM // warps)
    if shared:
        blocks = min(blocks, (228 * 1024) // shared)
    return blocks


def _occupancy(registers: int, warps: int, grid_blocks: int, shared: int = 0) -> float:
    """Resident warps per SM, averaged over all SMs (a grid of fewer blocks than SMs leaves some idle)."""
    return min(grid_blocks, SMS * _resident_blocks(registers, warps, shared)) * warps / SMS


def waves(registers: int, warps: int, grid_blocks: int, shared: int = 0) -> float:
    """Grid blocks per (multiprocessors x resident blocks): how many full waves the grid fills."""
    return grid_blocks / (SMS * _resident_blocks(registers, warps, shared))


def predict(name: str, rank: int, n: int, sass: Sass) -> Prediction:
    """The model of kernel ``name`` for bf16, aligned, rank bucket ``rank``, N = ``n``, d = in = out = 4096."""
    v = kernel_variants.Variant("bfloat16", rank, True)
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
        # out (the base product) is read, 16 bytes per row, before the rank loop, then written
        per_lane = (2 * tile["rows_per_thread"] if mma else tile["rows_per_thread"]) * 16
        min_bytes = hbm = 2 * big + adapter + small
        l2 = grid[0] * adapter + grid[1] * small  # B^T per row tile, h per column tile
        core, tensor = (0.0, flops) if mma else (flops, 0.0)
    else:
        split = (specs.plan_grad_out if name == "lora_grad_out" else specs.plan_grad_in)(
            n, D, v, TARGET_BLOCKS
        )
        spec = specs.KERNELS[name]
        tiles = specs.rank_tiles(spec, v)
        blocks = split.grid[0] * split.grid[1]
        mma = bool(tile.get("mma"))
        # bytes of g or x each lane loads before first use: with mma, rows g and g + 8 of every chunk
        if mma and name == "lora_grad_in":  # rows g and g + 8 of each of the step's 16-row tiles
            per_lane = 2 * (tile["rows_per_step"] // 16) * 16
        elif mma:  # the same, in each chunk of 32 columns
            per_lane = 2 * (tile["rows_per_step"] // 16) * tile["col_chunks"] * 16
        else:
            per_lane = tile["rows_per_step"] * 16
        if name == "lora_grad_out":
            min_bytes = big + adapter + 2 * small + adapter
            partials = split.col_blocks * small + split.splits * adapter
            hbm = big + adapter + small + 2 * partials
            l2 = big * (tiles - 1) + split.col_blocks * small
        else:
            min_bytes = 2 * big + small + 2 * adapter
            hbm = 2 * big + small + adapter + 2 * split.splits * adapter
            # x again per extra rank tile; grad_x streams A (all ranks, the block's 256 columns) once per
            # step of the block's warps together (they share the columns: L1 serves the other warps)
            l2 = (
                big * (tiles - 1)
                + n / (tile["rows_per_step"] * tile["warps"]) * adapter
                + split.col_blocks * small * 2
            )
            if mma:  # every block reads dh for its rows and A for its 32 columns once, x once
                l2 = split.col_blocks * small + split.splits * adapter
        core, tensor = (0.0, 2 * flops) if mma else (2 * flops, 0.0)
        if mma and name == "lora_grad_in":  # dh as two bf16 terms: two mma per product
            tensor = 4 * flops
    shared = 2 * tile["warps"] * tile.get("rows_per_step", 0) * tile.get("rank_tile", 0) * 4
    if name == "lora_grad_in":
        shared = (tile["warps"] - 1) * tile["rank_tile"] * (32 if mma else 256) * 4
    used_shared = shared if name in ("lora_grad_out", "lora_grad_in") else 0
    warps = _occupancy(sass.registers, tile["warps"], blocks, used_shared)
    filled = waves(sass.registers, tile["warps"], blocks, used_shared)
    # under one wave, warps/SM already counts the idle slots; the tail of a partial last wave is not
    # modelled (the fit did not need it), only reported as ``waves``
    inflight = warps * 32 * per_lane
    need = HBM / SMS * LATENCY
    bandwidth = HBM * (min(1.0, inflight / need) if per_lane else 1.0)
    ffma = sass.share("FFMA") if sass.counts else 0.75  # no SASS: assume 3 of 4 issued instructions are FFMA
    issue = min(1.0, warps / ISSUE_WARPS)
    t_core = core / (FP32_FMA * max(ffma, 1e-3) * issue) if core else 0.0
    t_tensor = tensor / MMA_SYNC
    # issue slots of a tensor-core kernel, counted as t_core counts them for an FFMA kernel (t_core is
    # FFMA instructions / FFMA share / (ISSUE_RATE x issue)): HMMA instructions / HMMA share of the loop
    hmma = sass.share("HMMA") if sass.counts else 0.0
    t_issue = tensor / HMMA_FLOPS / (ISSUE_RATE * hmma * issue) if tensor and hmma else 0.0
    t_hbm, t_l2 = hbm / bandwidth, l2 / L2
    hbm_floor = min_bytes / HBM
    floor = max(hbm_floor, core / FP32_FMA, tensor / TENSOR_DENSE)
    return Prediction(
        name, rank, n, blocks, mma, sass.registers, sass.source, warps, filled, inflight,
        min_bytes, hbm, l2, core, tensor, ffma,
        t_hbm, t_l2, t_core, t_tensor, t_issue, max(t_hbm, t_l2, t_core, t_tensor, t_issue), hbm_floor, floor,
    )  # fmt: skip


def table(predictions: list[Prediction]) -> str:
    """The markdown table of BENCHMARKS.md's performance model section."""
    lines = [
        "| kernel | R | N | grid | waves | regs | warps/SM | in flight/SM | HBM MB (min) | L2 MB | GFLOP | FFMA share "
        "| bound by | predicted µs | binding floor µs | % of floor | % of HBM floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in predictions:
        unit = "tensor" if p.mma else "cores"
        lines.append(
            f"| {p.kernel}{' (mma)' if p.mma else ''} | {p.rank} | {p.tokens // 1024}k | {p.grid_blocks} "
            f"| {p.waves:.2f} "
            f"| {p.registers} | {p.warps_per_sm:.1f} | {p.inflight_per_sm / 1024:.1f} KB "
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
    predictions: list[Prediction] = []
    sources = set()
    for name in specs.KERNELS:
        for rank in kernel_variants.RANK_BUCKETS:
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
