"""LoRA classes for subclasses of nn.Linear and for registered layer types: conversion keeps the module's
state, the subclass's own forward computes the base output, merges are exact or refused, and the classes
pickle."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import loragen
from loragen import LoraConfig
from loragen.errors import AdapterError, LoraConversionError, LoraMergeError
from loragen.layers import LoraLinear, lora_class_for
from loragen.registry import unregister


class ScaledLinear(nn.Linear):
    """A subclass whose forward is not x W^T + b: merging into its weight would be wrong."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2.0


class TransposedMatmul(nn.Linear):
    """A subclass whose forward computes x W^T + b another way (as Falcon's FalconLinear does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.weight.T
        return out if self.bias is None else out + self.bias


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = TransposedMatmul(6, 5)
        self.scaled = ScaledLinear(5, 4)
        self.proj.note = "kept"  # an attribute of the instance survives conversion

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scaled(self.proj(x))


def _lora_block(seed: int = 0) -> Block:
    torch.manual_seed(seed)
    block = Block()
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["proj", "scaled"], init_lora_weights=False)
    return loragen.get_lora_model(block, config)


def _reference(block: Block, x: torch.Tensor) -> torch.Tensor:
    """base forward + scaling * B A x for every LoRA layer, computed by hand."""

    def branch(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return h @ layer.lora_A.t() @ layer.lora_B.t() * layer.scaling

    h = x @ block.proj.weight.t() + block.proj.bias + branch(block.proj, x)
    return (h @ block.scaled.weight.t() + block.scaled.bias) * 2.0 + branch(block.scaled, h)


def test_subclasses_convert_with_their_own_forward_and_keep_their_state() -> None:
    block = _lora_block()
    assert isinstance(block.proj, LoraLinear) and isinstance(block.proj, TransposedMatmul)
    assert type(block.proj).__name__ == "LoraTransposedMatmul"
    assert block.proj.note == "kept"
    assert set(block.state_dict()) == {
        "proj.weight",
        "proj.bias",
        "proj.lora_A",
        "proj.lora_B",
        "scaled.weight",
        "scaled.bias",
        "scaled.lora_A",
        "scaled.lora_B",
    }
    x = torch.randn(3, 6)
    torch.testing.assert_close(block(x), _reference(block, x))


def test_merge_is_exact_when_the_subclass_forward_is_linear_and_refused_otherwise() -> None:
    block = _lora_block()
    x = torch.randn(3, 6)
    before = block.proj(x)
    block.proj.merge()
    torch.testing.assert_close(block.proj(x), before, rtol=1e-5, atol=1e-5)
    with pytest.raises(
        LoraMergeError, match=r"scaled: cannot merge into LoraScaledLinear: its forward does not"
    ):
        loragen.merge_adapter(block)
    block.proj.unmerge()
    with pytest.raises(LoraMergeError, match=r"scaled: .*forward does not compute x W\^T \+ b"):
        loragen.merge_and_unload(block)
    assert not block.proj.merged  # a refusal changes nothing


def test_merge_and_unload_gives_the_subclass_back() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(TransposedMatmul(4, 4))
    loragen.get_lora_model(model, LoraConfig(r=2, target_modules=["0"], init_lora_weights=False))
    x = torch.randn(2, 4)
    expected = model(x)
    loragen.merge_and_unload(model)
    assert type(model[0]) is TransposedMatmul
    assert set(model.state_dict()) == {"0.weight", "0.bias"}
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_derived_classes_pickle_deepcopy_and_construct_like_the_base() -> None:
    block = _lora_block()
    x = torch.randn(3, 6)
    expected = block(x)
    for clone in (pickle.loads(pickle.dumps(block)), copy.deepcopy(block)):
        assert type(clone.proj) is type(block.proj)
        torch.testing.assert_close(clone(x), expected)
    cls = lora_class_for(TransposedMatmul)
    layer = cls(6, 3, bias=False, r=4, lora_alpha=8)
    assert layer.lora_A.shape == (4, 6) and layer.lora_B.shape == (3, 4) and layer.bias is None
    assert layer.scaling == 2.0 and cls is lora_class_for(TransposedMatmul)


def test_hooks_on_the_base_module_stay_with_the_lora_layer() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    seen = []
    handle = model[0].register_forward_hook(lambda module, args, out: seen.append(type(module).__name__))
    loragen.get_lora_model(model, LoraConfig(target_modules=["0"]))
    model(torch.randn(1, 4))
    assert seen == ["LoraLinear"]
    handle.remove()
    model(torch.randn(1, 4))
    assert seen == ["LoraLinear"]


def test_multihead_attention_out_proj_is_refused_with_the_reason() -> None:
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(8, 2)})
    with pytest.raises(LoraConversionError, match=r"attn\.out_proj .*never calls its forward"):
        loragen.get_lora_model(model, LoraConfig(target_modules=["out_proj"]))
    # all-linear leaves it out (peft would wrap a layer whose forward never runs)
    with pytest.raises(LoraConversionError, match="matched no module"):
        loragen.get_lora_model(model, LoraConfig(target_modules="all-linear"))


class ToyLinear(nn.Module):
    """A user's own layer that behaves like a Linear (weight (out, in), no bias)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in))

    bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


