"""Generated Python: the Jinja templates in ``templates/``, Python literals written as a person would, and the
edits a rewrite makes in a file, keeping the surrounding formatting and comments (:class:`Editor`,
:func:`add_preamble`, :func:`add_module_lines`). A line the file has already (a previous rewrite's) is
updated in place, so rewriting again changes nothing.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import keyword
import re
from collections.abc import Mapping, Sequence
from typing import Any, cast

import jinja2
import libcst as cst
import libcst.matchers as m

from loragen.config import LoraConfig
from loragen.resources import read_template
from loragen.source.scan import NO_DEFAULT, LayerField, LayerType, absolute_module, code_of

__all__ = [
    "CONFIG_ATTR",
    "CONFIG_NAME",
    "Binding",
    "Diagnostic",
    "Editor",
    "ModuleLine",
    "RewriteResult",
    "RewrittenCall",
    "add_module_lines",
    "add_preamble",
    "config_attribute",
    "config_literal",
    "edit_call",
    "environment",
    "has_lora_hook",
    "is_identifier",
    "lora_keywords",
    "py_literal",
    "render",
    "top_level_bindings",
]

_WIDTH = 100  # a generated line longer than this is split, one argument per line


@functools.cache
def environment() -> jinja2.Environment:
    """The shared Jinja environment: templates from loragen's resources, ``StrictUndefined``, no autoescape."""
    return jinja2.Environment(
        loader=jinja2.FunctionLoader(read_template),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def render(template: str, **values: Any) -> str:
    """Render the template named ``template`` (``"decorator.py.j2"``) with ``values``.

    Raises:
        jinja2.UndefinedError: the template uses a value that was not passed.
        FileNotFoundError: no such template.
    """
    return environment().get_template(template).render(**values)


def py_literal(value: Any) -> str:
    """Python source for a config value: ``16`` for ``16.0``, ``r"(.*\\.)?q_proj"``, tuples as lists.

    Raises:
        TypeError: a value that has no literal (an object).
    """
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        if "\\" in value and '"' not in value and not value.endswith("\\") and value.isprintable():
            raw = f'r"{value}"'  # a regex reads best as a raw string
            if ast.literal_eval(raw) == value:
                return raw
        quoted = repr(value)
        if quoted.startswith("'") and '"' not in value and "'" not in value:
            return f'"{quoted[1:-1]}"'
        return quoted
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(py_literal(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{py_literal(k)}: {py_literal(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no Python literal for {type(value).__name__} {value!r}")


def config_literal(config: LoraConfig, *, indent: str = "", column: int = 0) -> str:
    """``LoraConfig(r=16, ...)``: the call that builds ``config``, with the fields that differ from their
    defaults; on one line if it fits in 100 columns after ``column``, else one field per line under ``indent``.
    """
    default = LoraConfig()
    arguments = [
        f"{f.name}={py_literal(getattr(config, f.name))}"
        for f in dataclasses.fields(config)
        if getattr(config, f.name) != getattr(default, f.name)
    ]
    one_line = f"LoraConfig({', '.join(arguments)})"
    if column + len(one_line) <= _WIDTH:
        return one_line
    inner = indent + "    "
    return "LoraConfig(\n" + "".join(f"{inner}{a},\n" for a in arguments) + f"{indent})"


def is_identifier(name: str) -> bool:
    """Whether ``name`` can be written as a Python attribute name."""
    return name.isidentifier() and not keyword.iskeyword(name)


Statement = cst.SimpleStatementLine | cst.BaseCompoundStatement

CONFIG_NAME = "LORA_CONFIG"
# loragen.convert.CONFIG_ATTR, which imports torch; a test holds the two equal
CONFIG_ATTR = "loragen_config"
_COMMENT = (
    "# Added by loragen rewrite: the LoRA config this file's LoRA layers were written with.",
    "# Classes holding them carry it as `loragen_config` (read by loragen.mark_trainable).",
)


@dataclasses.dataclass(frozen=True)
class Binding:
    """What a module-level name is bound to: an import of ``name`` from ``module``, or something else (None)."""

    module: str | None = None
    name: str | None = None

    def imports(self, module: str, name: str) -> bool:
        """Whether this binding imports ``name`` from ``module`` (any loragen module counts for another)."""
        if self.module is None or self.name != name:
            return False
        return self.module == module or (_is_loragen(self.module) and _is_loragen(module))


def _is_loragen(module: str) -> bool:
    return module == "loragen" or module.startswith("loragen.")


_ASSIGNMENT = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name())])])
# a previous rewrite's `LORA_CONFIG = LoraConfig(...)`
_CONFIG_ASSIGNMENT = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(target=m.Name(CONFIG_NAME))], value=m.Call(func=m.Name("LoraConfig"))
        )
    ]
)
_DOCSTRING = m.SimpleStatementLine(
    body=[m.Expr(value=m.SimpleString() | m.ConcatenatedString()), m.ZeroOrMore()]
)
_IMPORT = m.SimpleStatementLine(body=[m.ZeroOrMore(), m.Import() | m.ImportFrom(), m.ZeroOrMore()])


