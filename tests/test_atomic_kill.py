"""Writers killed at any moment leave the old or the new content, complete, and nothing else changed.

A forked child writes (``atomic_write_bytes``, ``save_adapter``) with every file-system step loragen's
writer takes (rename, replace, fsync, chmod, open, delete, the tensor file write...) counted; it SIGKILLs
itself before step ``k``, which hypothesis draws. Then:

- one file: the target holds its old or its new content at every moment (never missing once it exists);
  the next write deletes the killed writer's temporary file, and every entry beside the target is unchanged;
- a save (several files): every file holds its old or its new content, each adapter folder reads as the
  old or the new adapter (config and weights together), other files are unchanged, and the next save
  leaves the new adapter and no temporary.

Concurrent saves, readers and another process writing files into the same folder: every read is one saved
adapter, no file of the other process is lost.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import loragen.atomic
from loragen import LoraConfig, add_adapter, get_lora_model, save_adapter
from loragen.adapters.folder import read_adapter
from loragen.atomic import atomic_file, atomic_write_bytes
from tests.adapters.helpers import TinyNet, perturb_trainable, tree_snapshot

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")

_COUNTED_OS = ("rename", "replace", "fsync", "chmod", "fchmod", "write", "unlink", "open", "mkdir", "scandir")
_SETTINGS = settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _arm(step: int) -> None:
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
    safetensors.torch.save_file = counted(safetensors.torch.save_file)


def _run_killed(action: Callable[[], None], step: int) -> bool:
    """Run ``action`` in a forked child armed to die at ``step``; True if it was killed."""
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 0
        try:
            _arm(step)
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
    """A write to ``target`` that changes nothing (it fails on purpose): it deletes the temporary files of
    killed writers."""
    with contextlib.suppress(RuntimeError), atomic_file(target):
        raise RuntimeError("no change")


@pytest.mark.parametrize("old", [None, b"old weights"], ids=["new", "replaced"])
def test_atomic_file_killed_anywhere(tmp_path: Path, old: bytes | None) -> None:
    """Killed before each of its steps in turn, until one write runs to its end."""
    new = b"new weights"
    for step in itertools.count():
        parent = tmp_path / f"killed-at-{step}"
        parent.mkdir()
        (parent / "sibling.txt").write_text("untouched")
        (parent / ".sibling.txt.loragen-7-ab.tmp").write_text("another file's write, not this one's")
        target = parent / "model.safetensors"
        if old is not None:
            target.write_bytes(old)
        before = tree_snapshot(parent)

        killed = _run_killed(lambda target=target: atomic_write_bytes(target, new), step)

        if old is not None:  # never a moment without the file
            assert target.read_bytes() in (old, new)
        elif target.exists():
            assert target.read_bytes() == new
        _next_access(target)  # no temporary left, nothing else changed
        after = tree_snapshot(parent)
        assert after.pop(target.name, None) in (old, new)
        assert after == {k: v for k, v in before.items() if k != target.name}
        if not killed:
            assert target.read_bytes() == new
            break
    assert step >= 5  # open, fsync, chmod, rename, fsync the folder: each one cut off once


_TEMPORARY = re.compile(r"(.*/)?\.[^/]+\.loragen-\d+-[0-9a-f]+\.tmp")


def _adapters(seed: int, alpha: int) -> nn.Module:
    """TinyNet with a default adapter and one named ``other`` (saved in ``other/``), values from ``seed``."""
    torch.manual_seed(seed)
    model = get_lora_model(TinyNet(), LoraConfig(r=2, lora_alpha=alpha, target_modules=["q", "v"]))
    add_adapter(model, LoraConfig(r=2, lora_alpha=alpha + 1, target_modules=["q"]), "other")
    perturb_trainable(model, seed)
    with torch.no_grad():
        model.q.lora_adapters["other"].lora_B.normal_()
    return model


def _pair(folder: Path) -> tuple[dict, dict[str, bytes]]:
    """What a loader sees in the adapter folder: its config and its tensors' bytes."""
    adapter = read_adapter(folder)
    return adapter.config_dict, {k: v.numpy().tobytes() for k, v in adapter.tensors.items()}


