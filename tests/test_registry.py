"""The registry holds every per-type fact: a layer type defined here, registered with
``loragen.register_layer`` and nothing else, works through all three ways in (runtime, decorator,
rewrite), ``save_adapter`` / ``load_adapter`` and ``loragen merge``, and the three give the same model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

import loragen
from loragen import LoraConfig, LoraLayer
from loragen.cli import main as cli_main
from loragen.convert import find_lora_layers
from loragen.layers import LoraAdapter
from loragen.registry import spec_for_qualname, unregister


class GatedLinear(nn.Module):
    """A user's layer: ``x W^T`` times a fixed gate, weight stored (out, in) like a Linear's."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)
        self.register_buffer("gate", torch.ones(d_out))
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight.t()) * self.gate


class LoraGatedLinear(LoraLayer, GatedLinear):
    """The user's own LoRA class for it: the LoRA term is added after the gate."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        r: int = 8,
        lora_alpha: float = 8,
        lora_dropout: float = 0.0,
        use_rslora: bool = False,
        init_lora_weights: bool | str = True,
    ) -> None:
        GatedLinear.__init__(self, d_in, d_out)
        self._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights)  # type: ignore[arg-type]

    def _factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        d_out, d_in = self.weight.shape
        return (self.r, d_in), (d_out, self.r)

    def _adapter_output(self, x: torch.Tensor, adapter: LoraAdapter) -> torch.Tensor:
        x = F.dropout(x, adapter.lora_dropout_p, self.training)
        return F.linear(F.linear(x, adapter.factor_a), adapter.factor_b) * adapter.scaling


MODEL_SOURCE = """\
from torch import nn

from tests.test_registry import GatedLinear


class GatedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.gated = GatedLinear(6, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.gated(x))
"""

CONFIG = LoraConfig(r=2, lora_alpha=4, target_modules=["gated", "head"])


def _import_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def registered():
    spec = loragen.register_layer(GatedLinear, LoraGatedLinear, linear=True)
    yield spec
    unregister(spec.base_qualname)


@pytest.fixture
def model_file(tmp_path: Path, registered) -> Path:
    path = tmp_path / "gated_net.py"
    path.write_text(MODEL_SOURCE)
    return path


def _randomise_lora(model: nn.Module) -> None:
    with torch.no_grad():
        for layer in find_lora_layers(model).values():
            for p in layer.lora_parameters().values():
                p.normal_()


def test_a_registered_type_is_known_by_name_layout_and_class(registered) -> None:
    assert spec_for_qualname("tests.test_registry.GatedLinear") is registered
    assert registered.lora_type() is LoraGatedLinear and registered.layout.factor_names == (
        "lora_A",
        "lora_B",
    )


def test_a_registered_type_works_through_every_way_in_and_out(model_file: Path, tmp_path: Path) -> None:
    module = _import_file(model_file, "gated_net")
    x = torch.randn(4, 6)

    # 1. runtime
    torch.manual_seed(0)
    runtime = loragen.get_lora_model(module.GatedNet(), CONFIG)
    _randomise_lora(runtime)
    assert isinstance(runtime.gated, LoraGatedLinear)
    expected = runtime.eval()(x)

    # 2. decorator: generated conversion code for the class
    decorated_cls = loragen.lora_convert(module.GatedNet, CONFIG)
    assert "LoraGatedLinear" in decorated_cls.__lora_source__
    decorated = decorated_cls().get_lora_model()

    # 3. source rewrite
    result = loragen.rewrite_source(MODEL_SOURCE, CONFIG, filename="gated_net.py")
    assert result.ok, [str(e) for e in result.errors]
    assert "LoraGatedLinear(6, 5, r=2, lora_alpha=4)" in result.code
    (tmp_path / "gated_net_lora.py").write_text(result.code)
    rewritten = _import_file(tmp_path / "gated_net_lora.py", "gated_net_lora").GatedNet()

    for model in (decorated, rewritten):
        assert sorted(model.state_dict()) == sorted(runtime.state_dict())
        assert {p: type(m) for p, m in find_lora_layers(model).items()} == {
            p: type(m) for p, m in find_lora_layers(runtime).items()
        }
        model.load_state_dict(runtime.state_dict())
        torch.testing.assert_close(model.eval()(x), expected)

    # save / load: the adapter of the runtime model reproduces it on a fresh base
    loragen.save_adapter(runtime, tmp_path / "adapter")
    fresh = module.GatedNet()
    fresh.load_state_dict({k: v for k, v in runtime.state_dict().items() if "lora_" not in k})
    loaded = loragen.load_adapter(fresh, tmp_path / "adapter")
    torch.testing.assert_close(loaded.eval()(x), expected)

    # loragen merge: offline, into the base checkpoint, equals merge_and_unload
    base_state = {k: v.contiguous() for k, v in runtime.state_dict().items() if "lora_" not in k}
    save_file(base_state, str(tmp_path / "base.safetensors"))
    status = cli_main(
        [
            "merge",
            "--base",
            str(tmp_path / "base.safetensors"),
            "--adapter",
            str(tmp_path / "adapter"),
            "-o",
            str(tmp_path / "merged.safetensors"),
            "--quiet",
        ]
    )
    assert status == 0
    plain = module.GatedNet()
    plain.load_state_dict(load_file(str(tmp_path / "merged.safetensors")))
    unloaded = loragen.merge_and_unload(runtime)
    assert type(unloaded.gated) is module.GatedNet().gated.__class__
    torch.testing.assert_close(plain.eval()(x), unloaded(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plain(x), expected, rtol=1e-4, atol=1e-5)


def test_a_registered_lora_class_gets_named_adapters_disabling_and_merging(registered) -> None:
    """The two methods of the contract are all a LoRA class provides; the rest is loragen's."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gated = GatedLinear(6, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.gated(x)

    torch.manual_seed(0)
    model = Net()
    x = torch.randn(4, 6)
    base = model(x)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["gated"], init_lora_weights=False)
    loragen.add_adapter(model, config, "a")
    loragen.add_adapter(model, config.replace(r=3), "b")
    assert isinstance(model.gated, LoraGatedLinear)
    outputs = {}
    for name in ("a", "b"):
        loragen.set_adapter(model, name)
        outputs[name] = model(x)
        loragen.merge_adapter(model)
        torch.testing.assert_close(model(x), outputs[name], rtol=1e-5, atol=1e-5)
        loragen.unmerge_adapter(model)
    assert not torch.allclose(outputs["a"], outputs["b"]) and not torch.allclose(outputs["a"], base)
    with loragen.disable_adapter(model):
        torch.testing.assert_close(model(x), base)
    with loragen.mixed_batch(model.eval(), ["b", "__base__", "a", "b"]):
        mixed = model(x)
    torch.testing.assert_close(
        mixed, torch.stack([outputs["b"][0], base[1], outputs["a"][2], outputs["b"][3]])
    )


def test_a_lora_class_missing_a_method_of_the_contract_is_refused() -> None:
    class Incomplete(LoraLayer, GatedLinear):
        def _factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
            d_out, d_in = self.weight.shape
            return (self.r, d_in), (d_out, self.r)

    with pytest.raises(TypeError, match=r"lora_class=.*Incomplete does not provide _adapter_output"):
        loragen.register_layer(GatedLinear, Incomplete)