def top_level_bindings(module: cst.Module) -> dict[str, Binding]:
    """The names bound at module level, and to what."""
    names: dict[str, Binding] = {}
    for stmt in module.body:
        if isinstance(stmt, (cst.ClassDef, cst.FunctionDef)):
            names[stmt.name.value] = Binding()
        elif m.matches(stmt, _CONFIG_ASSIGNMENT):
            names[CONFIG_NAME] = Binding("<loragen rewrite>", CONFIG_NAME)
        elif isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                names.update(_bound_by(small))
    return names


def _bound_by(small: cst.BaseSmallStatement) -> dict[str, Binding]:
    if isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar):
        source = None if small.relative or small.module is None else code_of(small.module)
        return {
            code_of(a.asname.name if a.asname else a.name): Binding(source, code_of(a.name))
            for a in small.names
        }
    if isinstance(small, cst.Import):
        return {
            code_of(a.asname.name if a.asname else a.name).partition(".")[0]: Binding() for a in small.names
        }
    if isinstance(small, (cst.Assign, cst.AnnAssign)):
        targets = [t.target for t in small.targets] if isinstance(small, cst.Assign) else [small.target]
        return {t.value: Binding() for t in targets if isinstance(t, cst.Name)}
    return {}


def _import_position(body: Sequence[Statement]) -> int:
    position = 0
    for index, stmt in enumerate(body):
        if isinstance(stmt, (cst.ClassDef, cst.FunctionDef)):
            break
        if m.matches(stmt, _IMPORT):
            position = index + 1
        elif index == 0 and m.matches(stmt, _DOCSTRING):
            position = 1  # after the module docstring
    return position


