"""``loragen rewrite``: rewrite model source files so that their targeted layers are LoRA layers."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import re
import sys
from pathlib import Path
from typing import Any

from loragen.adapters.files import read_json_file
from loragen.atomic import atomic_file
from loragen.cli import EXIT_INPUT, EXIT_OK, EXIT_USAGE, SUBCOMMANDS, add_lora_arguments, error
from loragen.config import ALL_LINEAR, LoraConfig
from loragen.errors import LoraConfigError
from loragen.plan import check_pattern
from loragen.source.rewriter import (
    Diagnostic,
    RewriteResult,
    imported_modules,
    installed_packages,
    model_classes,
    module_name_for_path,
    relative_imports,
    rewrite_source,
)

__all__ = ["register", "run"]

_DEFAULTS = LoraConfig()
_REGEX_CHARACTERS = re.compile(r"[\\^$*+?{}\[\]()|]")

DESCRIPTION = f"""\
Rewrite the constructor calls of targeted layer fields into loragen LoRA layers: only the callee
changes and LoRA keywords are added (nn.Linear(a, b, bias=False) -> LoraLinear(a, b, bias=False,
r={_DEFAULTS.r}, lora_alpha={_DEFAULTS.lora_alpha:g})). The file also gets the loragen imports and its config as
LORA_CONFIG = LoraConfig(...), carried by its LoRA classes as `loragen_config` (so
loragen.mark_trainable(model) needs no config). Formatting and comments are kept; rewriting is
idempotent. A package file (e.g. transformers' modeling_llama.py) written elsewhere gets absolute
imports, so the output is standalone. The package is --package, else the one the file's __init__.py
folders name, else, for a copy outside any package folder, the installed package that holds a file of
that name beside the modules its relative imports name (a note on stderr says which); a file with relative
imports and no such package is an input error that asks for --package.

The PreTrainedModel classes of a file holding LoRA layers get an _init_weights hook, with which
from_pretrained gives the LoRA factors a checkpoint lacks peft's initialisation. The files of one run are
one model: when any gets LoRA layers, the PreTrainedModel classes of all of them get the hook (for a model
split into blocks.py and modeling.py, rewrite both, or the folder). A model file left out of the run that
imports a rewritten file is named in a warning, as is a rewritten file that imports transformers in a run
without PreTrainedModel classes.

An nn.Linear subclass defined in the file gets its LoRA class bound after it (LoraFalconLinear =
lora_class_for(FalconLinear)). Sub-models built with AutoModel.from_config (Gemma 3, LLaVA, ...) are
built through a LoRA auto class (LoraAutoModel = lora_auto_class(AutoModel, [...], LORA_CONFIG)),
each reported as a warning at file:line.

Targets follow peft's target_modules: --target-modules takes module names (an exact path or a dotted
suffix, comma-separated) or all-linear; --target-regex one regular expression that must match a whole
module path. A target that matches no layer field in any file is an error (unless a file builds
sub-models with auto classes: they may hold it).

Without -o/--in-place/--diff the rewritten file is printed (one SRC file only); a per-file summary and
warnings go to stderr. Exit status: 0 done; 1 an input error: a missing or unreadable SRC or --config,
a file that cannot be rewritten or written, a target that matches nothing (nothing is written then;
each error as file:line: message); 2 a usage error: flags, or outputs that collide.

Every output path is checked before the first write: two sources onto one output, an output that is a
source (without --in-place), or a file where a folder is needed are usage errors, and nothing is
written. Each file goes to a temporary file beside it, renamed into place with the replaced file's mode.
Symbolic links are followed: the file a link points to is rewritten and the link kept.
"""

EPILOG = f"""\
examples:
  loragen rewrite model.py --target-modules q_proj,v_proj --r {_DEFAULTS.r} --lora-alpha {_DEFAULTS.lora_alpha:g} -o model_lora.py
  loragen rewrite model.py --target-regex '.*\\.layers\\.\\d+\\.(q_proj|v_proj)' --diff
  loragen rewrite src/models/ --config adapter_config.json --in-place
  loragen rewrite "$(python -c 'import transformers.models.llama.modeling_llama as m; print(m.__file__)')" \\
      --target-modules all-linear -o modeling_llama_lora.py
