"""Atomic writes keep sensible file modes: the umask's for new files and folders (not tempfile's private
0600 / 0700), the replaced file's for an existing one — so ``loragen rewrite --in-place`` keeps a
script's executable bit — and a failed write leaves the old content. Writes replace links instead of
writing through them, delete only loragen's own temporary files of the names they write (never a folder,
never through a link) and touch nothing else; writers take turns and readers wait for a writer holding the
folder."""

from __future__ import annotations

import io
import os
import stat
import threading
import time
from pathlib import Path

import pytest

import loragen.atomic
from loragen.atomic import (
    WriteError,
    atomic_file,
    atomic_write_text,
    leftover_temporaries,
    locked_folder,
    mount_points,
    shared_lock,
    writers_lock,
)
from loragen.cli import main as cli_main
from tests.adapters.helpers import tree_snapshot


@pytest.fixture(params=[0o022, 0o077, 0o002])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_new_files_and_folders_get_the_umask_mode(tmp_path: Path, umask: int) -> None:
    atomic_write_text(tmp_path / "made" / "new.txt", "x")
    assert _mode(tmp_path / "made" / "new.txt") == 0o666 & ~umask
    assert _mode(tmp_path / "made") == 0o777 & ~umask
    with locked_folder(tmp_path / "adapter") as folder, folder.subfolder("other") as other:
        folder.write_files([("a.json", b"{}")])
        other.write_files([("b.json", b"{}")])
    assert _mode(tmp_path / "adapter") == _mode(tmp_path / "adapter" / "other") == 0o777 & ~umask
    assert _mode(tmp_path / "adapter" / "a.json") == _mode(tmp_path / "adapter" / "other" / "b.json")
    assert _mode(tmp_path / "adapter" / "a.json") == 0o666 & ~umask


