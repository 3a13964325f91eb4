"""The module-level lines a rewrite adds: the loragen imports, ``LORA_CONFIG``, and the bindings it places
among the file's definitions.

A rewritten file imports each LoRA class from where the registry says it lives
(:attr:`~loragen.registry.LayerSpec.lora_module`) and states the config its LoRA layers were written
with, as a literal, after its imports::

    from loragen import LoraConfig
    from loragen.layers import LoraLinear

    # Added by loragen rewrite: ...
    LORA_CONFIG = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"])

Rewriting again with the same config changes nothing; with another config the literal is replaced.

Among the file's definitions (:func:`add_module_lines`), each under a comment saying why:

* after a layer subclass of the file, the binding of its LoRA class::

      # Added by loragen rewrite: FalconLinear with a LoRA adapter (its own forward computes the base output).
      LoraFalconLinear = lora_class_for(FalconLinear)

* after the file's last class, the factory that builds the file's own (rewritten) classes for sub-model
  configs (see :mod:`loragen.source.composite`)::

      LoraAutoModel = lora_auto_class(AutoModel, [Gemma3TextModel], LORA_CONFIG)

A line the file has already (a previous rewrite's) is updated in place, so rewriting again changes nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import cast

import libcst as cst
import libcst.matchers as m

from loragen.source.syntax import code_of

__all__ = [
    "DOCSTRING",
    "Binding",
    "CONFIG_ATTR",
    "CONFIG_NAME",
    "ModuleLine",
    "add_module_lines",
    "add_preamble",
    "is_config_assignment",
    "top_level_bindings",
]

Statement = cst.SimpleStatementLine | cst.BaseCompoundStatement

CONFIG_NAME = "LORA_CONFIG"
# the class attribute that holds it, read by loragen.mark_trainable (loragen.convert.CONFIG_ATTR, which imports
# torch; a test holds the two equal)
CONFIG_ATTR = "loragen_config"
_COMMENT = (
    "# Added by loragen rewrite: the LoRA config this file's LoRA layers were written with.",
    "# Classes holding them carry it as `loragen_config` (read by loragen.mark_trainable).",
)


@dataclasses.dataclass(frozen=True)
class Binding:
    """What a module-level name is bound to: an import from ``module`` (``name`` is the imported name), or
    something else (``module`` None)."""

    module: str | None = None
    name: str | None = None

    def imports(self, module: str, name: str) -> bool:
        """Whether this binding already imports ``name`` from ``module`` (loragen's modules re-export each
        other's layers, so any loragen module counts for another)."""
        if self.module is None or self.name != name:
            return False
        return self.module == module or (_is_loragen(self.module) and _is_loragen(module))


def _is_loragen(module: str) -> bool:
    return module == "loragen" or module.startswith("loragen.")


# one-line module-level statements, looked at by shape (a module has a few hundred at most)
_ASSIGNMENT = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name())])])
_CONFIG_ASSIGNMENT = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(target=m.Name(CONFIG_NAME))], value=m.Call(func=m.Name("LoraConfig"))
        )
    ]
)
DOCSTRING = m.SimpleStatementLine(
    body=[m.Expr(value=m.SimpleString() | m.ConcatenatedString()), m.ZeroOrMore()]
)
_IMPORT = m.SimpleStatementLine(body=[m.ZeroOrMore(), m.Import() | m.ImportFrom(), m.ZeroOrMore()])


def is_config_assignment(stmt: cst.CSTNode) -> bool:
    """Whether ``stmt`` is ``LORA_CONFIG = LoraConfig(...)`` (a previous rewrite's)."""
    return m.matches(stmt, _CONFIG_ASSIGNMENT)


def top_level_bindings(module: cst.Module) -> dict[str, Binding]:
    """The names bound at module level, and to what."""
    names: dict[str, Binding] = {}
    for stmt in module.body:
        if isinstance(stmt, (cst.ClassDef, cst.FunctionDef)):
            names[stmt.name.value] = Binding()
        elif is_config_assignment(stmt):
            names[CONFIG_NAME] = Binding("<loragen rewrite>", CONFIG_NAME)
        elif isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                names.update(_bound_by(small))
    return names


def _bound_by(small: cst.BaseSmallStatement) -> dict[str, Binding]:
    if isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar):
        source = None if small.relative or small.module is None else code_of(small.module)
        out = {}
        for alias in small.names:
            imported = code_of(alias.name)
            bound = code_of(alias.asname.name) if alias.asname else imported
            out[bound] = Binding(source, imported)
        return out
    if isinstance(small, cst.Import):
        return {
            code_of(a.asname.name if a.asname else a.name).partition(".")[0]: Binding() for a in small.names
        }
    if isinstance(small, (cst.Assign, cst.AnnAssign)):
        targets = [t.target for t in small.targets] if isinstance(small, cst.Assign) else [small.target]
        return {t.value: Binding() for t in targets if isinstance(t, cst.Name)}
    return {}


def _is_import(stmt: cst.CSTNode) -> bool:
    return m.matches(stmt, _IMPORT)


