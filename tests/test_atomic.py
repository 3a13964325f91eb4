"""Atomic writes keep sensible file modes: the umask's for new files and folders (not tempfile's private
0600 / 0700), the replaced file's for an existing one — so ``loragen rewrite --in-place`` keeps a
script's executable bit — and a failed write leaves the old content. Removals never follow a link nor
enter a mount point; per-file writes replace links instead of writing through them and touch nothing
else; readers wait for a writer holding the folder."""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path

import pytest

import loragen.atomic
from loragen.atomic import WriteError, atomic_dir, atomic_write_text
from loragen.cli import main as cli_main
from tests.adapters.helpers import tree_snapshot


@pytest.fixture(params=[0o022, 0o077, 0o002])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


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


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_new_files_and_folders_get_the_umask_mode(tmp_path: Path, umask: int) -> None:
    atomic_write_text(tmp_path / "new.txt", "x")
    assert _mode(tmp_path / "new.txt") == 0o666 & ~umask
    with atomic_dir(tmp_path / "adapter") as folder:
        (folder / "a.json").write_text("{}")
    assert _mode(tmp_path / "adapter") == 0o777 & ~umask


def test_replacing_a_file_keeps_its_mode(tmp_path: Path, umask: int) -> None:
    script = tmp_path / "run.py"
    script.write_text("old")
    os.chmod(script, 0o751)
    atomic_write_text(script, "new")
    assert script.read_text() == "new" and _mode(script) == 0o751


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "keep.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="boom"), atomic_dir(tmp_path / "d"):
        raise RuntimeError("boom")
    assert target.read_text() == "old" and not (tmp_path / "d").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_rewrite_in_place_keeps_the_executable_bit(tmp_path: Path, umask: int) -> None:
    model = tmp_path / "model.py"
    model.write_text(
        "#!/usr/bin/env python\nfrom torch import nn\n\n\nclass M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.q = nn.Linear(4, 4)\n"
    )
    os.chmod(model, 0o755)
    assert cli_main(["rewrite", str(model), "--in-place", "--target-modules", "q"]) == 0
    assert "LoraLinear" in model.read_text() and _mode(model) == 0o755


def test_files_written_privately_into_a_folder_get_the_umask_mode(tmp_path: Path, umask: int) -> None:
    """safetensors creates its files 0600; in a folder loragen writes they end with the umask's mode,
    or with the mode the same file had in the folder replaced."""
    with atomic_dir(tmp_path / "adapter") as folder:
        private = folder / "weights.bin"
        private.write_bytes(b"x")
        os.chmod(private, 0o600)
    assert _mode(tmp_path / "adapter" / "weights.bin") == 0o666 & ~umask
    os.chmod(tmp_path / "adapter" / "weights.bin", 0o640)
    with atomic_dir(tmp_path / "adapter") as folder:
        (folder / "weights.bin").write_bytes(b"y")
        os.chmod(folder / "weights.bin", 0o600)
    assert _mode(tmp_path / "adapter" / "weights.bin") == 0o640


def test_every_file_of_a_saved_adapter_and_merged_checkpoint_honours_the_umask(
    tmp_path: Path, umask: int
) -> None:
    import torch
    from safetensors.torch import save_file
    from torch import nn

    import loragen

    torch.manual_seed(0)
    model = loragen.get_lora_model(
        nn.Sequential(nn.Linear(4, 4)), loragen.LoraConfig(r=2, target_modules=["0"])
    )
    loragen.save_adapter(model, tmp_path / "adapter")
    base = tmp_path / "base.safetensors"
    save_file({"0.weight": torch.zeros(4, 4), "0.bias": torch.zeros(4)}, str(base))
    merged = tmp_path / "merged.safetensors"
    assert (
        cli_main(["merge", "--base", str(base), "--adapter", str(tmp_path / "adapter"), "-o", str(merged)])
        == 0
    )
    written = [*sorted((tmp_path / "adapter").iterdir()), merged]
    assert [p.name for p in written] == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "merged.safetensors",
    ]
    assert {p.name: _mode(p) for p in written} == {p.name: 0o666 & ~umask for p in written}


