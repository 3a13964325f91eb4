"""Merging in one thread while another runs forward: every output is the merged or the unmerged one.

Without the guard a forward could read ``merged`` before a merge and the weight after it (the update
counted twice) or the reverse (not at all); torch releases the GIL inside its kernels, so such
interleavings happen within a few hundred calls.
"""

from __future__ import annotations

import copy
import pickle
import threading
import time

import pytest
import torch

import loragen
from loragen import LoraConfig
from loragen.layers import base
from loragen.layers.base import MergeGuard


@pytest.fixture(params=[True, False], ids=["gil", "free-threaded"])
def interpreter(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both ways forwards count themselves in: lock-free under the GIL, under the lock without it."""
    monkeypatch.setattr(base, "_GIL", request.param)
    return bool(request.param)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    model = loragen.get_lora_model(model, LoraConfig(r=8, lora_alpha=64, target_modules=["0", "1"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_()  # a large update: counted twice or missed, outputs change a lot
    return model.eval()


def test_forward_during_merges_sees_merged_or_unmerged_weights(interpreter: bool) -> None:
    model = _model()
    x = torch.randn(512, 256)
    with torch.no_grad():
        expected = model(x)
    errors: list[float] = []
    stop = threading.Event()

    def run_forwards() -> None:
        with torch.no_grad():
            for _ in range(300):
                errors.append(((model(x) - expected).norm() / expected.norm()).item())
        stop.set()

    def run_merges() -> None:
        while not stop.is_set():
            loragen.merge_adapter(model)
            loragen.unmerge_adapter(model)

    threads = [threading.Thread(target=run_forwards), threading.Thread(target=run_merges)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert len(errors) == 300
    assert max(errors) < 1e-4, f"a forward saw a half-done merge: relative error {max(errors):.3g}"


def test_a_merge_waits_for_forwards_and_forwards_wait_for_a_merge(interpreter: bool) -> None:
    guard = MergeGuard()
    assert guard.start_reading()
    merged = threading.Event()

    def merge() -> None:
        assert guard.start_writing()
        merged.set()
        guard.stop_writing()

    writer = threading.Thread(target=merge)
    writer.start()
    assert not merged.wait(0.2)  # a forward is in flight
    # a forward that starts while the merge waits for the ones in flight waits for the merge
    late: list[bool] = []
    reader = threading.Thread(target=lambda: late.append(guard.start_reading()))
    reader.start()
    reader.join(timeout=0.2)
    assert reader.is_alive() and not late
    guard.stop_reading()
    writer.join(timeout=30)
    assert merged.is_set()
    reader.join(timeout=30)
    assert late == [True]
    guard.stop_reading()
    assert guard.start_writing()  # nothing left in flight
    guard.stop_writing()


def test_many_forwards_and_merges_never_overlap(interpreter: bool) -> None:
    """Threads entering and leaving as forwards and as merges: a merge never runs beside a forward or
    another merge, and every thread finishes."""
    guard = MergeGuard()
    state = {"readers": 0, "writers": 0}
    seen = threading.Lock()
    overlaps: list[str] = []

    def forward() -> None:
        for _ in range(400):
            assert guard.start_reading()
            with seen:
                state["readers"] += 1
                if state["writers"]:
                    overlaps.append("a forward beside a merge")
            time.sleep(0)  # let the other threads run while this one is inside
            with seen:
                state["readers"] -= 1
            guard.stop_reading()
            time.sleep(0.0001)  # gaps in which a merge can start

    def merge() -> None:
        for _ in range(40):
            assert guard.start_writing()
            with seen:
                if state["readers"] or state["writers"]:
                    overlaps.append("a merge beside a forward or a merge")
                state["writers"] += 1
            time.sleep(0.0005)
            with seen:
                state["writers"] -= 1
            guard.stop_writing()

    threads = [threading.Thread(target=forward) for _ in range(4)] + [
        threading.Thread(target=merge) for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert not overlaps


def test_the_merging_thread_can_run_the_layer_itself(interpreter: bool) -> None:
    guard = MergeGuard()
    assert guard.start_writing()
    assert not guard.start_reading()  # no wait, nothing to undo: a probe inside merge()
    assert not guard.start_writing()  # a nested merge
    guard.stop_writing()
    assert guard.start_reading()
    guard.stop_reading()


def test_copies_and_pickles_of_a_layer_get_their_own_guard() -> None:
    model = _model()
    model(torch.randn(2, 256))
    layer = model[0]
    assert isinstance(layer.merge_guard, MergeGuard)
    for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert isinstance(twin.merge_guard, MergeGuard) and twin.merge_guard is not layer.merge_guard
        x = torch.randn(3, 256)
        torch.testing.assert_close(twin(x), layer(x))
        twin.merge()
        torch.testing.assert_close(twin(x), layer(x), rtol=1e-4, atol=1e-4)
    assert "merge_guard" not in vars(loragen.merge_and_unload(model)[0])
