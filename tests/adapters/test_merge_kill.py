"""A merge into a folder killed at any moment leaves each file old or new and other files untouched, and the
next merge finishes it; merges into one folder from several processes take turns while other programs
write into it.

A forked child merges with every file-system step of the writer counted (rename, fsync, chmod, open,
mkdir in :mod:`loragen.atomic`; each file's write and each removal in the merge) and SIGKILLs itself
before step ``k``, which hypothesis draws.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import loragen.atomic
from loragen import save_adapter
from loragen.adapters import offline_merge
from loragen.adapters.offline_merge import MERGE_MARKER_NAME, merge_checkpoint, read_marker
from tests.adapters.helpers import tiny_lora
from tests.adapters.test_merge_output import make_base

pytestmark = [pytest.mark.distributed, pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")]

_COUNTED_OS = ("rename", "replace", "fsync", "chmod", "open", "mkdir")


def _arm(step: int) -> None:
    """In the child: SIGKILL this process before the ``step``-th counted file-system step."""
    left = [step]

    def counted(fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            if left[0] == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            left[0] -= 1
            return fn(*args, **kwargs)

        return wrapper

    class CountingOs:
        def __getattr__(self, name: str):
            value = getattr(os, name)
            return counted(value) if name in _COUNTED_OS else value

    loragen.atomic.os = CountingOs()  # type: ignore[assignment]
    for name in ("_write_file", "_remove_own"):
        setattr(offline_merge, name, counted(getattr(offline_merge, name)))
    offline_merge.shutil.copyfile = counted(offline_merge.shutil.copyfile)


def _in_child(action: Callable[[], None], step: int | None = None) -> int:
    """Fork a child that runs ``action`` (armed to die at ``step``); returns its pid."""
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 0
        try:
            if step is not None:
                _arm(step)
            action()
        except BaseException:
            code = 3
        os._exit(code)
    return pid


def _wait(pid: int, timeout: float = 60) -> int:
    """The child's wait status; fails the test if it hangs."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the merge hung")
        time.sleep(0.002)


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` but the marker and temporaries: relative path -> bytes."""
    if not folder.exists():
        return {}
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MERGE_MARKER_NAME and not offline_merge._TEMPORARY.fullmatch(p.name)
    }


def _temporaries(folder: Path) -> list[str]:
    return [str(p) for p in folder.rglob("*") if offline_merge._TEMPORARY.fullmatch(p.name)]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(previous=st.sampled_from(["none", "merge", "merge+user"]), step=st.integers(0, 60))
def test_a_merge_killed_anywhere_leaves_each_file_old_or_new_and_the_next_merge_finishes(
    tmp_path_factory, previous: str, step: int
) -> None:
    parent = tmp_path_factory.mktemp("parent")
    base = make_base(parent / "base")
    save_adapter(tiny_lora(3), parent / "adapter")
    target = parent / "merged"
    user: dict[str, bytes] = {}
    if previous != "none":
        save_adapter(tiny_lora(4), parent / "older")
        merge_checkpoint(base, parent / "older", target, progress=False)
        if previous == "merge+user":
            user = {"notes.txt": b"mine", "tokenizer/mine.txt": b"mine too"}
            for name, data in user.items():
                (target / name).write_bytes(data)
    old = _files(target)
    merge_checkpoint(base, parent / "adapter", parent / "reference", progress=False)
    new = _files(parent / "reference")

    status = _wait(
        _in_child(lambda: merge_checkpoint(base, parent / "adapter", target, progress=False), step)
    )
    assert os.WIFSIGNALED(status) or os.WEXITSTATUS(status) == 0, "the merge failed without being killed"

    after = _files(target)
    for name in set(old) | set(new) | set(after):
        assert after.get(name) in (old.get(name), new.get(name)), name
    if set(after) - set(old):  # a file renamed into place: the marker lists it for the next merge
        assert read_marker(target)[0] is not None
    merge_checkpoint(base, parent / "adapter", target, progress=False)
    assert _files(target) == {**new, **user}
    assert _temporaries(target) == []
    marker, why = read_marker(target)
    assert marker is not None and marker.complete, why
    assert set(marker.files) == set(new)


def test_merges_from_several_processes_take_turns_and_keep_what_others_write(tmp_path: Path) -> None:
    base = make_base(tmp_path / "base")
    target = tmp_path / "merged"
    references = []
    for seed in (5, 6):
        save_adapter(tiny_lora(seed), tmp_path / f"adapter{seed}")
        merge_checkpoint(base, tmp_path / f"adapter{seed}", tmp_path / f"reference{seed}", progress=False)
        references.append(_files(tmp_path / f"reference{seed}"))
    merge_checkpoint(base, tmp_path / "adapter5", target, progress=False)
    (target / "logs").mkdir()

    def merges(seed: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(6):
                merge_checkpoint(base, tmp_path / f"adapter{seed}", target, progress=False)

        return run

    def logger() -> None:
        for i in range(300):
            (target / ("logs" if i % 2 else ".") / f"log-{i}.txt").write_text(str(i))

    children = [_in_child(merges(5)), _in_child(merges(6)), _in_child(logger)]
    for pid in children:
        status = _wait(pid)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    logs = {f"{'logs/' if i % 2 else ''}log-{i}.txt": str(i).encode() for i in range(300)}
    assert _files(target) in ({**reference, **logs} for reference in references)
    assert _temporaries(target) == []