def test_only_loragens_own_leftovers_of_that_target_are_cleaned(tmp_path: Path) -> None:
    stale = {
        ".adapter.loragen-4242-00ff.tmp": "dir",  # a killed build of the new folder
        ".adapter.loragen-4242-0a0b.old": "dir",  # a killed journalled swap (the target exists: obsolete)
        ".out.safetensors.loragen-17-beef.tmp": "file",
    }
    kept = [
        ".adapter.abc.tmp",
        ".adapter.loragen-x.tmp",
        ".other.loragen-4242-00ff.tmp",
        "adapter.loragen-1-ab.tmp",
    ]
    (tmp_path / "adapter").mkdir()
    for name, kind in stale.items():
        if kind == "dir":
            (tmp_path / name).mkdir()
            (tmp_path / name / "adapter_model.safetensors").write_bytes(b"x" * 100)
        else:
            (tmp_path / name).write_bytes(b"partial")
    for name in kept:
        (tmp_path / name).write_text("the user's")
    with atomic_dir(tmp_path / "adapter") as folder:
        (folder / "a.json").write_text("{}")
    atomic_write_text(tmp_path / "out.safetensors", "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, "adapter", "out.safetensors"])


def test_a_journalled_swap_cut_off_is_finished_by_the_next_write(tmp_path: Path) -> None:
    # killed after renaming the old folder aside, before renaming the complete new one into place
    (tmp_path / ".adapter.loragen-7-aa.new").mkdir()
    (tmp_path / ".adapter.loragen-7-aa.new" / "v").write_text("new")
    (tmp_path / ".adapter.loragen-7-bb.old").mkdir()
    (tmp_path / ".adapter.loragen-7-bb.old" / "v").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "adapter"):
        raise RuntimeError("a write that fails: the recovery alone")
    assert (tmp_path / "adapter" / "v").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]


def test_a_live_writers_folder_is_not_cleaned_and_writers_take_turns(tmp_path: Path) -> None:
    inside, release, second_done = threading.Event(), threading.Event(), threading.Event()
    building: list[Path] = []

    def first() -> None:
        with atomic_dir(tmp_path / "adapter") as folder:
            (folder / "v").write_text("first")
            building.append(folder)
            inside.set()
            release.wait(10)

    def second() -> None:
        with atomic_dir(tmp_path / "adapter") as folder:
            (folder / "v").write_text("second")
        second_done.set()

    one = threading.Thread(target=first)
    one.start()
    inside.wait(10)
    two = threading.Thread(target=second)
    two.start()
    time.sleep(0.2)
    assert building[0].is_dir() and not second_done.is_set()  # the second waits; nothing is cleaned
    release.set()
    one.join(10)
    two.join(10)
    assert (tmp_path / "adapter" / "v").read_text() == "second"
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]


