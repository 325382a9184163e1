"""Pack / unpack bandwidth, swept over box size and box count, next to the copy ceiling and naive baselines.

Usage:
    python perf/bench_kernels.py [--out perf/out] [--device cpu|cuda] [--backend torch|triton]
        [--sizes 64,256,...] [--counts 1,10,100,1000,10000] [--count-box-bytes 4096]
        [--max-total-bytes N] [--layouts cols,rows] [--dtype bfloat16] [--repeat 5] [--threads 1]

Writes `bench_kernels.csv`, `bench_kernels.png` and `bench_kernels_summary.txt` into `--out`.

What is measured, per configuration (`num_boxes` boxes of `box_bytes` each, spread over up to 8 source tensors):
    ceiling          `dst.copy_(src)` of the same number of bytes, both contiguous: the device's copy bandwidth
    pack, unpack     `reshard.kernels.pack` / `unpack`, one call each time (checks and plans every call)
    pack_prepared,   `prepare_pack(...).run()` / `prepare_unpack(...).run()`: planned once, then only the copy, as a
    unpack_prepared  refit that repeats its plan runs it
    cat              the naive pack: `torch.cat([t[box].contiguous().reshape(-1) for each box])`
    loop_pack,       one `copy_` per box between `t[box.slices()]` and its buffer slice, in a Python loop
    loop_unpack
GB/s is packed bytes / time (the bytes are read once and written once); median, min and max over `--repeat`
samples. `cols` boxes are column blocks of a wider matrix (strided rows, like a tensor-parallel shard), `rows`
boxes are full rows (one contiguous run each).

On CPU the default backend is the torch path; the Triton interpreter is far too slow to time.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import machine_info, spread, synchronizer, time_calls, write_csv

from reshard.kernels import pack, packed_offsets, prepare_pack, prepare_unpack, unpack
from reshard.planner import Box

logger = logging.getLogger("bench_kernels")

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES = [64, 256, KiB, 4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB]
DEFAULT_COUNTS = [1, 10, 100, 1000, 10_000]
IMPLS = ["ceiling", "pack", "pack_prepared", "unpack", "unpack_prepared", "cat", "loop_pack", "loop_unpack"]


def make_boxes(box_bytes: int, num_boxes: int, layout: str, dtype: torch.dtype,
               device: torch.device) -> tuple[list[torch.Tensor], list[Box]]:
    """`num_boxes` boxes of about `box_bytes` (shape `(h, w)`, rows of up to 4 KiB) over up to 8 source tensors."""
    elems = max(1, box_bytes // dtype.itemsize)
    w = min(elems, max(1, 4 * KiB // dtype.itemsize))
    h = math.ceil(elems / w)
    num_tensors = min(num_boxes, 8)
    per_tensor = math.ceil(num_boxes / num_tensors)
    shape = (h * per_tensor, w) if layout == "rows" else (h, 2 * w * per_tensor)
    gen = torch.Generator(device=device).manual_seed(0)
    tensors = [torch.randn(shape, generator=gen, device=device).to(dtype) for _ in range(num_tensors)]
    owners, boxes = [], []
    for i in range(num_boxes):
        k, j = i % num_tensors, i // num_tensors
        owners.append(tensors[k])
        boxes.append(Box((j * h, 0), (h, w)) if layout == "rows" else Box((0, 2 * w * j), (h, w)))
    return owners, boxes


def bench_config(sweep: str, layout: str, box_bytes: int, num_boxes: int, args: argparse.Namespace,
                 device: torch.device) -> list[dict[str, object]]:
    dtype = getattr(torch, args.dtype)
    tensors, boxes = make_boxes(box_bytes, num_boxes, layout, dtype, device)
    offsets, total = packed_offsets(boxes, dtype)
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    src_flat = torch.randint(0, 256, (total,), dtype=torch.uint8, device=device)
    dst_flat = torch.empty_like(src_flat)
    views = [t[b.slices()] for t, b in zip(tensors, boxes)]
    backend = None if args.backend == "auto" else args.backend
    packer = prepare_pack(tensors, boxes, buf, offsets, backend=backend)
    unpacker = prepare_unpack(buf, offsets, tensors, boxes, backend=backend)

    # the per-box loops a user would write: slice, view and copy each box (views are made in the loop, as pack
    # makes its own; `pack_prepared` is the one that reuses them)
    def loop_pack() -> None:
        for t, b, o in zip(tensors, boxes, offsets):
            buf[o: o + b.numel * dtype.itemsize].view(dtype).view(b.shape).copy_(t[b.slices()])

    def loop_unpack() -> None:
        for t, b, o in zip(tensors, boxes, offsets):
            t[b.slices()].copy_(buf[o: o + b.numel * dtype.itemsize].view(dtype).view(b.shape))

    fns = {
        "ceiling": lambda: dst_flat.copy_(src_flat),
        "pack": lambda: pack(tensors, boxes, buf, offsets, backend=backend),
        "pack_prepared": packer.run,
        "unpack": lambda: unpack(buf, offsets, tensors, boxes, backend=backend),
        "unpack_prepared": unpacker.run,
        "cat": lambda: torch.cat([v.contiguous().reshape(-1) for v in views]),
        "loop_pack": loop_pack,
        "loop_unpack": loop_unpack,
    }
    packer.run()  # every impl moves the same bytes: check it once against the naive pack
    if not torch.equal(buf.view(dtype), fns["cat"]()):
        raise AssertionError(f"pack ({packer.backend}) differs from torch.cat for {sweep}/{layout}/{box_bytes}B")
    sync = synchronizer(device)
    rows = []
    ceiling = None
    for impl in args.impls:
        med, lo, hi = spread(time_calls(fns[impl], sync, repeat=args.repeat))
        gbps = total / med / 1e9
        if impl == "ceiling":
            ceiling = gbps
        rows.append({
            "sweep": sweep, "layout": layout, "impl": impl,
            "backend": "torch" if impl in ("ceiling", "cat", "loop_pack", "loop_unpack") else packer.backend,
            "dtype": args.dtype, "box_bytes": box_bytes, "num_boxes": num_boxes, "total_bytes": total,
            "median_s": f"{med:.6g}", "min_s": f"{lo:.6g}", "max_s": f"{hi:.6g}",
            "gbps_median": f"{gbps:.4g}", "gbps_min": f"{total / hi / 1e9:.4g}", "gbps_max": f"{total / lo / 1e9:.4g}",
        })
    for row in rows:
        row["fraction_of_ceiling"] = f"{float(row['gbps_median']) / ceiling:.3f}" if ceiling else ""
    logger.info("%s %s %dB x %d: %s", sweep, layout, box_bytes, num_boxes,
                ", ".join(f"{r['impl']} {float(r['gbps_median']):.2f}" for r in rows))
    return rows


def plot(rows: list[dict[str, object]], path: Path, title: str) -> None:
    """GB/s against box size and against box count, one row of panels per layout; the ceiling dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = sorted({str(r["layout"]) for r in rows})
    sweeps = [("size", "box_bytes", "box size (bytes)"), ("count", "num_boxes", "number of boxes (4 KiB each)")]
    fig, axes = plt.subplots(len(layouts), 2, figsize=(12, 4.2 * len(layouts)), squeeze=False)
    styles = {"ceiling": ("k", "--"), "pack_prepared": ("C0", "-"), "unpack_prepared": ("C1", "-"),
              "pack": ("C0", ":"), "unpack": ("C1", ":"), "cat": ("C2", "-"), "loop_pack": ("C3", "-"),
              "loop_unpack": ("C3", ":")}
    for i, layout in enumerate(layouts):
        for j, (sweep, key, label) in enumerate(sweeps):
            ax = axes[i][j]
            for impl, (color, style) in styles.items():
                pts = sorted((int(r[key]), float(r["gbps_median"]), float(r["gbps_min"]), float(r["gbps_max"]))
                             for r in rows if r["sweep"] == sweep and r["layout"] == layout and r["impl"] == impl)
                if not pts:
                    continue
                xs, ys, lo, hi = zip(*pts)
                ax.plot(xs, ys, color=color, linestyle=style, marker="." if impl != "ceiling" else None, label=impl)
                ax.fill_between(xs, lo, hi, color=color, alpha=0.12)
            ax.set_xscale("log", base=2 if sweep == "size" else 10)
            ax.set_yscale("log")
            ax.set_xlabel(label)
            ax.set_ylabel("GB/s (packed bytes / time)")
            ax.set_title(f"{layout} boxes, {sweep} sweep")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(rows: list[dict[str, object]]) -> list[str]:
    """The issue's GPU targets, evaluated on these rows (informational on CPU)."""
    lines = []
    big = [r for r in rows if r["sweep"] == "size" and int(r["box_bytes"]) >= 16 * MiB
           and r["impl"] in ("pack_prepared", "unpack_prepared")]
    for r in big:
        frac = float(r["fraction_of_ceiling"])
        lines.append(f"large boxes: {r['impl']} {r['layout']} {int(r['box_bytes']) // MiB} MiB x {r['num_boxes']}: "
                     f"{float(r['gbps_median']):.1f} GB/s = {frac:.0%} of the copy ceiling (target >= 90%: "
                     f"{'met' if frac >= 0.9 else 'NOT met'})")
    for layout in sorted({str(r["layout"]) for r in rows}):
        sel = {r["impl"]: r for r in rows if r["sweep"] == "count" and r["layout"] == layout
               and int(r["num_boxes"]) == 1000 and int(r["box_bytes"]) == 4 * KiB}
        if "loop_pack" in sel and "pack_prepared" in sel:
            loop = float(sel["loop_pack"]["median_s"])
            for impl in ("pack_prepared", "pack"):
                if impl in sel:
                    speedup = loop / float(sel[impl]["median_s"])
                    lines.append(f"1,000 x 4 KiB {layout}: {impl} {float(sel[impl]['median_s']) * 1e3:.3f} ms vs "
                                 f"per-box copy loop {loop * 1e3:.3f} ms: {speedup:.1f}x (target >= 10x: "
                                 f"{'met' if speedup >= 10 else 'NOT met'})")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="perf/out")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto")
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="box bytes of the size sweep")
    ap.add_argument("--counts", default=",".join(map(str, DEFAULT_COUNTS)), help="box counts of the count sweep")
    ap.add_argument("--count-box-bytes", type=int, default=4 * KiB, help="box bytes of the count sweep")
    ap.add_argument("--max-total-bytes", type=int, default=None,
                    help="size sweep: boxes per config = min(1000, this // box bytes); default 64 MiB on CPU, "
                         "256 MiB on CUDA")
    ap.add_argument("--layouts", default="cols,rows")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: a CPU reshard runs one process per rank, several per machine, "
                         "and OpenMP threads of oversubscribed processes can slow small copies 100x)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.impls = args.impls.split(",")
    if "ceiling" not in args.impls:
        args.impls.insert(0, "ceiling")
    device = torch.device(args.device)
    max_total = args.max_total_bytes or (256 * MiB if device.type == "cuda" else 64 * MiB)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info(device)
    logger.info("machine: %s", info)

    rows: list[dict[str, object]] = []
    for layout in args.layouts.split(","):
        for size in map(int, args.sizes.split(",")):
            rows += bench_config("size", layout, size, max(1, min(1000, max_total // size)), args, device)
        for count in map(int, args.counts.split(",")):
            rows += bench_config("count", layout, args.count_box_bytes, count, args, device)
    rows = [{**row, **info} for row in rows]
    write_csv(out / "bench_kernels.csv", rows)
    backend = next(str(r["backend"]) for r in rows if r["impl"] == "pack_prepared")
    plot(rows, out / "bench_kernels.png",
         f"pack/unpack, {args.dtype}, {backend} backend on {info['gpu'] if device.type == 'cuda' else info['cpu']}")
    summary = summarize(rows)
    (out / "bench_kernels_summary.txt").write_text("\n".join([f"{k}: {v}" for k, v in info.items()] + summary) + "\n")
    for line in summary:
        logger.info("%s", line)
    logger.info("wrote %s, %s and %s", out / "bench_kernels.csv", out / "bench_kernels.png",
                out / "bench_kernels_summary.txt")


if __name__ == "__main__":
    main()
