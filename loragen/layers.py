"""LoRA layers: Linear, Embedding, Conv1d, Conv2d and transformers' Conv1D.

Each LoRA layer *subclasses* the torch layer it replaces, so it keeps the base ``weight`` / ``bias``
parameters under their usual state-dict keys (a base checkpoint loads into a converted model unchanged)
and its constructor is a superset of the torch one: ``nn.Linear(i, o)`` -> ``LoraLinear(i, o, r=8)``.
The LoRA factors are plain parameters on the layer (as in loralib):

    Linear, Conv1D   lora_A (r, in_features)          lora_B (out_features, r)
    Embedding        lora_embedding_A (r, num_emb)    lora_embedding_B (embedding_dim, r)
    ConvNd           lora_A (r, in_ch // groups, *k)  lora_B (out_ch, r, 1, ...)

    y = base(x) + scaling * B(A(dropout(x)))      scaling = lora_alpha / r  (/ sqrt(r) with rsLoRA)

Merging adds ``scaling * B @ A`` to the base weight in its own layout, computed in float32 and rounded
once. For convolutions the LoRA branch runs with *all* of the base layer's settings (stride, padding
including ``'same'``, dilation, padding mode, groups), so merged and unmerged outputs agree for every
configuration; with ``groups > 1`` the branch convolves with the composed ``B @ A`` weight, which is
exactly what merging adds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, Union

from typing_extensions import Self

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loragen import siblings
from loragen.config import LoraConfigError
from loragen.ops import lora_linear, lora_linear_reference

__all__ = [
    "LoraLayer",
    "LoraLinear",
    "LoraEmbedding",
    "LoraConv1d",
    "LoraConv2d",
    "LoraConv1D",
    "LoraMergeError",
    "adapter_dtype_for",
]

InitMode = Union[bool, Literal["gaussian"]]


class LoraMergeError(RuntimeError):
    """The layer cannot be merged exactly (e.g. an Embedding with ``max_norm``)."""


def adapter_dtype_for(base_dtype: torch.dtype) -> torch.dtype:
    """The dtype LoRA factors get for a base weight of ``base_dtype``.

    Half-precision bases (fp16, bf16) get float32 adapters, as peft does by default: the factors are
    small and their updates would lose most of their bits in 8 significant bits. Other floating dtypes
    are kept.
    """
    if base_dtype in (torch.float16, torch.bfloat16) or not base_dtype.is_floating_point:
        return torch.float32
    return base_dtype


def _check_lora_args(r: int, lora_alpha: float, lora_dropout: float, init_lora_weights: Any) -> None:
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise LoraConfigError(f"r={r!r}: the rank must be a positive integer")
    if isinstance(lora_alpha, bool) or not isinstance(lora_alpha, (int, float)) or not math.isfinite(lora_alpha):
        raise LoraConfigError(f"lora_alpha={lora_alpha!r}: expected a finite number")
    if isinstance(lora_dropout, bool) or not isinstance(lora_dropout, (int, float)) or not 0 <= lora_dropout < 1:
        raise LoraConfigError(f"lora_dropout={lora_dropout!r}: expected a probability with 0 <= p < 1")
    if init_lora_weights not in (True, False, "gaussian") or not isinstance(init_lora_weights, (bool, str)):
        raise LoraConfigError(f"init_lora_weights={init_lora_weights!r}: expected True, False or 'gaussian'")


class LoraLayer(nn.Module):
    """Common state and behaviour of all LoRA layers (a mixin; the concrete classes also subclass a
    torch layer, which comes first in the MRO so its ``forward``-related attributes are the real ones).

    Attributes:
        r: rank. lora_alpha: alpha. scaling: the factor applied to the LoRA branch.
        lora_dropout_p: dropout probability on the branch's input. use_rslora: rank-stabilised scaling.
        merged: whether ``scaling * B @ A`` is currently added into ``weight``.
    """

    # attribute name of the factor applied first / second, and their keys in peft's files
    _factor_names: tuple[str, str] = ("lora_A", "lora_B")
    _peft_suffixes: tuple[str, str] = ("lora_A.weight", "lora_B.weight")

    weight: nn.Parameter
    r: int
    lora_alpha: float
    scaling: float
    lora_dropout_p: float
    use_rslora: bool
    merged: bool

    def _setup_lora(
        self,
        r: int,
        lora_alpha: float,
        lora_dropout: float,
        use_rslora: bool,
        init_lora_weights: InitMode,
    ) -> None:
        _check_lora_args(r, lora_alpha, lora_dropout, init_lora_weights)
        self.r = r
        self.lora_alpha = lora_alpha
        self.use_rslora = bool(use_rslora)
        self.scaling = lora_alpha / (math.sqrt(r) if use_rslora else r)
        self.lora_dropout_p = float(lora_dropout)
        self.merged = False
        factory = {"device": self.weight.device, "dtype": adapter_dtype_for(self.weight.dtype)}
        a_shape, b_shape = self._factor_shapes()
        first, second = self._factor_names
        setattr(self, first, nn.Parameter(torch.empty(a_shape, **factory)))
        setattr(self, second, nn.Parameter(torch.empty(b_shape, **factory)))
        if self.weight.device.type != "meta":
            self.reset_lora_parameters(init_lora_weights)

    def _factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        raise NotImplementedError(f"{type(self).__name__} must define the shapes of its LoRA factors")

    # ---- factors -----------------------------------------------------------------------------

    @property
    def factor_a(self) -> nn.Parameter:
        """The first LoRA factor (``lora_A``, or ``lora_embedding_A``)."""
        return getattr(self, self._factor_names[0])

    @property
    def factor_b(self) -> nn.Parameter:
        """The second LoRA factor (``lora_B``, or ``lora_embedding_B``)."""
        return getattr(self, self._factor_names[1])

    def lora_parameters(self) -> dict[str, nn.Parameter]:
        """The LoRA parameters by attribute name, ``{"lora_A": ..., "lora_B": ...}``."""
        return {name: getattr(self, name) for name in self._factor_names}

    def peft_key_suffixes(self) -> dict[str, str]:
        """Attribute name -> the key suffix peft uses in ``adapter_model.safetensors``.

        ``{"lora_A": "lora_A.weight", "lora_B": "lora_B.weight"}`` for Linear / Conv / Conv1D, and
        ``{"lora_embedding_A": "lora_embedding_A", ...}`` for Embedding.
        """
        return dict(zip(self._factor_names, self._peft_suffixes))

    def reset_lora_parameters(self, init_lora_weights: InitMode = True) -> None:
        """(Re)initialise A and B as peft does.

        ``True``: A kaiming-uniform(a=sqrt(5)), B zeros (the adapter starts as a no-op);
        ``"gaussian"``: A normal(0, 1/r), B zeros; ``False``: both kaiming-uniform (not a no-op).
        """
        with torch.no_grad():
            a, b = self.factor_a, self.factor_b
            if init_lora_weights == "gaussian":
                nn.init.normal_(a, std=1.0 / self.r)
            else:
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            if init_lora_weights is False:
                nn.init.kaiming_uniform_(b, a=math.sqrt(5))
            else:
                nn.init.zeros_(b)

    # ---- merging --------------------------------------------------------------------------------

    def _merge_dtype(self) -> torch.dtype:
        """float32, or float64 for float64 weights: merges never compute in less than float32."""
        return torch.promote_types(self.weight.dtype, torch.float32)

    def delta_weight(self) -> Tensor:
        """``scaling * B @ A`` in the base weight's layout, in float32 (float64 for float64 weights)."""
        raise NotImplementedError

    def _check_mergeable(self) -> None:
        """Raise :class:`LoraMergeError` if merged and unmerged outputs could not agree."""

    @torch.no_grad()
    def merge(self) -> None:
        """Add ``scaling * B @ A`` into ``weight`` (float32 math, rounded once). A no-op if merged."""
        if self.merged:
            return
        self._check_mergeable()
        w = self.weight
        w.copy_((w.to(self._merge_dtype()) + self.delta_weight()).to(w.dtype))
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Subtract the LoRA update from ``weight`` again. A no-op if not merged.

        In float32 the original weight comes back up to rounding; in fp16/bf16 each merge/unmerge
        round trip can move a weight by up to one unit in its last place.
        """
        if not self.merged:
            return
        w = self.weight
        w.copy_((w.to(self._merge_dtype()) - self.delta_weight()).to(w.dtype))
        self.merged = False

    def to_base(self) -> nn.Module:
        """A plain torch layer holding this layer's current (possibly merged) weight and bias.

        The returned layer shares the ``weight`` / ``bias`` parameters (no copy).
        """
        raise NotImplementedError

    def lora_extra_repr(self) -> str:
        return (
            f"r={self.r}, lora_alpha={self.lora_alpha:g}, scaling={self.scaling:g}, "
            f"lora_dropout={self.lora_dropout_p:g}" + (", merged" if self.merged else "")
        )


def _share_base_params(layer: nn.Module, base: nn.Module) -> None:
    """Point ``layer``'s weight and bias at ``base``'s parameters (no copy) and copy its mode."""
    layer.weight = base.weight
    layer.bias = base.bias
    layer.train(base.training)


def _plain_copy(cls: type[nn.Module], layer: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    with torch.device("meta"):
        plain = cls(*args, **kwargs)
    _share_base_params(plain, layer)
    return plain


# ---- Linear ---------------------------------------------------------------------------------------


class LoraLinear(nn.Linear, LoraLayer):
    """``nn.Linear`` with a LoRA adapter. Shapes: x (..., in) -> y (..., out).

    The forward runs the fused LoRA op (:func:`loragen.ops.lora_linear`), sharing the rank-r
    down-projection with sibling layers that read the same input (:mod:`loragen.siblings`); set
    ``fused = False`` to run the plain-autograd reference instead.
    """

    fused: bool = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        r: int = 8,
        lora_alpha: float = 8,
        lora_dropout: float = 0.0,
        use_rslora: bool = False,
        init_lora_weights: InitMode = True,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights)

    def _factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.r, self.in_features), (self.out_features, self.r)

    @classmethod
    def from_module(
        cls,
        base: nn.Linear,
        *,
        r: int = 8,
        lora_alpha: float = 8,
        lora_dropout: float = 0.0,
        use_rslora: bool = False,
        init_lora_weights: InitMode = True,
    ) -> LoraLinear:
        """Wrap an existing ``nn.Linear``, sharing its weight and bias parameters."""
        with torch.device("meta"):
            layer = cls(base.in_features, base.out_features, bias=base.bias is not None, r=r)
        _share_base_params(layer, base)
        layer._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        if self.merged:
            return F.linear(x, self.weight, self.bias)
        if self.fused:
            y = siblings.forward(self, x)  # shares its down-projection with siblings reading x
            if y is not None:
                return y
        fn = lora_linear if self.fused else lora_linear_reference
        return fn(
            x, self.weight, self.bias, self.lora_A, self.lora_B, self.scaling, self.lora_dropout_p, self.training
        )

    def delta_weight(self) -> Tensor:
        return (self.lora_B.to(self._merge_dtype()) @ self.lora_A.to(self._merge_dtype())) * self.scaling

    def to_base(self) -> nn.Linear:
        return _plain_copy(nn.Linear, self, self.in_features, self.out_features, bias=self.bias is not None)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.lora_extra_repr()}"


# ---- Embedding ------------------------------------------------------------------------------------


class LoraEmbedding(nn.Embedding, LoraLayer):
    """``nn.Embedding`` with a LoRA adapter. Shapes: ids (...) -> y (..., embedding_dim).

    As in peft, the LoRA branch of an embedding has no dropout (``lora_dropout`` is accepted and
    ignored) and its factors are initialised A = 0, B ~ normal(0, 1). The branch looks up ids with the
    base's ``padding_idx`` (that row of A gets no gradient). ``max_norm`` renormalises looked-up rows,
    which is not linear: such a layer trains, but cannot be merged exactly and refuses to.
    """

    _factor_names = ("lora_embedding_A", "lora_embedding_B")
    _peft_suffixes = ("lora_embedding_A", "lora_embedding_B")

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
    ) -> None:
        super().__init__(
            num_embeddings, embedding_dim, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse,
            _weight, _freeze, device, dtype,
        )
        self.bias = None  # embeddings have no bias; keeps the LoraLayer interface uniform
        self._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights)

    def _factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.r, self.num_embeddings), (self.embedding_dim, self.r)

    @classmethod
    def from_module(
        cls,
        base: nn.Embedding,
        *,
        r: int = 8,
        lora_alpha: float = 8,
        lora_dropout: float = 0.0,
        use_rslora: bool = False,
        init_lora_weights: InitMode = True,
    ) -> LoraEmbedding:
        """Wrap an existing ``nn.Embedding``, sharing its weight parameter."""
        with torch.device("meta"):
            layer = cls(
                base.num_embeddings, base.embedding_dim, base.padding_idx, base.max_norm, base.norm_type,
                base.scale_grad_by_freq, base.sparse, r=r,
            )
        layer.weight = base.weight
        layer.train(base.training)
        layer._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights)
        return layer

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
        result = self._lookup(ids, self.weight)
        if self.merged:
            return result
        # (..., r): row lookup in A^T is A[:, ids]^T, exactly the one-hot product A @ onehot(ids)
        after_a = F.embedding(ids, self.lora_embedding_A.t(), self.padding_idx, None, 2.0, self.scale_grad_by_freq,
                              self.sparse)
        lora = after_a @ self.lora_embedding_B.t()  # (..., embedding_dim)
        return (result + lora * self.scaling).to(result.dtype)

    def delta_weight(self) -> Tensor:
        # (num_embeddings, embedding_dim), the layout of the embedding table
        return (self.lora_embedding_B.to(self._merge_dtype()) @ self.lora_embedding_A.to(self._merge_dtype())).t() * self.scaling

    def _check_mergeable(self) -> None:
        if self.max_norm is not None:
            raise LoraMergeError(
                f"cannot merge a LoRA Embedding with max_norm={self.max_norm}: the renormalisation of looked-up "
                "rows is not linear, so merged and unmerged outputs would differ"
            )

    def to_base(self) -> nn.Embedding:
        with torch.device("meta"):
            plain = nn.Embedding(
                self.num_embeddings, self.embedding_dim, self.padding_idx, self.max_norm, self.norm_type,
                self.scale_grad_by_freq, self.sparse,
            )
        plain.weight = self.weight
        plain.train(self.training)
        return plain

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.lora_extra_repr()}"


# ---- Convolutions -------------------------------------------------------------------------------


class _LoraConvNd(LoraLayer):
    """Shared code of :class:`LoraConv1d` and :class:`LoraConv2d` (mixed into the torch conv class)."""

    _conv = staticmethod(F.conv2d)
    _base_cls: type[nn.Module] = nn.Conv2d

    in_channels: int
    out_channels: int
    kernel_size: tuple[int, ...]
    groups: int
    bias: nn.Parameter | None

    def _factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        ones = (1,) * len(self.kernel_size)
        return (self.r, self.in_channels // self.groups, *self.kernel_size), (self.out_channels, self.r, *ones)

    def _conv_args(self) -> dict[str, Any]:
        return {
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "kernel_size": self.kernel_size,
            "stride": self.stride,
            "padding": self.padding,
            "dilation": self.dilation,
            "groups": self.groups,
            "bias": self.bias is not None,
            "padding_mode": self.padding_mode,
        }

    @classmethod
    def from_module(
        cls,
        base: nn.Module,
        *,
        r: int = 8,
        lora_alpha: float = 8,
        lora_dropout: float = 0.0,
        use_rslora: bool = False,
        init_lora_weights: InitMode = True,
    ) -> Self:
        """Wrap an existing ``nn.Conv1d`` / ``nn.Conv2d``, sharing its weight and bias parameters."""
        with torch.device("meta"):
            layer = cls(  # type: ignore[call-arg]
                base.in_channels, base.out_channels, base.kernel_size, stride=base.stride, padding=base.padding,
                dilation=base.dilation, groups=base.groups, bias=base.bias is not None,
                padding_mode=base.padding_mode, r=r,
            )
        _share_base_params(layer, base)
        layer._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights)
        return layer

    def _composed_weight(self) -> Tensor:
        """``B @ A`` reshaped to the base weight's shape (cout, cin // groups, *k), in the adapter dtype."""
        a, b = self.lora_A, self.lora_B
        return (b.flatten(1) @ a.flatten(1)).view(self.out_channels, *a.shape[1:])

    def forward(self, x: Tensor) -> Tensor:
        result = self._conv_forward(x, self.weight, self.bias)  # type: ignore[attr-defined]
        if self.merged:
            return result
        x_lora = x.to(self.lora_A.dtype)
        if self.lora_dropout_p > 0:
            x_lora = F.dropout(x_lora, self.lora_dropout_p, self.training)
        if self.groups == 1:
            # A with every base setting (stride, padding, dilation, padding mode), then B as a 1x1 conv:
            # the same linear map as convolving with B @ A, through an r-channel bottleneck.
            hidden = self._conv_forward(x_lora, self.lora_A, None)  # type: ignore[attr-defined]
            lora = self._conv(hidden, self.lora_B)
        else:
            # A grouped weight cannot be factored through r channels; convolve with the composed weight.
            lora = self._conv_forward(x_lora, self._composed_weight(), None)  # type: ignore[attr-defined]
        return (result + lora * self.scaling).to(result.dtype)

    def delta_weight(self) -> Tensor:
        a, b = self.lora_A.to(self._merge_dtype()), self.lora_B.to(self._merge_dtype())
        return (b.flatten(1) @ a.flatten(1)).view(self.weight.shape) * self.scaling

    def to_base(self) -> nn.Module:
        return _plain_copy(self._base_cls, self, **self._conv_args())


