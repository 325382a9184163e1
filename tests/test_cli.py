"""The command line: `python -m reshard plan` and `simulate` as a user runs them, from another directory.

Bad input gives one line on stderr and exit status 2, never a traceback; `simulate` writes files only under
`--out`, and without matplotlib (an optional extra, `reshard[perf]`) still prints its table and exits 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from reshard.__main__ import main

ROOT = Path(__file__).resolve().parent.parent
SMALL_SIM = ["-m", "qwen3-0.6b", "-s", "train=tp2 gen=tp1,dp2", "-H", "gb300", "--domain-size", "2", "--no-direct"]
BLOCK_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None; import runpy; sys.argv[0] = 'reshard'; " \
                   "runpy.run_module('reshard', run_name='__main__')"


def run_cli(args: list[str], cwd: Path, *, block_matplotlib: bool = False) -> subprocess.CompletedProcess:
    """`python -m reshard ARGS` in `cwd` with this checkout's `reshard` (matplotlib made unimportable on request)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", BLOCK_MATPLOTLIB, *args] if block_matplotlib else [sys.executable, "-m", "reshard",
                                                                                      *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_plan_prints_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    # (8, 8) float32 = 256 bytes, S(0) on ranks 0-1 -> R on ranks 2-3: gather 2 x 128, broadcast 2 x 256 bytes
    assert main(["plan", "--src", "ranks=0-1 S(0)", "--dst", "ranks=2-3 R", "--shape", "8,8", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "reshard plan:" in out
    assert "all-gather on the source ranks        256 B" in out
    assert "broadcast to destination ranks        512 B" in out


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--src", "ranks=0-3 Q(0)", "placements: cannot read"),
        ("--src", "0-3 S(0)", "missing ranks="),
        ("--dst", "ranks=4-7 mesh=3x2 S(0)", "mesh 3x2 holds 6 ranks, got 4"),
        ("--shape", "8,eight", "shape: cannot read '8,eight'"),
        ("--dtype", "float12", "--dtype: unknown dtype 'float12'"),
        ("--src", "ranks=0-3 S(2)", "dim"),  # a placement on a dim the 2-D tensor does not have
    ],
)
def test_plan_bad_input_is_one_line(flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = {"--src": "ranks=0-3 S(0)", "--dst": "ranks=4-7 R", "--shape": "8,8", "--dtype": "bfloat16"}
    args[flag] = value
    assert main(["plan", *[x for kv in args.items() for x in kv]]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m reshard plan: error: ") and message in lines[0], lines


def test_plan_bad_layout_has_no_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    # in-process: an exception escaping `main` would fail this test; the one subprocess run, below, checks that
    # `python -m reshard` turns main's status into the exit status
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--src", "ranks=0-3 S(0", "--dst", "ranks=4-7 R", "--shape", "8,8"]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and len(captured.err.splitlines()) == 1, captured.err
    assert captured.err.startswith("python -m reshard plan: error: "), captured.err
    assert captured.out == ""
    assert list(tmp_path.iterdir()) == []


def test_simulate_bad_system_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "-m", "qwen3-0.6b", "-s", "train=tp2 gen=tp3,dq2"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("python -m reshard simulate: error: "), err


def test_simulate_without_matplotlib_prints_the_table_and_writes_nothing(tmp_path: Path) -> None:
    # a wheel install without the perf extra, run from the user's own directory: the subprocess smoke test of
    # `python -m reshard` (exit status, stdout and stderr as a shell sees them)
    r = run_cli(["simulate", *SMALL_SIM], tmp_path, block_matplotlib=True)
    assert r.returncode == 0, r.stderr
    assert "gather+bcast" in r.stdout and "lower bound" in r.stdout  # the table
    assert "pip install 'reshard[perf]'" in r.stdout
    assert "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []  # no ./perf/out/... in the user's directory


def test_simulate_out_without_matplotlib_writes_only_the_csv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    assert main(["simulate", *SMALL_SIM, "--out", str(tmp_path / "sim")]) == 0
    out = capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "sim").iterdir()) == ["simulate.csv"]
    assert f"wrote {tmp_path / 'sim' / 'simulate.csv'}; PNG plots need matplotlib: pip install 'reshard[perf]'" in out


def test_plan_help_explains_the_layout_notation(capsys: pytest.CaptureFixture[str]) -> None:
    from reshard.__main__ import LAYOUT_NOTATION, main
    from reshard.planner import parse_layout

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "S(d) shards tensor dim d over the axis" in out and "_S(d,k)" in out and "mesh=2x4" in out
    # the example it gives is a layout the command reads (pieces as DTensor's: rank 3 holds rows 3072:4096)
    lay = parse_layout("ranks=0-7 mesh=2x4 R,S(0)", (4096, 4096))
    assert lay.pieces(3)[0].global_box.offsets == (3072, 0) and 'ranks=0-7 mesh=2x4 R,S(0)' in LAYOUT_NOTATION
