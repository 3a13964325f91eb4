"""The commands that read adapter folders: ``loragen merge`` (an adapter merged into a safetensors checkpoint
without building the model) and ``loragen inspect`` (what an adapter folder holds)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from loragen.cli import EXIT_INPUT, EXIT_OK, EXIT_USAGE, SUBCOMMANDS, error

__all__ = ["register_inspect", "register_merge", "run_inspect", "run_merge"]


def register_merge(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``merge`` subcommand."""
    parser = subparsers.add_parser(
        "merge",
        help=SUBCOMMANDS["merge"][2],
        description=(
            "Merge a LoRA adapter folder (peft's format) into a safetensors checkpoint, tensor by tensor,\n"
            "without loading the model. BASE is a .safetensors file or a folder of shards with\n"
            "model.safetensors.index.json; OUT gets the same layout. Untouched tensors are copied byte\n"
            "for byte; merged ones keep their dtype (computed in fp32, rounded once).\n\n"
            "Each adapter tensor must find its own checkpoint tensor. By default the adapter's paths\n"
            "(peft's base_model.model. removed) are used as they are or under the checkpoint's known\n"
            "wrapper: the base_model_prefix of the architecture its config.json names ('model.' for\n"
            "LlamaForCausalLM, whose checkpoint stores model.layers.* while LlamaModel's stores layers.*).\n"
            "Any other naming needs --key-map / --strip-prefix. On any error nothing is written.\n\n"
            "OUT must be new, an empty folder, or a previous loragen merge output (its loragen_merge.json,\n"
            "which lists the files that merge wrote: only those are replaced or removed, each file atomically;\n"
            "other files, links and mount points in OUT are left alone); never BASE, ADAPTER, or a folder\n"
            "inside or around them. A BASE folder's other files (config.json, tokenizer/, ...) are copied;\n"
            "weights of other formats, hidden folders and links to folders are not (the report lists them)."
        ),
        epilog=(
            "examples:\n"
            "  loragen merge --base llama --adapter adapter -o merged\n"
            "  loragen merge --base ckpt.safetensors --adapter adapter -o out.safetensors "
            "--key-map blocks=model.layers --dry-run"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
        "--key-map",
        action="append",
        type=_key_map_rule,
        default=[],
        metavar="OLD=NEW",
        help=(
            "rewrite adapter paths that are OLD or begin with OLD. to begin with NEW instead (whole path "
            "components; OLD empty: add NEW in front of every path); repeatable, the longest OLD wins; "
            "replaces the default mapping"
        ),
    )
    parser.add_argument(
        "--strip-prefix",
        action="append",
        default=[],
        metavar="PREFIX",
        help="remove PREFIX from the front of adapter paths (same as --key-map PREFIX=); repeatable",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check everything and print which checkpoint tensor each adapter tensor changes; write nothing",
    )
    parser.add_argument(
        "--allow-pickle",
        action="store_true",
        help="accept a pickled adapter_model.bin (only from a trusted source)",
    )
    parser.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="merge adapter tensors holding NaN or inf (refused by default: they would poison the weights)",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar (default: when stderr is a terminal)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    parser.set_defaults(func=run_merge)


def _key_map_rule(text: str) -> tuple[str, str]:
    old, sep, new = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not OLD=NEW (e.g. blocks=model.layers)")
    return old, new


def run_merge(args: argparse.Namespace) -> int:
    """Run ``loragen merge``; returns the exit status (0 done, 1 an input error, 2 a usage error; the error
    on stderr)."""
    from loragen.adapters.offline_merge import merge_checkpoint
    from loragen.errors import LoraError

    key_map = dict(args.key_map)
    if len(key_map) < len(args.key_map):
        return error("merge", "--key-map gives the same OLD twice", EXIT_USAGE)
    try:
        report = merge_checkpoint(
            args.base,
            args.adapter,
            args.output,
            key_map=key_map,
            strip_prefix=args.strip_prefix,
            allow_pickle=args.allow_pickle,
            progress=args.progress,
            dry_run=args.dry_run,
            allow_nonfinite=args.allow_nonfinite,
        )
    except (LoraError, OSError) as exc:
        return error("merge", str(exc))
    if args.dry_run:
        for path, key in report.keys.items():
            print(f"{path} -> {key}")
        print(
            f"would merge {len(report.merged)} tensors, replace {len(report.replaced)}, copy {report.copied} "
            f"unchanged into {report.output} ({report.mapping}); nothing written"
        )
    elif not args.quiet:
        replaced = f", replaced {len(report.replaced)}" if report.replaced else ""
        print(
            f"merged {len(report.merged)} tensors{replaced}, copied {report.copied} unchanged "
            f"into {report.output} ({len(report.files)} file{'s' * (len(report.files) != 1)}; "
            f"{report.mapping})"
        )
        if report.skipped:
            print(f"not copied from {args.base}: {', '.join(report.skipped)}")
        if report.removed:
            print(f"removed from the previous merge into {report.output}: {', '.join(report.removed)}")
    return EXIT_OK


def register_inspect(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``inspect`` subcommand."""
    parser = subparsers.add_parser(
        "inspect",
        help=SUBCOMMANDS["inspect"][2],
        description=(
            "Show what a LoRA adapter folder (peft's format) holds: one row per adapted module with its "
            "rank, alpha, scale, shape, parameter count and dtype, tensors saved in full, and totals. "
            "A folder of several named adapters (the one at the root and each in its <name>/ subfolder, as "
            "save_pretrained writes them) gets one report per adapter. Reads only the configs and the "
            "safetensors headers."
        ),
    )
    parser.add_argument("adapter", metavar="ADAPTER", help="adapter folder (adapter_config.json, ...)")
    parser.add_argument(
        "--json",
        action="store_true",
        help='print JSON instead of a table (several adapters: {"folder": ..., "adapters": {name: report}})',
    )
    parser.add_argument(
        "--allow-pickle",
        action="store_true",
        help="accept a pickled adapter_model.bin (only from a trusted source)",
    )
    parser.set_defaults(func=run_inspect)


def _adapter_folders(folder: Path) -> dict[str, Path]:
    """``{name: folder}`` of the adapters in ``folder``: the root one (``"default"``, as ``load_adapter`` names
    it; ``"(root)"`` beside a ``default/`` subfolder) and one per ``<name>/`` subfolder with an
    ``adapter_config.json``; the root alone when there are no named ones (its errors are then the report)."""
    from loragen.adapters.folder import ADAPTER_CONFIG_NAME

    named = (
        {sub.name: sub for sub in sorted(folder.iterdir()) if (sub / ADAPTER_CONFIG_NAME).is_file()}
        if folder.is_dir()
        else {}
    )
    if named and not (folder / ADAPTER_CONFIG_NAME).is_file():
        return named
    return {"(root)" if "default" in named else "default": folder, **named}


def run_inspect(args: argparse.Namespace) -> int:
    """Run ``loragen inspect``; returns the exit status (0 on success, 1 on an error, reported on stderr)."""
    from loragen.adapters.folder import format_summary, inspect_adapter
    from loragen.errors import LoraError

    folder = Path(args.adapter)
    try:
        summaries = {
            name: inspect_adapter(path, allow_pickle=args.allow_pickle)
            for name, path in _adapter_folders(folder).items()
        }
    except (LoraError, OSError) as exc:
        return error("inspect", str(exc), EXIT_INPUT)
    if len(summaries) == 1 and "default" in summaries:
        summary = summaries["default"]
        print(json.dumps(summary.to_json(), indent=2) if args.json else format_summary(summary))
    elif args.json:
        reports = {name: summary.to_json() for name, summary in summaries.items()}
        print(json.dumps({"folder": str(folder), "adapters": reports}, indent=2))
    else:
        print(f"{len(summaries)} adapters in {folder}: {', '.join(summaries)}")
        for name, summary in summaries.items():
            print(f"\n== adapter {name!r} ==\n{format_summary(summary)}")
    return EXIT_OK
