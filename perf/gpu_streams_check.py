"""Single-GPU check of the executor's streams pipeline: two chunks in flight, and the overlap shown in the timing.

Two ranks run as two threads of this process on one device. Between them sits a loopback "link": a send is matched
to its receive, and the bytes are copied on a link stream after a delay that stands for the wire time (on CUDA
`torch.cuda._sleep`, which takes time but no memory bandwidth; on CPU a timer thread). The executor itself is the
real one (`reshard.comm.execute`, with its pack, comm and unpack streams and their events); only the process group
is replaced.

First, `check_paths` runs the executor's message paths (many tensors sent box by box from and into the tensors;
a strided slab packed and sent in parts) zero-copy and staged, bit for bit. Then the check runs one plan (each rank
sends its whole shard to the other, in `--chunks` chunks) three ways:

1. `serial, no link delay`: one pipeline slot; calibrates the per-chunk cost of pack + copy + unpack, `T`;
2. `serial`: one slot (`NUM_SLOTS = 1`: pack, transfer and unpack of a chunk run one after another), with a link
   delay of `T` per chunk;
3. `pipelined`: the executor as shipped, two slots: chunk i+1 packs and chunk i-1 unpacks while chunk i is on the
   link.

With the delay equal to the work, `serial` takes about `2 T` per chunk and `pipelined` about `T` per chunk plus one
chunk to fill the pipeline. The check passes when every result is correct (bit for bit) and `pipelined` is at
least `--min-speedup` (default 1.25) times faster than `serial`. It writes `gpu_streams_check.csv` and
`gpu_streams_check.png` into `--out`.

Usage: python perf/gpu_streams_check.py [--device cuda] [--mib 256] [--chunks 8] [--repeat 3] [--out DIR]
(`--device cpu` runs the same plumbing on CPU tensors, for a machine without a GPU.)
"""

from __future__ import annotations

import argparse
import collections
import csv
import datetime
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.distributed.tensor import Shard  # noqa: E402

import reshard.comm._executor as ex  # noqa: E402
from reshard.comm import Group, execute  # noqa: E402
from reshard.planner import Layout, Mesh, plan  # noqa: E402