def _extend_import(stmt: Statement, module: str, names: Sequence[str]) -> Statement | None:
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
    one-line import) and ``LORA_CONFIG = <config_code>`` after the imports (replacing a previous one)."""
    body: list[Statement] = list(tree.body)
    new: list[Statement] = []
    for module in sorted(imports):
        names = sorted(imports[module])
        if not names:
            continue
        extended = next(((i, j) for i, s in enumerate(body) if (j := _extend_import(s, module, names))), None)
        if extended is not None:
            body[extended[0]] = extended[1]
        else:
            new.append(cst.parse_statement(f"from {module} import {', '.join(names)}\n"))
    position = _import_position(body)
    if new and position > 0 and not _is_loragen_import(body[position - 1]):
        # loragen's imports in a group of their own
        new[0] = new[0].with_changes(leading_lines=[cst.EmptyLine(indent=False)])
    body[position:position] = new
    position += len(new)
    existing = next((i for i, s in enumerate(body) if m.matches(s, _CONFIG_ASSIGNMENT)), None)
    if existing is not None:
        _set_value(body, existing, config_code)
    else:
        comment = [cst.EmptyLine(comment=cst.Comment(line)) for line in _COMMENT]
        statement = cst.parse_statement(f"{CONFIG_NAME} = {config_code}\n")
        body.insert(position, statement.with_changes(leading_lines=[cst.EmptyLine(indent=False), *comment]))
    return tree.with_changes(body=body)


def _is_loragen_import(stmt: Statement) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and any(
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


def _set_value(body: list[Statement], index: int, code: str) -> None:
    stmt = cast(cst.SimpleStatementLine, body[index])
    assign = cast(cst.Assign, stmt.body[0])
    if code_of(assign.value) != code:
        body[index] = stmt.with_changes(body=[assign.with_changes(value=cst.parse_expression(code))])


def _assigned_name(stmt: cst.CSTNode) -> str | None:
    if not m.matches(stmt, _ASSIGNMENT):
        return None
    target = cast(cst.Assign, cast(cst.SimpleStatementLine, stmt).body[0]).targets[0].target
    return cast(cst.Name, target).value


def add_module_lines(tree: cst.Module, lines: list[ModuleLine]) -> cst.Module:
    """``tree`` with ``lines`` added (or updated where the file assigns the name already)."""
    body: list[Statement] = list(tree.body)
    for line in lines:
        existing = next((i for i, s in enumerate(body) if _assigned_name(s) == line.name), None)
        if existing is not None:
            _set_value(body, existing, line.value)
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


_ALWAYS = ("r", "lora_alpha")
_RELATIVE_IMPORT = re.compile(r"\bfrom[\s\\]+\.")


def lora_keywords(
    spec: LayerType, r: int, alpha: float, config: LoraConfig, existing: set[str]
) -> dict[str, str]:
    """The LoRA keywords, as source text, that a targeted call of ``spec``'s type gets: ``r``, ``lora_alpha``,
    those the call passes already (``existing``) and those whose value differs from the LoRA class's default.

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
    """``call`` with callee ``lora_name`` (None: keep it) and ``keywords`` set, formatting kept; ``wrap`` (the
    statement's indentation) says the line would grow too long, so the arguments go on lines of their own."""
    args = list(call.args)
    present = {a.keyword.value: i for i, a in enumerate(args) if a.keyword is not None}
    for key, text in keywords.items():
        if key in present:
            arg = args[present[key]]
            if code_of(arg.value) != text:
                args[present[key]] = arg.with_changes(value=_expression(text))
    new = [
        cst.Arg(_expression(t), keyword=cst.Name(k), equal=_EQUAL)
        for k, t in keywords.items()
        if k not in present
    ]
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
_EQUAL = cst.AssignEqual(
    whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
)


@functools.lru_cache(maxsize=256)
def _expression(text: str) -> cst.BaseExpression:
    # cached: a file's calls get the same few values, and libcst nodes are immutable
    return cst.parse_expression(text)


def _newline(indent: str) -> cst.ParenthesizedWhitespace:
    return cst.ParenthesizedWhitespace(indent=False, last_line=cst.SimpleWhitespace(indent))


def _one_per_line(args: Sequence[cst.Arg]) -> bool:
    last = args[-1]
    return isinstance(last.comma, cst.Comma) and isinstance(
        last.comma.whitespace_after, cst.ParenthesizedWhitespace
    )


def _append_args(
    call: cst.Call, args: list[cst.Arg], new: Sequence[cst.Arg], own_line: bool
) -> list[cst.Arg]:
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


_INIT_WEIGHTS = m.FunctionDef(name=m.Name("_init_weights"))


def has_lora_hook(node: cst.ClassDef) -> bool:
    """Whether the class's ``_init_weights`` already initialises LoRA factors (a rewritten file)."""
    method = next((s for s in node.body.body if m.matches(s, _INIT_WEIGHTS)), None)
    return method is not None and "reset_lora_parameters" in code_of(method)


