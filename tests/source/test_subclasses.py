"""Layer subclasses defined in the scanned file: the scanner, the rewrite and the decorator on user code.

A class of the file deriving from ``nn.Linear`` (directly, under an alias, or through another class of the
file) is a layer type; its LoRA class is ``lora_class_for(<subclass>)``, bound once after the class.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import torch
from torch import nn

import loragen
from loragen import LoraConfig, lora_convert, rewrite_source
from loragen.convert import find_lora_layers
from loragen.source.scan import scan_source

SOURCE = textwrap.dedent(
    """\
    import torch
    from torch import nn
    from torch.nn import Linear as L


    class Scaled(L):
        def forward(self, x):
            return super().forward(x) * 2.0


    class Shifted(Scaled):
        def forward(self, x):
            return super().forward(x) + 1.0


    class NotALayer(nn.Module):
        pass


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = Scaled(4, 8)
            self.v = Shifted(8, 4, bias=False)
            self.o = nn.Linear(4, 4)
            self.other = NotALayer()

        def forward(self, x):
            return self.o(self.v(self.q(x)))
    """
)


def test_the_scanner_finds_subclasses_of_subclasses_under_aliases():
    fields = {f.path: f for f in scan_source(SOURCE, filename="m.py", module="m").fields}
    assert sorted(fields) == ["o", "q", "v"]
    assert (fields["q"].layer, fields["q"].subclass, fields["q"].lora_name) == (
        "torch.nn.Linear",
        "Scaled",
        "LoraScaled",
    )
    assert (fields["v"].subclass, fields["v"].lora_name) == ("Shifted", "LoraShifted")
    assert fields["o"].subclass is None and fields["o"].lora_name == "LoraLinear"


def test_the_rewrite_binds_each_lora_class_after_its_subclass():
    result = rewrite_source(SOURCE, LoraConfig(r=4, target_modules=["q", "v"]), filename="m.py")
    assert result.ok, [str(e) for e in result.errors]
    code = result.code
    assert "self.q = LoraScaled(4, 8, r=4, lora_alpha=8)" in code
    assert "self.v = LoraShifted(8, 4, bias=False, r=4, lora_alpha=8)" in code
    assert "self.o = nn.Linear(4, 4)" in code
    assert "from loragen.layers import lora_class_for" in code and "LoraLinear" not in code
    scaled, shifted = (
        code.index("\nLoraScaled = lora_class_for(Scaled)\n"),
        code.index("\nLoraShifted = lora_class_for(Shifted)\n"),
    )
    assert (
        code.index("class Scaled(L)")
        < scaled
        < code.index("class Shifted(Scaled)")
        < shifted
        < code.index("class NotALayer")
    )
    again = rewrite_source(code, LoraConfig(r=4, target_modules=["q", "v"]), filename="m.py")
    assert again.ok and not again.changed and again.code == code
    wider = rewrite_source(code, LoraConfig(r=4, target_modules=["q", "v", "o"]), filename="m.py")
    assert (
        wider.ok
        and wider.code.count("= lora_class_for(") == 2
        and "self.o = LoraLinear(4, 4, r=4, lora_alpha=8)" in wider.code
    )


def test_the_rewritten_file_runs_like_get_lora_model(tmp_path):
    result = rewrite_source(SOURCE, LoraConfig(r=4, target_modules=["q", "v"]), filename="m.py")
    (tmp_path / "subclass_model_lora.py").write_text(result.code)
    spec = importlib.util.spec_from_file_location("subclass_model_lora", tmp_path / "subclass_model_lora.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["subclass_model_lora"] = module
    try:
        spec.loader.exec_module(module)
        torch.manual_seed(0)
        model = module.Block()
        plain = {k: v for k, v in model.state_dict().items() if ".lora_" not in k}
        with torch.no_grad():
            for layer in find_lora_layers(model).values():
                layer.lora_B.normal_()
        x = torch.randn(3, 4)
        expected = model.o(model.v(model.q(x)))
        # the same computation by hand: the subclasses' own forwards plus the LoRA branches
        q, v = model.q, model.v
        by_hand = (x @ q.weight.T + q.bias) * 2.0 + q.scaling * (x @ q.lora_A.T @ q.lora_B.T)
        by_hand = (by_hand @ v.weight.T) * 2.0 + 1.0 + v.scaling * (by_hand @ v.lora_A.T @ v.lora_B.T)
        by_hand = model.o(by_hand)
        torch.testing.assert_close(expected, by_hand)
        assert isinstance(model.q, module.Scaled) and isinstance(model.v, module.Shifted)
        assert set(plain) == {"q.weight", "q.bias", "v.weight", "o.weight", "o.bias"}
    finally:
        sys.modules.pop("subclass_model_lora", None)


def test_a_name_taken_by_something_else_is_an_error_naming_it():
    code = SOURCE + "\nLoraScaled = None\n"
    result = rewrite_source(code, LoraConfig(target_modules=["q"]), filename="m.py")
    assert not result.ok and result.code == code
    assert any(
        "LoraScaled is already bound" in e.message and "rename it first" in e.message for e in result.errors
    )


def test_subclasses_of_types_without_subclass_support_stay_submodules():
    code = textwrap.dedent(
        """\
        from torch import nn
        from transformers.pytorch_utils import Conv1D

        class MyConv1D(Conv1D):
            pass

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.e = MyConv1D(10, 4)
        """
    )
    scan = scan_source(code, filename="m.py", module="m").get("M")
    assert scan is not None and scan.fields == () and [s.path for s in scan.submodules] == ["e"]


# ---- the decorator on a class of this file ----------------------------------------------------------


class Doubled(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2.0


@lora_convert(LoraConfig(r=2, target_modules=["a", "b"]))
class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Doubled(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_the_decorator_converts_subclass_fields_explicitly_like_the_runtime():
    source = Pair.__lora_source__  # type: ignore[attr-defined]
    assert "LoraDoubled = lora_class_for(Doubled)" in source
    assert 'if name == "a" and type(child) is Doubled:' in source
    assert "self.a = LoraDoubled.from_module(" in source
    torch.manual_seed(0)
    generated = Pair()
    runtime = Pair()
    runtime.load_state_dict(generated.state_dict())
    torch.manual_seed(1)
    generated.get_lora_model()  # type: ignore[attr-defined]
    torch.manual_seed(1)
    loragen.get_lora_model(runtime, LoraConfig(r=2, target_modules=["a", "b"]))
    assert type(generated.a) is type(runtime.a) and isinstance(generated.a, Doubled)
    mine, theirs = generated.state_dict(), runtime.state_dict()
    assert list(mine) == list(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert sorted(generated.get_tensors()) == [  # type: ignore[attr-defined]
        "base_model.model.a.lora_A.weight",
        "base_model.model.a.lora_B.weight",
        "base_model.model.b.lora_A.weight",
        "base_model.model.b.lora_B.weight",
    ]


def test_only_classes_at_the_top_level_of_the_module_count():
    code = textwrap.dedent(
        """\
        from torch import nn

        try:
            class Guarded(nn.Linear):
                pass
        except ImportError:
            Guarded = None

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.g = Guarded(2, 2)
        """
    )
    result = rewrite_source(code, LoraConfig(target_modules="all-linear"), filename="m.py")
    assert result.ok and not result.rewritten and "lora_class_for" not in result.code
