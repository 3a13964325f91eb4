"""The ``__init__`` walk: the statements that store modules on ``self``, and the values they store.

:class:`InitWalker` reads one class's ``__init__`` statement by statement: ``self.x = ...`` (also
annotated and tuple assignments), locals (``proj = Layer(...); self.x = proj``), ``self.x.append(...)`` /
``extend``, ``self.add_module("x", ...)``, ``setattr(self, "x", ...)`` and ``self.x["key"] = ...``, in
every branch of ``if`` / ``try`` / loops / ``match`` (marked conditional) and inside ``with``.

Its base :class:`ValueFollower` follows a value assigned to a field (``self.x = <value>``) through
conditional expressions, local variables, containers (``ModuleList``, ``Sequential``, ``ModuleDict``,
comprehensions, ``OrderedDict``) down to the constructor calls it holds. A call to a registered layer type
becomes a :class:`~loragen.source.fields.LayerField`; a call to another class a
:class:`~loragen.source.fields.SubmoduleField`; what cannot be followed statically (a layer built by a
helper, a constructor from ``getattr`` or a parameter) an :class:`~loragen.source.fields.Unresolved`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import libcst as cst

from loragen.source.fields import FactoryCall, LayerField, SubmoduleField, Unresolved
from loragen.source.names import Resolver, lora_auto_name
from loragen.source.syntax import calls_in, code_of, nested_statements, string_value

__all__ = ["Findings", "InitWalker", "Site", "ValueFollower"]

_SETATTR = "builtins.setattr"
_ORDERED_DICT = ("collections.OrderedDict", "builtins.dict", "typing.OrderedDict")
_GETATTR = "builtins.getattr"


@dataclasses.dataclass
class Site:
    """Where a value ends up: the attribute of self and the path below it."""

    attribute: str
    path: str
    conditional: bool
    container: str | None = None


@dataclasses.dataclass
class Findings:
    """What the walks of all classes of a module found, by call node.

    ``calls`` maps every followed layer constructor call (the node itself) to the fields it builds,
    ``claimed`` holds the calls accounted for (followed or reported) and ``unresolved`` everything
    reported; ``factories`` the sub-models built by auto classes.
    """

    calls: dict[cst.Call, list[LayerField]] = dataclasses.field(default_factory=dict)
    claimed: set[cst.Call] = dataclasses.field(default_factory=set)
    unresolved: list[Unresolved] = dataclasses.field(default_factory=list)
    factories: dict[cst.Call, FactoryCall] = dataclasses.field(default_factory=dict)


class ValueFollower:
    """Follows the values of one class's ``__init__`` to its fields (see the module docstring)."""

    def __init__(self, names: Resolver, found: Findings, owner: str) -> None:
        self.names = names
        self.found = found
        self.owner = owner
        self.fields: list[LayerField] = []
        self.submodules: list[SubmoduleField] = []
        self.unresolved: list[Unresolved] = []
        self.factories: list[FactoryCall] = []
        self.self_name = "self"
        self.params: set[str] = set()
        self.locals: dict[str, list[tuple[cst.BaseExpression, bool]]] = {}
        self.following: set[str] = set()

    def report(self, node: cst.CSTNode, attribute: str | None, reason: str) -> None:
        item = Unresolved(self.owner, attribute, self.names.loc(node), reason)
        self.unresolved.append(item)
        self.found.unresolved.append(item)

    def is_self_attr(self, node: cst.BaseExpression) -> str | None:
        """``"x"`` for ``self.x``, None for anything else."""
        if (
            isinstance(node, cst.Attribute)
            and isinstance(node.value, cst.Name)
            and node.value.value == self.self_name
        ):
            return node.attr.value
        return None

    def value(self, node: cst.BaseExpression, site: Site) -> None:
        if isinstance(node, cst.IfExp):
            conditional_site = dataclasses.replace(site, conditional=True)
            self.value(node.body, conditional_site)
            self.value(node.orelse, conditional_site)
            return
        if isinstance(node, cst.Name) and node.value in self.locals and node.value not in self.following:
            self.following.add(node.value)
            bindings = self.locals[node.value]
            for bound, conditional in bindings:
                self.value(
                    bound,
                    dataclasses.replace(
                        site, conditional=site.conditional or conditional or len(bindings) > 1
                    ),
                )
            self.following.discard(node.value)
            return
        if not isinstance(node, cst.Call):
            return
        hit = self.names.layer(node)
        if hit is not None:
            field = LayerField(
                owner=self.owner,
                attribute=site.attribute,
                path=site.path,
                layer=hit.spec.base_qualname,
                lora_name=hit.lora_name or hit.spec.lora_name,
                location=self.names.loc(node),
                conditional=site.conditional,
                container=site.container,
                is_lora=hit.is_lora,
                subclass=hit.subclass,
            )
            self.fields.append(field)
            self.found.claimed.add(node)
            self.found.calls.setdefault(node, []).append(field)
            return
        kind = self.names.container_kind(node)
        if kind is not None:
            self.container(node, kind, site)
            return
        self.other_call(node, site)

    def container(self, call: cst.Call, kind: str, site: Site) -> None:
        positional = [a for a in call.args if a.keyword is None]
        if kind == "ModuleList":
            if positional:
                self.items(
                    positional[0].value, dataclasses.replace(site, path=f"{site.path}.{{i}}", container=kind)
                )
            return
        if kind == "ModuleDict":
            if positional:
                self.mapping(positional[0].value, site, kind)
            return
        # Sequential(a, b, c) or Sequential(OrderedDict([...]))
        if len(positional) == 1 and isinstance(positional[0].value, (cst.Call, cst.Dict, cst.DictComp)):
            inner = positional[0].value
            if not isinstance(inner, cst.Call) or self.names.qualnames(inner.func) & set(_ORDERED_DICT):
                self.mapping(inner, site, kind)
                return
        for index, arg in enumerate(positional):
            if arg.star:
                self.items(arg.value, dataclasses.replace(site, path=f"{site.path}.{{i}}", container=kind))
                if any(self.builds_layer(a.value) for a in positional[index + 1 :]):
                    self.report(
                        arg.value,
                        site.attribute,
                        f"items after *{code_of(arg.value)} in {kind} have indices known only at run time",
                    )
                return
            self.value(arg.value, dataclasses.replace(site, path=f"{site.path}.{index}", container=kind))

    def items(self, node: cst.BaseExpression, site: Site) -> None:
        """A list-like value whose items land at ``site.path`` (already ending in ``.{i}``)."""
        base = site.path.removesuffix(".{i}")
        if isinstance(node, (cst.List, cst.Tuple)):
            if any(isinstance(e, cst.StarredElement) for e in node.elements):
                for element in node.elements:
                    self.value(element.value, site)
                return
            for index, element in enumerate(node.elements):
                self.value(element.value, dataclasses.replace(site, path=f"{base}.{index}"))
        elif isinstance(node, (cst.ListComp, cst.GeneratorExp)):
            self.value(node.elt, site)
        elif isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Add):
            self.items(node.left, site)
            self.items(node.right, site)
        elif self.builds_layer(node):
            self.report(
                node,
                site.attribute,
                f"the items of {site.attribute} come from {code_of(node)!s:.60}; cannot follow them statically",
            )

    def mapping(self, node: cst.BaseExpression, site: Site, kind: str) -> None:
        """A dict-like value (dict literal, comprehension, OrderedDict([...]), list of pairs)."""
        if isinstance(node, cst.Call) and node.args:
            keywords = [a.keyword.value for a in node.args if a.keyword is not None]
            if len(keywords) == len(node.args):  # dict(a=..., b=...)
                for keyword, a in zip(keywords, node.args):
                    self.value(
                        a.value, dataclasses.replace(site, path=f"{site.path}.{keyword}", container=kind)
                    )
                return
            node = node.args[0].value
        if isinstance(node, cst.Dict):
            for element in node.elements:
                if isinstance(element, cst.DictElement):
                    key = string_value(element.key)
                    path = f"{site.path}.{key}" if key is not None else f"{site.path}.{{key}}"
                    self.value(element.value, dataclasses.replace(site, path=path, container=kind))
        elif isinstance(node, cst.DictComp):
            self.value(node.value, dataclasses.replace(site, path=f"{site.path}.{{key}}", container=kind))
        elif isinstance(node, (cst.List, cst.Tuple)):
            for item in node.elements:
                pair = item.value
                if isinstance(pair, (cst.Tuple, cst.List)) and len(pair.elements) == 2:
                    key = string_value(pair.elements[0].value)
                    path = f"{site.path}.{key}" if key is not None else f"{site.path}.{{key}}"
                    self.value(pair.elements[1].value, dataclasses.replace(site, path=path, container=kind))
        elif isinstance(node, (cst.ListComp, cst.GeneratorExp)):
            pair = node.elt
            if isinstance(pair, (cst.Tuple, cst.List)) and len(pair.elements) == 2:
                self.value(
                    pair.elements[1].value,
                    dataclasses.replace(site, path=f"{site.path}.{{key}}", container=kind),
                )
        elif self.builds_layer(node):
            self.report(
                node,
                site.attribute,
                f"the entries of {site.attribute} come from {code_of(node)!s:.60}; "
                "cannot follow them statically",
            )

    def other_call(self, call: cst.Call, site: Site) -> None:
        """A call that is neither a layer nor a container: a submodule, a factory, or unrelated."""
        func = call.func
        factory = self.names.auto_factory(call)
        if factory is not None:  # self.language_model = AutoModel.from_config(config.text_config)
            auto_class, is_lora = factory
            name = (
                code_of(func.value)
                if is_lora and isinstance(func, cst.Attribute)
                else lora_auto_name(auto_class)
            )
            item = FactoryCall(
                self.owner, site.attribute, site.path, auto_class, name, self.names.loc(call), is_lora
            )
            self.factories.append(item)
            self.found.factories[call] = item
            return
        names = self.names.qualnames(func)
        local = self.names.local_class(func)
        if local is not None:
            self._submodule(site, call, local, local, site.conditional)
            return
        if isinstance(func, cst.Call) and _GETATTR in self.names.qualnames(func.func):
            self.report(
                call,
                site.attribute,
                f"{site.path} is built by {code_of(func)}(...); a constructor looked up "
                "with getattr is known only at run time",
            )
            return
        if isinstance(func, cst.Name) and func.value in self.locals and func.value not in self.params:
            classes = self.alias_classes(func.value)
            if classes is not None:  # attention_class = CrossAttention if cross else SelfAttention
                for local in classes:
                    self._submodule(site, call, local, local, True)
                return
        if isinstance(func, cst.Name) and (func.value in self.params or func.value in self.locals):
            what = "a parameter of __init__" if func.value in self.params else "a local variable"
            self.report(
                call,
                site.attribute,
                f"{site.path} is built by {func.value}(...), {what}; its type is known only at run time",
            )
            return
        if self.calls_layer_helper(call):
            self.report(
                call,
                site.attribute,
                f"{site.path} is built by the helper {code_of(func)}(...), which "
                "constructs layers; move the constructor into __init__ to convert it",
            )
            return
        external = sorted(n for n in names if not n.startswith(self.names.module_prefix))
        if external and _looks_like_class(external[0]):
            self._submodule(site, call, external[0], None, site.conditional)

    def _submodule(
        self, site: Site, call: cst.Call, callee: str, local: str | None, conditional: bool
    ) -> None:
        location = self.names.loc(call)
        self.submodules.append(
            SubmoduleField(self.owner, site.attribute, site.path, callee, location, local, conditional)
        )

    def alias_classes(self, name: str) -> list[str] | None:
        """The local classes a local variable may hold (``cls = A if c else B``), or None if not only those."""
        found: list[str] = []
        todo = [value for value, _ in self.locals[name]]
        while todo:
            node = todo.pop(0)
            if isinstance(node, cst.IfExp):
                todo.extend((node.body, node.orelse))
                continue
            local = self.names.local_class(node) if isinstance(node, (cst.Name, cst.Attribute)) else None
            if local is None:
                return None
            found.append(local)
        return list(dict.fromkeys(found)) or None

    def calls_layer_helper(self, node: cst.BaseExpression) -> bool:
        if not isinstance(node, cst.Call):
            return False
        helper = self.names.local_function(node.func)
        method = self.is_self_attr(node.func)
        if method is not None and f"{self.owner}.{method}" in self.names.function_defs:
            helper = f"{self.owner}.{method}"
        return helper is not None and self.builds_layer(self.names.function_defs[helper])

    def builds_layer(self, node: cst.CSTNode) -> bool:
        return any(self.names.layer(c) is not None for c in calls_in(node))


def _looks_like_class(qualname: str) -> bool:
    last = qualname.rpartition(".")[2]
    return bool(last) and last[0].isupper()


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
