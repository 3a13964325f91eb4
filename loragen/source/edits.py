"""Source edits for :mod:`loragen.source.rewrite`: swap a callee and add keywords with the call's own
formatting, make relative imports absolute, add the loragen import and the transformers init hook.
Private: used by :func:`loragen.source.rewrite.rewrite_source`.
"""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst

from loragen.config import LoraConfig
from loragen.source.codegen import py_literal, render
from loragen.source.syntax import absolute_module

__all__ = ["Editor", "edit_call", "has_lora_hook", "insert_import", "lora_keywords", "top_level_bindings"]

_LORA_DEFAULTS = {"lora_dropout": 0.0, "use_rslora": False, "init_lora_weights": True}


def lora_keywords(r: int, alpha: float, config: LoraConfig, existing: set[str]) -> dict[str, str]:
    """The LoRA keywords a targeted call gets, as source text: ``r`` and ``lora_alpha`` always, the others
    when they differ from the layer's default or the call already passes them."""
    wanted = {"r": str(r), "lora_alpha": py_literal(alpha)}
    values = {
        "lora_dropout": config.lora_dropout,
        "use_rslora": config.use_rslora,
        "init_lora_weights": config.init_lora_weights,
    }
    for key, value in values.items():
        if key in existing or value != _LORA_DEFAULTS[key]:
            wanted[key] = py_literal(value)
    return wanted


def edit_call(call: cst.Call, lora_name: str | None, keywords: dict[str, str]) -> cst.Call:
    """``call`` with callee ``lora_name`` (None: keep it) and ``keywords`` set, formatting kept."""
    code = cst.Module(body=[]).code_for_node
    args = list(call.args)
    present = {a.keyword.value: i for i, a in enumerate(args) if a.keyword is not None}
    for key, text in keywords.items():
        if key in present:
            arg = args[present[key]]
            if code(arg.value) != text:
                args[present[key]] = arg.with_changes(value=cst.parse_expression(text))
    new = [(k, t) for k, t in keywords.items() if k not in present]
    if new:
        args = _append_args(call, args, new)
    changes: dict[str, object] = {"args": args}
    if lora_name is not None:
        changes["func"] = cst.Name(lora_name)
    return call.with_changes(**changes)


def _append_args(call: cst.Call, args: list[cst.Arg], new: Sequence[tuple[str, str]]) -> list[cst.Arg]:
    def keyword_arg(key: str, text: str, comma: cst.Comma | cst.MaybeSentinel) -> cst.Arg:
        return cst.Arg(
            value=cst.parse_expression(text),
            keyword=cst.Name(key),
            equal=cst.AssignEqual(
                whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
            ),
            comma=comma,
        )

    if not args:
        space = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        return [
            keyword_arg(k, t, space if i < len(new) - 1 else cst.MaybeSentinel.DEFAULT)
            for i, (k, t) in enumerate(new)
        ]
    last = args[-1]
    if isinstance(last.comma, cst.Comma) and isinstance(
        last.comma.whitespace_after, cst.ParenthesizedWhitespace
    ):
        # one argument per line with a trailing comma: add ours the same way
        if isinstance(call.whitespace_before_args, cst.ParenthesizedWhitespace):
            between = cst.Comma(whitespace_after=call.whitespace_before_args)
        elif len(args) > 1 and isinstance(args[-2].comma, cst.Comma):
            between = args[-2].comma
        else:
            between = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        closing = last.comma
        added = [keyword_arg(k, t, between) for k, t in new]
        added[-1] = added[-1].with_changes(comma=closing)
        return [*args[:-1], last.with_changes(comma=between), *added]
    space = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    trailing = last.comma  # a trailing comma on one line, or none
    added = [keyword_arg(k, t, space) for k, t in new]
    added[-1] = added[-1].with_changes(comma=trailing, whitespace_after_arg=last.whitespace_after_arg)
    return [*args[:-1], last.with_changes(comma=space, whitespace_after_arg=cst.SimpleWhitespace("")), *added]


def _dotted(name: str) -> cst.Attribute | cst.Name:
    node: cst.Attribute | cst.Name = cst.Name(name.split(".")[0])
    for part in name.split(".")[1:]:
        node = cst.Attribute(value=node, attr=cst.Name(part))
    return node


