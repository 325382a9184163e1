"""Helpers shared by the perf scripts: machine and version info, timing with spread, CSV rows."""

from __future__ import annotations

import csv
import datetime
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def python_speed_ms(repeat: int = 3) -> float:
    """Milliseconds (best of `repeat`) this interpreter takes for a fixed pure-Python workload of dict updates and
    integer arithmetic: the machine's speed when a CPU-bound benchmark ran. Planning times scale with it, and a
    shared VM's speed can change by 2x within a day."""

    def work() -> int:
        counts: dict[int, int] = {}
        acc = 0
        for i in range(300_000):
            counts[i & 1023] = counts.get(i & 1023, 0) + i
            acc += (i * 7) % 13
        return acc

    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def machine_info(device: torch.device) -> dict[str, str]:
    """Where and with what a result was measured: one dict, repeated on every CSV row."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "none",
        "cpu": _cpu_model(),
        "cpu_count": str(os.cpu_count()),
        "torch_threads": str(torch.get_num_threads()),
        "load_avg_1min": f"{load:.2f}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "commit": _git_commit(),
    }


def synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def time_calls(fn: Callable[[], object], sync: Callable[[], None], *, repeat: int,
               min_sample_s: float = 0.01) -> list[float]:
    """Seconds per call of `fn`, one value per sample; a sample runs `fn` enough times to last `min_sample_s`.

    One untimed call first (compilation, allocator warm-up). Each sample ends with `sync()`, so on a GPU the time
    includes launch and completion, as a caller that waits for the copy would see it.
    """
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    once = time.perf_counter() - t0
    calls = max(1, math.ceil(min_sample_s / max(once, 1e-7)))
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / calls)
    return samples


def spread(samples: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of the samples."""
    return statistics.median(samples), min(samples), max(samples)


def write_csv(path: Path, rows: list[dict[str, object]]) -> None:
    """Rows (dicts) to a CSV file with a header: every key of any row, in first-seen order; missing cells empty."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