class _Work:
    """A loopback send or receive: matched on the host, completed on the link (stream or timer thread)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.matched = threading.Event()
        self.done = threading.Event()  # CPU: the copy has happened
        self.event: Any = None  # CUDA: recorded on the link stream after the copy

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        seconds = timeout.total_seconds() if timeout is not None else 60.0
        if not self.matched.wait(seconds):
            raise RuntimeError(f"loopback: timed out after {seconds} s waiting for the peer to post")
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_event(self.event)  # link -> caller's stream
        elif not self.done.wait(seconds):
            raise RuntimeError("loopback: timed out waiting for the link")
        return True

    def is_completed(self) -> bool:
        return self.done.is_set() if self.device.type != "cuda" else self.matched.is_set() and self.event.query()


class _Many:
    def __init__(self, works: list[_Work]) -> None:
        self.works = works

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        for w in self.works:
            w.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class LoopbackHub:
    """The "network" between ranks that are threads: FIFO matching per (sender, receiver, tag).

    Args:
        device: where data tensors live (control messages are CPU tensors and are copied at once).
        delay_s: link time per byte, seconds.
    """

    def __init__(self, device: torch.device, delay_s_per_byte: float = 0.0, sleep_cycles_per_s: float = 0.0) -> None:
        self.device = device
        self.delay = delay_s_per_byte
        self.cycles_per_s = sleep_cycles_per_s
        self.lock = threading.Lock()
        self.sends: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        self.recvs: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        self.link = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.link_bytes = 0

    def post(self, kind: str, me: int, peer: int, tensor: torch.Tensor, tag: int, pending: list | None) -> _Work:
        work = _Work(tensor.device)
        ready = None
        if tensor.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tensor.device))  # caller -> link: the buffer is ready
        key = (me, peer, tag) if kind == "send" else (peer, me, tag)
        mine, theirs = (self.sends, self.recvs) if kind == "send" else (self.recvs, self.sends)
        with self.lock:
            if theirs[key]:
                other = theirs[key].popleft()
                send, recv = ((tensor, ready, work), other) if kind == "send" else (other, (tensor, ready, work))
                self._move(send, recv)
            else:
                mine[key].append((tensor, ready, work))
        if pending is not None:
            pending.append(work)
        return work

    def _move(self, send: tuple, recv: tuple) -> None:
        (src, src_ready, w1), (dst, dst_ready, w2) = send, recv
        if src.numel() != dst.numel():
            raise RuntimeError(f"loopback: send of {src.numel()} elements matched to a receive of {dst.numel()}")
        wire = self.delay * src.numel() * src.element_size()
        if src.is_cuda:
            with torch.cuda.stream(self.link):
                self.link.wait_event(src_ready)
                self.link.wait_event(dst_ready)
                if wire > 0:
                    torch.cuda._sleep(int(wire * self.cycles_per_s))  # wire time without memory traffic
                dst.copy_(src)
                done = torch.cuda.Event()
                done.record(self.link)
            w1.event = w2.event = done
            w1.matched.set()
            w2.matched.set()
            self.link_bytes += src.numel() * src.element_size()
            return

        def deliver() -> None:
            if wire > 0:
                time.sleep(wire)
            dst.copy_(src)
            w1.done.set()
            w2.done.set()

        w1.matched.set()
        w2.matched.set()
        if wire > 0 and dst.numel() > 64:
            threading.Thread(target=deliver, daemon=True).start()
        else:
            deliver()


class LoopbackBackend:
    """What `Group` needs of a backend (`send`, `recv`, coalescing), for one rank of a `LoopbackHub`."""

    def __init__(self, hub: LoopbackHub, rank: int) -> None:
        self.hub, self.rank = hub, rank
        self.pending: list | None = None

    def _start_coalescing(self, device: torch.device) -> None:
        self.pending = []

    def _end_coalescing(self, device: torch.device) -> _Many:
        works, self.pending = self.pending or [], None
        return _Many(works)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Work:
        return self.hub.post("send", self.rank, dst, tensors[0], tag, self.pending)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Work:
        return self.hub.post("recv", self.rank, src, tensors[0], tag, self.pending)


def _groups(hub: LoopbackHub) -> list[Group]:
    out = []
    for r in range(2):
        b = LoopbackBackend(hub, r)
        out.append(Group(rank=r, size=2, control=b, data={hub.device.type: b, "cpu": b}, name="loopback",
                         timeout=datetime.timedelta(seconds=60)))
    return out


def _run_pair(p: Any, groups: list[Group], srcs: list[torch.Tensor], dsts: list[torch.Tensor]) -> float:
    """Both ranks execute `p` at once (threads); seconds until both are done and the device is idle."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(3)

    def rank_main(r: int) -> None:
        try:
            barrier.wait()
            execute(p, r, [srcs[r]], [dsts[r]], groups[r], timeout=60)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    if srcs[0].is_cuda:
        torch.cuda.synchronize()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    if srcs[0].is_cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return elapsed


