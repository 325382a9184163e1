"""The frame of one `execute` call, shared by full and delta runs: who takes part, the group held, the
handshake, the run, the completion round, the timings.

`run_plan` is the skeleton; the caller brings the two steps that differ: `prepare` (check the local tensors, the
plan handshake, reserve staging: `reshard.comm._prepare.prepare_run` with the run's own reservations) and `run`
(move the bytes of this rank's program; return the receive-side errors, e.g. failed checksums or decodes).
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from reshard.comm._group import Group
from reshard.comm._handshake import agree
from reshard.comm._prepare import ExecutionReport, Staging, describe_plan
from reshard.planner import Plan, RankPlan

logger = logging.getLogger(__name__)

R = TypeVar("R", bound=ExecutionReport)


def run_plan(
    plan: Plan,
    rank: int,
    group: Group,
    report: R,
    *,
    timeout: datetime.timedelta,
    prepare: Callable[[RankPlan], Staging | None],
    run: Callable[[RankPlan, Staging], list[str]],
    confirm: bool,
    what: str,
    failure: str,
    error_type: type[Exception] = ValueError,
    confirmed: Callable[[float], None] | None = None,
    kind: str = "executed",
) -> R:
    """Run `rank`'s part of `plan` on `group` and fill `report`: the skeleton of `execute` (full and delta).

    A rank outside `plan.ranks` returns `report` at once. Otherwise, holding the group (one call at a time) and
    without autograd: `prepare(prog)` with this rank's program `prog` (None: this rank has no work after the
    handshake), then `errors = run(prog, staging)`; then, when `confirm` and the plan spans several ranks, the
    completion round (`agree` over `plan.ranks`, labelled `what`) so that all ranks return or all raise
    `error_type` with `failure` and every rank's errors; without the round, this rank's own errors raise
    `error_type` here.

    Args:
        plan, rank, group: as `execute`'s (`rank` is `group.rank`, checked by the caller).
        report: the report to fill (`seconds_handshake`, `staging_bytes`, `seconds_confirm`, `seconds`).
        timeout: for each wait of the completion round.
        prepare, run: the steps that differ between full and delta runs (see the module docstring).
        confirm: whether the completion round runs (on plans of several ranks).
        what, failure, error_type: the completion round's label, what its error says happened, its type.
        confirmed: called with the completion round's seconds, when it ran.
        kind: how the debug log names the run.

    Returns:
        `report`.

    Raises:
        ValueError: the plan spans ranks beyond the group. What `prepare` and `run` raise. `error_type` (on every
        rank with the round) when a rank's `run` returned errors. `CommError` when a peer fails or times out.
    """
    ranks = plan.ranks
    if rank not in ranks:
        return report
    if ranks[-1] >= group.size:
        raise ValueError(f"execute: the plan spans ranks up to {ranks[-1]} but {group} has {group.size} ranks")
    start = time.perf_counter()
    with group.exclusive("execute"), torch.no_grad():  # one call at a time per group (see Group)
        prog = plan.for_rank(rank)
        staging = prepare(prog)
        report.seconds_handshake = time.perf_counter() - start
        errors: list[str] = []
        if staging is not None:
            report.staging_bytes = staging.nbytes
            errors = run(prog, staging)
        if confirm and len(ranks) > 1:
            t_confirm = time.perf_counter()
            # every rank of the plan, even one without work, takes part, so all return or all raise together
            agree(group, ranks, plan.fingerprint, errors, lambda: describe_plan(plan), timeout=timeout,
                  what=what, error_type=error_type, failure=failure)
            report.seconds_confirm = time.perf_counter() - t_confirm
            if confirmed is not None:
                confirmed(report.seconds_confirm)
        elif errors:
            raise error_type(f"{failure}:\n  " + "\n  ".join(errors))
    report.seconds = time.perf_counter() - start
    logger.debug("rank %d: %s plan %s: %s", rank, kind, plan.fingerprint[:12], report)
    return report