def _import_position(body: Sequence[Statement]) -> int:
    """Where new imports go: after the module's leading imports (or its docstring)."""
    position = 0
    for index, stmt in enumerate(body):
        if isinstance(stmt, (cst.ClassDef, cst.FunctionDef)):
            break
        if _is_import(stmt):
            position = index + 1
        elif index == 0 and m.matches(stmt, DOCSTRING):
            position = 1  # after the module docstring
    return position


def _extend_import(stmt: Statement, module: str, names: Sequence[str]) -> Statement | None:
    """``stmt`` importing ``names`` too when it is a one-line ``from <module> import ...``, else None."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    small = stmt.body[0]
    if (
        not isinstance(small, cst.ImportFrom)
        or small.relative
        or small.module is None
        or code_of(small.module) != module
        or isinstance(small.names, cst.ImportStar)
        or small.lpar is not None
        or any(alias.asname for alias in small.names)
    ):
        return None
    every = sorted({code_of(alias.name) for alias in small.names} | set(names))
    return cst.parse_statement(f"from {module} import {', '.join(every)}\n").with_changes(
        leading_lines=stmt.leading_lines, trailing_whitespace=stmt.trailing_whitespace
    )


def add_preamble(tree: cst.Module, imports: Mapping[str, Sequence[str]], config_code: str) -> cst.Module:
    """``tree`` with ``from <module> import <names>`` for every entry of ``imports`` (joined to an existing
    one-line import of that module when there is one) and ``LORA_CONFIG = <config_code>`` after the imports
    (replacing a previous rewrite's)."""
    body: list[Statement] = list(tree.body)
    new: list[Statement] = []
    for module in sorted(imports):
        names = sorted(imports[module])
        if not names:
            continue
        index = next((i for i, s in enumerate(body) if _extend_import(s, module, names) is not None), None)
        if index is not None:
            extended = _extend_import(body[index], module, names)
            assert extended is not None  # just checked
            body[index] = extended
        else:
            new.append(cst.parse_statement(f"from {module} import {', '.join(names)}\n"))
    position = _import_position(body)
    if new and position > 0 and not _is_loragen_import(body[position - 1]):
        new[0] = new[0].with_changes(
            leading_lines=[cst.EmptyLine(indent=False)]
        )  # loragen's imports in a group of their own
    body[position:position] = new
    position += len(new)
    value = cst.parse_expression(config_code)
    existing = next((i for i, s in enumerate(body) if is_config_assignment(s)), None)
    if existing is not None:
        stmt = body[existing]
        assert isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Assign)  # checked
        if code_of(stmt.body[0].value) != config_code:
            body[existing] = stmt.with_changes(body=[stmt.body[0].with_changes(value=value)])
    else:
        comment = [cst.EmptyLine(comment=cst.Comment(line)) for line in _COMMENT]
        statement = cst.parse_statement(f"{CONFIG_NAME} = {config_code}\n")
        body.insert(position, statement.with_changes(leading_lines=[cst.EmptyLine(indent=False), *comment]))
    return tree.with_changes(body=body)


def _is_loragen_import(stmt: Statement) -> bool:
    if not isinstance(stmt, cst.SimpleStatementLine):
        return False
    return any(
        isinstance(s, cst.ImportFrom)
        and s.module is not None
        and not s.relative
        and _is_loragen(code_of(s.module))
        for s in stmt.body
    )


@dataclasses.dataclass(frozen=True)
class ModuleLine:
    """``name = value`` at module level, after the class ``after`` (None: after the file's last class)."""

    name: str
    value: str
    comment: str
    after: str | None = None


def _assigned_name(stmt: cst.CSTNode) -> str | None:
    """``x`` for a line ``x = ...`` (one target, one statement), else None."""
    if not m.matches(stmt, _ASSIGNMENT):
        return None
    target = cast(cst.Assign, cast(cst.SimpleStatementLine, stmt).body[0]).targets[0].target
    return cast(cst.Name, target).value


def add_module_lines(tree: cst.Module, lines: list[ModuleLine]) -> cst.Module:
    """``tree`` with ``lines`` added (or updated where the file assigns the name already)."""
    body = list(tree.body)
    for line in lines:
        value = cst.parse_expression(line.value)
        existing = next((i for i, s in enumerate(body) if _assigned_name(s) == line.name), None)
        if existing is not None:
            stmt = body[existing]
            assert isinstance(stmt, cst.SimpleStatementLine) and isinstance(
                stmt.body[0], cst.Assign
            )  # checked
            if code_of(stmt.body[0].value) != line.value:
                body[existing] = stmt.with_changes(body=[stmt.body[0].with_changes(value=value)])
            continue
        classes = {i: s.name.value for i, s in enumerate(body) if isinstance(s, cst.ClassDef)}
        anchor = next(
            (i for i, name in classes.items() if name == line.after), max(classes, default=len(body) - 1)
        )
        statement = cst.parse_statement(f"{line.name} = {line.value}\n")
        leading = [
            cst.EmptyLine(indent=False),
            cst.EmptyLine(indent=False),
            cst.EmptyLine(comment=cst.Comment(line.comment)),
        ]
        body.insert(anchor + 1, statement.with_changes(leading_lines=leading))
    return tree.with_changes(body=body)
