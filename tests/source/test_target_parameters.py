"""target_parameters in the source entry points: the decorator adapts them, the rewrite says it cannot."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

import loragen
from loragen import LoraConfig

CONFIG = LoraConfig(target_modules=["proj"], target_parameters=["experts.down_proj"], init_lora_weights=False)

SOURCE = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.down_proj = nn.Parameter(torch.randn(3, 4, 5))

        def forward(self, x):
            return torch.einsum("bi,eoi->beo", x, self.down_proj)


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(5, 5)
            self.experts = Experts()

        def forward(self, x):
            return self.experts(self.proj(x))
    """
)


def _namespace(code: str) -> dict:
    namespace: dict = {"__name__": "user_experts_model"}
    exec(compile(code, "user_experts_model.py", "exec"), namespace)
    return namespace


def _module_from_file(folder: Path, code: str) -> ModuleType:
    path = folder / "user_experts_model.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location("user_experts_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_decorated_class_adapts_targeted_parameters_like_the_runtime_path(tmp_path: Path) -> None:
    try:
        net = _module_from_file(tmp_path, SOURCE).Net
        decorated = loragen.lora_convert(net)
    finally:
        sys.modules.pop("user_experts_model", None)
    torch.manual_seed(0)
    model = decorated().get_lora_model(CONFIG)
    torch.manual_seed(0)
    reference = loragen.get_lora_model(net(), CONFIG)
    assert set(dict(model.named_parameters())) == set(dict(reference.named_parameters()))
    assert "experts.lora_targets.down_proj.lora_A" in dict(model.named_parameters())
    model.load_state_dict(reference.state_dict())
    x = torch.randn(2, 5)
    torch.testing.assert_close(model(x), reference(x))


def test_the_rewrite_warns_and_keeps_no_target_parameters_in_its_config() -> None:
    result = loragen.rewrite_source(SOURCE, CONFIG, filename="user_experts_model.py")
    assert result.changed and not result.errors
    assert any(
        "target_parameters=['experts.down_proj'] is not written into the source" in w.message
        for w in result.warnings
    )
    assert "target_parameters" not in result.code
    model = _namespace(result.code)["Net"]()
    assert isinstance(model.experts, nn.Module) and not hasattr(model.experts, "lora_targets")
