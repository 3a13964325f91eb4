"""Name resolution for the scanner: what a name in a module denotes, and where a node is.

:class:`Resolver` answers, for a parsed module, the qualified names a ``Name`` / ``Attribute`` denotes
(``nn.Linear``, ``torch.nn.Linear`` and ``from torch.nn import Linear as L`` all give
``torch.nn.Linear``), which registered layer type a constructor call builds (read from
:mod:`loragen.registry`), the classes and functions the module defines, and ``file:line`` positions, also
inside function bodies that the skeleton stubbed out (:mod:`loragen.source.parse`).

Node identity: the scanner and the rewriter key what they find by the tree's node objects (positions,
scopes, the calls found, the planner's edits), which hash and compare by identity. libcst's metadata
wrapper deep-copies the tree it is given unless told ``unsafe_skip_copy=True``; a copy would make every
lookup miss, so the wrapper here never copies, and the kept bodies of the skeleton are the full tree's own
nodes. A test holds the scan's calls and positions to the full tree's nodes.

The module also finds what a rewrite bound at module level: sub-models built by transformers' auto classes
(``AutoModel.from_config(...)`` in ``__init__``) and the LoRA classes of the file's own layer subclasses.
Composite models (Gemma 3, Qwen3-VL, LLaVA, InternVL, Voxtral, ...) build their vision, audio and text
sub-models with ``AutoModel.from_config(config.text_config)``, which returns transformers' own classes: a
rewrite that only swaps constructor calls would leave them without LoRA layers. The scanner reports each such
call as a :class:`~loragen.source.fields.FactoryCall`; the rewrite makes it build through a LoRA auto class
bound once at module level (see :mod:`loragen.source.composite` for what it does at run time)::

    LoraAutoModel = lora_auto_class(AutoModel, [Gemma3TextModel], LORA_CONFIG)
    ...
            self.language_model = LoraAutoModel.from_config(config.text_config)

A second scan recognises ``LoraAutoModel.from_config(...)`` as already rewritten.

Layer subclasses defined in the scanned file, and the names bound to their LoRA classes: a class of the file that derives from a registered layer type accepting subclasses (``nn.Linear``), directly
or through other classes of the file, is a layer type too: Falcon's ``class FalconLinear(nn.Linear)``. Its
constructor calls are layer fields like ``nn.Linear(...)`` calls, and its LoRA class is the one
:func:`loragen.layers.lora_class_for` derives from it (its own ``forward`` computes the base output). A
rewritten file binds that class at module level, right after the subclass::

    LoraFalconLinear = lora_class_for(FalconLinear)

and a second scan recognises ``LoraFalconLinear(...)`` calls as already rewritten. Only classes defined at the
module's top level count (a nested class cannot get such a module-level line).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import libcst as cst
import libcst.metadata as md
from libcst.metadata import CodeRange

from loragen.errors import ScanError
from loragen.source.fields import SourceLocation
from loragen.source.layer_types import LayerType, layer_types
from loragen.source.parse import SourcePositions, without_signatures
from loragen.source.syntax import absolute_module, class_definitions, code_of, dotted_name, nested_statements

__all__ = [
    "AUTO_METHODS",
    "AutoFactory",
    "CONTAINERS",
    "LORA_AUTO_CLASS",
    "LORA_CLASS_FOR",
    "LORA_CLASS_FOR_NAMES",
    "LayerMatch",
    "Resolver",
    "auto_bindings",
    "auto_factory",
    "derived_lora_name",
    "layer_subclasses",
    "lora_auto_name",
    "lora_bindings",
]

CONTAINERS = {
    "ModuleList": ("torch.nn.ModuleList", "torch.nn.modules.container.ModuleList"),
    "Sequential": ("torch.nn.Sequential", "torch.nn.modules.container.Sequential"),
    "ModuleDict": ("torch.nn.ModuleDict", "torch.nn.modules.container.ModuleDict"),
}
_COMPOUND = (cst.If, cst.Try, cst.With, cst.For, cst.While, cst.Match)


class LayerMatch(NamedTuple):
    """What a constructor call builds: the registered type's spec, whether the call builds the LoRA class
    already, and for a layer subclass defined in the file its name and the name of its LoRA class."""

    spec: LayerType
    is_lora: bool
    subclass: str | None = None
    lora_name: str | None = None


def _layer_names() -> dict[str, tuple[LayerType, bool]]:
    """Every qualified name a registered base type or its LoRA class is reachable under."""
    names: dict[str, tuple[LayerType, bool]] = {}
    for spec in layer_types().all:
        for qualname in spec.qualnames:
            names[qualname] = (spec, False)
        names[spec.lora_qualname] = (spec, True)
        if spec.lora_module.startswith("loragen."):
            names[f"loragen.{spec.lora_name}"] = (spec, True)  # ``from loragen import LoraLinear``
    return names


class Resolver:
    """Names, definitions and positions of one parsed module (see the module docstring).

    Args:
        tree: the full module; ``skeleton`` / ``stubs`` / ``hidden``: its skeleton, stubbed functions and
            wholly stubbed ones (as :func:`~loragen.source.parse.skeleton` gives them).
        filename: for locations. ``module``: the module's dotted name (None: ``__scanned__``).
        package: the module's package, to resolve relative imports (None: keep them relative).
    """

    def __init__(
        self,
        tree: cst.Module,
        skeleton: cst.Module,
        stubs: dict[cst.FunctionDef, cst.FunctionDef],
        filename: str,
        module: str | None,
        package: str | None,
        hidden: Mapping[cst.FunctionDef, str] | None = None,
    ) -> None:
        self.tree = tree
        self.stubs = stubs
        self.filename = filename
        self.package = package
        self.module_prefix = (module or "__scanned__") + "."
        self._qualnames: dict[cst.CSTNode, frozenset[str]] = {}
        # The scopes give a node's qualified names on demand (what QualifiedNameProvider and
        # FullyQualifiedNameProvider wrap, at the cost of a whole-tree pass each); ``_normalise`` makes
        # local names and relative imports absolute as the latter would.
        stubbed = {stubs[function] for function in hidden or ()}
        scoped = without_signatures(skeleton, stubbed)
        wrapper = md.MetadataWrapper(scoped, unsafe_skip_copy=True)  # node identity: see module docstring
        self.scopes: Mapping[cst.CSTNode, md.Scope | None] = wrapper.resolve(md.ScopeProvider)
        self.positions: Mapping[cst.CSTNode, CodeRange] = SourcePositions(skeleton)
        scope = self.scopes[wrapper.module]
        if scope is None:  # libcst gives every module a global scope
            raise ScanError("libcst found no module scope", filename=filename, line=1)
        self.global_scope = scope
        self.skeleton = skeleton
        self.layer_names = _layer_names()
        self.short_layer_names = {q.rpartition(".")[2] for q in self.layer_names}
        # qualified name -> ClassDef / FunctionDef, with Python-style qualnames ("f.<locals>.C")
        self.class_defs = class_definitions(self.skeleton.body)
        self.function_defs: dict[str, cst.FunctionDef] = {}
        # the file's own layer subclasses (FalconLinear -> nn.Linear's spec) and the names bound to their
        # LoRA classes (LoraFalconLinear -> FalconLinear), see loragen.source.names
        top_level = {s.name.value: s for s in self.skeleton.body if isinstance(s, cst.ClassDef)}
        self.layer_subclasses = layer_subclasses(
            top_level, self.layer_names, self.qualnames, self.local_class
        )
        self.lora_bindings = lora_bindings(list(self.skeleton.body), self.layer_subclasses, self.qualnames)
        self.auto_bindings = auto_bindings(list(self.skeleton.body), self.qualnames)
        self.star_imports: list[str] = []
        self._index_star_imports(self.skeleton.body)
        self._index_functions(tree.body, "")

    # ---- definitions ---------------------------------------------------------------------------------

    def _index_star_imports(self, body: Sequence[cst.CSTNode]) -> None:
        """``from x import *`` at module level (also inside ``if`` / ``try``: Python allows no others)."""
        for stmt in body:
            if isinstance(stmt, _COMPOUND):
                self._index_star_imports(nested_statements(stmt))
            elif isinstance(stmt, cst.SimpleStatementLine):
                for small in stmt.body:
                    if isinstance(small, cst.ImportFrom) and isinstance(small.names, cst.ImportStar):
                        self.star_imports.append(code_of(small.module) if small.module else ".")

    def _index_functions(self, body: Sequence[cst.CSTNode], prefix: str) -> None:
        """Functions and methods of the full tree (their bodies intact) by qualified name."""
        for stmt in body:
            if isinstance(stmt, cst.ClassDef):
                self._index_functions(stmt.body.body, prefix + stmt.name.value + ".")
            elif isinstance(stmt, cst.FunctionDef):
                self.function_defs[prefix + stmt.name.value] = stmt
                self._index_functions(stmt.body.body, prefix + stmt.name.value + ".<locals>.")
            elif isinstance(stmt, _COMPOUND):
                self._index_functions(nested_statements(stmt), prefix)

    def local_class(self, node: cst.CSTNode) -> str | None:
        """The qualified name (in this module) of the class ``node`` denotes when the module defines it."""
        return self._local(node, self.class_defs)

    def local_function(self, node: cst.CSTNode) -> str | None:
        """The qualified name of the function ``node`` denotes when the module defines it."""
        return self._local(node, self.function_defs)

    def _local(self, node: cst.CSTNode, defs: Mapping[str, object]) -> str | None:
        for name in self.qualnames(node):
            if name.startswith(self.module_prefix) and name[len(self.module_prefix) :] in defs:
                return name[len(self.module_prefix) :]
        return None

    # ---- names -----------------------------------------------------------------------------------------

    def qualnames(self, node: cst.CSTNode) -> set[str]:
        """The absolute qualified names ``node`` may denote (relative ones when no package is known).

        Remembered per node: the scan asks about a call's callee several times (layer, container, factory,
        submodule), and libcst's scope lookup is its costliest step."""
        found = self._qualnames.get(node)
        if found is None:
            found = self._qualnames[node] = self._lookup(node)
        return set(found)

    def _lookup(self, node: cst.CSTNode) -> frozenset[str]:
        scope = self.scopes.get(node)
        if scope is None:  # in a stubbed body: resolve the dotted name at module level
            dotted = dotted_name(node)
            at_top = self.global_scope.get_qualified_names_for(dotted) if dotted else ()
            return frozenset(self._normalise(q) for q in at_top)
        return frozenset(self._normalise(q) for q in scope.get_qualified_names_for(node))

    def _normalise(self, q: md.QualifiedName) -> str:
        """``q`` as an absolute name: a local name gets the module's, a relative import the package's."""
        if q.source is md.QualifiedNameSource.LOCAL:
            return self.module_prefix + q.name
        if q.name.startswith(".") and self.package is not None:
            level = len(q.name) - len(q.name.lstrip("."))
            return absolute_module(self.package, level, q.name.lstrip(".")) or q.name
        return q.name

    def lora_name_for(self, subclass: str) -> str:
        """The name the file binds ``subclass``'s LoRA class to: its existing binding, or ``Lora<subclass>``."""
        bound = sorted(name for name, sub in self.lora_bindings.items() if sub == subclass)
        return bound[0] if bound else derived_lora_name(subclass)

    def layer(self, call: cst.Call) -> LayerMatch | None:
        """The registered layer type ``call`` constructs (and whether it is already the LoRA class)."""
        subclass = self._local(call.func, self.layer_subclasses)
        if subclass is not None:
            return LayerMatch(self.layer_subclasses[subclass], False, subclass, self.lora_name_for(subclass))
        bound = self._local(call.func, self.lora_bindings)
        if bound is not None:
            subclass = self.lora_bindings[bound]
            return LayerMatch(self.layer_subclasses[subclass], True, subclass, bound)
        for name in sorted(self.qualnames(call.func)):
            hit = self.layer_names.get(name)
            if hit is not None:
                return LayerMatch(*hit)
        return None

    def auto_factory(self, call: cst.Call) -> AutoFactory | None:
        """``(auto class, already LoRA)`` when ``call`` builds a sub-model with a transformers auto class."""
        return auto_factory(call, self.qualnames, self._local, self.auto_bindings)

    def container_kind(self, call: cst.Call) -> str | None:
        """``"ModuleList"``, ``"Sequential"`` or ``"ModuleDict"`` when ``call`` builds one."""
        names = self.qualnames(call.func)
        return next((kind for kind, qualnames in CONTAINERS.items() if names & set(qualnames)), None)

    # ---- positions -------------------------------------------------------------------------------------

    def loc(self, node: cst.CSTNode, within: cst.FunctionDef | None = None) -> SourceLocation:
        """Position of ``node``; ``within`` is the enclosing function when its body was stubbed."""
        pos = self.positions.get(node)
        if pos is None and within is not None:
            return self._loc_in_stubbed(node, within)
        if pos is None:
            return SourceLocation(self.filename, 1, 0)
        return SourceLocation(self.filename, pos.start.line, pos.start.column)

    def _loc_in_stubbed(self, node: cst.CSTNode, func: cst.FunctionDef) -> SourceLocation:
        stub = self.stubs.get(func)
        if stub is None or stub not in self.positions:
            return SourceLocation(self.filename, 1, 0)
        mini = SourcePositions(cst.Module(body=[func]))
        offset = mini[node].start.line - mini[func].start.line
        return SourceLocation(
            self.filename, self.positions[stub].start.line + offset, mini[node].start.column
        )


