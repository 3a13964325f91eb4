"""What the scanner reports: layer fields, submodules, unresolved constructions, per class and per file.

These plain data classes are shared by the scanner (:mod:`loragen.source.scan`), which fills them, and
the code generators (:mod:`loragen.source.decorator`, :mod:`loragen.source.rewriter`), which read them; :class:`RewriteResult` is what :func:`loragen.rewrite_source` returns: the new code, what
it found, warnings and errors.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import libcst as cst
from libcst.metadata import CodeRange

__all__ = [
    "ClassScan",
    "Diagnostic",
    "FactoryCall",
    "LayerField",
    "RewriteResult",
    "RewrittenCall",
    "ScanResult",
    "ScannedModule",
    "SourceLocation",
    "SubmoduleField",
    "Unresolved",
]


@dataclasses.dataclass(frozen=True)
class SourceLocation:
    """Where a node starts: ``file:line:column`` (line 1-based, column 0-based)."""

    filename: str
    line: int
    column: int = 0

    def __str__(self) -> str:
        return f"{self.filename}:{self.line}"


@dataclasses.dataclass(frozen=True)
class LayerField:
    """A layer built in ``__init__`` and stored under a module path of its class.

    Attributes:
        owner: qualified name of the class in its module (``"LlamaAttention"``, ``"Outer.Inner"``).
        attribute: the attribute of ``self`` that holds it or its container (``"layers"``).
        path: module path relative to an instance of ``owner``; ``{i}`` stands for a list index and
            ``{key}`` for a dictionary key only known at run time (``"layers.{i}.0"``).
        layer: qualified name of the base layer type (``"torch.nn.Linear"``).
        lora_name: the loragen class that replaces it (``"LoraLinear"``).
        location: position of the constructor call.
        conditional: built under ``if``/``else``, a conditional expression, ``try`` or a loop body.
        container: ``"ModuleList"``, ``"Sequential"`` or ``"ModuleDict"`` when built inside one.
        is_lora: the call already builds the loragen layer (a rewritten file).
        subclass: for a layer subclass defined in the scanned file (``FalconLinear``), its name; ``layer`` is
            then the registered type it derives from and ``lora_name`` the name the file binds its LoRA
            class to (``LoraFalconLinear = lora_class_for(FalconLinear)``).
    """

    owner: str
    attribute: str
    path: str
    layer: str
    lora_name: str
    location: SourceLocation
    conditional: bool = False
    container: str | None = None
    is_lora: bool = False
    subclass: str | None = None

    @property
    def pattern(self) -> str:
        """The path with run-time indices and keys as ``*`` (``"layers.*"``)."""
        return re.sub(r"\{(i|key)\}", "*", self.path)


@dataclasses.dataclass(frozen=True)
class SubmoduleField:
    """A child module built from a class constructor that is not a layer (``self.mlp = LlamaMLP(config)``).

    ``callee`` is the qualified name of the constructor; ``local_class`` the qualified name of the class
    in the scanned module when it is defined there (used to follow containment inside one file).
    """

    owner: str
    attribute: str
    path: str
    callee: str
    location: SourceLocation
    local_class: str | None = None
    conditional: bool = False


@dataclasses.dataclass(frozen=True)
class FactoryCall:
    """A sub-model built by a transformers auto class: ``self.language_model = AutoModel.from_config(...)``.

    ``auto_class`` is the auto class as the file spells it (``"AutoModel"``), ``lora_name`` the LoRA auto class
    a rewrite builds it with (``"LoraAutoModel"``), ``is_lora`` whether the call does so already.
    """

    owner: str
    attribute: str
    path: str
    auto_class: str
    lora_name: str
    location: SourceLocation
    is_lora: bool = False


@dataclasses.dataclass(frozen=True)
class Unresolved:
    """Something the scanner saw but cannot resolve statically, with the reason."""

    owner: str | None
    attribute: str | None
    location: SourceLocation
    reason: str

    def __str__(self) -> str:
        return f"{self.location}: {self.reason}"


@dataclasses.dataclass(frozen=True)
class ClassScan:
    """What the scanner found in one class.

    Attributes:
        name: the class's qualified name in its module; ``location``: where it is defined.
        local_bases: the classes of the same file it derives from; ``base_names``: the qualified names of
            all its bases.
        fields / submodules / unresolved: what its ``__init__`` builds, and what could not be followed.
        output_head: what ``get_output_embeddings`` returns when the class defines it: ``("lm_head",)``
            for ``return self.lm_head``, ``()`` for ``return None`` or anything not a ``self.<path>``; None
            when the class does not define it.
    """

    name: str
    location: SourceLocation
    local_bases: tuple[str, ...]
    base_names: tuple[str, ...]
    fields: tuple[LayerField, ...]
    submodules: tuple[SubmoduleField, ...]
    unresolved: tuple[Unresolved, ...]
    output_head: tuple[str, ...] | None = None
    factories: tuple[FactoryCall, ...] = ()


@dataclasses.dataclass(frozen=True)
class ScanResult:
    """What the scanner found in a module: its classes, and what it could not resolve anywhere."""

    filename: str
    module: str | None
    classes: tuple[ClassScan, ...]
    unresolved: tuple[Unresolved, ...]

    def get(self, name: str) -> ClassScan | None:
        """The class with qualified name ``name``, or None."""
        return next((c for c in self.classes if c.name == name), None)

    @property
    def fields(self) -> list[LayerField]:
        """All layer fields of all classes, in source order."""
        return [f for c in self.classes for f in c.fields]

    def contexts(self, name: str, *, limit: int = 64) -> list[tuple[str, str]]:
        """Where instances of class ``name`` appear, following containment in this file.

        Returns ``(root class, path prefix)`` pairs: the fields of ``name`` sit at ``prefix + field.path``
        inside an instance of the root class. ``(name, "")`` (the class on its own) comes first. For
        ``LlamaAttention`` in ``modeling_llama.py``: ``("LlamaAttention", "")``,
        ``("LlamaDecoderLayer", "self_attn.")``, ``("LlamaModel", "layers.{i}.self_attn.")``,
        ``("LlamaForCausalLM", "model.layers.{i}.self_attn.")``, ... Subclasses defined in the file run
        their base's ``__init__``, so they share its placements.
        """
        subclasses: dict[str, set[str]] = {c.name: set() for c in self.classes}
        for c in self.classes:
            for base in c.local_bases:
                subclasses.setdefault(base, set()).add(c.name)

        def family(cls: str) -> set[str]:  # cls and its local subclasses: they all run cls.__init__
            seen, todo = set(), [cls]
            while todo:
                item = todo.pop()
                if item not in seen:
                    seen.add(item)
                    todo.extend(subclasses.get(item, ()))
            return seen

        result: list[tuple[str, str]] = []

        def walk(cls: str, suffix: str, stack: tuple[str, ...]) -> None:
            members = family(cls)
            for member in [cls, *sorted(members - {cls})]:  # a subclass instance holds the same fields
                if (member, suffix) not in result:
                    result.append((member, suffix))
            if len(result) >= limit or cls in stack:
                return
            for owner in self.classes:
                for sub in owner.submodules:
                    if sub.local_class in members:
                        # the owner's subclasses run the owner's __init__ and hold the child too
                        for holder in [owner.name, *sorted(family(owner.name) - {owner.name})]:
                            walk(holder, f"{sub.path}.{suffix}", (*stack, cls))

        walk(name, "", ())
        return result


@dataclasses.dataclass
class ScannedModule:
    """A parsed module and its scan, kept together for the rewriter.

    ``tree`` is the full syntax tree; ``calls`` maps every followed layer constructor call in it to the
    fields that call builds; ``positions`` gives the source range of the nodes inside those calls (they all
    lie in ``__init__`` bodies). ``lora_bindings`` holds the module-level ``Name = lora_class_for(Subclass)``
    lines (name -> subclass), ``factories`` the auto-class calls (and what each builds), ``auto_bindings`` the
    module-level ``Name = lora_auto_class(AutoX, ...)`` lines (name -> ``AutoX``). ``hidden`` maps each
    function whose body the scanner did not read (:func:`loragen.source.parse.skeleton`) to that body's
    source: no followed call lies inside one, so the rewriter's pass skips those without a relative import.

    Every map is keyed by the nodes of ``tree`` itself: libcst nodes hash and compare by identity, so a
    key is one place in the tree (two equal calls on two lines are two keys), and a copy of the tree would
    match none of them.
    """

    tree: cst.Module
    result: ScanResult
    calls: dict[cst.Call, list[LayerField]]
    positions: Mapping[cst.CSTNode, CodeRange]
    lora_bindings: dict[str, str] = dataclasses.field(default_factory=dict)
    factories: dict[cst.Call, FactoryCall] = dataclasses.field(default_factory=dict)
    auto_bindings: dict[str, str] = dataclasses.field(default_factory=dict)
    hidden: dict[cst.FunctionDef, str] = dataclasses.field(default_factory=dict)


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
    """One targeted constructor call: its field, the LoRA class and the rank and alpha it gets."""

    field: LayerField
    lora_name: str
    r: int
    lora_alpha: float
    changed: bool


@dataclasses.dataclass(frozen=True)
class RewriteResult:
    """What :func:`~loragen.source.rewriter.rewrite_source` did.

    Attributes:
        code: the rewritten source; the input unchanged when there are errors or nothing to do.
        changed: whether ``code`` differs from the input.
        filename: the name used in messages.
        rewritten: the targeted calls (``changed=False`` for those already up to date).
        fields: every layer field the scanner found, targeted or not.
        unmatched_targets: the entries of ``target_modules`` that select no layer field of this file (the
            regex or ``"all-linear"`` as a whole); ``loragen rewrite`` reports those that match nothing
            in any of its files as errors.
        warnings: things left alone that a reader should know about (unresolvable layers, sub-models built by
            transformers' auto classes, ...).
        errors: reasons the file could not be rewritten; when not empty, ``code`` is the input.
        sub_models: the sub-models built by transformers' auto classes (``"Gemma3Model.language_model"``),
            which the rewritten file builds through its LoRA auto classes (:mod:`loragen.source.composite`).
    """

    code: str
    changed: bool
    filename: str
    rewritten: tuple[RewrittenCall, ...] = ()
    fields: tuple[LayerField, ...] = ()
    unmatched_targets: tuple[str, ...] = ()
    warnings: tuple[Diagnostic, ...] = ()
    errors: tuple[Diagnostic, ...] = ()
    sub_models: tuple[str, ...] = ()

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
        if not self.fields and not self.sub_models:
            text = f"{self.filename}: no layer fields"
        elif not self.rewritten:
            text = f"{self.filename}: no targeted layers"
        else:
            text = f"{self.filename}: {_plural(len(self.rewritten), 'layer')} -> LoRA ({shown})"
            if not self.changed:
                text += ", already up to date"
        if self.sub_models:
            text += f", {_plural(len(self.sub_models), 'sub-model')} through LoRA auto classes"
        if self.warnings:
            text += f", {_plural(len(self.warnings), 'warning')}"
        return text


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"