class Editor(cst.CSTTransformer):
    """Applies the planned edits to the full tree.

    ``calls`` maps ``id(call node)`` to ``(LoRA class name or None to keep the callee, keywords)``;
    ``package`` (or None) makes relative imports absolute; ``hooks`` maps ``id(class node)`` to the
    ``init_lora_weights`` literal of the ``_init_weights`` hook that class gets.
    """

    def __init__(
        self, calls: dict[int, tuple[str | None, dict[str, str]]], package: str | None, hooks: dict[int, str]
    ) -> None:
        self.calls = calls
        self.package = package
        self.hooks = hooks
        self.import_errors: list[tuple[cst.ImportFrom, str]] = []

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        edit = self.calls.get(id(original_node))
        if edit is None:
            return updated_node
        lora_name, keywords = edit
        return edit_call(updated_node, lora_name, keywords)

    def leave_ImportFrom(self, original_node: cst.ImportFrom, updated_node: cst.ImportFrom) -> cst.ImportFrom:
        if not self.package or not updated_node.relative:
            return updated_node
        name = cst.Module(body=[]).code_for_node(updated_node.module) if updated_node.module else None
        absolute = absolute_module(self.package, len(updated_node.relative), name)
        if absolute is None:
            self.import_errors.append(
                (original_node, f"relative import reaches above the package {self.package!r}")
            )
            return updated_node
        return updated_node.with_changes(
            relative=(), module=_dotted(absolute), whitespace_after_from=cst.SimpleWhitespace(" ")
        )

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        snippet = self.hooks.get(id(original_node))
        if snippet is None:
            return updated_node
        body = list(updated_node.body.body)
        for index, stmt in enumerate(body):
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "_init_weights":
                hook = cst.parse_module(
                    render("rewrite_init_weights_hook.py.j2", **_hook_values(snippet))
                ).body
                inner = list(stmt.body.body) + list(hook)
                body[index] = stmt.with_changes(body=stmt.body.with_changes(body=inner))
                break
        else:
            method = cst.parse_statement(render("rewrite_init_weights.py.j2", **_hook_values(snippet)))
            body.append(method.with_changes(leading_lines=[cst.EmptyLine(indent=False)]))
        return updated_node.with_changes(body=updated_node.body.with_changes(body=body))


def _hook_values(init: str) -> dict[str, str]:
    note = {"True": "A random, B zero", "'gaussian'": "A gaussian, B zero", "False": "A and B random"}[init]
    return {"init_lora_weights": init, "init_note": note}


def has_lora_hook(node: cst.ClassDef) -> bool:
    """Whether the class's ``_init_weights`` already initialises LoRA factors (a rewritten file)."""
    for stmt in node.body.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "_init_weights":
            return "reset_lora_parameters" in cst.Module(body=[]).code_for_node(stmt)
    return False


def top_level_bindings(module: cst.Module) -> dict[str, str]:
    """Names bound at module level -> ``"loragen"`` (imported from loragen under its own name) or ``"other"``."""
    names: dict[str, str] = {}
    for stmt in module.body:
        if isinstance(stmt, (cst.ClassDef, cst.FunctionDef)):
            names[stmt.name.value] = "other"
        elif isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar):
                    source = cst.Module(body=[]).code_for_node(small.module) if small.module else ""
                    origin = (
                        "loragen"
                        if source in ("loragen", "loragen.layers") and not small.relative
                        else "other"
                    )
                    for alias in small.names:
                        bound = alias.asname.name.value if alias.asname else alias.name.value
                        same = alias.asname is None or alias.asname.name.value == alias.name.value
                        names[bound] = origin if same else "other"
                elif isinstance(small, cst.Import):
                    for alias in small.names:
                        target = alias.asname.name if alias.asname else alias.name
                        if isinstance(target, cst.Name):
                            names[target.value] = "other"
                elif isinstance(small, cst.Assign):
                    for t in small.targets:
                        if isinstance(t.target, cst.Name):
                            names[t.target.value] = "other"
    return names


def insert_import(module: cst.Module, names: Sequence[str]) -> cst.Module:
    """Add ``from loragen import <names>`` after the module's leading imports."""
    statement = cst.parse_statement(f"from loragen import {', '.join(names)}")
    body = list(module.body)
    position = 0
    for index, stmt in enumerate(body):
        if isinstance(stmt, (cst.ClassDef, cst.FunctionDef)):
            break
        if isinstance(stmt, cst.SimpleStatementLine) and any(
            isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body
        ):
            position = index + 1
        elif (
            index == 0
            and isinstance(stmt, cst.SimpleStatementLine)
            and isinstance(stmt.body[0], cst.Expr)
            and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
        ):
            position = 1  # after the module docstring
    if (
        position == 1
        and len(body) > 0
        and not any(isinstance(s, (cst.Import, cst.ImportFrom)) for s in getattr(body[0], "body", []))
    ):
        statement = statement.with_changes(leading_lines=[cst.EmptyLine()])
    body.insert(position, statement)
    return module.with_changes(body=body)
