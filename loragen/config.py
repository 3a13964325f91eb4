"""LoraConfig: the adapter configuration, with peft's field names and semantics, validated when it is
created and converted to and from peft's ``adapter_config.json`` dictionaries. What the fields select in
a model is decided by :mod:`loragen.plan`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from loragen.errors import LoraConfigError

__all__ = [
    "LoraConfig",
    "LoraConfigError",
    "LoraConfigWarning",
    "TargetWarning",
    "ALL_LINEAR",
    "FrozenDict",
    "InitMode",
    "check_rank",
    "check_alpha",
    "check_dropout",
    "check_flag",
    "check_init",
    "check_lora_args",
]

ALL_LINEAR = "all-linear"
InitMode = bool | Literal["gaussian"]
BiasMode = Literal["none", "all", "lora_only"]
_BIAS_MODES = ("none", "all", "lora_only")
# peft's TaskType values (peft trains a task's head beside the adapter: see loragen.plan)
TASK_TYPES = ("SEQ_CLS", "SEQ_2_SEQ_LM", "CAUSAL_LM", "TOKEN_CLS", "QUESTION_ANS", "FEATURE_EXTRACTION")

# peft fields that carry no meaning for a LoRA adapter's math (metadata), accepted and dropped.
_PEFT_METADATA_FIELDS = frozenset(
    {
        "peft_type",
        "auto_mapping",
        "peft_version",
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "megatron_core",
    }
)
# peft features loragen does not implement: accepted only at their "off" value, refused otherwise, because
# ignoring them would silently change the adapter's output.
_PEFT_UNSUPPORTED_DEFAULTS: Mapping[str, Any] = {
    "lora_bias": False,
    "use_qalora": False,
    "layer_replication": None,
    "megatron_config": None,
    "trainable_token_indices": None,
    "loftq_config": {},
    "eva_config": None,
    "corda_config": None,
    "lora_ga_config": None,
    "velora_config": None,
    "alora_invocation_tokens": None,
    "monteclora_config": None,
    "use_bdlora": None,
    "arrow_config": None,
    "kasa_config": None,
    "qalora_group_size": 16,
    "ensure_weight_tying": False,
}


# Field checks, shared with every LoRA layer's constructor: each raises LoraConfigError naming the field,
# the value and what would be accepted.
INIT_MODES: tuple[InitMode, ...] = (True, False, "gaussian")


def check_rank(value: Any, field: str = "r") -> int:
    """A rank: a positive integer (``bool`` is refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LoraConfigError(f"{field}={value!r}: the rank must be a positive integer")
    return value


def check_alpha(value: Any, field: str = "lora_alpha") -> float:
    """A LoRA alpha: a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        shown = f"an integer of {len(str(value))} digits" if isinstance(value, int) else repr(value)
        raise LoraConfigError(f"{field}={shown}: expected a finite number")
    return value


def _finite(value: float) -> bool:
    """Whether ``value`` is finite as a float (an integer too large for one is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_dropout(value: Any, field: str = "lora_dropout") -> float:
    """A dropout probability ``p`` with ``0 <= p < 1``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise LoraConfigError(f"{field}={value!r}: expected a probability with 0 <= p < 1")
    return float(value)


def check_flag(value: Any, field: str) -> bool:
    """A switch field: exactly ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise LoraConfigError(f"{field}={value!r}: expected True or False")
    return value


def check_init(value: Any, field: str = "init_lora_weights") -> InitMode:
    """An init scheme loragen implements: ``True``, ``False`` or ``"gaussian"``."""
    if not isinstance(value, (bool, str)) or value not in INIT_MODES:
        raise LoraConfigError(
            f"{field}={value!r}: expected True, False or 'gaussian' "
            "(peft's other schemes - pissa, olora, loftq, eva, corda - are not supported)"
        )
    return value


def check_lora_args(
    r: Any, lora_alpha: Any, lora_dropout: Any, use_rslora: Any, init_lora_weights: Any
) -> None:
    """Check the LoRA arguments every LoRA layer takes (the same fields as the config)."""
    check_rank(r)
    check_alpha(lora_alpha)
    check_dropout(lora_dropout)
    check_flag(use_rslora, "use_rslora")
    check_init(init_lora_weights)


def _check_parameter_targets(value: Any) -> tuple[str, ...] | None:
    """``target_parameters``: None or a list of parameter names (no regex string, as in peft), as a tuple."""
    field = "target_parameters"
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
        raise LoraConfigError(
            f"{field}={value!r}: expected a list of parameter names such as ['experts.gate_up_proj'] "
            "(a regex string is not accepted, as in peft)"
        )
    names = sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    for name in names:
        if not isinstance(name, str) or not name or name.startswith(".") or name.endswith("."):
            raise LoraConfigError(
                f"{field}: {name!r} is not a parameter name (expected e.g. 'experts.down_proj')"
            )
    return tuple(names)


class FrozenDict(dict):
    """A read-only dict for ``rank_pattern`` / ``alpha_pattern`` that pickles and deep-copies."""

    def _readonly(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("LoraConfig patterns are read-only; use config.replace(rank_pattern=...)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _readonly  # type: ignore[assignment]
    __ior__ = _readonly  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (dict(self),))


class LoraConfigWarning(UserWarning):
    """A peft configuration field loragen does not know was ignored."""


class TargetWarning(LoraConfigWarning):
    """An entry of ``target_modules`` matches no module of the model, or one of ``target_parameters`` no
    parameter (``strict_targets=True``: an error)."""


# LoraConfig fields of loragen's own, which to_peft leaves out (peft would warn about them)
_LORAGEN_ONLY_FIELDS = frozenset({"strict_targets"})


def _freeze_names(field: str, value: Any) -> str | tuple[str, ...] | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Iterable) and not isinstance(value, (bytes, Mapping)):
        names = tuple(value)
        if all(isinstance(n, str) and n for n in names):
            # peft stores target_modules as a set: keep a stable order for reproducible configs.
            return tuple(sorted(set(names))) if isinstance(value, (set, frozenset)) else names
    raise LoraConfigError(f"{field}={value!r}: expected None, a regex string, or a list of module names")


def _freeze_pattern(field: str, value: Any, kind: type) -> Mapping[str, Any]:
    if value is None:
        return FrozenDict()
    if not isinstance(value, Mapping):
        raise LoraConfigError(f"{field}={value!r}: expected a dict mapping module-name patterns to values")
    for key, item in value.items():
        if not isinstance(key, str) or not key:
            raise LoraConfigError(f"{field}: key {key!r} must be a non-empty pattern string")
        _check_regex(f"{field}[{key!r}]", key)
        if (
            isinstance(item, bool)
            or not isinstance(item, (int, float))
            or (kind is int and item != int(item))
        ):
            raise LoraConfigError(f"{field}[{key!r}]={item!r}: expected a {kind.__name__}")
        if kind is int:
            check_rank(item, f"{field}[{key!r}]")
        else:
            check_alpha(item, f"{field}[{key!r}]")
    return FrozenDict({k: kind(v) for k, v in value.items()})


def _check_regex(field: str, pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise LoraConfigError(f"{field}={pattern!r} is not a valid regular expression: {exc}") from None


# peft init schemes that only choose starting values: a saved adapter loads as init_lora_weights=True
_VALUES_ONLY_INITS = ("eva", "orthogonal")
# peft init schemes that change the base model's weights when the adapter is created
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")


def _loaded_init(init: str, source: str) -> bool:
    """The init mode a saved adapter with peft's ``init_lora_weights=init`` is loaded with, or an error
    for a scheme loragen does not reproduce."""
    if init in _VALUES_ONLY_INITS:
        return True
    if init.startswith(_BASE_CHANGING_INITS):
        raise LoraConfigError(
            f"{source}: init_lora_weights={init!r}: peft changed the base model's weights when it created this "
            "adapter, so its factors reproduce the trained model only on those changed weights. Convert it "
            "to a plain LoRA adapter with peft first (save_pretrained(..., "
            "path_initial_model_for_weight_conversion=...)), then load the converted folder"
        )
    if init == "mica":
        raise LoraConfigError(
            f"{source}: init_lora_weights='mica': peft trains only lora_A of a MiCA adapter (lora_B stays frozen), "
            "and loragen does not implement that; loading it would train both factors. Load it with peft, or "
            "train a plain LoRA adapter"
        )
    raise LoraConfigError(
        f"{source}: init_lora_weights={init!r} is not a scheme loragen knows; expected True, False, "
        f"'gaussian', or one of peft's {', '.join(map(repr, _VALUES_ONLY_INITS))}"
    )


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA adapter configuration with peft's field names, defaults and semantics.

    Attributes:
        r: default rank (> 0).
        lora_alpha: default alpha; ``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with use_rslora).
        lora_dropout: dropout probability on the LoRA branch's input, ``0 <= p < 1``.
        target_modules: a list of module names (exact path or dotted suffix), a regex string (full match
            on the module path), ``"all-linear"`` (every linear layer except the output head), or None
            (peft's defaults for the model type).
        exclude_modules: same forms as ``target_modules``; matching modules are never converted.
        modules_to_save: modules trained fully beside the adapter (hybrid mode), saved with it.
        bias: which biases train: ``"none"``, ``"all"``, or ``"lora_only"`` (biases of LoRA layers).
        use_rslora: rank-stabilised scaling ``lora_alpha / sqrt(r)``.
        init_lora_weights: ``True`` (A kaiming-uniform, B zeros), ``"gaussian"`` (A normal(0, 1/r),
            B zeros) or ``False`` (both random: the adapter is not a no-op at start).
        rank_pattern / alpha_pattern: per-module overrides, ``{pattern: value}``; a pattern matches a
            module path when ``re.match(rf"(.*\\.)?({pattern})$", path)`` does (first key wins).
        layers_to_transform: only convert modules in these layer indices (with a list ``target_modules``).
        layers_pattern: the name of the layer list (e.g. ``"layers"``, ``"h"``) used to find the index.
        fan_in_fan_out: the targeted base weights are stored ``(in, out)`` (set per ``Conv1D`` layer).
        target_parameters: parameters adapted directly (e.g. 3-D MoE expert stacks), by full name or
            dotted suffix (``"experts.gate_up_proj"``), as in peft.
        use_dora: DoRA as peft computes it (a trained magnitude per output feature).
        task_type: peft's task type (``"CAUSAL_LM"``, ``"SEQ_CLS"``, ...); as in peft, ``"SEQ_CLS"`` and
            ``"TOKEN_CLS"`` also train the ``classifier`` / ``score`` head and ``"QUESTION_ANS"`` the
            ``qa_outputs`` head in full.
        strict_targets: a list entry of ``target_modules`` / ``target_parameters`` that matches nothing
            is an error instead of a :class:`TargetWarning` (loragen's own; not written for peft).

    Raises:
        LoraConfigError: on any invalid value; the message names the field and the value.
    """

    r: int = 8
    lora_alpha: float = 8
    lora_dropout: float = 0.0
    target_modules: str | Sequence[str] | None = None
    exclude_modules: str | Sequence[str] | None = None
    modules_to_save: Sequence[str] | None = None
    bias: BiasMode = "none"
    use_rslora: bool = False
    init_lora_weights: InitMode = True
    rank_pattern: Mapping[str, int] = dataclasses.field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = dataclasses.field(default_factory=dict)
    layers_to_transform: int | Sequence[int] | None = None
    layers_pattern: str | Sequence[str] | None = None
    fan_in_fan_out: bool = False
    target_parameters: Sequence[str] | None = None
    use_dora: bool = False
    task_type: str | None = None
    strict_targets: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        check_lora_args(self.r, self.lora_alpha, self.lora_dropout, self.use_rslora, self.init_lora_weights)
        if self.bias not in _BIAS_MODES:
            raise LoraConfigError(f"bias={self.bias!r}: expected one of {', '.join(map(repr, _BIAS_MODES))}")
        for flag in ("fan_in_fan_out", "use_dora", "strict_targets"):
            check_flag(getattr(self, flag), flag)
        task = getattr(self.task_type, "value", self.task_type)  # peft's TaskType enum
        if task is not None and task not in TASK_TYPES:
            raise LoraConfigError(
                f"task_type={task!r}: expected None or one of {', '.join(map(repr, TASK_TYPES))}"
            )
        set_(self, "task_type", task)
        set_(self, "target_parameters", _check_parameter_targets(self.target_parameters))
        for name in ("target_modules", "exclude_modules"):
            value = _freeze_names(name, getattr(self, name))
            if isinstance(value, str) and value != ALL_LINEAR:
                _check_regex(name, value)
                if "," in re.sub(r"\{\d*,\d*\}", "", value):  # a comma outside {m,n}: meant as a list
                    names = [n.strip() for n in value.split(",") if n.strip()]
                    raise LoraConfigError(
                        f"{name}={value!r}: a string is one regular expression matched against whole module paths, "
                        f"where a comma matches only a comma; to name several modules pass a list: {name}={names!r}"
                    )
            set_(self, name, value)
        if self.exclude_modules == ALL_LINEAR:
            raise LoraConfigError(
                "exclude_modules='all-linear': 'all-linear' is only valid for target_modules"
            )
        mts = _freeze_names("modules_to_save", self.modules_to_save)
        if isinstance(mts, str):
            raise LoraConfigError(f"modules_to_save={mts!r}: expected a list of module names, not a string")
        set_(self, "modules_to_save", mts)
        set_(self, "rank_pattern", _freeze_pattern("rank_pattern", self.rank_pattern, int))
        set_(self, "alpha_pattern", _freeze_pattern("alpha_pattern", self.alpha_pattern, float))
        layers = self.layers_to_transform
        if layers is not None:
            items = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else layers
            if not isinstance(items, Iterable) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items
            ):
                raise LoraConfigError(
                    f"layers_to_transform={layers!r}: expected a non-negative int or a list of them"
                )
            set_(self, "layers_to_transform", layers if isinstance(layers, int) else tuple(items))
            if isinstance(self.target_modules, str):
                raise LoraConfigError(
                    "layers_to_transform cannot be used when target_modules is a regex string "
                    f"({self.target_modules!r}); put the layer indices into the regex instead"
                )
        if self.layers_pattern is not None:
            if layers is None:
                raise LoraConfigError(
                    f"layers_pattern={self.layers_pattern!r} is only meaningful with layers_to_transform"
                )
            set_(self, "layers_pattern", _freeze_names("layers_pattern", self.layers_pattern))

    def replace(self, **changes: Any) -> LoraConfig:
        """A copy with ``changes`` applied (validated like a new config)."""
        return dataclasses.replace(self, **changes)

    def to_peft(self) -> dict[str, Any]:
        """The ``adapter_config.json`` dictionary peft writes for this configuration."""
        out: dict[str, Any] = {
            "peft_type": "LORA",
            "base_model_name_or_path": None,
            "revision": None,
            "inference_mode": True,
        }
        for f in dataclasses.fields(self):
            if f.name in _LORAGEN_ONLY_FIELDS:
                continue
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, Mapping):
                value = dict(value)
            out[f.name] = value
        out["lora_bias"] = False
        return out

    @classmethod
    def from_peft(cls, data: Mapping[str, Any], *, source: str = "adapter_config.json") -> LoraConfig:
        """Build a config from a peft ``adapter_config.json`` dictionary: metadata fields are dropped, peft
        features loragen does not implement are refused unless "off", unknown fields are reported with a
        :class:`LoraConfigWarning`.

        Raises:
            LoraConfigError: not a LoRA config, an unsupported feature switched on, or an invalid value;
                the message names ``source`` and the field.
        """
        if not isinstance(data, Mapping):
            raise LoraConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
        peft_type = data.get("peft_type", "LORA")
        peft_type = getattr(peft_type, "value", peft_type)  # peft's PeftType enum in an in-memory dict
        if str(peft_type).upper() != "LORA":
            raise LoraConfigError(
                f"{source}: peft_type={peft_type!r}: loragen reads LoRA adapters only ('LORA')"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        unknown: list[str] = []
        for key, value in data.items():
            if key in known:
                kwargs[key] = value
            elif key in _PEFT_METADATA_FIELDS:
                continue
            elif key in _PEFT_UNSUPPORTED_DEFAULTS:
                off = _PEFT_UNSUPPORTED_DEFAULTS[key]
                if value != off and not (off is None and value in ({}, [], False)):
                    raise LoraConfigError(
                        f"{source}: {key}={value!r} is not supported by loragen (only {off!r}); "
                        "loading it would give different outputs than peft"
                    )
            else:
                unknown.append(key)
        if unknown:
            warnings.warn(
                f"{source}: ignoring peft fields loragen does not know: {', '.join(sorted(unknown))}",
                LoraConfigWarning,
                stacklevel=2,
            )
        init = kwargs.get("init_lora_weights")
        if isinstance(init, str) and init != "gaussian":
            kwargs["init_lora_weights"] = _loaded_init(init, source)
        try:
            return cls(**kwargs)
        except LoraConfigError as exc:
            raise LoraConfigError(f"{source}: {exc}") from None
