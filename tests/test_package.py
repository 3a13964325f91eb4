"""The wheel carries templates/, kernels/, the examples and the benchmarks, and loragen reads and runs them
from the installed wheel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_NOT_SOURCES = (
    ".git",
    ".pytest_cache",
    ".hypothesis",
    "*_cache",
    ".venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # built from a copy: other tests write into the checkout meanwhile (caches under .pytest_cache), and an
    # in-tree build would walk files that come and go
    source = tmp_path_factory.mktemp("source") / "loragen"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*_NOT_SOURCES))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(source),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    (path,) = out.glob("loragen-*.whl")
    return path


def test_wheel_contains_templates_kernels_and_cli(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    repo_templates = sorted(p.name for p in (ROOT / "templates").glob("*.j2"))
    kernels = ROOT / "kernels"
    repo_kernels = sorted(p.name for pattern in ("*.j2", "*.c", "*.cpp") for p in kernels.glob(pattern))
    assert repo_templates and repo_kernels, "templates/ and kernels/ must hold Jinja templates"
    assert "lora_dropout_cpu.c" in repo_kernels  # the CPU kernels' C source ships too
    assert "lora_common.cuh.j2" in repo_kernels  # and the CUDA kernels' shared header
    for name in repo_templates:
        assert f"loragen/_templates/{name}" in names
    for name in repo_kernels:
        assert f"loragen/_kernels/{name}" in names
    entry_points = (
        zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    )
    assert "loragen = loragen.cli:main" in entry_points


def test_resources_are_read_from_the_installed_wheel(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # -S: no site-packages processing, so the editable install of the source tree is invisible; the
    # unpacked wheel comes first and third-party packages are reachable after it.
    code = (
        "import sys; sys.path[:0] = [sys.argv[1]]; sys.path.append(sys.argv[2]);"
        "import loragen, loragen.resources as r;"
        "assert loragen.__file__.startswith(sys.argv[1]), loragen.__file__;"
        "t = str(r.templates_dir()); k = str(r.kernels_dir());"
        "assert t.startswith(sys.argv[1]) and k.startswith(sys.argv[1]), (t, k);"
        "names = r.list_kernels(); assert names, 'no kernels';"
        "assert r.read_kernel(names[0]).strip();"
        "assert 'lora_masked_down' in r.read_kernel('lora_dropout_cpu.c');"
        "assert 'philox' in r.read_kernel('lora_common.cuh.j2').lower();"
        "print(len(names))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-S", "-c", code, str(site), sysconfig.get_paths()["purelib"]],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) >= 1


def test_bench_and_demo_run_from_the_installed_wheel(wheel: Path, tmp_path: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("__init__", "run", "training", "plot", "report"):
        assert f"loragen/_examples/demo/{module}.py" in names
    assert "loragen/_examples/digits_model.py" in names and "loragen/_benchmarks/harness.py" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # as in the test above: the unpacked wheel first, third-party packages after it, no editable install
    code = (
        "import sys; sys.path[:0] = [sys.argv[1]]; sys.path.append(sys.argv[2]);"
        "import loragen; assert loragen.__file__.startswith(sys.argv[1]), loragen.__file__;"
        "from loragen._examples.demo import bundled_model_file;"
        "assert str(bundled_model_file()).startswith(sys.argv[1]), bundled_model_file();"
        "from loragen.cli import main;"
        "sys.exit(main(['bench', 'layer', '--quick', '--dropout', '0', '--threads', '1', '--json']))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-S", "-c", code, str(site), sysconfig.get_paths()["purelib"]],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [v["name"] for v in report["tables"][0]["variants"]] == [
        "frozen",
        "peft",
        "loragen",
        "loragen unfused",
        "full",
    ]
    assert "bench: table 1: round 3/3" in result.stderr
