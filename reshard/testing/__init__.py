"""Test helpers shipped with reshard, for its own tests and for users' tests of code that reshards.

Ranks on this machine:
    RankPool: `world_size` processes, started once, that run `fn(worker, *args)` together; one `Outcome` per rank
        (value, or error type, message and traceback; a rank that died is named with its exit code or signal).
    shared_pool, close_shared_pools: one pool per size for a whole test session.
    launch: run `fn(worker, *args)` once on fresh ranks; the per-rank values.
    Worker: what `fn` gets on its rank (`rank`, `world_size`, `device`, `group`, `new_group`, `init_world`).
    Outcome, RankError: one rank's result; some ranks failed.
    free_port: a free TCP port on this machine.
    counted_group, ControlCounter: a group whose control backend counts what this rank posts on it (the
        all-rank control rounds of a run, from the messages themselves).

Devices:
    device_under_test, DEVICE_ENV: the test device, `RESHARD_TEST_DEVICE` (`cpu` by default, or `cuda`).

NCCL's rules on CPU (registered with `torch.distributed.Backend.register_backend` on import):
    NCCL_RULES: `"reshard_nccl_rules"`, a backend whose CPU ranks obey NCCL's contract where it differs from gloo's
        (lazy communicators, asynchronous completion, unchecked sizes, one rank per device, a dead peer a stall);
        pass it as `backend=` to `Group.rendezvous` or `RankPool`.
    NcclRulesGroup: that backend's process group; set_rules_device: this process's device id under it (what
        `torch.cuda.set_device` is to NCCL); rules_violations: the rule breaks it detected in this process.

verl (`import reshard.testing.verl` explicitly; needs verl and Ray): verl trainer and rollout workers on a local CPU
Ray cluster under verl's real `CheckpointEngineManager`, for testing and measuring a checkpoint-engine backend.

Ground truth from DTensor, in one process (a fake process group):
    dtensor_local: what `distribute_tensor(full, mesh, placements).to_local()` gives any rank.
    index_tensor: a tensor whose element `i` is `i`, to read ownership off a local tensor.
    use_fake_rank, close_fake_world: act as any rank of a fake default world, and tear it down.
"""

from reshard.testing._device import DEVICE_ENV, device_under_test
from reshard.testing._nccl_rules import BACKEND as NCCL_RULES
from reshard.testing._nccl_rules import NcclRulesGroup, register
from reshard.testing._nccl_rules import set_device as set_rules_device
from reshard.testing._nccl_rules import violations as rules_violations
from reshard.testing._oracle import close_fake_world, dtensor_local, index_tensor, use_fake_rank
from reshard.testing._pool import (
    Outcome,
    RankError,
    RankPool,
    Worker,
    close_shared_pools,
    describe_exit,
    free_port,
    launch,
    shared_pool,
)
from reshard.testing._rounds import ControlCounter, counted_group

register()

__all__ = [
    "DEVICE_ENV",
    "NCCL_RULES",
    "ControlCounter",
    "NcclRulesGroup",
    "Outcome",
    "RankError",
    "RankPool",
    "Worker",
    "close_fake_world",
    "close_shared_pools",
    "counted_group",
    "describe_exit",
    "device_under_test",
    "dtensor_local",
    "free_port",
    "index_tensor",
    "launch",
    "rules_violations",
    "set_rules_device",
    "shared_pool",
    "use_fake_rank",
]
