"""Pack / unpack bandwidth, swept over box size and box count, next to the copy ceiling and naive baselines.

Usage:
    python perf/bench_kernels.py [--out perf/out] [--device cpu|cuda] [--backend torch|triton]
        [--sizes 64,256,...] [--counts 1,10,100,1000,10000] [--count-box-bytes 4096]
        [--max-total-bytes N] [--layouts cols,rows] [--dtype bfloat16] [--repeat 5] [--threads 1]
    python perf/bench_kernels.py --shape 4096,11008 --split tp8,tp8:1,tp2 [...]   (your own tensor instead)

`--shape R,C` with `--split`: one `[R, C]` tensor cut into the shards of each split (`tpN`: N row blocks, as a
column-parallel weight; `tpN:1`: N column blocks, strided, as a row-parallel one; uneven as `torch.chunk`), all N
boxes packed into one buffer (what a rank holding the whole tensor sends to N ranks); the sweep is called `shape`.

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
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import machine_info, spread, synchronizer, time_calls, write_csv

from reshard.kernels import pack, packed_offsets, prepare_pack, prepare_unpack, unpack
from reshard.planner import Box, format_bytes

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


def parse_split(split: str, shape: tuple[int, int]) -> tuple[int, int]:
    """`"tp8"` -> `(8, 0)` (8 row blocks), `"tp8:1"` -> `(8, 1)` (8 column blocks); ValueError naming the split."""
    head, _, dim = split.partition(":")
    if not head.startswith("tp") or not head[2:].isdigit() or int(head[2:]) < 1 or dim not in ("", "0", "1"):
        raise ValueError(f"--split {split!r}: expected tpN (N row blocks) or tpN:1 (N column blocks), e.g. tp8")
    n, d = int(head[2:]), int(dim or 0)
    if n > shape[d]:
        raise ValueError(f"--split {split!r}: {n} shards of dim {d} of --shape {list(shape)} leave some empty")
    return n, d


def shape_boxes(shape: tuple[int, int], split: str, dtype: torch.dtype,
                device: torch.device) -> tuple[list[torch.Tensor], list[Box]]:
    """The N shards of one `shape` tensor under `split` (`parse_split`), as boxes of that one tensor."""
    n, d = parse_split(split, shape)
    t = torch.randn(shape, generator=torch.Generator(device=device).manual_seed(0), device=device).to(dtype)
    boxes, at = [], 0
    for size in (len(c) for c in torch.arange(shape[d]).chunk(n)):
        boxes.append(Box((at, 0), (size, shape[1])) if d == 0 else Box((0, at), (shape[0], size)))
        at += size
    return [t] * len(boxes), boxes


def bench_config(sweep: str, layout: str, box_bytes: int, num_boxes: int, args: argparse.Namespace,
                 device: torch.device) -> list[dict[str, object]]:
    """Every impl on `num_boxes` boxes of about `box_bytes` (`make_boxes`)."""
    tensors, boxes = make_boxes(box_bytes, num_boxes, layout, getattr(torch, args.dtype), device)
    return bench_boxes(sweep, layout, tensors, boxes, args, device)


def bench_boxes(sweep: str, layout: str, tensors: list[torch.Tensor], boxes: list[Box], args: argparse.Namespace,
                device: torch.device, extra: dict[str, object] | None = None) -> list[dict[str, object]]:
    """Every impl of `args.impls` packing `boxes` of `tensors` (one row each; `box_bytes` is the largest box's real
    size, not a requested one)."""
    dtype = getattr(torch, args.dtype)
    box_bytes, num_boxes = max(b.numel for b in boxes) * dtype.itemsize, len(boxes)
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
            "dtype": args.dtype, "box_bytes": box_bytes, "num_boxes": num_boxes, "total_bytes": total, **(extra or {}),
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

    if all(r["sweep"] == "shape" for r in rows):
        plot_shape(rows, path, title, plt)
        return
    layouts = sorted({str(r["layout"]) for r in rows if r["sweep"] != "shape"})
    sweeps = [("size", "box_bytes", "box size (bytes)"), ("count", "num_boxes", count_label(rows))]
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


def count_label(rows: list[dict[str, object]]) -> str:
    """The count sweep's axis label, from the boxes' real sizes (the rows' `box_bytes`)."""
    sizes = sorted({int(r["box_bytes"]) for r in rows if r["sweep"] == "count"})
    return f"number of boxes ({', '.join(format_bytes(b) for b in sizes) or '?'} each)"


def plot_shape(rows: list[dict[str, object]], path: Path, title: str, plt: Any) -> None:
    """The `--shape` sweep: GB/s per split (bars per impl), the ceiling's bar first."""
    splits = list(dict.fromkeys(str(r["layout"]) for r in rows))
    impls = list(dict.fromkeys(str(r["impl"]) for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(splits) * len(impls) / 4), 4.5))
    width = 0.8 / len(impls)
    for k, impl in enumerate(impls):
        ys = [next((float(r["gbps_median"]) for r in rows if r["layout"] == s and r["impl"] == impl), 0.0)
              for s in splits]
        ax.bar([i + k * width for i in range(len(splits))], ys, width, label=impl)
    labels = []
    for s in splits:
        r = next(r for r in rows if r["layout"] == s)
        labels.append(f"{s}\n{r['num_boxes']} x {format_bytes(int(r['box_bytes']))}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(splits))], labels)
    ax.set_ylabel("GB/s (packed bytes / time)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(f"{title}\nshape {rows[0].get('shape', '?')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(rows: list[dict[str, object]]) -> list[str]:
    """One line per configuration measured (the packers' GB/s and fraction of the copy ceiling), then the GPU
    targets where the rows cover them (informational on CPU)."""
    lines = []
    for key in dict.fromkeys((r["sweep"], r["layout"], int(r["box_bytes"]), int(r["num_boxes"])) for r in rows):
        sel = {r["impl"]: r for r in rows if (r["sweep"], r["layout"], int(r["box_bytes"]), int(r["num_boxes"])) == key}
        parts = [f"{impl} {float(r['gbps_median']):.2f} GB/s" + (f" ({float(r['fraction_of_ceiling']):.0%})"
                                                               if r["fraction_of_ceiling"] else "")
                 for impl, r in sel.items()]
        lines.append(f"{key[0]} {key[1]} {key[3]} x {format_bytes(key[2])}: " + ", ".join(parts))
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


def _shape(text: str) -> tuple[int, int]:
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected R,C (two positive integers), got {text!r}")
    return int(parts[0]), int(parts[1])


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
    ap.add_argument("--shape", type=_shape, default=None, help="R,C: time your own [R, C] tensor's shards instead")
    ap.add_argument("--split", default="tp8", help="with --shape: tpN (row blocks) or tpN:1 (column blocks), ...")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: a CPU reshard runs one process per rank, several per machine, "
                         "and OpenMP threads of oversubscribed processes can slow small copies 100x)")
    args = ap.parse_args()
    if args.shape:
        for split in args.split.split(","):
            try:
                parse_split(split, args.shape)
            except ValueError as e:
                ap.error(str(e))
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
    if args.shape:
        for split in args.split.split(","):
            tensors, boxes = shape_boxes(args.shape, split, getattr(torch, args.dtype), device)
            rows += bench_boxes("shape", split, tensors, boxes, args, device,
                                {"shape": "x".join(map(str, args.shape))})
    for layout in args.layouts.split(",") if not args.shape else ():
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