AUTO_METHODS = ("from_config",)
LORA_AUTO_CLASS = ("loragen.source.composite", "lora_auto_class")  # where a rewritten file imports it from
_LORA_AUTO_CLASS_NAMES = frozenset({".".join(LORA_AUTO_CLASS), "loragen.lora_auto_class"})
# transformers.AutoModel, transformers.models.auto.modeling_auto.AutoModelForCausalLM, ..auto.AutoModel
_AUTO_CLASS = re.compile(r"^(transformers\.|\.)([\w.]*\.)?Auto[A-Z]\w*$")

# (the auto class's spelling in the file, whether the call goes through the file's LoRA auto class already)
AutoFactory = tuple[str, bool]
Qualnames = Callable[[cst.CSTNode], set[str]]
LocalName = Callable[[cst.CSTNode, Mapping[str, object]], "str | None"]


def lora_auto_name(auto_spelling: str) -> str:
    """The name a rewrite binds the LoRA auto class to: ``AutoModel`` -> ``LoraAutoModel``."""
    return "Lora" + auto_spelling.rpartition(".")[2]


def auto_bindings(body: list[cst.CSTNode], qualnames: Qualnames) -> dict[str, str]:
    """Module-level ``Name = lora_auto_class(AutoX, ...)`` lines (a previous rewrite's): name -> ``AutoX`` as
    the file spells it."""
    found: dict[str, str] = {}
    for stmt in body:
        if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
            continue
        small = stmt.body[0]
        if not (
            isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.value, cst.Call)
        ):
            continue
        target, value = small.targets[0].target, small.value
        if isinstance(target, cst.Name) and value.args and qualnames(value.func) & _LORA_AUTO_CLASS_NAMES:
            found[target.value] = code_of(value.args[0].value)
    return found