def test_atomic_dir_refuses_links_and_dot_paths(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(WriteError, match="is a symbolic link"), atomic_dir(tmp_path / "link"):
        pass
    monkeypatch.chdir(tmp_path / "real")
    for path in (".", "..", ""):
        with pytest.raises(WriteError, match="names no file or folder of its own"), atomic_dir(path):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


# ---- removals never follow a link nor enter a mount -------------------------------------------------


def _leftover_with_a_mount_and_a_link(tmp_path: Path) -> tuple[Path, Path]:
    """A killed writer's leftover folder holding ``mnt/`` (a mount point, as faked by the caller) and a link
    to a folder outside; returns (the leftover, the outside folder)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "mine.txt").write_text("mine")
    leftover = tmp_path / ".adapter.loragen-4242-00ff.tmp"
    (leftover / "mnt").mkdir(parents=True)
    (leftover / "mnt" / "volume.bin").write_bytes(b"data on the mounted volume")
    (leftover / "link").symlink_to(outside, target_is_directory=True)
    (leftover / "stale.bin").write_bytes(b"x")
    return leftover, outside


@pytest.mark.parametrize("how", ["device", "mountinfo"])
def test_leftovers_are_removed_without_entering_a_mount_or_following_a_link(
    tmp_path: Path, monkeypatch, how: str
) -> None:
    leftover, outside = _leftover_with_a_mount_and_a_link(tmp_path)
    if how == "device":  # another filesystem mounted there
        fake_mount(monkeypatch, "mnt")
    else:  # a bind mount of the same filesystem: the same st_dev, listed in /proc/self/mountinfo
        points = frozenset({os.path.realpath(leftover / "mnt")})
        monkeypatch.setattr(loragen.atomic, "_mount_points", lambda: points, raising=False)
    with atomic_dir(tmp_path / "adapter") as folder:
        (folder / "a.json").write_text("{}")
    monkeypatch.undo()
    assert (leftover / "mnt" / "volume.bin").read_bytes() == b"data on the mounted volume"
    assert tree_snapshot(outside) == {"mine.txt": b"mine"}
    # what is not under the mount is gone; the folders holding the mount stay
    assert sorted(p.name for p in leftover.iterdir()) == ["mnt"]


def test_atomic_dir_refuses_to_replace_a_folder_holding_a_mount(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "out"
    (target / "cache").mkdir(parents=True)
    (target / "cache" / "volume.bin").write_bytes(b"data")
    (target / "model.safetensors").write_bytes(b"old")
    before = tree_snapshot(tmp_path)
    fake_mount(monkeypatch, "cache")
    with (
        pytest.raises(WriteError, match=r"out/cache is a mount point; refusing to replace .*out"),
        atomic_dir(target) as folder,
    ):
        (folder / "model.safetensors").write_bytes(b"new")
    monkeypatch.undo()
    assert tree_snapshot(tmp_path) == before


# ---- per-file writes into a locked folder ------------------------------------------------------------


def test_write_files_replaces_links_and_keeps_every_other_file(tmp_path: Path, umask: int) -> None:
    from loragen.atomic import locked_folder

    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not yours")
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "weights").symlink_to(outside)
    (folder / "config").write_text("old")
    os.chmod(folder / "config", 0o640)
    (folder / "README.md").write_text("notes")
    (folder / ".weights.loragen-17-beef.tmp").write_bytes(b"a killed writer's")
    with locked_folder(folder) as handle:
        handle.write_files([("weights", b"W"), ("config", b"C")])
    assert outside.read_bytes() == b"not yours"  # the link was replaced, not written through
    assert tree_snapshot(folder) == {"README.md": b"notes", "config": b"C", "weights": b"W"}
    assert _mode(folder / "weights") == 0o666 & ~umask and _mode(folder / "config") == 0o640


def test_locked_folder_and_subfolder_refuse_links_and_files(tmp_path: Path) -> None:
    from loragen.atomic import locked_folder

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    (tmp_path / "real" / "sub").symlink_to(tmp_path, target_is_directory=True)
    (tmp_path / "real" / "file").write_text("x")
    before = tree_snapshot(tmp_path)
    with pytest.raises(
        WriteError, match=r"link is a symbolic link \(to .*real\); refusing to write through it"
    ):
        with locked_folder(tmp_path / "link"):
            pass
    with locked_folder(tmp_path / "real") as folder:
        with pytest.raises(WriteError, match=r"real/sub is a symbolic link"), folder.subfolder("sub"):
            pass
        with (
            pytest.raises(WriteError, match=r"real/file exists and is not a folder"),
            folder.subfolder("file"),
        ):
            pass
        for name in ("..", "a/b", ""):
            with pytest.raises(WriteError, match="is not a name of an entry"), folder.subfolder(name):
                pass
    assert tree_snapshot(tmp_path) == before


def test_a_reader_waits_for_the_writer_holding_the_folder(tmp_path: Path) -> None:
    from loragen.atomic import locked_folder, shared_lock

    order: list[str] = []
    inside = threading.Event()

    def write() -> None:
        with locked_folder(tmp_path / "adapter") as folder:
            inside.set()
            time.sleep(0.3)
            folder.write_files([("a", b"1")])
            order.append("written")

    writer = threading.Thread(target=write)
    writer.start()
    assert inside.wait(10)
    with shared_lock(tmp_path / "adapter"):
        order.append("read")
    writer.join(10)
    assert order == ["written", "read"]
    with locked_folder(tmp_path / "adapter"), shared_lock(tmp_path / "adapter"):
        pass  # the writer's own thread reads without waiting for itself