@pytest.fixture
def toy_registered():
    spec = loragen.register_layer(ToyLinear)
    yield spec
    unregister(spec.base_qualname)


def test_register_layer_makes_a_linear_like_type_convertible(toy_registered) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(ToyLinear(5, 3))
    loragen.get_lora_model(model, LoraConfig(r=2, target_modules="all-linear", init_lora_weights=False))
    layer = model[0]
    assert isinstance(layer, loragen.LoraLayer) and isinstance(layer, ToyLinear)
    assert layer.lora_A.shape == (2, 5) and layer.lora_B.shape == (3, 2)
    x = torch.randn(4, 5)
    expected = x @ layer.weight.t() + x @ layer.lora_A.t() @ layer.lora_B.t() * layer.scaling
    torch.testing.assert_close(model(x), expected)
    loragen.merge_and_unload(model)
    assert type(model[0]) is ToyLinear
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_register_layer_errors_name_the_problem() -> None:
    with pytest.raises(TypeError, match=r"is not an nn\.Module subclass"):
        loragen.register_layer(int)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layout='sideways'"):
        loragen.register_layer(ToyLinear, layout="sideways")
    with pytest.raises(TypeError, match=r"must derive from both loragen\.LoraLayer and ToyLinear"):
        loragen.register_layer(ToyLinear, LoraLinear)
    with pytest.raises(ValueError, match=r"torch\.nn\.Linear is registered already"):
        loragen.register_layer(nn.Linear)


class ScoringRouter(nn.Linear):
    """A linear router that returns (scores, logits), as transformers' Llama-4 and PhiMoE routers do."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        logits = super().forward(x)
        return logits.softmax(-1), logits


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = ScoringRouter(6, 4)
        self.proj = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores, _ = self.router(x)
        return self.proj(x) * scores.sum(-1, keepdim=True)


def test_a_linear_subclass_returning_several_values_says_so_at_its_first_forward() -> None:
    model = loragen.get_lora_model(Routed(), LoraConfig(target_modules="all-linear", init_lora_weights=False))
    with pytest.raises(
        LoraConversionError, match=r"LoraScoringRouter: .* returns a tuple, not a tensor.*exclude"
    ):
        model(torch.randn(2, 6))
    excluded = loragen.get_lora_model(
        Routed(), LoraConfig(target_modules="all-linear", exclude_modules=["router"], init_lora_weights=False)
    )
    assert excluded(torch.randn(2, 6)).shape == (2, 6)


# ---- subclasses of the torch convolutions and of nn.Embedding ---------------------------------------------


class TaggedConv2d(nn.Conv2d):
    """A subclass that keeps nn.Conv2d's forward (adds an attribute only)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.tag = "patch"


class TaggedConv3d(nn.Conv3d):
    """A subclass that keeps nn.Conv3d's forward."""


