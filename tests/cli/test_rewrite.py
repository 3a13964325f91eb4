"""``loragen rewrite``: files, folders, stdout / -o / --in-place / --diff, exit statuses, targets that match
nothing, regex targets, flag names."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from loragen.cli import EXIT_INPUT, EXIT_USAGE
from loragen.cli import rewrite as rewrite_command
from loragen.config import LoraConfig


def run_cli(*args: str) -> int:
    parser = argparse.ArgumentParser(prog="loragen")
    rewrite_command.register(parser.add_subparsers())
    parsed = parser.parse_args(["rewrite", *args])
    return parsed.func(parsed)


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    folder = tmp_path / "src"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.py").write_text(
        "from torch import nn\n\nclass A(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.q = nn.Linear(2, 2)\n"
    )
    (folder / "sub" / "b.py").write_text(
        "from torch import nn\n\nclass B(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.v = nn.Linear(2, 2)\n        self.k = nn.Linear(2, 2)\n"
    )
    return folder


def test_cli_single_file_to_stdout_with_summary(sources: Path, capsys):
    assert run_cli(str(sources / "a.py"), "--target-modules", "q", "--r", "4", "--lora-alpha", "8") == 0
    out, err = capsys.readouterr()
    assert "self.q = LoraLinear(2, 2, r=4, lora_alpha=8)" in out
    assert 'LORA_CONFIG = LoraConfig(r=4, target_modules=["q"])' in out
    assert err == f"{sources / 'a.py'}: 1 layer -> LoRA (q)\n"


def test_cli_folder_to_output_folder_and_in_place(sources: Path, tmp_path: Path, capsys):
    out = tmp_path / "out"
    assert run_cli(str(sources), "-o", str(out), "--target-modules", "q,v", "-q") == 0
    assert capsys.readouterr() == ("", "")
    assert "LoraLinear(2, 2, r=8, lora_alpha=8)" in (out / "a.py").read_text()
    assert (out / "sub" / "b.py").read_text().count("LoraLinear(") == 1
    before = (sources / "sub" / "b.py").read_text()
    assert run_cli(str(sources), "--in-place", "--target-modules", "k") == 0
    after = (sources / "sub" / "b.py").read_text()
    assert after != before and "self.k = LoraLinear(2, 2, r=8, lora_alpha=8)" in after
    assert not any(p.name.endswith(".tmp") for p in sources.rglob("*"))


def test_cli_diff_and_config_file(sources: Path, tmp_path: Path, capsys):
    config = tmp_path / "adapter_config.json"
    config.write_text(
        '{"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q"], "task_type": null}'
    )
    assert run_cli(str(sources / "a.py"), "--diff", "--config", str(config), "--lora-alpha", "6") == 0
    out, _ = capsys.readouterr()
    assert "-        self.q = nn.Linear(2, 2)\n+        self.q = LoraLinear(2, 2, r=2, lora_alpha=6)\n" in out
    assert (sources / "a.py").read_text().count("nn.Linear(2, 2)") == 1  # --diff writes nothing


def test_cli_invalid_python_exits_nonzero_with_file_line_and_writes_nothing(
    sources: Path, tmp_path: Path, capsys
):
    (sources / "broken.py").write_text("import torch\n\nclass A(:\n    pass\n")
    originals = {p: p.read_bytes() for p in sources.rglob("*.py")}
    assert run_cli(str(sources), "--in-place", "--target-modules", "q") == EXIT_INPUT
    err = capsys.readouterr().err
    assert f"{sources / 'broken.py'}:3: invalid syntax\n" in err
    assert "nothing was written" in err
    assert {p: p.read_bytes() for p in sources.rglob("*.py")} == originals
    assert run_cli(str(sources), "-o", str(tmp_path / "o"), "--target-modules", "q") == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{src}/a.py"], "no target modules"),
        (
            ["{src}/a.py", "--target-modules", r".*\.q"],
            "looks like a regular expression. Pass it as --target-regex",
        ),
        (["{src}/a.py", "--target-modules", ","], "--target-modules is empty"),
        (["{src}", "--target-modules", "q"], "2 files to rewrite: use -o FOLDER, --in-place or --diff"),
    ],
)
def test_cli_usage_errors(sources: Path, capsys, args: list[str], message: str):
    assert run_cli(*[a.format(src=sources) for a in args]) == EXIT_USAGE
    assert message in capsys.readouterr().err


def test_a_bad_flag_value_is_a_usage_error_naming_the_range(sources: Path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(str(sources / "a.py"), "--target-modules", "q", "--lora-dropout", "2")
    assert exit_info.value.code == EXIT_USAGE
    assert "--lora-dropout: expected a probability with 0 <= p < 1, got '2'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.py", "--target-modules", "q"], "missing.py: no such file or folder"),
        (["{src}/a.py", "--config", "{src}/a.py"], "invalid JSON"),
        (["{src}/a.py", "--config", "{src}/missing.json"], "missing.json: cannot be read"),
    ],
)
def test_cli_input_errors(sources: Path, capsys, args: list[str], message: str):
    assert run_cli(*[a.format(src=sources) for a in args]) == EXIT_INPUT
    assert message in capsys.readouterr().err


def test_in_place_never_damages_the_input_when_the_write_fails(sources: Path, monkeypatch, capsys):
    target = sources / "a.py"
    before = target.read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    assert run_cli(str(target), "--in-place", "--target-modules", "q") == EXIT_INPUT
    assert "loragen rewrite: error: cannot write: disk full; nothing was written\n" in capsys.readouterr().err
    assert target.read_bytes() == before
    assert [p.name for p in sources.iterdir() if p.is_file()] == ["a.py"]


def test_two_sources_onto_one_output_file_are_refused_before_writing(sources: Path, tmp_path: Path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.py").write_text((sources / "a.py").read_text().replace("self.q", "self.q2"))
    out = tmp_path / "out"
    status = run_cli(str(sources / "a.py"), str(other / "a.py"), "-o", str(out), "--target-modules", "q,q2")
    assert status == EXIT_USAGE
    err = capsys.readouterr().err
    assert (
        f"error: {out / 'a.py'}: both {sources / 'a.py'} and {other / 'a.py'} would be written here\n" in err
    )
    assert "nothing was written" in err and not out.exists()


def test_an_output_onto_a_source_needs_in_place(sources: Path, capsys):
    source = sources / "a.py"
    before = source.read_bytes()
    assert run_cli(str(source), "-o", str(source), "--target-modules", "q") == EXIT_USAGE
    assert "the output would overwrite the source" in capsys.readouterr().err
    # a folder written onto itself, and an output reached through a link, are the same mistake
    (sources / "link.py").symlink_to(source)
    assert run_cli(str(source), "-o", str(sources / "link.py"), "--target-modules", "q") == 2
    assert run_cli(str(sources), "-o", str(sources), "--target-modules", "q,v") == 2
    assert "--in-place" in capsys.readouterr().err
    assert source.read_bytes() == before and (sources / "link.py").is_symlink()


def test_in_place_on_a_link_rewrites_its_target_and_keeps_the_link_and_the_mode(
    sources: Path, tmp_path: Path
):
    source = sources / "a.py"
    source.chmod(0o755)
    link = tmp_path / "link.py"
    link.symlink_to(source)
    assert run_cli(str(link), "--in-place", "--target-modules", "q", "-q") == 0
    assert link.is_symlink() and link.resolve() == source
    assert "self.q = LoraLinear(" in source.read_text()
    assert source.stat().st_mode & 0o777 == 0o755
    # a folder holding a file and a link to it rewrites the file once
    (sources / "sub" / "again.py").symlink_to(source)
    assert run_cli(str(sources), "--in-place", "--target-modules", "q,v", "-q") == 0
    assert (sources / "sub" / "again.py").is_symlink()


def test_a_file_in_the_way_of_an_output_folder_fails_before_anything_is_written(
    sources: Path, tmp_path: Path, capsys
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "sub").write_text("not a folder")
    status = run_cli(str(sources), "-o", str(out), "--target-modules", "q,v")
    assert status == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"error: {out / 'sub' / 'b.py'}: {out / 'sub'} is a file, not a folder\n" in err
    assert sorted(p.name for p in out.iterdir()) == ["sub"]  # a.py, which had room, is not written either
    (out / "sub").unlink()
    (out / "a.py").mkdir()
    assert run_cli(str(sources), "-o", str(out), "--target-modules", "q,v") == EXIT_USAGE
    assert f"{out / 'a.py'}: is a folder" in capsys.readouterr().err
    assert not (out / "sub").exists()


def test_a_target_that_matches_nothing_is_an_error_naming_it(sources: Path, tmp_path: Path, capsys):
    out = tmp_path / "out"
    status = run_cli(str(sources), "-o", str(out), "--target-modules", "q,q_prj,k")
    assert status == EXIT_INPUT
    err = capsys.readouterr().err
    assert (
        "loragen rewrite: error: target_modules entry 'q_prj' matches no layer field in 2 file(s); "
        "layer fields found: q, v, k\n"
    ) in err
    assert "nothing was written" in err and not out.exists()
    # one entry matching in any file is enough: q and k each match in one of the two
    assert run_cli(str(sources), "-o", str(out), "--target-modules", "q,k", "-q") == 0


def test_regex_targets_match_whole_module_paths(sources: Path, tmp_path: Path, capsys):
    out = tmp_path / "out"
    assert run_cli(str(sources), "-o", str(out), "--target-regex", "q|k", "-q") == 0
    assert "self.q = LoraLinear(" in (out / "a.py").read_text()
    b = (out / "sub" / "b.py").read_text()
    assert "self.k = LoraLinear(" in b and "self.v = nn.Linear(2, 2)" in b
    assert 'LORA_CONFIG = LoraConfig(target_modules="q|k")' in b
    status = run_cli(str(sources), "--diff", "--target-regex", "q_pr.*")
    assert status == EXIT_INPUT
    assert "target_modules regex 'q_pr.*' matches no layer field in 2 file(s)" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one or the other
        run_cli(str(sources), "--diff", "--target-regex", "q", "--target-modules", "k")


def test_folders_say_nothing_about_files_without_layers(sources: Path, tmp_path: Path, capsys):
    (sources / "__init__.py").write_text("")
    (sources / "sub" / "__init__.py").write_text('"""A package."""\n')
    (sources / "util.py").write_text("def helper():\n    return 1\n")
    assert run_cli(str(sources), "-o", str(tmp_path / "out"), "--target-modules", "q,v") == 0
    err = capsys.readouterr().err
    assert "__init__" not in err and "util.py" not in err and "warning" not in err
    assert err.count("-> LoRA") == 2
    assert (tmp_path / "out" / "__init__.py").read_text() == ""


def test_flags_are_peft_field_names_and_the_help_shows_the_defaults():
    subparsers = argparse.ArgumentParser(prog="loragen").add_subparsers()
    rewrite_command.register(subparsers)
    text = subparsers.choices["rewrite"].format_help()
    for flag in (
        "--r N",
        "--lora-alpha A",
        "--lora-dropout P",
        "--target-modules A,B",
        "--target-regex REGEX",
    ):
        assert flag in text
    assert "--rank" not in text
    defaults = LoraConfig()
    assert (
        f"--r {defaults.r} --lora-alpha {defaults.lora_alpha:g} -o" in text
    )  # the example uses the defaults
    assert f"lora_alpha={defaults.lora_alpha:g})" in text


# ---- a copy of a package's file: the output works where it is written ----------------------------


def _llama_copy(tmp_path: Path) -> Path:
    import transformers.models.llama.modeling_llama as installed

    copy = tmp_path / "modeling_llama.py"
    copy.write_text(Path(installed.__file__).read_text(encoding="utf-8"), encoding="utf-8")
    return copy


def test_a_copied_transformers_file_is_rewritten_into_a_module_that_works_where_it_is_written(
    tmp_path: Path, capsys, monkeypatch
):
    import importlib
    import sys

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from loragen.layers import LoraLayer

    copy = _llama_copy(tmp_path)
    out = tmp_path / "lora_llama.py"
    args = ("--target-modules", "q_proj,v_proj", "--r", "16", "--lora-alpha", "32")
    assert run_cli(str(copy), *args, "-o", str(out)) == 0
    err = capsys.readouterr().err
    assert "relative imports resolved in the installed package transformers.models.llama" in err
    text = out.read_text()
    assert "from ..." not in text and "from .configuration_llama" not in text
    assert "from transformers.models.llama.configuration_llama import LlamaConfig" in text

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lora_llama", raising=False)
    rewritten = importlib.import_module("lora_llama")
    monkeypatch.delitem(sys.modules, "lora_llama")
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).eval()
    base.save_pretrained(tmp_path / "base")
    model = rewritten.LlamaForCausalLM.from_pretrained(tmp_path / "base").eval()
    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    assert sorted({name.rpartition(".")[2] for name in layers}) == ["q_proj", "v_proj"] and len(layers) == 4
    for name, layer in layers.items():
        a, b = layer.lora_A, layer.lora_B
        assert a.shape[0] == 16 and torch.isfinite(a).all() and a.abs().max() > 0, name
        bound = 1 / a.shape[1] ** 0.5  # kaiming-uniform(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))
        assert a.abs().max() <= bound, name
        assert torch.equal(b, torch.zeros_like(b)), name
    tokens = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        logits = model(tokens).logits
        assert torch.isfinite(logits).all()
        # B = 0: the LoRA term is exactly 0, so only the base GEMMs' summation order may differ
        torch.testing.assert_close(logits, base(tokens).logits)


def test_package_names_the_package_of_a_copied_file(tmp_path: Path, capsys):
    copy = _llama_copy(tmp_path)
    args = ("--target-modules", "q_proj,v_proj", "--r", "16", "--lora-alpha", "32")
    assert run_cli(str(copy), *args, "-o", str(tmp_path / "found.py")) == 0
    capsys.readouterr()
    named = tmp_path / "named.py"
    assert run_cli(str(copy), *args, "--package", "transformers.models.llama", "-o", str(named)) == 0
    assert "relative imports resolved" not in capsys.readouterr().err
    assert named.read_text() == (tmp_path / "found.py").read_text()
    assert "module.reset_lora_parameters(True)" in named.read_text()
    # in place too: relative imports cannot work in a file outside any package folder
    assert run_cli(str(copy), *args, "--in-place", "-q") == 0
    assert copy.read_text() == named.read_text()


def test_a_file_with_relative_imports_and_no_package_is_refused_naming_package(tmp_path: Path, capsys):
    source = tmp_path / "model_of_mine.py"
    source.write_text(
        "from torch import nn\n\nfrom .blocks_of_mine import Block\n\n\nclass A(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.q = nn.Linear(2, 2)\n"
    )
    for where in (("-o", str(tmp_path / "out.py")), ("--in-place",), ("--diff",)):
        assert run_cli(str(source), "--target-modules", "q", *where) == EXIT_INPUT
        err = capsys.readouterr().err
        assert f"{source}:3: relative import (from .blocks_of_mine import ...)" in err
        assert "pass --package PKG" in err
    assert not (tmp_path / "out.py").exists() and "LoraLinear" not in source.read_text()
    assert (
        run_cli(str(source), "--target-modules", "q", "--package", "mine", "-o", str(tmp_path / "out.py"))
        == 0
    )
    assert "from mine.blocks_of_mine import Block" in (tmp_path / "out.py").read_text()


def _installed(root: Path, package: str) -> None:
    """A package ``package.sub`` under ``root`` holding ``model.py``, ``config.py`` and ``package/utils.py``."""
    sub = root / package / "sub"
    sub.mkdir(parents=True)
    for folder in (root / package, sub):
        (folder / "__init__.py").write_text("")
    (root / package / "utils.py").write_text("def helper():\n    return 1\n")
    (sub / "config.py").write_text("class Config:\n    pass\n")
    (sub / "model.py").write_text("")


def test_a_copy_is_resolved_in_the_one_installed_package_that_holds_it(tmp_path: Path, capsys, monkeypatch):
    site = tmp_path / "site"
    _installed(site, "first_pkg")
    (site / "other_pkg" / "sub").mkdir(parents=True)  # holds model.py, but not the modules it imports
    (site / "other_pkg" / "__init__.py").write_text("")
    (site / "other_pkg" / "sub" / "__init__.py").write_text("")
    (site / "other_pkg" / "sub" / "model.py").write_text("")
    monkeypatch.syspath_prepend(str(site))
    copy = tmp_path / "work" / "model.py"
    copy.parent.mkdir()
    copy.write_text(
        "from torch import nn\n\nfrom ..utils import helper\nfrom .config import Config\n\n\nclass A(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.q = nn.Linear(2, 2)\n"
    )
    out = tmp_path / "out.py"
    assert run_cli(str(copy), "--target-modules", "q", "-o", str(out)) == 0
    assert "relative imports resolved in the installed package first_pkg.sub" in capsys.readouterr().err
    text = out.read_text()
    assert "from first_pkg.utils import helper" in text and "from first_pkg.sub.config import Config" in text
    _installed(site, "second_pkg")  # now two packages hold it: the choice is the user's
    assert run_cli(str(copy), "--target-modules", "q", "-o", str(out)) == EXIT_INPUT
    err = capsys.readouterr().err
    assert f"{copy}:3: relative import (from ..utils import ...)" in err
    assert "several installed packages hold a model.py" in err and "first_pkg.sub, second_pkg.sub" in err
    assert run_cli(str(copy), "--target-modules", "q", "--package", "second_pkg.sub", "-o", str(out)) == 0
    assert "from second_pkg.utils import helper" in out.read_text()


# ---- a model split into files: the LoRA layers in one, the PreTrainedModel class in another --------------

_BLOCKS = '''"""The blocks of a tiny model."""

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.o_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(torch.tanh(self.q_proj(x)) * self.v_proj(x))
'''

_MODELING = '''"""A tiny transformers model built from the blocks of blocks.py."""

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from .blocks import Attention


class TinyConfig(PretrainedConfig):
    model_type = "loragen-tiny-two-files"

    def __init__(self, hidden: int = 16, layers: int = 2, **kwargs) -> None:
        self.hidden = hidden
        self.layers = layers
        super().__init__(**kwargs)


class TinyPreTrainedModel(PreTrainedModel):
    config_class = TinyConfig
    base_model_prefix = "tiny"


class TinyModel(TinyPreTrainedModel):
    def __init__(self, config: TinyConfig) -> None:
        super().__init__(config)
        self.blocks = nn.ModuleList([Attention(config.hidden) for _ in range(config.layers)])
        self.head = nn.Linear(config.hidden, 3)
        self.post_init()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)
'''


def _two_file_package(root: Path, name: str) -> Path:
    """A package ``name`` under ``root``: ``blocks.py`` holds the attention layers, ``modeling.py`` the
    ``PreTrainedModel`` class that builds them."""
    package = root / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "blocks.py").write_text(_BLOCKS)
    (package / "modeling.py").write_text(_MODELING)
    return package


def _import_fresh(monkeypatch, folder: Path, module: str):
    import importlib
    import sys

    monkeypatch.syspath_prepend(str(folder))
    for name in [
        n
        for n in sys.modules
        if n == module.partition(".")[0] or n.startswith(module.partition(".")[0] + ".")
    ]:
        monkeypatch.delitem(sys.modules, name)
    return importlib.import_module(module)


def test_a_folder_rewrite_gives_the_model_file_the_init_hook_for_the_layers_of_another_file(
    tmp_path: Path, capsys, monkeypatch
):
    """``from_pretrained`` fills the LoRA factors a base checkpoint lacks with the model's ``_init_weights``:
    the model file gets the hook although its own file has no targeted layer."""
    import torch

    from loragen.layers import LoraLayer

    base_module = _import_fresh(
        monkeypatch, _two_file_package(tmp_path / "base", "tiny_base").parent, "tiny_base.modeling"
    )
    source = _two_file_package(tmp_path / "src", "tiny_lora")
    out = tmp_path / "out" / "tiny_lora"
    args = ("--target-modules", "q_proj,v_proj", "--r", "4", "--lora-alpha", "8")
    assert run_cli(str(source), *args, "-o", str(out)) == 0
    err = capsys.readouterr().err
    assert "warning" not in err
    assert (
        f"{source / 'modeling.py'}: no targeted layers; TinyPreTrainedModel._init_weights initialises the "
        "LoRA layers of other files"
    ) in err
    modeling = (out / "modeling.py").read_text()
    assert "module.reset_lora_parameters(True)" in modeling and "loragen_config = LORA_CONFIG" in modeling
    assert "LoraLayer" not in (out / "blocks.py").read_text()  # no PreTrainedModel class there

    torch.manual_seed(0)
    base = base_module.TinyModel(base_module.TinyConfig()).eval()
    base.save_pretrained(tmp_path / "checkpoint")
    rewritten = _import_fresh(monkeypatch, out.parent, "tiny_lora.modeling")
    model = rewritten.TinyModel.from_pretrained(tmp_path / "checkpoint").eval()
    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    assert sorted(layers) == [f"blocks.{i}.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    for name, layer in layers.items():
        a, b = layer.lora_A, layer.lora_B
        assert a.shape == (4, 16) and torch.isfinite(a).all() and a.abs().max() > 0, name
        assert a.abs().max() <= 1 / a.shape[1] ** 0.5, name  # kaiming-uniform(a=sqrt(5)): U(-1/sqrt(in), ..)
        assert torch.equal(b, torch.zeros_like(b)), name
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), base(x))  # B = 0: the LoRA term is exactly zero

    # rewriting the output again changes nothing
    assert run_cli(str(out), *args, "--in-place") == 0
    assert "already up to date" in capsys.readouterr().err
    assert (out / "modeling.py").read_text() == modeling


def test_rewriting_only_the_layer_file_warns_naming_the_model_file(tmp_path: Path, capsys):
    source = _two_file_package(tmp_path / "src", "tiny_warned")
    args = ("--target-modules", "q_proj,v_proj")
    assert run_cli(str(source / "blocks.py"), *args, "-o", str(tmp_path / "blocks.py")) == 0
    err = capsys.readouterr().err
    assert (
        f"{source / 'blocks.py'}: warning: {source / 'modeling.py'} defines TinyPreTrainedModel, TinyModel "
        "(transformers PreTrainedModel) and imports this file's classes, but is not rewritten in this run"
    ) in err
    assert "from_pretrained leaves the LoRA factors a checkpoint lacks uninitialised" in err
    assert f"(loragen rewrite {source})" not in err and f"loragen rewrite {source} ...)" in err
    assert (tmp_path / "blocks.py").is_file()  # a warning, not a refusal
    # both files in one run: the model file gets the hook, and nothing to warn about
    assert (
        run_cli(str(source / "blocks.py"), str(source / "modeling.py"), *args, "-o", str(tmp_path / "both"))
        == 0
    )
    assert "warning" not in capsys.readouterr().err
    assert "module.reset_lora_parameters(True)" in (tmp_path / "both" / "modeling.py").read_text()


def test_a_layer_file_that_imports_transformers_and_no_model_in_the_run_warns(tmp_path: Path, capsys):
    source = tmp_path / "layers.py"
    source.write_text(
        _BLOCKS.replace(
            "from torch import nn\n", "from torch import nn\nfrom transformers import activations\n"
        )
    )
    assert run_cli(str(source), "--target-modules", "q_proj", "--diff") == 0
    err = capsys.readouterr().err
    assert (
        f"{source}: warning: LoRA layers in a file that imports transformers, and no file of this run" in err
    )
    assert "loragen rewrite DIR" in err


def test_a_plain_torch_file_does_not_warn(tmp_path: Path, capsys):
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "net.py").write_text(_BLOCKS)
    (folder / "train.py").write_text("from net import Attention\n\nmodel = Attention(16)\n")
    assert (
        run_cli(str(folder / "net.py"), "--target-modules", "q_proj,v_proj", "-o", str(tmp_path / "out.py"))
        == 0
    )
    assert capsys.readouterr().err == f"{folder / 'net.py'}: 2 layers -> LoRA (q_proj, v_proj)\n"


def test_a_model_whose_pretrained_base_class_is_left_out_warns_and_the_folder_gets_the_hook_there(
    tmp_path: Path, capsys
):
    source = _two_file_package(tmp_path / "src", "tiny_three")
    modeling = (source / "modeling.py").read_text()
    start, end = modeling.index("class TinyPreTrainedModel"), modeling.index("class TinyModel")
    (source / "base.py").write_text(
        "from transformers import PreTrainedModel\n\nfrom .modeling import TinyConfig\n\n\n"
        + modeling[start:end]
    )
    (source / "modeling.py").write_text(
        modeling[:start].replace("from .blocks", "from .base import TinyPreTrainedModel\nfrom .blocks")
        + modeling[end:]
    )
    args = ("--target-modules", "q_proj,v_proj", "--diff")
    assert run_cli(str(source / "blocks.py"), str(source / "modeling.py"), *args) == 0
    err = capsys.readouterr().err
    assert (
        f"{source / 'modeling.py'}: warning: the PreTrainedModel base class TinyPreTrainedModel "
        "(from tiny_three.base) of TinyModel is in a file not rewritten in this run"
    ) in err
    assert run_cli(str(source), *args) == 0
    out, err = capsys.readouterr()
    assert "warning" not in err
    assert f"{source / 'base.py'}: no layer fields; TinyPreTrainedModel._init_weights initialises" in err
    assert out.count("module.reset_lora_parameters(True)") == 1
