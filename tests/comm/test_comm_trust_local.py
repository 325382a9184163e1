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


def test_the_control_allowance_follows_the_call() -> None:
    from reshard.comm._wire import (
        CONTROL_SLACK,
        MAX_CONTROL_TOTAL_BYTES,
        MAX_MESSAGE_BYTES,
        control_allowance,
        over_allowance,
    )

    assert control_allowance([3_000, 2_500, 20 << 20, 2_800]) == MAX_CONTROL_TOTAL_BYTES // 4  # the worked example
    big = 40 << 20  # honest ranks that all need a lot: the bound grows with them (to the message limit)
    assert control_allowance([big, big - 1, big, 5]) == MAX_MESSAGE_BYTES
    assert control_allowance([1 << 20] * 1024) == CONTROL_SLACK << 20  # not 64 MiB per rank at 1,024 ranks
    assert control_allowance([10, 0], own=1 << 20) == max(MAX_CONTROL_TOTAL_BYTES // 2, CONTROL_SLACK << 20)
    assert over_allowance({0: 10, 1: 20}, "k", "me") is None
    sender, message = over_allowance({0: 10, 1: 20 << 20, 2: 30, 3: 5}, "k", "me")
    assert sender == 1 and "rank 1 announced a k message of 20971520 bytes" in message


def test_verdicts_are_signed_and_forgeries_skipped() -> None:
    import json

    import torch.distributed as dist

    from reshard.comm._errors import VERDICT_CHAIN, Verdicts

    store = dist.HashStore()
    mine = Verdicts(store, b"job-token", "session-1")
    assert mine.find() is None
    store.set("abort", json.dumps({"failed": 1, "observer": 2, "message": "forged"}))  # the old unsigned form
    store.set("abort/1", json.dumps({"failed": 1, "observer": 2, "message": "forged", "mac": "0" * 64}))
    assert mine.find() is None  # both skipped: nobody failed
    assert mine.record(3, 0, "rank 3 died") == {"failed": 3, "observer": 0, "message": "rank 3 died"}
    other = Verdicts(store, b"job-token", "session-1")  # another rank of the group reads the real verdict
    assert other.find() == {"failed": 3, "observer": 0, "message": "rank 3 died"}
    assert other.record(1, 2, "later") == {"failed": 3, "observer": 0, "message": "rank 3 died"}  # first one wins
    # the same verdict under another token or session is not accepted
    assert Verdicts(store, b"other-token", "session-1").find() is None
    assert Verdicts(store, b"job-token", "session-2").find() is None
    # a store filled with forgeries is reported as a denial of service, not as some rank's failure
    flooded = dist.HashStore()
    for i in range(VERDICT_CHAIN):
        flooded.set("abort" if i == 0 else f"abort/{i}", b"junk")
    v = Verdicts(flooded, b"job-token", "s").find()
    assert v["failed"] is None and "not signed with the job token" in v["message"]


def test_next_ordinal_counts_users_per_group_and_kind(monkeypatch) -> None:
    # how a refit without a name is named in errors ("the 2nd Refit made on this group"): counted on the group,
    # through its public method, per kind, and never shared between two groups
    monkeypatch.delenv("RESHARD_TOKEN", raising=False)
    a = Group.rendezvous("127.0.0.1", 0, 0, 1, timeout=10.0, prefix="ordinal-a", token="t")
    b = Group.rendezvous("127.0.0.1", 0, 0, 1, timeout=10.0, prefix="ordinal-b", token="t")
    try:
        assert [a.next_ordinal("refit"), a.next_ordinal("refit"), a.next_ordinal("other")] == [1, 2, 1]
        assert b.next_ordinal("refit") == 1
    finally:
        a.close()
        b.close()