class ScaledStdConv2d(nn.Conv2d):
    """timm's ScaledStdConv2d (timm.layers.std_conv), as timm writes it: a forward of its own that standardises
    the weight per output channel and scales it by a learned gain."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, ...] | None = None,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        bias: bool = True,
        gamma: float = 1.0,
        eps: float = 1e-6,
        gain_init: float = 1.0,
    ) -> None:
        if padding is None:  # timm's get_padding, per dimension
            dims = [d if isinstance(d, tuple) else (d, d) for d in (kernel_size, stride, dilation)]
            padding = tuple(((s - 1) + d * (k - 1)) // 2 for k, s, d in zip(*dims))
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias)
        self.gain = nn.Parameter(torch.full((self.out_channels, 1, 1, 1), gain_init))
        self.scale = gamma * self.weight[0].numel() ** -0.5
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = torch.nn.functional.batch_norm(
            self.weight.reshape(1, self.out_channels, -1),
            None,
            None,
            weight=(self.gain * self.scale).view(-1),
            training=True,
            momentum=0.0,
            eps=self.eps,
        ).reshape_as(self.weight)
        return torch.nn.functional.conv2d(
            x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups
        )


class PaddedConv2d(nn.Conv2d):
    """A subclass that replaces only ``_conv_forward`` (reflect-pads by hand)."""

    def _conv_forward(
        self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return super()._conv_forward(
            torch.nn.functional.pad(input, (1, 1, 1, 1), mode="reflect"), weight, bias
        )


class ScaledEmbedding(nn.Embedding):
    """An embedding that scales its rows in its forward (as Gemma's scaled word embedding does)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 3.0


class TaggedEmbedding(nn.Embedding):
    """A subclass that keeps nn.Embedding's forward."""


def _bart_embedding() -> nn.Module:
    from transformers.models.bart.modeling_bart import BartScaledWordEmbedding

    return BartScaledWordEmbedding(10, 4, padding_idx=1, embed_scale=2.5)


def _gemma3_embedding() -> nn.Module:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    return Gemma3TextScaledWordEmbedding(10, 4, padding_idx=0, embed_scale=4**0.5)


SUBCLASSES = {
    # kind -> (module factory, input factory, whether merging is exact)
    "conv2d": (lambda: TaggedConv2d(3, 4, 3, stride=2, padding=1), lambda: torch.randn(2, 3, 7, 7), True),
    "conv3d": (lambda: TaggedConv3d(3, 4, (2, 3, 3), stride=2), lambda: torch.randn(2, 3, 4, 7, 7), True),
    "embedding": (lambda: TaggedEmbedding(10, 4, padding_idx=1), lambda: torch.randint(0, 10, (2, 5)), True),
    "scaled_embedding": (lambda: ScaledEmbedding(10, 4), lambda: torch.randint(0, 10, (2, 5)), False),
    # transformers' scaled word embeddings: embed_scale (a float; a tensor buffer) scales the LoRA rows too
    "bart_embedding": (_bart_embedding, lambda: torch.randint(0, 10, (2, 5)), True),
    "gemma3_embedding": (_gemma3_embedding, lambda: torch.randint(0, 10, (2, 5)), True),
}


def _perturb_peft(model: nn.Module) -> None:
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("kind", sorted(SUBCLASSES))
def test_conv_and_embedding_subclasses_adapt_as_peft_does(kind: str, use_dora: bool, tmp_path) -> None:
    peft = pytest.importorskip("peft")
    make, inputs, mergeable = SUBCLASSES[kind]
    torch.manual_seed(0)
    base = nn.Sequential(make()).double().eval()
    x = inputs()
    x = x.double() if x.is_floating_point() else x
    settings = dict(r=2, lora_alpha=4, target_modules=["0"], init_lora_weights=False, use_dora=use_dora)
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**settings))
    _perturb_peft(theirs)
    theirs.save_pretrained(tmp_path)
    ours = loragen.load_adapter(copy.deepcopy(base), tmp_path)
    layer = ours[0]
    assert isinstance(layer, type(base[0])) and isinstance(layer, loragen.LoraLayer)
    assert type(layer).__name__ == f"Lora{type(base[0]).__name__}"
    assert getattr(layer, "tag", None) == getattr(base[0], "tag", None)  # the module's own state is kept
    expected = theirs(x)
    torch.testing.assert_close(ours(x), expected, rtol=1e-10, atol=1e-12)
    if mergeable:
        loragen.merge_adapter(ours)
        torch.testing.assert_close(ours(x), expected, rtol=1e-10, atol=1e-12)
        unloaded = loragen.merge_and_unload(ours)
        assert type(unloaded[0]) is type(base[0])
        torch.testing.assert_close(unloaded(x), expected, rtol=1e-10, atol=1e-12)
    else:
        with pytest.raises(
            LoraMergeError, match=r"0: cannot merge into LoraScaledEmbedding: its forward does not"
        ):
            loragen.merge_adapter(ours)
        assert not layer.merged
        torch.testing.assert_close(ours(x), expected, rtol=1e-10, atol=1e-12)
    clone = pickle.loads(pickle.dumps(loragen.load_adapter(copy.deepcopy(base), tmp_path)))
    torch.testing.assert_close(clone(x), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("make", "method"),
    [(lambda: ScaledStdConv2d(3, 4, 3), "forward"), (lambda: PaddedConv2d(3, 4, 3), "_conv_forward")],
    ids=["scaled_std_conv2d", "own_conv_forward"],
)
def test_a_conv_subclass_with_its_own_forward_is_refused_naming_path_class_and_why(
    make, method: str, tmp_path
) -> None:
    model = nn.ModuleDict({"stem": nn.ModuleDict({"conv": make()}), "plain": nn.Conv2d(3, 4, 3)})
    name = type(model["stem"]["conv"]).__qualname__
    with pytest.raises(
        LoraConversionError,
        match=rf"stem\.conv \(tests\.layers\.test_derived\.{name}\): it overrides Conv2d\.{method}, and peft "
        rf"builds the LoRA factors of such a layer as {name} layers",
    ):
        loragen.get_lora_model(model, LoraConfig(target_modules=["conv", "plain"]))
    assert type(model["plain"]) is nn.Conv2d  # all-or-nothing: nothing was converted
    with pytest.raises(LoraConversionError, match=rf"{name} is not converted: it overrides Conv2d\.{method}"):
        lora_class_for(type(model["stem"]["conv"]))
    # why: peft's factors are layers of the subclass (its forward runs on them), and its adapter holds the
    # extra parameters of those layers, which loragen refuses to load
    peft = pytest.importorskip("peft")
    if method == "forward":
        folder = tmp_path / "peft"
        theirs = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(target_modules=["conv"]))
        assert type(theirs.base_model.model["stem"]["conv"].lora_A["default"]) is ScaledStdConv2d
        theirs.save_pretrained(folder)
        with pytest.raises(
            AdapterError, match=r"base_model\.model\.stem\.conv\.lora_[AB]\.gain: unsupported"
        ):
            loragen.load_adapter(copy.deepcopy(model), folder)
    # the other layers still convert when it is not targeted
    loragen.get_lora_model(model, LoraConfig(target_modules=["plain"]))
    assert isinstance(model["plain"], loragen.LoraConv2d) and type(model["stem"]["conv"]) is type(make())


