"""Shared fixtures (tiny transformers models built from configs; nothing is downloaded) and the suite's tiers.

Every test belongs to one tier. ``unit`` is the default (``pytest`` alone runs it, in a few minutes); the
others are assigned here by file and fixture, or by a ``@pytest.mark.<tier>`` on the test:

- ``kernels``: builds kernels and runs them (NVRTC compiles, g++-built CUDA emulation, the C++ host path);
- ``sanitizers``: kernels built with AddressSanitizer / ThreadSanitizer / UBSan;
- ``sass``: disassembles the compiled cubins;
- ``packaging``: builds the wheel and runs loragen from it;
- ``lint``: ruff, mypy, import-linter and the other static checks of the source;
- ``distributed``: several processes working together or killed mid-write (DDP, FSDP, fork);
- ``slow``: slow integration tests (a child interpreter or pytest, the demo, the snippets of README and docs/).

``pytest -m ""`` runs every tier. Under pytest-xdist (``-n 2 --dist loadgroup``) the tests that compile
into the same cache run in one worker, so no build is made twice, and the distributed tests run one at a
time.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, settings
from torch import nn

# Two cores are shared by everything in CI; one intra-op thread keeps tests predictable.
torch.set_num_threads(int(os.environ.get("LORAGEN_TEST_THREADS", "1")))

settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))


# ---- tiers -----------------------------------------------------------------------------------------

TIERS = ("kernels", "sanitizers", "sass", "packaging", "lint", "distributed", "slow")

# a test file (by name, wherever it lives under tests/) whose every test is in a tier
FILE_TIERS = {
    "test_cuda_emulated.py": "kernels",
    "test_cuda_compile.py": "kernels",
    "test_sanitizers.py": "sanitizers",
    "test_sass.py": "sass",
    "test_package.py": "packaging",
    "test_architecture.py": "lint",
    "test_ddp.py": "distributed",
    "test_atomic_kill.py": "distributed",
}

# fixtures that compile native code: a test using one, directly or through another fixture, is a kernels test
NVRTC_FIXTURES = {"nvrtc_available"}  # every cubin-compiling fixture depends on it
# g++: the emulated kernels
EMULATION_FIXTURES = {"launcher", "emulated"}
# g++: kernel code built for the host
HOST_BUILD_FIXTURES = {"device_mask_code", "jit_sources_on_host"}

# xdist groups: tests that share an on-disk build cache (or session fixtures that fill one) run in one
# worker, so each build is made once; tests that start processes of their own run one at a time
TIER_GROUPS = {"sass": "nvrtc", "sanitizers": "sanitizers", "lint": "lint", "distributed": "processes"}


def _fixtures(item: pytest.Item) -> set[str]:
    """The fixtures ``item`` uses, with those they use in turn."""
    return set(getattr(item, "fixturenames", ()))


def _tier(item: pytest.Item) -> str:
    """The tier of ``item``: its own tier marker, else its file's, its name's or its fixtures' tier, else
    ``slow`` where it is marked so, else ``unit`` (a slow test of a more specific tier is in that tier)."""
    for tier in TIERS[:-1]:
        if item.get_closest_marker(tier) is not None:
            return tier
    tier = FILE_TIERS.get(item.path.name)
    if tier is not None:
        return tier
    if "sanitizer" in item.name:
        return "sanitizers"
    if _fixtures(item) & (NVRTC_FIXTURES | EMULATION_FIXTURES | HOST_BUILD_FIXTURES):
        return "kernels"
    return "slow" if item.get_closest_marker("slow") is not None else "unit"


def _group(item: pytest.Item, tier: str) -> str | None:
    """The xdist group of ``item`` (None: any worker)."""
    if tier in TIER_GROUPS:
        return TIER_GROUPS[tier]
    if _fixtures(item) & NVRTC_FIXTURES:
        return "nvrtc"
    if _fixtures(item) & (EMULATION_FIXTURES | HOST_BUILD_FIXTURES):
        return "emulation"  # g++ builds: each module's made once
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its tier (before ``-m`` selects), and with its xdist group."""
    for item in items:
        tier = _tier(item)
        # one tier each: a slow test of another tier is not selected by -m slow
        item.own_markers[:] = [mark for mark in item.own_markers if mark.name not in TIERS]
        item.add_marker(getattr(pytest.mark, tier))
        group = _group(item, tier)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    """Print the seed of a random order (pytest-randomly), under -q too, so a failing order can be replayed;
    and when the default unit tier left nothing to run, how to run the other tiers."""
    seed = getattr(config.option, "randomly_seed", None)
    if config.pluginmanager.hasplugin("randomly") and isinstance(seed, int):
        terminalreporter.write_line(f"random order: --randomly-seed={seed} replays it")
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and config.getoption("markexpr", "") == "unit":
        terminalreporter.write_line('the tests selected are outside the unit tier: -m "" runs every tier')


def pytest_report_header(config: pytest.Config) -> str | None:
    """Say when only the unit tier runs, and how to run every tier."""
    if config.getoption("markexpr", "") == "unit":
        return 'tiers: unit only (the default); pytest -m "" runs every tier (see tests/conftest.py)'
    return None


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=100,
            max_position_embeddings=64,
        )
    )


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=64))


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(
        BertConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=100,
            max_position_embeddings=64,
            num_labels=3,
        )
    )


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(
        T5Config(
            d_model=32,
            d_ff=64,
            d_kv=8,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            vocab_size=100,
            decoder_start_token_id=0,
        )
    )


TINY_MODELS: dict[str, Callable[[], nn.Module]] = {"llama": _llama, "gpt2": _gpt2, "bert": _bert, "t5": _t5}


def tiny_inputs(kind: str, batch: int = 2, seq: int = 7, seed: int = 0) -> dict[str, torch.Tensor]:
    """Model inputs for a tiny model of ``kind``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (batch, seq), generator=g)
    if kind == "t5":
        return {"input_ids": ids, "decoder_input_ids": torch.randint(0, 100, (batch, 5), generator=g)}
    return {"input_ids": ids}


@pytest.fixture
def make_tiny_model() -> Callable[[str, int], nn.Module]:
    """Factory: ``make_tiny_model(kind, seed)`` -> an eval-mode tiny transformers model."""

    def make(kind: str, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return TINY_MODELS[kind]().eval()

    return make


def autograd_node_names(output: torch.Tensor) -> set[str]:
    """The class names of every autograd node ``output`` was made through (which ops ran as one node)."""
    seen, stack, names = set(), [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return names
