"""The walker behind :mod:`loragen.source.scan`: resolves names, follows ``__init__`` and reports the rest.

:class:`ModuleScanner` indexes a module's classes, walks each ``__init__`` with :class:`_ClassState`
(assignments, containers, conditionals, locals) and finally reports every layer constructor call that
no field could be followed to. Private: use :func:`loragen.source.scan.scan_source`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterator, Mapping, Sequence

import libcst as cst
import libcst.metadata as md

from loragen.registry import LayerSpec, specs
from loragen.source.scan import (
    ClassScan,
    LayerField,
    ScannedModule,
    ScanResult,
    SourceLocation,
    SubmoduleField,
    Unresolved,
    _code,
    absolute_module,
)

__all__ = ["ModuleScanner"]

_CONTAINERS = {
    "ModuleList": ("torch.nn.ModuleList", "torch.nn.modules.container.ModuleList"),
    "Sequential": ("torch.nn.Sequential", "torch.nn.modules.container.Sequential"),
    "ModuleDict": ("torch.nn.ModuleDict", "torch.nn.modules.container.ModuleDict"),
}
_ORDERED_DICT = ("collections.OrderedDict", "builtins.dict", "typing.OrderedDict")
_GETATTR = "builtins.getattr"
_SETATTR = "builtins.setattr"


@dataclasses.dataclass
class _Site:
    """Where a value ends up: the attribute of self and the path below it."""

    attribute: str
    path: str
    conditional: bool
    container: str | None = None


def _string_value(node: cst.BaseExpression) -> str | None:
    if isinstance(node, cst.SimpleString):
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    return None


class ModuleScanner:
    def __init__(
        self,
        tree: cst.Module,
        wrapper: md.MetadataWrapper,
        names: Mapping[cst.CSTNode, Collection[md.QualifiedName]],
        absolute: bool,
        filename: str,
        module: str | None,
        package: str | None,
    ) -> None:
        self.tree = tree
        self.wrapper = wrapper
        self.global_scope = wrapper.resolve(md.ScopeProvider)[wrapper.module]
        self.filename = filename
        self.module = module
        self.package = package
        self.names = names
        # QualifiedNameProvider gives local names without the module: add it so both providers agree
        self.local_prefix = "" if absolute else (module or "__scanned__") + "."
        self.positions = wrapper.resolve(md.PositionProvider)
        self.module_prefix = (module or "__scanned__") + "."
        self.layer_names: dict[str, tuple[LayerSpec, bool]] = {}
        for spec in specs():
            for qualname in spec.qualnames:
                self.layer_names[qualname] = (spec, False)
            self.layer_names[f"loragen.{spec.lora_name}"] = (spec, True)
            self.layer_names[f"loragen.layers.{spec.lora_name}"] = (spec, True)
        self.short_layer_names = {q.rpartition(".")[2] for q in self.layer_names}
        # qualified name -> ClassDef / FunctionDef, with Python-style qualnames ("f.<locals>.C")
        self.class_defs: dict[str, cst.ClassDef] = {}
        self.function_defs: dict[str, cst.FunctionDef] = {}
        self.stubs: dict[int, cst.FunctionDef] = {}
        self.claimed: set[int] = set()
        self.calls: dict[int, list[LayerField]] = {}
        self.call_nodes: dict[int, cst.Call] = {}
        self.unresolved: list[Unresolved] = []
        self.star_imports: list[str] = []

    # -- helpers ---------------------------------------------------------------------------------

    def loc(self, node: cst.CSTNode, within: cst.FunctionDef | None = None) -> SourceLocation:
        """Position of ``node``; ``within`` is the enclosing function when its body was stubbed."""
        pos = self.positions.get(node)
        if pos is None and within is not None:
            return self._loc_in_stubbed(node, within)
        if pos is None:
            return SourceLocation(self.filename, 1, 0)
        return SourceLocation(self.filename, pos.start.line, pos.start.column)

    def _loc_in_stubbed(self, node: cst.CSTNode, func: cst.FunctionDef) -> SourceLocation:
        stub = self.stubs.get(id(func))
        if stub is None or stub not in self.positions:
            return SourceLocation(self.filename, 1, 0)
        mini = md.MetadataWrapper(cst.Module(body=[func]), unsafe_skip_copy=True).resolve(md.PositionProvider)
        offset = mini[node].start.line - mini[func].start.line
        return SourceLocation(
            self.filename, self.positions[stub].start.line + offset, mini[node].start.column
        )

    def qualnames(self, node: cst.CSTNode) -> set[str]:
        found = self.names.get(node)
        if found is None:  # in a stubbed body: resolve the dotted name at module level
            dotted = _dotted_name(node)
            found = self.global_scope.get_qualified_names_for(dotted) if dotted else ()
            return {self._normalise(q, relative=True) for q in found}
        if callable(found):  # QualifiedNameProvider computes lazily
            found = found()
        return {self._normalise(q, relative=False) for q in found}

    def _normalise(self, q: md.QualifiedName, relative: bool) -> str:
        if q.source is md.QualifiedNameSource.LOCAL:
            return (self.module_prefix if relative else self.local_prefix) + q.name
        if relative and q.name.startswith(".") and self.package is not None:
            level = len(q.name) - len(q.name.lstrip("."))
            absolute = absolute_module(self.package, level, q.name.lstrip("."))
            return absolute or q.name
        return q.name

    def layer_spec(self, call: cst.Call) -> tuple[LayerSpec, bool, str] | None:
        for name in sorted(self.qualnames(call.func)):
            hit = self.layer_names.get(name)
            if hit is not None:
                return hit[0], hit[1], name
        return None

    def container_kind(self, call: cst.Call) -> str | None:
        names = self.qualnames(call.func)
        for kind, qualnames in _CONTAINERS.items():
            if names & set(qualnames):
                return kind
        return None

    def local_class(self, node: cst.CSTNode) -> str | None:
        for name in self.qualnames(node):
            if name.startswith(self.module_prefix) and name[len(self.module_prefix) :] in self.class_defs:
                return name[len(self.module_prefix) :]
        return None

    def local_function(self, node: cst.CSTNode) -> str | None:
        for name in self.qualnames(node):
            if name.startswith(self.module_prefix) and name[len(self.module_prefix) :] in self.function_defs:
                return name[len(self.module_prefix) :]
        return None

    # -- driver ----------------------------------------------------------------------------------

    def run(self) -> ScannedModule:
        self._index(self.wrapper.module.body, "")
        self._index_functions(self.tree.body, "")
        classes = [self._scan_class(name, node) for name, node in self.class_defs.items()]
        self._report_unclaimed()
        self.unresolved.sort(key=lambda u: (u.location.line, u.location.column))
        result = ScanResult(self.filename, self.module, tuple(classes), tuple(self.unresolved))
        return ScannedModule(self.tree, result, self.calls, self.call_nodes)

    def _index(self, body: Sequence[cst.CSTNode], prefix: str) -> None:
        """Classes of the skeleton by qualified name (``f.<locals>.C`` as Python spells it), star imports."""
        for stmt in body:
            if isinstance(stmt, cst.ClassDef):
                qualname = prefix + stmt.name.value
                self.class_defs[qualname] = stmt
                self._index(stmt.body.body, qualname + ".")
            elif isinstance(stmt, cst.FunctionDef):
                self._index(stmt.body.body, prefix + stmt.name.value + ".<locals>.")
            elif isinstance(stmt, (cst.If, cst.Try, cst.With, cst.For, cst.While)):
                self._index(_compound_bodies(stmt), prefix)
            elif isinstance(stmt, cst.SimpleStatementLine):
                for small in stmt.body:
                    if isinstance(small, cst.ImportFrom) and isinstance(small.names, cst.ImportStar):
                        self.star_imports.append(_code(small.module) if small.module else ".")

    def _index_functions(self, body: Sequence[cst.CSTNode], prefix: str) -> None:
        for stmt in body:
            if isinstance(stmt, cst.ClassDef):
                self._index_functions(stmt.body.body, prefix + stmt.name.value + ".")
            elif isinstance(stmt, cst.FunctionDef):
                self.function_defs[prefix + stmt.name.value] = stmt
                self._index_functions(stmt.body.body, prefix + stmt.name.value + ".<locals>.")
            elif isinstance(stmt, (cst.If, cst.Try, cst.With, cst.For, cst.While)):
                self._index_functions(_compound_bodies(stmt), prefix)

    # -- one class -------------------------------------------------------------------------------

    def _scan_class(self, name: str, node: cst.ClassDef) -> ClassScan:
        state = _ClassState(self, name)
        init = next(
            (s for s in node.body.body if isinstance(s, cst.FunctionDef) and s.name.value == "__init__"), None
        )
        if init is not None:
            state.scan_init(init)
        local_bases = tuple(filter(None, (self.local_class(b.value) for b in node.bases)))
        base_names = tuple(sorted({q for b in node.bases for q in self.qualnames(b.value)}))
        return ClassScan(
            output_head=_output_head(node),
            name=name,
            location=self.loc(node),
            local_bases=local_bases,
            base_names=base_names,
            fields=tuple(state.fields),
            submodules=tuple(state.submodules),
            unresolved=tuple(state.unresolved),
            has_init=init is not None,
        )

    def _report_unclaimed(self) -> None:
        """Every layer constructor call that no field could be followed to is reported."""
        scanner = self

        class Finder(cst.CSTVisitor):
            def __init__(self) -> None:
                self.scopes: list[str] = []
                self.functions: list[cst.FunctionDef] = []

            def visit_ClassDef(self, node: cst.ClassDef) -> None:
                self.scopes.append(f"class {node.name.value}")

            def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
                self.scopes.pop()

            def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
                self.scopes.append(f"{node.name.value}()")
                self.functions.append(node)

            def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
                self.scopes.pop()
                self.functions.pop()

            def where(self, node: cst.CSTNode) -> SourceLocation:
                stubbed = next((f for f in self.functions if id(f) in scanner.stubs), None)
                return scanner.loc(node, stubbed)

            def visit_Call(self, node: cst.Call) -> None:
                if id(node) in scanner.claimed:
                    return
                hit = scanner.layer_spec(node)
                where = " in " + ".".join(self.scopes) if self.scopes else " at module level"
                if hit is not None:
                    scanner.claimed.add(id(node))
                    scanner.unresolved.append(
                        Unresolved(
                            None,
                            None,
                            self.where(node),
                            f"{_code(node.func)}(...){where} is not assigned to a module field the scanner "
                            "can follow; not converted",
                        )
                    )
                elif isinstance(node.func, (cst.Name, cst.Attribute)) and any(
                    n.startswith(".") and n.rpartition(".")[2] in scanner.short_layer_names
                    for n in scanner.qualnames(node.func)
                ):
                    scanner.unresolved.append(
                        Unresolved(
                            None,
                            None,
                            self.where(node),
                            f"{_code(node.func)} comes from a relative import that cannot be resolved without "
                            "the module's package (pass package=...); not converted",
                        )
                    )
                elif (
                    scanner.star_imports
                    and isinstance(node.func, cst.Name)
                    and node.func.value in scanner.short_layer_names
                    and not scanner.qualnames(node.func) - {scanner.module_prefix + node.func.value}
                ):
                    scanner.unresolved.append(
                        Unresolved(
                            None,
                            None,
                            self.where(node),
                            f"{node.func.value}(...){where} may come from a star import "
                            f"(from {', '.join(scanner.star_imports)} import *); import it by name to convert it",
                        )
                    )

        self.tree.visit(Finder())


def _compound_bodies(stmt: cst.CSTNode) -> list[cst.CSTNode]:
    """The statements nested in an if/try/with/for/while, all branches."""
    out: list[cst.CSTNode] = []
    blocks: list[cst.BaseSuite] = []
    if isinstance(stmt, cst.If):
        blocks.append(stmt.body)
        orelse = stmt.orelse
        while orelse is not None:
            blocks.append(orelse.body)
            orelse = orelse.orelse if isinstance(orelse, cst.If) else None
    elif isinstance(stmt, cst.Try):
        blocks.append(stmt.body)
        blocks.extend(h.body for h in stmt.handlers)
        if stmt.orelse is not None:
            blocks.append(stmt.orelse.body)
        if stmt.finalbody is not None:
            blocks.append(stmt.finalbody.body)
    elif isinstance(stmt, (cst.With, cst.For, cst.While)):
        blocks.append(stmt.body)
        if getattr(stmt, "orelse", None) is not None:
            blocks.append(stmt.orelse.body)
    for block in blocks:
        if isinstance(block, cst.IndentedBlock):
            out.extend(block.body)
        else:  # SimpleStatementSuite: `if x: a = 1`
            out.append(cst.SimpleStatementLine(body=block.body))
    return out


class _ClassState:
    """Walks one ``__init__`` and collects fields, submodules and what it cannot resolve."""

    def __init__(self, scanner: ModuleScanner, owner: str) -> None:
        self.s = scanner
        self.owner = owner
        self.fields: list[LayerField] = []
        self.submodules: list[SubmoduleField] = []
        self.unresolved: list[Unresolved] = []
        self.self_name = "self"
        self.params: set[str] = set()
        self.locals: dict[str, list[tuple[cst.BaseExpression, bool]]] = {}
        self.following: set[str] = set()

    def report(self, node: cst.CSTNode, attribute: str | None, reason: str) -> None:
        item = Unresolved(self.owner, attribute, self.s.loc(node), reason)
        self.unresolved.append(item)
        self.s.unresolved.append(item)

    # -- statements ------------------------------------------------------------------------------

    def scan_init(self, init: cst.FunctionDef) -> None:
        params = init.params
        positional = [*params.posonly_params, *params.params]
        if positional:
            self.self_name = positional[0].name.value
        for p in [*positional, *params.kwonly_params]:
            self.params.add(p.name.value)
        for p in (params.star_arg, params.star_kwarg):
            if isinstance(p, cst.Param):
                self.params.add(p.name.value)
        self.params.discard(self.self_name)
        self.statements(init.body.body, conditional=False)

    def statements(self, body: Sequence[cst.CSTNode], conditional: bool) -> None:
        for stmt in body:
            if isinstance(stmt, cst.SimpleStatementLine):
                for small in stmt.body:
                    self.small_statement(small, conditional)
            elif isinstance(stmt, cst.If):
                self.statements(_compound_bodies(stmt), True)
            elif isinstance(stmt, (cst.Try, cst.For, cst.While, cst.Match)):
                nested = (
                    _compound_bodies(stmt)
                    if not isinstance(stmt, cst.Match)
                    else [s for case in stmt.cases for s in _compound_bodies_of_case(case)]
                )
                self.statements(nested, True)
            elif isinstance(stmt, cst.With):
                self.statements(_compound_bodies(stmt), conditional)
            # nested def/class inside __init__: their layer calls are reported as unclaimed

    def is_self_attr(self, node: cst.BaseExpression) -> str | None:
        if (
            isinstance(node, cst.Attribute)
            and isinstance(node.value, cst.Name)
            and node.value.value == self.self_name
        ):
            return node.attr.value
        return None

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
            self.value(value, _Site(attribute, attribute, conditional))
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
                self._builds_layer(value) or self._calls_layer_helper(value)
            ):
                self.report(value, None, f"tuple assignment from {_code(value)!s:.60} cannot be followed")
            return
        if isinstance(target, cst.Subscript):
            attribute = self.is_self_attr(target.value)
            if attribute is not None and len(target.slice) == 1:
                index = target.slice[0].slice
                key = None
                if isinstance(index, cst.Index):
                    key = _string_value(index.value)
                    if key is None and isinstance(index.value, cst.Integer):
                        key = index.value.value
                if key is None:
                    self.value(value, _Site(attribute, f"{attribute}.{{key}}", conditional, "ModuleDict"))
                else:
                    self.value(value, _Site(attribute, f"{attribute}.{key}", conditional, "ModuleDict"))

    def call_statement(self, call: cst.Call, conditional: bool) -> None:
        func = call.func
        # self.x.append(...), self.x.extend([...])
        if isinstance(func, cst.Attribute) and func.attr.value in ("append", "extend", "insert"):
            attribute = self.is_self_attr(func.value)
            if attribute is not None and call.args:
                site = _Site(attribute, f"{attribute}.{{i}}", conditional, "ModuleList")
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
        elif _SETATTR in self.s.qualnames(func) and len(call.args) == 3 and is_self(call.args[0].value):
            name_arg, value_arg = call.args[1].value, call.args[2].value
        if value_arg is None or name_arg is None:
            return
        name = _string_value(name_arg)
        if name is None:
            self.report(
                call,
                None,
                f"{_code(func)}() with an attribute name computed at run time ({_code(name_arg)}); "
                "its module path cannot be known statically",
            )
            return
        self.value(value_arg, _Site(name, name, conditional))

    # -- values ----------------------------------------------------------------------------------

    def value(self, node: cst.BaseExpression, site: _Site) -> None:
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
        hit = self.s.layer_spec(node)
        if hit is not None:
            spec, is_lora, _ = hit
            field = LayerField(
                owner=self.owner,
                attribute=site.attribute,
                path=site.path,
                layer=spec.base_qualname,
                lora_name=spec.lora_name,
                location=self.s.loc(node),
                conditional=site.conditional,
                container=site.container,
                is_lora=is_lora,
            )
            self.fields.append(field)
            self.s.claimed.add(id(node))
            self.s.calls.setdefault(id(node), []).append(field)
            self.s.call_nodes[id(node)] = node
            return
        kind = self.s.container_kind(node)
        if kind is not None:
            self.container(node, kind, site)
            return
        self.other_call(node, site)

    def container(self, call: cst.Call, kind: str, site: _Site) -> None:
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
            if not isinstance(inner, cst.Call) or self.s.qualnames(inner.func) & set(_ORDERED_DICT):
                self.mapping(inner, site, kind)
                return
        for index, arg in enumerate(positional):
            if arg.star:
                self.items(arg.value, dataclasses.replace(site, path=f"{site.path}.{{i}}", container=kind))
                if any(self._builds_layer(a.value) for a in positional[index + 1 :]):
                    self.report(
                        arg.value,
                        site.attribute,
                        f"items after *{_code(arg.value)} in {kind} have indices known only at run time",
                    )
                return
            self.value(arg.value, dataclasses.replace(site, path=f"{site.path}.{index}", container=kind))

    def items(self, node: cst.BaseExpression, site: _Site) -> None:
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
        elif self._builds_layer(node):
            self.report(
                node,
                site.attribute,
                f"the items of {site.attribute} come from {_code(node)!s:.60}; cannot follow them statically",
            )

    def mapping(self, node: cst.BaseExpression, site: _Site, kind: str) -> None:
        """A dict-like value (dict literal, comprehension, OrderedDict([...]), list of pairs)."""
        if isinstance(node, cst.Call) and node.args:
            if all(a.keyword is not None for a in node.args):  # dict(a=..., b=...)
                for a in node.args:
                    self.value(
                        a.value,
                        dataclasses.replace(site, path=f"{site.path}.{a.keyword.value}", container=kind),
                    )
                return
            node = node.args[0].value
        if isinstance(node, cst.Dict):
            for element in node.elements:
                if isinstance(element, cst.DictElement):
                    key = _string_value(element.key)
                    path = f"{site.path}.{key}" if key is not None else f"{site.path}.{{key}}"
                    self.value(element.value, dataclasses.replace(site, path=path, container=kind))
        elif isinstance(node, cst.DictComp):
            self.value(node.value, dataclasses.replace(site, path=f"{site.path}.{{key}}", container=kind))
        elif isinstance(node, (cst.List, cst.Tuple)):
            for element in node.elements:
                pair = element.value
                if isinstance(pair, (cst.Tuple, cst.List)) and len(pair.elements) == 2:
                    key = _string_value(pair.elements[0].value)
                    path = f"{site.path}.{key}" if key is not None else f"{site.path}.{{key}}"
                    self.value(pair.elements[1].value, dataclasses.replace(site, path=path, container=kind))
        elif isinstance(node, (cst.ListComp, cst.GeneratorExp)):
            pair = node.elt
            if isinstance(pair, (cst.Tuple, cst.List)) and len(pair.elements) == 2:
                self.value(
                    pair.elements[1].value,
                    dataclasses.replace(site, path=f"{site.path}.{{key}}", container=kind),
                )
        elif self._builds_layer(node):
            self.report(
                node,
                site.attribute,
                f"the entries of {site.attribute} come from {_code(node)!s:.60}; "
                "cannot follow them statically",
            )

    def other_call(self, call: cst.Call, site: _Site) -> None:
        """A call that is neither a layer nor a container: a submodule, a factory, or unrelated."""
        func = call.func
        names = self.s.qualnames(func)
        local = self.s.local_class(func)
        if local is not None:
            self.submodules.append(
                SubmoduleField(
                    self.owner, site.attribute, site.path, local, self.s.loc(call), local, site.conditional
                )
            )
            return
        if isinstance(func, cst.Call) and _GETATTR in self.s.qualnames(func.func):
            self.report(
                call,
                site.attribute,
                f"{site.path} is built by {_code(func)}(...); a constructor looked up "
                "with getattr is known only at run time",
            )
            return
        if isinstance(func, cst.Name) and func.value in self.locals and func.value not in self.params:
            classes = self.alias_classes(func.value)
            if classes is not None:  # attention_class = CrossAttention if cross else SelfAttention
                for local in classes:
                    self.submodules.append(
                        SubmoduleField(
                            self.owner, site.attribute, site.path, local, self.s.loc(call), local, True
                        )
                    )
                return
        if isinstance(func, cst.Name) and (func.value in self.params or func.value in self.locals):
            what = "a parameter of __init__" if func.value in self.params else "a local variable"
            self.report(
                call,
                site.attribute,
                f"{site.path} is built by {func.value}(...), {what}; its type is known only at run time",
            )
            return
        if self._calls_layer_helper(call):
            self.report(
                call,
                site.attribute,
                f"{site.path} is built by the helper {_code(func)}(...), which "
                "constructs layers; move the constructor into __init__ to convert it",
            )
            return
        external = sorted(n for n in names if not n.startswith(self.s.module_prefix))
        if external and _looks_like_class(external[0]):
            self.submodules.append(
                SubmoduleField(
                    self.owner,
                    site.attribute,
                    site.path,
                    external[0],
                    self.s.loc(call),
                    None,
                    site.conditional,
                )
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
            local = self.s.local_class(node) if isinstance(node, (cst.Name, cst.Attribute)) else None
            if local is None:
                return None
            found.append(local)
        return list(dict.fromkeys(found)) or None

    def _calls_layer_helper(self, node: cst.BaseExpression) -> bool:
        if not isinstance(node, cst.Call):
            return False
        helper = self.s.local_function(node.func)
        method = self.is_self_attr(node.func)
        if method is not None and f"{self.owner}.{method}" in self.s.function_defs:
            helper = f"{self.owner}.{method}"
        return helper is not None and self._builds_layer(self.s.function_defs[helper])

    def _builds_layer(self, node: cst.CSTNode) -> bool:
        return any(self.s.layer_spec(c) is not None for c in _calls_in(node))


def _dotted_name(node: cst.CSTNode) -> str | None:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = _dotted_name(node.value)
        return None if base is None else f"{base}.{node.attr.value}"
    return None


def _output_head(node: cst.ClassDef) -> tuple[str, ...] | None:
    method = next(
        (
            s
            for s in node.body.body
            if isinstance(s, cst.FunctionDef) and s.name.value == "get_output_embeddings"
        ),
        None,
    )
    if method is None:
        return None
    returns = [r for r in _nodes_of(method, cst.Return)]
    if len(returns) != 1 or returns[0].value is None:
        return ()
    parts: list[str] = []
    value: cst.BaseExpression = returns[0].value
    while isinstance(value, cst.Attribute):
        parts.append(value.attr.value)
        value = value.value
    if isinstance(value, cst.Name) and value.value == "self" and parts:
        return (".".join(reversed(parts)),)
    return ()


def _nodes_of(node: cst.CSTNode, kind: type[cst.CSTNode]) -> list:
    found: list[cst.CSTNode] = []

    class Collect(cst.CSTVisitor):
        def on_visit(self, child: cst.CSTNode) -> bool:
            if isinstance(child, kind):
                found.append(child)
            return True

    node.visit(Collect())
    return found


def _compound_bodies_of_case(case: cst.MatchCase) -> list[cst.CSTNode]:
    body = case.body
    return (
        list(body.body) if isinstance(body, cst.IndentedBlock) else [cst.SimpleStatementLine(body=body.body)]
    )


def _looks_like_class(qualname: str) -> bool:
    last = qualname.rpartition(".")[2]
    return bool(last) and last[0].isupper()


def _calls_in(node: cst.CSTNode) -> Iterator[cst.Call]:
    found: list[cst.Call] = []

    class Collect(cst.CSTVisitor):
        def visit_Call(self, call: cst.Call) -> None:
            found.append(call)

    node.visit(Collect())
    return iter(found)