def auto_factory(
    call: cst.Call, qualnames: Qualnames, local_name: LocalName, bindings: Mapping[str, str]
) -> AutoFactory | None:
    """What ``call`` is when it builds a sub-model through a transformers auto class (``AutoModel.from_config``),
    or None."""
    func = call.func
    if not (isinstance(func, cst.Attribute) and func.attr.value in AUTO_METHODS):
        return None
    bound = local_name(func.value, bindings)
    if bound is not None:
        return bindings[bound], True
    if any(_AUTO_CLASS.match(name) for name in qualnames(func.value)):
        return code_of(func.value), False
    return None


LORA_CLASS_FOR = ("loragen.layers", "lora_class_for")  # where a rewritten file imports it from
LORA_CLASS_FOR_NAMES = frozenset(
    {"loragen.layers.lora_class_for", "loragen.layers.derived.lora_class_for", "loragen.lora_class_for"}
)

LocalClass = Callable[[cst.CSTNode], "str | None"]


def derived_lora_name(subclass: str) -> str:
    """The name a rewrite binds the LoRA class of ``subclass`` to: ``"LoraFalconLinear"``."""
    return f"Lora{subclass}"


def layer_subclasses(
    class_defs: Mapping[str, cst.ClassDef],
    layer_names: Mapping[str, tuple[LayerType, bool]],
    qualnames: Qualnames,
    local_class: LocalClass,
) -> dict[str, LayerType]:
    """The classes of ``class_defs`` (the file's top-level classes) that are layer types: class name -> the spec
    of the registered base type they derive from (only specs that accept subclasses; LoRA classes do not count)."""
    found: dict[str, LayerType] = {}
    changed = True
    while changed:  # a subclass of a subclass of the file: repeat until nothing new is found
        changed = False
        for name, node in class_defs.items():
            if name in found:
                continue
            for base in node.bases:
                spec = _base_spec(base.value, found, layer_names, qualnames, local_class)
                if spec is not None:
                    found[name] = spec
                    changed = True
                    break
    return found


