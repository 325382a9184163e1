"""`reshard._progress.Progress`: a line on stderr for long commands, only on a terminal."""

from __future__ import annotations

import io
import subprocess
import sys
import time

from reshard._progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_the_line_and_it_is_cleared_at_the_end() -> None:
    tty = _Terminal()
    with Progress("simulate", stream=tty, after_s=0.0, interval_s=0.01) as p:
        p.step("kimi-k2 on 512 GPUs")
        deadline = time.monotonic() + 60  # a generous bound: the thread writes within its first interval
        while "kimi-k2" not in tty.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
    text = tty.getvalue()
    assert "\r\x1b[Ksimulate: " in text and ", kimi-k2 on 512 GPUs" in text, text
    assert text.endswith("\r\x1b[K")  # the command's own output starts on a clean line


def test_nothing_is_written_when_not_a_terminal_or_before_after_s() -> None:
    pipe = io.StringIO()
    with Progress("simulate", stream=pipe, after_s=0.0, interval_s=0.01) as p:
        p.tick()
        time.sleep(0.05)
    assert pipe.getvalue() == "" and not p.enabled
    tty = _Terminal()
    with Progress("plan", stream=tty, after_s=3600.0):
        pass
    assert tty.getvalue() == ""  # a short command shows nothing


def test_the_cli_writes_nothing_extra_to_a_pipe() -> None:
    r = subprocess.run([sys.executable, "-m", "reshard", "plan", "--src", "ranks=0-3 mesh=4 S(0)", "--dst",
                        "ranks=4-5 mesh=2 S(1)", "--shape", "64,32"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr
