"""Which LoRA linears are siblings (read the same input), planned once, at conversion time.

:func:`plan_siblings` looks at each module that owns two or more linear LoRA layers on the fused path,
asks :func:`loragen.forward_calls.call_groups` which calls ``self.<name>(<var>)`` of its class's
``forward`` share a variable, and records a plan for each such group (:class:`loragen.ops.siblings.Role`
on every member): the first member leads and computes every output, the others take theirs
(:mod:`loragen.ops.siblings`). Nothing here inspects the call stack: the plan depends only on the module
structure and the source, so a forward pass and its recomputation under ``torch.utils.checkpoint`` take the
same path.

The conversion entry points call :func:`plan_siblings` when they finish (``get_lora_model`` and
``mark_trainable``, which rewritten and decorated models and ``load_adapter`` go through, and adding or
deleting a named adapter). LoRA layers that were never planned, or whose parent's source cannot be read,
run on their own: correct, unfused.

A layer takes part when it is a Linear-like LoRA layer whose base forward the fused op replaces: its
class is registered with the PLAIN or TRANSPOSED layout (:mod:`loragen.registry`) and it says
``fused_base``.

Where this sits: planning is a step of conversion, so it lives beside :mod:`loragen.convert`, one layer
below it in the import order (``convert`` and :mod:`loragen.adapters` call it), and above
:mod:`loragen.forward_calls`, the source reading it uses. The op layer keeps only what a plan *is*
(:class:`~loragen.ops.siblings.Role`, :func:`~loragen.ops.siblings.role_of`) and what it does at run time;
it never reads source.
"""

from __future__ import annotations

import threading
from typing import Any

from torch import nn

from loragen.forward_calls import call_groups
from loragen.ops.siblings import Role, role_of, set_role
from loragen.registry import PLAIN, TRANSPOSED, spec_for_lora_type

__all__ = ["fused_groups", "plan_siblings"]

_lock = threading.Lock()


def _fusable(module: nn.Module | None) -> bool:
    if module is None or not getattr(type(module), "fused_base", False):
        return False
    spec = spec_for_lora_type(type(module))
    return spec is not None and spec.layout in (PLAIN, TRANSPOSED)


def plan_siblings(model: nn.Module) -> None:
    """Plan sibling groups for every module of ``model`` (replacing earlier plans for its layers)."""
    for parent in model.modules():
        children = parent._modules
        members = [child for child in children.values() if child is not None and _fusable(child)]
        with _lock:
            for child in members:
                set_role(child, None)
        if len(members) < 2:
            continue
        for names in call_groups(type(parent).forward):
            group: list[tuple[str, Any]] = []
            for name in names:
                candidate = children.get(name)
                if candidate is not None and _fusable(candidate):
                    group.append((name, candidate))
            if len(group) < 2:
                continue
            # members must agree on in_features with the leader; others run alone
            leader = group[0][1]
            group = [(name, m) for name, m in group if m.in_features == leader.in_features]
            if len(group) < 2 or any(role_of(m) is not None for _, m in group):
                continue  # a layer leads or follows in one group only
            group_names = tuple(name for name, _ in group)
            with _lock:
                set_role(leader, Role(group_names, tuple(m for _, m in group[1:])))
                for _, member in group[1:]:
                    set_role(member, Role(group_names))


def fused_groups(model: nn.Module) -> list[tuple[str, ...]]:
    """The sibling groups planned in ``model``, as qualified module names (leader first).

    Example: ``[("model.layers.0.self_attn.q_proj", "...k_proj", "...v_proj"), ...]``.
    """
    groups = []
    for name, module in model.named_modules():
        role = role_of(module)
        if role is not None and role.followers:
            parent = name.rpartition(".")[0]
            groups.append(tuple(f"{parent}.{n}" if parent else n for n in role.names))
    return groups
