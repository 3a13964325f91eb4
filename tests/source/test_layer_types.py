"""The source tools without torch: ``rewrite_source`` and ``loragen rewrite`` import no torch, and the table of
built-in layer types they read then (:data:`loragen.source.scan.BUILTIN`) is the registry's."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import loragen.layers  # noqa: F401  (registers the built-in types)
from loragen import registry
from loragen.config import LoraConfig
from loragen.convert import CONFIG_ATTR
from loragen.source.codegen import CONFIG_ATTR as SOURCE_CONFIG_ATTR
from loragen.source.rewriter import rewrite_source
from loragen.source.scan import BUILTIN, from_spec, layer_types

MODEL = """\
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.q_proj = nn.Linear(4, 4, bias=False)
        self.conv = nn.Conv1d(4, 4, 3)
        self.c_attn = Conv1D(12, 4)

    def forward(self, x):
        return self.q_proj(self.embed(x))
"""

# runs in a fresh interpreter: the rewrite through the function and through the command line
_CHILD = """
import json, sys
from loragen.cli import main
from loragen.config import LoraConfig
from loragen.source.rewriter import rewrite_source

config = LoraConfig(target_modules="all-linear", lora_dropout=0.1, use_dora=True)
result = rewrite_source(open(sys.argv[1]).read(), config, filename="model.py")
try:
    main(["rewrite", sys.argv[1], "-o", sys.argv[2], "--target-modules", "q_proj,embed", "-q"])
except SystemExit as exit:
    assert not exit.code, exit.code
print(json.dumps({"code": result.code, "errors": [str(e) for e in result.errors], "torch": "torch" in sys.modules}))
"""


def test_rewrite_imports_no_torch_and_rewrites_as_with_the_registry(tmp_path: Path):
    source = tmp_path / "model.py"
    source.write_text(MODEL)
    out = tmp_path / "out.py"
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(source), str(out)],
        check=False,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    child = json.loads(done.stdout)
    assert child["torch"] is False  # neither rewrite_source nor `loragen rewrite` imported torch
    assert child["errors"] == []
    # this process has the registry (loragen.layers imported): the same rewrite, to the byte
    config = LoraConfig(target_modules="all-linear", lora_dropout=0.1, use_dora=True)
    here = rewrite_source(MODEL, config, filename="model.py")
    assert here.ok and child["code"] == here.code
    assert "self.c_attn = LoraConv1D(" in here.code and "self.q_proj = LoraLinear(" in here.code
    assert here.code.count("use_dora=True") == 3  # both layers and LORA_CONFIG
    cli = rewrite_source(MODEL, LoraConfig(target_modules=["q_proj", "embed"]), filename="model.py")
    assert out.read_text() == cli.code


def test_builtin_table_is_the_registry():
    registered = {spec.base_qualname: spec for spec in registry.specs()}
    for builtin in BUILTIN:
        spec = registered[builtin.base_qualname]
        read = from_spec(spec)
        fields = ("base_qualname", "lora_qualname", "aliases", "linear", "subclasses", "refused_overrides")
        assert {f: getattr(builtin, f) for f in fields} == {f: getattr(read, f) for f in fields}
        if all(importlib.util.find_spec(package) for package in builtin.requires):
            assert builtin.signature() == read.signature(), builtin.base_qualname
            assert builtin.importable() and read.importable()
    # the order of the registry's built-in types, which error messages list
    assert [t.base_qualname for t in BUILTIN] == [
        q for q in registered if q in {t.base_qualname for t in BUILTIN}
    ]


def test_registered_types_are_read_once_layers_are_imported():
    assert {t.base_qualname for t in layer_types().all} == {s.base_qualname for s in registry.specs()}
    linear = layer_types().for_qualname("torch.nn.modules.linear.Linear")
    assert linear is not None and linear.spec is not None and linear.lora_name == "LoraLinear"
    assert layer_types().for_qualname("torch.nn.ReLU") is None


def test_config_attribute_name_is_the_converters():
    assert SOURCE_CONFIG_ATTR == CONFIG_ATTR