"""


class _Refused(Exception):
    """The command cannot start: ``str(exc)`` says why, ``status`` is the exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def register(subparsers: Any) -> None:
    """Add the ``rewrite`` subcommand to the ``loragen`` parser."""
    parser = subparsers.add_parser(
        "rewrite",
        help=SUBCOMMANDS["rewrite"][2],
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
    targets = parser.add_mutually_exclusive_group()
    targets.add_argument(
        "--target-modules",
        metavar="A,B",
        help="module names, comma-separated (exact path or dotted suffix), or all-linear",
    )
    targets.add_argument(
        "--target-regex",
        metavar="REGEX",
        help="target_modules as one regular expression matching whole module paths",
    )
    add_lora_arguments(
        parser,
        r_default=None,
        alpha_help=f"default {_DEFAULTS.lora_alpha:g}, or the --config value",
        dropout_default=None,
        unset_help=", or the --config value",
    )
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


def _target_names(text: str) -> str | list[str]:
    """``--target-modules``: ``"all-linear"`` or the list of names; raises _Refused for a regex."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise _Refused("--target-modules is empty; give names like q_proj,v_proj or all-linear", EXIT_USAGE)
    if names == [ALL_LINEAR]:
        return ALL_LINEAR
    for name in names:
        if _REGEX_CHARACTERS.search(name):
            raise _Refused(
                f"--target-modules {name!r} is not a module name: it looks like a regular expression. "
                f"Pass it as --target-regex {text!r} (it must then match whole module paths, as in peft), "
                "or name the modules (an exact path or a dotted suffix such as self_attn.q_proj)",
                EXIT_USAGE,
            )
    return names


def _config(args: argparse.Namespace) -> LoraConfig:
    """The LoraConfig from --config and the flags.

    Raises:
        _Refused: an unreadable or invalid --config file (an input error), or flags that make no valid
            config (a usage error).
    """
    changes: dict[str, Any] = {}
    if args.target_modules is not None:
        changes["target_modules"] = _target_names(args.target_modules)
    if args.target_regex is not None:
        changes["target_modules"] = args.target_regex
    for flag in ("r", "lora_alpha", "lora_dropout"):
        if getattr(args, flag) is not None:
            changes[flag] = getattr(args, flag)
    config = None
    if args.config is not None:
        path = args.config / "adapter_config.json" if args.config.is_dir() else args.config
        try:
            config = LoraConfig.from_peft(read_json_file(path, LoraConfigError), source=str(path))
        except LoraConfigError as exc:
            raise _Refused(str(exc), EXIT_INPUT) from None
    try:
        config = LoraConfig(**changes) if config is None else config.replace(**changes)
        if args.target_regex is not None:  # valid, as the config checked: can it backtrack catastrophically?
            check_pattern("--target-regex", args.target_regex)
    except LoraConfigError as exc:
        raise _Refused(str(exc), EXIT_USAGE) from None
    if config.target_modules is None:
        raise _Refused(
            "no target modules: pass --target-modules a,b (or all-linear), --target-regex REGEX, "
            "or --config adapter_config.json",
            EXIT_USAGE,
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
            raise _Refused(f"{source}: no such file or folder", EXIT_INPUT)
    if not files:
        raise _Refused(f"no Python files in {', '.join(map(str, sources))}", EXIT_INPUT)
    return files


def _read(path: Path) -> tuple[str, tuple[int, str] | None]:
    """The file's text (newlines kept as they are), or ``(line, message)`` saying why it cannot be read."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        return "", (1, f"cannot read: {exc.strerror or exc}")
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1)
        return "", (
            line,
            f"not UTF-8 text: byte 0x{data[exc.start]:02x} at column {column + 1} ({exc.reason})",
        )


def _package_of(path: Path, code: str, given: str | None) -> tuple[str | None, str | None, Diagnostic | None]:
    """``(package, note, error)``: the package ``path`` belongs to: ``--package``, else the one its
    ``__init__.py`` folders name, else, for a file with relative imports outside any package folder (a
    copy), the installed package that holds a file of that name beside the modules it imports (``note``
    says which). A file with relative imports and no such package, or several, is an ``error``."""
    if given:
        return given, None, None
    package = module_name_for_path(path)[1]
    imports = relative_imports(code) if package is None else []
    if not imports:
        return package, None, None
    found = installed_packages(path, code)
    if len(found) == 1:
        package, file = found[0]
        return (
            package,
            f"{path}: relative imports resolved in the installed package {package}, which holds {file}; "
            "pass --package PKG to name another",
            None,
        )
    line, level, module = imports[0]
    where = (
        f"several installed packages hold a {path.name} beside the modules it imports ({', '.join(p for p, _ in found)})"
        if found
        else f"no installed package holds a {path.name} beside the modules it imports"
    )
    return (
        None,
        None,
        Diagnostic(
            str(path),
            line,
            f"relative import (from {'.' * level}{module or ''} import ...) in a file outside any package folder, "
            f"and {where}: pass --package PKG, the package the file comes from (e.g. --package "
            "transformers.models.llama for a copy of transformers' modeling_llama.py)",
        ),
    )


