"""Sub-models built by transformers' auto classes, found statically: ``AutoModel.from_config(...)`` in ``__init__``.

Composite models (Gemma 3, Qwen3-VL, LLaVA, InternVL, Voxtral, ...) build their vision, audio and text
sub-models with ``AutoModel.from_config(config.text_config)``, which returns transformers' own classes: a
rewrite that only swaps constructor calls would leave them without LoRA layers. The scanner reports each such
call as a :class:`~loragen.source.fields.FactoryCall`; the rewrite makes it build through a LoRA auto class
bound once at module level (see :mod:`loragen.source.composite` for what it does at run time)::

    LoraAutoModel = lora_auto_class(AutoModel, [Gemma3TextModel], LORA_CONFIG)
    ...
            self.language_model = LoraAutoModel.from_config(config.text_config)

A second scan recognises ``LoraAutoModel.from_config(...)`` as already rewritten.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import libcst as cst

from loragen.source.syntax import code_of

__all__ = [
    "AUTO_METHODS",
    "LORA_AUTO_CLASS",
    "AutoFactory",
    "auto_bindings",
    "auto_factory",
    "lora_auto_name",
]

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
