"""Writes touch only what they were asked to: adapter names are folder names, ``save_adapter`` never writes
through a link or onto ``.``, and ``loragen merge -o`` never replaces the base, the adapter or a folder of
other files. Every refusal is a ``LoraError`` naming the path, and leaves everything as it was."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loragen import AdapterError, AdapterNameError, LoraConfig, add_adapter, load_adapter, save_adapter
from loragen.adapters.offline_merge import MergeError, merge_checkpoint
from loragen.atomic import WriteError
from loragen.cli import main
from tests.adapters.helpers import TinyNet, tiny_lora, tree_snapshot

# ---- adapter names ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("/tmp/elsewhere", "contains '/'"),
        ("a/b", "contains '/'"),
        ("..", r"contains '\.'"),
        ("a\\b", "contains"),
    ],
)
def test_add_adapter_refuses_names_that_are_paths(tmp_path: Path, name: str, why: str) -> None:
    model = tiny_lora()
    with pytest.raises(AdapterNameError, match=why):
        add_adapter(model, LoraConfig(r=2, target_modules=["q"]), name)


@pytest.mark.parametrize("name", ["", "x\x00y", "/abs", "up/../down"])
def test_load_adapter_refuses_names_that_are_paths(tmp_path: Path, name: str) -> None:
    save_adapter(tiny_lora(), tmp_path / "adapter")
    with pytest.raises(AdapterNameError, match="adapter_name="):
        load_adapter(TinyNet(), tmp_path / "adapter", adapter_name=name)


def test_an_absolute_adapter_name_never_writes_outside_the_folder(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "adapter_config.json").write_text("mine")
    model = tiny_lora()
    with pytest.raises(AdapterNameError):
        add_adapter(model, LoraConfig(r=2, target_modules=["q"]), str(victim))
    assert (victim / "adapter_config.json").read_text() == "mine"


def test_save_refuses_a_name_that_slipped_past_add_adapter(tmp_path: Path) -> None:
    model = tiny_lora()
    add_adapter(model, LoraConfig(r=2, target_modules=["q"]), "second")
    victim = tmp_path / "victim"
    victim.mkdir()
    configs = model.loragen_adapter_configs
    configs[str(victim)] = configs.pop("second")  # renamed behind loragen's back
    before = tree_snapshot(tmp_path)
    with pytest.raises(AdapterNameError, match="victim"):
        save_adapter(model, tmp_path / "out", selected_adapters=["default", str(victim)])
    assert tree_snapshot(tmp_path) == before


# ---- save_adapter targets --------------------------------------------------------------------------


def test_save_refuses_an_adapter_subfolder_that_is_a_link(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    model = tiny_lora()
    add_adapter(model, LoraConfig(r=2, target_modules=["q"]), "second")
    target = tmp_path / "adapters"
    target.mkdir()
    (target / "second").symlink_to(outside, target_is_directory=True)
    before = tree_snapshot(tmp_path)
    with pytest.raises(AdapterError, match=r"second is a symbolic link .*outside the folder"):
        save_adapter(model, target)
    assert tree_snapshot(tmp_path) == before


@pytest.mark.parametrize("kind", ["dangling", "to-folder"])
def test_save_refuses_a_target_that_is_a_link(tmp_path: Path, kind: str) -> None:
    real = tmp_path / "real"
    if kind == "to-folder":
        real.mkdir()
        (real / "notes.txt").write_text("mine")
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    before = tree_snapshot(tmp_path)
    with pytest.raises(AdapterError, match=r"link is a symbolic link .*never a link"):
        save_adapter(tiny_lora(), tmp_path / "link")
    assert tree_snapshot(tmp_path) == before


@pytest.mark.parametrize("path", [".", "..", "sub/.."])
def test_save_refuses_dot_paths(tmp_path: Path, monkeypatch, path: str) -> None:
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    before = tree_snapshot(tmp_path)
    with pytest.raises(AdapterError, match="names no folder of its own"):
        save_adapter(tiny_lora(), path)
    assert tree_snapshot(tmp_path) == before


def test_save_from_a_meta_model_names_the_tensor(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = tiny_lora()
    with pytest.raises(AdapterError, match=r"q\.lora_A is on the meta device"):
        save_adapter(model, tmp_path / "adapter")
    assert list(tmp_path.iterdir()) == []


def test_save_onto_a_full_disk_is_a_write_error_and_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    save_adapter(tiny_lora(0), tmp_path / "adapter")
    before = tree_snapshot(tmp_path)

    def full(fd: int, data: bytes) -> None:
        os.write(fd, data[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("loragen.atomic._write_all", full)
    with pytest.raises(WriteError, match=r"adapter: cannot write the adapter .*No space left") as caught:
        save_adapter(tiny_lora(1), tmp_path / "adapter")
    assert caught.value.errno == errno.ENOSPC and isinstance(caught.value, OSError)
    assert tree_snapshot(tmp_path) == before


# ---- merge outputs ---------------------------------------------------------------------------------


@pytest.fixture
def merge_files(tmp_path: Path) -> tuple[Path, Path]:
    """A one-file checkpoint of TinyNet in ``base/`` and an adapter for it in ``adapter/``."""
    model = tiny_lora()
    (tmp_path / "base").mkdir()
    save_file(
        {k: v.contiguous() for k, v in TinyNet().state_dict().items()},
        tmp_path / "base" / "model.safetensors",
    )
    save_adapter(model, tmp_path / "adapter")
    return tmp_path / "base", tmp_path / "adapter"


def _cli_merge(base: Path, adapter: Path, out: Path) -> int:
    return main(["merge", "--base", str(base), "--adapter", str(adapter), "-o", str(out), "-q"])


@pytest.mark.parametrize(
    "where",
    [
        "project-folder",
        "adapter-folder",
        "adapter-file",
        "folder-holding-adapter",
        "inside-adapter",
        "hard-link",
    ],
)
def test_merge_never_replaces_other_files(merge_files, tmp_path: Path, capsys, where: str) -> None:
    base, adapter = merge_files
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('mine')")
    outputs = {
        "project-folder": project,
        "adapter-folder": adapter,
        "adapter-file": adapter / "adapter_model.safetensors",
        "folder-holding-adapter": tmp_path,
        "inside-adapter": adapter / "merged",
    }
    if where == "hard-link":  # the same file under another name: found by its inode
        os.link(base / "model.safetensors", tmp_path / "alias.safetensors")
        out, base = tmp_path / "alias.safetensors", base / "model.safetensors"
    else:
        out = outputs[where]
    before = tree_snapshot(tmp_path)
    assert _cli_merge(base, adapter, out) == 1
    assert "refusing to" in capsys.readouterr().err
    assert tree_snapshot(tmp_path) == before


def test_merge_output_may_replace_its_own_previous_output(merge_files, tmp_path: Path) -> None:
    base, adapter = merge_files
    assert _cli_merge(base, adapter, tmp_path / "merged") == 0
    assert (tmp_path / "merged" / "loragen_merge.json").is_file()
    assert _cli_merge(base, adapter, tmp_path / "merged") == 0  # its own output: replaced
    (tmp_path / "empty").mkdir()
    assert _cli_merge(base, adapter, tmp_path / "empty") == 0  # an empty folder: filled
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == [
        "loragen_merge.json",
        "model.safetensors",
    ]


def test_merge_refuses_a_file_output_that_is_not_a_checkpoint(merge_files, tmp_path: Path) -> None:
    base, adapter = merge_files
    notes = tmp_path / "notes.safetensors"
    notes.write_text("my notes")
    with pytest.raises(MergeError, match="not a safetensors checkpoint"):
        merge_checkpoint(base / "model.safetensors", adapter, notes)
    assert notes.read_text() == "my notes"
    merge_checkpoint(base / "model.safetensors", adapter, tmp_path / "one.safetensors")
    merge_checkpoint(
        base / "model.safetensors", adapter, tmp_path / "one.safetensors"
    )  # a checkpoint: replaced


def test_merge_onto_a_full_disk_is_a_write_error_and_leaves_nothing(
    merge_files, tmp_path: Path, monkeypatch
) -> None:
    base, adapter = merge_files
    before = tree_snapshot(tmp_path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("loragen.adapters.offline_merge._copy_range", full)
    with pytest.raises(WriteError, match=r"merged: cannot write the merged checkpoint .*No space left"):
        merge_checkpoint(base, adapter, tmp_path / "merged")
    assert tree_snapshot(tmp_path) == before