def _unmatched(config: LoraConfig, results: list[RewriteResult]) -> list[str]:
    """One message per target entry that selects no layer field in any of the files."""
    readable = [r for r in results if not r.errors]
    if not readable:
        return []
    unmatched = set.intersection(*(set(r.unmatched_targets) for r in readable))
    found = list(dict.fromkeys(f.pattern for r in readable for f in r.fields))
    shown = ", ".join(found[:20]) + (", ..." if len(found) > 20 else "") if found else "none"
    what = "target_modules regex" if isinstance(config.target_modules, str) else "target_modules entry"
    return [
        f"{what} {entry!r} matches no layer field in {len(readable)} file(s); layer fields found: {shown}"
        for entry in sorted(unmatched)
    ]


def _holds_lora(result: RewriteResult) -> bool:
    """Whether a rewritten file holds LoRA layers (or builds sub-models through LoRA auto classes)."""
    return bool(result.rewritten or result.sub_models)


def _search_folders(path: Path) -> list[Path]:
    """The folder of ``path`` and the folders of its package above it (each holding an ``__init__.py``)."""
    folders = [path.resolve().parent]
    while (folders[-1] / "__init__.py").is_file() and (folders[-1].parent / "__init__.py").is_file():
        folders.append(folders[-1].parent)
    return folders


def _models_using(path: Path, package: str | None, run: set[Path]) -> list[tuple[Path, list[str]]]:
    """``(file, model classes)`` for each file outside ``run``, in ``path``'s folder or a folder of its
    package above it, that defines ``PreTrainedModel`` classes and imports ``path``'s module."""
    module = f"{package}.{path.stem}" if package else path.stem
    found: list[tuple[Path, list[str]]] = []
    for folder in _search_folders(path):
        for other in sorted(folder.glob("*.py")):
            if other.resolve() in run:
                continue
            code, problem = _read(other)
            if problem is not None or "PreTrainedModel" not in code or path.stem not in code:
                continue
            classes = model_classes(code)
            importer = module_name_for_path(other)[1]
            if importer is None and other.parent.resolve() == path.resolve().parent:
                importer = package  # a copy outside any package folder: its neighbours are copies too
            uses = any(
                name == module or (name == package and path.stem in names)
                for name, names in imported_modules(code, importer)
            )
            if classes and uses:
                found.append((other, list(classes)))
    return found


def _uninitialised_lora(
    results: list[tuple[Path, Path, str, RewriteResult]], packages: dict[Path, tuple[str | None, bool]]
) -> list[str]:
    """Warnings for the LoRA layers that ``from_pretrained`` may leave uninitialised: a model of the run whose
    ``PreTrainedModel`` base class is in a file outside the run, a ``PreTrainedModel`` file outside the run
    that imports a rewritten file, a rewritten file that imports transformers when no file of the run defines a
    ``PreTrainedModel`` class (so none got the ``_init_weights`` hook)."""
    if not any(_holds_lora(result) for *_, result in results):
        return []
    run = {path.resolve() for path, *_ in results}
    hooked = {name for *_, result in results for name in result.init_hooks}
    messages: list[str] = []
    for path, _, code, result in results:
        # models of the run whose PreTrainedModel base class comes from a file the run does not hold
        models = model_classes(code) if not result.init_hooks and "PreTrainedModel" in code else {}
        foreign = sorted(
            {
                base
                for base in models.values()
                if base not in models.keys() | hooked and base != "PreTrainedModel"
            }
        )
        if foreign:
            origins = [
                f"{base} (from {module})"
                for base in foreign
                for module, names in imported_modules(code, packages[path][0])
                if base in names
            ]
            messages.append(
                f"{path}: warning: the PreTrainedModel base class {', '.join(origins or foreign)} of "
                f"{', '.join(models)} is in a file not rewritten in this run: its _init_weights has no LoRA hook, so "
                "from_pretrained leaves the LoRA factors a checkpoint lacks uninitialised. Rewrite that file in the "
                "same run"
            )
    for path, _, code, result in results:
        if not result.rewritten:
            continue
        package = packages[path][0]
        users = _models_using(path, package, run)
        for user, classes in users:
            shown = ", ".join(classes[:3]) + (", ..." if len(classes) > 3 else "")
            messages.append(
                f"{path}: warning: {user} defines {shown} (transformers PreTrainedModel) and imports this file's "
                "classes, but is not rewritten in this run: its _init_weights has no LoRA hook, so from_pretrained "
                f"leaves the LoRA factors a checkpoint lacks uninitialised. Rewrite both in one run "
                f"(loragen rewrite {path} {user} ...) or the whole folder (loragen rewrite {user.parent} ...)"
            )
        transformers = any(
            name == "transformers" or name.startswith("transformers.")
            for name, _ in imported_modules(code, package)
        )
        if not users and not hooked and transformers:
            messages.append(
                f"{path}: warning: LoRA layers in a file that imports transformers, and no file of this run "
                "defines a PreTrainedModel class: if a transformers model of another file builds these layers, its "
                "_init_weights has no LoRA hook, so from_pretrained leaves the LoRA factors a checkpoint lacks "
                "uninitialised. Rewrite the file that defines the model's PreTrainedModel class in the same run, "
                "or the model's whole folder (loragen rewrite DIR ...)"
            )
    return messages


