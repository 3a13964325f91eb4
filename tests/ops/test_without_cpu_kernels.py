"""The tests that reach the compiled CPU dropout kernels, run once more on the other dropout paths.

A CPU without AVX2 and FMA, a CPU that is not x86, or a machine without a C compiler never loads
:mod:`loragen.ops.cpu_kernels`: every float32 dropout product of the fused op and of the LoRA branch
takes the numpy/BLAS row-block path instead; an x86-64 CPU with AVX2 but without AVX-512 runs the
``avx2`` build of the kernels. Where this suite runs with the AVX-512 kernels loaded, those paths would
otherwise be tested only by ``test_cpu_kernels.py``, so the test below re-runs, in a child pytest with
``LORAGEN_CPU_KERNELS=0`` and again with ``LORAGEN_CPU_KERNEL_VARIANT=avx2``, the tests that call into
the kernels (found by recording which tests reach :func:`loragen.ops.cpu_kernels.available` with True):
the op and mask tests of ``tests/ops``, the 4-bit/8-bit branch and a checkpointed QLoRA training step.

DoRA and mixed-batch layers never call the kernels (they unpack masks themselves), so the switch does
not change them and they are not re-run. Where the kernels are unavailable anyway, the main run already
covers the numpy/BLAS path and this test skips; so does the AVX2 run where the CPU cannot run that
build, or already runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loragen import switches
from loragen.ops import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]

# whole modules: every dropout test of the op, the branch and the kernels' on/off comparison
MODULES = ("tests/ops/test_ops.py", "tests/ops/test_branch.py", "tests/ops/test_cpu_kernels.py")
# single tests elsewhere that take the dropout path in float32
TESTS = (
    "tests/ops/test_real_architectures.py::test_zero_rows_run_forward_and_backward_in_every_path",
    "tests/layers/test_bnb.py::test_dropout_mask_follows_torch_seed",
    "tests/training/test_kbit.py::test_checkpointing_recomputes_the_same_dropout_mask",
)


def _avx2_is_another_path() -> bool:
    with switches.cpu_kernels.using(True), switches.cpu_kernel_variant.using("avx2"):
        runs = cpu_kernels.available()
    return runs and cpu_kernels.variant() not in (None, "avx2")


@pytest.mark.slow
@pytest.mark.skipif(
    not cpu_kernels.available(),
    reason=f"the compiled CPU kernels are not in use ({cpu_kernels.status()}): the suite runs without them",
)
@pytest.mark.parametrize(
    "setting",
    [
        "LORAGEN_CPU_KERNELS=0",
        pytest.param(
            "LORAGEN_CPU_KERNEL_VARIANT=avx2",
            marks=pytest.mark.skipif(
                not _avx2_is_another_path(), reason="the avx2 kernels are already in use, or cannot run"
            ),
        ),
    ],
)
def test_the_dropout_tests_pass_on_the_other_paths(setting: str) -> None:
    name, _, value = setting.partition("=")
    env = {**os.environ, name: value}
    # -m "": each test named runs, whatever its tier
    options = ["-q", "-rfE", "-m", "", "-p", "no:cacheprovider"]
    command = [sys.executable, "-m", "pytest", *options, *MODULES, *TESTS]
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    # exit code 4 (a test named here no longer exists) fails too: the list must follow renames
    assert done.returncode == 0, f"{' '.join(command[2:])} with {setting}:\n{done.stdout[-6000:]}"
    assert " passed" in done.stdout.splitlines()[-1]
