"""The one place a :class:`~loragen.config.LoraConfig`'s matching rules are read: config + model -> plan.

:func:`resolve` interprets the config's target, exclusion, layer, pattern, parameter, bias and task fields
against a model and returns a :class:`LoraPlan` (per module path: layer kind, rank, alpha, scaling and
variant; what else trains; the config the converted model keeps). It raises every error up front and
changes nothing; :mod:`loragen.convert` applies plans. The rules work on :class:`Candidate` descriptions,
so the source rewriter asks :func:`resolve_candidates` the same questions about source text. The functions
at the end answer questions about module paths read from an adapter file. Every pattern field is matched
here, by ``re``, after a check that refuses patterns which backtrack catastrophically (:func:`check_pattern`).

``all-linear`` follows peft 0.21, including on transformers 5 MoE models of the ``mixtral`` /
``qwen2_moe`` conversion families, where it also adapts the fused expert parameters and the router.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import re
import sys
import warnings
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from loragen.config import ALL_LINEAR, BiasMode, InitMode, LoraConfig, LoraConfigWarning, TargetWarning
from loragen.errors import LoraConfigError, LoraConversionError, LoraError

if TYPE_CHECKING:
    from torch import nn

# torch, the registry and the layers are imported only where a live model is described (the rewriter
# runs without torch)

__all__ = [
    "Candidate",
    "PlanEntry",
    "LoraPlan",
    "resolve",
    "resolve_candidates",
    "candidates_of",
    "entry_for",
    "saved_modules",
    "embedding_targeted",
    "targets_parameters_of",
    "fused_expert_parameters",
    "max_rank",
    "check_pattern",
]

_SHOWN = 20
_SHOWN_PARAMETERS = 12

# model_type -> the modules peft adapts when target_modules is None (peft's
# TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, peft/utils/constants.py)
_QV = ("q_proj", "v_proj")
_QKV = ("query_key_value",)
_DEFAULT_TARGETS: Mapping[str, str | tuple[str, ...]] = {
    **dict.fromkeys(("t5", "mt5"), ("q", "v")),
    **dict.fromkeys(("gpt2", "gpt_bigcode"), ("c_attn",)),
    **dict.fromkeys(("bloom", "gpt_neox", "chatglm", "RefinedWebModel", "RefinedWeb", "falcon"), _QKV),
    **dict.fromkeys(("bert", "roberta", "xlm-roberta", "electra", "layoutlm"), ("query", "value")),
    **dict.fromkeys(
        ("bart", "opt", "gptj", "gpt_neo", "llama", "llama4", "mistral", "mixtral", "stablelm", "gemma"), _QV
    ),
    **dict.fromkeys(("gemma2", "gemma3_text", "qwen2", "qwen3"), _QV),
    "blip-2": ("q", "v", "q_proj", "v_proj"),
    "deberta-v2": ("query_proj", "value_proj"),
    "deberta": ("in_proj",),
    "mpt": ("Wqkv",),
    "btlm": ("c_proj", "c_attn"),
    "codegen": ("qkv_proj",),
    "phi": ("q_proj", "v_proj", "fc1", "fc2"),
    "rwkv": ("key", "value", "receptance", "output"),
    "rwkv7": ("r_proj", "k_proj", "v_proj", "o_proj", "key", "value"),
    "gemma4": r".*language_model\..*\.(q_proj|v_proj)",
    "nemotron_h": ("q_proj", "k_proj", "v_proj", "o_proj"),
}
# task_type -> the head modules peft trains in full beside the adapter (peft's PeftModelFor<Task> classes)
_TASK_HEADS: Mapping[str, tuple[str, ...]] = {
    "SEQ_CLS": ("classifier", "score"),
    "TOKEN_CLS": ("classifier", "score"),
    "QUESTION_ANS": ("qa_outputs",),
}


# ---- regular expressions: each pattern is checked once for catastrophic backtracking, then run by `re`
#
# Python's `re` backtracks: a pattern in which a repeated part can match the same text in two ways
# ("(.|.)*Z", "(a+)+Z") takes time exponential in the length of a name it fails on, and one with k chained
# repeats that can share text (".*.*.*Z") time of the order of n**(k+1). _analysed builds the pattern's
# position automaton (Glushkov's, counting the ways each transition arises) and finds both: the first is
# refused, the second bounds the length of the names the pattern is matched against (_MATCH_BUDGET steps).
# Where the analysis approximates, it errs towards refusing: character classes overlap when they share one
# of the _PROBES characters (or a character the pattern names), lookarounds and anchors never block a path,
# atomic groups and possessive repeats backtrack like plain ones, a back reference matches anything.
# Accepted patterns are matched by `re` itself, so every result is re's.


def _sre_module(name: str, before_3_11: str) -> Any:
    """The standard library's regex module ``re._<name>`` (``before_3_11``: its name on Python 3.10)."""
    try:
        return importlib.import_module(f"re._{name}")
    except ImportError:  # Python 3.10
        return importlib.import_module(before_3_11)


_sre_parse = _sre_module("parser", "sre_parse")
_sre_compile = _sre_module("compiler", "sre_compile")

# the most backtracking steps (an estimate from above) one match may take: at most about a second of `re`
_MATCH_BUDGET = 10**8
# bounded repeats up to this count are unrolled; larger ones are analysed as unbounded loops
_UNROLL = 4
# the largest automaton (positions, loops) and product graph (pairs or triples of positions) analysed
_MAX_POSITIONS = 100_000
_MAX_PRODUCT = 400_000
_MAX_LOOPS = 1_000
# characters a character class is tried on, besides the pattern's own literals and their case variants:
# ASCII and representatives of Unicode's digits, letters, spaces, line ends and case folds
_PROBES = "".join(map(chr, range(128))) + "\x85\xa0\xb5\xdf\xe9\u0130\u0131\u017f\u0660\u2028\u212a\u4e2d"


class _TooLarge(Exception):
    """The pattern's automaton is larger than loragen analyses."""


@dataclasses.dataclass(frozen=True)
class _Regex:
    """A pattern as loragen runs it: ``compiled`` and the longest name it may be matched against within
    the budget (None: any), or why it is refused (``refusal``)."""

    compiled: re.Pattern[str] | None
    longest: int | None = None
    refusal: str | None = None


@dataclasses.dataclass
class _Fragment:
    """A sub-pattern in the automaton: the ways to start at / end at each position, and to match ''."""

    first: dict[int, int]
    last: dict[int, int]
    empty: int


def _ways(*terms: tuple[dict[int, int], int]) -> dict[int, int]:
    """``sum(count * scale)`` position-wise over ``terms``, capped at 2 (two ways is already ambiguous)."""
    out: dict[int, int] = {}
    for count, scale in terms:
        if scale:
            for p, k in count.items():
                out[p] = min(2, out.get(p, 0) + k * scale)
    return out


class _Automaton:
    """The position automaton of a parsed pattern; its lookaround bodies are automata of their own."""

    def __init__(self, items: Any, flags: int, probes: str, masks: dict[tuple[str, int], int]) -> None:
        self.probes = probes
        self.masks: list[int] = []  # per position: which probe characters it matches
        self.follow: list[dict[int, int]] = []  # per position: next position -> ways (at most 2)
        self.lookarounds: list[_Automaton] = []
        self._known_masks = masks
        self.build(items, flags)

    def _mask(self, item: Any, flags: int) -> int:
        key = (repr(item), flags)
        if key not in self._known_masks:
            try:
                state = _sre_parse.State()
                state.flags = flags
                test = _sre_compile.compile(_sre_parse.SubPattern(state, [item]), flags).match
                mask = sum(1 << i for i, ch in enumerate(self.probes) if test(ch))
            except Exception:  # an item this Python does not compile alone: it may match anything
                mask = (1 << len(self.probes)) - 1
            self._known_masks[key] = mask
        return self._known_masks[key]

    def _link(self, last: dict[int, int], first: dict[int, int]) -> None:
        for p, k in last.items():
            follow = self.follow[p]
            for q, m in first.items():
                follow[q] = min(2, follow.get(q, 0) + k * m)

    def concat(self, a: _Fragment, b: _Fragment) -> _Fragment:
        self._link(a.last, b.first)
        return _Fragment(
            _ways((a.first, 1), (b.first, a.empty)),
            _ways((b.last, 1), (a.last, b.empty)),
            min(2, a.empty * b.empty),
        )

    def build(self, items: Any, flags: int) -> _Fragment:
        out = _Fragment({}, {}, 1)
        for item in items:
            out = self.concat(out, self.item(item, flags))
        return out

    def item(self, item: Any, flags: int) -> _Fragment:
        op, av = item
        kind = op.name
        if kind in ("LITERAL", "NOT_LITERAL", "ANY", "IN"):
            if len(self.masks) >= _MAX_POSITIONS:
                raise _TooLarge
            self.masks.append(self._mask(item, flags))
            self.follow.append({})
            return _Fragment({len(self.masks) - 1: 1}, {len(self.masks) - 1: 1}, 0)
        if kind == "SUBPATTERN":
            _, add, remove, body = av
            return self.build(body, (flags | add) & ~remove)
        if kind == "ATOMIC_GROUP":  # analysed as a plain group: that errs only towards refusing
            return self.build(av, flags)
        if kind in ("BRANCH", "GROUPREF_EXISTS"):
            parts = [
                self.build(alt, flags) for alt in (av[1] if kind == "BRANCH" else av[1:]) if alt is not None
            ]
            empty = sum(part.empty for part in parts) + (kind == "GROUPREF_EXISTS" and av[2] is None)
            return _Fragment(
                _ways(*((part.first, 1) for part in parts)),
                _ways(*((part.last, 1) for part in parts)),
                min(2, empty),
            )
        if kind in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, high, body = av
            return self.repeat(low, high, body, flags)
        if kind == "GROUPREF":  # the group's text, whatever it is: any characters, repeated
            return self.repeat(0, _sre_parse.MAXREPEAT, [(_sre_parse.ANY, None)], flags | re.DOTALL)
        if kind in ("ASSERT", "ASSERT_NOT"):  # tried at each position it is reached at: analysed apart
            self.lookarounds.append(_Automaton(av[1], flags, self.probes, self._known_masks))
        return _Fragment({}, {}, 1)  # lookarounds, anchors (AT): zero-width

    def repeat(self, low: int, high: int, body: Any, flags: int) -> _Fragment:
        if high <= _UNROLL:  # x{1,3} = x(x(x)?)?, each copy with positions of its own
            tail = _Fragment({}, {}, 1)
            for _ in range(high - low):
                tail = self.concat(self.build(body, flags), tail)
                tail.empty = min(2, tail.empty + 1)
            out = _Fragment({}, {}, 1)
            for _ in range(low):
                out = self.concat(out, self.build(body, flags))
            return self.concat(out, tail)
        inner = self.build(body, flags)
        self._link(inner.last, inner.first)  # from each end of the body back to each start
        return _Fragment(inner.first, inner.last, 1 if low == 0 else inner.empty)

    def components(self) -> list[list[int]]:
        """The strongly connected components of the positions (Tarjan's), those later in the pattern's
        order first; a position on no loop is a component of its own."""
        index: dict[int, int] = {}
        low: dict[int, int] = {}
        stack: list[int] = []
        on_stack: set[int] = set()
        out: list[list[int]] = []
        for root in range(len(self.masks)):
            if root in index:
                continue
            work = [(root, iter(self.follow[root]))]
            index[root] = low[root] = len(index)
            stack.append(root)
            on_stack.add(root)
            while work:
                node, successors = work[-1]
                for nxt in successors:
                    if nxt not in index:
                        index[nxt] = low[nxt] = len(index)
                        stack.append(nxt)
                        on_stack.add(nxt)
                        work.append((nxt, iter(self.follow[nxt])))
                        break
                    if nxt in on_stack:
                        low[node] = min(low[node], index[nxt])
                else:
                    work.pop()
                    if work:
                        low[work[-1][0]] = min(low[work[-1][0]], low[node])
                    if low[node] == index[node]:
                        component = []
                        while True:
                            member = stack.pop()
                            on_stack.discard(member)
                            component.append(member)
                            if member == node:
                                break
                        out.append(component)
        return out

    def exponential(self, loop: list[int]) -> bool:
        """Whether a word leads from a position of ``loop`` back to it along two different paths: some
        transition inside the loop arises two ways, or the pairs of positions two paths reach on the same
        word go from equal to unequal and back to equal."""
        members = set(loop)
        if any(k > 1 and q in members for p in loop for q, k in self.follow[p].items()):
            return True
        inside = {p: [q for q in self.follow[p] if q in members] for p in loop}
        edges: dict[tuple[int, int], list[tuple[int, int]]] = {}
        todo = [(p, p) for p in loop]
        seen = set(todo)
        while todo:
            x, y = pair = todo.pop()
            nxt = [(a, b) for a in inside[x] for b in inside[y] if self.masks[a] & self.masks[b]]
            edges[pair] = nxt
            for other in nxt:
                if other not in seen:
                    if len(seen) >= _MAX_PRODUCT:
                        raise _TooLarge
                    seen.add(other)
                    todo.append(other)
        back: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for pair, nxt in edges.items():
            for other in nxt:
                back.setdefault(other, []).append(pair)
        todo = [(p, p) for p in loop]
        reached = set(todo)
        while todo:
            for pair in back.get(todo.pop(), ()):
                if pair not in reached:
                    if pair[0] != pair[1]:
                        return True  # reached from equal positions, and leads back to equal ones
                    reached.add(pair)
                    todo.append(pair)
        return False

    def chained(self, first: list[int], second: list[int]) -> bool:
        """Whether some word loops at a position of ``first``, leads from there to one of ``second``, and
        loops there too: the backtracking matcher then tries every split of such text between the two."""
        one, two = set(first), set(second)
        todo = [(p, p, q) for p in first for q in second]
        seen = set(todo)
        while todo:
            x, y, z = todo.pop()
            if y == z:
                return True
            for a in self.follow[x]:
                if a not in one:
                    continue
                for c in self.follow[z]:
                    if c not in two or not self.masks[a] & self.masks[c]:
                        continue
                    for b in self.follow[y]:
                        if self.masks[a] & self.masks[b] & self.masks[c] and (a, b, c) not in seen:
                            if len(seen) >= _MAX_PRODUCT:
                                raise _TooLarge
                            seen.add((a, b, c))
                            todo.append((a, b, c))
        return False

    def degree(self) -> int | None:
        """How many chained loops beyond the first can share a failing name's text (its matching takes
        of the order of ``n ** (degree + 1)`` steps on a name of ``n`` characters), or None if a loop can
        match the same text two ways (exponential)."""
        components = self.components()[::-1]  # in the pattern's order: every transition goes forward
        where = {p: i for i, component in enumerate(components) for p in component}
        loops = [
            i
            for i, component in enumerate(components)
            if len(component) > 1 or component[0] in self.follow[component[0]]
        ]
        if len(loops) > _MAX_LOOPS:
            raise _TooLarge
        if any(self.exponential(components[i]) for i in loops):
            return None
        bit = {i: 1 << k for k, i in enumerate(loops)}
        reach = [0] * len(components)  # per component: the loops reachable from it, as bits
        for i in reversed(range(len(components))):
            reach[i] = bit.get(i, 0)
            for p in components[i]:
                for q in self.follow[p]:
                    if where[q] != i:
                        reach[i] |= reach[where[q]]
        chain: dict[int, int] = {}
        for i in reversed(loops):
            chain[i] = 0
            for j in loops:
                if j > i and reach[i] & bit[j] and chain[j] + 1 > chain[i]:
                    if self.chained(components[i], components[j]):
                        chain[i] = chain[j] + 1
        own = max(chain.values(), default=0)
        for inner in self.lookarounds:  # a lookaround runs once per position reached: one degree more
            found = inner.degree()
            if found is None:
                return None
            own = max(own, found + 1 if inner.masks else 0)
        return own


