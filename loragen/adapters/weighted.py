"""``add_weighted_adapter``: a new adapter that combines existing ones (:func:`~loragen.layers.adapter_set.combine`),
with peft's rank and config (``r = lora_alpha =`` the new rank, the union of the targets, no patterns).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

from loragen.adapters.named import adapter_configs, check_adapter_name, record_config, require_adapter
from loragen.config import LoraConfig
from loragen.convert import find_lora_layers
from loragen.errors import AdapterMixError, AdapterNameError
from loragen.layers.adapter_set import COMBINATIONS, adapter_factors, add_factors, combine, has_adapter
from loragen.plan import max_rank

__all__ = ["add_weighted_adapter"]


def _new_targets(names: Sequence[str], configs: dict[str, LoraConfig | None]) -> str | list[str] | None:
    targets = {n: configs[n].target_modules if configs[n] is not None else None for n in names}  # type: ignore[union-attr]
    kinds = {n: "regex" if isinstance(t, str) else "list" for n, t in targets.items() if t is not None}
    if len(set(kinds.values())) > 1:
        described = ", ".join(f"{n!r}: target_modules={targets[n]!r}" for n in kinds)
        raise AdapterMixError(
            f"cannot combine adapters whose target_modules mix a regex (a string) and a list of names ({described}); "
            "peft refuses them too"
        )
    if not kinds:
        return None
    if "regex" in kinds.values():
        return "|".join(f"({targets[n]})" for n in kinds)
    return sorted({t for n in kinds for t in targets[n]})  # type: ignore[union-attr]


def add_weighted_adapter(
    model: nn.Module,
    adapters: Sequence[str],
    weights: Sequence[float],
    adapter_name: str,
    combination_type: str = "svd",
    *,
    svd_rank: int | None = None,
    svd_clamp: float | None = None,
    svd_full_matrices: bool = True,
    svd_driver: str | None = None,
) -> None:
    """Add ``adapter_name``, the combination of ``adapters`` with ``weights``, to ``model`` (peft's semantics).

    ``combination_type``: ``"cat"`` (exact; rank = the sum of the ranks), ``"linear"`` (every rank equal)
    or ``"svd"`` (rank ``svd_rank``, default the largest); ``"linear"`` for one adapter, as peft. Weights
    may be negative. The new adapter is not made active and its factors are frozen, as in peft.

    Raises:
        AdapterNameError: an unknown adapter in ``adapters`` (the known ones are listed), or
            ``adapter_name`` exists already (peft returns silently then; loragen says so).
        AdapterMixError: ``weights`` and ``adapters`` differ in length, a weight is not a finite number, an
            unknown ``combination_type``, ``"linear"`` over adapters of different ranks, DoRA adapters, or target_modules
            that mix a regex and a list (the adapters and what differs are named).
    """
    names = list(adapters)
    if not names:
        raise AdapterMixError("add_weighted_adapter: adapters is empty; name at least one adapter")
    for name in names:
        require_adapter(model, name)
    if len(weights) != len(names):
        raise AdapterMixError(
            f"add_weighted_adapter: {len(names)} adapters ({', '.join(map(repr, names))}) but {len(weights)} weights"
        )
    bad = [
        w for w in weights if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w)
    ]
    if bad:
        raise AdapterMixError(f"add_weighted_adapter: weights must be finite numbers, got {bad!r}")
    if isinstance(adapter_name, str) and adapter_name in adapter_configs(model):
        raise AdapterNameError(
            f"add_weighted_adapter: an adapter {adapter_name!r} exists already; pick another name"
        )
    check_adapter_name(adapter_name)
    if combination_type not in COMBINATIONS:
        raise AdapterMixError(
            f"add_weighted_adapter: combination_type={combination_type!r}; loragen implements "
            f"{', '.join(map(repr, COMBINATIONS))}"
        )
    if len(names) == 1:
        combination_type = "linear"
    configs = adapter_configs(model)
    layers = {
        p: layer for p, layer in find_lora_layers(model).items() if any(has_adapter(layer, n) for n in names)
    }
    variants = {  # each adapter's variant (one per adapter: it follows the adapter's config)
        n: adapter_factors(layer, n).variant
        for layer in layers.values()
        for n in names
        if has_adapter(layer, n)
    }
    uncombinable = [n for n in names if n in variants and not variants[n].combinable]
    if uncombinable:
        title = variants[uncombinable[0]].title
        raise AdapterMixError(
            f"add_weighted_adapter: adapter(s) {', '.join(map(repr, uncombinable))} use {title}; a weighted sum of "
            f"factors leaves out what {title} adds to them, so loragen does not combine {title} adapters"
        )
    ranks = {  # the largest rank of each (peft: max(r, *rank_pattern.values()))
        n: max_rank(c)
        if (c := configs.get(n)) is not None
        else max(adapter_factors(layer, n).r for layer in layers.values() if has_adapter(layer, n))
        for n in names
    }
    if combination_type == "linear" and len(set(ranks.values())) > 1:
        described = ", ".join(f"{n!r} r={r}" for n, r in ranks.items())
        raise AdapterMixError(
            f"combination_type='linear' needs adapters of one rank, but {described}; use 'cat' or 'svd'"
        )
    new_rank = {"linear": ranks[names[0]], "cat": sum(ranks.values())}.get(
        combination_type, svd_rank or max(ranks.values())
    )
    targets = _new_targets(names, configs)
    first = configs.get(names[0])
    if first is None:
        config = LoraConfig(r=new_rank, lora_alpha=new_rank, target_modules=sorted(layers))
    else:
        config = first.replace(
            r=new_rank,
            lora_alpha=new_rank,
            target_modules=targets if targets is not None else sorted(layers),
            rank_pattern={},
            alpha_pattern={},
        )
    # every layer's factors first: an error leaves the model unchanged
    combined = {
        path: combine(
            [
                (n, adapter_factors(layer, n), float(w))
                for n, w in zip(names, weights)
                if has_adapter(layer, n)
            ],
            combination_type,
            new_rank,
            path=path,
            svd_clamp=svd_clamp,
            svd_full_matrices=svd_full_matrices,
            svd_driver=svd_driver,
        )
        for path, layer in layers.items()
    }
    for path, layer in layers.items():
        a, b = combined[path]
        factors = add_factors(
            layer,
            adapter_name,
            r=new_rank,
            lora_alpha=new_rank,
            lora_dropout=config.lora_dropout,
            use_rslora=config.use_rslora,
        )
        factors.factor_a.data.copy_(a)
        factors.factor_b.data.copy_(b)
        factors.requires_grad_(False)
    record_config(model, adapter_name, config)
