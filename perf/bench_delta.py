"""How many bf16 bits change per RL step, what each delta format would send, and what encode + decode cost.

Usage:
    python perf/bench_delta.py [--numel 4194304] [--steps 5] [--lrs 1e-6,1e-5] [--seed 0]
        [--model-steps 5] [--no-model] [--time-mib 64] [--time-frac 0.02] [--repeat 3] [--threads 0]
        [--refit-numel 16777216] [--refit-weights 4] [--refit-steps 5] [--delta-check checksum]
        [--only synthetic,model,timing,checks,refit,model_refit] [--out perf/out]

Five parts, all on this machine's CPU with the torch path of `reshard.kernels` (`--only` picks some):
    synthetic  fp32 master weights `~N(0, 0.02)` (`--numel` elements), AdamW (torch defaults: betas (0.9, 0.999),
               eps 1e-8, weight decay 0.01) at each `--lrs` learning rate on fresh `N(0, 1)` gradients every step;
               after each step the bf16 inference copy (`w.bfloat16()`) is compared bit for bit with the previous
               step's. One box holds all elements (a refit box is a shard of one weight; a box of that size gives
               the same fractions and, up to 40-byte headers, the same bytes).
    model      the same with a tiny `transformers` Llama (random init, fp32, 2 layers, hidden 256, vocab 4096)
               trained on random tokens, one box per parameter (skipped with a message if `transformers` is missing
               or with `--no-model`).
    timing     a 64 MiB bf16 weight (`--time-mib`) with `--time-frac` of its elements changed: scan + encode
               (source; also count + encode, which compares twice) and decode (destination) next to a plain
               prepared pack + unpack of the whole weight. The snapshot is restored (untimed) before each encode.
    checks     each delta destination check (`DeltaSession(check=...)`: checksum, sum, none) on a `--time-mib` MiB
               bf16 box, contiguous and strided (a column half), with `kernels.checksum`'s torch form and an unpack
               of the box for scale, and whether each check detects rows swapped, a paired +1/-1 ulp move and a
               permutation of the even words (a receiver computes its check twice per run: state round, decode).
    refit      delta vs full refit side by side on 8 gloo ranks (`refit_job`): trainer ranks 0-3 hold fp32 master
               weights `S(0)` (`--refit-numel` elements in `--refit-weights` weights of 1024 rows) and their bf16
               copies, AdamW as above; inference ranks 4-7 (one NVLink domain, `[R, S(1)]`: relays) hold the
               destinations of a full `Refit` and of a `Refit(delta=True)`. Per step both run, in alternating order,
               each between barriers; rows give the slowest rank's time, the paired time ratio, the wire bytes of
               both (the delta's including its state and size messages), their ratio, and the delta's wire bytes
               over the encoded size of the changed elements, and the CPU seconds of each summed over the ranks;
               destinations are compared bit for bit. The per-rank median seconds of each phase of the delta runs
               (`DeltaReport.phases`) are logged.
    model_refit the same side by side over the tiny Llama's weights (21 parameters, 3.5M elements), trained a
               step between refits on every trainer rank (the same tokens: all hold the same weights), `S(0)` on
               ranks 0-3 -> `[R, S(0)]` on ranks 4-7.

For every step the encoded bytes of each format (DENSE, BITMASK, INDICES; `delta_nbytes`) and of the chosen one are
reported next to the dense bytes; the chosen encoding is also really encoded and decoded (`delta_encode`,
`delta_decode`) and the destination checked bit for bit against the source. Writes `bench_delta.csv` and
`bench_delta.png` (skipped with a message without matplotlib) into `--out`.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_info, write_csv

from reshard.kernels import (
    DeltaFormat,
    checksum,
    count_changed,
    delta_decode,
    delta_encode,
    delta_nbytes,
    delta_offsets,
    pack,
    packed_offsets,
    prepare_pack,
    prepare_unpack,
    scan_changes,
)
from reshard.planner import Box

logger = logging.getLogger("bench_delta")
MiB = 1 << 20
FORMATS = (DeltaFormat.DENSE, DeltaFormat.BITMASK, DeltaFormat.INDICES)
PARTS = ("synthetic", "model", "timing", "checks", "refit", "model_refit")


def whole(t: torch.Tensor) -> Box:
    return Box((0,) * t.ndim, tuple(t.shape))


class DeltaLink:
    """One source -> destination pair for a list of bf16 tensors: snapshot, destination copies and a version."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.boxes = [whole(t) for t in tensors]
        self.snap_offsets, end = packed_offsets(self.boxes, torch.bfloat16, align=8)
        self.snapshot = torch.empty(end, dtype=torch.uint8)
        pack(tensors, self.boxes, self.snapshot, self.snap_offsets)
        self.dests = [t.clone() for t in tensors]
        self.version = 0

    def step(self, tensors: list[torch.Tensor]) -> dict[str, object]:
        """Count, encode, decode and check one update; return counts and bytes per format."""
        counts = scan_changes(tensors, self.boxes, self.snapshot, self.snap_offsets)
        offsets, end = delta_offsets(self.boxes, torch.bfloat16, counts)
        buf = torch.empty(end, dtype=torch.uint8)
        headers = delta_encode(tensors, self.boxes, self.snapshot, self.snap_offsets, buf, offsets, counts=counts,
                               base_version=self.version, version=self.version + 1)
        delta_decode(buf, offsets, self.dests, self.boxes, versions=self.version)
        self.version += 1
        for d, t in zip(self.dests, tensors):
            if not torch.equal(d.view(torch.int16), t.view(torch.int16)):
                raise AssertionError("delta round trip is not bit-exact")
        numel = sum(b.numel for b in self.boxes)
        changed = sum(counts.counts)
        row: dict[str, object] = {"numel": numel, "changed": changed, "changed_pct": round(100 * changed / numel, 4),
                                  "dense_bytes": 2 * numel}
        for fmt in FORMATS:
            row[f"{fmt.name.lower()}_bytes"] = sum(delta_nbytes(b.numel, c, 2, format=fmt)
                                                   for b, c in zip(self.boxes, counts.counts))
        row["encoded_bytes"] = end
        row["formats"] = "/".join(sorted({h.format.name for h in headers}))
        row["dense_over_encoded"] = round(2 * numel / end, 2)
        row["bits_per_element"] = round(8 * end / numel, 3)
        return row


