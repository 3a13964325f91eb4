"""Writes touch only what they were asked to: adapter names are folder names, ``save_adapter`` never writes
through a link or onto ``.``, and ``loragen merge -o`` never replaces the base, the adapter or a folder of
other files. Every refusal is a ``LoraError`` naming the path, and leaves everything as it was. A save writes its own
files and nothing else: another adapter's files, files other programs create meanwhile and mounted
subfolders stay as they are, and a check against links holds when the files are written."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loragen import (
    AdapterError,
    AdapterNameError,
    LoraConfig,
    add_adapter,
    get_lora_model,
    load_adapter,
    save_adapter,
)
from loragen.adapters.folder import read_adapter
from loragen.adapters.offline_merge import MergeError, merge_checkpoint
from loragen.atomic import WriteError
from loragen.cli import main
from tests.adapters.helpers import TinyNet, perturb_trainable, tiny_lora, tree_snapshot

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


# ---- a save touches only the files it writes -------------------------------------------------------


def _two_adapters() -> torch.nn.Module:
    model = tiny_lora(0)
    torch.manual_seed(1)
    add_adapter(model, LoraConfig(r=2, lora_alpha=8, target_modules=["q"]), "other")
    return model


def test_saving_a_selected_adapter_keeps_the_root_adapter(tmp_path: Path) -> None:
    model = _two_adapters()
    folder = tmp_path / "adapters"
    save_adapter(model, folder)
    root = {
        name: (folder / name).read_bytes() for name in ("adapter_config.json", "adapter_model.safetensors")
    }
    with torch.no_grad():
        model.q.lora_adapters["other"].lora_B.add_(1.0)
    save_adapter(model, folder, selected_adapters=["other"])
    assert sorted(p.name for p in folder.iterdir()) == [*sorted(root), "other"]
    assert {name: (folder / name).read_bytes() for name in root} == root  # as peft: the root stays
    reloaded = load_adapter(TinyNet(), folder / "other")
    torch.testing.assert_close(reloaded.q.lora_B, model.q.lora_adapters["other"].lora_B)


def test_save_pretrained_with_selected_adapters_keeps_the_root_adapter(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    import peft

    torch.manual_seed(0)
    config = transformers.OPTConfig(
        vocab_size=32, hidden_size=8, num_hidden_layers=1, ffn_dim=16, num_attention_heads=2,
        max_position_embeddings=16, word_embed_proj_dim=8,
    )  # fmt: skip
    model = get_lora_model(transformers.OPTForCausalLM(config), LoraConfig(r=2, target_modules=["q_proj"]))
    model.add_adapter(peft.LoraConfig(r=2, target_modules=["q_proj"]), "other")
    folder = tmp_path / "saved"
    model.save_pretrained(folder)
    root = {
        name: (folder / name).read_bytes() for name in ("adapter_config.json", "adapter_model.safetensors")
    }
    entries = sorted(p.name for p in folder.iterdir())
    assert entries == [*sorted(root), "default"]  # "other", the active adapter, at the root
    model.save_pretrained(folder, selected_adapters=["other"])  # peft's layout: "other" in other/
    assert sorted(p.name for p in folder.iterdir()) == [*entries, "other"]
    assert {name: (folder / name).read_bytes() for name in root} == root


def test_files_created_in_the_folder_during_saves_are_kept(tmp_path: Path) -> None:
    """A logger (or another DDP rank writing rng_state_N.pth into checkpoint-N) writes into the folder while
    it is saved to: every file it created is still there, with its content."""
    folder = tmp_path / "checkpoint-10"
    save_adapter(tiny_lora(0), folder)
    created: list[str] = []
    stop = threading.Event()

    def logger() -> None:
        while not stop.is_set():
            name = f"rng_state_{len(created)}.pth"
            (folder / name).write_text(name)
            created.append(name)

    thread = threading.Thread(target=logger)
    thread.start()
    try:
        while len(created) < 20:
            time.sleep(0.001)
        for seed in range(3):
            save_adapter(tiny_lora(seed), folder)
    finally:
        stop.set()
        thread.join()
    assert len(created) > 20
    assert {name: (folder / name).read_text() for name in created} == {name: name for name in created}
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["adapter_config.json", "adapter_model.safetensors", *created]
    )


def fake_mount(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Make every folder named ``name`` look like a mount point of another filesystem (``st_dev`` differs),
    as a bind mount would; mounting for real needs root."""
    real_stat, real_lstat = os.stat, os.lstat
    extra = "st_atime st_mtime st_ctime st_atime_ns st_mtime_ns st_ctime_ns st_blksize st_blocks st_rdev"

    def moved(info: os.stat_result) -> os.stat_result:
        values = list(info[:10])
        values[2] += 1  # st_dev
        return os.stat_result(values, {key: getattr(info, key) for key in extra.split()})

    def stat(path, *args, **kwargs):
        info = real_stat(path, *args, **kwargs)
        return moved(info) if os.path.basename(os.fspath(path)) == name else info

    def lstat(path, *args, **kwargs):
        info = real_lstat(path, *args, **kwargs)
        return moved(info) if os.path.basename(os.fspath(path)) == name else info

    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(os, "lstat", lstat)


