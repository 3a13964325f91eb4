"""The ``__init__`` walk: the statements that store modules on ``self``.

:class:`InitWalker` reads one class's ``__init__`` statement by statement: ``self.x = ...`` (also
annotated and tuple assignments), locals (``proj = Layer(...); self.x = proj``), ``self.x.append(...)`` /
``extend``, ``self.add_module("x", ...)``, ``setattr(self, "x", ...)`` and ``self.x["key"] = ...``, in
every branch of ``if`` / ``try`` / loops / ``match`` (marked conditional) and inside ``with``. The values
are followed by :class:`loragen.source.values.ValueFollower`.
"""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst

from loragen.source.syntax import code_of, nested_statements, string_value
from loragen.source.values import Site, ValueFollower

__all__ = ["InitWalker"]

_SETATTR = "builtins.setattr"


class InitWalker(ValueFollower):
    """Walks one ``__init__``; the fields, submodules and unresolved items land on the instance."""

    def scan_init(self, init: cst.FunctionDef) -> None:
        """Walk ``init`` (the class's ``__init__``) and collect its fields."""
        params = init.params
        positional = [*params.posonly_params, *params.params]
        if positional:
            self.self_name = positional[0].name.value
        for p in [*positional, *params.kwonly_params]:
            self.params.add(p.name.value)
        for star in (params.star_arg, params.star_kwarg):
            if isinstance(star, cst.Param):
                self.params.add(star.name.value)
        self.params.discard(self.self_name)
        self.statements(init.body.body, conditional=False)

    def statements(self, body: Sequence[cst.CSTNode], conditional: bool) -> None:
        for stmt in body:
            if isinstance(stmt, cst.SimpleStatementLine):
                for small in stmt.body:
                    self.small_statement(small, conditional)
            elif isinstance(stmt, (cst.If, cst.Try, cst.For, cst.While, cst.Match)):
                self.statements(nested_statements(stmt), True)
            elif isinstance(stmt, cst.With):
                self.statements(nested_statements(stmt), conditional)
            # nested def/class inside __init__: their layer calls are reported as unclaimed

    def small_statement(self, small: cst.BaseSmallStatement, conditional: bool) -> None:
        if isinstance(small, cst.Assign):
            for target in small.targets:
                self.assign(target.target, small.value, conditional)
        elif isinstance(small, cst.AnnAssign) and small.value is not None:
            self.assign(small.target, small.value, conditional)
        elif isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
            self.call_statement(small.value, conditional)

    def assign(self, target: cst.BaseExpression, value: cst.BaseExpression, conditional: bool) -> None:
        attribute = self.is_self_attr(target)
        if attribute is not None:
            self.value(value, Site(attribute, attribute, conditional))
            return
        if isinstance(target, cst.Name):
            self.locals.setdefault(target.value, []).append((value, conditional))
            return
        if isinstance(target, (cst.Tuple, cst.List)):
            elements = [e.value for e in target.elements]
            if isinstance(value, (cst.Tuple, cst.List)) and len(value.elements) == len(elements):
                for sub_target, element in zip(elements, value.elements):
                    self.assign(sub_target, element.value, conditional)
            elif any(self.is_self_attr(e) for e in elements) and (
                self.builds_layer(value) or self.calls_layer_helper(value)
            ):
                self.report(value, None, f"tuple assignment from {code_of(value)!s:.60} cannot be followed")
            return
        if isinstance(target, cst.Subscript):
            attribute = self.is_self_attr(target.value)
            if attribute is not None and len(target.slice) == 1:
                index = target.slice[0].slice
                key = None
                if isinstance(index, cst.Index):
                    key = string_value(index.value)
                    if key is None and isinstance(index.value, cst.Integer):
                        key = index.value.value
                if key is None:
                    self.value(value, Site(attribute, f"{attribute}.{{key}}", conditional, "ModuleDict"))
                else:
                    self.value(value, Site(attribute, f"{attribute}.{key}", conditional, "ModuleDict"))

    def call_statement(self, call: cst.Call, conditional: bool) -> None:
        func = call.func
        # self.x.append(...), self.x.extend([...])
        if isinstance(func, cst.Attribute) and func.attr.value in ("append", "extend", "insert"):
            attribute = self.is_self_attr(func.value)
            if attribute is not None and call.args:
                site = Site(attribute, f"{attribute}.{{i}}", conditional, "ModuleList")
                arg = call.args[-1].value
                if func.attr.value == "extend":
                    self.items(arg, site)
                else:
                    self.value(arg, site)
            return
        # self.add_module("x", ...), self.register_module("x", ...), setattr(self, "x", ...)
        name_arg = value_arg = None

        def is_self(node: cst.BaseExpression) -> bool:
            return isinstance(node, cst.Name) and node.value == self.self_name

        if isinstance(func, cst.Attribute) and func.attr.value in ("add_module", "register_module"):
            if is_self(func.value) and len(call.args) == 2:
                name_arg, value_arg = call.args[0].value, call.args[1].value
        elif _SETATTR in self.names.qualnames(func) and len(call.args) == 3 and is_self(call.args[0].value):
            name_arg, value_arg = call.args[1].value, call.args[2].value
        if value_arg is None or name_arg is None:
            return
        name = string_value(name_arg)
        if name is None:
            self.report(
                call,
                None,
                f"{code_of(func)}() with an attribute name computed at run time ({code_of(name_arg)}); "
                "its module path cannot be known statically",
            )
            return
        self.value(value_arg, Site(name, name, conditional))