def run_updates(params: list[torch.Tensor], loss_fn, lr: float, steps: int, seed: int) -> list[dict[str, object]]:
    """AdamW on `params` (fp32 leaves) for `steps` steps; one row per step with the bf16 changes."""
    opt = torch.optim.AdamW(params, lr=lr)
    link = DeltaLink([p.detach().bfloat16() for p in params])
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        loss_fn(gen)
        opt.step()
        rows.append({"step": step, **link.step([p.detach().bfloat16() for p in params])})
    return rows


def synthetic(numel: int, lr: float, steps: int, seed: int) -> list[dict[str, object]]:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(numel, generator=gen) * 0.02).requires_grad_()

    def loss_fn(g: torch.Generator) -> None:
        w.grad = torch.randn(numel, generator=g)

    return run_updates([w], loss_fn, lr, steps, seed + 1)


def tiny_model(lr: float, steps: int, seed: int) -> list[dict[str, object]] | None:
    built = tiny_llama(seed)
    if built is None:
        return None
    model, cfg = built
    params = [p for p in model.parameters() if p.requires_grad]

    def loss_fn(g: torch.Generator) -> None:
        tokens = torch.randint(0, cfg.vocab_size, (4, 64), generator=g)
        model(input_ids=tokens, labels=tokens).loss.backward()

    rows = run_updates(params, loss_fn, lr, steps, seed + 1)
    for r in rows:
        r["num_params"] = len(params)
    return rows


