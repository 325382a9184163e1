"""Trust checks that need no rank pool: a closed group frees its store's port at once, verdicts are signed, control
limits per group."""

from __future__ import annotations

import pytest

from reshard.comm import CommError, Group
from reshard.testing import free_port


def test_close_releases_the_store_port_at_once(monkeypatch) -> None:
    monkeypatch.delenv("RESHARD_TOKEN", raising=False)
    port = free_port()
    first = Group.rendezvous("127.0.0.1", port, 0, 1, timeout=10.0, prefix="close-a", token="t")
    first.close()
    # `first` is still referenced here: the port must be free without waiting for garbage collection
    second = Group.rendezvous("127.0.0.1", port, 0, 1, timeout=10.0, prefix="close-b", token="t")
    try:
        assert second.store_port == port
    finally:
        second.close()
    with pytest.raises(CommError, match="was closed"):
        with first.exclusive("a call after close"):
            pass
