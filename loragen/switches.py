"""loragen's process-wide switches. Each :class:`Switch` starts from ``LORAGEN_<NAME>`` (booleans take
``1/0``, ``true/false``, ``on/off``, ``yes/no``) or its default, is read with ``switches.<name>.get()`` and
changed for a block with ``with switches.<name>.using(value):``. A value not understood raises
:class:`ValueError` naming the variable.

================= ================= ======================================================================
switch             values            what it controls
================= ================= ======================================================================
fused              True / False      LoRA linears run loragen's fused op (True) or peft's plain composition
cpu_kernels        True / False      the compiled kernels of the CPU dropout path (AVX-512 or AVX2 builds)
cpu_kernel_variant "auto"/"avx512"/  which build of those kernels: the best the CPU runs (default), or one
                   "avx2"            forced (a CPU that cannot run it takes the numpy path)
cuda_kernels       "check"/"trust"/  loragen's CUDA kernels: checked against the torch path on first use
                   "torch"           (default), used unchecked, or never used (the torch path instead)
================= ================= ======================================================================
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Generic, TypeVar

__all__ = ["Switch", "fused", "cpu_kernels", "cpu_kernel_variant", "cuda_kernels"]

T = TypeVar("T", bool, str)

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


class Switch(Generic[T]):
    """A process-wide setting named ``name``, read from ``LORAGEN_<NAME>`` or ``default``; ``choices`` are
    the accepted values of a string switch (``()`` for a boolean one)."""

    def __init__(self, name: str, default: T, choices: tuple[str, ...] = ()) -> None:
        self.name = name
        self.default: T = default
        self.choices = choices
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


fused: Switch[bool] = Switch("fused", True)
cpu_kernels: Switch[bool] = Switch("cpu_kernels", True)
# the choices of loragen.ops.cpu_kernels.VARIANTS, best first
cpu_kernel_variant: Switch[str] = Switch("cpu_kernel_variant", "auto", ("auto", "avx512", "avx2"))
cuda_kernels: Switch[str] = Switch("cuda_kernels", "check", ("check", "trust", "torch"))
