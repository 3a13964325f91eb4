"""loragen's process-wide switches, all with one naming scheme.

Each switch is a :class:`Switch` object here, named like what it turns on. Its value:

* starts from the environment variable ``LORAGEN_<NAME>`` (``LORAGEN_FUSED=0``) or its default;
* is read with ``switches.<name>.get()``;
* is changed for a block with ``with switches.<name>.using(value): ...`` (restored afterwards, also on
  an exception).

Switches are process-wide, not per thread, as torch's own global flags are.

================= ================= ======================================================================
switch             values            what it controls
================= ================= ======================================================================
fused              True / False      LoRA linears run loragen's fused op (True) or peft's plain composition
sibling_fusion     True / False      LoRA linears reading one input share one autograd node
cuda_sibling_     True / False      the same on CUDA tensors, through loragen's kernels (default off: see
fusion                              docs/cuda.md, "Sibling groups on CUDA"; not with cuda_native_host on)
cuda_native_host   True / False      the CUDA op's per-call host work in C++ (default off: see docs/cuda.md,
                                     "The host path in C++")
cuda_native_       True / False      that C++ path called from Python directly, not through torch.ops (where
direct_call                          Python's headers are installed; read when the C++ path is first built)
cpu_kernels        True / False      the compiled kernels of the CPU dropout path (AVX-512 or AVX2 builds)
cpu_kernel_variant "auto"/"avx512"/  which build of those kernels: the best the CPU runs (default), or one
                   "avx2"            forced (a CPU that cannot run it takes the numpy path)
dropout_rng        "bits"/"philox"   the generator of CPU dropout masks
cuda_kernels       "check"/"trust"/  loragen's CUDA kernels: checked against the torch path on first use
                   "torch"           (default), used unchecked, or never used (the torch path instead)
================= ================= ======================================================================

Environment values: ``1/0``, ``true/false``, ``on/off``, ``yes/no`` for the boolean switches; one of the
listed strings for the others. A value that is not understood raises :class:`ValueError` naming the
variable when the switch is first read.

Example::

    from loragen import switches

    with switches.fused.using(False):   # compare against peft's composition
        loss = model(x).sum()
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Generic, TypeVar

__all__ = [
    "Switch",
    "fused",
    "sibling_fusion",
    "cuda_sibling_fusion",
    "cuda_native_host",
    "cuda_native_direct_call",
    "cpu_kernels",
    "cpu_kernel_variant",
    "dropout_rng",
    "cuda_kernels",
]

T = TypeVar("T", bool, str)

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


class Switch(Generic[T]):
    """A process-wide setting with an environment default.

    Args:
        name: the switch's name; its environment variable is ``LORAGEN_<NAME>``.
        default: the value when the environment does not set one.
        choices: the accepted values of a string switch (``()`` for a boolean switch).
        doc: one line saying what the switch controls.
    """

    def __init__(self, name: str, default: T, choices: tuple[str, ...] = (), doc: str = "") -> None:
        self.name = name
        self.default: T = default
        self.choices = choices
        self.doc = doc
        self._value: T | None = None

    @property
    def env_var(self) -> str:
        """The environment variable that sets the starting value."""
        return f"LORAGEN_{self.name.upper()}"

    def _parse(self, raw: object, source: str) -> T:
        if isinstance(self.default, bool):
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise ValueError(f"{source}={raw!r}: expected one of {', '.join(_TRUE + _FALSE)}")
        if raw not in self.choices:
            raise ValueError(f"{source}={raw!r}: expected one of {', '.join(map(repr, self.choices))}")
        return raw

    def get(self) -> T:
        """The current value.

        Raises:
            ValueError: the environment variable holds a value this switch does not accept.
        """
        if self._value is None:
            raw = os.environ.get(self.env_var)
            self._value = self.default if raw is None else self._parse(raw, self.env_var)
        return self._value

    @contextlib.contextmanager
    def using(self, value: T) -> Iterator[None]:
        """Within the block the switch has ``value``; the previous value comes back afterwards.

        Raises:
            ValueError: ``value`` is not one this switch accepts.
        """
        new = self._parse(value, f"loragen.switches.{self.name}")
        previous = self.get()
        self._value = new
        try:
            yield
        finally:
            self._value = previous

    def __repr__(self) -> str:
        return f"Switch({self.name}={self.get()!r}, env {self.env_var})"


fused: Switch[bool] = Switch(
    "fused", True, doc="LoRA linears run loragen's fused op (False: peft's composition)"
)
sibling_fusion: Switch[bool] = Switch(
    "sibling_fusion", True, doc="LoRA linears reading one input share one autograd node"
)
cuda_sibling_fusion: Switch[bool] = Switch(
    "cuda_sibling_fusion",
    False,
    doc="sibling fusion on CUDA tensors (loragen.cuda.group_op); off until measured on a GPU in a model",
)
cuda_native_host: Switch[bool] = Switch(
    "cuda_native_host",
    False,
    doc="the CUDA op's host path in C++ (loragen.cuda.native_host); off until measured on a GPU",
)
cuda_native_direct_call: Switch[bool] = Switch(
    "cuda_native_direct_call",
    True,
    doc="the C++ host path's direct Python entry (loragen.cuda.native_host), read when it is first built",
)
cpu_kernels: Switch[bool] = Switch(
    "cpu_kernels", True, doc="the compiled kernels (AVX-512 or AVX2 builds) of the CPU dropout path"
)
cpu_kernel_variant: Switch[str] = Switch(
    "cpu_kernel_variant",
    "auto",
    ("auto", "avx512", "avx2"),  # loragen.ops.cpu_kernels.VARIANTS, best first
    doc="which build of the compiled CPU dropout kernels: chosen by the CPU, or forced",
)
dropout_rng: Switch[str] = Switch(
    "dropout_rng", "bits", ("bits", "philox"), doc="the CPU dropout mask generator"
)
cuda_kernels: Switch[str] = Switch(
    "cuda_kernels",
    "check",
    ("check", "trust", "torch"),
    doc="CUDA kernels: self-checked on first use, trusted unchecked, or replaced by the torch path",
)
