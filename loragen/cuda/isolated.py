"""The self-check of one kernel variant in a child process, so a kernel that faults cannot take the
caller's CUDA context with it.

An illegal memory access, a misaligned address or a trap in a kernel is sticky: the CUDA context that
ran it is unusable afterwards, for the torch path too. :class:`loragen.cuda.selfcheck.CheckedLauncher`
therefore first runs :func:`loragen.cuda.selfcheck.check_variant` in a fresh interpreter on the same GPU
(``python -m loragen.cuda.selfcheck``, see :func:`loragen.cuda.selfcheck.child_main`); a variant whose check fails there, or kills the child, never runs
in the caller's process. The child compiles into the same kernel cache, so the caller's own (second,
in-process) check loads the cubins from disk. The child prints one JSON line: ``{"reason": null}`` or
``{"reason": "..."}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from loragen.cuda.kernel_variants import Variant

__all__ = ["DRIVER_LAUNCHER", "check_in_child"]

DRIVER_LAUNCHER = "loragen.cuda.launch:DriverLauncher"
TIMEOUT_S = 300.0  # imports, CUDA start, five NVRTC compiles and tiny launches: a hung kernel is a failure


def _tail(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def _child_environment() -> dict[str, str]:
    """The caller's environment, with its module search path: the child imports what the caller does."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def check_in_child(
    variant: Variant, device: torch.device, launcher: str = DRIVER_LAUNCHER, timeout: float = TIMEOUT_S
) -> str | None:
    """:func:`loragen.cuda.selfcheck.check_variant` of ``variant`` on ``device`` in a child process
    whose launcher is made by calling ``launcher`` (``"module:attribute"``); None when it passed, else
    the reason (a crash or a timeout of the child included, and a child that could not be started: the
    variant is then not run unchecked, and the reason says why)."""
    index = (
        -1
        if device.type != "cuda"
        else device.index
        if device.index is not None
        else torch.cuda.current_device()
    )
    command = [
        sys.executable,
        "-m",
        "loragen.cuda.selfcheck",
        variant.dtype,
        str(variant.rank_bucket),
        "aligned" if variant.aligned else "unaligned",
        str(index),
        launcher,
    ]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, check=False, env=_child_environment()
        )
    except subprocess.TimeoutExpired:
        return f"crashed: the isolated self-check did not finish in {timeout:.0f} s"
    except OSError as exc:  # no interpreter at sys.executable, a process limit reached, no memory to fork
        return f"not checked: cannot start the isolated self-check's process {command[0]!r}: {exc}"
    for line in reversed(done.stdout.splitlines()):
        try:
            answer = json.loads(line)
        except ValueError:
            continue
        if isinstance(answer, dict) and "reason" in answer:
            return None if answer["reason"] is None else str(answer["reason"])
    return f"crashed: the isolated self-check's process exited with status {done.returncode}: {_tail(done.stderr)}"
