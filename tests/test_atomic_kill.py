"""Writers killed at any moment leave the old or the new content, complete, and nothing else changed.

A forked child writes (``atomic_dir``, ``save_adapter``) with every file-system
step loragen's writer takes (rename, exchange, fsync, chmod, delete, the tensor file write...) counted;
it SIGKILLs itself before step ``k``, which hypothesis draws. Then:

- with the exchange rename, the target holds the old or the new content at once (never missing);
- without it (the journalled fallback), the next write to the target completes or rolls back the swap;
- after that next write, no temporary entry is left and every entry beside the target is unchanged.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import loragen.atomic
from loragen import save_adapter
from loragen.atomic import atomic_dir
from tests.adapters.helpers import tiny_lora, tree_snapshot

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")

_COUNTED_OS = ("rename", "replace", "fsync", "chmod", "open", "mkdir", "scandir")
_SETTINGS = settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _arm(step: int, journal: bool) -> None:
    """In the child: SIGKILL this process before the ``step``-th counted file-system step."""
    left = [step]

    def tick() -> None:
        if left[0] == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        left[0] -= 1

    def counted(fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            tick()
            return fn(*args, **kwargs)

        return wrapper

    class CountingOs:
        def __getattr__(self, name: str):
            value = getattr(os, name)
            return counted(value) if name in _COUNTED_OS else value

    loragen.atomic.os = CountingOs()  # type: ignore[assignment]
    for name in ("_remove", "_exchange"):  # the steps of the folder swap
        if hasattr(loragen.atomic, name):
            setattr(loragen.atomic, name, counted(getattr(loragen.atomic, name)))
    safetensors.torch.save_file = counted(safetensors.torch.save_file)
    if journal:
        loragen.atomic._RENAMEAT2 = None


def _run_killed(action: Callable[[], None], step: int, journal: bool) -> bool:
    """Run ``action`` in a forked child armed to die at ``step``; True if it was killed."""
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 0
        try:
            _arm(step, journal)
            action()
        except BaseException:
            code = 3
        os._exit(code)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the writer hung")
        time.sleep(0.002)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True
    assert os.WEXITSTATUS(status) == 0, "the writer failed without being killed"
    return False


def _next_access(target: Path) -> None:
    """A write to ``target`` that changes nothing (it fails on purpose): it finishes a cut-off swap and
    deletes the leftovers of killed writers."""
    with contextlib.suppress(RuntimeError), atomic_dir(target):
        raise RuntimeError("no change")


def _check(parent: Path, target: Path, before: dict, old: dict | None, new: dict, journal: bool) -> None:
    name = target.name
    if not journal and old is not None:  # the exchange rename: never a moment without the target
        assert target.is_dir()
        assert tree_snapshot(target) in (old, new)
    _next_access(target)
    state = tree_snapshot(target) if target.exists() else None
    assert state in (old, new)
    after = tree_snapshot(parent)
    outside = {k: v for k, v in after.items() if k != name and not k.startswith(name + os.sep)}
    assert outside == {k: v for k, v in before.items() if k != name and not k.startswith(name + os.sep)}


_files = st.dictionaries(
    st.sampled_from(["a.bin", "b.json", "README.md", "sub/c.bin"]), st.binary(max_size=64), max_size=4
)


@_SETTINGS
@given(old=st.none() | _files, new=_files, step=st.integers(0, 40), journal=st.booleans())
def test_atomic_dir_killed_anywhere(tmp_path_factory, old, new, step: int, journal: bool) -> None:
    parent = tmp_path_factory.mktemp("parent")
    (parent / "sibling.txt").write_text("untouched")
    target = parent / "target"

    def write(folder: Path, files: dict[str, bytes]) -> None:
        for rel, data in files.items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_bytes(data)

    if old is not None:
        target.mkdir()
        write(target, old)
    old_state = tree_snapshot(target) if old is not None else None
    reference = tmp_path_factory.mktemp("reference")
    write(reference, new)
    before = tree_snapshot(parent)

    def action() -> None:
        with atomic_dir(target) as tmp:
            write(tmp, new)

    _run_killed(action, step, journal)
    _check(parent, target, before, old_state, tree_snapshot(reference), journal)


@_SETTINGS
@given(
    existing=st.sampled_from(["none", "adapter", "adapter+readme"]),
    step=st.integers(0, 20),
    journal=st.booleans(),
)
def test_save_adapter_killed_anywhere(tmp_path_factory, existing: str, step: int, journal: bool) -> None:
    parent = tmp_path_factory.mktemp("parent")
    (parent / "train.py").write_text("print('mine')")
    target = parent / "adapter"
    if existing != "none":
        save_adapter(tiny_lora(1), target)
        if existing == "adapter+readme":
            (target / "README.md").write_text("notes")
    old_state = tree_snapshot(target) if target.exists() else None
    reference = tmp_path_factory.mktemp("reference") / "adapter"
    if target.exists():
        shutil.copytree(target, reference)
    new_model = tiny_lora(2)
    save_adapter(new_model, reference)
    before = tree_snapshot(parent)

    _run_killed(lambda: save_adapter(new_model, target), step, journal)
    _check(parent, target, before, old_state, tree_snapshot(reference), journal)


def test_concurrent_saves_to_one_path_take_turns(tmp_path: Path) -> None:
    target = tmp_path / "adapter"
    models = [tiny_lora(5), tiny_lora(6)]
    references = []
    for i, model in enumerate(models):
        save_adapter(model, tmp_path / f"reference{i}")
        references.append(tree_snapshot(tmp_path / f"reference{i}"))
    children = []
    for model in models:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                for _ in range(25):
                    save_adapter(model, target)
            except BaseException:
                code = 3
            os._exit(code)
        children.append(pid)
    for pid in children:
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert tree_snapshot(target) in references
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "reference0", "reference1"]
