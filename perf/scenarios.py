"""Real multi-process reshards on this machine, timed against the baselines a user would pick instead.

For each `Scenario` (a weight's source and destination layouts), every rank runs, in one job:

- `reshard`: this library's executor (`execute`) over `Group.world()`;
- gather-and-broadcast, implemented honestly: the source ranks all-gather the full tensor
  (`dist.all_gather`), the lowest source rank broadcasts it to every destination rank (`dist.broadcast`), and each
  destination keeps its slice. Buffers are reserved once, outside the timing, as reshard's staging is;
- DTensor `redistribute`, when source and destination share one mesh.

Each method's result is checked bit for bit against DTensor's own `distribute_tensor(full, dst_mesh,
dst_placements).to_local()`. Used by `perf/bench_reshard.py`; `run_demo()` runs one scenario on ranks of this
machine (`reshard.testing.launch`).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import Placement, Replicate, Shard

from reshard import gather_broadcast_bytes
from reshard.planner import Layout, Mesh, Topology, dtype_name, format_bytes, plan
from reshard.testing import launch

logger = logging.getLogger(__name__)

QWEN3_32B_MLP = (25600, 5120)
"""`mlp.gate_proj.weight` of Qwen3-32B: intermediate size x hidden size."""


@dataclass(frozen=True)
class Scenario:
    """One weight's source and destination layouts over `world_size` ranks (nested rank lists as meshes)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    src_mesh: Any
    src_pl: tuple[Placement, ...]
    dst_mesh: Any
    dst_pl: tuple[Placement, ...]
    domain_size: int | None = None

    @property
    def same_mesh(self) -> bool:
        return torch.equal(torch.as_tensor(self.src_mesh), torch.as_tensor(self.dst_mesh))

    def layouts(self) -> tuple[Layout, Layout]:
        return (Layout(self.shape, Mesh(self.src_mesh), list(self.src_pl), self.dtype, name=self.name),
                Layout(self.shape, Mesh(self.dst_mesh), list(self.dst_pl), self.dtype, name=self.name))


