"""The engine side of any engine backend: the update state machine and the engine's model facts.

An engine backend (vLLM's weight-transfer engine today) receives updates through a small life cycle: init (join
the group, register destinations), start, update (in phases), finish. What may come next is engine-neutral and
lives here, one object per engine worker (`Updates`), checked on every call; so do the facts the served config
declares (`declare_engine_facts`). The group's ranks are `reshard.integrations.group_layout.GroupLayout`'s.

States (`Updates.state`):

    idle        nothing staged; the loader-format buffers hold the last committed update (or nothing yet)
    staging     a "stage" transfer runs in a background thread into the buffers the forward does not read
    staged      the stage's transfer ended (landed, or failed: its commit says which)
    committing  re-processing and the copy into the live tensors run (inside one `update_weights` call)
    failed      the last transfer or commit failed: the buffers hold an unknown mix, so the next update is full
                (delta state reset); the forward still reads `live_version` unless the commit itself failed

Transitions (`update_weights` phases; anything else is refused, naming the state and the valid next call, before
the stage or any buffer is touched):

    idle / failed     --"stage"--> staging        --"full"--> committing -> idle (or failed)
    staging / staged  --"commit" (same version)--> committing -> idle (or failed)
    staging / staged  --"commit" (other version)--> failed (the stage is waited for and dropped)
    any               --init_weight_transfer_engine / shutdown--> idle (a stage is dropped with a warning: its
                      bytes went to buffers of the old group's registration, so they are never committed)

Versions: `live_version` names what the forward reads (None: the checkpoint vLLM loaded; an update without a
version is named `"update-<n>"`, n counting this engine's updates; `"incomplete-<v>"` after a commit of `v` that
failed part way), `staged_version` what a stage holds (None when nothing is staged, also after it was dropped).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

from typing import Any

from reshard.integrations.model_config import model_facts
from reshard.refit import Refit, RefitReport

logger = logging.getLogger(__name__)

__all__ = ["STATES", "Refused", "Stage", "Updates", "declare_engine_facts", "stop"]

STATES = ("idle", "staging", "staged", "committing", "failed")
STOP_JOIN_S = 10.0  # how long a dropped stage's thread may take to end once its group is closed


class Refused(RuntimeError):
    """A call the state machine cannot honour; raised before anything is touched (the state is unchanged)."""


class Stage:
    """One update's transfer: run at once, or in a background thread (`background`) while the engine generates."""

    def __init__(self, refit: Refit, version: str, *, background: bool) -> None:
        self.refit, self.version = refit, version
        self.report: RefitReport | None = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        if background:
            self.thread = threading.Thread(target=self._run, name=f"reshard-stage-{version}", daemon=True)
            self.thread.start()
        else:
            self._run()

    def _run(self) -> None:
        try:
            self.report = self.refit.run()
        except BaseException as e:  # re-raised by wait(), on the commit
            self.error = e

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def wait(self) -> RefitReport:
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.report is not None
        return self.report


