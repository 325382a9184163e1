"""Every kernel variant the CUDA launchers can pick, compiled ahead of time for Hopper and Blackwell on this CPU.

Usage:
    python perf/bench_compile.py [--capabilities 90,100] [--only pack,delta,quant] [--out perf/out]

`reshard.kernels.kernel_variants()` lists the specializations from the launchers' own choices (word
sizes, VEC, dims, BLOCK and warps, casts, FP8 blocks); each is compiled with `triton.compile` for
`GPUTarget("cuda", capability, 32)` (no GPU needed: Triton's wheel ships ptxas), and ptxas `-v` on its PTX gives
the registers per thread, spill stores / loads and stack frame. Writes `kernels/compile.csv` (one row per variant
and target, with the machine and versions) and `kernels/compile.png` (registers per variant, spilling ones marked),
and prints the variants that spill. Exits 1 if any variant fails to compile or a bulk variant spills.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, write_csv  # noqa: E402

from reshard.kernels import compile_variant, kernel_variants  # noqa: E402

log = logging.getLogger("bench_compile")


def run(capabilities: list[int], families: set[str]) -> list[dict[str, object]]:
    """One row per (variant, capability): the variant's choices and ptxas's figures, or the compile error."""
    machine = machine_info(torch.device("cpu"))
    rows = []
    for variant in kernel_variants():
        if variant.family not in families:
            continue
        for capability in capabilities:
            t0 = time.perf_counter()
            row: dict[str, object] = {"family": variant.family, "kernel": variant.name, "variant": variant.label,
                                      "bulk": int(variant.bulk), "sm": capability, "num_warps": variant.num_warps,
                                      **{k: int(v) for k, v in variant.constexprs.items()}}
            try:
                figures = compile_variant(variant, capability)
                row.update(registers=figures.registers, spill_stores=figures.spill_stores,
                           spill_loads=figures.spill_loads, stack_bytes=figures.stack_bytes, error="")
            except Exception as e:  # noqa: BLE001 - a compile error is a result here, reported and counted
                row.update(registers="", spill_stores="", spill_loads="", stack_bytes="", error=repr(e)[:300])
            row["compile_s"] = round(time.perf_counter() - t0, 3)
            rows.append({**row, **machine})
    return rows


def plot(rows: list[dict[str, object]], path: Path) -> None:
    """Registers per thread of each variant (one panel per target); spilling variants in red, bulk ones filled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    capabilities = sorted({int(r["sm"]) for r in rows})
    fig, axes = plt.subplots(len(capabilities), 1, figsize=(14, 3.2 * len(capabilities)), squeeze=False)
    for ax, capability in zip(axes[:, 0], capabilities):
        mine = [r for r in rows if int(r["sm"]) == capability and r["registers"] != ""]
        xs = range(len(mine))
        colors = ["tab:red" if int(r["spill_stores"]) else ("tab:blue" if r["bulk"] else "tab:gray") for r in mine]
        ax.bar(xs, [int(r["registers"]) for r in mine], color=colors, width=1.0)
        ax.axhline(255, color="black", lw=0.8, ls="--")
        ax.set_ylabel("registers / thread")
        ax.set_title(f"sm_{capability}: {len(mine)} variants; blue bulk, gray other, red spills "
                     f"({sum(1 for r in mine if int(r['spill_stores']))})")
        families = [r["family"] for r in mine]
        for family in dict.fromkeys(families):
            ax.axvline(families.index(family) - 0.5, color="black", lw=0.5)
            ax.text(families.index(family), 262, family, fontsize=8)
        ax.set_ylim(0, 280)
        ax.set_xticks([])
    machine = rows[0]
    fig.suptitle(f"triton.compile, Triton {machine['triton']}, on {machine['cpu']} ({machine['date_utc'][:10]})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capabilities", default="90,100")
    parser.add_argument("--only", default="pack,delta,quant")
    parser.add_argument("--out", type=Path, default=Path("perf/out"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.perf_counter()
    rows = run([int(c) for c in args.capabilities.split(",")], set(args.only.split(",")))
    write_csv(args.out / "kernels" / "compile.csv", rows)
    plot(rows, args.out / "kernels" / "compile.png")
    errors = [r for r in rows if r["error"]]
    spills = [r for r in rows if not r["error"] and int(r["spill_stores"])]
    for r in spills:
        log.info("spills: sm_%s %s: %s registers, %s bytes spill stores, %s bytes stack%s", r["sm"], r["variant"],
                 r["registers"], r["spill_stores"], r["stack_bytes"], " (BULK)" if r["bulk"] else "")
    for r in errors:
        log.info("compile error: sm_%s %s: %s", r["sm"], r["variant"], r["error"])
    bulk_spills = [r for r in spills if r["bulk"]]
    log.info("%d variants x %d targets in %.0f s: %d compile errors, %d spill (%d bulk) -> %s", len(rows) // max(
        len(args.capabilities.split(",")), 1), len(args.capabilities.split(",")), time.perf_counter() - t0,
        len(errors), len(spills), len(bulk_spills), args.out / "kernels" / "compile.csv")
    return 1 if errors or bulk_spills else 0


if __name__ == "__main__":
    sys.exit(main())