def scenarios(world_size: int = 8, shape: tuple[int, int] = QWEN3_32B_MLP,
              dtype: torch.dtype = torch.bfloat16) -> dict[str, Scenario]:
    """The standard scenarios over `world_size` ranks (a multiple of 4), keyed by a short name.

    - `tp-to-tp2xdp` (the refit target): trainer TP on the first half of the ranks, `S(0)`, to inference TP2 x
      (half / 2) replicas on the other half, `[R, S(0)]`. With 8 ranks: TP4 -> TP2 x 2.
    - `fsdp-to-tp`: the first half, `S(0)` (FSDP-like), to the other half as TP, `S(1)` (all-to-all of halves).
    - `colocated`: TP x DP2 on every rank `[R, S(0)]` -> TP2 replicas on every rank `[R, S(1)]`.
    - `same-mesh-s0-s1`, `same-mesh-2d`: source and destination on one mesh, where DTensor `redistribute` applies.
    """
    if world_size < 4 or world_size % 4:
        raise ValueError(f"scenarios: world_size must be a multiple of 4 (>= 4), got {world_size}")
    half = world_size // 2
    first = torch.arange(half)
    second = torch.arange(half, world_size)
    every = torch.arange(world_size)
    R, S0, S1 = Replicate(), Shard(0), Shard(1)
    out = [
        Scenario(f"TP{half} -> TP2 x {half // 2} (disjoint)", shape, dtype, first.tolist(), (S0,),
                 second.reshape(half // 2, 2).tolist(), (R, S0)),
        Scenario(f"FSDP{half} S(0) -> TP{half} S(1) (disjoint)", shape, dtype, first.tolist(), (S0,), second.tolist(),
                 (S1,)),
        Scenario(f"TP{half} x DP2 -> TP2 x {half} (colocated)", shape, dtype, every.reshape(2, half).tolist(), (R, S0),
                 every.reshape(half, 2).tolist(), (R, S1)),
        Scenario(f"S(0) -> S(1) on {world_size} ranks (same mesh)", shape, dtype, every.tolist(), (S0,),
                 every.tolist(), (S1,)),
        Scenario(f"[S(0), S(1)] -> [S(1), S(0)] on 2x{half} (same mesh)", shape, dtype,
                 every.reshape(2, half).tolist(), (S0, S1), every.reshape(2, half).tolist(), (S1, S0)),
    ]
    return dict(zip(["tp-to-tp2xdp", "fsdp-to-tp", "colocated", "same-mesh-s0-s1", "same-mesh-2d"], out))


# -------------------------------------------------------------------------------------------------------------
# per rank
# -------------------------------------------------------------------------------------------------------------


def _full(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The same random bits on every rank."""
    g = torch.Generator().manual_seed(1234)
    numel = 1
    for s in shape:
        numel *= s
    return torch.randint(0, 256, (numel * dtype.itemsize,), generator=g, dtype=torch.uint8).view(dtype).reshape(shape)


def _local(full: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    out = torch.empty(layout.local_shape(rank), dtype=full.dtype, device=full.device)
    for p in layout.pieces(rank):
        out[p.local_box.slices()] = full[p.global_box.slices()]
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


class _GatherBroadcast:
    """Gather-and-broadcast for one layout pair: groups and buffers reserved once, `run()` timed."""

    def __init__(self, src: Layout, dst: Layout, rank: int, device: torch.device) -> None:
        import torch.distributed as dist

        self.src, self.dst, self.rank = src, dst, rank
        self.src_ranks = sorted(src.ranks)
        self.root = self.src_ranks[0]
        self.bcast_ranks = sorted({self.root, *dst.ranks})
        # new_group is collective over the world: every rank creates both groups
        self.src_group = dist.new_group(self.src_ranks)
        self.bcast_group = dist.new_group(self.bcast_ranks)
        self.full = None
        if rank in src.ranks or rank in dst.ranks:
            self.full = torch.empty(src.shape, dtype=src.dtype, device=device)
        self.slabs = self._slabs() if rank in src.ranks else None
        if rank in src.ranks and self.slabs is None:
            size = max(torch.Size(src.local_shape(r)).numel() for r in self.src_ranks)
            self.gathered = [torch.empty(size, dtype=src.dtype, device=device) for _ in self.src_ranks]

    def _slabs(self) -> list[torch.Tensor] | None:
        """Views of `full` that the source ranks' locals are, when each is one equal dim-0 slab (a plain TP
        `S(0)`): then all-gather writes straight into the full tensor."""
        views = []
        for r in self.src_ranks:
            pieces = self.src.pieces(r)
            if len(pieces) != 1:
                return None
            g = pieces[0].global_box
            if any(o != 0 or s != n for o, s, n in zip(g.offsets[1:], g.shape[1:], self.src.shape[1:])):
                return None
            views.append(self.full.narrow(0, g.offsets[0], g.shape[0]) if self.src.ndim else self.full)
        return views if len({v.shape for v in views}) == 1 else None

    def run(self, src_local: torch.Tensor | None, dst_local: torch.Tensor | None) -> None:
        import torch.distributed as dist

        rank = self.rank
        if rank in self.src.ranks:
            assert src_local is not None
            if self.slabs is not None:
                dist.all_gather(self.slabs, src_local.contiguous(), group=self.src_group)
            else:
                flat = torch.zeros_like(self.gathered[0])
                flat[: src_local.numel()] = src_local.reshape(-1)
                dist.all_gather(self.gathered, flat, group=self.src_group)
                for r, g in zip(self.src_ranks, self.gathered):
                    local = g[: torch.Size(self.src.local_shape(r)).numel()].view(self.src.local_shape(r))
                    for p in self.src.pieces(r):
                        self.full[p.global_box.slices()] = local[p.local_box.slices()]
        if rank in self.bcast_ranks:
            dist.broadcast(self.full, src=self.root, group=self.bcast_group)
        if rank in self.dst.ranks:
            assert dst_local is not None
            for p in self.dst.pieces(rank):
                dst_local[p.local_box.slices()] = self.full[p.global_box.slices()]


def _collective_bytes() -> Any:
    """A dispatch mode that counts the payload bytes this rank receives in DTensor's functional collectives, the way
    plans count theirs (each element that arrives from another rank, once)."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    class CollectiveBytes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.received = 0
            self.calls: dict[str, int] = {}

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if func.namespace == "_c10d_functional":
                name = func.overloadpacket.__name__
                if name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "all_reduce"):
                    self.calls[name] = self.calls.get(name, 0) + 1
                inp = args[0]
                if name == "all_gather_into_tensor":
                    self.received += inp.nbytes * (args[1] - 1)
                elif name == "reduce_scatter_tensor":
                    self.received += inp.nbytes * (args[2] - 1) // args[2]
                elif name == "all_to_all_single":
                    me = dist.distributed_c10d._resolve_process_group(args[3]).rank()
                    row = inp.nbytes // max(inp.shape[0], 1) if inp.ndim else inp.nbytes
                    self.received += (sum(args[1]) - args[1][me]) * row
                elif name == "all_reduce":
                    n = dist.distributed_c10d._resolve_process_group(args[2]).size()
                    self.received += 2 * inp.nbytes * (n - 1) // n
            return func(*args, **(kwargs or {}))

    return CollectiveBytes()


def _timed(fn: Any, warmup: int, repeat: int) -> list[float]:
    """Seconds per run, barrier to barrier on the world, after `warmup` untimed runs."""
    import torch.distributed as dist

    out = []
    for i in range(warmup + repeat):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        dist.barrier()
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def compare_job(w: Any, scenario_list: list[Scenario], *, warmup: int = 1, repeat: int = 3,
                staging_bytes: int = 64 << 20, methods: tuple[str, ...] = ("reshard", "gather-broadcast",
                                                                          "redistribute")) -> list[dict]:
    """One rank's part (`w`: its `reshard.testing.Worker`) of timing every scenario with every method; returns
    per-scenario rows (see `merge`)."""
    return [_compare_scenario(w.rank, w.world_size, sc, w.device, warmup, repeat, staging_bytes, methods)
            for sc in scenario_list]


def _compare_scenario(rank: int, world_size: int, sc: Scenario, device: torch.device, warmup: int, repeat: int,
                      staging_bytes: int, methods: tuple[str, ...]) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import distribute_tensor

    from reshard.comm import Group, execute

    group = Group.world()
    src, dst = sc.layouts()
    full = _full(sc.shape, sc.dtype)
    src_local = _local(full, src, rank).to(device) if rank in src.ranks else None
    dmesh = DeviceMesh("cpu", torch.as_tensor(sc.dst_mesh), _init_backend=False)
    expected = distribute_tensor(full, dmesh, list(sc.dst_pl), src_data_rank=None).to_local()
    dst_local = torch.zeros(dst.local_shape(rank), dtype=sc.dtype, device=device) if rank in dst.ranks else None
    row: dict[str, Any] = {"scenario": sc.name, "shape": sc.shape, "dtype": dtype_name(sc.dtype),
                           "world_size": world_size, "times": {}, "verified": {}, "bytes": {}, "notes": {},
                           "rank_bytes": {}}

    def check(out: torch.Tensor | None) -> bool:
        return out is None or torch.equal(_bits(out.cpu()), _bits(expected))

    if "reshard" in methods:
        p = plan(src, dst, Topology(domain_size=sc.domain_size), staging_bytes=staging_bytes)
        srcs = None if src_local is None else [src_local]
        dsts = None if dst_local is None else [dst_local]
        row["times"]["reshard"] = _timed(lambda: execute(p, rank, srcs, dsts, group), warmup, repeat)
        row["verified"]["reshard"] = check(dst_local)
        s = p.stats
        row["bytes"]["reshard"] = s.network_bytes + s.nvlink_bytes
        row["notes"]["reshard"] = f"{s.messages} messages, {s.num_chunks} chunks, local copies {s.local_bytes} B"
    if "gather-broadcast" in methods:
        gb = _GatherBroadcast(src, dst, rank, device)
        if dst_local is not None:
            dst_local.zero_()
        row["times"]["gather-broadcast"] = _timed(lambda: gb.run(src_local, dst_local), warmup, repeat)
        row["verified"]["gather-broadcast"] = check(dst_local)
        row["bytes"]["gather-broadcast"] = gather_broadcast_bytes(src, dst)["total"]
        row["notes"]["gather-broadcast"] = "all_gather on the source ranks + broadcast to the destinations"
    if "redistribute" in methods and sc.same_mesh:
        mesh = DeviceMesh(device.type, torch.as_tensor(sc.src_mesh))
        src_dt = distribute_tensor(full.to(device), mesh, list(sc.src_pl), src_data_rank=None)
        result: dict[str, Any] = {}

        def redistribute() -> None:
            result["out"] = src_dt.redistribute(mesh, list(sc.dst_pl)).to_local()

        row["times"]["redistribute"] = _timed(redistribute, warmup, repeat)
        row["verified"]["redistribute"] = check(result["out"])
        with _collective_bytes() as counter:
            redistribute()
        row["rank_bytes"]["redistribute"] = counter.received
        row["notes"]["redistribute"] = f"collectives {counter.calls}"
    return row


# -------------------------------------------------------------------------------------------------------------
# results
# -------------------------------------------------------------------------------------------------------------


@dataclass
class MethodResult:
    """One method on one scenario: bytes moved between ranks, seconds per run (slowest rank), verified."""

    method: str
    bytes: int | None
    seconds: list[float]
    verified: bool
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


@dataclass
class ScenarioResult:
    scenario: str
    shape: tuple[int, ...]
    dtype: str
    world_size: int
    methods: dict[str, MethodResult] = field(default_factory=dict)

    def speedup(self, baseline: str = "gather-broadcast") -> float | None:
        """Median time of `baseline` over reshard's."""
        if baseline not in self.methods or "reshard" not in self.methods:
            return None
        return self.methods[baseline].median / self.methods["reshard"].median


def merge(per_rank: list[list[dict]]) -> list[ScenarioResult]:
    """Per-rank rows -> one result per scenario: the slowest rank's time per run, verified on every rank."""
    out = []
    for i, row in enumerate(per_rank[0]):
        res = ScenarioResult(row["scenario"], tuple(row["shape"]), row["dtype"], row["world_size"])
        for m in row["times"]:
            seconds = [max(rows[i]["times"][m][k] for rows in per_rank) for k in range(len(row["times"][m]))]
            nbytes = sum(rows[i]["rank_bytes"][m] for rows in per_rank) if m in row["rank_bytes"] \
                else row["bytes"].get(m)
            res.methods[m] = MethodResult(m, nbytes, seconds,
                                          all(rows[i]["verified"][m] for rows in per_rank), row["notes"].get(m, ""))
        out.append(res)
    return out


def format_results(results: list[ScenarioResult]) -> str:
    """A readable table: per scenario and method, bytes, median time [min, max], verified, speedup."""
    lines = []
    for r in results:
        lines.append(f"{r.scenario}: {list(r.shape)} {r.dtype}, {r.world_size} ranks")
        for m in r.methods.values():
            b = format_bytes(m.bytes) if m.bytes is not None else "n/a"
            lines.append(f"  {m.method:<17} {b:>11}  median {m.median * 1e3:8.1f} ms  [{min(m.seconds) * 1e3:.1f}, "
                         f"{max(m.seconds) * 1e3:.1f}]  {'verified' if m.verified else 'WRONG'}  {m.note}")
        sp = r.speedup()
        if sp is not None:
            lines.append(f"  reshard is {sp:.2f}x faster than gather-and-broadcast")
        sp = r.speedup("redistribute")
        if sp is not None:
            lines.append(f"  reshard is {sp:.2f}x as fast as DTensor redistribute")
    return "\n".join(lines)


def run_demo(world_size: int = 8, *, shape: tuple[int, int] = (6400, 5120), dtype: torch.dtype = torch.bfloat16,
             scenario: str = "tp-to-tp2xdp", repeat: int = 3, warmup: int = 1, staging_bytes: int = 64 << 20,
             backend: str = "gloo") -> dict[str, Any]:
    """Spawn `world_size` gloo ranks on this machine, reshard one weight, verify it against DTensor, and time it
    against gather-and-broadcast (and DTensor `redistribute` on same-mesh scenarios).

    Args:
        world_size: ranks to spawn (a multiple of 4).
        shape: the weight's shape; the default is a Qwen3-32B MLP weight `(25600, 5120)` scaled down 4x in rows,
            so a run takes seconds on a laptop CPU.
        dtype: the weight's dtype.
        scenario: a key of `scenarios()`; the default is trainer TP on half the ranks -> inference TP2 replicas
            on the other half (TP4 -> TP2 x 2 with 8 ranks).
        repeat, warmup: timed and untimed runs per method.
        staging_bytes: reshard's staging budget per rank.
        backend: `"gloo"` (CPU tensors) or `"nccl"` (one GPU per rank).

    Returns:
        `{"results": [ScenarioResult], "text": table, "verified": bool, "speedup": gather-and-broadcast median /
        reshard median, "bytes": {method: bytes}, "seconds": {method: median seconds}}`.
    """
    all_scenarios = scenarios(world_size, shape, dtype)
    if scenario not in all_scenarios:
        raise ValueError(f"run_demo: unknown scenario {scenario!r}; expected one of {sorted(all_scenarios)}")
    per_rank = launch(compare_job, world_size, [all_scenarios[scenario]], warmup=warmup, repeat=repeat,
                      staging_bytes=staging_bytes, backend=backend)
    results = merge(per_rank)
    r = results[0]
    return {
        "results": results,
        "text": format_results(results),
        "verified": all(m.verified for m in r.methods.values()),
        "speedup": r.speedup(),
        "bytes": {k: m.bytes for k, m in r.methods.items()},
        "seconds": {k: m.median for k, m in r.methods.items()},
    }


if __name__ == "__main__":
    demo = run_demo(world_size=4, shape=(1600, 1280))
    print(demo["text"])


# -------------------------------------------------------------------------------------------------------------
# speed: reshard against the bare wire and a per-tensor exact-overlap transfer, interleaved rounds
# -------------------------------------------------------------------------------------------------------------

SPEED_METHODS = ("reshard", "wire", "exact_overlap")


@dataclass(frozen=True)
class SpeedCase:
    """Several tensors (same placements) moved together: `shapes` of one dtype from `src` to `dst` meshes."""

    key: str
    name: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    src_mesh: Any
    src_pl: tuple[Placement, ...]
    dst_mesh: Any
    dst_pl: tuple[Placement, ...]

    def layouts(self) -> list[tuple[Layout, Layout]]:
        return [(Layout(s, Mesh(self.src_mesh), list(self.src_pl), self.dtype, name=f"t{i}"),
                 Layout(s, Mesh(self.dst_mesh), list(self.dst_pl), self.dtype, name=f"t{i}"))
                for i, s in enumerate(self.shapes)]

    @property
    def nbytes(self) -> int:
        return sum(torch.Size(s).numel() for s in self.shapes) * self.dtype.itemsize


SMALL_MODEL_LAYER = ((1024, 1024), (512, 1024), (1024, 1024), (2816, 1024))
"""One layer of a small model (q, kv, o, fused MLP), ~10.25 MiB in bf16; 25 layers make 100 tensors, ~256 MiB."""


def speed_cases(world_size: int = 8, shape: tuple[int, int] = QWEN3_32B_MLP,
                dtype: torch.dtype = torch.bfloat16) -> dict[str, SpeedCase]:
    """The four speed cases over `world_size` ranks (8: TP4 / FSDP4 on ranks 0-3, destinations on ranks 4-7, or the
    colocated 2-D case on all 8):

    - `a`: one `shape` weight, TP{h} `S(0)` -> TP2 x {h/2} replicas `[R, S(0)]` (disjoint halves);
    - `b`: FSDP{h} `S(0)` -> TP{h} `S(1)` (disjoint halves);
    - `c`: `[DP2, TP2]` `[R, S(0)]` on the first half -> TP{h} `S(1)` on the second;
    - `d`: 100 tensors of a small model (`SMALL_MODEL_LAYER` x 25, ~256 MiB), as `a`.
    """
    if world_size < 8 or world_size % 4:
        raise ValueError(f"speed_cases: world_size must be a multiple of 4 and >= 8, got {world_size}")
    half = world_size // 2
    first, second = torch.arange(half), torch.arange(half, world_size)
    R, S0, S1 = Replicate(), Shard(0), Shard(1)
    model = tuple(s for _ in range(25) for s in SMALL_MODEL_LAYER)
    return {
        "a": SpeedCase("a", f"(a) TP{half} -> TP2 x {half // 2}", (shape,), dtype, first.tolist(), (S0,),
                       second.reshape(half // 2, 2).tolist(), (R, S0)),
        "b": SpeedCase("b", f"(b) FSDP{half} S(0) -> TP{half} S(1)", (shape,), dtype, first.tolist(), (S0,),
                       second.tolist(), (S1,)),
        "c": SpeedCase("c", f"(c) [DP2, TP{half // 2}] [R, S(0)] -> TP{half} S(1)", (shape,), dtype,
                       first.reshape(2, half // 2).tolist(), (R, S0), second.tolist(), (S1,)),
        "d": SpeedCase("d", f"(d) {len(model)} tensors TP{half} -> TP2 x {half // 2}", model, dtype, first.tolist(),
                       (S0,), second.reshape(half // 2, 2).tolist(), (R, S0)),
    }


def _one_piece(layout: Layout, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(global offsets, shape) of `rank`'s one piece of `layout` (None: holds nothing); the speed cases have one."""
    pieces = layout.pieces(rank)
    if not pieces:
        return None
    if len(pieces) != 1:
        raise ValueError(f"exact_overlap: rank {rank} holds {len(pieces)} pieces of {layout!r}; expected one")
    g = pieces[0].global_box
    return tuple(g.offsets), tuple(g.shape)


def _intersect(a: tuple, b: tuple) -> tuple | None:
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a[0], a[1], b[0], b[1]))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def _slices(box: tuple, origin: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o - z, o - z + s) for o, s, z in zip(box[0], box[1], origin))


class _ExactOverlap:
    """Per-tensor exact-overlap transfer (no staging budget, no plan): for each tensor in turn, every destination
    replica group splits its box along dim 0 among its members; each member receives its part from the source
    ranks that hold it (one source replica each, spread over the replicas), contiguous source views sent directly,
    strided ones made contiguous, contiguous destination views received into directly, strided ones through a
    temporary; then the replica group completes its box with an all-gather straight into the destination tensors."""

    def __init__(self, pairs: list[tuple[Layout, Layout]], rank: int, world_size: int) -> None:
        import torch.distributed as dist

        self.rank = rank
        self.steps = []  # per tensor: (sends [(peer, src slices)], recvs [(peer, dst slices)], locals, gather)
        groups: dict[tuple[int, ...], Any] = {}
        for src, dst in pairs:
            sends, recvs, local = [], [], []
            gather = None
            holders: dict[tuple, list[int]] = {}
            for r in range(world_size):
                p = _one_piece(src, r)
                if p is not None:
                    holders.setdefault(p, []).append(r)
            replica_sets: dict[tuple, list[int]] = {}
            for r in range(world_size):
                p = _one_piece(dst, r)
                if p is not None:
                    replica_sets.setdefault(p, []).append(r)
            for box, members in replica_sets.items():
                n = len(members)
                rows = box[1][0]
                if n > 1 and rows % n:
                    raise ValueError(f"exact_overlap: {rows} rows do not split over {n} replicas")
                key = tuple(members)
                if n > 1 and key not in groups:
                    groups[key] = dist.new_group(list(key))  # collective: every rank creates every group
                for j, d in enumerate(members):
                    part = ((box[0][0] + j * rows // n, *box[0][1:]), (rows // n, *box[1][1:]))
                    for sbox, srcs in holders.items():
                        cut = _intersect(sbox, part)
                        if cut is None:
                            continue
                        s = d if d in srcs else srcs[d % len(srcs)]
                        if s == d == rank:
                            local.append((_slices(cut, sbox[0]), _slices(cut, box[0])))
                        elif s == rank:
                            sends.append((d, _slices(cut, sbox[0])))
                        elif d == rank:
                            recvs.append((s, _slices(cut, box[0])))
                    if d == rank and n > 1:
                        gather = (groups[key], n, j)
            self.steps.append((sends, recvs, local, gather))

    def run(self, srcs: list[torch.Tensor] | None, dsts: list[torch.Tensor] | None) -> None:
        import torch.distributed as dist

        for i, (sends, recvs, local, gather) in enumerate(self.steps):
            works, unstage = [], []
            for peer, sl in recvs:
                view = dsts[i][sl]
                if view.is_contiguous():
                    works.append(dist.irecv(view, peer, tag=i))
                else:
                    tmp = torch.empty(view.shape, dtype=view.dtype, device=view.device)
                    works.append(dist.irecv(tmp, peer, tag=i))
                    unstage.append((view, tmp))
            for peer, sl in sends:
                works.append(dist.isend(srcs[i][sl].contiguous(), peer, tag=i))  # a view when already contiguous
            for s_sl, d_sl in local:
                dsts[i][d_sl].copy_(srcs[i][s_sl])
            for w in works:
                w.wait()
            for view, tmp in unstage:
                view.copy_(tmp)
            if gather is not None:
                group, n, j = gather
                parts = list(dsts[i].chunk(n, 0))  # dim-0 parts of a contiguous tensor: contiguous views
                dist.all_gather(parts, parts[j].clone(), group=group)


def _wire_plan(prog: Any) -> tuple[dict[int, int], dict[int, int]]:
    """Per-peer bytes this rank sends and receives over all of the plan's chunks (reshard's own messages)."""
    sends: dict[int, int] = {}
    recvs: dict[int, int] = {}
    for c in prog.chunks:
        for m in c.sends:
            sends[m.peer] = sends.get(m.peer, 0) + m.nbytes
        for m in c.recvs:
            recvs[m.peer] = recvs.get(m.peer, 0) + m.nbytes
    return sends, recvs


def speed_job(w: Any, cases: list[SpeedCase], *, rounds: int = 5, warmup: int = 1, staging_bytes: int = 64 << 20,
              execute_options: dict | None = None) -> list[dict]:
    """One rank's part of timing reshard, `wire` and `exact_overlap` on every case, in interleaved rounds (the
    method order rotates each round); every result checked bit for bit against DTensor. Returns one row per case:
    per method the seconds per round, verified, and for reshard the report's breakdown per round."""
    return [_speed_case(w.rank, w.world_size, ci, case, rounds, warmup, staging_bytes, execute_options or {})
            for ci, case in enumerate(cases)]


def _speed_case(rank: int, world: int, ci: int, case: SpeedCase, rounds: int, warmup: int, staging_bytes: int,
                opts: dict) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import distribute_tensor

    from reshard.comm import Group, execute
    from reshard.planner import plan_many

    group = Group.world()
    pairs = case.layouts()
    fulls = [_full(s, case.dtype) if i == 0 else _full(s, case.dtype).roll(i, 0)
             for i, s in enumerate(case.shapes)]
    src_on = rank in pairs[0][0].ranks
    dst_on = rank in pairs[0][1].ranks
    srcs = [_local(f, s, rank) for f, (s, _) in zip(fulls, pairs)] if src_on else None
    dmesh = DeviceMesh("cpu", torch.as_tensor(case.dst_mesh), _init_backend=False)
    expected = [distribute_tensor(f, dmesh, list(case.dst_pl), src_data_rank=None).to_local() if dst_on
                else None for f in fulls]
    del fulls
    dsts = [torch.zeros(d.local_shape(rank), dtype=case.dtype) for _, d in pairs] if dst_on else None

    p = plan_many(pairs, staging_bytes=staging_bytes)
    prog = p.for_rank(rank)
    wsend, wrecv = _wire_plan(prog)
    send_bufs = [(peer, torch.randint(0, 255, (n,), dtype=torch.uint8)) for peer, n in sorted(wsend.items())]
    recv_bufs = [(peer, torch.empty(n, dtype=torch.uint8)) for peer, n in sorted(wrecv.items())]
    exact = _ExactOverlap(pairs, rank, world)
    reports: list[Any] = []

    def run_reshard() -> None:
        reports.append(execute(p, rank, srcs, dsts, group, **opts))

    def run_wire() -> None:
        works = [dist.irecv(b, peer, tag=1000 + ci) for peer, b in recv_bufs]
        works += [dist.isend(b, peer, tag=1000 + ci) for peer, b in send_bufs]
        for wk in works:
            wk.wait()

    def run_exact() -> None:
        exact.run(srcs, dsts)

    fns = {"reshard": run_reshard, "wire": run_wire, "exact_overlap": run_exact}
    times: dict[str, list[float]] = {m: [] for m in SPEED_METHODS}
    verified = {"reshard": True, "exact_overlap": True, "wire": True}

    def check() -> bool:
        return not dst_on or all(torch.equal(_bits(o), _bits(e)) for o, e in zip(dsts, expected))

    for k in range(warmup + rounds):
        order = SPEED_METHODS[k % 3:] + SPEED_METHODS[:k % 3]
        for m in order:
            if dsts is not None and m != "wire":
                for d in dsts:
                    d.zero_()
            dist.barrier()
            t0 = time.perf_counter()
            fns[m]()
            dist.barrier()
            dt = time.perf_counter() - t0
            if m != "wire":
                verified[m] = verified[m] and check()
            if k >= warmup:
                times[m].append(dt)
    breakdown = [{f: getattr(r, f) for f in ("seconds", "seconds_handshake", "seconds_pack", "seconds_wait",
                                             "seconds_unpack", "seconds_confirm")} for r in reports[warmup:]]
    return {"case": case.key, "name": case.name, "nbytes": case.nbytes, "tensors": len(case.shapes), "times": times,
            "verified": verified, "breakdown": breakdown, "wire_bytes": sum(wsend.values()),
            "messages": p.stats.messages, "chunks": p.stats.num_chunks,
            "wire_sends": sum(len(m.parts) for c in prog.chunks for m in c.sends)}


@dataclass
class SpeedResult:
    """One speed case over all ranks: per method the slowest rank's seconds per round; paired ratios per round."""

    case: str
    name: str
    nbytes: int
    tensors: int
    seconds: dict[str, list[float]]
    verified: dict[str, bool]
    breakdown: dict[str, float]
    note: str

    def ratio(self, other: str) -> float:
        """Median over rounds of reshard's time / `other`'s time in the same round."""
        return statistics.median(a / b for a, b in zip(self.seconds["reshard"], self.seconds[other]))


def merge_speed(per_rank: list[list[dict]]) -> list[SpeedResult]:
    """Per-rank rows -> per case: slowest rank per round. The breakdown is the median over rounds of the slowest
    rank's value of each part, part by part (max over ranks): pack, wait (wire), unpack, the handshake round (with
    checks and staging), and the rest (posting, local copies, the completion round, which on a fast rank includes
    waiting for the slowest one); `confirm` is the completion round on the rank with the longest data path
    (pack + wait + unpack), the last to reach it: the round's own cost."""
    out = []
    for i, row in enumerate(per_rank[0]):
        seconds = {m: [max(rows[i]["times"][m][k] for rows in per_rank) for k in range(len(row["times"][m]))]
                   for m in row["times"]}
        verified = {m: all(rows[i]["verified"][m] for rows in per_rank) for m in row["verified"]}
        parts: dict[str, list[float]] = {"pack": [], "wire": [], "unpack": [], "handshake": [], "confirm": [],
                                         "other": []}
        for k in range(len(row["breakdown"])):
            bs = [rows[i]["breakdown"][k] for rows in per_rank]
            parts["pack"].append(max(b["seconds_pack"] for b in bs))
            parts["wire"].append(max(b["seconds_wait"] for b in bs))
            parts["unpack"].append(max(b["seconds_unpack"] for b in bs))
            parts["handshake"].append(max(b["seconds_handshake"] for b in bs))
            parts["other"].append(max(b["seconds"] - b["seconds_pack"] - b["seconds_wait"] - b["seconds_unpack"]
                                      - b["seconds_handshake"] for b in bs))
            last = max(bs, key=lambda b: b["seconds_pack"] + b["seconds_wait"] + b["seconds_unpack"])
            parts["confirm"].append(last["seconds_confirm"])
        breakdown = {k: statistics.median(v) for k, v in parts.items() if v}
        note = (f"{row['messages']} messages (chunk, sender, receiver), {row['chunks']} chunks, "
                f"{row.get('wire_sends', '?')} wire sends and {row['wire_bytes']} B sent by rank 0")
        out.append(SpeedResult(row["case"], row["name"], row["nbytes"], row["tensors"], seconds, verified, breakdown,
                               note))
    return out


def format_speed(results: list[SpeedResult]) -> str:
    lines = [(f"{'case':<36} {'reshard':>9} {'wire':>9} {'exact':>9}  {'r/wire':>7} {'r/exact':>7}  "
              f"{'pack':>6} {'wait':>6} {'unpack':>6} {'hshake':>6} {'confirm':>7} {'other':>6}  verified")]
    for r in results:
        med = {m: statistics.median(v) * 1e3 for m, v in r.seconds.items()}
        b = {k: v * 1e3 for k, v in r.breakdown.items()}
        lines.append(f"{r.name:<36} {med['reshard']:8.1f}ms {med['wire']:8.1f}ms {med['exact_overlap']:8.1f}ms  "
                     f"{r.ratio('wire'):6.2f}x {r.ratio('exact_overlap'):6.2f}x  {b.get('pack', 0):6.1f} "
                     f"{b.get('wire', 0):6.1f} {b.get('unpack', 0):6.1f} {b.get('handshake', 0):6.1f} "
                     f"{b.get('confirm', 0):7.1f} {b.get('other', 0):6.1f}  "
                     f"{all(v for m, v in r.verified.items() if m != 'wire')}")
    lines.append("(ms; ratios: median over rounds of reshard / method in the same round; breakdown: reshard's "
                 "slowest rank per part, median; 'other' = posting, local copies, completion round with waiting; "
                 "'confirm' = the completion round on the last rank to reach it)")
    return "\n".join(lines)
