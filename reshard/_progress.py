"""Progress on stderr for commands that can run for a while (`python -m reshard simulate`, `plan`, the scale
benchmark): after `after_s` seconds, one line rewritten in place every `interval_s` seconds with the elapsed time
and the current step; nothing at all when the stream is not a terminal (logs, pipes, CI)."""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import IO


class Progress:
    """`with Progress("simulate"): ...`, and `step("kimi-k2 on 512 GPUs")` as the work moves on.

    Args:
        label: what runs (the line starts with it).
        stream: where the line goes (default `sys.stderr`); only written to if `stream.isatty()`.
        after_s: nothing is shown for commands that end sooner.
        interval_s: how often the line is rewritten.
    """

    def __init__(self, label: str, *, stream: IO[str] | None = None, after_s: float = 2.0,
                 interval_s: float = 1.0) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.after_s = after_s
        self.interval_s = interval_s
        self.text = ""
        self._start = time.monotonic()
        self._shown = False
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(isatty and isatty())

    def step(self, text: str) -> None:
        """What the command is doing now (shown on the next rewrite)."""
        self.text = text

    def tick(self) -> None:
        """Rewrite the line now (the thread calls it; a no-op when not a terminal)."""
        if not self.enabled:
            return
        elapsed = time.monotonic() - self._start
        self.stream.write(f"\r\x1b[K{self.label}: {elapsed:.0f} s" + (f", {self.text}" if self.text else ""))
        self.stream.flush()
        self._shown = True

    def _run(self) -> None:
        if self._done.wait(self.after_s):
            return
        while not self._done.is_set():
            self.tick()
            self._done.wait(self.interval_s)

    def __enter__(self) -> Progress:
        self._start = time.monotonic()
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="reshard-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        if self._shown:  # leave the terminal as it was: the command's own output follows
            self.stream.write("\r\x1b[K")
            self.stream.flush()
