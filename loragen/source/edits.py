"""The edits a rewrite makes inside a file, each keeping the surrounding formatting and comments.

* a targeted constructor call: the callee becomes the LoRA class, the LoRA keywords are added (or updated)
  the way the call lays out its arguments, ``nn.Linear(a, b)`` -> ``LoraLinear(a, b, r=8, lora_alpha=16)``;
* relative imports become absolute (for output written outside the package);
* a class that holds LoRA layers gets ``loragen_config = LORA_CONFIG`` (after its docstring);
* the topmost transformers ``PreTrainedModel`` class gets the LoRA init in ``_init_weights``.

The LoRA keywords a call gets are those of the LoRA protocol (:meth:`loragen.LoraLayer.from_module`);
a keyword is written when the call passes it already, for ``r`` and ``lora_alpha``, and when the config's
value differs from the default in the LoRA class's constructor signature (or the signature does not show
one), so the defaults cannot drift from the layers'.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import cast

import libcst as cst
import libcst.matchers as m

from loragen.config import LoraConfig
from loragen.source.codegen import py_literal, render
from loragen.source.layer_types import NO_DEFAULT, LayerType
from loragen.source.preamble import CONFIG_ATTR, CONFIG_NAME, DOCSTRING
from loragen.source.syntax import absolute_module, code_of

__all__ = ["Editor", "config_attribute", "edit_call", "has_lora_hook", "lora_keywords"]

_ALWAYS = ("r", "lora_alpha")
_RELATIVE_IMPORT = re.compile(r"\bfrom[\s\\]+\.")


def lora_keywords(
    spec: LayerType, r: int, alpha: float, config: LoraConfig, existing: set[str]
) -> dict[str, str]:
    """The LoRA keywords, as source text, that a targeted call of ``spec``'s type gets (see the module
    docstring); ``existing`` holds the keywords the call passes already.

    Raises:
        ImportError: the LoRA class cannot be imported.
    """
    protocol, defaults, takes_any = spec.signature()
    values = {"r": r, "lora_alpha": alpha}
    wanted: dict[str, str] = {}
    for key, protocol_default in protocol.items():
        value = values[key] if key in values else getattr(config, key, NO_DEFAULT)
        if value is NO_DEFAULT:
            continue  # a protocol keyword the config has no field for: the layer's default applies
        if key not in defaults and key not in _ALWAYS and value == protocol_default and not takes_any:
            continue  # a user's LoRA class without this keyword (say use_dora), at its usual value
        default = defaults.get(key, NO_DEFAULT)
        if key in _ALWAYS or key in existing or default is NO_DEFAULT or value != default:
            wanted[key] = py_literal(value)
    return wanted


def edit_call(
    call: cst.Call, lora_name: str | None, keywords: dict[str, str], wrap: str | None = None
) -> cst.Call:
    """``call`` with callee ``lora_name`` (None: keep it) and ``keywords`` set, formatting kept.

    ``wrap`` (the indentation of the call's statement) says the line would grow too long: a call laid out
    over several lines gets the new keywords on a line of their own, a call on one line is laid out as
    ``Layer(`` / its arguments one level deeper / ``)``.
    """
    args = list(call.args)
    present = {a.keyword.value: i for i, a in enumerate(args) if a.keyword is not None}
    for key, text in keywords.items():
        if key in present:
            arg = args[present[key]]
            if code_of(arg.value) != text:
                args[present[key]] = arg.with_changes(value=_expression(text))
    new = [_keyword_arg(k, t) for k, t in keywords.items() if k not in present]
    changes: dict[str, object] = {}
    if new and args:
        hanging = isinstance(call.whitespace_before_args, cst.ParenthesizedWhitespace)
        if wrap is not None and not hanging and not _one_per_line(args):
            changes["whitespace_before_args"] = _newline(wrap + "    ")
            last = args[-1].with_changes(whitespace_after_arg=_newline(wrap))
            args = _append_args(call, [*args[:-1], last], new, own_line=False)
        else:
            args = _append_args(call, args, new, own_line=wrap is not None and hanging)
    elif new:
        args = [a.with_changes(comma=_COMMA) for a in new[:-1]] + new[-1:]
    if lora_name is not None:
        changes["func"] = cst.Name(lora_name)
    return call.with_changes(args=args, **changes)


_COMMA = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))


@functools.lru_cache(maxsize=256)
def _expression(text: str) -> cst.BaseExpression:
    """``text`` parsed; cached, as a file's hundreds of calls get the same few keyword values (libcst
    nodes are immutable, so one node may stand in many places of a tree)."""
    return cst.parse_expression(text)


def _newline(indent: str) -> cst.ParenthesizedWhitespace:
    return cst.ParenthesizedWhitespace(indent=False, last_line=cst.SimpleWhitespace(indent))


def _keyword_arg(key: str, text: str) -> cst.Arg:
    no_space = cst.SimpleWhitespace("")
    return cst.Arg(
        value=_expression(text),
        keyword=cst.Name(key),
        equal=cst.AssignEqual(whitespace_before=no_space, whitespace_after=no_space),
    )


def _one_per_line(args: Sequence[cst.Arg]) -> bool:
    """Whether the arguments are laid out one per line with a trailing comma."""
    last = args[-1]
    return isinstance(last.comma, cst.Comma) and isinstance(
        last.comma.whitespace_after, cst.ParenthesizedWhitespace
    )


def _append_args(
    call: cst.Call, args: list[cst.Arg], new: Sequence[cst.Arg], own_line: bool
) -> list[cst.Arg]:
    """``args`` followed by ``new``, laid out like ``args``; ``own_line``: ``new`` on a line of its own."""
    last = args[-1]
    if _one_per_line(args):  # one argument per line with a trailing comma: add ours the same way
        if isinstance(call.whitespace_before_args, cst.ParenthesizedWhitespace):
            between = cst.Comma(whitespace_after=call.whitespace_before_args)
        elif len(args) > 1 and isinstance(args[-2].comma, cst.Comma):
            between = args[-2].comma
        else:
            between = _COMMA
        added = [a.with_changes(comma=between) for a in new]
        added[-1] = added[-1].with_changes(comma=last.comma)
        return [*args[:-1], last.with_changes(comma=between), *added]
    first = _COMMA
    if own_line and isinstance(call.whitespace_before_args, cst.ParenthesizedWhitespace):
        first = cst.Comma(whitespace_after=call.whitespace_before_args)  # the arguments' own indentation
    added = [a.with_changes(comma=_COMMA) for a in new]
    added[-1] = added[-1].with_changes(comma=last.comma, whitespace_after_arg=last.whitespace_after_arg)
    return [*args[:-1], last.with_changes(comma=first, whitespace_after_arg=cst.SimpleWhitespace("")), *added]


def _dotted(name: str) -> cst.Attribute | cst.Name:
    node: cst.Attribute | cst.Name = cst.Name(name.split(".")[0])
    for part in name.split(".")[1:]:
        node = cst.Attribute(value=node, attr=cst.Name(part))
    return node


# matchers for the few statements of a class body or a module looked at by shape (not on the hot path, where
# isinstance checks are several times cheaper)
_CONFIG_ATTRIBUTE = m.Assign(
    targets=[m.ZeroOrMore(), m.AssignTarget(target=m.Name(CONFIG_ATTR)), m.ZeroOrMore()]
)


def config_attribute(node: cst.ClassDef) -> str | None:
    """The code of the value a class assigns to ``loragen_config`` in its body, or None."""
    for stmt in node.body.body:
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if m.matches(small, _CONFIG_ATTRIBUTE):
                    return code_of(cast(cst.Assign, small).value)
    return None


def has_lora_hook(node: cst.ClassDef) -> bool:
    """Whether the class's ``_init_weights`` already initialises LoRA factors (a rewritten file)."""
    for stmt in node.body.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "_init_weights":
            return "reset_lora_parameters" in code_of(stmt)
    return False