@_SETTINGS
@given(existing=st.booleans(), step=st.integers(0, 30))
def test_save_adapter_killed_anywhere(tmp_path_factory, existing: bool, step: int) -> None:
    parent = tmp_path_factory.mktemp("parent")
    (parent / "train.py").write_text("print('mine')")
    target = parent / "adapter"
    old_model, new_model = _adapters(1, 4), _adapters(2, 8)
    if existing:
        save_adapter(old_model, target)
    (target / "logs").mkdir(parents=True)  # a logger's files, beside the adapter
    (target / "logs" / "run.txt").write_text("step 1")
    (target / "README.md").write_text("notes")
    old_state = tree_snapshot(target)
    old_pairs = {rel: _pair(target / rel) for rel in ("", "other")} if existing else {}
    reference = tmp_path_factory.mktemp("reference") / "adapter"
    shutil.copytree(target, reference)
    save_adapter(new_model, reference)
    new_state = tree_snapshot(reference)
    new_pairs = {rel: _pair(reference / rel) for rel in ("", "other")}
    before = tree_snapshot(parent)

    _run_killed(lambda: save_adapter(new_model, target), step)

    state = {k: v for k, v in tree_snapshot(target).items() if not _TEMPORARY.fullmatch(k)}
    for key in {*state, *old_state, *new_state}:  # each file old or new, never half-written
        assert state.get(key) in (old_state.get(key), new_state.get(key)), key
    for rel in ("", "other"):  # config and weights from one save
        if (target / rel / "adapter_config.json").exists():
            assert _pair(target / rel) in (old_pairs.get(rel), new_pairs[rel])
    after = tree_snapshot(parent)
    untouched = ("train.py", "adapter/README.md", "adapter/logs", "adapter/logs/run.txt")
    assert {k: after[k] for k in untouched} == {k: before[k] for k in untouched}

    save_adapter(new_model, target)  # the next save: the new adapter, no leftovers
    assert tree_snapshot(target) == new_state


def _child(work: Callable[[], None]) -> int:
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 0
        try:
            work()
        except AssertionError:
            code = 4
        except BaseException:
            code = 3
        os._exit(code)
    return pid


def test_concurrent_saves_readers_and_other_writers(tmp_path: Path) -> None:
    """Two processes save two different adapters to one folder in turn, a third writes its own files into
    the folder (a logger, another rank's rng_state), a fourth reads: every read is one saved adapter, config
    and weights together; every file of the third process is kept; the end state is one of the adapters."""
    target = tmp_path / "checkpoint-1"
    models = [_adapters(5, 4), _adapters(6, 8)]
    references, pairs = [], []
    for i, model in enumerate(models):
        save_adapter(model, tmp_path / f"reference{i}")
        references.append(tree_snapshot(tmp_path / f"reference{i}"))
        pairs.append({rel: _pair(tmp_path / f"reference{i}" / rel) for rel in ("", "other")})
    save_adapter(models[0], target)
    done = tmp_path / "done"

    def save(model: nn.Module) -> None:
        for _ in range(15):
            save_adapter(model, target)

    def write_files() -> None:
        for i in range(400):
            (target / f"rng_state_{i}.pth").write_text(str(i))
            if done.exists():
                break

    def read() -> None:
        while not done.exists():
            for rel in ("", "other"):
                assert _pair(target / rel) in [p[rel] for p in pairs]

    readers = [_child(write_files), _child(read)]
    savers = [_child(lambda model=model: save(model)) for model in models]
    for pid in savers:
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    done.touch()
    for pid, what in zip(readers, ["the writer of other files", "the reader"]):
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"{what} failed ({status})"
    state = tree_snapshot(target)
    others = {k: state.pop(k) for k in list(state) if k.startswith("rng_state_")}
    assert others == {f"rng_state_{i}.pth": str(i).encode() for i in range(len(others))} and others
    assert state in references
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "done", "reference0", "reference1"]