def test_a_save_leaves_a_mounted_subfolder_as_it_is(tmp_path: Path, monkeypatch) -> None:
    """``adapter/logs`` is a mount point (a bind mount: faked, mounting needs root); the save writes its two
    files and leaves the folder, its inode and its files as they were."""
    folder = tmp_path / "adapter"
    save_adapter(tiny_lora(0), folder)
    (folder / "logs").mkdir()
    (folder / "logs" / "run.log").write_text("step 1")
    fake_mount(monkeypatch, "logs")
    inode = os.lstat(folder / "logs").st_ino
    save_adapter(tiny_lora(1), folder)
    monkeypatch.undo()
    assert os.lstat(folder / "logs").st_ino == inode
    assert tree_snapshot(folder / "logs") == {"run.log": b"step 1"}
    torch.testing.assert_close(load_adapter(TinyNet(), folder).q.lora_B, tiny_lora(1).q.lora_B)


def test_a_subfolder_swapped_for_a_link_while_the_save_waits_is_refused(tmp_path: Path, monkeypatch) -> None:
    """The save's checks pass, then it waits for the folder's lock; meanwhile ``T/other`` becomes a link to a
    folder outside. The check made under the lock refuses it: nothing is written through the link."""
    import fcntl

    from loragen.adapters import save as save_module

    model = _two_adapters()
    target = tmp_path / "T"
    save_adapter(model, target)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    checked = threading.Event()
    real_check = save_module._check_target

    def check_then_signal(*args, **kwargs):
        result = real_check(*args, **kwargs)
        checked.set()
        return result

    monkeypatch.setattr(save_module, "_check_target", check_then_signal)
    # the lock the save waits for: the folder's own (and its parent's, where writers locked that before)
    held = [os.open(target, os.O_RDONLY), os.open(tmp_path, os.O_RDONLY)]
    for fd in held:
        fcntl.flock(fd, fcntl.LOCK_EX)
    errors: list[BaseException] = []

    def save() -> None:
        try:
            save_adapter(model, target)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=save)
    thread.start()
    try:
        assert checked.wait(30)
        time.sleep(0.2)
        (target / "other").rename(tmp_path / "moved")
        (target / "other").symlink_to(outside, target_is_directory=True)
        root_before = tree_snapshot(target)
    finally:
        for fd in held:
            os.close(fd)  # releases the locks
        thread.join(30)
    assert len(errors) == 1 and isinstance(errors[0], WriteError), errors
    assert re.search(r"T/other is a symbolic link .*refusing to write through it", str(errors[0]))
    assert tree_snapshot(outside) == {"keep.txt": b"keep"}
    assert tree_snapshot(target) == root_before  # nothing written before the refusal