def _longest_name(degree: int) -> int | None:
    """The longest name a pattern of ``degree`` is matched against within :data:`_MATCH_BUDGET` steps
    (estimated from above by the number of ways to split it between ``degree + 2`` chained parts)."""
    if degree == 0:
        return None
    n = 0
    while math.comb(n + 1 + degree + 1, degree + 1) * (degree + 1) <= _MATCH_BUDGET:
        n += 1
    return n


@functools.lru_cache(maxsize=1024)
def _analysed(pattern: str) -> _Regex:
    """``pattern`` compiled, with the longest name it may be matched against, or why it is refused."""
    try:
        compiled = re.compile(pattern)
    except re.error as exc:  # a key within peft's wrapper: "(?i)" no longer opens the expression
        return _Regex(None, refusal=f"is not a valid regular expression where peft puts it ({exc})")
    try:
        parsed = _sre_parse.parse(pattern)
        named = set(_characters(parsed))
        literals = named | {c for ch in named for c in (ch.lower(), ch.upper(), ch.casefold()) if len(c) == 1}
        probes = _PROBES + "".join(sorted(literals - set(_PROBES)))
        degree = _Automaton(parsed, parsed.state.flags, probes, {}).degree()
    except (_TooLarge, RecursionError):
        return _Regex(compiled, refusal="is too large to check for catastrophic backtracking; split it up")
    if degree is None:
        return _Regex(
            compiled,
            refusal=(
                "can backtrack catastrophically: a repeated part of it can match the same text in more than "
                "one way (as in '(.|.)*' or '(a+)+'), so a name it does not match takes time exponential in "
                "the name's length. Write it so that each character can be matched only one way (e.g. "
                r"'.*\.(q_proj|v_proj)', '(.*\.)?q_proj')"
            ),
        )
    return _Regex(compiled, longest=_longest_name(degree))


def _characters(items: Any) -> Iterator[str]:
    """The characters a parsed pattern names (literals and range ends), nested ones included."""
    for op, av in items:
        kind = op.name
        if kind in ("LITERAL", "NOT_LITERAL"):
            yield chr(av)
        elif kind == "RANGE":
            yield from map(chr, av)
        elif kind in ("IN", "ATOMIC_GROUP"):
            yield from _characters(av)
        elif kind == "BRANCH":
            for alt in av[1]:
                yield from _characters(alt)
        elif kind == "GROUPREF_EXISTS":
            for alt in av[1:]:
                yield from _characters(alt or ())
        elif kind in ("SUBPATTERN", "MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT", "ASSERT", "ASSERT_NOT"):
            yield from _characters(av[-1])


def check_pattern(field: str, pattern: str) -> None:
    """Refuse ``pattern`` (the value of ``field``, as the user names it) if matching it can backtrack
    catastrophically: take time exponential in the length of a name it fails on. (A pattern whose time is
    polynomial is run, on names up to the length its degree allows within :data:`_MATCH_BUDGET` steps.)

    Raises:
        LoraConfigError: naming ``field`` and ``pattern`` (also for a pattern that is not a valid regular
            expression).
    """
    refusal = _analysed(pattern).refusal
    if refusal is not None:
        raise LoraConfigError(f"{field} {pattern!r} {refusal}")


