"""``LoraEmbedding``: ``nn.Embedding`` with a LoRA adapter (peft's embedding semantics)."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loragen.config import InitMode
from loragen.errors import LoraMergeError
from loragen.layers.adapter_set import LoraAdapter
from loragen.layers.base import LoraLayer
from loragen.layers.variants import EMBEDDING_DORA, Variant

__all__ = ["LoraEmbedding"]


class LoraEmbedding(nn.Embedding, LoraLayer):
    """``nn.Embedding`` with a LoRA adapter. Shapes: ids (...) -> y (..., embedding_dim).

    As in peft the branch has no dropout (``lora_dropout`` is ignored), A starts at 0 and B ~ normal(0, 1).
    It looks ids up with the base's ``padding_idx`` (that row of A gets no gradient). ``max_norm``
    renormalises looked-up rows, which is not linear: such a layer trains but refuses to merge. A subclass of
    ``nn.Embedding`` gets a class derived from this one whose base output is the subclass's own forward (as in
    peft); it merges only if that forward is the plain row lookup (checked on probe ids). A scalar
    ``embed_scale`` attribute (transformers' scaled word embeddings) scales the LoRA rows too, as in peft.
    """

    lora_embedding_A: nn.Parameter
    lora_embedding_B: nn.Parameter

    base_class = nn.Embedding
    dora_variant: ClassVar[Variant | None] = EMBEDDING_DORA
    bias = None  # embeddings have no bias; keeps the LoraLayer interface uniform

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: Tensor | None = None,
        _freeze: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        r: int = 8,
        lora_alpha: float = 8,
        lora_dropout: float = 0.0,
        use_rslora: bool = False,
        init_lora_weights: InitMode = True,
        use_dora: bool = False,
    ) -> None:
        super().__init__(
            num_embeddings,
            embedding_dim,
            padding_idx,
            max_norm,
            norm_type,
            scale_grad_by_freq,
            sparse,
            _weight,
            _freeze,
            device,
            dtype,
        )
        self._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights, use_dora)

    # nn.Embedding comes first in the MRO; take the LoRA forward explicitly
    forward = LoraLayer.forward

    def _factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.r, self.num_embeddings), (self.embedding_dim, self.r)

    def _adapter_output(self, ids: Tensor, adapter: LoraAdapter) -> Tensor:
        # (..., r): row lookup in A^T is A[:, ids]^T, exactly the one-hot product A @ onehot(ids)
        after_a = F.embedding(
            ids, adapter.factor_a.t(), self.padding_idx, None, 2.0, self.scale_grad_by_freq, self.sparse
        )
        term = (after_a @ adapter.factor_b.t()) * adapter.scaling  # (..., embedding_dim)
        embed_scale = self._embed_scale()
        return term if embed_scale is None else term * embed_scale.to(term.dtype)

    def _embed_scale(self) -> Tensor | None:
        """The layer's scalar ``embed_scale``, or None. transformers' scaled word embeddings (Gemma 3, BART, ...)
        multiply the looked-up rows by it in their forward; as in peft, it scales the LoRA rows too (so merging
        stays exact). A non-scalar ``embed_scale`` is not applied (peft warns and ignores it too)."""
        scale = getattr(self, "embed_scale", None)
        if isinstance(scale, (int, float)) and not isinstance(scale, bool):
            return torch.tensor(scale, dtype=self.weight.dtype, device=self.weight.device)
        if isinstance(scale, Tensor) and scale.numel() == 1:
            return scale
        return None

    def _check_mergeable(self) -> None:
        super()._check_mergeable()
        if self.max_norm is not None:
            raise LoraMergeError(
                f"cannot merge a LoRA Embedding with max_norm={self.max_norm}: the renormalisation of looked-up "
                "rows is not linear, so merged and unmerged outputs would differ"
            )
        if self.base_class.forward is nn.Embedding.forward and self._embed_scale() is None:
            return
        # a subclass with its own forward (or an embed_scale): merging is exact only if the forward looks rows up
        # in the stored weight times embed_scale, which scales the LoRA rows. Check on a few ids, not assume it.
        ids = torch.arange(min(self.num_embeddings, 8), device=self.weight.device)
        with torch.no_grad():
            actual = self._base_output(ids)
            expected = F.embedding(ids, self.weight, self.padding_idx)
            embed_scale = self._embed_scale()
            if embed_scale is not None:
                expected = expected * embed_scale.to(expected.dtype)
        if actual.shape != expected.shape or not torch.allclose(actual, expected, rtol=1e-3, atol=1e-4):
            scaled = "" if embed_scale is None else " times its embed_scale"
            raise LoraMergeError(
                f"cannot merge into {type(self).__qualname__}: its forward does not look ids up as rows of its "
                f"stored weight{scaled} (checked on probe ids), so adding the update to the weight would change "
                "what the layer computes. Keep the adapter unmerged"
            )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.lora_extra_repr()}"
