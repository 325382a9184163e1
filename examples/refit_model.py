"""Quick start: refit a small model from trainer ranks to engine ranks, on this machine's CPU.

Run: `python examples/refit_model.py` (starts 4 gloo ranks with `reshard.testing.launch`).

Ranks 0-1 train a 2-layer MLP with tensor parallelism (`fc1` by rows, `fc2` by columns); ranks 2-3 serve it with
`fc1` replicated and `fc2` sharded by rows. Each side registers only its own tensors and layouts; `Refit.run()`
exchanges the layouts once, plans once, and moves the weights on every call. After a simulated optimizer step, the
second run moves the new values into the same engine tensors. The engine's tensors are checked against the model's
own parameters, cut by hand.
"""

import torch
from torch import nn

from reshard import Layout, Mesh, Refit, Replicate, Shard
from reshard.testing import launch

TRAINER, ENGINE = Mesh([0, 1]), Mesh([2, 3])


def model(step: int) -> nn.Module:
    """The trainer's model after optimizer step `step`, the same in every process (a stand-in for training)."""
    torch.manual_seed(step)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def layouts(params: dict[str, torch.Tensor]) -> tuple[dict[str, Layout], dict[str, Layout]]:
    """Each weight's layout on the trainer (TP2: fc1 rows, fc2 columns, biases of fc1 split) and on the engine."""
    train, engine = {}, {}
    for name, p in params.items():
        tp = {"0.weight": [Shard(0)], "0.bias": [Shard(0)], "2.weight": [Shard(1)], "2.bias": [Replicate()]}[name]
        serve = {"0.weight": [Replicate()], "0.bias": [Replicate()], "2.weight": [Shard(0)], "2.bias": [Replicate()]}
        train[name] = Layout(tuple(p.shape), TRAINER, tp, p.dtype, name=name)
        engine[name] = Layout(tuple(p.shape), ENGINE, serve[name], p.dtype, name=name)
    return train, engine


def shard(full: torch.Tensor, placement, index: int) -> torch.Tensor:
    """This rank's part of `full` under one mesh axis of 2 ranks (DTensor's `torch.chunk` rule)."""
    return full.chunk(2, dim=placement.dim)[index].clone() if isinstance(placement, Shard) else full.clone()


def check(rank: int, mine: dict[str, torch.Tensor], params: dict[str, torch.Tensor],
          engine: dict[str, Layout]) -> None:
    """On an engine rank, every local tensor equals the model's parameter cut by hand."""
    if rank in ENGINE.ranks:
        for name, local in mine.items():
            want = shard(params[name], engine[name].placements[0], rank - 2)
            assert torch.equal(local, want), f"rank {rank}: {name} differs from the trainer's model"


def refit_rank(w) -> dict:
    """One rank: register this side's tensors, refit twice around an optimizer step, check the engine's tensors."""
    rank = w.rank
    refit = Refit(w.group)
    params = {n: p.detach() for n, p in model(0).named_parameters()}
    train, engine = layouts(params)
    mine: dict[str, torch.Tensor] = {}
    for name, full in params.items():
        if rank in TRAINER.ranks:  # the trainer's own shard, updated in place by the "optimizer"
            mine[name] = shard(full, train[name].placements[0], rank)
            refit.add_source(name, mine[name], train[name])
        else:  # the engine's own parameter, written in place
            mine[name] = torch.zeros(engine[name].local_shape(rank))
            refit.add_destination(name, mine[name], engine[name])
    first = refit.run()
    check(rank, mine, params, engine)

    new = {n: p.detach() for n, p in model(1).named_parameters()}  # an optimizer step on the trainer, in place
    if rank in TRAINER.ranks:
        for name in mine:
            mine[name].copy_(shard(new[name], train[name].placements[0], rank))
    second = refit.run()
    check(rank, mine, new, engine)
    return {"first_run": (first.first_run, second.first_run), "network_bytes": first.network_bytes}


def main() -> None:
    out = launch(refit_rank, 4)
    assert all(o["first_run"] == (True, False) for o in out)  # the second run reused the plan
    print(f"refit_model verified: 4 weights, trainer ranks 0-1 -> engine ranks 2-3, "
          f"{out[0]['network_bytes']} bytes per refit, second run reused the plan")


if __name__ == "__main__":
    main()
