"""`perf/gpu_check.sh` cannot rot: its section limits add up to what its header says (at most 6 minutes), and its
new sections' plumbing runs here on the CPU (`GPU_CHECK_DEVICE=cpu`): the preflight on `reshard_nccl_rules` and the
end-to-end refit into an engine process whose "device" is the CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "perf" / "gpu_check.sh"


def test_section_limits_add_up_to_the_header() -> None:
    text = SCRIPT.read_text()
    limits = [int(m) for m in re.findall(r"^section \S+ (\d+) ", text, flags=re.M)]
    stated = int(re.search(r"The section limits add up to (\d+) s", text).group(1))
    assert sum(limits) == stated <= 360, (limits, stated)
    assert "Whole run: under 6 minutes" in text


@pytest.mark.distributed  # the end-to-end section starts 3 ranks
def test_dry_run_of_preflight_and_end_to_end_refit(tmp_path: Path) -> None:
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "GPU_CHECK_BACKEND": "torch", "PYTHON": sys.executable,
           "GPU_CHECK_SECTIONS": "preflight refit_e2e"}
    run = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    summary = (tmp_path / "summary.txt").read_text()
    assert run.returncode == 0, run.stdout + run.stderr
    assert "preflight: ok" in summary and "refit_e2e: ok" in summary, summary
    assert "end-to-end refit is exact" in summary, summary
    csv = (tmp_path / "gpu_refit_check.csv").read_text().splitlines()
    assert csv[1].startswith("cpu,") and csv[1].endswith(",True"), csv
