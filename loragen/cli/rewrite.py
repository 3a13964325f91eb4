"""``loragen rewrite``: rewrite model source files so that their targeted layers are LoRA layers."""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["EXIT_FILE_ERRORS", "EXIT_OK", "EXIT_USAGE", "register", "run"]

EXIT_OK = 0
EXIT_FILE_ERRORS = 1  # some file could not be rewritten (invalid Python, a config it cannot express)
EXIT_USAGE = 2  # bad arguments, missing files, an unreadable config

DESCRIPTION = """\
Rewrite the constructor calls of targeted layer fields into loragen LoRA layers: only the callee
changes and LoRA keywords are added (nn.Linear(a, b, bias=False) -> LoraLinear(a, b, bias=False,
r=8, lora_alpha=16)), plus one `from loragen import ...` line; formatting and comments are kept.
A file inside an installed package (e.g. transformers' modeling_llama.py) written elsewhere gets
absolute imports, so the output is standalone. Rewriting is idempotent.

Without -o/--in-place/--diff the rewritten file is printed (one SRC file only). A per-file summary
and warnings go to stderr. Exit status: 0 done, 1 some file could not be rewritten (nothing is
written then; each error as file:line: message), 2 usage error.
"""

EPILOG = """\
examples:
  loragen rewrite model.py --target-modules q_proj,v_proj --r 8 --lora-alpha 16 -o model_lora.py
  loragen rewrite src/models/ --config adapter_config.json --in-place
  loragen rewrite "$(python -c 'import transformers.models.llama.modeling_llama as m; print(m.__file__)')" \\
      --target-modules all-linear -o modeling_llama_lora.py
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def register(subparsers: Any) -> None:
    """Add the ``rewrite`` subcommand to the ``loragen`` parser."""
    parser = subparsers.add_parser(
        "rewrite",
        help="rewrite model source files so that targeted layers become LoRA layers",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "sources", nargs="+", metavar="SRC", type=Path, help="Python files or folders (*.py inside)"
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "-o",
        "--output",
        type=Path,
        metavar="OUT",
        help="write here: a file for one SRC file, else a folder mirroring the sources",
    )
    where.add_argument("--in-place", action="store_true", help="replace the source files (atomically)")
    where.add_argument("--diff", action="store_true", help="print a unified diff instead of writing")
    parser.add_argument(
        "--target-modules",
        metavar="A,B",
        help="comma-separated module names (exact or dotted suffix), or all-linear",
    )
    parser.add_argument(
        "--r", type=_positive_int, metavar="N", help="LoRA rank (default 8, or the --config value)"
    )
    parser.add_argument(
        "--lora-alpha", type=_float, metavar="A", help="LoRA alpha (default 8, or the --config value)"
    )
    parser.add_argument("--lora-dropout", type=_float, metavar="P", help="LoRA dropout (default 0)")
    parser.add_argument(
        "--config",
        type=Path,
        metavar="JSON",
        help="a peft adapter_config.json (or the adapter folder); flags override its values",
    )
    parser.add_argument(
        "--package",
        metavar="PKG",
        help="the package the sources belong to (default: found from __init__.py files)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no summary or warnings on stderr")
    parser.set_defaults(func=run)


def _config(args: argparse.Namespace) -> Any:
    """The LoraConfig from --config and the flags; raises ValueError with a message for the user."""
    from loragen.config import ALL_LINEAR, LoraConfig, LoraConfigError

    changes: dict[str, Any] = {}
    if args.target_modules is not None:
        names = [n.strip() for n in args.target_modules.split(",") if n.strip()]
        if not names:
            raise ValueError("--target-modules is empty; give names like q_proj,v_proj or all-linear")
        changes["target_modules"] = ALL_LINEAR if names == [ALL_LINEAR] else names
    if args.r is not None:
        changes["r"] = args.r
    if args.lora_alpha is not None:
        changes["lora_alpha"] = args.lora_alpha
    if args.lora_dropout is not None:
        changes["lora_dropout"] = args.lora_dropout
    try:
        if args.config is not None:
            path = args.config / "adapter_config.json" if args.config.is_dir() else args.config
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"{path}: cannot read: {exc}") from None
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
            config = LoraConfig.from_peft(data, source=str(path))
            return config.replace(**changes) if changes else config
        config = LoraConfig(**changes)
    except LoraConfigError as exc:
        raise ValueError(str(exc)) from None
    if config.target_modules is None:
        raise ValueError(
            "no target modules: pass --target-modules a,b (or all-linear) or --config adapter_config.json"
        )
    return config


def _collect(sources: list[Path]) -> list[tuple[Path, Path]]:
    """``(file, path relative to its SRC)`` for every Python file named or inside a named folder."""
    files: list[tuple[Path, Path]] = []
    for source in sources:
        if source.is_dir():
            for path in sorted(source.rglob("*.py")):
                relative = path.relative_to(source)
                if any(part.startswith(".") or part == "__pycache__" for part in relative.parts[:-1]):
                    continue
                files.append((path, relative))
        elif source.is_file():
            files.append((source, Path(source.name)))
        else:
            raise ValueError(f"{source}: no such file or folder")
    if not files:
        raise ValueError(f"no Python files in {', '.join(map(str, sources))}")
    return files


def run(args: argparse.Namespace) -> int:
    """Rewrite the sources; returns the exit status (0 done, 1 some file failed, 2 usage error)."""
    from loragen.atomic import atomic_write_text
    from loragen.source.rewrite import Diagnostic, RewriteResult, module_name_for_path, rewrite_source

    def fail(message: str) -> int:
        print(f"loragen rewrite: error: {message}", file=sys.stderr)
        return EXIT_USAGE

    try:
        config = _config(args)
        files = _collect(args.sources)
    except ValueError as exc:
        return fail(str(exc))
    to_stdout = not (args.output or args.in_place or args.diff)
    if to_stdout and len(files) > 1:
        return fail(f"{len(files)} files to rewrite: use -o FOLDER, --in-place or --diff")
    single_file_output = (
        args.output is not None
        and len(files) == 1
        and args.sources[0].is_file()
        and not (args.output.is_dir() or str(args.output).endswith(("/", "\\")))
    )
    # written elsewhere, a package file needs absolute imports; in place its relative ones still work
    standalone = not (args.in_place or args.diff)

    results: list[tuple[Path, Path, str, RewriteResult]] = []
    for path, relative in files:
        try:
            with open(path, encoding="utf-8", newline="") as fh:
                code = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            failed = RewriteResult(
                "", False, str(path), errors=(Diagnostic(str(path), 1, f"cannot read: {exc}"),)
            )
            results.append((path, relative, "", failed))
            continue
        package = args.package or module_name_for_path(path)[1]
        result = rewrite_source(
            code, config, filename=str(path), package=package, absolute_imports=standalone
        )
        results.append((path, relative, code, result))

    failed = [r for *_, r in results if r.errors]
    if not args.quiet or failed:
        for *_, result in results:
            for error in result.errors:
                print(f"{error.filename}:{error.line}: {error.message}", file=sys.stderr)
            if not args.quiet:
                for warning in result.warnings:
                    print(f"{warning.filename}:{warning.line}: warning: {warning.message}", file=sys.stderr)
                print(result.summary(), file=sys.stderr)
    if failed:
        print(
            f"loragen rewrite: {len(failed)} of {len(results)} files could not be rewritten; nothing was written",
            file=sys.stderr,
        )
        return EXIT_FILE_ERRORS

    for path, relative, code, result in results:
        if to_stdout:
            sys.stdout.write(result.code)
        elif args.diff:
            sys.stdout.writelines(
                difflib.unified_diff(
                    code.splitlines(keepends=True),
                    result.code.splitlines(keepends=True),
                    fromfile=str(path),
                    tofile=str(path),
                )
            )
        elif args.in_place:
            if result.changed:
                atomic_write_text(path, result.code)
        else:
            target = args.output if single_file_output else args.output / relative
            atomic_write_text(target, result.code)
    return EXIT_OK
