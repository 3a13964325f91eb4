"""Rewrite a model's source so that its targeted layers are built as loragen LoRA layers.

:func:`rewrite_source` is the pure function behind ``loragen rewrite``: source in, :class:`RewriteResult`
out, never an exception for bad input (invalid Python, a config it cannot express, a name clash are
returned as errors with ``file:line``).

What changes, and nothing else:

* the constructor call of each targeted layer field: only the callee and added LoRA keywords,
  ``nn.Linear(a, b, bias=False)`` -> ``LoraLinear(a, b, bias=False, r=8, lora_alpha=16)``;
* one import, ``from loragen import LoraLinear``;
* with ``package`` given (a file inside an installed package, such as transformers'
  ``modeling_llama.py``): relative imports become absolute, so the output works from anywhere;
* in a transformers ``PreTrainedModel`` subclass: ``_init_weights`` also initialises LoRA factors (A
  random, B zero, as peft does). ``from_pretrained`` on a base checkpoint leaves them uninitialised
  otherwise: the model is built on the meta device and only ``_init_weights`` fills missing parameters.

Targets are decided with the config's own rules (:meth:`LoraConfig.matches_target`, ``rank_for``,
``alpha_for``) on module paths. A class's fields are matched under every path the class takes inside the
file's other classes (``LlamaAttention.q_proj`` as ``model.layers.{i}.self_attn.q_proj`` in
``LlamaForCausalLM``). A rewrite changes every instance of a class alike, so a config that picks only
some instances of one field inside one model (``layers_to_transform``, a regex naming layer indices, an
``exclude_modules`` entry for one layer, ``rank_pattern`` per layer) is reported as an error: use
:func:`loragen.get_lora_model` or :func:`loragen.lora_convert` for those.

Rewriting is idempotent: the output, rewritten again with the same config, is unchanged.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

import libcst as cst

from loragen.config import ALL_LINEAR, LoraConfig
from loragen.source.codegen import py_literal
from loragen.source.edits import (
    Editor,
    edit_call,
    has_lora_hook,
    insert_import,
    lora_keywords,
    top_level_bindings,
)
from loragen.source.scan import LayerField, ScanError, ScannedModule, scan_module
from loragen.source.targets import PRETRAINED, Targets, instances

__all__ = ["Diagnostic", "RewriteResult", "RewrittenCall", "module_name_for_path", "rewrite_source"]


@dataclasses.dataclass(frozen=True)
class Diagnostic:
    """A warning or an error about one place in a file: ``str()`` gives ``file:line: message``."""

    filename: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.line}: {self.message}"


@dataclasses.dataclass(frozen=True)
class RewrittenCall:
    """One targeted constructor call: its field, the LoRA class and the keywords it gets."""

    field: LayerField
    lora_name: str
    r: int
    lora_alpha: float
    changed: bool


@dataclasses.dataclass(frozen=True)
class RewriteResult:
    """What :func:`rewrite_source` did.

    Attributes:
        code: the rewritten source; the input unchanged when there are errors or nothing to do.
        changed: whether ``code`` differs from the input.
        filename: the name used in messages.
        rewritten: the targeted calls (``changed=False`` for those already up to date).
        fields: every layer field the scanner found, targeted or not.
        warnings: things left alone that a reader should know about (unresolvable layers, ...).
        errors: reasons the file could not be rewritten; when not empty, ``code`` is the input.
    """

    code: str
    changed: bool
    filename: str
    rewritten: tuple[RewrittenCall, ...] = ()
    fields: tuple[LayerField, ...] = ()
    warnings: tuple[Diagnostic, ...] = ()
    errors: tuple[Diagnostic, ...] = ()

    @property
    def ok(self) -> bool:
        """True when there are no errors."""
        return not self.errors

    def summary(self) -> str:
        """One line for the CLI: ``model.py: 4 layers -> LoRA (q_proj, v_proj, ...), 1 warning``."""
        if self.errors:
            return f"{self.filename}: not rewritten, {_plural(len(self.errors), 'error')}"
        names = list(dict.fromkeys(c.field.pattern for c in self.rewritten))
        shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        if not self.rewritten:
            text = f"{self.filename}: no targeted layers"
        else:
            text = f"{self.filename}: {_plural(len(self.rewritten), 'layer')} -> LoRA ({shown})"
            if not self.changed:
                text += ", already up to date"
        if self.warnings:
            text += f", {_plural(len(self.warnings), 'warning')}"
        return text


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


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


def rewrite_source(
    code: str,
    config: LoraConfig,
    *,
    filename: str | None = None,
    package: str | None = None,
    absolute_imports: bool = True,
) -> RewriteResult:
    """Rewrite the constructor calls of ``config``'s target layers in ``code`` into loragen layers.

    Args:
        code: Python source of a module.
        config: which fields to target and their ``r`` / ``lora_alpha`` / ``lora_dropout`` / ...
        filename: used in messages (and, with ``package``, for the module's name).
        package: the package the file belongs to (``"transformers.models.llama"``); resolves relative
            imports for matching (``from ...pytorch_utils import Conv1D``) and, with
            ``absolute_imports``, rewrites them as absolute imports so the output is standalone.
        absolute_imports: make relative imports absolute (needs ``package``); ``False`` for a file
            rewritten in place, where its relative imports still work.

    Returns:
        a :class:`RewriteResult`; never raises for bad input: errors are in ``result.errors``.
    """
    name = filename or "<string>"
    if not isinstance(code, str):
        return RewriteResult(
            str(code), False, name, errors=(Diagnostic(name, 1, "the source must be a str"),)
        )
    if not isinstance(config, LoraConfig):
        message = f"config must be a loragen.LoraConfig, got {type(config).__name__}"
        return RewriteResult(code, False, name, errors=(Diagnostic(name, 1, message),))
    if config.target_modules is None:
        message = "LoraConfig.target_modules is None: name the modules to adapt (e.g. --target-modules q_proj,v_proj)"
        return RewriteResult(code, False, name, errors=(Diagnostic(name, 1, message),))
    module = None
    if package:
        stem = Path(filename).stem if filename else "__rewritten__"
        module = package if stem == "__init__" else f"{package}.{stem}"
    try:
        scanned = scan_module(code, filename=name, module=module, package=package)
    except ScanError as exc:
        return RewriteResult(code, False, name, errors=(Diagnostic(name, exc.line, exc.reason),))
    except RecursionError:
        return RewriteResult(
            code, False, name, errors=(Diagnostic(name, 1, "the source is nested too deeply"),)
        )
    try:
        return _Rewrite(code, config, name, package if absolute_imports else None, scanned).run()
    except RecursionError:
        return RewriteResult(
            code, False, name, errors=(Diagnostic(name, 1, "the source is nested too deeply"),)
        )
    except Exception as exc:  # noqa: BLE001 - a bug in loragen must not crash the caller with bad input
        message = f"internal error while rewriting ({type(exc).__name__}: {exc}); please report it"
        return RewriteResult(code, False, name, errors=(Diagnostic(name, 1, message),))


class _Rewrite:
    def __init__(
        self, code: str, config: LoraConfig, filename: str, package: str | None, scanned: ScannedModule
    ):
        self.code = code
        self.config = config
        self.filename = filename
        self.package = package
        self.scanned = scanned
        self.result = scanned.result
        self.errors: list[Diagnostic] = []
        self.warnings: list[Diagnostic] = [
            Diagnostic(filename, u.location.line, u.reason) for u in scanned.result.unresolved
        ]

    def diag(self, field: LayerField, message: str) -> Diagnostic:
        return Diagnostic(self.filename, field.location.line, message)

    def run(self) -> RewriteResult:
        targets = Targets(self.config, self.result)
        edits: dict[int, tuple[str | None, dict[str, str]]] = {}
        rewritten: list[RewrittenCall] = []
        needed: set[str] = set()
        for call_id, fields in self.scanned.calls.items():
            call = self.scanned.call_nodes[call_id]
            decisions = [(f, targets.decide(f)) for f in fields]
            for f, d in decisions:
                if d.error:
                    self.errors.append(self.diag(f, d.error))
                if d.warning:
                    self.warnings.append(self.diag(f, d.warning))
            if any(d.error for _, d in decisions):
                continue
            chosen = [(f, d) for f, d in decisions if d.targeted]
            if not chosen:
                if any(f.is_lora for f in fields):
                    f = fields[0]
                    self.warnings.append(
                        self.diag(
                            f,
                            f"{f.owner}.{f.pattern} is already a LoRA layer but is not "
                            "targeted by this config; left as it is",
                        )
                    )
                continue
            field, decision = chosen[0]
            if len(chosen) != len(decisions) or len({(d.r, d.alpha) for _, d in chosen}) > 1:
                paths = ", ".join(f"{f.owner}.{f.pattern}" for f, _ in decisions)
                self.errors.append(
                    self.diag(
                        field,
                        f"one layer object is stored under several fields ({paths}) "
                        "that the config treats differently; cannot rewrite it",
                    )
                )
                continue
            existing = {a.keyword.value for a in call.args if a.keyword is not None}
            keywords = lora_keywords(decision.r, decision.alpha, self.config, existing)
            lora_name = None if field.is_lora else field.lora_name
            new_call = edit_call(call, lora_name, keywords)
            changed = not new_call.deep_equals(call)
            if changed:
                edits[call_id] = (lora_name, keywords)
            if lora_name is not None:
                needed.add(lora_name)
            rewritten.append(RewrittenCall(field, field.lora_name, decision.r, decision.alpha, changed))
        rewritten.sort(key=lambda c: (c.field.location.line, c.field.location.column))
        fields = tuple(self.result.fields)
        if not fields:
            self.warnings.append(Diagnostic(self.filename, 1, "no layer fields found in any class"))
        elif not rewritten and not self.errors:
            self.warnings.append(
                Diagnostic(
                    self.filename, 1, f"no layer field matches target_modules={self.config.target_modules!r}"
                )
            )
        self._warn_non_layer_targets(targets)
        hooks = self._init_weight_hooks() if rewritten else {}
        if hooks:
            needed.add("LoraLayer")
        bindings = top_level_bindings(self.scanned.tree)
        for name in sorted(needed):
            if bindings.get(name, "loragen") != "loragen":
                self.errors.append(
                    Diagnostic(
                        self.filename,
                        1,
                        f"the name {name} is already bound in this module to "
                        "something other than loragen's; rename it first",
                    )
                )
        if self.errors:
            return self._result(self.code, rewritten, fields)
        editor = Editor(edits, self.package, hooks)
        tree = self.scanned.tree.visit(editor)
        for node, message in editor.import_errors:
            del node
            self.errors.append(Diagnostic(self.filename, 1, message))
        if self.errors:
            return self._result(self.code, rewritten, fields)
        missing = sorted(n for n in needed if n not in bindings)
        if missing:
            tree = insert_import(tree, missing)
        return self._result(tree.code, rewritten, fields)

    def _warn_non_layer_targets(self, targets: Targets) -> None:
        """Targets naming a container or a submodule: the runtime path refuses those, say so here."""
        if self.config.target_modules == ALL_LINEAR:
            return
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
                hit = next(
                    (
                        full
                        for _, prefix in targets.contexts.get(scan.name, [(scan.name, "")])
                        for full in instances(prefix + path, targets.extra_keys)
                        if self.config.matches_target(full)
                    ),
                    None,
                )
                if hit is not None:
                    self.warnings.append(
                        Diagnostic(
                            self.filename,
                            line,
                            (
                                f"target_modules matches {hit}: {scan.name}.{path} is {kind}, not a layer; it is left as "
                                "it is (loragen.get_lora_model would refuse it): name the layers inside it instead"
                            ),
                        )
                    )

    def _init_weight_hooks(self) -> dict[int, str]:
        """The transformers ``PreTrainedModel`` base classes of this file that need the LoRA init hook."""
        targets = Targets(self.config, self.result)
        hooks: dict[int, str] = {}
        class_defs = _class_defs(self.scanned.tree)
        for scan in self.result.classes:
            # the topmost PreTrainedModel subclass of the file gets it; its subclasses inherit it
            if not any(b in PRETRAINED for b in scan.base_names) or any(
                targets.is_pretrained(base) for base in scan.local_bases
            ):
                continue
            node = class_defs.get(scan.name)
            if node is not None and not has_lora_hook(node):
                hooks[id(node)] = py_literal(self.config.init_lora_weights)
        return hooks

    def _result(
        self, code: str, rewritten: list[RewrittenCall], fields: tuple[LayerField, ...]
    ) -> RewriteResult:
        errors = tuple(sorted(set(self.errors), key=lambda d: d.line))
        return RewriteResult(
            code=self.code if errors else code,
            changed=not errors and code != self.code,
            filename=self.filename,
            rewritten=tuple(rewritten),
            fields=fields,
            warnings=tuple(sorted(set(self.warnings), key=lambda d: d.line)),
            errors=errors,
        )


def _class_defs(module: cst.Module) -> dict[str, cst.ClassDef]:
    out: dict[str, cst.ClassDef] = {}

    def walk(body: Sequence[cst.CSTNode], prefix: str) -> None:
        for stmt in body:
            if isinstance(stmt, cst.ClassDef):
                out[prefix + stmt.name.value] = stmt
                walk(stmt.body.body, prefix + stmt.name.value + ".")

    walk(module.body, "")
    return out
