"""What :func:`loragen.rewrite_source` returns: the new code, what it found, warnings and errors."""

from __future__ import annotations

import dataclasses

from loragen.source.fields import LayerField

__all__ = ["Diagnostic", "RewriteResult", "RewrittenCall"]


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
