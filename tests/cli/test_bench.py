"""loragen bench: the harness, a smoke run of each benchmark at tiny sizes (--quick), --json, progress on
stderr, --help's expected durations, the caveat of a run too small to be representative, the closing
time with start-up included, and the message naming the [bench] extra when peft is missing."""

from __future__ import annotations

import importlib
import json
import re
import sys

import pytest
import torch

from loragen.cli import main
from loragen.cli.bench import BENCHMARKS, MIN_ROUNDS, MIN_STEP_SECONDS, caveats, load_benchmark

# the variants every CPU benchmark of the tiny Llama times (a benchmark may add ablation rows of its own)
LLAMA_ROWS = {"frozen", "peft", "loragen", "loragen unfused"}


def _harness():
    return importlib.import_module(f"{load_benchmark('layer').__package__}.harness")


def _rows(text: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("variant",):
            rows[cells[0]] = cells[1:]
    return rows


def _headers(text: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("| variant")
    ]


def test_bench_layer_quick_prints_tables_progress_and_json_file(tmp_path, capsys) -> None:
    json_file = tmp_path / "layer.json"
    argv = ["bench", "layer", "--quick", "--dropout", "0.1", "--threads", "1", "--json", str(json_file)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "dropout 0.1" in out
    rows = _rows(out)
    assert set(rows) == {"frozen", "peft", "loragen", "loragen unfused", "full"}
    for cells in rows.values():
        assert re.fullmatch(r"\d+\.\d", cells[0]) and float(cells[0]) > 0  # a median time in ms
    # a single frozen nn.Linear saves nothing for backward (dx = g W): no saved / frozen column, said so
    (header,) = _headers(out)
    assert header == ["variant", "median ms", "time / frozen", "time / peft", "saved MiB", "saved / peft"]
    assert "frozen saves nothing for backward" in out
    assert all(cell != "-" for cells in rows.values() for cell in cells)
    saved = {name: float(cells[3]) for name, cells in rows.items()}
    assert saved["frozen"] == 0.0
    assert saved["loragen"] < saved["peft"]  # no float mask, no dropout(x) copy

    # progress: one line per warm-up and timed round on stderr
    progress = [line for line in captured.err.splitlines() if line.startswith("bench: table 1: ")]
    assert [line.split(" of ")[0] for line in progress if "round " in line and "warm-up" not in line] == [
        f"bench: table 1: round {i}/3" for i in (1, 2, 3)
    ]
    assert BENCHMARKS["layer"].quick_duration in captured.err

    report = json.loads(json_file.read_text())
    assert report["benchmark"] == "layer" and report["options"]["quick"] is True
    assert report["options"]["dropout"] == [0.1] and report["seconds"] > 0 and "torch" in report["machine"]
    (table,) = report["tables"]
    assert (
        "dropout 0.1" in table["title"] and table["rounds"] == 3 and table["ratio_to"] == ["frozen", "peft"]
    )
    variants = {v["name"]: v for v in table["variants"]}
    assert set(variants) == set(rows)
    for name, v in variants.items():
        assert len(v["times_s"]) == 3 and v["median_s"] == sorted(v["times_s"])[1]
        assert v["saved_ratio"]["frozen"] is None and isinstance(v["saved_bytes"], int)
        assert v["time_ratio"]["peft"] == pytest.approx(v["median_s"] / variants["peft"]["median_s"])
        assert f"{v['saved_bytes'] / 2**20:.2f}" == rows[name][3]
    assert variants["frozen"]["saved_bytes"] == 0
    # too small to mean anything, and said so in the output and the report; the time includes start-up
    assert "Not representative:\n- --quick is a smoke test, not a measurement" in out
    assert report["representative"] is False and report["caveats"][0].startswith("--quick is a smoke test")
    assert 0 < report["startup_seconds"] <= report["seconds"]
    footer = out.strip().splitlines()[-1]
    assert re.fullmatch(
        r"\(loragen bench layer: \d+\.\d s wall-clock from process start, of which \d+\.\d s start-up: .*\)",
        footer,
    )


def test_bench_llama_quick_writes_markdown_and_fills_saved_over_frozen(tmp_path, capsys) -> None:
    out_file = tmp_path / "bench.md"
    assert main(["bench", "llama", "--quick", "--dropout", "0", "--threads", "1", "-o", str(out_file)]) == 0
    printed = capsys.readouterr().out
    assert out_file.read_text().strip() == printed.strip()
    rows = _rows(printed)
    assert LLAMA_ROWS | {"full fine-tuning"} <= set(rows)
    # a frozen network saves activations to pass gradients to its input embeddings: the column is filled
    (header,) = _headers(printed)
    assert header[-2:] == ["saved / frozen", "saved / peft"]
    saved_over_frozen = {name: float(cells[-2]) for name, cells in rows.items()}
    assert saved_over_frozen["frozen"] == 1.0 and saved_over_frozen["peft"] > 1.0


def test_bench_decoder_quick_json_on_stdout(capsys) -> None:
    assert main(["bench", "decoder", "--quick", "--threads", "1", "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # nothing but the JSON on stdout: the caveat goes to stderr
    assert "loragen bench: not representative:\n- --quick is a smoke test" in captured.err
    (table,) = report["tables"]
    variants = {v["name"]: v for v in table["variants"]}
    assert LLAMA_ROWS <= set(variants) and "full fine-tuning" not in variants
    assert variants["loragen"]["saved_bytes"] <= variants["peft"]["saved_bytes"]
    assert variants["frozen"]["saved_bytes"] > 0 and variants["peft"]["saved_ratio"]["frozen"] > 1.0
    assert "bench: table 1: round 3/3" in captured.err


@pytest.mark.parametrize("missing", ["peft", "transformers"])
def test_bench_without_peft_names_the_extra(monkeypatch, capsys, missing: str) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # import raises ImportError
    assert main(["bench", "layer", "--quick"]) == 1
    err = capsys.readouterr().err
    assert "loragen bench needs peft and transformers; missing: " in err and f"{missing} (" in err
    assert "pip install -e '.[bench]'" in err  # loragen installs from its checkout


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_bench_help_gives_the_expected_duration_and_the_options(name: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", name, "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert BENCHMARKS[name].duration in text and BENCHMARKS[name].quick_duration in text
    assert "--quick" in text and "--json [FILE]" in text and ".[bench]" in text


def test_bench_cpu_kernels_smoke() -> None:
    from loragen.ops import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("loragen's compiled CPU kernels are not available on this machine")
    bench = load_benchmark("layer").__package__
    run = importlib.import_module(f"{bench}.bench_cpu_kernels").run
    text = run(rounds=1)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "product" not in line]
    assert len(rows) == 6 and all(float(cell) > 0 for row in rows for cell in row.strip("|").split("|")[2:])


def test_saved_bytes_counts_each_storage_once_and_skips_kept_tensors() -> None:
    saved_bytes = _harness().saved_bytes
    x = torch.randn(100, requires_grad=True)
    w = torch.randn(100, requires_grad=True)
    # x is saved by both products but counted once; w and x * w once each
    assert saved_bytes(lambda: (x * w) * x) == 3 * 400
    assert saved_bytes(lambda: (x * w) * x, keep=[w]) == 2 * 400


def test_tables_drop_only_the_saved_ratio_to_a_reference_that_saved_nothing() -> None:
    harness = _harness()
    results = [
        harness.Result("base", [0.002, 0.001, 0.003], 0),
        harness.Result("lora", [0.004], 3 << 20),
        harness.Result("peft", [0.006], 6 << 20),
    ]
    with harness.recording(progress=None) as record:
        text = harness.format_table(results, "toy", ratio_to=["base", "peft", "absent"])
    (table,) = record.tables
    assert table.ratio_to == ["base", "peft"]  # names not among the variants are left out
    assert _headers(text) == [
        ["variant", "median ms", "time / base", "time / peft", "saved MiB", "saved / peft"]
    ]
    assert _rows(text)["lora"] == ["4.0", "2.000", "0.667", "3.00", "0.500"]
    assert "base saves nothing for backward" in text
    lora = table.to_json()["variants"][1]
    assert lora["saved_ratio"] == {"base": None, "peft": 0.5} and lora["time_ratio"]["base"] == 2.0


def test_run_variants_reports_every_round(capsys) -> None:
    harness = _harness()
    x = torch.ones(3, requires_grad=True)
    variant = harness.Variant("v", lambda: None, lambda: x * 2)
    with harness.recording(progress=sys.stdout):
        harness.run_variants([variant], rounds=4, warmup=1)
        harness.run_variants([variant], rounds=2, warmup=0)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "bench: table 1: warm-up round 1/1",
        *(f"bench: table 1: round {i}/4 of 1 variants" for i in range(1, 5)),
        "bench: table 2: round 1/2 of 1 variants",
        "bench: table 2: round 2/2 of 1 variants",
    ]


def _table(rounds: int, seconds: float):
    harness = _harness()
    results = [harness.Result(name, [seconds] * rounds, 0) for name in ("frozen", "loragen")]
    return harness.Table("toy", results, ["frozen"])


def test_caveats_name_quick_few_rounds_and_short_steps() -> None:
    long_step = 2 * MIN_STEP_SECONDS
    assert caveats(False, [_table(MIN_ROUNDS, long_step)]) == []  # representative: nothing to say
    (few,) = caveats(False, [_table(MIN_ROUNDS - 1, long_step)])
    assert few.startswith(f"table 1: medians of {MIN_ROUNDS - 1} rounds") and f"--rounds {MIN_ROUNDS}" in few
    (short,) = caveats(False, [_table(MIN_ROUNDS, MIN_STEP_SECONDS / 2)])
    assert short.startswith("table 1: frozen, loragen step in under 10 ms")
    # --quick says why once, whatever its tables look like
    (quick,) = caveats(True, [_table(3, MIN_STEP_SECONDS / 2)])
    assert quick.startswith("--quick is a smoke test, not a measurement") and "BENCHMARKS.md" in quick