def _run(field: str, shown: str, pattern: str, path: str, full: bool) -> re.Match[str] | None:
    """``re.fullmatch`` (``full``) or ``re.match`` of ``pattern`` (``shown`` to the user, as ``field``'s
    value) on ``path``, after the checks for catastrophic backtracking.

    Raises:
        LoraConfigError: the pattern is refused, or ``path`` is longer than it may be matched against.
    """
    regex = _analysed(pattern)
    if regex.refusal is not None:
        raise LoraConfigError(f"{field} {shown!r} {regex.refusal}")
    if regex.longest is not None and len(path) > regex.longest:
        raise LoraConfigError(
            f"{field} {shown!r}: matching it against the module path {path!r} ({len(path)} characters) could "
            f"take more than {_MATCH_BUDGET:.0e} steps: it chains repeats that can match the same text (such "
            f"as '.*' after '.*'), and a name it may be matched against has at most {regex.longest} characters. "
            "Anchor the repeats to literal text (e.g. '.*\\.layers\\.\\d+\\.q_proj')"
        )
    compiled = regex.compiled
    assert compiled is not None  # a pattern that does not compile is refused above
    return compiled.fullmatch(path) if full else compiled.match(path)


def _name_matches(names: str | Sequence[str], path: str, field: str) -> bool:
    """peft's rule: a string is a full-match regex; a list matches a name exactly or as a dotted suffix."""
    if isinstance(names, str):
        return _run(field, names, names, path, full=True) is not None
    return any(path == n or path.endswith("." + n) for n in names)


def _pattern_value(field: str, patterns: Mapping[str, Any], path: str, default: Any) -> Any:
    """The first ``rank_pattern`` / ``alpha_pattern`` (``field``) value whose key matches ``path`` as peft
    matches it."""
    for key, value in patterns.items():
        if _run(f"{field} key", key, rf"(.*\.)?({key})$", path, full=False):
            return value
    return default


def _is_excluded(config: LoraConfig, path: str) -> bool:
    """``exclude_modules`` or ``modules_to_save`` (trained in full, with all inside it) rule ``path`` out."""
    excluded = config.exclude_modules
    if excluded is not None and _name_matches(excluded, path, "exclude_modules"):
        return True
    return any(re.match(rf"(^|.*\.){re.escape(name)}($|\..*)", path) for name in config.modules_to_save or ())