class Editor(cst.CSTTransformer):
    """Applies the planned edits to the full tree.

    Args:
        calls: call node -> the arguments of :func:`edit_call`.
        package: make relative imports absolute inside this package (None: leave them).
        hooks: class node -> the ``init_lora_weights`` literal of the ``_init_weights`` hook it gets.
        config_classes: the class nodes that get ``loragen_config = LORA_CONFIG``.
        factories: call node -> the LoRA auto class that ``AutoModel.from_config(...)`` calls build with.
        hidden: function node -> body source of the functions the scanner did not read.
        functions: the functions that hold a planned edit; the others are visited only for relative imports
            (``nested_imports``: some function or class holds one).
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
        if factory is not None and isinstance(updated_node.func, cst.Attribute):
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
            relative=(),
            module=cst.parse_expression(absolute),
            whitespace_after_from=cst.SimpleWhitespace(" "),
        )

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        block = updated_node.body
        edited = original_node in self.config_classes or original_node in self.hooks
        if not edited or not isinstance(block, cst.IndentedBlock):
            return updated_node
        body = list(block.body)
        if original_node in self.config_classes:
            index = 1 if body and m.matches(body[0], _DOCSTRING) else 0
            line = cst.parse_statement(f"{CONFIG_ATTR} = {CONFIG_NAME}  # added by loragen rewrite\n")
            if index:
                line = line.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
            after = body[index] if index < len(body) else None
            if isinstance(after, (cst.FunctionDef, cst.ClassDef)) and not after.leading_lines:
                body[index] = after.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
            body.insert(index, line)
        init = self.hooks.get(original_node)
        if init is not None:
            notes = {
                "True": "A random, B zero",
                '"gaussian"': "A gaussian, B zero",
                "False": "A and B random",
            }
            values = {"init_lora_weights": init, "init_note": notes[init]}
            at = next((i for i, s in enumerate(body) if m.matches(s, _INIT_WEIGHTS)), None)
            if at is None:
                method = cst.parse_statement(render("rewrite_init_weights.py.j2", **values))
                body.append(method.with_changes(leading_lines=[cst.EmptyLine(indent=False)]))
            else:
                stmt = cast(cst.FunctionDef, body[at])
                hook = cst.parse_module(render("rewrite_init_weights_hook.py.j2", **values)).body
                body[at] = stmt.with_changes(body=stmt.body.with_changes(body=[*stmt.body.body, *hook]))
        return updated_node.with_changes(body=block.with_changes(body=body))


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
        code: the rewritten source; the input unchanged when there are ``errors`` or nothing to do.
        rewritten: the targeted calls (``changed=False`` for those already up to date).
        fields: every layer field the scanner found, targeted or not.
        unmatched_targets: the entries of ``target_modules`` that select no layer field of this file.
        warnings: things left alone that a reader should know about (unresolvable layers, ...).
        sub_models: the sub-models built by transformers' auto classes (``"Gemma3Model.language_model"``).
        init_hooks: the ``PreTrainedModel`` classes whose ``_init_weights`` gives LoRA factors a checkpoint
            lacks peft's initialisation in ``from_pretrained`` (the hook added now, or there already).
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
    init_hooks: tuple[str, ...] = ()

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
        if self.init_hooks and not self.rewritten and not self.sub_models:
            # the hook for the LoRA layers of other files that these models may build
            hooked = ", ".join(f"{name}._init_weights" for name in self.init_hooks)
            text += f"; {hooked} initialises the LoRA layers of other files"
            if not self.changed:
                text += ", already up to date"
        if self.sub_models:
            text += f", {_plural(len(self.sub_models), 'sub-model')} through LoRA auto classes"
        if self.warnings:
            text += f", {_plural(len(self.warnings), 'warning')}"
        return text


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"