class LoraConv1d(nn.Conv1d, _LoraConvNd):
    """``nn.Conv1d`` with a LoRA adapter. Shapes: x (N, C_in, L) -> y (N, C_out, L_out)."""

    _conv = staticmethod(F.conv1d)
    _base_cls = nn.Conv1d

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int],
        stride: int | tuple[int] = 1,
        padding: str | int | tuple[int] = 0,
        dilation: int | tuple[int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        r: int = 8,
        lora_alpha: float = 8,
        lora_dropout: float = 0.0,
        use_rslora: bool = False,
        init_lora_weights: InitMode = True,
    ) -> None:
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode,
            device, dtype,
        )
        self._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights)

    # the torch conv class comes first in the MRO; take the LoRA forward explicitly
    forward = _LoraConvNd.forward

    def extra_repr(self) -> str:
        return f"{nn.Conv1d.extra_repr(self)}, {self.lora_extra_repr()}"


class LoraConv2d(nn.Conv2d, _LoraConvNd):
    """``nn.Conv2d`` with a LoRA adapter. Shapes: x (N, C_in, H, W) -> y (N, C_out, H_out, W_out)."""

    _conv = staticmethod(F.conv2d)
    _base_cls = nn.Conv2d

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: str | int | tuple[int, int] = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        r: int = 8,
        lora_alpha: float = 8,
        lora_dropout: float = 0.0,
        use_rslora: bool = False,
        init_lora_weights: InitMode = True,
    ) -> None:
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode,
            device, dtype,
        )
        self._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights)

    # the torch conv class comes first in the MRO; take the LoRA forward explicitly
    forward = _LoraConvNd.forward

    def extra_repr(self) -> str:
        return f"{nn.Conv2d.extra_repr(self)}, {self.lora_extra_repr()}"