def _with_config_attribute(body: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
    index = 1 if body and m.matches(body[0], DOCSTRING) else 0
    line = cst.parse_statement(f"{CONFIG_ATTR} = {CONFIG_NAME}  # added by loragen rewrite\n")
    if index:
        line = line.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
    after = body[index] if index < len(body) else None
    if isinstance(after, (cst.FunctionDef, cst.ClassDef)) and not after.leading_lines:
        body[index] = after.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
    return [*body[:index], line, *body[index:]]


def _with_init_hook(body: list[cst.BaseStatement], init: str) -> list[cst.BaseStatement]:
    note = {"True": "A random, B zero", '"gaussian"': "A gaussian, B zero", "False": "A and B random"}[init]
    values = {"init_lora_weights": init, "init_note": note}
    for index, stmt in enumerate(body):
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "_init_weights":
            hook = cst.parse_module(render("rewrite_init_weights_hook.py.j2", **values)).body
            body[index] = stmt.with_changes(body=stmt.body.with_changes(body=[*stmt.body.body, *hook]))
            return body
    method = cst.parse_statement(render("rewrite_init_weights.py.j2", **values))
    return [*body, method.with_changes(leading_lines=[cst.EmptyLine(indent=False)])]


class Editor(cst.CSTTransformer):
    """Applies the planned edits to the full tree.

    Args:
        calls: call node -> (the LoRA class's name, or None to keep the callee; the keywords; the
            ``wrap`` of :func:`edit_call`).
        package: make relative imports absolute inside this package (None: leave them).
        hooks: class node -> the ``init_lora_weights`` literal of the ``_init_weights`` hook it gets.
        config_classes: the class nodes that get ``loragen_config = LORA_CONFIG``.
        factories: call node -> the LoRA auto class that ``AutoModel.from_config(...)`` calls build with.
        hidden: function node -> body source of the functions the scanner did not read; no planned edit
            lies inside one, so those are skipped unless they hold a relative import to make absolute.
        functions: the functions that hold a planned edit (or a class that gets one); the other
            functions are skipped, unless ``nested_imports`` says some function or class holds a relative
            import (then those the scanner read are visited too).
    """

    def __init__(
        self,
        calls: dict[cst.Call, tuple[str | None, dict[str, str], str | None]],
        package: str | None,
        hooks: dict[cst.ClassDef, str],
        config_classes: set[cst.ClassDef],
        factories: dict[cst.Call, str] | None = None,
        hidden: dict[cst.FunctionDef, str] | None = None,
        functions: set[cst.FunctionDef] | None = None,
        nested_imports: bool = True,
    ) -> None:
        self.calls = calls
        self.functions = functions
        self.nested_imports = nested_imports
        self.hidden = hidden or {}
        self.factories = factories or {}
        self.package = package
        self.hooks = hooks
        self.config_classes = config_classes
        self.import_errors: list[str] = []

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        if self.functions is None or node in self.functions:
            return True
        body = self.hidden.get(node)
        if body is None:
            return self.nested_imports
        return self.package is not None and _RELATIVE_IMPORT.search(body) is not None

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        factory = self.factories.get(original_node)
        if factory is not None and isinstance(
            updated_node.func, cst.Attribute
        ):  # LoraAutoModel.from_config(...)
            return updated_node.with_changes(func=updated_node.func.with_changes(value=cst.Name(factory)))
        edit = self.calls.get(original_node)
        if edit is None:
            return updated_node
        return edit_call(updated_node, *edit)

    def leave_ImportFrom(self, original_node: cst.ImportFrom, updated_node: cst.ImportFrom) -> cst.ImportFrom:
        if not self.package or not updated_node.relative:
            return updated_node
        name = code_of(updated_node.module) if updated_node.module else None
        absolute = absolute_module(self.package, len(updated_node.relative), name)
        if absolute is None:
            self.import_errors.append(f"relative import reaches above the package {self.package!r}")
            return updated_node
        return updated_node.with_changes(
            relative=(), module=_dotted(absolute), whitespace_after_from=cst.SimpleWhitespace(" ")
        )

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        key = original_node
        block = updated_node.body
        if (key not in self.config_classes and key not in self.hooks) or not isinstance(
            block, cst.IndentedBlock
        ):
            return updated_node
        body = list(block.body)
        if key in self.config_classes:
            body = _with_config_attribute(body)
        if key in self.hooks:
            body = _with_init_hook(body, self.hooks[key])
        return updated_node.with_changes(body=block.with_changes(body=body))