def _base_spec(
    node: cst.BaseExpression,
    found: Mapping[str, LayerType],
    layer_names: Mapping[str, tuple[LayerType, bool]],
    qualnames: Qualnames,
    local_class: LocalClass,
) -> LayerType | None:
    local = local_class(node)
    if local is not None:
        return found.get(local)
    for name in sorted(qualnames(node)):
        hit = layer_names.get(name)
        if hit is not None and not hit[1] and hit[0].subclasses:
            return hit[0]
    return None


def lora_bindings(
    body: list[cst.CSTNode], subclasses: Mapping[str, LayerType], qualnames: Qualnames
) -> dict[str, str]:
    """Module-level ``Name = lora_class_for(Subclass)`` lines: bound name -> subclass, for the subclasses of
    ``subclasses`` (a previous rewrite's lines)."""
    found: dict[str, str] = {}
    for stmt in body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for small in stmt.body:
            if not (isinstance(small, cst.Assign) and len(small.targets) == 1):
                continue
            target, value = small.targets[0].target, small.value
            if not (isinstance(target, cst.Name) and isinstance(value, cst.Call) and len(value.args) == 1):
                continue
            argument = value.args[0].value
            if (
                qualnames(value.func) & LORA_CLASS_FOR_NAMES
                and isinstance(argument, cst.Name)
                and argument.value in subclasses
            ):
                found[target.value] = argument.value
    return found
