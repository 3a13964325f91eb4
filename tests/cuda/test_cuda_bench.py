"""benchmarks/bench_cuda.py's CPU side: the command line, the tables, a captured step's lifetime, and a
clear failure without CUDA."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable

import pytest
import torch
from torch import nn

from loragen._benchmarks import bench_cuda


def test_quick_sets_few_rounds_and_lists_parse():
    args = bench_cuda.parse_args(
        ["--quick", "--only", "model", "--only", "small", "--batches", "1,8", "--dropouts", "0,0.05"]
    )
    assert args.parts == ("model", "small")
    assert (args.rounds, args.model_rounds) == (5, 3)
    assert args.batch_list == [1, 8] and args.dropout_list == [0.0, 0.05]
    full = bench_cuda.parse_args([])
    assert full.parts == bench_cuda.PARTS and (full.rounds, full.model_rounds) == (20, 10)
    assert bench_cuda.parse_args(["--quick", "--rounds", "7"]).rounds == 7
    assert bench_cuda.parse_args(["--only", "model", "--autocast"]).autocast and not full.autocast


def test_bad_lists_and_parts_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench_cuda.parse_args(["--batches", "one"])
    assert "comma-separated numbers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_cuda.parse_args(["--only", "everything"])


def test_summary_rows_and_markdown_table():
    report = {
        "layer": {"p=0.0": {"frozen base": 2.0, "peft": 4.0, "loragen": 3.0}},
        "small": {"p=0.05": {"frozen base": 0.25, "peft": 0.8, "loragen": 0.5, "loragen graphed": 0.3}},
        "model": {
            "batch 1, p=0.05": {
                "frozen base": {"step_ms": 40.0, "peak_GiB": 10.0},
                "peft": {"step_ms": 50.0, "peak_GiB": 12.0},
                "loragen": {"step_ms": 45.0, "peak_GiB": 11.0},
                "loragen graphed": {"peak_GiB": 11.5},  # a failed timing leaves no step_ms
            }
        },
    }
    rows = bench_cuda.summary_rows(report)
    assert [row["case"] for row in rows] == [
        "layer 4096, p=0.0",
        "small 1024x64, p=0.05",
        "model batch 1, p=0.05",
    ]
    assert rows[0]["loragen/peft"] == 0.75 and rows[0]["loragen/frozen"] == 1.5
    assert rows[2]["loragen/peft"] == 0.9 and rows[2]["peft peak GiB"] == 12.0
    table = bench_cuda.markdown_table(rows).splitlines()
    assert table[0].startswith(
        "| case | frozen base ms | peft ms | loragen ms | loragen/peft | loragen/frozen |"
    )
    assert table[1] == "|" + "---|" * len(table[0].split(" | "))
    assert "| layer 4096, p=0.0 | 2 | 4 | 3 | 0.75x | 1.50x |" in table[2]
    graphed = table[0].split(" | ").index("loragen graphed ms")
    assert table[3].split(" | ")[graphed] == "0.3"  # only where measured
    assert table[2].split(" | ")[graphed] == ""
    assert len(table) == 5


def test_graphed_steps_get_their_ratio_to_the_eager_ones():
    """A replay runs only the device's work: frozen graphed / eager above 1 says capture itself costs
    device time (the batch-8 question), the same for loragen."""
    report = {
        "model": {
            "batch 8, p=0.0": {
                "frozen base": {"step_ms": 120.0, "peak_GiB": 17.0},
                "loragen": {"step_ms": 137.0, "peak_GiB": 17.4},
                "frozen base graphed": {"step_ms": 132.0, "peak_GiB": 17.0},
                "loragen graphed": {"step_ms": 151.0, "peak_GiB": 17.4},
            }
        }
    }
    (row,) = bench_cuda.summary_rows(report)
    assert row["frozen graphed/eager"] == 1.1 and row["loragen graphed/eager"] == 151.0 / 137.0
    assert row["graphed loragen/frozen"] == 151.0 / 132.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a CUDA device")
def test_without_cuda_it_fails_clearly(capsys):
    assert bench_cuda.main(["--only", "layer"]) == 2
    assert "need a CUDA device and cuda-python" in capsys.readouterr().err


class _Graph:
    """Stands in for ``torch.cuda.CUDAGraph``: like it, it holds nothing of what it replays."""

    replays = 0

    def replay(self) -> None:
        _Graph.replays += 1


class _Stream:
    def wait_stream(self, other: object) -> None:
        pass


def _training_step(model: nn.Module) -> Callable[[], None]:
    x = torch.randn(2, 4)

    def step() -> None:
        model(x).sum().backward()

    return step


def test_a_captured_step_keeps_the_model_its_graph_reads_alive(monkeypatch):
    """A CUDA graph keeps no tensor alive: were the replay only ``graph.replay``, a model held by nothing
    else (the benchmark's frozen base graphed, once the loop built the next kind) would be freed, and its
    memory handed back to the driver by the next ``empty_cache`` while the graph still reads it."""
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph: contextlib.nullcontext())
    model = nn.Linear(4, 4)
    alive = weakref.ref(model)
    replay = bench_cuda.captured(_training_step(model), warmup=2)
    del model
    gc.collect()
    assert alive() is not None
    before = _Graph.replays
    replay()
    assert _Graph.replays == before + 1
    del replay
    gc.collect()
    assert alive() is None