def test_a_file_s_own_conv_subclass_is_rewritten_like_the_runtime_converts_it(tmp_path) -> None:
    source = (
        "from torch import nn\n\n\n"
        "class Patch(nn.Conv3d):\n    pass\n\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.patch = Patch(3, 4, 2, stride=2)\n\n"
        "    def forward(self, x):\n"
        "        return self.patch(x)\n"
    )
    config = LoraConfig(r=2, target_modules=["patch"])
    result = loragen.rewrite_source(source, config, filename="net.py")
    assert result.ok, [str(e) for e in result.errors]
    assert "LoraPatch = lora_class_for(Patch)" in result.code
    assert "self.patch = LoraPatch(3, 4, 2, stride=2, r=2, lora_alpha=8)" in result.code
    namespace: dict[str, object] = {"__name__": "net_lora"}
    exec(compile(result.code, str(tmp_path / "net_lora.py"), "exec"), namespace)
    rewritten = namespace["Net"]()  # type: ignore[operator]
    assert isinstance(rewritten.patch, loragen.LoraConv3d) and type(rewritten.patch).__name__ == "LoraPatch"
    assert sorted(rewritten.state_dict()) == ["patch.bias", "patch.lora_A", "patch.lora_B", "patch.weight"]


def test_a_rewrite_refuses_a_file_s_conv_subclass_with_its_own_forward_as_the_runtime_does() -> None:
    source = (
        "from torch import nn\n\n\n"
        "class Std(nn.Conv2d):\n    def forward(self, x):\n        return super().forward(x) * 2.0\n\n\n"
        "class Deeper(Std):\n    pass\n\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.conv = Deeper(3, 4, 3)\n"
        "        self.emb = nn.Embedding(5, 3)\n"
    )
    result = loragen.rewrite_source(source, LoraConfig(target_modules=["conv", "emb"]), filename="net.py")
    assert not result.ok and result.code == source
    assert [(e.line, e.message) for e in result.errors] == [
        (
            16,  # self.conv = Deeper(3, 4, 3)
            "Net.conv: Std overrides Conv2d.forward, and peft builds the LoRA factors of such a layer as Deeper "
            "layers, so that method acts on the factors too; loragen's factors are plain convolutions and could "
            "not give peft's outputs or files (get_lora_model refuses it too). Leave the field out of "
            "target_modules",
        )
    ]
    assert loragen.rewrite_source(source, LoraConfig(target_modules=["emb"]), filename="net.py").ok


