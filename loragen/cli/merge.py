"""``loragen merge``: merge an adapter into a safetensors checkpoint without building the model."""

from __future__ import annotations

import argparse
import sys

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``merge`` subcommand."""
    parser = subparsers.add_parser(
        "merge",
        help="merge a peft/loragen adapter into a safetensors checkpoint (file or shard folder)",
        description=(
            "Merge a LoRA adapter folder (peft's format) into a safetensors checkpoint, tensor by tensor, "
            "without loading the model. BASE is a .safetensors file or a folder of shards with "
            "model.safetensors.index.json; OUT gets the same layout. Untouched tensors are copied byte for "
            "byte; merged ones keep their dtype (computed in fp32, rounded once)."
        ),
    )
    parser.add_argument(
        "--base", required=True, metavar="BASE", help="checkpoint: .safetensors file or shard folder"
    )
    parser.add_argument(
        "--adapter", required=True, metavar="ADAPTER", help="adapter folder (adapter_config.json, ...)"
    )
    parser.add_argument(
        "-o", "--output", required=True, metavar="OUT", help="output file or folder (not BASE)"
    )
    parser.add_argument(
        "--allow-pickle",
        action="store_true",
        help="accept a pickled adapter_model.bin (only from a trusted source)",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar (default: when stderr is a terminal)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``loragen merge``; returns the exit status (0 on success, 1 on an error, reported on stderr)."""
    from loragen.adapters.io import AdapterError
    from loragen.adapters.merge import MergeError, merge_checkpoint
    from loragen.config import LoraConfigError

    try:
        report = merge_checkpoint(
            args.base, args.adapter, args.output, allow_pickle=args.allow_pickle, progress=args.progress
        )
    except (MergeError, AdapterError, LoraConfigError, OSError) as exc:
        print(f"loragen merge: error: {exc}", file=sys.stderr)
        return 1
    if not args.quiet:
        replaced = f", replaced {len(report.replaced)}" if report.replaced else ""
        print(
            f"merged {len(report.merged)} tensors{replaced}, copied {report.copied} unchanged "
            f"into {report.output} ({len(report.files)} file{'s' * (len(report.files) != 1)}; "
            f"{report.mapping})"
        )
    return 0
