"""The numeric settings the self-check computes under, whatever its caller chose.

:func:`loragen.cuda.selfcheck.check_variant` compares the kernels with the torch path, and its bounds are
sized for a torch path whose float32 products are full float32. A user may have allowed TF32 or bfloat16
passes in them (``torch.set_float32_matmul_precision("medium")``, as Lightning and many training scripts
do, or the per-backend ``fp32_precision`` settings). :func:`exact_float32_products` turns that off for the
check and puts back exactly what it found, through the API this torch offers.

The op may run the check from inside the caller's ``torch.autocast`` region (its first call is often
there); autocast would cast the torch path's out-of-place products to 16 bits and move the reference by a
third of the tolerance. :func:`autocast_off` turns it off for the check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["autocast_off", "exact_float32_products"]

# torch >= 2.9 keeps a float32 precision per backend and operation as well (``torch.backends.cuda.matmul.
# fp32_precision``, "none" meaning "as the level above says"); older torch has only the process-wide one
_PER_BACKEND_PRECISION = hasattr(torch.backends.cuda.matmul, "fp32_precision")


def _matmul_precisions() -> list[Any]:
    """The per-backend settings the torch path's float32 products read (none before torch 2.9): cuBLAS's
    on a GPU, oneDNN's on the CPU (where the tests check emulated kernels)."""
    if not _PER_BACKEND_PRECISION:
        return []
    found: list[Any] = [torch.backends.cuda.matmul]
    onednn = getattr(torch.backends.mkldnn, "matmul", None)
    if onednn is not None and hasattr(onednn, "fp32_precision"):
        found.append(onednn)
    return found


@contextlib.contextmanager
def exact_float32_products() -> Iterator[None]:
    """Float32 matrix products in full float32 inside the block (no TF32, no bfloat16 passes), and every
    precision setting back as it was found afterwards.

    The process-wide setting goes to ``"highest"`` and back, and on torch >= 2.9 the cuBLAS and oneDNN
    matmul settings go to ``"ieee"`` and back to their own values (``"none"`` included), in that order,
    so that every reading -- :func:`torch.get_float32_matmul_precision`, ``allow_tf32``, each
    ``fp32_precision`` -- answers inside the block without raising and afterwards as before. Where the
    caller's per-backend settings already disagree with the process-wide one (reading it raises), that
    one is left alone. The legacy ``allow_tf32`` flag is never set: on torch >= 2.9 that mixes the two
    APIs, after which :func:`torch.get_float32_matmul_precision` can raise for the rest of the process;
    before, it is only a view of the process-wide setting, and setting it back turns ``"medium"`` into
    ``"high"``. cuDNN's settings are not touched.
    """
    try:
        process_wide: str | None = torch.get_float32_matmul_precision()
    except RuntimeError:
        process_wide = None
    settings = _matmul_precisions()
    found = [setting.fp32_precision for setting in settings]
    try:
        if process_wide is not None:
            torch.set_float32_matmul_precision("highest")
        for setting in settings:
            setting.fp32_precision = "ieee"
        yield
    finally:
        if process_wide is not None:
            torch.set_float32_matmul_precision(process_wide)
        for setting, value in zip(settings, found):
            setting.fp32_precision = value


@contextlib.contextmanager
def autocast_off(device: torch.device) -> Iterator[None]:
    """No autocast inside the block for ``device``'s type or for the CPU (where the check builds its
    problem, and where the tests check emulated kernels), whichever the caller had on; the caller's
    autocast is back as found afterwards."""
    with contextlib.ExitStack() as stack:
        for device_type in dict.fromkeys(("cpu", device.type)):
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield
