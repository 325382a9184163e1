"""The simulator's outputs: a text table, CSV rows and a PNG bar chart, and the command line that makes them."""

from __future__ import annotations

import argparse
import csv
import logging
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from reshard.cost import HARDWARE
from reshard.models import PRESETS
from reshard.sim._simulate import SimResult, simulate
from reshard.sim._system import system_config_names

logger = logging.getLogger(__name__)

CSV_FIELDS = (
    "model",
    "system",
    "hardware",
    "domain_size",
    "tensors",
    "model_gb",
    "method",
    "seconds",
    "speedup_vs_gather_bcast",
    "network_gb",
    "nvlink_gb",
    "messages",
    "max_network_send_gb",
    "max_network_recv_gb",
    "max_nvlink_send_gb",
    "max_nvlink_recv_gb",
    "bottleneck",
    "plan_seconds",
    "python",
    "torch",
    "machine",
)


def format_table(result: SimResult) -> str:
    """A plain-text table of one `SimResult`: one row per method."""
    base = result.method("gather+bcast").seconds
    title = (
        f"{result.model.name} ({result.num_tensors} tensors, {result.model_bytes / 1e9:.1f} GB) on "
        f"{result.system.describe()}, {result.hardware.name}"
    )
    header = (
        f"{'method':<17} {'time ms':>10} {'vs g+b':>7} {'network GB':>11} {'nvlink GB':>10} {'messages':>9} "
        f"{'plan s':>7}  bottleneck"
    )
    lines = [title, header]
    for m in result.methods:
        speedup = f"{base / m.seconds:.2f}x" if m.seconds > 0 else "-"
        msgs = f"{m.messages}" if m.messages is not None else "-"
        plan_s = f"{m.plan_seconds:.2f}" if m.plan_seconds is not None else "-"
        lines.append(
            f"{m.method:<17} {m.seconds * 1e3:>10.1f} {speedup:>7} {m.network_bytes / 1e9:>11.1f} "
            f"{m.nvlink_bytes / 1e9:>10.1f} {msgs:>9} {plan_s:>7}  {m.bottleneck}"
        )
    return "\n".join(lines)


def csv_rows(result: SimResult) -> list[dict[str, object]]:
    """One CSV row per method, with the machine and versions that made it."""
    base = result.method("gather+bcast").seconds
    common = {
        "model": result.model.name,
        "system": result.system.name or result.system.describe(),
        "hardware": result.hardware.name,
        "domain_size": result.system.domain_size,
        "tensors": result.num_tensors,
        "model_gb": round(result.model_bytes / 1e9, 3),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
    }
    rows = []
    for m in result.methods:
        rows.append(
            {
                **common,
                "method": m.method,
                "seconds": round(m.seconds, 6),
                "speedup_vs_gather_bcast": round(base / m.seconds, 3) if m.seconds > 0 else "",
                "network_gb": round(m.network_bytes / 1e9, 3),
                "nvlink_gb": round(m.nvlink_bytes / 1e9, 3),
                "messages": m.messages if m.messages is not None else "",
                "max_network_send_gb": round(m.max_network_send / 1e9, 3),
                "max_network_recv_gb": round(m.max_network_recv / 1e9, 3),
                "max_nvlink_send_gb": round(m.max_nvlink_send / 1e9, 3),
                "max_nvlink_recv_gb": round(m.max_nvlink_recv / 1e9, 3),
                "bottleneck": m.bottleneck,
                "plan_seconds": round(m.plan_seconds, 3) if m.plan_seconds is not None else "",
            }
        )
    return rows


def write_csv(results: Sequence[SimResult], path: Path) -> None:
    """Write every result's rows to `path` (overwritten)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in results:
            w.writerows(csv_rows(r))


def plot(result: SimResult, path: Path) -> None:
    """A bar chart of the modelled time per method, written to `path` (PNG). Needs matplotlib (`.[perf]`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [m.method for m in result.methods]
    secs = [m.seconds for m in result.methods]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    bars = ax.bar(names, secs, color=["tab:green", "tab:blue", "tab:red", "tab:gray"][: len(names)])
    ax.bar_label(bars, labels=[f"{s:.3g} s" for s in secs], fontsize=8)
    ax.set_ylabel("modelled refit time (s)")
    ax.set_title(
        f"{result.model.name}: {result.system.name or ''}\n{result.system.describe().split(': ', 1)[-1]}, "
        f"{result.hardware.name}",
        fontsize=8,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


PERF_HINT = "PNG plots need matplotlib: pip install 'reshard[perf]'"


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401  (an optional dependency: `reshard[perf]`)
    except ImportError:
        return False
    return True


def main(argv: Sequence[str] | None = None, *, default_out: Path | None = None) -> int:
    """`python -m reshard simulate` and `perf/simulate.py`: simulate and print the table; with `--out DIR` (or a
    caller's `default_out`) also write `DIR/simulate.csv` and one PNG per result (PNGs need matplotlib).

    Returns the exit status: 0, or 2 (one line on stderr) for a system, model or hardware it cannot read.
    """
    p = argparse.ArgumentParser(
        prog="python -m reshard simulate",
        description="Model the refit time of the project's real plans on an H100/GB200/GB300 cluster.",
    )
    p.add_argument(
        "--model", "-m", action="append", choices=sorted(PRESETS), help="model preset (repeatable); default qwen3-32b"
    )
    p.add_argument(
        "--system",
        "-s",
        action="append",
        help=f"M2N system-config JSON path, shipped name {system_config_names()}, or "
        "'train=tp2,pp4,ep16 gen=tp8,dp8 [domain=72] [packed|colocated]' (repeatable)",
    )
    p.add_argument("--hardware", "-H", default="gb200", choices=sorted(HARDWARE))
    p.add_argument("--domain-size", type=int, default=None, help="GPUs per NVLink domain (default: the hardware's)")
    p.add_argument("--unstacked", action="store_true", help="plan one tensor per expert instead of [E, ...] stacks")
    p.add_argument("--no-direct", action="store_true", help="skip the direct point-to-point plan")
    p.add_argument("--fp8", action="store_true", help="also model an fp8_block refit (FP8 linear weights + scales)")
    p.add_argument("--out", type=Path, default=default_out,
                   help="folder for simulate.csv and the PNG plots (default: "
                   + (f"{default_out}" if default_out is not None else "write no files") + ")")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.verbose:  # a no-op basicConfig (a caller configured logging first) must not swallow -v
        logging.getLogger("reshard.sim").setLevel(logging.INFO)
    models = args.model or ["qwen3-32b"]
    systems = args.system or ["qwen3-32b-tp4pp4dp2-to-tp4dp8-64gpus-h100"]
    plots = _have_matplotlib()
    results = []
    for model in models:
        for system in systems:
            try:
                r = simulate(
                    model,
                    system,
                    args.hardware,
                    domain_size=args.domain_size,
                    stack_experts=not args.unstacked,
                    direct=not args.no_direct,
                    fp8=args.fp8,
                )
            except ValueError as e:  # a system the user wrote that does not parse or fit: one line, no traceback
                print(f"{p.prog}: error: {e}", file=sys.stderr)
                return 2
            results.append(r)
            print(format_table(r), end="\n\n")
            if args.out is not None and plots:
                stem = f"{model}__{_slug(r.system.name)}__{args.hardware}_d{r.system.domain_size}"
                plot(r, args.out / f"{stem}.png")
    if args.out is None:
        print("no files written (pass --out DIR for simulate.csv and PNG plots)")
        if not plots:
            print(PERF_HINT)
        return 0
    write_csv(results, args.out / "simulate.csv")
    if plots:
        print(f"wrote {args.out / 'simulate.csv'} and {len(results)} PNG(s) under {args.out}")
    else:
        print(f"wrote {args.out / 'simulate.csv'}; {PERF_HINT}")
    return 0


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text).strip("_")[:80]


if __name__ == "__main__":
    sys.exit(main())