def timed(fn, repeat: int, setup=None) -> list[float]:
    """Seconds per call of `fn` over `repeat` samples after one warm-up call; `setup` runs untimed before each."""
    out = []
    for i in range(repeat + 1):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        if i:
            out.append(time.perf_counter() - t0)
    return out


def timing(mib: int, frac: float, repeat: int, seed: int) -> list[dict[str, object]]:
    """Encode + decode of one `mib` MiB bf16 weight with `frac` changed, next to a prepared pack + unpack."""
    numel = mib * MiB // 2
    cols = 8192
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(numel // cols, cols, generator=gen).bfloat16()
    new = old.clone()
    flat = new.view(-1).view(torch.int16)
    pick = torch.randperm(numel, generator=gen)[: round(frac * numel)]
    flat[pick] ^= 1  # the lowest mantissa bit: every picked element changes
    box = [whole(new)]
    snap_offsets, snap_end = packed_offsets(box, torch.bfloat16, align=8)
    snapshot = torch.empty(snap_end, dtype=torch.uint8)
    pack([old], box, snapshot, snap_offsets)
    pristine = snapshot.clone()
    dest = old.clone()

    counts = count_changed([new], box, snapshot, snap_offsets)
    offsets, end = delta_offsets(box, torch.bfloat16, counts)
    buf = torch.empty(end, dtype=torch.uint8)
    state: dict[str, object] = {}

    def encode() -> None:
        scan = scan_changes([new], box, snapshot, snap_offsets)
        state["headers"] = delta_encode([new], box, snapshot, snap_offsets, buf, offsets, counts=scan,
                                        base_version=0, version=1)

    def encode_recount() -> None:  # counts only: delta_encode compares again
        c = count_changed([new], box, snapshot, snap_offsets)
        delta_encode([new], box, snapshot, snap_offsets, buf, offsets, counts=c, base_version=0, version=1)

    def decode() -> None:
        delta_decode(buf, offsets, [dest], box, versions=0)

    def restore() -> None:  # each encode sees the 2% change, as a real step would
        snapshot.copy_(pristine)

    encode_s = timed(encode, repeat, restore)
    recount_s = timed(encode_recount, repeat, restore)
    decode_s = timed(decode, repeat)
    assert torch.equal(dest.view(torch.int16), new.view(torch.int16))

    dense = torch.empty(numel * 2, dtype=torch.uint8)
    packer = prepare_pack([new], box, dense, [0])
    unpacker = prepare_unpack(dense, [0], [dest], box)
    pack_s = timed(packer.run, repeat)
    unpack_s = timed(unpacker.run, repeat)
    h = state["headers"][0]
    rows = []
    for op, samples, nbytes in [("delta_scan_encode", encode_s, end), ("delta_count_encode", recount_s, end),
                                ("delta_decode", decode_s, end),
                                ("pack", pack_s, numel * 2), ("unpack", unpack_s, numel * 2)]:
        rows.append({"part": "timing", "op": op, "numel": numel, "changed": counts[0],
                     "changed_pct": round(100 * counts[0] / numel, 3), "format": h.format.name, "bytes": nbytes,
                     "median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples)})
    enc = statistics.median(encode_s) + statistics.median(decode_s)
    full = statistics.median(pack_s) + statistics.median(unpack_s)
    rows.append({"part": "timing", "op": "delta_total_vs_pack_total", "numel": numel, "bytes": end,
                 "median_s": enc, "full_s": full, "delta_over_full_time": round(enc / full, 3),
                 "dense_over_encoded_bytes": round(numel * 2 / end, 2)})
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Delta refit vs full refit on gloo ranks
# ---------------------------------------------------------------------------------------------------------------

REFIT_WORLD = 8


def _check_patterns(box: torch.Tensor) -> dict[str, torch.Tensor]:
    """Engine-side changes of `box` (bf16, 2-D) that keep its multiset of values or its word sums."""
    swapped = box.clone()
    swapped[[1, 3]] = swapped[[3, 1]].clone()  # rows 2 apart: each row a whole number of words
    ulp = box.clone()
    flat = ulp.view(-1).view(torch.int16)
    flat[4 * 5] += 1  # +1 ulp in word 5, -1 ulp at the same place of word 9: both odd words
    flat[4 * 9] -= 1
    permuted = box.clone()
    words = permuted.view(-1).view(torch.int64)
    even = words[::2].clone()
    words[::2] = even[torch.randperm(even.numel(), generator=torch.Generator().manual_seed(5))]
    return {"swap_rows": swapped, "paired_ulp": ulp, "permute_even_words": permuted}


def checks(mib: int, repeat: int, seed: int) -> list[dict[str, object]]:
    """What each delta destination check (`DeltaSession(check=...)`, `reshard.comm.fingerprint`) costs on one
    `mib` MiB bf16 box, contiguous and strided (the left half of a tensor twice as wide: a TP column shard), and
    which engine-side changes it detects; next to `kernels.checksum`'s torch form and a prepared unpack of the box."""
    from reshard.comm import CHECKS, fingerprint

    numel = mib * MiB // 2
    cols = 4096
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(numel // cols, 2 * cols, generator=gen).bfloat16()
    boxes = {"contiguous": wide[:, :cols].contiguous(), "strided": wide[:, :cols]}
    rows = []
    for layout, box in boxes.items():
        patterns = _check_patterns(box.contiguous())
        for check in CHECKS:
            samples = timed(lambda: fingerprint(box, check), repeat)  # noqa: B023 - called at once
            base = fingerprint(box.contiguous(), check)
            row = {"part": "checks", "op": f"check_{check}", "layout": layout, "numel": numel, "bytes": numel * 2,
                   "median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples),
                   "gb_per_s": round(numel * 2 / statistics.median(samples) / 1e9, 2)}
            for name, changed in patterns.items():
                row[f"detects_{name}"] = check != "none" and fingerprint(changed, check) != base
            rows.append(row)
        samples = timed(lambda: checksum(box), repeat)  # noqa: B023 - called at once
        rows.append({"part": "checks", "op": "kernels_checksum_torch", "layout": layout, "numel": numel,
                     "bytes": numel * 2, "median_s": statistics.median(samples), "min_s": min(samples),
                     "max_s": max(samples), "gb_per_s": round(numel * 2 / statistics.median(samples) / 1e9, 2)})
    dense = torch.empty(numel * 2, dtype=torch.uint8)
    dest = boxes["strided"]
    unpacker = prepare_unpack(dense, [0], [dest], [whole(dest)])
    samples = timed(unpacker.run, repeat)
    rows.append({"part": "checks", "op": "unpack", "layout": "strided", "numel": numel, "bytes": numel * 2,
                 "median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples),
                 "gb_per_s": round(numel * 2 / statistics.median(samples) / 1e9, 2)})
    return rows


def _barrier(group, timeout) -> None:
    from reshard.comm import all_gather_json

    all_gather_json(group, 0, timeout=timeout, what="bench barrier")


def tiny_llama(seed: int):
    """The tiny `transformers` Llama of the model parts (random init from a config, fp32), or None without
    `transformers`: `(model, config)`."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        logger.warning("model parts skipped: transformers is not importable (%s)", e)
        return None
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).float().train(), cfg


def refit_job(w, numel: int, num_weights: int, lr: float, steps: int, seed: int,
              model: bool = False, check: str = "checksum") -> list[dict[str, object]]:
    """On every rank: trainer ranks 0-3 hold fp32 master weights `S(0)` and their bf16 copies, AdamW on random
    gradients; inference ranks 4-7 (one NVLink domain, 2 x 2 `[R, S(1)]`: relays) hold two sets of bf16
    destinations, one for a full `Refit` and one for `Refit(delta=True)`. Per step the two refits run in
    alternating order, each timed between barriers; the destinations are compared bit for bit.

    With `model`, the weights are the parameters of the tiny Llama (`tiny_llama`, the same init on every rank):
    each trainer rank trains the whole model on the same random tokens (so all hold the same weights) and sources
    its `S(0)` shard of each parameter; the inference ranks hold `[R, S(0)]` (`numel`, `num_weights` unused).
    `check`: the delta refit's `delta_check`."""
    import datetime

    from reshard import Layout, Mesh, Replicate, Shard, Topology
    from reshard.refit import Refit

    rank, group = w.rank, w.group
    td = datetime.timedelta(seconds=300)
    topo = Topology(domain_size=4)
    refits = {mode: Refit(group, topology=topo, delta=mode == "delta", staging_bytes=64 * MiB, policy="reshard",
                          delta_check=check)
              for mode in ("full", "delta")}
    masters, copies, opt = [], [], None
    dests: dict[str, list[torch.Tensor]] = {"full": [], "delta": []}
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    train_ranks = [0, 1, 2, 3]
    if model:
        built = tiny_llama(seed)
        if built is None:
            return []
        net, cfg = built
        named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
        weights = [(n, tuple(p.shape), Shard(0)) for n, p in named]
    else:
        rows_per_weight = 1024
        shape = (rows_per_weight, numel // num_weights // rows_per_weight)
        weights = [(f"w{k}", shape, Shard(1)) for k in range(num_weights)]
    slices = []
    for k, (name, shape, infer_shard) in enumerate(weights):
        train = Layout(shape, Mesh(train_ranks), [Shard(0)], torch.bfloat16, name=name)
        infer = Layout(shape, Mesh([[4, 5], [6, 7]]), [Replicate(), infer_shard], torch.bfloat16, name=name)
        if rank in train.ranks:
            if model:
                (piece,) = train.pieces(rank)
                slices.append(piece.global_box.slices())
                masters.append(named[k][1])
                copies.append(named[k][1].detach()[slices[-1]].bfloat16())
            else:
                m = (torch.randn(train.local_shape(rank), generator=gen) * 0.02).requires_grad_()
                masters.append(m)
                copies.append(m.detach().bfloat16())
            for r in refits.values():
                r.add_source(name, copies[-1], train)
        if rank in infer.ranks:
            for mode, r in refits.items():
                dests[mode].append(torch.zeros(infer.local_shape(rank), dtype=torch.bfloat16))
                r.add_destination(name, dests[mode][-1], infer)
    if masters:
        opt = torch.optim.AdamW(masters, lr=lr)
    tokens_gen = torch.Generator().manual_seed(seed + 1)  # the same tokens on every trainer rank
    for r in refits.values():  # first runs: metadata, plan, and the delta side's first (full) run
        r.run()
    rows = []
    for step in range(1, steps + 1):
        if opt is not None:
            opt.zero_grad(set_to_none=True)
            if model:
                tokens = torch.randint(0, cfg.vocab_size, (4, 64), generator=tokens_gen)
                net(input_ids=tokens, labels=tokens).loss.backward()
            else:
                for m in masters:
                    m.grad = torch.randn(m.shape, generator=gen)
            opt.step()
            for k, (m, c) in enumerate(zip(masters, copies)):
                c.copy_(m.detach()[slices[k]] if model else m.detach())
        order = ("full", "delta") if step % 2 else ("delta", "full")
        times, cpus, reports = {}, {}, {}
        for mode in order:
            _barrier(group, td)
            t0, c0 = time.perf_counter(), time.process_time()
            reports[mode] = refits[mode].run()
            times[mode] = time.perf_counter() - t0
            cpus[mode] = time.process_time() - c0
        equal = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(dests["full"],
                                                                                          dests["delta"]))
        ex = reports["delta"].execution
        full_ex = reports["full"].execution
        links = ex.links if ex is not None else {}
        rows.append({"step": step, "rank": rank, "full_s": times["full"], "delta_s": times["delta"], "equal": equal,
                     "weights_numel": sum(math.prod(shape) for _, shape, _ in weights), "weights": len(weights),
                     "full_cpu_s": cpus["full"], "delta_cpu_s": cpus["delta"],
                     "elements": sum(v.elements for v in links.values()),
                     "changed": sum(v.changed for v in links.values()),
                     "encoded_bytes": sum(v.encoded_bytes for v in links.values()),
                     "dense_bytes": sum(v.dense_bytes for v in links.values()),
                     "network_encoded": links["network"].encoded_bytes if "network" in links else 0,
                     "nvlink_encoded": links["nvlink"].encoded_bytes if "nvlink" in links else 0,
                     "delta_wire_bytes": (ex.bytes_sent + ex.control_bytes) if ex is not None else 0,
                     "full_wire_bytes": full_ex.bytes_sent if full_ex is not None else 0,
                     "snapshot_bytes": reports["delta"].snapshot_bytes,
                     "delta_pack_s": ex.seconds_pack if ex is not None else 0.0,
                     "delta_unpack_s": ex.seconds_unpack if ex is not None else 0.0,
                     "delta_handshake_s": ex.seconds_handshake if ex is not None else 0.0,
                     "phases": {"handshake": ex.seconds_handshake, **getattr(ex, "phases", {})} if ex is not None
                     else {}})
    group.cache.clear()
    return rows


def refit_compare(numel: int, num_weights: int, lrs: list[float], steps: int, seed: int,
                  model: bool = False, check: str = "checksum") -> list[dict[str, object]]:
    """`refit_job` on `REFIT_WORLD` gloo ranks per learning rate; one row per step (summed over ranks, times as
    the slowest rank's) and one summary row per learning rate with median paired ratios. `model`: the tiny Llama's
    weights (part `model_refit`)."""
    from reshard.testing import RankPool

    out = []
    part = "model_refit" if model else "refit"
    with RankPool(REFIT_WORLD) as pool:
        for lr in lrs:
            per_rank = pool.run_ok(refit_job, numel, num_weights, lr, steps, seed, model, check, timeout=1800)
            if not per_rank[0]:
                return out  # no transformers
            for k in range(steps):
                rs = [per_rank[r][k] for r in range(REFIT_WORLD)]
                row = {"part": part, "lr": lr, "step": k + 1, "delta_check": check, "numel": rs[0]["weights_numel"],
                       "weights": rs[0]["weights"], "ranks": REFIT_WORLD,
                       "full_s": max(r["full_s"] for r in rs), "delta_s": max(r["delta_s"] for r in rs),
                       "equal": all(r["equal"] for r in rs),
                       "full_cpu_s": sum(r["full_cpu_s"] for r in rs), "delta_cpu_s": sum(r["delta_cpu_s"] for r in rs)}
                for key in ("elements", "changed", "encoded_bytes", "dense_bytes", "network_encoded",
                            "nvlink_encoded", "delta_wire_bytes", "full_wire_bytes", "snapshot_bytes"):
                    row[key] = sum(r[key] for r in rs)
                row["changed_pct"] = round(100 * row["changed"] / max(row["elements"], 1), 3)
                row["bytes_ratio"] = round(row["full_wire_bytes"] / max(row["delta_wire_bytes"], 1), 2)
                row["wire_over_encoded"] = round(row["delta_wire_bytes"] / max(row["encoded_bytes"], 1), 4)
                row["time_ratio"] = round(row["full_s"] / row["delta_s"], 3)
                row["delta_pack_s"] = max(r["delta_pack_s"] for r in rs)
                row["delta_unpack_s"] = max(r["delta_unpack_s"] for r in rs)
                out.append(row)
                logger.info("%s lr=%g step %d: %.2f%% changed, full %.3f s vs delta %.3f s (%.2fx; CPU summed over "
                            "ranks %.3f vs %.3f s), bytes %d vs %d (%.1fx), wire/encoded %.3f, equal=%s", part, lr,
                            k + 1, row["changed_pct"], row["full_s"], row["delta_s"], row["time_ratio"],
                            row["full_cpu_s"], row["delta_cpu_s"], row["full_wire_bytes"], row["delta_wire_bytes"],
                            row["bytes_ratio"], row["wire_over_encoded"], row["equal"])
            for r in range(REFIT_WORLD):  # per rank, per phase: the median over steps of the delta run's seconds
                names = sorted({k for row in per_rank[r] for k in row["phases"]})
                med = {k: round(1000 * statistics.median(row["phases"].get(k, 0.0) for row in per_rank[r]), 1)
                       for k in names}
                logger.info("%s lr=%g rank %d delta phases (median ms): %s", part, lr, r, med)
            sel = [r for r in out if r.get("lr") == lr and r["part"] == part and "step" in r]
            summary = {"part": f"{part}_summary", "lr": lr, "numel": sel[0]["numel"], "ranks": REFIT_WORLD,
                       "steps": steps,
                       "median_time_ratio": statistics.median(r["time_ratio"] for r in sel),
                       "median_bytes_ratio": statistics.median(r["bytes_ratio"] for r in sel),
                       "max_wire_over_encoded": max(r["wire_over_encoded"] for r in sel),
                       "median_changed_pct": statistics.median(r["changed_pct"] for r in sel),
                       "all_equal": all(r["equal"] for r in sel)}
            out.append(summary)
            logger.info("%s lr=%g summary: %s", part, lr, summary)
    return out


def plot(rows: list[dict[str, object]], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        logger.warning("plot skipped: matplotlib is not installed (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(16, 4))
    for part, tag in (("refit", ""), ("model_refit", " model")):
        for lr in sorted({r["lr"] for r in rows if r["part"] == part}):
            sel = [r for r in rows if r["part"] == part and r["lr"] == lr]
            ax2.plot([r["step"] for r in sel], [r["bytes_ratio"] for r in sel], "-o",
                     label=f"bytes full/delta{tag} lr={lr:g}")
            ax2.plot([r["step"] for r in sel], [r["time_ratio"] for r in sel], "--s",
                     label=f"time full/delta{tag} lr={lr:g}")
    ax2.set(xlabel="step", ylabel="full / delta", yscale="log",
            title=f"refit on {REFIT_WORLD} gloo ranks, delta vs full")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=7)
    series = sorted({(r["part"], r["lr"]) for r in rows if r["part"] in ("synthetic", "model")})
    for part, lr in series:
        sel = [r for r in rows if r["part"] == part and r["lr"] == lr]
        steps = [r["step"] for r in sel]
        style = "-o" if part == "synthetic" else "--s"
        ax0.plot(steps, [r["changed_pct"] for r in sel], style, label=f"{part} lr={lr:g}")
        for fmt, marker in (("bitmask", "^"), ("indices", "v")):
            ax1.plot(steps, [r["dense_bytes"] / r[f"{fmt}_bytes"] for r in sel], style[:-1] + marker,
                     label=f"{part} lr={lr:g} {fmt}")
    steps_all = sorted({r["step"] for r in rows if r["part"] in ("synthetic", "model")})
    ax0.set_xticks(steps_all)
    ax1.set_xticks(steps_all)
    ax0.set(xlabel="step", ylabel="bf16 elements changed (%)", yscale="log", title="changed fraction per step")
    ax1.set(xlabel="step", ylabel="dense bytes / encoded bytes", yscale="log", title="bytes saved per format")
    ax0.grid(True, which="both", alpha=0.3)
    ax1.grid(True, which="both", alpha=0.3)
    ax0.legend(fontsize=7)
    ax1.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    logger.info("wrote %s", path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=4 * MiB)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lrs", default="1e-6,1e-5")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-steps", type=int, default=5)
    ap.add_argument("--no-model", action="store_true")
    ap.add_argument("--time-mib", type=int, default=64, help="size of the timed bf16 weight (0: skip the timing)")
    ap.add_argument("--time-frac", type=float, default=0.02)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--refit-numel", type=int, default=16 * MiB, help="bf16 elements of the refit part (0: skip)")
    ap.add_argument("--refit-weights", type=int, default=4)
    ap.add_argument("--refit-steps", type=int, default=5)
    ap.add_argument("--delta-check", default="checksum", choices=("checksum", "sum", "none"),
                    help="Refit(delta_check=...) of the refit parts: how a destination finds it was overwritten")
    ap.add_argument("--only", default="", help="comma-separated parts to run (synthetic, model, timing, refit, "
                    "model_refit); "
                    "default all")
    ap.add_argument("--out", default="perf/out")
    args = ap.parse_args()
    parts = set(args.only.split(",")) if args.only else set(PARTS)
    if parts - set(PARTS):
        ap.error(f"--only: unknown parts {sorted(parts - set(PARTS))}; choose from {PARTS}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    info = machine_info(torch.device("cpu"))
    lrs = [float(x) for x in args.lrs.split(",")]
    rows: list[dict[str, object]] = []
    for lr in lrs if "synthetic" in parts else ():
        for r in synthetic(args.numel, lr, args.steps, args.seed):
            rows.append({"part": "synthetic", "lr": lr, **r})
            logger.info("synthetic lr=%g step %d: %.2f%% changed, dense/encoded %.1fx (%s), %.2f bits/element",
                        lr, r["step"], r["changed_pct"], r["dense_over_encoded"], r["formats"], r["bits_per_element"])
    if not args.no_model and "model" in parts:
        for lr in lrs:
            model_rows = tiny_model(lr, args.model_steps, args.seed)
            if model_rows is None:
                break
            for r in model_rows:
                rows.append({"part": "model", "lr": lr, **r})
                logger.info("model lr=%g step %d: %.2f%% of %d changed, dense/encoded %.1fx (%s)", lr, r["step"],
                            r["changed_pct"], r["numel"], r["dense_over_encoded"], r["formats"])
    if args.time_mib and "timing" in parts:
        for r in timing(args.time_mib, args.time_frac, args.repeat, args.seed):
            rows.append(r)
            if "full_s" in r:
                logger.info("timing %d MiB bf16 at %.1f%%: count+encode+decode %.3f s vs pack+unpack %.3f s (%.2fx the "
                            "time), %.1fx fewer bytes", args.time_mib, 100 * args.time_frac, r["median_s"],
                            r["full_s"], r["delta_over_full_time"], r["dense_over_encoded_bytes"])
            else:
                logger.info("timing %s: median %.4f s (min %.4f, max %.4f), %d bytes", r["op"], r["median_s"],
                            r["min_s"], r["max_s"], r["bytes"])
    if args.time_mib and "checks" in parts:
        for r in checks(args.time_mib, args.repeat, args.seed):
            rows.append(r)
            detects = {k[len("detects_"):]: v for k, v in r.items() if k.startswith("detects_")}
            logger.info("checks %s %s: median %.4f s (%.2f GB/s)%s", r["op"], r["layout"], r["median_s"],
                        r["gb_per_s"], f", detects {detects}" if detects else "")
    if args.refit_numel and "refit" in parts:
        rows.extend(refit_compare(args.refit_numel, args.refit_weights, lrs, args.refit_steps, args.seed,
                                  check=args.delta_check))
    if not args.no_model and "model_refit" in parts:
        rows.extend(refit_compare(0, 0, lrs, args.model_steps, args.seed, model=True, check=args.delta_check))
    out = Path(args.out)
    config = {"numel_arg": args.numel, "seed": args.seed, "repeat": args.repeat}
    write_csv(out / "bench_delta.csv", [{**r, **config, **info} for r in rows])
    logger.info("wrote %s", out / "bench_delta.csv")
    plot(rows, out / "bench_delta.png")


if __name__ == "__main__":
    main()