def _blocking_file(path: Path) -> Path | None:
    """The nearest existing ancestor of ``path`` when it is not a folder (so ``path`` cannot be created)."""
    for parent in path.parents:
        if parent.exists() or parent.is_symlink():
            return None if parent.is_dir() else parent
    return None


def _same_file(a: Path, b: Path) -> bool:
    with contextlib.suppress(OSError):
        return os.path.samefile(a, b)
    return False


def _plan_writes(
    args: argparse.Namespace, writes: list[tuple[Path, Path, str]], inputs: list[Path]
) -> list[tuple[Path, str]]:
    """``(real path, text)`` for every file to write, after checking all of them against each other and the
    inputs; ``writes`` holds ``(source, output path as given, text)``.

    Links are resolved on purpose: the real path is written and a link to it stays a link.

    Raises:
        ValueError: with one line per problem: two sources onto one output, an output that is an input
            (without ``--in-place``), a folder where a file goes, a file where a folder is needed.
    """
    problems: list[str] = []
    planned: dict[Path, tuple[Path, str]] = {}  # real output path -> (its source, text)
    real_inputs = {Path(os.path.realpath(p)): p for p in inputs}
    for source, given, text in writes:
        real = Path(os.path.realpath(given))
        if not args.in_place:
            onto = real_inputs.get(real) or next((p for p in inputs if _same_file(p, real)), None)
            if onto is not None:
                problems.append(
                    f"{given}: the output would overwrite the source {onto}; "
                    "pass --in-place to rewrite sources in place, or choose another -o"
                )
                continue
        earlier = planned.get(real)
        if earlier is not None:
            if not _same_file(earlier[0], source) or earlier[1] != text:
                problems.append(f"{given}: both {earlier[0]} and {source} would be written here")
            continue
        if real.is_dir():
            problems.append(f"{given}: is a folder; a file would be written here")
            continue
        blocking = _blocking_file(real)
        if blocking is not None:
            problems.append(f"{given}: {blocking} is a file, not a folder")
            continue
        planned[real] = (source, text)
    if problems:
        raise ValueError("\n".join(problems))
    return [(real, text) for real, (_, text) in planned.items()]


def _write_all(planned: list[tuple[Path, str]]) -> str | None:
    """Write every file atomically; all temporary files are written before the first rename, so a failure
    to write (disk full, no permission) leaves every target untouched. Returns an error message or None."""
    created = [f for f in {p.parent for p, _ in planned} if not f.exists()]
    try:
        with contextlib.ExitStack() as stack:
            for path, text in planned:
                tmp = stack.enter_context(atomic_file(path))
                tmp.write_bytes(text.encode("utf-8"))
            # leaving the stack renames each temporary file onto its target
    except OSError as exc:
        written = [p for p, text in planned if p.is_file() and _reads_as(p, text)]
        for folder in sorted(created, key=lambda f: len(f.parts), reverse=True):
            with contextlib.suppress(OSError):  # only folders this run made and left empty
                folder.rmdir()
        where = (
            f"; written before the failure: {', '.join(map(str, written))}"
            if written
            else "; nothing was written"
        )
        return f"cannot write: {exc}{where}"
    return None


def _reads_as(path: Path, text: str) -> bool:
    with contextlib.suppress(OSError):
        return path.read_bytes() == text.encode("utf-8")
    return False


