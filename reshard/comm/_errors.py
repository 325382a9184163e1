"""Errors and fault verdicts of the comm layer, below every other comm module (groups, wire, rendezvous)."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

FAULT_POLL_S = 0.1
"""How often a waiting rank checks whether another rank reported a fault."""

ABORT_KEY = "abort"
"""The store key (under the group's prefix) of the first fault verdict."""


class CommError(RuntimeError):
    """A peer failed, died or did not answer within the timeout, or received bytes failed verification."""


VERDICT_CHAIN = 8
"""How many verdict slots (`abort`, `abort/1`, ...) a rank walks past forged ones before it gives up (then the
store is being written by a process without the token: a denial of service, reported as such)."""

JOIN_SESSION = "join"
"""The session verdicts of the rendezvous itself are signed with (the group's session is not known yet)."""

_MAX_MESSAGE = 4000


def _slot(i: int) -> str:
    return ABORT_KEY if i == 0 else f"{ABORT_KEY}/{i}"


def _mac(token: bytes, session: str, failed: int | None, observer: int, message: str) -> str:
    return hmac.new(token, f"verdict|{session}|{failed}|{observer}|{message}".encode(), hashlib.sha256).hexdigest()


def parse_verdict(raw: bytes, token: bytes = b"", sessions: tuple[str, ...] = (JOIN_SESSION,)) -> dict[str, Any] | None:
    """A fault verdict read from the store, `{"failed": rank or None, "observer": rank, "message": str}`, or None
    when it is not one: unreadable, or not signed with `token` for one of `sessions` (a forgery: the store is
    written by processes that can reach it, so its content is data, never code, and never trusted unsigned)."""
    try:
        v = json.loads(bytes(raw).decode("utf-8"))
        failed, observer, message, mac = v["failed"], v["observer"], v["message"], v["mac"]
        if not (failed is None or type(failed) is int) or type(observer) is not int or not isinstance(message, str) \
                or not isinstance(mac, str) or len(message) > _MAX_MESSAGE:
            return None
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        return None
    if not any(hmac.compare_digest(mac, _mac(token, s, failed, observer, message)) for s in sessions):
        return None
    return {"failed": failed, "observer": observer, "message": message}


class Verdicts:
    """A group's fault verdicts in its store: signed with the job token, the first valid one wins.

    Slot `abort` holds the first verdict; a slot that holds something not signed with the token (a forgery by a
    process that can write to the store) is skipped, logged, and the next slot (`abort/1`, ...) takes its place, so
    a forged key can neither make a rank raise nor keep the real verdict out. Every store call may raise (a store
    host that is gone): the caller decides what that means.

    Args:
        store: the group's (prefixed) store.
        token: the job token (empty for an unauthenticated loopback group: its verdicts are then unauthenticated).
        session: what this group's verdicts are signed for (verdicts of the rendezvous use `JOIN_SESSION`, and
            are accepted too).
    """

    def __init__(self, store: Any, token: bytes, session: str) -> None:
        self.store, self.token, self.session = store, token, session
        self.sessions = (session, JOIN_SESSION) if session != JOIN_SESSION else (JOIN_SESSION,)
        self.skipped = 0  # slots known to hold forgeries

    def _forged(self, raw: bytes) -> None:
        logger.warning("fault verdict slot %r of the store holds %d bytes not signed with the job token (a forgery, "
                       "or another job on the same prefix); ignored", _slot(self.skipped), len(raw))
        self.skipped += 1

    def _exhausted(self) -> dict[str, Any]:
        return {"failed": None, "observer": -1, "message": f"the group's store holds {VERDICT_CHAIN} fault verdicts "
                "not signed with the job token: a process without the token is writing to it (denial of service)"}

    def record(self, failed: int | None, observer: int, message: str) -> dict[str, Any]:
        """Write this rank's verdict unless a valid one is there; returns the group's verdict."""
        message = message[:_MAX_MESSAGE]
        mine = {"failed": failed, "observer": observer, "message": message}
        raw = json.dumps({**mine, "mac": _mac(self.token, self.session, failed, observer, message)}).encode()
        while self.skipped < VERDICT_CHAIN:
            current = self.store.compare_set(_slot(self.skipped), "", raw)
            if bytes(current) == raw:
                return mine
            theirs = parse_verdict(current, self.token, self.sessions)
            if theirs is not None:
                return theirs
            self._forged(current)
        return self._exhausted()

    def find(self) -> dict[str, Any] | None:
        """The group's verdict, or None when no rank has recorded one (forgeries skipped)."""
        while self.skipped < VERDICT_CHAIN:
            key = _slot(self.skipped)
            if not self.store.check([key]):
                return None
            raw = self.store.get(key)
            v = parse_verdict(raw, self.token, self.sessions)
            if v is not None:
                return v
            self._forged(raw)
        return self._exhausted()
