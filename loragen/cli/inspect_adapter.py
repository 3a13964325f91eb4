"""``loragen inspect``: what an adapter folder holds."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``inspect`` subcommand."""
    parser = subparsers.add_parser(
        "inspect",
        help="show the target modules, ranks, alphas, scales, sizes and dtypes of an adapter",
        description=(
            "Show what a LoRA adapter folder (peft's format) holds: one row per adapted module with its "
            "rank, alpha, scale, shape, parameter count and dtype, tensors saved in full, and totals. "
            "Reads only the config and the safetensors header."
        ),
    )
    parser.add_argument("adapter", metavar="ADAPTER", help="adapter folder (adapter_config.json, ...)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--allow-pickle",
        action="store_true",
        help="accept a pickled adapter_model.bin (only from a trusted source)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``loragen inspect``; returns the exit status (0 on success, 1 on an error, reported on stderr)."""
    from loragen.adapters.summary import format_summary, inspect_adapter
    from loragen.errors import LoraError

    try:
        summary = inspect_adapter(args.adapter, allow_pickle=args.allow_pickle)
    except (LoraError, OSError) as exc:
        print(f"loragen inspect: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary.to_json(), indent=2))
    else:
        print(format_summary(summary))
    return 0