def run(args: argparse.Namespace) -> int:
    """Rewrite the sources; returns the exit status (0 done, 1 an input error, 2 a usage error)."""
    try:
        config = _config(args)
        files = _collect(args.sources)
    except _Refused as exc:
        return error("rewrite", str(exc), exc.status)
    to_stdout = not (args.output or args.in_place or args.diff)
    if to_stdout and len(files) > 1:
        return error(
            "rewrite", f"{len(files)} files to rewrite: use -o FOLDER, --in-place or --diff", EXIT_USAGE
        )
    single_file_output = (
        args.output is not None
        and len(files) == 1
        and args.sources[0].is_file()
        and not (args.output.is_dir() or str(args.output).endswith(("/", "\\")))
    )
    # written elsewhere, a package file needs absolute imports; in place its relative ones still work
    standalone = not (args.in_place or args.diff)

    results: list[tuple[Path, Path, str, RewriteResult]] = []
    packages: dict[Path, tuple[str | None, bool]] = {}  # file -> (its package, absolute imports)
    for path, relative in files:
        code, problem = _read(path)
        if problem is not None:
            diagnostic = Diagnostic(str(path), *problem)
            results.append((path, relative, "", RewriteResult("", False, str(path), errors=(diagnostic,))))
            continue
        package, note, problem_at = _package_of(path, code, args.package)
        if problem_at is not None:
            results.append(
                (path, relative, code, RewriteResult(code, False, str(path), errors=(problem_at,)))
            )
            continue
        if note is not None and not args.quiet:
            print(note, file=sys.stderr)
        # a copy outside any package folder: relative imports cannot work where it is, in place or not
        packages[path] = (package, standalone or note is not None)
        result = rewrite_source(
            code, config, filename=str(path), package=package, absolute_imports=packages[path][1]
        )
        results.append((path, relative, code, result))
    if any(_holds_lora(result) for *_, result in results):
        # from_pretrained fills the LoRA factors a checkpoint lacks with the model's _init_weights: every
        # PreTrainedModel class of the run gets the hook, whichever file holds the layers it builds
        for index, (path, relative, code, result) in enumerate(results):
            if not result.errors and not _holds_lora(result) and "PreTrainedModel" in code:
                package, absolute = packages[path]
                hooked = rewrite_source(
                    code,
                    config,
                    filename=str(path),
                    package=package,
                    absolute_imports=absolute,
                    init_hook=True,
                )
                results[index] = (path, relative, code, hooked)

    unmatched = _unmatched(config, [r for *_, r in results])
    failed = [r for *_, r in results if r.errors]
    for *_, result in results:
        for diagnostic in result.errors:
            print(str(diagnostic), file=sys.stderr)
        if not args.quiet:
            for warning in result.warnings:
                print(f"{warning.filename}:{warning.line}: warning: {warning.message}", file=sys.stderr)
            # a file without layers has nothing to say
            if result.fields or result.sub_models or result.init_hooks or result.errors or len(results) == 1:
                print(result.summary(), file=sys.stderr)
    for message in unmatched:
        error("rewrite", message)
    if failed or unmatched:
        what = (
            f"{len(failed)} of {len(results)} files could not be rewritten"
            if failed
            else "a target matches nothing"
        )
        print(f"loragen rewrite: {what}; nothing was written", file=sys.stderr)
        return EXIT_INPUT
    if not args.quiet:
        for message in _uninitialised_lora(results, packages):
            print(message, file=sys.stderr)

    if to_stdout or args.diff:
        for path, _, code, result in results:
            if to_stdout:
                sys.stdout.write(result.code)
            else:
                sys.stdout.writelines(
                    difflib.unified_diff(
                        code.splitlines(keepends=True),
                        result.code.splitlines(keepends=True),
                        fromfile=str(path),
                        tofile=str(path),
                    )
                )
        return EXIT_OK
    writes = [  # (source, where its rewrite goes: itself, OUT or OUT/relative, text)
        (
            path,
            path if args.in_place else args.output if single_file_output else args.output / relative,
            result.code,
        )
        for path, relative, _, result in results
        if result.changed or not args.in_place
    ]
    try:
        planned = _plan_writes(args, writes, [path for path, *_ in results])
    except ValueError as exc:
        error("rewrite", str(exc))
        print("loragen rewrite: nothing was written", file=sys.stderr)
        return EXIT_USAGE
    failure = _write_all(planned)
    if failure is not None:
        return error("rewrite", failure, EXIT_INPUT)
    return EXIT_OK