def check_paths(device: torch.device) -> list[str]:
    """The executor's message paths on `device`, zero-copy and staged, each bit for bit against the source bytes:
    many tensors whose boxes go direct box by box (`DIRECT_SPLIT_BYTES`), and one strided column slab per rank
    packed and sent in parts (`PART_BYTES`), received straight into the destination. Returns the failures."""
    from reshard.planner import plan_many

    bf16 = torch.bfloat16
    g = torch.Generator().manual_seed(1)
    cases = {}
    # 12 tensors, each rank's half of 1024 x 512 bf16 (512 KiB boxes): one direct message per box
    shapes = [(1024, 512)] * 12
    cases["many-box direct"] = [(Layout(s, Mesh([0, 1]), [Shard(0)], bf16), Layout(s, Mesh([1, 0]), [Shard(0)], bf16))
                                for s in shapes]
    # S(0) -> S(1) of 4096 x 8192 bf16: 2048 x 4096 slabs (16 MiB), strided in the source: packed in 2 parts
    cases["strided slab in parts"] = [(Layout((4096, 8192), Mesh([0, 1]), [Shard(0)], bf16),
                                       Layout((4096, 8192), Mesh([0, 1]), [Shard(1)], bf16))]
    failures = []
    for name, pairs in cases.items():
        p = plan_many(pairs, staging_bytes=64 << 20)
        fulls = [torch.randint(-(2**15), 2**15, a.shape, dtype=torch.int16, generator=g).view(bf16) for a, _ in pairs]

        def local(full: torch.Tensor, layout: Any, r: int) -> torch.Tensor:
            (piece,) = layout.pieces(r)
            return full[piece.global_box.slices()].contiguous().to(device)

        srcs = [[local(f, a, r) for f, (a, _) in zip(fulls, pairs)] for r in range(2)]
        want = [[local(f, b, r) for f, (_, b) in zip(fulls, pairs)] for r in range(2)]
        for zero_copy in (True, False):
            dsts = [[torch.zeros_like(t) for t in want[r]] for r in range(2)]
            groups = _groups(LoopbackHub(device))
            errors: list[BaseException] = []
            reports: dict[int, Any] = {}

            def rank_main(r: int, zc: bool = zero_copy, d: list = dsts, gr: list = groups, pl: Any = p,
                          s: list = srcs, err: list = errors, rep: dict = reports) -> None:
                try:
                    rep[r] = execute(pl, r, s[r], d[r], gr[r], timeout=60, zero_copy=zc)
                except BaseException as e:  # noqa: BLE001 - reported below
                    err.append(e)

            threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            path = "zero-copy" if zero_copy else "staged"
            if errors:
                failures.append(f"{name} ({path}): {type(errors[0]).__name__}: {errors[0]}")
            elif not all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                         for r in range(2) for a, b in zip(dsts[r], want[r])):
                failures.append(f"{name} ({path}): wrong bytes")
            else:
                # rank 1 (not the handshake's root) packs its first staged send (a strided part, or any message on
                # the staged path) during the handshake on CPU only; on CUDA packing stays on the pack stream, after
                # the verdict
                early = reports[1].sends_packed_early
                want_early = int(device.type == "cpu" and (name.startswith("strided") or not zero_copy))
                if early != want_early:
                    failures.append(f"{name} ({path}): rank 1 packed {early} sends during the handshake, expected "
                                    f"{want_early} on {device.type}")
            msgs = [m for r in range(2) for c in p.for_rank(r).chunks for m in c.sends]
            print(f"paths: {name:<24} {path:<9} {'ok' if not failures else 'FAILED'} ({len(msgs)} messages, "
                  f"{sum(m.direct for m in msgs)} direct at the sender, {sum(len(m.parts) for m in msgs)} wire sends)")
    return failures


