"""Errors and fault verdicts of the comm layer, below every other comm module (groups, wire, rendezvous)."""

from __future__ import annotations

import json
from typing import Any

FAULT_POLL_S = 0.1
"""How often a waiting rank checks whether another rank reported a fault."""

ABORT_KEY = "abort"
"""The store key (under the group's prefix) of the first fault verdict."""


class CommError(RuntimeError):
    """A peer failed, died or did not answer within the timeout, or received bytes failed verification."""


def parse_verdict(raw: bytes) -> dict[str, Any]:
    """A fault verdict read from the store: `{"failed": rank or None, "observer": rank, "message": str}`.

    Anything that does not parse is reported as an unreadable verdict (the store is written by processes that can
    reach it, so its content is data, never code).
    """
    try:
        v = json.loads(raw.decode("utf-8"))
        failed, observer, message = v["failed"], v["observer"], v["message"]
        if not (failed is None or type(failed) is int) or type(observer) is not int or not isinstance(message, str):
            raise ValueError("wrong field types")
        return {"failed": failed, "observer": observer, "message": message[:4000]}
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        return {"failed": None, "observer": -1, "message": f"an unreadable fault verdict ({len(raw)} bytes: {e})"}