# ---- a reader pairs the weights with the config saved with them --------------------------------------


def _alpha8(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = get_lora_model(TinyNet(), LoraConfig(r=2, lora_alpha=8, target_modules=["q", "v"]))
    perturb_trainable(model, seed)
    return model


def _assert_same_adapter(loaded: torch.nn.Module, model: torch.nn.Module) -> None:
    for name in ("q", "v"):
        got, want = getattr(loaded, name), getattr(model, name)
        assert got.scaling == want.scaling
        torch.testing.assert_close((got.lora_A, got.lora_B), (want.lora_A, want.lora_B), rtol=0, atol=0)


def test_a_save_killed_between_its_renames_still_reads_as_one_adapter(tmp_path: Path) -> None:
    """New weights beside the old config (the save died before renaming the config): the reader takes the
    config saved with the weights, complete in the killed save's temporary, not the older one."""
    old, new, target = tmp_path / "old", tmp_path / "new", tmp_path / "adapter"
    save_adapter(tiny_lora(0), old)
    model = _alpha8(1)
    save_adapter(model, new)
    shutil.copytree(old, target)
    shutil.copy(new / "adapter_model.safetensors", target / "adapter_model.safetensors")
    (target / ".adapter_config.json.loragen-99-0abc.tmp").write_bytes(
        (new / "adapter_config.json").read_bytes()
    )
    (target / ".adapter_config.json.loragen-98-0def.tmp").write_bytes(b'{"r": 2, "lora_al')  # cut off
    adapter = read_adapter(target)
    assert adapter.config_dict == json.loads((new / "adapter_config.json").read_text())
    _assert_same_adapter(load_adapter(TinyNet(), target), model)
    save_adapter(model, target)  # the next save deletes the leftovers
    assert sorted(p.name for p in target.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


def test_a_config_edited_by_hand_is_read_as_it_is(tmp_path: Path) -> None:
    model = _alpha8(2)
    save_adapter(model, tmp_path / "adapter")
    config = tmp_path / "adapter" / "adapter_config.json"
    data = json.loads(config.read_text())
    data["base_model_name_or_path"] = "my-org/my-base"
    config.write_text(json.dumps(data))
    (tmp_path / "adapter" / ".adapter_config.json.loragen-99-0abc.tmp").write_text("{}")  # matches nothing
    assert read_adapter(tmp_path / "adapter").config_dict["base_model_name_or_path"] == "my-org/my-base"
    _assert_same_adapter(load_adapter(TinyNet(), tmp_path / "adapter"), model)


def test_readers_never_see_a_torn_adapter_while_saves_run(tmp_path: Path) -> None:
    """One thread saves two different adapters (different lora_alpha, different weights) in turn while
    another reads the folder: every read is one of the two, config and weights together."""
    models = [tiny_lora(0), _alpha8(1)]
    references = []
    for i, model in enumerate(models):
        save_adapter(model, tmp_path / f"reference{i}")
        adapter = read_adapter(tmp_path / f"reference{i}")
        references.append((adapter.config_dict, dict(adapter.tensors)))
    target = tmp_path / "adapter"
    save_adapter(models[0], target)
    stop = threading.Event()
    errors: list[BaseException] = []

    def saves() -> None:
        try:
            for i in range(30):
                save_adapter(models[i % 2], target)
        except BaseException as exc:
            errors.append(exc)
        finally:
            stop.set()

    thread = threading.Thread(target=saves)
    thread.start()
    reads = 0
    while not stop.is_set() or reads == 0:
        adapter = read_adapter(target)
        matches = [
            config == adapter.config_dict
            and all(torch.equal(tensors[k], adapter.tensors[k]) for k in tensors)
            for config, tensors in references
        ]
        assert any(matches), f"read {reads}: a config and weights that were not saved together"
        reads += 1
    thread.join()
    assert not errors and reads > 0