def test_replacing_a_file_keeps_its_mode(tmp_path: Path, umask: int) -> None:
    script = tmp_path / "run.py"
    script.write_text("old")
    os.chmod(script, 0o751)
    atomic_write_text(script, "new")
    assert script.read_text() == "new" and _mode(script) == 0o751


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    def half_write(path: Path) -> None:
        with atomic_file(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("boom")

    target = tmp_path / "keep.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="boom"):
        half_write(target)
    with pytest.raises(RuntimeError, match="boom"):
        half_write(tmp_path / "new.txt")
    assert target.read_text() == "old"
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


def test_files_written_privately_get_the_umask_mode(tmp_path: Path, umask: int) -> None:
    """safetensors creates its files 0600; written through ``atomic_file`` they end with the umask's mode,
    or with the mode of the file they replace."""
    target = tmp_path / "weights.bin"
    with atomic_file(target) as tmp:
        tmp.write_bytes(b"x")
        os.chmod(tmp, 0o600)
    assert _mode(target) == 0o666 & ~umask
    os.chmod(target, 0o640)
    with atomic_file(target) as tmp:
        tmp.write_bytes(b"y")
        os.chmod(tmp, 0o600)
    assert target.read_bytes() == b"y" and _mode(target) == 0o640


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


def _write_one_file(path: Path, data: bytes) -> None:
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def _write_in_folder(path: Path, data: bytes) -> None:
    with locked_folder(path.parent) as folder:
        folder.write_files([(path.name, data)])


@pytest.mark.parametrize("write", [_write_one_file, _write_in_folder], ids=["atomic_file", "write_files"])
def test_only_loragens_own_leftover_files_of_that_target_are_deleted(tmp_path: Path, write) -> None:
    """Killed writers' ``.NAME.loragen-PID-RANDOM.tmp`` files are deleted by the next write of NAME; a folder
    or a link of such a name (an older loragen's leftover, or someone else's) is left as it is, and so is
    whatever it holds or points to."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "mine.txt").write_text("mine")
    folder = tmp_path / "work"
    folder.mkdir()
    stale = [".out.safetensors.loragen-17-beef.tmp", ".out.safetensors.loragen-4242-00ff.tmp"]
    for name in stale:
        (folder / name).write_bytes(b"partial")
    old_folder = folder / ".out.safetensors.loragen-4242-0a0b.tmp"
    (old_folder / "sub").mkdir(parents=True)
    (old_folder / "sub" / "volume.bin").write_bytes(b"data")
    (old_folder / "link").symlink_to(outside, target_is_directory=True)
    (folder / ".out.safetensors.loragen-4242-0c0d.tmp").symlink_to(outside / "mine.txt")
    for name in (
        ".out.safetensors.abc.tmp",
        ".out.safetensors.loragen-x.tmp",
        ".other.loragen-4242-00ff.tmp",
        "out.safetensors.loragen-1-ab.tmp",
        ".out.safetensors.loragen-1-ab.new",
    ):
        (folder / name).write_text("the user's")
    before = tree_snapshot(tmp_path)
    write(folder / "out.safetensors", b"new")
    expected = {k: v for k, v in before.items() if not any(k == f"work/{name}" for name in stale)}
    assert tree_snapshot(tmp_path) == {**expected, "work/out.safetensors": b"new"}


def test_a_live_writers_temporary_is_not_deleted_and_writers_take_turns(tmp_path: Path) -> None:
    """A writer holding the folder's writers' lock (as a merge does, across several files) keeps every other
    writer of the folder waiting, and its temporary file is not taken for a killed writer's."""
    target = tmp_path / "model.safetensors"
    inside, release, second_done = threading.Event(), threading.Event(), threading.Event()
    building: list[Path] = []

    def first() -> None:
        with writers_lock(tmp_path) as exclusive, atomic_file(target) as tmp:  # the lock is reentrant
            assert exclusive
            tmp.write_text("first")
            building.append(tmp)
            inside.set()
            release.wait(10)

    def second() -> None:
        atomic_write_text(target, "second")
        second_done.set()

    one = threading.Thread(target=first)
    one.start()
    assert inside.wait(10)
    two = threading.Thread(target=second)
    two.start()
    time.sleep(0.2)
    assert building[0].read_text() == "first" and not second_done.is_set()  # the second waits
    assert leftover_temporaries(target) == building
    release.set()
    one.join(10)
    two.join(10)
    assert target.read_text() == "second"
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_writes_replace_links_and_refuse_dot_paths(tmp_path: Path, monkeypatch) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("not yours")
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "link.txt").symlink_to(outside)
    atomic_write_text(tmp_path / "real" / "link.txt", "new")
    assert outside.read_text() == "not yours"  # replaced, not written through
    assert not (tmp_path / "real" / "link.txt").is_symlink()
    assert (tmp_path / "real" / "link.txt").read_text() == "new"
    before = tree_snapshot(tmp_path)
    monkeypatch.chdir(tmp_path / "real")
    for path in (".", "..", ""):
        with pytest.raises(WriteError, match="names no file or folder of its own"), atomic_file(path):
            pass
        with pytest.raises(WriteError, match="names no file or folder of its own"), locked_folder(path):
            pass
    assert tree_snapshot(tmp_path) == before


def test_mount_points_reads_the_mount_table_with_its_escapes(monkeypatch) -> None:
    """``/proc/self/mountinfo`` escapes space, tab, newline and backslash in octal (a bind mount of a folder
    of the same file system shows only there)."""
    table = (
        "22 1 0:21 / / rw - ext4 /dev/sda1 rw\n"
        "36 22 0:31 /data /mnt/my\\040disk\\134x rw shared:1 - ext4 /dev/sdb1 rw\n"
    )
    monkeypatch.setattr(loragen.atomic, "open", lambda *a, **k: io.StringIO(table), raising=False)
    assert mount_points() == frozenset({"/", "/mnt/my disk\\x"})

    def unreadable(*args, **kwargs):
        raise PermissionError("no /proc here")

    monkeypatch.setattr(loragen.atomic, "open", unreadable, raising=False)
    assert mount_points() == frozenset()


# ---- per-file writes into a locked folder ------------------------------------------------------------


def test_write_files_replaces_links_and_keeps_every_other_file(tmp_path: Path, umask: int) -> None:
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