# ---- transformers Conv1D ------------------------------------------------------------------------
# transformers is optional and slow to import: LoraConv1D is built on first use (module __getattr__).


def _build_lora_conv1d() -> type[LoraLayer]:
    try:
        from transformers.pytorch_utils import Conv1D as HFConv1D
    except ImportError as exc:
        raise ImportError(
            "LoraConv1D wraps transformers' Conv1D: install transformers (pip install transformers)"
        ) from exc

    class LoraConv1D(HFConv1D, LoraLayer):  # type: ignore[valid-type,misc]
        """transformers' ``Conv1D`` (GPT-2's c_attn, c_proj, c_fc) with a LoRA adapter.

        ``Conv1D(nf, nx)`` stores its weight as (nx, nf) = (in, out); the LoRA factors keep the Linear
        orientation, A (r, nx) and B (nf, r), as peft does, so adapters are interchangeable with peft.
        """

        fused: bool = True

        def __init__(
            self,
            nf: int,
            nx: int,
            *,
            r: int = 8,
            lora_alpha: float = 8,
            lora_dropout: float = 0.0,
            use_rslora: bool = False,
            init_lora_weights: InitMode = True,
        ) -> None:
            super().__init__(nf, nx)
            self._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights)

        @property
        def in_features(self) -> int:
            return self.nx

        @property
        def out_features(self) -> int:
            return self.nf

        def _factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
            return (self.r, self.in_features), (self.out_features, self.r)

        @classmethod
        def from_module(
            cls,
            base: nn.Module,
            *,
            r: int = 8,
            lora_alpha: float = 8,
            lora_dropout: float = 0.0,
            use_rslora: bool = False,
            init_lora_weights: InitMode = True,
        ) -> LoraConv1D:
            """Wrap an existing transformers ``Conv1D``, sharing its weight and bias parameters."""
            nx, nf = base.weight.shape
            with torch.device("meta"):
                layer = cls(nf, nx, r=r)
            _share_base_params(layer, base)
            layer._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights)
            return layer

        def forward(self, x: Tensor) -> Tensor:
            if self.merged:
                return HFConv1D.forward(self, x)
            if self.fused:
                y = siblings.forward(self, x)
                if y is not None:
                    return y
            fn = lora_linear if self.fused else lora_linear_reference
            return fn(
                x, self.weight, self.bias, self.lora_A, self.lora_B, self.scaling, self.lora_dropout_p,
                self.training, fan_in_fan_out=True,
            )

        def delta_weight(self) -> Tensor:
            # (nx, nf): the transposed Linear-orientation update
            dtype = self._merge_dtype()
            return (self.lora_B.to(dtype) @ self.lora_A.to(dtype)).t() * self.scaling

        def to_base(self) -> nn.Module:
            nx, nf = self.weight.shape
            return _plain_copy(HFConv1D, self, nf, nx)

        __repr__ = nn.Module.__repr__  # Conv1D's own __repr__ would hide the LoRA settings

        def extra_repr(self) -> str:
            return f"nf={self.nf}, nx={self.nx}, {self.lora_extra_repr()}"

    LoraConv1D.__module__ = __name__
    LoraConv1D.__qualname__ = "LoraConv1D"
    return LoraConv1D


def __getattr__(name: str) -> Any:
    if name == "LoraConv1D":
        cls = _build_lora_conv1d()
        globals()[name] = cls  # built once; later lookups are plain module attributes
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def lora_layer_types() -> Sequence[type[LoraLayer]]:
    """All concrete LoRA layer classes (LoraConv1D only when transformers is installed)."""
    types: list[type[LoraLayer]] = [LoraLinear, LoraEmbedding, LoraConv1d, LoraConv2d]
    try:
        types.append(__getattr__("LoraConv1D"))
    except ImportError:
        pass
    return tuple(types)
