"""Layouts: how a layer type's LoRA factors are named, saved in peft's files, initialised and merged into
its weight (:class:`PlainLayout`, :class:`TransposedLayout`, :class:`EmbeddingLayout`), and how factors
line up with a targeted parameter (:class:`ParameterLayout`: MoE expert stacks). The registry gives each
layer type its layout.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from loragen.config import InitMode

__all__ = [
    "EMBEDDING",
    "EXPERTS",
    "EXPERTS_TRANSPOSED",
    "LAYOUTS",
    "PLAIN",
    "TRANSPOSED",
    "EmbeddingLayout",
    "Layout",
    "ParameterLayout",
    "PlainLayout",
    "TransposedLayout",
    "factor_suffixes",
]

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Layout(ABC):
    """How a layer's two LoRA factors are named, stored in peft's files, initialised and merged into its
    weight; each kind of weight is a subclass.

    Attributes:
        name: the layout's name for messages and :func:`loragen.register_layer`.
        factor_names: the attribute names of A and B on a loragen layer.
        peft_suffixes: the key suffixes of A and B in peft's ``adapter_model.safetensors``.
    """

    name: str
    factor_names: tuple[str, str]
    peft_suffixes: tuple[str, str]

    @abstractmethod
    def weight_shape(self, a: Shape, b: Shape) -> Shape:
        """The shape of the base weight that factors of shapes ``a`` (A) and ``b`` (B) update."""

    @abstractmethod
    def fits(self, a: Shape, b: Shape) -> bool:
        """Whether factors of shapes ``a`` (A) and ``b`` (B) are a pair of this layout."""

    @abstractmethod
    def delta(self, a: Tensor, b: Tensor) -> Tensor:
        """``B @ A`` in the base weight's layout (unscaled), in the factors' dtype."""

    @abstractmethod
    def delta_row_factors(self, a: Tensor, b: Tensor, start: int, stop: int) -> tuple[Tensor, Tensor]:
        """``(rows, r)`` and ``(r, -1)`` matrices whose product is rows ``start:stop`` of :meth:`delta`
        flattened, so a streaming merge adds a block in place (``block.addmm_(*factors, alpha=s)``)."""

    def init_factors(self, a: Tensor, b: Tensor, r: int, init: InitMode) -> None:
        """Initialise new factors in place as peft does: ``True``: A kaiming-uniform(a=sqrt(5)), B zeros;
        ``"gaussian"``: A normal(0, 1/r), B zeros; ``False``: both kaiming-uniform (not a no-op)."""
        with torch.no_grad():
            if init == "gaussian":
                nn.init.normal_(a, std=1.0 / r)
            else:
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            if init is False:
                nn.init.kaiming_uniform_(b, a=math.sqrt(5))
            else:
                nn.init.zeros_(b)


@dataclasses.dataclass(frozen=True)
class PlainLayout(Layout):
    """A weight stored ``(out, in, *kernel)``: Linear and ConvNd. A ``(r, in, *kernel)``, B ``(out, r, 1, ...)``
    with as many dimensions; the update is ``B @ A`` viewed as the weight."""

    def weight_shape(self, a: Shape, b: Shape) -> Shape:
        return (b[0], *a[1:])

    def fits(self, a: Shape, b: Shape) -> bool:
        return len(a) >= 2 and len(a) == len(b) and a[0] == b[1] and all(d == 1 for d in b[2:])

    def delta(self, a: Tensor, b: Tensor) -> Tensor:
        product = b.flatten(1) @ a.flatten(1)  # (out, in * prod(kernel))
        return product.view(self.weight_shape(tuple(a.shape), tuple(b.shape)))

    def delta_row_factors(self, a: Tensor, b: Tensor, start: int, stop: int) -> tuple[Tensor, Tensor]:
        return b[start:stop].flatten(1), a.flatten(1)


@dataclasses.dataclass(frozen=True)
class TransposedLayout(Layout):
    """A weight stored ``(in, out)``: transformers' ``Conv1D``. The factors keep the Linear orientation,
    A ``(r, in)`` and B ``(out, r)``, both 2-D; the update is ``(B @ A)^T``."""

    def weight_shape(self, a: Shape, b: Shape) -> Shape:
        return (a[1], b[0])

    def fits(self, a: Shape, b: Shape) -> bool:
        return len(a) == len(b) == 2 and a[0] == b[1]

    def delta(self, a: Tensor, b: Tensor) -> Tensor:
        return (b @ a).t()

    def delta_row_factors(self, a: Tensor, b: Tensor, start: int, stop: int) -> tuple[Tensor, Tensor]:
        return a[:, start:stop].t(), b.t()


@dataclasses.dataclass(frozen=True)
class EmbeddingLayout(TransposedLayout):
    """An embedding table ``(num_embeddings, dim)``: A ``(r, num_embeddings)``, B ``(dim, r)``; the update is
    ``(B @ A)^T``."""

    def init_factors(self, a: Tensor, b: Tensor, r: int, init: InitMode) -> None:
        """peft's embedding init: A zeros, B normal(0, 1); ``False``: both standard normal."""
        with torch.no_grad():
            if init is False:
                nn.init.normal_(a)
            else:
                nn.init.zeros_(a)
            nn.init.normal_(b)


