"""Progress of a training phase: a tqdm bar on a terminal, plain lines in a log.

On a terminal the bar redraws at most every ``min_interval`` seconds; the loss shown beside it is
updated without forcing a redraw (a forced redraw per update is what made piped logs unreadable). When
the stream is not a terminal (a pipe, a file, CI) a plain line is written at every tenth of the phase:
step, loss, throughput and time left, with no carriage returns.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any, TextIO

__all__ = ["Progress"]


class Progress:
    """Reports the steps of one training phase on ``stream`` (``None``: reports nothing).

    Args:
        description: the phase's name, shown before each report.
        total: the phase's number of steps.
        stream: where reports go (the demo passes ``sys.stderr``).
        interactive: draw a tqdm bar; default: whether ``stream`` is a terminal.
        min_interval: a bar redraws at most this often, in seconds.
        lines: plain-line mode writes this many reports over the phase (one every ``total / lines`` steps).
    """

    def __init__(
        self,
        description: str,
        total: int,
        stream: TextIO | None,
        *,
        interactive: bool | None = None,
        min_interval: float = 0.25,
        lines: int = 10,
    ) -> None:
        self.description = description
        self.total = total
        self.stream = stream
        self.every = max(1, -(-total // lines))  # ceil: at most `lines` reports
        self._start = time.perf_counter()
        self._bar: Any = None
        if stream is not None and (stream.isatty() if interactive is None else interactive):
            from tqdm import tqdm

            self._bar = tqdm(
                total=total,
                desc=description,
                unit="step",
                file=stream,
                mininterval=min_interval,
                dynamic_ncols=True,
            )

    def update(self, step: int, loss: float) -> None:
        """Report that ``step`` steps (1-based) of the phase are done, the last one with training ``loss``."""
        if self.stream is None:
            return
        if self._bar is not None:
            if step % 10 == 0 or step == self.total:
                self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)  # shown at the next timed redraw
            self._bar.update(1)
            return
        if step % self.every == 0 or step == self.total:
            elapsed = time.perf_counter() - self._start
            rate = step / elapsed if elapsed > 0 else float("inf")
            left = (self.total - step) / rate if rate > 0 else 0.0
            self.stream.write(
                f"{self.description}: step {step}/{self.total} ({100 * step // self.total}%), "
                f"loss {loss:.4f}, {rate:.1f} steps/s, ~{left:.0f} s left\n"
            )
            self.stream.flush()

    def close(self) -> None:
        """Finish the report (closes the bar)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()
