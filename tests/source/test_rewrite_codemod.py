"""Rewrites checked with libcst's own codemod test harness: ``rewrite_source`` driven as a libcst codemod
(before/after, idempotence, warnings and refusals as libcst's codemod tools report them)."""

from __future__ import annotations

import libcst as cst
from libcst.codemod import Codemod, CodemodContext, CodemodTest, SkipFile

from loragen import LoraConfig, rewrite_source


class LoraRewrite(Codemod):
    """``rewrite_source`` as a codemod: warnings become the codemod's, a file with errors is skipped."""

    def __init__(self, context: CodemodContext, config: LoraConfig) -> None:
        super().__init__(context)
        self.config = config

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        result = rewrite_source(tree.code, self.config, filename="m.py")
        for warning in result.warnings:
            self.warn(str(warning))
        if result.errors:
            raise SkipFile("; ".join(map(str, result.errors)))
        return cst.parse_module(result.code)


BEFORE = """
import torch.nn as nn


class Attention(nn.Module):
    \"\"\"Attention.\"\"\"

    def __init__(self, d):
        super().__init__()
        self.q_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d)
        self.cache = {}
"""

AFTER = """
import torch.nn as nn

from loragen import LoraConfig
from loragen.layers import LoraLinear

# Added by loragen rewrite: the LoRA config this file's LoRA layers were written with.
# Classes holding them carry it as `loragen_config` (read by loragen.mark_trainable).
LORA_CONFIG = LoraConfig(r=4, target_modules=["q_proj"])


class Attention(nn.Module):
    \"\"\"Attention.\"\"\"

    loragen_config = LORA_CONFIG  # added by loragen rewrite

    def __init__(self, d):
        super().__init__()
        self.q_proj = LoraLinear(d, d, bias=False, r=4, lora_alpha=8)
        self.o_proj = nn.Linear(d, d)
        self.cache = {}
"""


class TestRewriteCodemod(CodemodTest):
    TRANSFORM = LoraRewrite

    def test_targeted_layer_rewritten_and_config_recorded(self) -> None:
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
        self.assertCodemod(BEFORE, AFTER, config)

    def test_rewritten_file_is_left_as_it_is(self) -> None:
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
        self.assertCodemod(AFTER, AFTER, config)

    def test_layer_built_by_a_helper_is_a_warning(self) -> None:
        code = "from torch import nn\n\ndef make():\n    return nn.Linear(2, 2)\n"
        self.assertCodemod(
            code,
            code,
            LoraConfig(target_modules=["q_proj"]),
            expected_warnings=[
                "m.py:4: nn.Linear(...) in make() is not assigned to a module field the scanner can follow; "
                "not converted"
            ],
        )

    def test_config_per_layer_index_is_refused(self) -> None:
        code = (
            "from torch import nn\n\nclass Block(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.q = nn.Linear(2, 2)\n\n"
            "class Model(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.layers = nn.ModuleList([Block() for _ in range(4)])\n"
        )
        self.assertCodemod(
            code,
            code,
            LoraConfig(target_modules=["q"], layers_to_transform=[0], layers_pattern="layers"),
            expected_skip=True,
        )