PLAIN: Layout = PlainLayout("plain", ("lora_A", "lora_B"), ("lora_A.weight", "lora_B.weight"))
TRANSPOSED: Layout = TransposedLayout("transposed", ("lora_A", "lora_B"), ("lora_A.weight", "lora_B.weight"))
EMBEDDING: Layout = EmbeddingLayout(
    "embedding", ("lora_embedding_A", "lora_embedding_B"), ("lora_embedding_A", "lora_embedding_B")
)
LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (PLAIN, TRANSPOSED, EMBEDDING)}


def factor_suffixes() -> Iterator[tuple[str, Layout, int]]:
    """``(peft key suffix, layout, factor index)`` for every factor of every layout: index 0 is A, 1 is B."""
    for layout in LAYOUTS.values():
        for index, suffix in enumerate(layout.peft_suffixes):
            yield suffix, layout, index


@dataclasses.dataclass(frozen=True)
class ParameterLayout:
    """How LoRA factors line up with a parameter targeted by ``target_parameters`` (peft's ``ParamWrapper``).

    A 3-D parameter stacks ``E`` experts, each ``(out, in)`` (``"experts"``) or ``(in, out)``
    (``"experts_transposed"``: modules with ``is_transposed = True``); a 2-D ``(out, in)`` is one expert.
    As in peft, ``A (r*E, in)`` and ``B (out, r*E)``: expert ``e`` owns rows ``e*r .. e*r+r-1`` of A and
    columns ``e, e+E, e+2E, ...`` of B.

    Attributes:
        name: ``"experts"`` or ``"experts_transposed"``.
    """

    name: str
    factor_names: tuple[str, str] = ("lora_A", "lora_B")
    peft_suffixes: tuple[str, str] = ("lora_A.weight", "lora_B.weight")

    def features(self, shape: Shape) -> tuple[int, int, int]:
        """``(num_experts, in_features, out_features)`` of a parameter of ``shape`` (2-D or 3-D).

        Raises:
            ValueError: the parameter is neither 2-D nor 3-D.
        """
        if len(shape) == 2:
            return 1, shape[1], shape[0]
        if len(shape) != 3:
            raise ValueError(
                f"a {len(shape)}-D parameter: LoRA on parameters takes 2-D and 3-D (experts) ones"
            )
        if self.name == "experts_transposed":
            return shape[0], shape[1], shape[2]
        return shape[0], shape[2], shape[1]

    def factor_shapes(self, shape: Shape, r: int) -> tuple[Shape, Shape]:
        """The shapes of A and B for rank ``r`` on a parameter of ``shape``."""
        experts, in_features, out_features = self.features(shape)
        return (r * experts, in_features), (out_features, r * experts)

    def expert_factors(self, a: Tensor, b: Tensor, num_experts: int, ndim: int) -> tuple[Tensor, Tensor]:
        """Two batched factors ``(E, m, r)`` and ``(E, r, n)`` whose product is the update of every expert
        in the stored orientation of a ``ndim``-D parameter (views of ``a`` and ``b``, no copy)."""
        a_e = a.view(num_experts, -1, a.shape[-1])  # (E, r, in)
        b_e = b.view(b.shape[0], -1, num_experts).permute(2, 0, 1)  # (E, out, r)
        if ndim == 3 and self.name == "experts_transposed":
            return a_e.transpose(1, 2), b_e.transpose(1, 2)  # (E, in, r) @ (E, r, out)
        return b_e, a_e  # (E, out, r) @ (E, r, in)

    def delta(self, a: Tensor, b: Tensor, shape: Shape) -> Tensor:
        """``B_e @ A_e`` for every expert, shaped like the parameter (unscaled), in the factors' dtype."""
        left, right = self.expert_factors(a, b, self.features(shape)[0], len(shape))
        return torch.bmm(left, right).view(shape)


EXPERTS = ParameterLayout("experts")
EXPERTS_TRANSPOSED = ParameterLayout("experts_transposed")
