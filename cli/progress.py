"""Progress display for long work: one line on stderr, only on a terminal.

Scripts read stdout and stderr; a progress line there would be noise, so the
display is off unless stderr is a terminal, and always off with ``--quiet``
or ``--json``.  The line is redrawn at most ten times a second and erased
when the work ends, so what remains on the terminal is the command's result.

Library functions take a plain callback ``progress(done, total)`` (``total``
may be None when unknown); :meth:`Progress.__call__` is one::

    with progress.for_args(args, "verifying objects") as bar:
        verify(ws, progress=bar)
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

REDRAW_INTERVAL = 0.1


class Progress:
    def __init__(self, label: str, total: int | None = None, stream: TextIO | None = None,
                 enabled: bool | None = None):
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.label = label
        self.total = total
        self.done = 0
        self._last_draw = 0.0
        self._width = 0

    def __enter__(self) -> "Progress":
        self._draw(force=True)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __call__(self, done: int, total: int | None = None) -> None:
        self.update(done, total)

    def update(self, done: int | None = None, total: int | None = None, label: str | None = None) -> None:
        if done is not None:
            self.done = done
        if total is not None:
            self.total = total
        if label is not None:
            self.label = label
        self._draw(force=label is not None)

    def phase(self, label: str) -> None:
        """Show a new indeterminate phase ("mounting", "committing", ...)."""
        self.total = None
        self.done = 0
        self.update(label=label)

    def text(self) -> str:
        if self.total:
            pct = 100 * self.done // self.total
            return f"stepfs: {self.label}  {self.done}/{self.total} ({pct}%)"
        if self.done:
            return f"stepfs: {self.label}  {self.done}"
        return f"stepfs: {self.label}..."

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < REDRAW_INTERVAL and self.done != self.total:
            return
        self._last_draw = now
        line = self.text()
        pad = max(0, self._width - len(line))
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()
        self._width = len(line)

    def close(self) -> None:
        """Erase the line (the terminal shows the result, not the progress)."""
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0


def for_args(args, label: str, total: int | None = None) -> Progress:
    """A progress display that honours ``--quiet`` and ``--json``."""
    quiet = getattr(args, "quiet", False) or getattr(args, "json", False)
    return Progress(label, total, enabled=False if quiet else None)
