"""Merging while another thread runs the layer: forwards and merges of one layer take turns.

``merge()`` / ``unmerge()`` change ``weight`` in place and flip ``merged``. A forward running in another
thread at that moment could read the flag before the change and the weight after it (the update counted
twice, or not at all). Each LoRA layer therefore has a small readers-writer guard: any number of forwards
run together (several threads, ``nn.DataParallel`` replicas); a merge or unmerge waits until the
forwards in flight have finished, and forwards that start meanwhile wait for it. A forward the merging
thread itself runs (a probe inside ``merge``) does not wait. Under ``torch.compile`` tracing the guard is
skipped: a traced graph has no threads of its own to order.

Each layer's output is right merged or unmerged, so per-layer turns are enough for a whole model: a
forward that overlaps ``loragen.merge_adapter(model)`` may see some layers merged and others not, and
computes the same outputs either way (to float rounding).

The guard lives in the layer's ``__dict__`` and is made on first use; copies and pickles of a layer get a
fresh one (:func:`without_guard` removes it from the state they copy).
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["GUARD_ATTR", "MergeGuard", "guard_of", "reading", "without_guard", "writing"]

GUARD_ATTR = "_merge_guard"
# the interpreter runs one thread's step at a time (no free-threaded build, or its GIL turned back on)
_GIL: bool = getattr(sys, "_is_gil_enabled", lambda: True)()
_RECOUNT_S = 0.005  # how often a waiting merge counts the forwards in flight again
F = TypeVar("F", bound=Callable[..., Any])


class MergeGuard:
    """A readers-writer turn: forwards read together, a merge writes alone.

    A forward counts itself in by appending to ``_readers`` and then looking for a merge; a merge marks
    itself in ``_writer`` and then waits for ``_readers`` to empty. Whichever of the two steps comes
    second sees the other, so a forward and a merge never both go ahead. With the GIL each step is one
    atomic list or attribute operation and a forward takes no lock (it runs on every call of every LoRA
    layer); on a free-threaded interpreter the forward's two steps are taken under the lock.
    """

    __slots__ = ("_changed", "_readers", "_writer")

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._readers: list[None] = []  # one entry per forward in flight
        self._writer: int | None = None  # the thread ident of the merge in progress

    def start_reading(self) -> bool:
        """Wait for a merge in another thread to finish, then count this forward in. False (nothing to
        undo) when this thread is the one merging."""
        readers = self._readers
        while True:
            if _GIL:
                readers.append(None)
                writer = self._writer
            else:
                with self._changed:
                    readers.append(None)
                    writer = self._writer
            if writer is None:
                return True
            readers.pop()  # a merge holds the layer, or is waiting for the forwards in flight
            if writer == threading.get_ident():
                return False
            with self._changed:
                self._changed.notify_all()  # a merge counting the forwards in flight counts again
                while self._writer is not None:
                    self._changed.wait()

    def stop_reading(self) -> None:
        self._readers.pop()
        if self._writer is not None:
            with self._changed:
                self._changed.notify_all()

    def start_writing(self) -> bool:
        """Wait until no forward and no other merge runs, then hold the layer. False when this thread
        already holds it (a nested merge)."""
        me = threading.get_ident()
        with self._changed:
            if self._writer == me:
                return False
            while self._writer is not None:
                self._changed.wait()
            self._writer = me
            while self._readers:  # forwards notify as they leave; the timeout covers a notification
                self._changed.wait(_RECOUNT_S)  # sent between their pop and this check
        return True

    def stop_writing(self) -> None:
        with self._changed:
            self._writer = None
            self._changed.notify_all()


def guard_of(layer: torch.nn.Module) -> MergeGuard:
    """The layer's guard, made on first use (``dict.setdefault`` keeps two first users on one guard)."""
    guard = layer.__dict__.get(GUARD_ATTR)
    if guard is None:
        guard = layer.__dict__.setdefault(GUARD_ATTR, MergeGuard())
    return guard


def reading(forward: F) -> F:
    """Decorate a LoRA layer's ``forward``: it runs while no merge of that layer is in progress."""

    @functools.wraps(forward)
    def guarded(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return forward(self, *args, **kwargs)
        guard = guard_of(self)
        if not guard.start_reading():
            return forward(self, *args, **kwargs)
        try:
            return forward(self, *args, **kwargs)
        finally:
            guard.stop_reading()

    return guarded  # type: ignore[return-value]


def writing(change: F) -> F:
    """Decorate a LoRA layer's ``merge`` / ``unmerge``: it waits for the layer's forwards in flight, and
    forwards that start meanwhile wait for it."""

    @functools.wraps(change)
    def guarded(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        guard = guard_of(self)
        if not guard.start_writing():
            return change(self, *args, **kwargs)
        try:
            return change(self, *args, **kwargs)
        finally:
            guard.stop_writing()

    return guarded  # type: ignore[return-value]


def without_guard(state: dict[str, Any]) -> dict[str, Any]:
    """A layer's state for copying or pickling: everything but its guard (a lock copies as nothing)."""
    if GUARD_ATTR not in state:
        return state
    return {key: value for key, value in state.items() if key != GUARD_ATTR}