def _sleep_cycles_per_s(device: torch.device) -> float:
    if device.type != "cuda":
        return 0.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    torch.cuda.synchronize()
    return 20_000_000 / (start.elapsed_time(end) / 1e3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--mib", type=float, default=256.0, help="bytes each rank sends, MiB")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--min-speedup", type=float, default=1.25)
    ap.add_argument("--out", default="perf/out")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; use --device cpu for the plumbing")
        return 2
    failures = check_paths(device)
    for f in failures:
        print(f"WRONG: {f}")
    cols = 4096
    rows = max(2, int(args.mib * 2**20 / (cols * 2)) // 2 * 2) * 2  # each rank holds rows/2 rows of bf16
    shape = (rows, cols)
    per_rank = rows // 2 * cols * 2
    src = Layout(shape, Mesh([0, 1]), [Shard(0)], torch.bfloat16)
    dst = Layout(shape, Mesh([1, 0]), [Shard(0)], torch.bfloat16)  # every byte crosses to the other rank
    # one chunk's send + receive bytes fit half the budget: budget = 4 x (per-rank bytes / chunks)
    p = plan(src, dst, staging_bytes=4 * -(-per_rank // args.chunks), min_split_bytes=1 << 16)
    for r in range(2):
        p.for_rank(r)
    g = torch.Generator().manual_seed(0)
    full = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=g).view(torch.bfloat16)
    srcs = [full[: rows // 2].to(device), full[rows // 2:].to(device)]
    expected = [srcs[1].clone(), srcs[0].clone()]

    # Triton compiles a kernel on first use; warm up with the launches serialized, so the threads never compile
    lock = threading.Lock()
    from reshard.kernels import PreparedCopy

    real_run = PreparedCopy.run  # the executor packs and unpacks through prepared copies

    def locked(fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            with lock:
                return fn(*a, **k)
        return call

    cycles = _sleep_cycles_per_s(device)
    rows_out = []

    def measure(name: str, slots: int, delay: float) -> tuple[float, list[float]]:
        ex.NUM_SLOTS = slots
        hub = LoopbackHub(device, delay, cycles)
        groups = _groups(hub)
        times = []
        try:
            for i in range(args.repeat + 1):
                dsts = [torch.zeros_like(s) for s in srcs]
                times.append(_run_pair(p, groups, srcs, dsts))
                for r in range(2):
                    if not torch.equal(dsts[r].view(torch.int16), expected[r].view(torch.int16)):
                        raise AssertionError(f"{name}: rank {r} received wrong bytes")
        finally:
            ex.NUM_SLOTS = 2
        times = times[1:]
        med = statistics.median(times)
        rows_out.append({"case": name, "slots": slots, "link_s_per_chunk": delay * per_rank / args.chunks,
                         "median_s": med, "min_s": min(times), "max_s": max(times), "chunks": p.stats.num_chunks})
        print(f"{name:<28} slots={slots} median {med * 1e3:8.2f} ms  [{min(times) * 1e3:.2f}, "
              f"{max(times) * 1e3:.2f}]  ({p.stats.num_chunks} chunks, {per_rank / 2**20:.0f} MiB per rank)")
        return med, times

    PreparedCopy.run = locked(real_run)  # type: ignore[method-assign]
    try:
        measure("warm-up", 2, 0.0)
    finally:
        PreparedCopy.run = real_run  # type: ignore[method-assign]
    rows_out.clear()
    base, _ = measure("serial, no link delay", 1, 0.0)
    per_chunk = base / p.stats.num_chunks
    delay = per_chunk / (per_rank / p.stats.num_chunks)  # link time per chunk = the work per chunk
    serial, _ = measure("serial", 1, delay)
    piped, _ = measure("pipelined (2 slots)", 2, delay)
    speedup = serial / piped
    ok = speedup >= args.min_speedup and not failures
    print(f"pipelined is {speedup:.2f}x faster than serial (want >= {args.min_speedup}); link time per chunk "
          f"{per_chunk * 1e3:.2f} ms = the pack + copy + unpack work per chunk: {'ok' if ok else 'NO OVERLAP'}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    with open(out / "gpu_streams_check.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*rows_out[0], "device", "torch"])
        w.writeheader()
        for row in rows_out:
            w.writerow({**row, "device": name, "torch": torch.__version__})
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 2.6))
        labels = [r["case"] for r in rows_out]
        ax.barh(labels, [r["median_s"] * 1e3 for r in rows_out],
                xerr=[[(r["median_s"] - r["min_s"]) * 1e3 for r in rows_out],
                      [(r["max_s"] - r["median_s"]) * 1e3 for r in rows_out]], capsize=3,
                color=["tab:gray", "tab:orange", "tab:blue"])
        ax.invert_yaxis()
        ax.set_xlabel("ms for both ranks to finish")
        ax.set_title(f"{name}: {p.stats.num_chunks} chunks, {per_rank / 2**20:.0f} MiB per rank; "
                     f"pipelined {speedup:.2f}x", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "gpu_streams_check.png", dpi=110)
        plt.close(fig)
    except ImportError:
        print("matplotlib missing: no PNG")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
