"""``LoraEmbedding``: ``nn.Embedding`` with a LoRA adapter (peft's embedding semantics)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loragen.layers import adapter_routing, dora
from loragen.layers.adapter_set import Factors
from loragen.layers.base import InitMode, LoraLayer, LoraMergeError
from loragen.registry import EMBEDDING, LayerSpec, register

__all__ = ["LoraEmbedding"]


class LoraEmbedding(nn.Embedding, LoraLayer):
    """``nn.Embedding`` with a LoRA adapter. Shapes: ids (...) -> y (..., embedding_dim).

    As in peft, the LoRA branch of an embedding has no dropout (``lora_dropout`` is accepted and
    ignored) and its factors are initialised A = 0, B ~ normal(0, 1). The branch looks up ids with the
    base's ``padding_idx`` (that row of A gets no gradient). ``max_norm`` renormalises looked-up rows,
    which is not linear: such a layer trains, but cannot be merged exactly and refuses to.
    """

    lora_embedding_A: nn.Parameter
    lora_embedding_B: nn.Parameter
    lora_magnitude_vector: nn.Parameter  # with use_dora only: (embedding_dim,)

    base_class = nn.Embedding
    supports_dora = True  # loragen.layers.dora
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

    def _factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.r, self.num_embeddings), (self.embedding_dim, self.r)

    def reset_lora_parameters(self, init_lora_weights: InitMode = True) -> None:
        """peft's embedding init: A zeros, B normal(0, 1); ``False``: both standard normal."""
        with torch.no_grad():
            if init_lora_weights is False:
                nn.init.normal_(self.lora_embedding_A)
            else:
                nn.init.zeros_(self.lora_embedding_A)
            nn.init.normal_(self.lora_embedding_B)

    def _lookup(self, ids: Tensor, table: Tensor) -> Tensor:
        return F.embedding(
            ids, table, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse
        )

    def forward(self, ids: Tensor) -> Tensor:
        if self._lora_detour:  # another adapter active, adapters off, or a mixed batch
            return adapter_routing.forward(self, ids)
        result = self._lookup(ids, self.weight)
        if self.merged:
            return result
        if self.use_dora:
            return self._dora_output(ids, self, result)
        return (result + self._lora_term(ids, self)).to(result.dtype)

    def _lora_term(self, ids: Tensor, factors: Factors) -> Tensor:
        # (..., r): row lookup in A^T is A[:, ids]^T, exactly the one-hot product A @ onehot(ids)
        after_a = F.embedding(
            ids, factors.factor_a.t(), self.padding_idx, None, 2.0, self.scale_grad_by_freq, self.sparse
        )
        return (after_a @ factors.factor_b.t()) * factors.scaling  # (..., embedding_dim)

    def _dora_output(self, ids: Tensor, factors: Factors, result: Tensor) -> Tensor:
        """peft's DoRA for embeddings: ``c * (table row + s * lora row)``, ``c = m / ||W + s (B A)^T||`` per
        embedding column, detached."""
        c = getattr(factors, dora.MAGNITUDE) / dora.weight_norm(self, factors)
        return (c * result + c * self._lora_term(ids, factors)).to(result.dtype)

    def _check_mergeable(self) -> None:
        if self.max_norm is not None:
            raise LoraMergeError(
                f"cannot merge a LoRA Embedding with max_norm={self.max_norm}: the renormalisation of looked-up "
                "rows is not linear, so merged and unmerged outputs would differ"
            )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.lora_extra_repr()}"


register(
    LayerSpec(
        "torch.nn.Embedding",
        "loragen.layers.LoraEmbedding",
        ("torch.nn.modules.sparse.Embedding",),
        EMBEDDING,
        lora_class=LoraEmbedding,
    )
)
