"""Jobs for `test_refit_live.py` (top-level functions, so they pickle): a registration changes between two runs.

Four ranks: ranks 0 and 1 train one weight `weight` of shape (8, 6), a DTensor `Shard(0)` over `[0, 1]` held as a
module's parameter; ranks 2 and 3 are the engine, holding it `Shard(1)` over `[2, 3]` (columns 0-2 on rank 2, 3-5
on rank 3). The expected engine values are cut from the full tensor by hand (`full(seed)[:, 3 * i: 3 * i + 3]`).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from reshard.comm import Group
from reshard.planner import Layout, Mesh
from reshard.refit import Refit

SHAPE = (8, 6)
TRAIN, ENGINE = (0, 1), (2, 3)


def full(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full weight for `seed`: distinct values, different for every seed."""
    return (torch.arange(48, dtype=torch.float64).reshape(SHAPE) * 1.25 + 1000.0 * seed).to(dtype)


def engine_slice(t: torch.Tensor, rank: int) -> torch.Tensor:
    """What engine rank `rank` holds of the full tensor `t` (columns, by hand)."""
    i = ENGINE.index(rank)
    return t[:, 3 * i: 3 * i + 3]


def dtensor(seed: int, dtype: torch.dtype = torch.float32):
    mesh = DeviceMesh("cpu", torch.tensor(TRAIN), _init_backend=False)
    return distribute_tensor(full(seed, dtype), mesh, [Shard(0)], src_data_rank=None)


