"""`perf/bench_kernels.py`: a user's own tensor (`--shape R,C --split ...`), a summary holding every configuration
it measured, and axis labels from the boxes' real sizes."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "perf"))

import bench_kernels as bk  # noqa: E402


@pytest.mark.parametrize("split, n, dim", [("tp8", 8, 0), ("tp3:1", 3, 1), ("tp7", 7, 0)])
def test_shape_boxes_are_torch_chunks(split: str, n: int, dim: int) -> None:
    """Oracle: `torch.chunk` of the tensor (uneven: 10 rows over 7 and 3 ranks, 9 columns over 3)."""
    tensors, boxes = bk.shape_boxes((10, 9), split, torch.float32, torch.device("cpu"))
    chunks = tensors[0].chunk(n, dim)
    assert len(boxes) == len(chunks)
    for b, c in zip(boxes, chunks):
        assert torch.equal(tensors[0][b.slices()], c)


@pytest.mark.parametrize("split, match", [("dp8", "expected tpN"), ("tp0", "expected tpN"), ("tp8:2", "expected"),
                                          ("tp20", "leave some empty")])
def test_a_bad_split_names_it(split: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        bk.parse_split(split, (10, 9))


def test_shape_run_writes_every_split_to_csv_summary_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "bk"
    r = subprocess.run([sys.executable, str(ROOT / "perf" / "bench_kernels.py"), "--shape", "96,40",
                        "--split", "tp8,tp4:1", "--repeat", "1", "--impls", "pack_prepared,cat", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = list(csv.DictReader(open(out / "bench_kernels.csv")))
    assert {(row["layout"], row["impl"]) for row in rows} == {(s, i) for s in ("tp8", "tp4:1")
                                                             for i in ("ceiling", "pack_prepared", "cat")}
    tp8 = next(row for row in rows if row["layout"] == "tp8")
    assert (tp8["sweep"], tp8["shape"], tp8["num_boxes"], tp8["box_bytes"]) == ("shape", "96x40", "8", str(12 * 40 * 2))
    summary = (out / "bench_kernels_summary.txt").read_text()
    assert "shape tp8 8 x 960 B: ceiling" in summary and "shape tp4:1 4 x 1.88 KiB: ceiling" in summary, summary
    assert (out / "bench_kernels.png").stat().st_size > 0


def test_the_summary_has_a_line_per_configuration_and_labels_use_real_sizes() -> None:
    """A custom sweep (3 KiB boxes, 10 of them) that meets none of the GPU targets' configurations: before, its
    summary was empty and its plot said 4 KiB."""
    args = bk.argparse.Namespace(dtype="bfloat16", backend="torch", impls=["ceiling", "pack_prepared"], repeat=1)
    rows = bk.bench_config("count", "cols", 3 * 1024, 10, args, torch.device("cpu"))
    lines = bk.summarize(rows)
    assert len(lines) == 1 and lines[0].startswith("count cols 10 x 3.00 KiB: ceiling"), lines
    assert bk.count_label(rows) == "number of boxes (3.00 KiB each)"
    # a size make_boxes rounds up (5000 B of bfloat16: 2 rows of 2,048 elements) is reported as what it timed
    rows = bk.bench_config("size", "cols", 5000, 2, args, torch.device("cpu"))
    assert {int(r["box_bytes"]) for r in rows} == {8192}
