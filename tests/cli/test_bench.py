"""loragen bench: the benchmark harness and a smoke run of both benchmarks at tiny sizes."""

from __future__ import annotations

import re

import torch

from loragen.cli import main
from loragen.cli.bench import load_benchmark


def _rows(text: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("variant",):
            rows[cells[0]] = cells[1:]
    return rows


def test_bench_layer_quick(capsys) -> None:
    assert main(["bench", "layer", "--quick", "--dropout", "0.1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "dropout 0.1" in out
    rows = _rows(out)
    assert set(rows) == {"frozen", "peft", "loragen", "loragen unfused", "full"}
    for cells in rows.values():
        assert re.fullmatch(r"\d+\.\d", cells[0]) and float(cells[0]) > 0  # a median time in ms
    saved = {name: float(cells[3]) for name, cells in rows.items()}
    assert saved["loragen"] < saved["peft"]  # no float mask, no dropout(x) copy


def test_bench_llama_quick_writes_markdown(tmp_path, capsys) -> None:
    out_file = tmp_path / "bench.md"
    assert main(["bench", "llama", "--quick", "--dropout", "0", "--threads", "1", "-o", str(out_file)]) == 0
    printed = capsys.readouterr().out
    assert out_file.read_text().strip() == printed.strip()
    assert set(_rows(printed)) == {"frozen", "peft", "loragen", "loragen, no sibling fusion", "loragen unfused",
                                   "full fine-tuning"}


def test_bench_decoder_quick(capsys) -> None:
    assert main(["bench", "decoder", "--quick", "--threads", "1"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert set(rows) == {"frozen", "peft", "loragen", "loragen, no sibling fusion", "loragen unfused"}
    saved = {name: float(cells[3]) for name, cells in rows.items()}
    assert saved["loragen"] <= saved["peft"]


def test_bench_cpu_kernels_smoke() -> None:
    from loragen.ops import cpu_kernels

    bench = load_benchmark("layer").__name__.rsplit(".", 1)[0]
    run = __import__(f"{bench}.bench_cpu_kernels", fromlist=["run"]).run
    text = run(rounds=1)
    if not cpu_kernels.available():
        assert text.startswith("compiled kernels unavailable")
        return
    rows = [line for line in text.splitlines() if line.startswith("| ") and "product" not in line]
    assert len(rows) == 6 and all(float(cell) > 0 for row in rows for cell in row.strip("|").split("|")[2:])


def test_saved_bytes_counts_each_storage_once_and_skips_kept_tensors() -> None:
    harness = load_benchmark("layer").__name__.rsplit(".", 1)[0]
    saved_bytes = __import__(f"{harness}.harness", fromlist=["saved_bytes"]).saved_bytes
    x = torch.randn(100, requires_grad=True)
    w = torch.randn(100, requires_grad=True)
    # x is saved by both products but counted once; w and x * w once each
    assert saved_bytes(lambda: (x * w) * x) == 3 * 400
    assert saved_bytes(lambda: (x * w) * x, keep=[w]) == 2 * 400