def test_gemma3_s_scaled_embedding_adapts_as_in_peft(tmp_path) -> None:
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma3TextConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=32,
        sliding_window=8,
    )
    torch.manual_seed(0)
    base = transformers.Gemma3ForCausalLM(config).double().eval()
    settings = dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"], init_lora_weights=False)
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**settings))
    _perturb_peft(theirs)
    theirs.save_pretrained(tmp_path / "peft")
    ours = loragen.load_adapter(copy.deepcopy(base), tmp_path / "peft")
    assert isinstance(ours.model.embed_tokens, loragen.LoraEmbedding)
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    expected = theirs(ids).logits
    torch.testing.assert_close(ours(ids).logits, expected, rtol=1e-10, atol=1e-10)
    loragen.save_adapter(ours, tmp_path / "loragen")
    again = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "loragen")
    torch.testing.assert_close(again(ids).logits, expected, rtol=1e-10, atol=1e-10)


class StdNet(nn.Module):
    """A model of this file holding a conv subclass with its own forward (for the decorator)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = ScaledStdConv2d(3, 4, 3)
        self.plain = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.plain(self.stem(x))


def test_the_decorator_leaves_a_refused_conv_subclass_to_the_runtime_path_which_refuses_it() -> None:
    decorated = loragen.lora_convert(StdNet)  # decorating never fails on it
    assert "stem   ScaledStdConv2d(torch.nn.Conv2d)" in decorated.__lora_source__
    assert "runtime path, which refuses it: ScaledStdConv2d overrides forward" in decorated.__lora_source__
    assert "lora_class_for(ScaledStdConv2d)" not in decorated.__lora_source__
    with pytest.raises(
        LoraConversionError, match=r"stem \(tests\.layers\.test_derived\.ScaledStdConv2d\): it overrides"
    ):
        decorated().get_lora_model(LoraConfig(target_modules=["stem", "plain"]))
    model = decorated().get_lora_model(LoraConfig(target_modules=["plain"]))
    assert isinstance(model.plain, loragen.LoraConv2d) and type(model.stem) is ScaledStdConv2d


def test_parametrized_convolutions_and_embeddings_convert_and_refuse_to_merge() -> None:
    """torch.nn.utils.parametrize makes the layer's class a subclass (ParametrizedConv2d) that keeps the torch
    forward: it converts, the term is added to the parametrized output, and merging (no stored weight) is
    refused."""
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    model = nn.ModuleDict({"conv": weight_norm(nn.Conv3d(3, 4, 2)), "emb": weight_norm(nn.Embedding(6, 3))})
    base = copy.deepcopy(model)
    loragen.get_lora_model(model, LoraConfig(r=2, target_modules=["conv", "emb"], init_lora_weights=False))
    conv, emb = model["conv"], model["emb"]
    assert (
        type(conv).__name__ == "LoraParametrizedConv3d" and type(emb).__name__ == "LoraParametrizedEmbedding"
    )
    x, ids = torch.randn(2, 3, 3, 4, 4), torch.tensor([[0, 5, 2]])
    term = torch.nn.functional.conv3d(torch.nn.functional.conv3d(x, conv.lora_A), conv.lora_B) * conv.scaling
    torch.testing.assert_close(conv(x), base["conv"](x) + term)
    rows = emb.lora_embedding_A.t()[ids] @ emb.lora_embedding_B.t() * emb.scaling
    torch.testing.assert_close(emb(ids), base["emb"](ids) + rows)
    for path in ("conv", "emb"):
        with pytest.raises(
            LoraMergeError, match=rf"^{path}: cannot merge into the weight of this LoraParametrized"
        ):
            loragen.merge_adapter(nn.ModuleDict({path: model[path]}))


def test_a_plain_embedding_with_an_embed_scale_attribute_scales_its_rows_and_refuses_to_merge() -> None:
    """peft scales the LoRA rows by any layer's scalar ``embed_scale``; nn.Embedding's own forward does not
    scale the base rows, so no merged weight could give the same output."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 3))
    model[0].embed_scale = 2.0
    loragen.get_lora_model(model, LoraConfig(r=2, target_modules=["0"], init_lora_weights=False))
    layer, ids = model[0], torch.tensor([[1, 4]])
    rows = layer.lora_embedding_A.t()[ids] @ layer.lora_embedding_B.t() * layer.scaling * 2.0
    torch.testing.assert_close(model(ids), layer.weight[ids] + rows)
    with pytest.raises(
        LoraMergeError, match=r"^0: cannot merge into LoraEmbedding: .* times its embed_scale"
    ):
        loragen.merge_adapter(model)
