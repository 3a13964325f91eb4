"""Run a CUDA sibling group's kernel passes at a model's sizes, emulated on the CPU under a sanitizer with
a GPU's launch plans, each checked against float64.

    python scripts/emulate_group_kernels.py                      # q/k/v of the Llama-shaped model, every pass
    python scripts/emulate_group_kernels.py --passes grad_in     # one pass
    python scripts/emulate_group_kernels.py --rows 256 --features 256 --outs 256,256,256   # small: minutes

What a group launches (:mod:`loragen.cuda.group_op`): ``lora_down`` once over the stacked A (each member's
rank in a block of its bucket), ``lora_up`` and ``lora_grad_out`` once per member, ``lora_grad_in`` once
over the stacked A. Each pass runs here on random inputs of those shapes through :mod:`loragen.cuda.passes`,
with the plans a GPU of ``--target-blocks`` blocks gets (264: an H100, two blocks on each of its 132 SMs),
in the emulator of ``tests/cuda/cuda_emulation.py``: under ASan + UBSan (``--sanitizer address``, the
default), TSan (``thread``) or none. A sanitizer report, or an error above the dtype's tolerance, fails the
run. At the Llama-shaped model's sizes (2048 rows, 2048 features, q/k/v at r = 16, bf16) a sanitized pass
takes 5 to 25 minutes on two cores; ``--timeout`` bounds each launch.

Needs a C++ compiler with the sanitizers' runtimes. Run it from the repository root.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tests/ package

from loragen.cuda import passes
from loragen.cuda.kernel_variants import rank_bucket
from tests.cuda.cuda_emulation import EmulatedLauncher, SanitizerError
from tests.cuda.lora_reference import TOLERANCE, relative_error

PASSES = ("down", "up", "grad_out", "grad_in")
_NO_DROPOUT: tuple[torch.Tensor | None, int, float] = (None, 0, 1.0)


def _numbers(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from exc


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2048, help="tokens (default 2048: batch 1, seq 2048)")
    parser.add_argument("--features", type=int, default=2048, help="in features (default 2048)")
    parser.add_argument(
        "--outs", type=_numbers, default=[2048] * 3, help="each member's out features (default q/k/v)"
    )
    parser.add_argument("--rank", type=int, default=16, help="every member's rank (default 16)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    parser.add_argument("--sanitizer", choices=("address", "thread", "none"), default="address")
    parser.add_argument("--target-blocks", type=int, default=264, help="the GPU's plans (default: an H100)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per launch (default 3600)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--build-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "loragen-emulated-kernels",
        help="where the emulated kernels are built and kept between runs",
    )
    return parser.parse_args(argv)


def _checks(args: argparse.Namespace, launcher: EmulatedLauncher) -> dict[str, Callable[[], float]]:
    """Each pass as the group launches it: a function that runs it and returns its largest relative error
    against float64."""
    gen = torch.Generator().manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * scale

    x2 = randn(args.rows, args.features).to(dtype)
    members = [passes.Plan(x2, out, args.rank, launcher) for out in args.outs]
    blocks = [rank_bucket(args.rank)] * len(args.outs)
    stacked = passes.Plan(x2, args.features, sum(blocks), launcher)
    bucket = stacked.variant.rank_bucket
    # the stacked A as the group keeps it: each member's rows in its block, every other row zero
    a32 = torch.zeros(bucket, args.features)
    for i, block in enumerate(blocks):
        a32[i * block : i * block + args.rank] = randn(args.rank, args.features, scale=args.features**-0.5)
    scaling = 2.0

    def down() -> float:
        h = passes.down(stacked, x2, a32, _NO_DROPOUT)
        return relative_error(h, x2.double() @ a32.double().t())

    def member_factors(plan: passes.Plan) -> tuple[torch.Tensor, torch.Tensor]:
        width = plan.variant.rank_bucket
        h = torch.zeros(args.rows, width)
        h[:, : args.rank] = randn(args.rows, args.rank)
        bt32 = torch.zeros(width, plan.out_features)
        bt32[: args.rank] = randn(args.rank, plan.out_features, scale=0.02)
        return h, bt32

    def up() -> float:
        worst = 0.0
        for plan in members:
            h, bt32 = member_factors(plan)
            bias = randn(plan.out_features).to(dtype)
            out = randn(args.rows, plan.out_features).to(dtype)
            want = out.double() + bias.double() + scaling * h.double() @ bt32.double()
            passes.up(plan, h, bt32, bias, scaling, out)
            worst = max(worst, relative_error(out, want))
        return worst

    def grad_out() -> float:
        worst = 0.0
        for plan in members:
            h, bt32 = member_factors(plan)
            g2 = randn(args.rows, plan.out_features).to(dtype)
            dh, db = passes.grad_out(plan, g2, h, bt32, scaling)
            worst = max(
                worst,
                relative_error(dh, scaling * g2.double() @ bt32.double().t()),
                relative_error(db, scaling * g2.double().t() @ h.double()),
            )
        return worst

    def grad_in() -> float:
        dh = torch.zeros(args.rows, bucket)
        for i, block in enumerate(blocks):
            dh[:, i * block : i * block + args.rank] = randn(args.rows, args.rank)
        gx, da = passes.grad_in(stacked, x2, dh, a32, _NO_DROPOUT, True)
        assert gx is not None
        return max(
            relative_error(gx, dh.double() @ a32.double()),
            relative_error(da, dh.double().t() @ x2.double()),
        )

    return {"down": down, "up": up, "grad_out": grad_out, "grad_in": grad_in}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen passes; 0 when every one ran clean and within tolerance, 1 otherwise."""
    args = parse_args(argv)
    sanitizer = None if args.sanitizer == "none" else args.sanitizer
    launcher = EmulatedLauncher(
        args.build_dir, target_blocks=args.target_blocks, sanitizer=sanitizer, timeout=args.timeout
    )
    checks = _checks(args, launcher)
    tolerance = TOLERANCE[getattr(torch, args.dtype)]
    print(
        f"group of {len(args.outs)} ({', '.join(map(str, args.outs))} out), {args.rows} rows, {args.features} "
        f"in, r={args.rank}, {args.dtype}, target_blocks {args.target_blocks}, sanitizer {args.sanitizer}",
        flush=True,
    )
    failed = 0
    for name in args.passes:
        start = len(launcher.launches)
        began = time.perf_counter()
        try:
            error = checks[name]()
        except SanitizerError as exc:
            print(f"{name}: {exc}", flush=True)
            failed += 1
            continue
        grids = ", ".join(f"{kernel} {grid}" for kernel, _, grid in launcher.launches[start:])
        within = error < tolerance  # NaN is not
        verdict = "ok" if within else f"NOT within the tolerance {tolerance:g}"
        print(
            f"{name}: {time.perf_counter() - began:.0f} s, largest relative error {error:.2e} ({verdict}); "
            f"launches: {grids}",
            flush=True,
        )
        failed += not within
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