class Model(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(dtensor(seed))


def _trainer_layout() -> Layout:
    return Layout(SHAPE, Mesh(list(TRAIN)), [Shard(0)], torch.float32, name="weight")


def _engine_layout(dtype: torch.dtype = torch.float32) -> Layout:
    return Layout(SHAPE, Mesh(list(ENGINE)), [Shard(1)], dtype, name="weight")


def job_live(worker, case: str) -> dict:
    """Run 1 with seed 1, change one registration as `case` says, run 2 (new values: seed 2).

    Returns, on engine ranks, the destination after each run (`runs`), and for `dest*` cases the old buffer after
    run 2 (`old`); `error` is the message of a `ValueError` raised by run 2 (None if it ran).
    """
    refit = Refit(Group.world(), timeout=60)
    rank = worker.rank
    model = None
    out: dict = {"runs": [], "error": None}
    engine_param = None
    if rank in TRAIN:
        model = Model(1)
        if case.startswith("assign"):
            refit.add_module_sources(model)
        elif case.startswith("plain"):  # this rank's piece, a plain tensor with its global layout
            refit.add_source("weight", model.weight.to_local().detach().clone(), _trainer_layout())
        else:
            refit.add_source("weight", model.weight)
    else:
        # an engine parameter, flat, registered as a view in the engine's shape (as `EngineTensor.register` does)
        engine_param = torch.nn.Parameter(torch.zeros(SHAPE[0] * 3), requires_grad=False)
        refit.add_destination("weight", engine_param.view(SHAPE[0], 3), _engine_layout())

    def dest() -> torch.Tensor:
        return engine_param.detach().view(SHAPE[0], 3).clone()

    refit.run()
    if engine_param is not None:
        out["runs"].append(dest())
    old = None
    if model is not None:
        if case == "to64":
            model.to(torch.float64)
            assert model.weight.to_local().dtype == torch.float64
        elif case == "local":  # a re-materialised local tensor of the same layout
            model.weight._local_tensor = dtensor(2).to_local().clone()
        elif case == "assign":
            before = model.weight
            model.load_state_dict({"weight": dtensor(2)}, assign=True)
            assert model.weight is not before
        elif case == "assign_dtype":
            model.load_state_dict({"weight": dtensor(2, torch.float64)}, assign=True)
        elif case == "update":  # Refit.update_source: a new DTensor object of the same layout (a stream's export)
            refit.update_source("weight", dtensor(2))
        elif case == "update_replicated":  # a new DTensor of another layout: refused on every rank
            mesh = DeviceMesh("cpu", torch.tensor(TRAIN), _init_backend=False)
            refit.update_source("weight", distribute_tensor(full(2), mesh, [Replicate()], src_data_rank=None))
        elif case in ("update_replicated_retry", "plain_update_dtype_retry") and rank == 1:  # one rank only
            bad = dtensor(2, torch.float64)
            refit.update_source("weight", bad if case.startswith("update") else bad.to_local())
        elif case == "plain_update_dtensor":  # a DTensor whose global shape is this rank's piece's
            mesh = DeviceMesh("cpu", torch.tensor(TRAIN), _init_backend=False)
            piece = dtensor(2).to_local().clone()
            refit.update_source("weight", distribute_tensor(piece, mesh, [Replicate()], src_data_rank=None))
        elif case == "update_unknown" and rank == 1:  # a name never registered, on one rank only
            refit.update_source("bias", dtensor(2))
        elif case == "refuse" and rank == 1:  # an integration's check after the first run, on one rank only
            refit.refuse("the stream changed on this rank")
        else:
            with torch.no_grad():
                model.weight.to_local().copy_(dtensor(2).to_local())  # in place: the values of seed 2
    if engine_param is not None and case.startswith("dest"):
        old = engine_param.data
        dtype = torch.float64 if case == "dest_dtype" else torch.float32
        engine_param.data = torch.full((SHAPE[0] * 3,), -1.0, dtype=dtype)  # the engine re-allocates its weight
    try:
        refit.run()
    except ValueError as e:
        out["error"] = str(e)
    if case.endswith("_retry"):  # the same run again, nothing rebound: refused again, or it runs
        out["retry_error"] = None
        try:
            refit.run()
        except ValueError as e:
            out["retry_error"] = str(e)
        if engine_param is not None:
            out["runs"].append(engine_param.detach().view(SHAPE[0], 3).clone())
    if engine_param is not None:
        out["runs"].append(engine_param.detach().view(SHAPE[0], 3).clone())
        if old is not None:
            out["old"] = old.view(SHAPE[0], 3).clone()
    return out


def job_rounds(worker, runs: int, *, idle: bool = False, separate: bool = False, fault: str = "") -> dict:
    """Run 1, then `runs` steady runs (the trainer's values updated in place to seed 2, 3, ...) on a group whose
    control messages are counted (`reshard.testing.counted_group`).

    `idle`: rank 2 alone is the engine (the whole weight), rank 3 holds nothing and is outside the plan.
    `separate`: the older steady run (`Refit._separate_handshake`: the live check, then the plan handshake).
    `fault`: on the last run, `"shape"` gives rank 1 a source of another shape (the live check refuses it),
    `"alias"` makes rank 2's destination share memory with a second destination of its own (the executor's check,
    which only the plan handshake made before, refuses it).

    Returns per run the rounds this rank saw (`rounds`), the collectives (`collectives`), on engine ranks the
    destination after each run (`runs`), and the `ValueError` of the last run (`error`, None if it ran).
    """
    from reshard.testing import counted_group

    group, counter = counted_group(Group.world())
    refit = Refit(group, timeout=60)
    refit._separate_handshake = separate
    rank = worker.rank
    model, engine, other = None, None, None
    if rank in TRAIN:
        model = Model(1)
        refit.add_source("weight", model.weight)
    elif rank == 2 or not idle:
        cols = SHAPE[1] if idle else 3
        engine = torch.zeros(SHAPE[0], cols)
        layout = (Layout(SHAPE, Mesh([2]), [Replicate()], torch.float32, name="weight") if idle
                  else _engine_layout())
        refit.add_destination("weight", engine, layout)
        if fault == "alias" and rank == 2:  # a second weight of this rank, a (4,) tensor trained on rank 0
            other = torch.zeros(4)
            refit.add_destination("bias", other, Layout((4,), Mesh([2]), [Replicate()], torch.float32))
    if rank == 0 and fault == "alias":
        refit.add_source("bias", torch.arange(4.0), Layout((4,), Mesh([0]), [Replicate()], torch.float32))
    out: dict = {"rounds": [], "collectives": [], "runs": [], "error": None}
    refit.run()
    for i in range(runs):
        last = i == runs - 1
        if model is not None:
            with torch.no_grad():
                model.weight.to_local().copy_(dtensor(2 + i).to_local())
            if last and fault == "shape" and rank == 1:
                model.weight._local_tensor = torch.zeros(SHAPE[0] // 2 + 1, SHAPE[1])
        if last and fault == "alias" and rank == 2:  # the bias now lands in the weight's first 4 elements
            refit._dests["bias"] = (engine.view(-1)[:4], refit._dests["bias"][1])
        counter.clear()
        try:
            refit.run()
        except ValueError as e:
            out["error"] = str(e)
        out["rounds"].append(counter.rounds())
        out["collectives"].append(list(counter.collectives))
        if engine is not None:
            out["runs"].append(engine.clone())
    return out