def _layer_index(config: LoraConfig, path: str) -> int | None:
    """The layer index of ``path`` as peft finds it."""
    patterns = config.layers_pattern
    if not patterns:
        found = [re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", path)]
    else:
        names = (patterns,) if isinstance(patterns, str) else patterns
        found = [
            _run("layers_pattern", pattern, rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", path, full=False)
            for pattern in names
        ]
    m = next((m for m in found if m is not None), None)
    return None if m is None else int(m.group("idx"))


def _matches(config: LoraConfig, path: str, targets: str | Sequence[str]) -> bool:
    """Whether ``targets`` (the config's, or one entry of its list) selects ``path``, with peft's rules."""
    if _is_excluded(config, path):
        return False
    if isinstance(targets, str) or path in targets:  # an exact path ignores layers_to_transform (as peft)
        return _name_matches(targets, path, "target_modules")
    if not _name_matches(targets, path, "target_modules"):
        return False
    layers = config.layers_to_transform
    if layers is None or (not isinstance(layers, int) and len(layers) == 0):
        return True
    index = _layer_index(config, path)
    return index is not None and (index == layers if isinstance(layers, int) else index in layers)


def _values(config: LoraConfig, path: str) -> tuple[int, float, float]:
    """``(r, lora_alpha, scaling)`` for the module (or ``<module>.<parameter>``) at ``path``."""
    r = int(_pattern_value("rank_pattern", config.rank_pattern, path, config.r))
    alpha = float(_pattern_value("alpha_pattern", config.alpha_pattern, path, config.lora_alpha))
    return r, alpha, alpha / (math.sqrt(r) if config.use_rslora else r)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A module the rules may select, described without the module itself.

    Attributes:
        path: its dotted module path.
        layer: the qualified name of its type when loragen can adapt it, else None.
        linear / output_head: whether it counts as linear for ``all-linear`` / is the output head.
        type_name: its type's qualified name, for messages.
        refusal: why loragen never adapts its type, or None.
        torch_linear: whether it is a plain ``nn.Linear`` (peft's ``all-linear`` takes every one).
        parameters: its own parameters, ``(name, shape)`` in registration order.
    """

    path: str
    layer: str | None
    linear: bool = False
    output_head: bool = False
    type_name: str = ""
    refusal: str | None = None
    torch_linear: bool = False
    parameters: tuple[tuple[str, tuple[int, ...]], ...] = ()


@dataclasses.dataclass(frozen=True)
class PlanEntry:
    """What one module becomes: a LoRA layer of its kind, or LoRA on some of its parameters.

    Attributes:
        path: the module path.
        layer: the qualified name of the base layer type (None for parameter targets of a plain module).
        r / lora_alpha / scaling: the module's rank, alpha and scaling (``alpha / r`` or ``/ sqrt(r)``).
        lora_dropout / use_rslora / use_dora / init_lora_weights: the variant.
        parameters: for LoRA on parameters, ``{name: (r, lora_alpha)}`` in registration order; else empty.
    """

    path: str
    layer: str | None
    r: int
    lora_alpha: float
    scaling: float
    lora_dropout: float
    use_rslora: bool
    use_dora: bool
    init_lora_weights: InitMode
    parameters: Mapping[str, tuple[int, float]] = dataclasses.field(default_factory=dict)

    def layer_kwargs(self) -> dict[str, Any]:
        """The keywords of ``LoraLayer.from_module`` (and ``add_factors``) for this entry."""
        names = ("r", "lora_alpha", "lora_dropout", "use_rslora", "init_lora_weights", "use_dora")
        return {name: getattr(self, name) for name in names}


@dataclasses.dataclass(frozen=True)
class LoraPlan:
    """A config interpreted against a model (or a description of its modules).

    Attributes:
        config: the config the converted model keeps and saves (defaults resolved, ``all-linear`` made
            explicit for peft where it differs).
        entries: ``{module path: PlanEntry}`` in module order.
        modules_to_save: paths of the modules trained in full beside the adapter (and saved whole).
        bias: which biases train (``"none"``, ``"all"``, ``"lora_only"``).
        unmatched: entries of a ``target_modules`` list that select no module, or the whole string.
        unmatched_parameters: entries of ``target_parameters`` that select no parameter.
        refused: targeted modules of types loragen never adapts, ``"path (type): why"``.
        unsupported: targeted modules of types loragen cannot adapt, ``"path (type)"``.
        problems: errors found before the targets are matched.
        conflicts: errors of what the targets select (parameters the config cannot adapt, a module
            targeted twice).
    """

    config: LoraConfig
    entries: Mapping[str, PlanEntry]
    modules_to_save: tuple[str, ...] = ()
    bias: BiasMode = "none"
    unmatched: tuple[str, ...] = ()
    unmatched_parameters: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()
    unsupported: tuple[str, ...] = ()
    problems: tuple[LoraError, ...] = ()
    conflicts: tuple[LoraError, ...] = ()

    def __contains__(self, path: object) -> bool:
        return path in self.entries

    def modules(self, model: nn.Module) -> dict[str, nn.Module]:
        """``{path: module}`` of ``model``'s modules the plan adapts."""
        return {path: model.get_submodule(path) for path in self.entries}


def candidates_of(model: nn.Module, *, further: bool = False) -> list[Candidate]:
    """The modules of ``model`` described as candidates; with ``further`` its LoRA layers are candidates
    (as their base type) and nothing inside them is."""
    from torch import nn

    from loragen.layers import LoraLayer
    from loragen.registry import refusal_for, spec_for, spec_for_lora_type

    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    found: list[Candidate] = []
    inside: tuple[str, ...] = ()
    for path, module in model.named_modules():
        if path and further and path.startswith(inside):
            continue
        lora = isinstance(module, LoraLayer)
        if lora and further:
            inside = (*inside, path + ".")
        refusal = refusal_for(type(module))
        spec = spec_for_lora_type(type(module)) if lora else spec_for(module)
        found.append(
            Candidate(
                path=path,
                layer=spec.base_qualname if spec is not None else None,
                linear=spec is not None and spec.linear,
                output_head=head is not None and module is head,
                type_name=f"{type(module).__module__}.{type(module).__qualname__}",
                refusal=refusal,
                torch_linear=isinstance(module, nn.Linear) and not lora,
                parameters=tuple((n, tuple(p.shape)) for n, p in module.named_parameters(recurse=False)),
            )
        )
    return found


def _model_type(model: nn.Module) -> str | None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type if isinstance(model_type, str) else None


def resolve(
    model: nn.Module, config: LoraConfig, *, further: bool = False, optional: bool = False
) -> LoraPlan:
    """Interpret ``config`` against ``model``; change nothing.

    ``further``: plan a further named adapter on a model that may hold LoRA layers already (they are
    targets too; nothing inside them is); otherwise a model with LoRA layers is refused. ``optional``: an
    empty plan instead of an error when nothing is targeted (a sub-model). A list entry of
    ``target_modules`` or ``target_parameters`` that matches nothing while others do gets a
    :class:`~loragen.config.TargetWarning`.

    Raises:
        LoraConversionError: the model already has LoRA layers; ``target_modules`` is None and peft has no
            default for the model type; a targeted module's type is not supported (every such path and type
            is listed, with the supported types); nothing matches (the patterns are repeated and some of the
            model's module names shown); with ``strict_targets=True``, an entry matches nothing; a targeted
            parameter is the top-level module's or not 2-D/3-D; a module is targeted twice.
        LoraConfigError: the config cannot adapt the parameters it (or ``all-linear``) selects; a pattern
            field could backtrack catastrophically on the model's module paths (:func:`check_pattern`).
    """
    if not isinstance(config, LoraConfig):
        raise TypeError(
            f"config must be a loragen.LoraConfig, got {type(config).__name__}; "
            "for a peft config use LoraConfig.from_peft(peft_config.to_dict())"
        )
    from loragen.layers import LoraLayer

    name = type(model).__name__
    if not further:
        existing = [path for path, m in model.named_modules() if isinstance(m, LoraLayer)]
        if existing:
            paths = ", ".join(existing[:5]) + (" ..." if len(existing) > 5 else "")
            raise LoraConversionError(
                f"the model already has LoRA layers ({paths}); converting it again would stack adapters. "
                "Use loragen.mark_trainable(model, config) to set which parameters train, load_adapter() to "
                "load weights into it, or merge_and_unload() first to start from plain layers"
            )
    candidates = candidates_of(model, further=further)
    plan = resolve_candidates(
        config, candidates, model_type=_model_type(model), moe=None if further else _moe_family(model)
    )
    if optional and not (plan.entries or plan.refused or plan.unsupported or plan.problems or plan.conflicts):
        return plan
    _raise_problems(plan, candidates, name)
    return plan


def _raise_problems(plan: LoraPlan, candidates: Sequence[Candidate], name: str) -> None:
    """Raise (or warn about) what :func:`resolve_candidates` found wrong, in a fixed order."""
    config = plan.config
    if plan.problems:
        raise plan.problems[0]
    if plan.unmatched_parameters:
        sample = [
            f"{c.path}.{n}" if c.path else n for c in candidates for n, s in c.parameters if len(s) in (2, 3)
        ]
        where = (
            f"match no parameter of {name}; an entry matches a parameter's full name or its dotted suffix. Its "
            f"2-D and 3-D parameters include: {_sample(sample, _SHOWN_PARAMETERS)}"
        )
        if config.strict_targets or (not plan.entries and config.target_modules is None):
            strict = " (strict_targets=True)" if config.strict_targets else ""
            raise LoraConversionError(
                f"target_parameters entries {list(plan.unmatched_parameters)!r} {where}{strict}"
            )
        for entry in plan.unmatched_parameters:  # as target_modules entries: peft converts with the others
            warnings.warn(
                f"target_parameters entry {entry!r} {where}. LoraConfig(strict_targets=True) makes this an error",
                TargetWarning,
                stacklevel=4,
            )
    if plan.conflicts:
        raise plan.conflicts[0]
    if plan.refused:
        raise LoraConversionError(
            "target_modules matched modules loragen will not adapt: "
            + "; ".join(plan.refused)
            + ". Narrow target_modules (or add these to exclude_modules)"
        )
    listed = not isinstance(config.target_modules, str) and config.target_modules is not None
    if listed and plan.unmatched:
        hint = (
            "an entry matches a module path exactly or as a dotted suffix (peft's rule). "
            f"{name}'s modules include: {_leaves(candidates)}"
        )
        if config.strict_targets:
            raise LoraConversionError(
                f"target_modules entries {list(plan.unmatched)!r} match no module of {name} "
                f"(strict_targets=True); {hint}"
            )
        if plan.entries or plan.unsupported:
            for entry in plan.unmatched:
                warnings.warn(
                    f"target_modules entry {entry!r} matches no module of {name}; {hint}. "
                    "LoraConfig(strict_targets=True) makes this an error",
                    TargetWarning,
                    stacklevel=4,
                )
    if plan.unsupported:
        from loragen.registry import supported_type_names

        raise LoraConversionError(
            "target_modules matched modules loragen cannot adapt: "
            + "; ".join(plan.unsupported)
            + ". Supported layer types: "
            + ", ".join(supported_type_names())
            + ". Narrow target_modules (or add these to exclude_modules), or teach loragen the type with "
            "loragen.register_layer(...)"
        )
    if not plan.entries:
        targets = config.target_modules
        if targets == ALL_LINEAR or targets is None:
            patterns: object = []
        else:
            patterns = targets if isinstance(targets, str) else list(targets)
        extra = ""
        if config.layers_to_transform is not None:
            extra = f" with layers_to_transform={config.layers_to_transform!r}"
            if config.layers_pattern is not None:
                extra += f", layers_pattern={config.layers_pattern!r}"
        raise LoraConversionError(
            f"target_modules={patterns!r}{extra} matched no module of {name}. "
            f"Its modules include: {_leaves(candidates)}"
        )


def _leaves(candidates: Sequence[Candidate]) -> str:
    """Some of the model's leaf module paths, for messages."""
    parents = {c.path.rpartition(".")[0] for c in candidates if "." in c.path}
    leaves = [c.path for c in candidates if c.path and c.path not in parents]
    return _sample(leaves, _SHOWN, "(the model has no submodules)")


def _sample(names: Sequence[str], shown: int, empty: str = "(none)") -> str:
    if not names:
        return empty
    more = f", ... ({len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def resolve_candidates(
    config: LoraConfig,
    candidates: Iterable[Candidate],
    *,
    model_type: str | None = None,
    moe: tuple[str, bool] | None = None,
) -> LoraPlan:
    """Interpret ``config`` against module descriptions; raises only for what it cannot run (the plan lists
    what it finds).

    ``model_type`` gives peft's default targets when ``target_modules`` is None; ``moe`` (``(family, peft
    converts it)`` for a transformers 5 MoE model) makes ``all-linear`` adapt the fused expert parameters.

    Raises:
        LoraConfigError: ``all-linear`` adds expert parameters this config cannot adapt on a family peft
            converts too (peft refuses it); a pattern field could backtrack catastrophically on the
            described paths (:func:`check_pattern`).
    """
    cands = list(candidates)
    config, no_targets = _with_defaults(config, model_type)
    config = _with_task_heads(config)
    if config.target_modules == ALL_LINEAR:
        linear = {c.path for c in cands if c.path and c.linear and not c.output_head}
        config = _exclude_what_peft_adds(config, cands, linear)
        if moe is not None:
            config = _expand_all_linear(config, cands, linear, moe)
        targets: str | Sequence[str] = tuple(p for p in (c.path for c in cands) if p in linear)
    else:
        targets = config.target_modules if config.target_modules is not None else ()
    module_entries: dict[str, PlanEntry] = {}
    refused: list[str] = []
    unsupported: list[str] = []
    for c in cands:
        if not c.path or not _matches(config, c.path, targets):
            continue
        if c.refusal is not None:
            refused.append(f"{c.path} ({c.type_name}): {c.refusal}")
        elif c.layer is None:
            unsupported.append(f"{c.path} ({c.type_name})" if c.type_name else c.path)
        else:
            module_entries[c.path] = _entry(config, c.path, c.layer)
    parameter_entries, as_modules, unused, problems, conflicts = _plan_parameters(config, cands)
    module_entries.update((p, e) for p, e in as_modules.items() if p not in module_entries)
    both = sorted(set(parameter_entries) & set(module_entries))
    if both:
        conflicts.append(
            LoraConversionError(
                f"{', '.join(both)}: targeted by target_modules and by target_parameters; a module is adapted "
                "one way (peft refuses it too). Narrow target_modules or target_parameters"
            )
        )
    entries = {c.path: e for c in cands if (e := parameter_entries.get(c.path) or module_entries.get(c.path))}
    paths = [c.path for c in cands if c.path]
    return LoraPlan(
        config=config,
        entries=entries,
        modules_to_save=saved_modules(config, paths),
        bias=config.bias,
        unmatched=_unmatched(config, paths, targets),
        unmatched_parameters=unused,
        refused=tuple(refused),
        unsupported=tuple(unsupported),
        problems=(no_targets, *problems) if no_targets is not None else tuple(problems),
        conflicts=tuple(conflicts),
    )


def _with_defaults(config: LoraConfig, model_type: str | None) -> tuple[LoraConfig, LoraError | None]:
    """``config`` with peft's default targets when ``target_modules`` is None, or the error that there are none."""
    if config.target_modules is not None or config.target_parameters:
        return config, None
    defaults = _DEFAULT_TARGETS.get(model_type or "")
    if defaults is None:
        known = (
            f"model type {model_type!r} has none"
            if model_type
            else "the model has no transformers model_type"
        )
        return config, LoraConversionError(
            "LoraConfig.target_modules is None: name the modules to adapt, e.g. "
            "target_modules=['q_proj', 'v_proj'], a regex, or 'all-linear' (peft's per-architecture defaults "
            f"apply to transformers models, and {known})"
        )
    return config.replace(target_modules=defaults if isinstance(defaults, str) else list(defaults)), None


def _with_task_heads(config: LoraConfig) -> LoraConfig:
    """``config`` with the heads peft trains for its ``task_type`` added to ``modules_to_save``."""
    heads = _TASK_HEADS.get(str(config.task_type or ""), ())
    have = tuple(config.modules_to_save or ())
    missing = [h for h in heads if h not in have]
    return config.replace(modules_to_save=[*have, *missing]) if missing else config


def _entry(
    config: LoraConfig, path: str, layer: str | None, parameters: Mapping[str, tuple[int, float]] = {}
) -> PlanEntry:
    r, alpha, scaling = _values(config, path)
    return PlanEntry(
        path=path,
        layer=layer,
        r=r,
        lora_alpha=alpha,
        scaling=scaling,
        lora_dropout=config.lora_dropout,
        use_rslora=config.use_rslora,
        use_dora=config.use_dora,
        init_lora_weights=config.init_lora_weights,
        parameters=dict(parameters),
    )


def _unmatched(config: LoraConfig, paths: Sequence[str], targets: str | Sequence[str]) -> tuple[str, ...]:
    listed = config.target_modules
    if listed is None:
        return ()
    if isinstance(listed, str):
        return () if any(_matches(config, p, targets) for p in paths) else (listed,)
    return tuple(entry for entry in listed if not any(_matches(config, p, (entry,)) for p in paths))


def _selected(entries: Iterable[str], key: str) -> list[str]:
    return [entry for entry in entries if key == entry or key.endswith("." + entry)]


def _plan_parameters(
    config: LoraConfig, cands: Sequence[Candidate]
) -> tuple[dict[str, PlanEntry], dict[str, PlanEntry], tuple[str, ...], list[LoraError], list[LoraError]]:
    """``({path: entry of its targeted parameters}, {path: entry of a linear adapted as a module},
    unused entries, problems, conflicts)``."""
    entries = config.target_parameters or ()
    if not entries:
        return {}, {}, (), [], []
    planned: dict[str, dict[str, tuple[int, float]]] = {}
    used: set[str] = set()
    problems: list[LoraError] = []
    conflicts: list[LoraError] = []
    as_modules: dict[str, PlanEntry] = {}
    for c in cands:
        for name, shape in c.parameters:
            key = f"{c.path}.{name}" if c.path else name
            hits = _selected(entries, key)
            if not hits:
                continue
            used.update(hits)
            if c.path and len(shape) in (2, 3):
                r, alpha, _ = _values(config, key)
                planned.setdefault(c.path, {})[name] = (r, alpha)
            elif not c.path:
                problem = (
                    f"target_parameters selects {key!r}, a parameter of the top-level {c.type_name.rpartition('.')[2]} "
                    "itself; only parameters of submodules can be adapted"
                )
                problems.append(LoraConversionError(problem))
            else:
                problem = (
                    f"target_parameters selects {key} of shape {list(shape)}: only 2-D (out, in) weights "
                    "and 3-D expert stacks (num_experts, out, in) can take LoRA factors"
                )
                problems.append(LoraConversionError(problem))
    if planned:
        selected = [f"{p}.{n}" for p, names in planned.items() for n in names]
        conflict = _parameter_conflict(
            config, ", ".join(selected[:3]) + (" ..." if len(selected) > 3 else "")
        )
        if conflict is not None:
            conflicts.append(LoraConfigError(conflict))
    # a linear's weight named by its full name (all-linear's explicit form for peft) makes a LoRA layer of its type
    layers = {c.path: c.layer for c in cands if c.linear and c.layer is not None}
    for path in [p for p, n in planned.items() if list(n) == ["weight"] and p in layers]:
        if f"{path}.weight" in entries:
            del planned[path]
            as_modules[path] = _entry(config, path, layers[path])
    out = {path: _entry(config, path, None, names) for path, names in planned.items()}
    return out, as_modules, tuple(e for e in entries if e not in used), problems, conflicts


def _parameter_conflict(config: LoraConfig, selected: str) -> str | None:
    """Why ``config`` cannot adapt the parameters ``selected`` names (as peft refuses), or None."""
    if config.lora_dropout:
        return (
            f"target_parameters selects {selected} with lora_dropout={config.lora_dropout!r}: LoRA on a parameter "
            "adds scaling * B @ A to the weight, where no input is there to drop out; set lora_dropout=0 (peft "
            "refuses it too)"
        )
    if config.use_dora:
        return (
            f"target_parameters selects {selected} with use_dora=True: DoRA on targeted parameters is not "
            "supported (peft refuses it too); set use_dora=False"
        )
    if config.fan_in_fan_out:
        return (
            f"target_parameters selects {selected} with fan_in_fan_out=True: a targeted parameter's layout "
            "comes from its shape (experts stored (num_experts, out, in), or (num_experts, in, out) on modules "
            "with is_transposed); set fan_in_fan_out=False"
        )
    return None


def _exclude_what_peft_adds(
    config: LoraConfig, cands: Sequence[Candidate], linear: Collection[str]
) -> LoraConfig:
    """``config`` with the ``nn.Linear`` modules loragen's ``all-linear`` leaves out and peft's takes
    (``nn.MultiheadAttention.out_proj``) in ``exclude_modules``, so peft adapts the same modules."""
    left_out = [
        c.path
        for c in cands
        if c.path
        and c.torch_linear
        and c.path not in linear
        and not c.output_head
        and not _is_excluded(config, c.path)
    ]
    if not left_out:
        return config
    excluded = config.exclude_modules
    if excluded is None:
        return config.replace(exclude_modules=left_out)
    if isinstance(excluded, str):  # a regex, which peft matches whole: one more alternative
        return config.replace(exclude_modules=f"(?:{excluded})|" + "|".join(re.escape(p) for p in left_out))
    return config.replace(exclude_modules=[*excluded, *left_out])


# transformers' conversion families whose experts and router were nn.Linear layers before transformers 5
_FUSED_FAMILIES = ("mixtral", "qwen2_moe")
# (parameter entry, how many transformers 4 linears it fuses): the router's weight, the experts' stacks.
_FUSED_ENTRIES = (("gate.weight", 1), ("gate_up_proj", 2), ("down_proj", 1))
# the transformers 4 module names peft's conversion moves from target_modules to those parameters
_MOVED_NAMES = {
    "mixtral": ("gate", "w1", "w2", "w3"),
    "qwen2_moe": ("gate", "gate_proj", "up_proj", "down_proj"),
}


def _moe_family(model: nn.Module) -> tuple[str, bool] | None:
    """``(family, peft converts it)`` for a transformers 5 MoE model of the ``mixtral`` / ``qwen2_moe``
    conversion families, else None. peft finds the family in transformers' table, which names
    ``qwen2_moe`` only as the family of others: peft 0.21 leaves Qwen2-MoE itself unconverted."""
    model_type = _model_type(model) if "transformers" in sys.modules else None
    if model_type is None:
        return None
    try:
        from transformers.conversion_mapping import _MODEL_TO_CONVERSION_PATTERN as table
    except ImportError:  # a transformers without the table (4.x)
        table = {}
    listed = table.get(model_type)
    listed = listed if listed in _FUSED_FAMILIES else None
    family = model_type if model_type in _FUSED_FAMILIES else listed
    return None if family is None else (family, model_type == "mixtral" or listed is not None)


def _expand_all_linear(
    config: LoraConfig, cands: Sequence[Candidate], linear: Collection[str], moe: tuple[str, bool]
) -> LoraConfig:
    """``config`` with the parameters peft's ``all-linear`` adds on a fused-family MoE model made explicit.

    Each fused entry joins ``target_parameters``; one fusing ``k`` linears gets ``rank_pattern`` /
    ``alpha_pattern`` values ``r * k`` / ``lora_alpha * k`` under peft's key (``.*\\.gate_up_proj``).
    Linears peft's conversion moves to parameters (:data:`_MOVED_NAMES`) are listed by full name. A config
    that cannot adapt parameters is refused, or, where peft does not convert (Qwen2-MoE), warned about.
    """
    found: dict[str, int] = {}
    for c in cands:
        if not c.path or c.path in linear:
            continue
        for name, shape in c.parameters:
            for entry, count in _FUSED_ENTRIES:
                if len(shape) in (2, 3) and _selected((entry,), f"{c.path}.{name}"):
                    found[entry] = count
    added = tuple((entry, count) for entry, count in _FUSED_ENTRIES if entry in found)
    if not added:
        return config
    family, converts = moe
    entries = list(config.target_parameters or ())
    moved = _MOVED_NAMES[family] if converts else ()
    for path in sorted(linear):
        if path.rpartition(".")[2] in moved and f"{path}.weight" not in entries:
            entries.append(f"{path}.weight")
    ranks, alphas = dict(config.rank_pattern), dict(config.alpha_pattern)
    # peft warns about a pattern key that matches no targeted module: the key also names one adapted module
    anchor = next(
        (p for p in sorted(linear) if p.rpartition(".")[2] not in moved and not _is_excluded(config, p)), None
    )
    anchor_r, anchor_alpha, _ = _values(config, anchor or "")
    for entry, count in added:
        if entry not in entries:
            entries.append(entry)
        if count > 1 and rf".*\.{entry}" not in ranks:  # peft's own key (a folder peft wrote) stands
            key = rf".*\.{entry}"
            if anchor is not None:  # the anchor's own key first (in any order, sorted too)
                own = f"(?:{re.escape(anchor)})"
                ranks.setdefault(own, anchor_r)
                alphas.setdefault(own, anchor_alpha)
                key = f"{own}|{key}"
            ranks.setdefault(key, config.r * count)
            alphas.setdefault(key, config.lora_alpha * count)
    conflict = _parameter_conflict(config, str([entry for entry, _ in added]))
    if conflict is None:
        # named where peft converts, as peft saves it then (a string would make peft convert again on load)
        names = sorted({p.rpartition(".")[2] for p in linear if p.rpartition(".")[2] not in moved})
        return config.replace(
            target_modules=names if converts else config.target_modules,
            target_parameters=entries,
            rank_pattern=ranks,
            alpha_pattern=alphas,
        )
    if not converts:
        warnings.warn(
            f"target_modules='all-linear' leaves the fused expert parameters {[e for e, _ in added]} out, as "
            f"peft does on this model type: {conflict}",
            LoraConfigWarning,
            stacklevel=5,
        )
        return config
    raise LoraConfigError(
        f"target_modules='all-linear' on a {family}-family MoE model also adapts the fused expert parameters "
        f"{[e for e, _ in added]}, as peft does: {conflict}. Or list the linear modules to adapt instead of "
        "'all-linear' (the experts are then left out)"
    )


def entry_for(config: LoraConfig, path: str) -> PlanEntry:
    """The plan entry ``config`` gives the module (or ``<module>.<parameter>``) at ``path``, whether or not
    its targets select it."""
    return _entry(config, path, None)


def saved_modules(config: LoraConfig, paths: Iterable[str]) -> tuple[str, ...]:
    """The module ``paths`` that ``modules_to_save`` names (exact name or dotted suffix): trained in full
    and saved whole."""
    names = tuple(config.modules_to_save or ())
    return tuple(p for p in paths if p and _name_matches(names, p, "modules_to_save")) if names else ()


def embedding_targeted(config: LoraConfig, paths: Iterable[str], names: Collection[str]) -> bool:
    """Whether ``target_modules`` (not ``all-linear``) selects a module whose last name is in ``names``
    (peft's check for ``save_embedding_layers="auto"``)."""
    targets = config.target_modules
    if targets == ALL_LINEAR or targets is None:
        return False
    if isinstance(targets, str):
        return any(_matches(config, p, targets) for p in paths if p.rpartition(".")[2] in names)
    return any(name in targets for name in names)


def targets_parameters_of(config: LoraConfig, module: str) -> bool:
    """Whether ``target_parameters`` selects a parameter of ``module`` (by the names its entries end in)."""
    entries = config.target_parameters or ()
    return any(_selected(entries, f"{module}.{entry.rpartition('.')[2]}") for entry in entries)


def fused_expert_parameters(config: LoraConfig, names: Iterable[str]) -> tuple[str, ...]:
    """Which of ``names`` (``Class.attribute`` of declared parameters) ``all-linear`` adapts as fused expert
    stacks on a transformers 5 MoE model, as peft does."""
    if config.target_modules != ALL_LINEAR:
        return ()
    fused = {entry for entry, _ in _FUSED_ENTRIES if "." not in entry}
    return tuple(name for name in names if name.rpartition(".")[2] in fused)


def max_rank(config: LoraConfig) -> int:
    """The largest rank ``config`` gives any module (``r`` or a ``rank_pattern`` value)."""
    return max(config.r, *config.rank_pattern.values()) if config.rank_pattern else config.r