class Updates:
    """The update state of one engine worker (see the module docstring); the engine calls it on every call."""

    def __init__(self, who: str = "reshard engine backend") -> None:
        self.who = who  # the backend, as refusals name it ("reshard vLLM backend")
        self.live_version: str | None = None
        self.staged_version: str | None = None
        self._stage: Stage | None = None
        self._failed = False
        self._committing = False
        self._why_failed = ""  # why the state is failed (for messages)
        self._count = 0  # updates begun on this engine: names an update without a version

    @property
    def state(self) -> str:
        if self._committing:
            return "committing"
        if self._stage is not None:
            return "staging" if self._stage.running else "staged"
        return "failed" if self._failed else "idle"

    def describe(self) -> str:
        """The state, with the version staged if any (for messages)."""
        if self._stage is not None:
            return f"state {self.state!r}, version {self._stage.version!r} staged"
        return f"state {self.state!r}"

    # ---- transitions -----------------------------------------------------------------------------------------
    def begin(self, refit: Refit, version: str | None, phase: str) -> Stage | None:
        """Start a "stage" (returns None: the transfer runs in the background) or run a "full" transfer (returns
        its finished stage, to be committed with `commit`). Refused while a stage is in flight or landed."""
        if self._stage is not None:
            v = self._stage.version
            raise Refused(f"{self.who}: a {phase!r} update is refused in {self.describe()}: a stage must be "
                          f"committed before the next update. Next: start_weight_update(), then update_weights("
                          f"{{'update_info': {{'version': {v!r}, 'phase': 'commit'}}}}) (or init_weight_transfer_"
                          "engine again to drop it)")
        self._count += 1
        name = version if version is not None else f"update-{self._count}"
        stage = Stage(refit, name, background=phase == "stage")
        self._failed = False
        if phase == "stage":
            self._stage, self.staged_version = stage, name
            return None
        return stage

    def take(self, refit: Refit, version: str | None) -> Stage:
        """The stage a "commit" commits (it leaves the state machine: `commit` or `fail` follows)."""
        if self._stage is None:
            why = f"nothing is staged ({self._why_failed})" if self._failed else "nothing is staged"
            raise Refused(f"{self.who}: a 'commit' is refused in {self.describe()}: {why}. Next: "
                          "start_weight_update(), then update_weights with phase 'stage' (then 'commit') or "
                          "'full'")
        stage = self._stage
        if stage.refit is not refit:  # never re-process buffers another registration's transfer wrote
            self.drop("its group was replaced")
            raise Refused(f"{self.who}: the staged update belongs to a group that was replaced; it is "
                          "dropped. Next: start_weight_update(), then a 'stage' or 'full' update")
        self._stage, self.staged_version = None, None
        if version is not None and version != stage.version:
            stage_error = None
            try:
                stage.wait()
            except BaseException as e:  # noqa: BLE001 - the stage is dropped either way
                stage_error = e
            self.fail(f"the stage of version {stage.version!r} was dropped: a commit named {version!r}")
            raise RuntimeError(f"{self.who}: commit of version {version!r}, but version {stage.version!r} "
                               "is staged: it is dropped (the next update is full). Next: start_weight_update(), "
                               "then a 'stage' or 'full' update" + (f" (the stage had failed too: {stage_error})"
                                                                    if stage_error is not None else ""))
        return stage

    def commit(self, stage: Stage, apply: Callable[[], None]) -> RefitReport:
        """Wait for `stage`'s transfer, then run `apply` (re-processing, copies into the live tensors): the live
        version becomes the stage's. A transfer error leaves the live tensors untouched (state failed)."""
        try:
            report = stage.wait()
        except BaseException:
            self.fail(f"the transfer of version {stage.version!r} failed")
            raise
        self._committing = True
        t0 = time.perf_counter()
        try:
            apply()
        except BaseException:
            self.fail(f"the commit of version {stage.version!r} failed part way")
            self.live_version = f"incomplete-{stage.version}"
            raise
        finally:
            self._committing = False
        report.seconds["process"] = time.perf_counter() - t0
        self.live_version = stage.version
        return report

    def fail(self, why: str = "the last update failed") -> None:
        """A call failed after the state machine let it through (the buffers may be partly written)."""
        if not self._failed:  # the first reason stands (begin() clears it)
            self._failed, self._why_failed = True, why

    def drop(self, why: str) -> Stage | None:
        """Forget the stage in flight or landed (init again, shutdown), with a warning; returns it (its thread may
        still run: the caller closes its group, then `stop`s it)."""
        stage, self._stage, self.staged_version = self._stage, None, None
        if stage is not None:
            logger.warning("reshard: the staged update %r (%s) is dropped, never committed: %s", stage.version,
                           "transfer still running" if stage.running else "landed", why)
            self.fail(f"the stage of version {stage.version!r} was dropped: {why}")  # the next update is full
        return stage


def stop(stage: Stage | None, timeout: float = STOP_JOIN_S) -> bool:
    """Wait up to `timeout` s for a dropped stage's thread (its group is closed, so its waits end); True if it is
    gone."""
    if stage is None or stage.thread is None:
        return True
    stage.thread.join(timeout)
    if stage.thread.is_alive():
        frame = sys._current_frames().get(stage.thread.ident or -1)
        where = "".join(traceback.format_stack(frame)) if frame is not None else "(its stack is gone)\n"
        logger.error("reshard: the dropped stage %r's thread is still running after %.0f s, at:\n%s",
                     stage.version, timeout, where.rstrip())
        return False
    return True


def declare_engine_facts(refit: Refit, config: Any, who: str = "engine (the config it serves)") -> None:
    """Declare the facts of the Hugging Face config an engine serves (`model_facts`) on `refit`, for the first run
    to compare with the trainer's (`Refit.declare_facts`); nothing when `config` is None.

    Args:
        refit: the engine worker's `Refit`.
        config: the served model's Hugging Face config (a multimodal model's text config), object or dict.
        who: the side named when the facts disagree.
    """
    if config is not None:
        refit.declare_facts(model_facts(config), who=who)
