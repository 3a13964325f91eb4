"""Rewrite a model's source so that its targeted layers are built as loragen LoRA layers.

:func:`rewrite_source` is the pure function behind ``loragen rewrite`` (docs/ways-in.md): source in,
:class:`RewriteResult` out; bad input (invalid Python, a config it cannot express, a name clash) comes back
as errors with ``file:line``, never as an exception. The planner here decides what changes,
:mod:`~loragen.source.codegen` makes the edits, :mod:`~loragen.source.targets` matches the config's targets.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import gc
import os
import pkgutil
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import libcst as cst
import libcst.matchers as m

from loragen.config import LoraConfig
from loragen.errors import LoraError
from loragen.plan import fused_expert_parameters
from loragen.source.codegen import (
    CONFIG_NAME,
    Diagnostic,
    Editor,
    ModuleLine,
    RewriteResult,
    RewrittenCall,
    add_module_lines,
    add_preamble,
    config_attribute,
    config_literal,
    edit_call,
    has_lora_hook,
    lora_keywords,
    py_literal,
    top_level_bindings,
)
from loragen.source.scan import (
    LORA_AUTO_CLASS,
    LORA_CLASS_FOR,
    LayerField,
    ScanError,
    ScannedModule,
    absolute_module,
    code_of,
    definitions,
    nested_statements,
    scan_module,
    source_text,
)
from loragen.source.targets import PRETRAINED, Targets

__all__ = [
    "Diagnostic",
    "RewriteResult",
    "RewrittenCall",
    "imported_modules",
    "installed_packages",
    "model_classes",
    "module_name_for_path",
    "relative_imports",
    "rewrite_source",
]

# names the rewritten file imports besides the LoRA classes: (module, name)
_CONFIG_IMPORT = ("loragen", "LoraConfig")
_HOOK_IMPORT = ("loragen.layers", "LoraLayer")
# a relative import inside a function or class (indented), which an absolute-imports rewrite must reach
_NESTED_RELATIVE_IMPORT = re.compile(r"^[ \t]+from[\s\\]+\.", re.MULTILINE)
_INIT = m.FunctionDef(name=m.Name("__init__"))
# a class header and a ``self.x = nn.Parameter(`` line, to find the parameters a class declares
_CLASS = re.compile(r"class\s+(\w+)\b")
_PARAMETER = re.compile(r"\s+self\.(\w+)\s*(?::[^=]+)?=\s*(?:torch\.)?(?:nn\.)?Parameter\(")


def module_name_for_path(path: str | os.PathLike[str]) -> tuple[str | None, str | None]:
    """``(module, package)`` of a source file found by walking up its ``__init__.py`` folders.

    ``.../site-packages/transformers/models/llama/modeling_llama.py`` gives
    ``("transformers.models.llama.modeling_llama", "transformers.models.llama")``; a file outside any
    package gives ``(None, None)``.
    """
    file = Path(path).resolve()
    parts: list[str] = []
    folder = file.parent
    while (folder / "__init__.py").is_file() and folder.name.isidentifier():
        parts.append(folder.name)
        folder = folder.parent
    if not parts:
        return None, None
    package = ".".join(reversed(parts))
    return (package if file.stem == "__init__" else f"{package}.{file.stem}"), package


def relative_imports(code: str) -> list[tuple[int, int, str | None]]:
    """``(line, level, module)`` of every relative import in ``code`` (``from ...modeling_utils import X``
    gives ``(line, 3, "modeling_utils")``); none for code that does not parse (the rewrite reports that)."""
    tree = _parse(code)
    return [
        (node.lineno, node.level, node.module)
        for node in (ast.walk(tree) if tree is not None else ())
        if isinstance(node, ast.ImportFrom) and node.level
    ]


def _parse(code: str) -> ast.Module | None:
    try:
        return ast.parse(code.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n"))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def imported_modules(code: str, package: str | None) -> list[tuple[str, tuple[str, ...]]]:
    """``(module, names)`` for every import in ``code``, relative ones resolved in ``package`` (left out
    without one): ``from .blocks import Attention`` in package ``pkg`` gives ``("pkg.blocks", ("Attention",))``,
    ``import torch.nn`` gives ``("torch.nn", ())``. Empty for code that does not parse."""
    tree = _parse(code)
    found: list[tuple[str, tuple[str, ...]]] = []
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Import):
            found.extend((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module if not node.level else None
            if node.level and package:
                module = absolute_module(package, node.level, node.module)
            if module:
                found.append((module, tuple(alias.name for alias in node.names)))
    return found


def model_classes(code: str) -> dict[str, str]:
    """The classes of ``code`` that derive from a class named ``PreTrainedModel`` or ``...PreTrainedModel``
    (transformers' base, a model's own base class), directly or through classes of ``code``: the models whose
    ``_init_weights`` ``from_pretrained`` uses. Each maps to the name of that base as written (a class of
    ``code`` or an imported name). Empty for code that does not parse."""
    tree = _parse(code)
    found: dict[str, str] = {}
    for node in tree.body if tree is not None else ():
        if not isinstance(node, ast.ClassDef):
            continue
        names = [
            b.id if isinstance(b, ast.Name) else b.attr
            for b in node.bases
            if isinstance(b, (ast.Name, ast.Attribute))
        ]
        base = next((n for n in names if n.endswith("PreTrainedModel") or n in found), None)
        if base is not None:
            found[node.name] = base
    return found


def installed_packages(path: str | os.PathLike[str], code: str) -> list[tuple[str, Path]]:
    """``(package, file)`` for each installed package (on ``sys.path``) that holds a file named like ``path``
    beside every module the relative imports of ``code`` name: the packages a copied file (such as
    transformers' ``modeling_llama.py``) may come from. Nothing is imported; an empty list for a file
    without relative imports.

    The package is looked for as deep as the deepest relative import reaches, and one level deeper.
    """
    imports = relative_imports(code)
    if not imports:
        return []
    source = Path(path).resolve()
    reach = max(level for _, level, _ in imports)
    top_module = next((module for _, level, module in imports if level == reach and module), None)
    pattern = "/".join(["*"] * (reach - 1) + [f"{source.stem}.py"])  # from the furthest ancestor reached
    found: list[tuple[str, Path]] = []
    for info in pkgutil.iter_modules():
        where = getattr(info.module_finder, "path", None)
        if not info.ispkg or not where:
            continue
        top = Path(where) / info.name
        for extra in range(2):
            for ancestor in top.glob("/".join(["*"] * extra)) if extra else [top]:
                if top_module is not None and not _module_exists(ancestor, top_module):
                    continue
                for file in ancestor.glob(pattern):
                    folder = file.parent
                    parts = folder.relative_to(top).parts
                    chain = [top.joinpath(*parts[:i]) for i in range(len(parts) + 1)]
                    if (
                        file.resolve() != source
                        and all(p.name.isidentifier() and (p / "__init__.py").is_file() for p in chain)
                        and all(
                            module is None
                            or _module_exists(folder.parents[level - 2] if level > 1 else folder, module)
                            for _, level, module in imports
                        )
                    ):
                        found.append((".".join((info.name, *parts)), file))
    return found


def _module_exists(folder: Path, module: str) -> bool:
    """Whether ``module`` (dotted, relative to ``folder``) is a file or package there."""
    target = folder.joinpath(*module.split("."))
    return target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()


def _module_name(filename: str | None, package: str | None) -> str | None:
    """The module's dotted name: ``package.stem`` inside a package, ``stem`` for a top-level file."""
    stem = Path(filename).stem if filename else None
    if package:
        stem = stem or "__rewritten__"
        return package if stem == "__init__" else f"{package}.{stem}"
    return stem if stem and stem.isidentifier() else None


def rewrite_source(
    code: str,
    config: LoraConfig,
    *,
    filename: str | None = None,
    package: str | None = None,
    absolute_imports: bool = True,
    init_hook: bool = False,
) -> RewriteResult:
    """Rewrite the constructor calls of ``config``'s target layers in ``code`` into loragen layers.

    Only these change: each targeted call's callee and added LoRA keywords (``nn.Linear(a, b)`` ->
    ``LoraLinear(a, b, r=8, lora_alpha=16)``), the imports they need, the config as a literal
    (``LORA_CONFIG = LoraConfig(...)``, recorded as ``loragen_config`` in each class holding LoRA layers), a
    ``PreTrainedModel``'s ``_init_weights`` (which ``from_pretrained`` uses to initialise the LoRA factors)
    and, with ``package``, relative imports. A rewrite changes every instance of a class alike, so a config
    that picks only some instances of a field (``layers_to_transform``, per-layer ``rank_pattern``) is an
    error. Rewriting is idempotent.

    Args:
        code: Python source of a module.
        config: which fields to target and their ``r`` / ``lora_alpha`` / ``lora_dropout`` / ...
        filename: used in messages, and for the module's name (``model.py``: ``model``, so a layer type
            defined in the file and registered from ``model`` is recognised).
        package: the package the file belongs to (``"transformers.models.llama"``), to resolve relative
            imports (``from ...pytorch_utils import Conv1D``).
        absolute_imports: with ``package``, write relative imports as absolute ones (a standalone output);
            ``False`` for a file rewritten in place.
        init_hook: give the file's ``PreTrainedModel`` classes the ``_init_weights`` hook (and the config)
            even when the file has no targeted layer: another file rewritten with it holds LoRA layers that
            these models may build (``loragen rewrite`` on several files).

    Returns:
        a :class:`RewriteResult`; never raises for bad input: errors are in ``result.errors``.
    """
    name = filename or "<string>"

    def failed(line: int, message: str) -> RewriteResult:
        return RewriteResult(str(code), False, name, errors=(Diagnostic(name, line, message),))

    if not isinstance(code, str):
        return failed(1, "the source must be a str")
    if not isinstance(config, LoraConfig):
        return failed(1, f"config must be a loragen.LoraConfig, got {type(config).__name__}")
    if config.target_modules is None:
        return failed(
            1,
            "LoraConfig.target_modules is None: name the modules to adapt (e.g. --target-modules q_proj,v_proj)",
        )
    text = source_text(code)  # the file's byte order mark, line ends and indentation are put back after
    try:
        with _collector_paused():
            scanned = scan_module(
                text.code, filename=name, module=_module_name(filename, package), package=package
            )
            result = _RewritePlanner(
                text.code, config, name, package if absolute_imports else None, scanned, init_hook
            ).run()
        return dataclasses.replace(result, code=text.restore(result.code))
    except ScanError as exc:
        return failed(exc.line, exc.reason)
    except LoraError as exc:  # the config's patterns, refused where they are matched (loragen.plan)
        return failed(1, str(exc))
    except RecursionError:  # the parser's guard keeps far from this; a last line of defence
        return failed(1, "the source is nested too deeply to rewrite")
    except Exception as exc:  # a bug in loragen must not crash the caller with bad input
        return failed(1, f"internal error while rewriting ({type(exc).__name__}: {exc}); please report it")


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: syntax trees hold no cycles, and its passes over them are slow."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _RewritePlanner:
    """Plans and applies the rewrite of one scanned file: which constructor calls change and how, which
    classes record the config and get the transformers init hook, which imports the file needs; errors
    leave it unchanged. ``package`` (or None) makes relative imports absolute in the output; ``init_hook``
    gives the file's ``PreTrainedModel`` classes the init hook even without targeted layers in the file."""

    def __init__(
        self,
        code: str,
        config: LoraConfig,
        filename: str,
        package: str | None,
        scanned: ScannedModule,
        init_hook: bool = False,
    ) -> None:
        self.code = code
        self.config = config
        self.filename = filename
        self.package = package
        self.scanned = scanned
        self.result = scanned.result
        self.targets = Targets(config, scanned.result)
        self.errors: list[Diagnostic] = []
        self.warnings = [Diagnostic(filename, u.location.line, u.reason) for u in scanned.result.unresolved]
        self.lines = [line.rstrip("\r") for line in code.split("\n")]
        # the line length the file keeps to, as far as its longest line tells (between 88 and 120)
        self.width = min(120, max(88, *(len(line) for line in self.lines)))
        self.imports: dict[str, set[str]] = {}
        # keyed by the scanned tree's own nodes (see ScannedModule)
        self.edits: dict[cst.Call, tuple[str | None, dict[str, str], str | None]] = {}
        self.rewritten: list[RewrittenCall] = []
        self.derived: dict[str, str] = {}  # layer subclass of the file -> the name its LoRA class gets
        # LoRA auto class -> the auto class (LoraAutoModel -> AutoModel)
        self.auto_classes: dict[str, str] = {}
        self.factory_edits: dict[cst.Call, str] = {}  # AutoModel.from_config(...) call -> LoraAutoModel
        self.init_hook = init_hook
        self.active = False  # whether the file gets the config (and its models the hook): set by run()
        # the PreTrainedModel classes whose _init_weights initialises LoRA factors
        self.hooked: list[str] = []

    def _error(self, line: int, message: str) -> None:
        self.errors.append(Diagnostic(self.filename, line, message))

    def _warn(self, line: int, message: str) -> None:
        self.warnings.append(Diagnostic(self.filename, line, message))

    def run(self) -> RewriteResult:
        """The rewritten code and what was done; the input unchanged when there are errors."""
        for call, fields in self.scanned.calls.items():
            self._plan_call(call, fields)
        self.rewritten.sort(key=lambda c: (c.field.location.line, c.field.location.column))
        self._warn_non_layer_targets()
        self._refuse_fused_experts()
        if self.config.target_parameters:  # parameters have no constructor call to swap: say so, keep none
            self._warn(
                1,
                f"target_parameters={list(self.config.target_parameters)} is not written into the source (a "
                "parameter has no constructor call to swap) and is left out of LORA_CONFIG; adapt those "
                "parameters with loragen.get_lora_model or @lora_convert on the original classes",
            )
        self._plan_factories()
        # a file edits its classes when it holds LoRA layers, or when its models may hold another file's
        self.active = bool(self.rewritten or self.auto_classes or (self.init_hook and self._model_roots()))
        hooks, config_classes = self._class_edits() if self.active else ({}, set())
        if self.active:
            self.imports.setdefault(_CONFIG_IMPORT[0], set()).add(_CONFIG_IMPORT[1])
            if hooks:
                self.imports.setdefault(_HOOK_IMPORT[0], set()).add(_HOOK_IMPORT[1])
        missing = self._missing_imports()
        if self.errors:
            return self._result(self.code)
        editor = Editor(
            self.edits,
            self.package,
            hooks,
            config_classes,
            self.factory_edits,
            self.scanned.hidden,
            self._functions_to_edit(hooks.keys() | config_classes),
            self.package is not None and _NESTED_RELATIVE_IMPORT.search(self.code) is not None,
        )
        tree = self.scanned.tree.visit(editor)
        for message in editor.import_errors:
            self._error(1, message)
        if self.errors:
            return self._result(self.code)
        if self.active:
            tree = add_preamble(
                tree,
                missing,
                config_literal(self.config.replace(target_parameters=None), column=len(CONFIG_NAME) + 3),
            )
        tree = add_module_lines(tree, self._module_lines())
        return self._result(tree.code)

    def _functions_to_edit(self, classes: set[cst.ClassDef]) -> set[cst.FunctionDef]:
        """Each edited class's ``__init__``, and every function around those and ``classes``."""
        nodes = definitions(self.scanned.tree.body, cst.ClassDef)
        owners = {f.owner for call in self.edits for f in self.scanned.calls[call]}
        owners.update(self.scanned.factories[call].owner for call in self.factory_edits)
        targets: set[cst.CSTNode] = set(classes)
        for owner in owners & nodes.keys():
            targets.update(s for s in nodes[owner].body.body if m.matches(s, _INIT))
        found: set[cst.FunctionDef] = set()

        def walk(body: Sequence[cst.CSTNode]) -> bool:
            hit = False
            for stmt in body:
                if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
                    inside = stmt in targets
                    if isinstance(stmt.body, cst.IndentedBlock):
                        inside = walk(stmt.body.body) or inside
                    if inside and isinstance(stmt, cst.FunctionDef):
                        found.add(stmt)
                    hit = hit or inside
                elif not isinstance(stmt, cst.SimpleStatementLine):
                    hit = walk(nested_statements(stmt)) or hit
            return hit

        walk(self.scanned.tree.body)
        return found

    def _plan_factories(self) -> None:
        """Route each ``AutoModel.from_config`` call through the LoRA auto class, with a warning."""
        for call, factory in sorted(self.scanned.factories.items(), key=lambda item: item[1].location.line):
            self.auto_classes[factory.lora_name] = factory.auto_class
            if not factory.is_lora:
                self.factory_edits[call] = factory.lora_name
            own = ", ".join(self._own_models()) or "none holds LoRA layers"
            self._warn(
                factory.location.line,
                f"{factory.owner}.{factory.path} = {factory.auto_class}.from_config(...) builds transformers' own "
                f"class; rewritten to {factory.lora_name}, which builds this file's LoRA class for its config ({own}) "
                "and converts a class of another file when built (target_modules matched inside it)",
            )

    def _own_models(self) -> list[str]:
        """The file's PreTrainedModel classes holding rewritten layers (what its auto classes build)."""
        roots = {
            root
            for call in self.rewritten
            for root, _ in self.targets.contexts.get(call.field.owner, [])
            if self.targets.is_pretrained(root)
        }
        return [c.name for c in self.result.classes if c.name in roots and "." not in c.name]

    def _module_lines(self) -> list[ModuleLine]:
        """The module-level LoRA auto classes and LoRA classes of the file's layer subclasses."""
        own = ", ".join(self._own_models())
        autos = []
        for name, auto in sorted(self.auto_classes.items()):
            value = f"lora_auto_class({auto}, [{own}], {CONFIG_NAME})"
            if len(name) + 3 + len(value) > self.width:
                value = f"lora_auto_class(\n    {auto},\n    [{own}],\n    {CONFIG_NAME},\n)"
            comment = f"# Added by loragen rewrite: {auto} that builds this file's LoRA classes (loragen.source.composite)."
            autos.append(ModuleLine(name, value, comment))
        return autos + [
            ModuleLine(
                name,
                f"lora_class_for({subclass})",
                f"# Added by loragen rewrite: {subclass} with a LoRA adapter (its own forward computes the base output).",
                after=subclass,
            )
            for subclass, name in sorted(self.derived.items())
            if name not in self.scanned.lora_bindings
        ]

    def _plan_call(self, call: cst.Call, fields: list[LayerField]) -> None:
        """Decide one constructor call (built for one or several fields)."""
        decisions = [(f, self.targets.decide(f)) for f in fields]
        for f, d in decisions:
            if d.error:
                self._error(f.location.line, d.error)
            if d.warning:
                self._warn(f.location.line, d.warning)
        if any(d.error for _, d in decisions):
            return
        chosen = [(f, d) for f, d in decisions if d.targeted]
        if not chosen:
            if any(f.is_lora for f in fields):
                f = fields[0]
                self._warn(
                    f.location.line,
                    f"{f.owner}.{f.pattern} is already a LoRA layer but is not targeted by this config; "
                    "left as it is",
                )
            return
        field, decision = chosen[0]
        if len(chosen) != len(decisions) or len({(d.r, d.alpha) for _, d in chosen}) > 1:
            paths = ", ".join(f"{f.owner}.{f.pattern}" for f, _ in decisions)
            self._error(
                field.location.line,
                f"one layer object is stored under several fields ({paths}) that the config treats "
                "differently; cannot rewrite it",
            )
            return
        spec = self.targets.types.for_qualname(field.layer)
        if spec is None or not spec.importable():
            self._error(
                field.location.line,
                f"{field.owner}.{field.pattern}: the LoRA class for {field.layer} cannot be imported by name"
                + (f" ({spec.lora_qualname})" if spec else "")
                + ", so a rewritten file could not use it; register a LoRA class defined at a module's top level",
            )
            return
        existing = {a.keyword.value for a in call.args if a.keyword is not None}
        keywords = lora_keywords(spec, decision.r, decision.alpha, self.config, existing)
        lora_name = None if field.is_lora else field.lora_name
        wrap = self._wrap(call, lora_name, {k: v for k, v in keywords.items() if k not in existing})
        changed = not edit_call(call, lora_name, keywords, wrap).deep_equals(call)
        if changed:
            self.edits[call] = (lora_name, keywords, wrap)
        if field.subclass is not None:  # LoraFalconLinear = lora_class_for(FalconLinear), after the class
            self.derived[field.subclass] = field.lora_name
            if field.lora_name not in self.scanned.lora_bindings:
                self.imports.setdefault(LORA_CLASS_FOR[0], set()).add(LORA_CLASS_FOR[1])
        elif lora_name is not None:
            self.imports.setdefault(spec.lora_module, set()).add(lora_name)
        self.rewritten.append(RewrittenCall(field, field.lora_name, decision.r, decision.alpha, changed))

    def _wrap(self, call: cst.Call, lora_name: str | None, added: dict[str, str]) -> str | None:
        """``call``'s indentation when the added keywords would make it wider than the file, else None."""
        start = self.scanned.positions.get(call)
        end = self.scanned.positions.get(call.args[-1].value) if call.args else None
        if not added or start is None or end is None:
            return None
        grow = sum(len(f", {k}={v}") for k, v in added.items())
        if lora_name is not None and start.start.line == end.end.line:
            grow += len(lora_name) - len(code_of(call.func))
        first = self.lines[start.start.line - 1]
        rest = first[start.end.column :].strip() if start.start.line == start.end.line else ""
        if rest and not rest.startswith("#"):
            return None  # a one-line call inside a longer expression: relaying it out would read worse
        last = self.lines[end.end.line - 1]
        code = first[: start.end.column] if rest.startswith("#") else last  # a trailing comment may stick out
        if len(code) + grow <= self.width:
            return None
        return first[: len(first) - len(first.lstrip())]

    def _class_edits(self) -> tuple[dict[cst.ClassDef, str], set[cst.ClassDef]]:
        """The classes that get the init hook, and those that get ``loragen_config`` (unless inherited)."""
        nodes = definitions(self.scanned.tree.body, cst.ClassDef)
        hooks: dict[cst.ClassDef, str] = {}
        holders = {c.field.owner for c in self.rewritten} | {f.owner for f in self.scanned.factories.values()}
        for name in self._model_roots():
            node = nodes.get(name)
            if node is not None:
                holders.add(name)
                self.hooked.append(name)
                if not has_lora_hook(node):
                    hooks[node] = py_literal(self.config.init_lora_weights)
        config_classes: set[cst.ClassDef] = set()
        for name in sorted(holders):
            node = nodes.get(name)
            if node is None or self.targets.ancestors(name) & holders:
                continue
            current = config_attribute(node)
            if current is None:
                config_classes.add(node)
            elif current != CONFIG_NAME:
                holder = self.result.get(name)
                self._error(
                    holder.location.line if holder else 1,
                    f"class {name} sets loragen_config = {current} itself; a rewrite records its config there "
                    f"(loragen_config = {CONFIG_NAME}): remove that line first",
                )
        return hooks, config_classes

    def _model_roots(self) -> list[str]:
        """The topmost ``PreTrainedModel`` subclasses of the file: they get the init hook, and their
        subclasses inherit it."""
        return [
            scan.name
            for scan in self.result.classes
            if any(b in PRETRAINED for b in scan.base_names)
            and not any(self.targets.is_pretrained(base) for base in scan.local_bases)
        ]

    def _missing_imports(self) -> dict[str, list[str]]:
        """The needed names the file does not import yet; a needed name bound to something else is an error."""
        bindings = top_level_bindings(self.scanned.tree)
        missing: dict[str, list[str]] = {}
        wanted = [(module, name) for module, names in self.imports.items() for name in names]
        if self.active:  # the file gets LORA_CONFIG
            wanted.append(("<loragen rewrite>", CONFIG_NAME))
        if any(name not in self.scanned.auto_bindings for name in self.auto_classes):
            wanted.append(LORA_AUTO_CLASS)
        autos, subclasses = self.scanned.auto_bindings, self.scanned.lora_bindings
        clashes = [
            (name, f"the LoRA auto class of {auto} ({name} = lora_auto_class(...))", autos)
            for name, auto in sorted(self.auto_classes.items())
        ] + [
            (name, f"the LoRA class of {sub} ({name} = lora_class_for({sub}))", subclasses)
            for sub, name in sorted(self.derived.items())
        ]
        for name, what, ours in clashes:
            if name in bindings and name not in ours:
                self._error(
                    1,
                    f"the name {name} is already bound in this module; the rewrite binds it to {what}: "
                    "rename it first",
                )
        for module, name in sorted(wanted):
            bound = bindings.get(name)
            if bound is None:
                if module != "<loragen rewrite>":
                    missing.setdefault(module, []).append(name)
            elif not bound.imports(module, name):
                self._error(
                    1,
                    f"the name {name} is already bound in this module to something other than "
                    f"{module}.{name}; rename it first",
                )
        return missing

    def _refuse_fused_experts(self) -> None:
        """Refuse ``all-linear`` on fused MoE expert parameters, which a rewrite cannot adapt (peft does)."""
        declared: dict[str, int] = {}
        owner = ""
        for number, line in enumerate(self.lines, 1):
            if (match := _CLASS.match(line)) is not None:
                owner = match.group(1)
            elif (match := _PARAMETER.match(line)) is not None and owner:
                declared.setdefault(f"{owner}.{match.group(1)}", number)
        fused = fused_expert_parameters(self.config, declared)
        if fused:
            self._error(
                declared[fused[0]],
                f"target_modules='all-linear' on a transformers 5 MoE model also adapts the fused expert "
                f"parameters {', '.join(fused)} (as peft and loragen.get_lora_model do), and a source rewrite "
                "cannot express LoRA on a parameter (it has no constructor call to swap). List the linear "
                "modules to adapt instead of 'all-linear' (the experts then stay plain), or use "
                "loragen.get_lora_model or @lora_convert",
            )

    def _warn_non_layer_targets(self) -> None:
        """Targets naming a container or a submodule: the runtime path refuses those, say so here."""
        for scan in self.result.classes:
            candidates: dict[str, tuple[str, int]] = {}
            for sub in scan.submodules:
                if sub.path != sub.attribute:
                    candidates.setdefault(sub.attribute, ("a module container", sub.location.line))
                candidates.setdefault(
                    sub.path, (f"a module of class {sub.callee.rpartition('.')[2]}", sub.location.line)
                )
            for f in scan.fields:
                if f.container:
                    candidates.setdefault(f.attribute, (f"a {f.container}", f.location.line))
            for path, (kind, line) in candidates.items():
                hit = self.targets.selected_non_layers(p for _, p in self.targets.paths(scan.name, path))
                if hit is not None:
                    self._warn(
                        line,
                        f"target_modules matches {hit}: {scan.name}.{path} is {kind}, not a layer; it is left "
                        "as it is (loragen.get_lora_model would refuse it): name the layers inside it instead",
                    )

    def _result(self, code: str) -> RewriteResult:
        errors = tuple(sorted(set(self.errors), key=lambda d: d.line))
        return RewriteResult(
            code=self.code if errors else code,
            changed=not errors and code != self.code,
            filename=self.filename,
            rewritten=tuple(self.rewritten),
            fields=tuple(self.result.fields),
            # a composite's sub-models of other files may hold what the file itself does not
            unmatched_targets=() if self.auto_classes else self.targets.unmatched(),
            warnings=tuple(sorted(set(self.warnings), key=lambda d: d.line)),
            errors=errors,
            init_hooks=() if errors else tuple(self.hooked),
            sub_models=tuple(
                f"{f.owner}.{f.path}"
                for f in sorted(self.scanned.factories.values(), key=lambda f: f.location.line)
            ),
        )
