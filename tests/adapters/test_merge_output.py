"""``loragen merge`` into a folder touches only its own files: each written atomically in place, listed in a
validated ``loragen_merge.json``; a re-merge replaces or removes only what the previous merge wrote, never
crosses a link or a mount point, and checks the output again right before it writes. The base folder's
other files, subfolders included, are copied."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
from safetensors.torch import save_file

from loragen import save_adapter
from loragen.adapters import offline_merge
from loragen.adapters.offline_merge import MERGE_MARKER_NAME, MergeError, merge_checkpoint, read_marker
from loragen.atomic import WriteError
from loragen.cli import main
from tests.adapters.helpers import TinyNet, tiny_lora, tree_snapshot

MARKER = MERGE_MARKER_NAME


def make_base(folder: Path, *, tokenizer: bool = True) -> Path:
    """A sharded TinyNet checkpoint with an index, ``config.json`` and (``tokenizer``) a ``tokenizer/``."""
    folder.mkdir()
    state = {k: v.contiguous() for k, v in TinyNet().state_dict().items()}
    shards = {"model-1.safetensors": ["q.weight", "q.bias"], "model-2.safetensors": ["v.weight", "v.bias"]}
    weight_map = {}
    for shard, names in shards.items():
        save_file({n: state[n] for n in names}, folder / shard)
        weight_map.update(dict.fromkeys(names, shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text('{"model_type": "tiny"}')
    if tokenizer:
        (folder / "tokenizer").mkdir()
        (folder / "tokenizer" / "tokenizer.json").write_text('{"vocab": {}}')
        (folder / "tokenizer" / "special").mkdir()
        (folder / "tokenizer" / "special" / "map.txt").write_text("a b")
    return folder


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path, Path]:
    """``(base, adapter, out)``: a sharded checkpoint with a tokenizer, an adapter, a merge output path."""
    base = make_base(tmp_path / "base")
    save_adapter(tiny_lora(1), tmp_path / "adapter")
    return base, tmp_path / "adapter", tmp_path / "out"


def cli_merge(base: Path, adapter: Path, out: Path) -> int:
    return main(["merge", "--base", str(base), "--adapter", str(adapter), "-o", str(out), "-q"])


def merge_files(out: Path) -> set[str]:
    """The files a merge of :func:`make_base` with its tokenizer writes into ``out``."""
    return {
        "model-1.safetensors",
        "model-2.safetensors",
        "model.safetensors.index.json",
        "config.json",
        "tokenizer/tokenizer.json",
        "tokenizer/special/map.txt",
    }


# ---- the marker -----------------------------------------------------------------------------------


def test_the_marker_lists_every_file_the_merge_wrote(files) -> None:
    base, adapter, out = files
    report = merge_checkpoint(base, adapter, out)
    marker, why = read_marker(out)
    assert marker is not None, why
    assert marker.complete
    assert set(marker.files) == merge_files(out)
    for name, identities in marker.files.items():
        stat = (out / name).stat()
        assert identities == ((stat.st_size, stat.st_mtime_ns),)
    assert set(report.extra_files) == merge_files(out) - {"model-1.safetensors", "model-2.safetensors"}
    assert (out / "tokenizer" / "special" / "map.txt").read_text() == "a b"


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"", "is not loragen's"),
        (b"{}", 'no "format"'),
        (b'{"loragen_merge": 1, "note": "written by loragen merge"}', "older loragen merge"),
        (
            b'{"format": "loragen merge output", "version": 2, "complete": true, "files": {"../x": [[1, 1]]}}',
            "files",
        ),
        (b'{"format": "loragen merge output", "version": 3, "complete": true, "files": {}}', "version 3"),
    ],
    ids=["empty", "object", "version-1", "path-outside", "future"],
)
def test_a_forged_marker_does_not_make_a_folder_a_previous_merge_output(
    files, capsys, content: bytes, why: str
) -> None:
    base, adapter, out = files
    out.mkdir()
    (out / MARKER).write_bytes(content)
    (out / "notes.txt").write_text("mine")
    (out / "sub").mkdir()
    (out / "sub" / "y").write_text("mine too")
    before = tree_snapshot(out)
    assert cli_merge(base, adapter, out) == 1
    err = capsys.readouterr().err
    assert "the folder holds other files (loragen_merge.json, notes.txt, sub)" in err
    assert why in err
    assert tree_snapshot(out) == before


def test_a_marker_never_authorises_removing_a_file_it_does_not_list_as_it_is(files) -> None:
    base, adapter, out = files
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    forged = {
        "format": "loragen merge output",
        "version": 2,
        "complete": True,
        "files": {"notes.txt": [[4, 1]], "model-1.safetensors": [[1, 1]]},  # not their identities
    }
    (out / MARKER).write_text(json.dumps(forged))
    report = merge_checkpoint(base, adapter, out)
    assert (out / "notes.txt").read_text() == "mine"
    assert report.removed == ()


def test_a_re_merge_removes_only_the_files_the_previous_merge_wrote(files, tmp_path: Path) -> None:
    base, adapter, out = files
    merge_checkpoint(base, adapter, out)
    (out / "notes.txt").write_text("mine")
    (out / "sub").mkdir()
    (out / "sub" / "y").write_text("mine too")
    (out / "tokenizer" / "mine.txt").write_text("in a folder the merge wrote into")
    smaller = make_base(tmp_path / "smaller", tokenizer=False)

    report = merge_checkpoint(smaller, adapter, out)

    assert set(report.removed) == {"tokenizer/tokenizer.json", "tokenizer/special/map.txt"}
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "sub" / "y").read_text() == "mine too"
    assert (out / "tokenizer" / "mine.txt").exists()
    assert not (out / "tokenizer" / "special").exists()  # emptied by the removal: removed
    marker, _ = read_marker(out)
    assert marker is not None and set(marker.files) == merge_files(out) - set(report.removed)


def test_a_file_the_previous_merge_wrote_but_the_user_changed_is_not_replaced(files, capsys) -> None:
    base, adapter, out = files
    merge_checkpoint(base, adapter, out)
    (out / "config.json").write_text('{"edited": true}')
    assert cli_merge(base, adapter, out) == 1
    assert "refusing to replace" in capsys.readouterr().err
    assert (out / "config.json").read_text() == '{"edited": true}'


def test_an_adapter_saved_into_a_merge_output_survives_a_re_merge(files) -> None:
    base, adapter, out = files
    merge_checkpoint(base, adapter, out)
    save_adapter(tiny_lora(2), out)  # save_adapter leaves the marker there
    saved = {name: (out / name).read_bytes() for name in ("adapter_config.json", "adapter_model.safetensors")}
    refusal = ""
    try:
        merge_checkpoint(base, adapter, out)
    except MergeError as exc:  # a save that rewrote the merge's files makes them foreign: refused
        refusal = str(exc)
    assert not refusal or "refusing to replace" in refusal
    for name, data in saved.items():
        assert (out / name).read_bytes() == data


# ---- links and mount points -------------------------------------------------------------------------


def test_a_re_merge_never_empties_a_mount_or_follows_a_link_in_the_output(
    files, tmp_path: Path, monkeypatch
) -> None:
    base, adapter, out = files
    merge_checkpoint(base, adapter, out)
    (out / "cache").mkdir()
    (out / "cache" / "volume.bin").write_bytes(b"data on another volume")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep")
    (out / "linked").symlink_to(elsewhere, target_is_directory=True)
    is_mount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == out / "cache" or is_mount(p))

    merge_checkpoint(base, adapter, out)

    assert (out / "cache" / "volume.bin").read_bytes() == b"data on another volume"
    assert (out / "linked").is_symlink() and (out / "linked" / "keep.txt").read_text() == "keep"


@pytest.mark.parametrize("kind", ["link", "mount"])
def test_the_merge_never_writes_through_a_link_or_into_a_mount_point(
    files, tmp_path: Path, monkeypatch, capsys, kind: str
) -> None:
    base, adapter, out = files
    merge_checkpoint(base, adapter, out)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "tokenizer.json").write_text("someone else's")
    for path in sorted((out / "tokenizer").rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    (out / "tokenizer").rmdir()
    if kind == "link":
        (out / "tokenizer").symlink_to(elsewhere, target_is_directory=True)
    else:
        (out / "tokenizer").mkdir()
        (out / "tokenizer" / "tokenizer.json").write_text("someone else's")
        is_mount = os.path.ismount
        monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == out / "tokenizer" or is_mount(p))
    before = tree_snapshot(tmp_path)
    assert cli_merge(base, adapter, out) == 1
    assert f"{out / 'tokenizer'} is a link, a mount point or not a folder" in capsys.readouterr().err
    assert tree_snapshot(tmp_path) == before


def test_links_to_folders_hidden_folders_and_other_weights_of_the_base_are_listed_not_copied(
    files, tmp_path: Path, capsys
) -> None:
    base, adapter, out = files
    (tmp_path / "elsewhere").mkdir()
    (base / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (base / ".cache").mkdir()
    (base / ".cache" / "download.lock").write_text("")
    (base / "original").mkdir()
    (base / "original" / "consolidated.00.pth").write_bytes(b"unmerged")
    assert main(["merge", "--base", str(base), "--adapter", str(adapter), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    for skipped in (
        "linked/ (a link to a folder",
        ".cache/ (a hidden folder)",
        "original/consolidated.00.pth",
    ):
        assert skipped in printed
    copied = {MARKER, "config.json", "model-1.safetensors", "model-2.safetensors", "tokenizer"}
    assert {p.name for p in out.iterdir()} == copied | {"model.safetensors.index.json"}


# ---- the output checked when the write happens ----------------------------------------------------------


def _during_the_merge(monkeypatch, action) -> None:
    """Run ``action`` once, while the merge writes its first shard."""
    write_file = offline_merge._write_file
    done = []

    def writing(*args, **kwargs):
        if not done:
            done.append(True)
            action()
        return write_file(*args, **kwargs)

    monkeypatch.setattr(offline_merge, "_write_file", writing)


def test_a_user_file_that_appears_in_a_new_output_during_the_merge_is_kept_and_the_merge_refused(
    files, monkeypatch, capsys
) -> None:
    base, adapter, out = files
    out.mkdir()
    _during_the_merge(monkeypatch, lambda: (out / "notes.txt").write_text("mine"))
    assert cli_merge(base, adapter, out) == 1
    assert "the folder holds other files (notes.txt)" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "mine"


def test_a_user_file_that_appears_at_a_name_the_merge_writes_is_never_replaced(files, monkeypatch, capsys):
    base, adapter, out = files
    merge_checkpoint(base, adapter, out)
    before = tree_snapshot(out)
    _during_the_merge(monkeypatch, lambda: (out / "config.json").write_text("mine"))
    assert cli_merge(base, adapter, out) == 1
    assert f"refusing to replace {out / 'config.json'}" in capsys.readouterr().err
    assert tree_snapshot(out) == {**before, "config.json": b"mine"}


def test_files_others_write_into_a_merge_output_during_re_merges_all_survive(files) -> None:
    base, adapter, out = files
    merge_checkpoint(base, adapter, out)
    (out / "logs").mkdir()
    written: list[Path] = []
    stop = threading.Event()

    def logger() -> None:
        while not stop.is_set():
            path = out / ("logs" if len(written) % 2 else ".") / f"log-{len(written)}.txt"
            path.write_text(str(len(written)))
            written.append(path)

    thread = threading.Thread(target=logger)
    thread.start()
    try:
        for seed in (2, 3, 4):
            save_adapter(tiny_lora(seed), adapter)
            merge_checkpoint(base, adapter, out)
    finally:
        stop.set()
        thread.join()
    assert written
    for i, path in enumerate(written):
        assert path.read_text() == str(i)


def test_a_file_that_appears_at_a_one_file_output_during_the_merge_is_kept(
    files, tmp_path, monkeypatch
) -> None:
    _, adapter, _ = files
    save_file({k: v.contiguous() for k, v in TinyNet().state_dict().items()}, tmp_path / "one.safetensors")
    out = tmp_path / "merged.safetensors"
    _during_the_merge(monkeypatch, lambda: out.write_text("my notes"))
    with pytest.raises(MergeError, match="not a safetensors checkpoint"):
        merge_checkpoint(tmp_path / "one.safetensors", adapter, out)
    assert out.read_text() == "my notes"


def test_a_merge_cut_off_while_renaming_its_files_is_finished_by_the_next(
    files, tmp_path, monkeypatch
) -> None:
    base, adapter, out = files
    merge_checkpoint(base, adapter, out)
    (out / "notes.txt").write_text("mine")
    save_adapter(tiny_lora(7), tmp_path / "newer")
    merge_checkpoint(base, tmp_path / "newer", tmp_path / "reference")
    replace = os.replace
    calls = []

    def failing(src, dst):
        calls.append(dst)
        if len(calls) == 3:  # the marker listing old and new files, then one file, then none
            raise OSError(28, "No space left on device")
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(WriteError, match="run the merge again to finish it"):
        merge_checkpoint(base, tmp_path / "newer", out)
    monkeypatch.setattr(os, "replace", replace)
    merge_checkpoint(base, tmp_path / "newer", out)
    expected = tree_snapshot(tmp_path / "reference")
    del expected[MARKER]
    assert {k: v for k, v in tree_snapshot(out).items() if k != MARKER} == {**expected, "notes.txt": b"mine"}


@pytest.fixture
def bind_mount():
    """``bind_mount(source, target)``: a real bind mount, undone after the test (skips where not permitted)."""
    mounted: list[Path] = []

    def mount(source: Path, target: Path) -> None:
        if shutil.which("mount") is None:
            pytest.skip("no mount command")
        done = subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True, check=False)
        if done.returncode:
            pytest.skip(f"bind mounts are not permitted here: {done.stderr.decode().strip()}")
        mounted.append(target)

    yield mount
    for target in reversed(mounted):
        subprocess.run(["umount", str(target)], check=True)


def test_a_real_bind_mount_in_the_output_is_never_emptied_nor_written_into(
    files, tmp_path, bind_mount
) -> None:
    base, adapter, out = files
    merge_checkpoint(base, adapter, out)
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "data.bin").write_bytes(b"on the volume")
    (out / "cache").mkdir()
    bind_mount(volume, out / "cache")
    merge_checkpoint(base, adapter, out)
    assert (volume / "data.bin").read_bytes() == b"on the volume"

    for path in sorted((out / "tokenizer").rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    bind_mount(volume, out / "tokenizer")  # the same file system: only the mount table tells
    before = tree_snapshot(volume)
    with pytest.raises(MergeError, match="is a link, a mount point or not a folder"):
        merge_checkpoint(base, adapter, out)
    assert tree_snapshot(volume) == before
