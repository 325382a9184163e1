"""Trust: no code from peers, a rendezvous that refuses strangers, one call at a time per group, faults that every
rank learns within 2 s.

Runs on its own pool of 4 ranks; the last test kills a rank (which breaks the pool).
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import threading
import time

import pytest
import torch
from comm_cases import as_bytes, dtensor_local, full_tensor
from torch.distributed.tensor import Shard

from reshard import Layout, Mesh, plan
from reshard.comm import CommError, Group

pytestmark = pytest.mark.distributed

WORLD = 4


RANK_POOL = {"world_size": WORLD}  # the `pool` fixture's ranks (tests/conftest.py)


def _all_raise(outs, error_type: str, *fragments: str, ranks=None) -> None:
    for o in outs if ranks is None else [outs[r] for r in ranks]:
        assert o.error_type == error_type, f"rank {o.rank}: {o.error}\n{o.trace}"
        for f in fragments:
            assert f in o.error, f"rank {o.rank}: {f!r} not in {o.error!r}"


# -------------------------------------------------------------------------------------------------------------
# No code from peers
# -------------------------------------------------------------------------------------------------------------


class _CreatesFile:
    """Unpickling this creates the file `path` (what a hostile peer could send to a receiver using pickle)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _armed_pickle(path: str) -> bytes:
    return pickle.dumps(_CreatesFile(path))


def test_the_pickle_payload_is_armed(tmp_path) -> None:
    """Negative control: unpickling the payload the hostile peer sends does create the file."""
    path = tmp_path / "created-by-unpickling"
    pickle.loads(_armed_pickle(str(path)))
    assert path.exists()


def on_rank_sends_pickle(w, path: str, tag: str) -> str:
    """Rank 1 sends a pickle payload instead of the wire format, in an all-gather and in a plan handshake."""
    import reshard.comm._handshake as hs

    group = w.new_group(tag, timeout=20)
    original = hs.encode
    if w.rank == 1:
        hs.encode = lambda kind, value: _armed_pickle(path)
    try:
        if tag.startswith("gather"):
            hs.all_gather_json(group, {"rank": w.rank}, timeout=datetime.timedelta(seconds=20), what="test gather")
        else:
            src = Layout((8, 4), Mesh(list(range(w.world_size))), [Shard(0)], torch.float32)
            p = plan(src, Layout((8, 4), Mesh(list(range(w.world_size))), [Shard(1)], torch.float32))
            bad = torch.zeros(3) if w.rank == 1 else torch.zeros(src.local_shape(w.rank))  # rank 1 has errors
            d = torch.zeros(p.items[0].dst.local_shape(w.rank))
            from reshard.comm import reshard

            reshard(bad, d, p, group, timeout=20)
    finally:
        hs.encode = original
        group.close()
    return "returned"


@pytest.mark.parametrize("tag", ["gather-pickle", "handshake-pickle"])
def test_a_pickle_payload_from_a_peer_runs_nothing_and_names_the_sender(pool, tmp_path, tag) -> None:
    path = tmp_path / f"{tag}-created"
    outs = pool.run(on_rank_sends_pickle, str(path), tag, timeout=120)
    assert not path.exists(), "a peer's payload was unpickled"
    _all_raise(outs, "CommError", "rank 1 sent a malformed")


def on_rank_sends_oversized(w) -> str:
    import reshard.comm._handshake as hs
    from reshard.comm._wire import MAX_MESSAGE_BYTES

    group = w.new_group("oversized", timeout=20)
    original = hs.encode
    if w.rank == 2:
        hs.encode = lambda kind, value: b" " * (MAX_MESSAGE_BYTES + 1)
    try:
        hs.all_gather_json(group, [w.rank], timeout=datetime.timedelta(seconds=20), what="test gather")
    finally:
        hs.encode = original
        group.close()
    return "returned"


def on_rank_sends_foreign_digest(w) -> str:
    """Rank 2 speaks another control-message version in the layout digest all-gather."""
    import reshard.comm._handshake as hs

    group = w.new_group("foreign-digest", timeout=20)
    original = hs._MAGIC
    if w.rank == 2:
        hs._MAGIC = original ^ 0xFF
    try:
        hs.all_gather_digest(group, "0" * 32, timeout=datetime.timedelta(seconds=20), what="test digest")
    finally:
        hs._MAGIC = original
        group.close()
    return "returned"


def test_a_digest_of_another_version_is_refused_naming_the_sender(pool) -> None:
    outs = pool.run(on_rank_sends_foreign_digest, timeout=120)
    # every rank raises; those that read rank 2's header first name it, rank 2 itself reports the group's verdict
    _all_raise(outs, "CommError")
    assert all("rank 2" in o.error for o in outs), [o.error for o in outs]


def test_an_oversized_message_is_refused_unread_naming_the_sender(pool) -> None:
    outs = pool.run(on_rank_sends_oversized, timeout=120)
    _all_raise(outs, "CommError", "rank 2 announced a test gather message of 67108865 bytes")


def test_wire_decoding_refuses_malformed_messages() -> None:
    from reshard.comm._wire import WIRE_VERSION, decode, encode

    assert decode(encode("k", {"a": (1, 2.5, None)}), 3, "k", "me") == {"a": [1, 2.5, None]}
    for data, fragment in [(b"\x80\x04junk", "not UTF-8 JSON"), (b"[1]", "expected an object"),
                           (b'{"v": 9, "kind": "k", "data": 1}', "speaks control-message version 9"),
                           (b'{"v": %d, "kind": "other", "data": 1}' % WIRE_VERSION, "'other' message where 'k'"),
                           (b'{"v": %d, "kind": "k", "data": NaN}' % WIRE_VERSION, "not UTF-8 JSON"),
                           (b"[" * 100_000 + b"]" * 100_000, "rank 3 sent a malformed")]:
        with pytest.raises(CommError, match="rank 3") as e:
            decode(data, 3, "k", "me")
        assert fragment in str(e.value)
    with pytest.raises(TypeError, match="bytes is not JSON-serialisable"):
        encode("k", {"a": b"raw"})
    with pytest.raises(TypeError, match="dict keys must be str"):
        encode("k", {1: 2})


# -------------------------------------------------------------------------------------------------------------
# One call at a time
# -------------------------------------------------------------------------------------------------------------


def on_rank_two_threads(w, different_plans: bool, calls: int, tag: str = "guarded") -> dict:
    """Two threads reshard on one group at once, `calls` times each; each thread's source has its own content."""
    from reshard.comm import reshard

    group = w.new_group(f"threads-{tag}-{different_plans}", timeout=20)
    mesh = Mesh(list(range(w.world_size)))
    results: dict[int, list[str]] = {0: [], 1: []}

    def worker(t: int) -> None:
        shape = (32, 16) if t == 0 or not different_plans else (48, 16)
        src, dst = Layout(shape, mesh, [Shard(0)], torch.float32), Layout(shape, mesh, [Shard(1)], torch.float32)
        p = plan(src, dst, staging_bytes=1024, min_split_bytes=64)
        full = full_tensor(shape, torch.float32, f"thread{t}")
        expected = dtensor_local(full, dst)
        for _ in range(calls):
            d = torch.zeros(dst.local_shape(w.rank))
            try:
                reshard(dtensor_local(full, src), d, p, group, timeout=20)
            except (CommError, ValueError) as e:
                results[t].append(f"{type(e).__name__}: {e}")
                continue
            results[t].append("ok" if torch.equal(as_bytes(d), as_bytes(expected)) else "WRONG BYTES")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    group.close()
    return results


@pytest.mark.parametrize("different_plans", [False, True])
def test_two_threads_on_one_group_never_cross_data(pool, different_plans) -> None:
    outs = pool.run(on_rank_two_threads, different_plans, 20, timeout=240)
    for o in outs:
        assert o.ok, f"rank {o.rank}: {o.error}\n{o.trace}"  # the process survived (no SIGABRT)
        for t, res in o.value.items():
            assert len(res) == 20, (o.rank, t, res)
            assert "WRONG BYTES" not in res, (o.rank, t, res)
            for r in res:
                assert r == "ok" or "second thread" in r or "different plans" in r, (o.rank, t, r)
    assert any(r != "ok" for o in outs for res in o.value.values() for r in res), "the threads never overlapped"


def on_rank_two_threads_unguarded(w, calls: int, attempt: int = 0) -> dict:
    """The same race with the group's one-call-at-a-time guard switched off, on the staged path (both threads pack
    into and unpack from the group's one staging, where the crossing shows most often). Each attempt rendezvous a
    group of its own."""
    import contextlib
    import os

    from reshard.comm._executor import ZERO_COPY_ENV

    original = Group.exclusive
    Group.exclusive = lambda self, what: contextlib.nullcontext()
    os.environ[ZERO_COPY_ENV] = "0"
    try:
        return on_rank_two_threads(w, False, calls, f"unguarded{attempt}")
    finally:
        Group.exclusive = original
        os.environ.pop(ZERO_COPY_ENV)


@pytest.mark.slow  # races threads until data crosses: ~20 s
def test_without_the_guard_the_race_crosses_data(pool) -> None:
    """Negative control: the race above really hands one thread's bytes to the other when nothing refuses it.
    A crossing can also garble a message header so that the group times out instead (seen once in a fresh-clone
    run: CommErrors, no wrong bytes), so the race gets up to three attempts to show wrong bytes."""
    for attempt in range(3):
        outs = pool.run(on_rank_two_threads_unguarded, 20, attempt, timeout=240)
        wrong = sum(r == "WRONG BYTES" for o in outs if o.ok for res in o.value.values() for r in res)
        if wrong:
            break
    assert wrong > 0, [o.value if o.ok else o.error for o in outs]


def test_exclusive_is_reentrant_and_refuses_a_second_thread() -> None:
    g = Group(rank=0, size=1, control=None, data={}, name="local", timeout=datetime.timedelta(seconds=1))
    entered, release, seen = threading.Event(), threading.Event(), []

    def hold() -> None:
        with g.exclusive("first call"), g.exclusive("nested call"):
            entered.set()
            release.wait(10)

    th = threading.Thread(target=hold)
    th.start()
    entered.wait(10)
    try:
        with g.exclusive("second call"):
            seen.append("entered")
    except CommError as e:
        seen.append(str(e))
    release.set()
    th.join(10)
    assert len(seen) == 1 and "second call was called from a second thread while first call runs" in seen[0]
    with pytest.raises(CommError, match="second thread"):  # the group stays aborted
        with g.exclusive("later call"):
            pass


# -------------------------------------------------------------------------------------------------------------
# Rendezvous
# -------------------------------------------------------------------------------------------------------------


def on_rank_rendezvous(w, tag: str, ranks: list, sizes: list, tokens: list, timeout: float) -> dict:
    """Worker i joins as rank `ranks[i]` of `sizes[i]` with `tokens[i]` (None: does not join); then one call."""
    if ranks[w.rank] is None:
        return {"joined": False}
    start = time.monotonic()
    group = Group.rendezvous(w.host, w.port, ranks[w.rank], sizes[w.rank], prefix=f"rv/{tag}", is_master=False,
                             timeout=timeout, token=tokens[w.rank])
    try:
        group.raise_if_aborted("first call")  # a duplicate that arrived after the group formed aborts it
        return {"joined": True, "seconds": time.monotonic() - start}
    finally:
        group.close()


def test_rendezvous_with_a_token_forms_the_group(pool) -> None:
    outs = pool.run(on_rank_rendezvous, "good", [0, 1, 2, 3], [4] * 4, ["s3cret"] * 4, 20.0, timeout=120)
    assert all(o.ok and o.value["joined"] for o in outs), [o.error for o in outs]


def test_a_wrong_token_is_refused_on_every_rank(pool) -> None:
    outs = pool.run(on_rank_rendezvous, "token", [0, 1, 2, 3], [4] * 4, ["s3cret", "s3cret", "guess", "s3cret"],
                    20.0, timeout=120)
    _all_raise(outs, "CommError", "not signed with this rank's job token")
    for o in outs:
        assert ("ranks [2]" in o.error) if o.rank != 2 else ("ranks [0, 1, 3]" in o.error), o.error
        assert o.seconds < 20.0, (o.rank, o.seconds)


def test_a_duplicate_rank_is_refused_on_every_rank(pool) -> None:
    outs = pool.run(on_rank_rendezvous, "dup", [0, 1, 2, 1], [3] * 4, [None] * 4, 20.0, timeout=120)
    _all_raise(outs, "CommError", "rank 1 was already claimed by another process")
    assert all(o.seconds < 20.0 for o in outs), "; ".join(f"worker {o.rank}: {o.seconds:.2f} s" for o in outs)


def test_a_wrong_world_size_is_refused_on_every_rank(pool) -> None:
    outs = pool.run(on_rank_rendezvous, "size", [0, 1, 2, None], [3, 3, 4, None], [None] * 4, 20.0, timeout=120)
    _all_raise(outs, "CommError", "rank 2 joined with world size 4", ranks=[0, 1, 2])
    assert all(o.seconds < 20.0 for o in outs[:3])


def test_a_missing_rank_raises_comm_error_within_the_timeout(pool) -> None:
    """The rogue case of a short timeout: 8 s, not the sum of torch's internal waits."""
    outs = pool.run(on_rank_rendezvous, "missing", [0, 1, 2, None], [4, 4, 4, None], [None] * 4, 8.0, timeout=120)
    _all_raise(outs, "CommError", "ranks [3] did not join within the timeout", ranks=[0, 1, 2])
    for o in outs[:3]:
        assert 7.5 < o.seconds < 8.0 + 4.0, (o.rank, o.seconds)


def test_no_store_raises_comm_error_within_the_timeout() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(CommError, match=f"cannot reach the store at 127.0.0.1:{port}"):
        Group.rendezvous("127.0.0.1", port, 1, 2, timeout=3.0, is_master=False)
    assert time.monotonic() - start < 3.0 + 4.0


def test_a_non_loopback_host_needs_a_token(monkeypatch) -> None:
    monkeypatch.delenv("RESHARD_TOKEN", raising=False)
    with pytest.raises(ValueError, match="needs a job token"):
        Group.rendezvous("10.255.255.1", 29500, 0, 2, timeout=1.0)
    with pytest.raises(TypeError, match="token must be str or bytes"):
        Group.rendezvous("127.0.0.1", 29500, 0, 2, timeout=1.0, token=1234)


def _listeners(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp*) listening on `port`."""
    out = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.rsplit(":", 1)
                if int(p, 16) == port and state == "0A":
                    out.add(addr)
    return out


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's socket table")
def test_the_store_listens_on_the_given_host_only(caplog, monkeypatch) -> None:
    import torch.distributed as dist

    monkeypatch.delenv("RESHARD_TOKEN", raising=False)
    plain = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)  # negative control: torch's own
    assert _listeners(plain.port) & {"00000000000000000000000000000000", "00000000"}, _listeners(plain.port)
    with caplog.at_level("WARNING"):
        g = Group.rendezvous("127.0.0.1", 0, 0, 1, timeout=10.0, prefix="bind-test", token=None)
    try:
        assert _listeners(g.store_port) == {"0100007F"}  # 127.0.0.1 only
        assert "unauthenticated" in caplog.text
    finally:
        g.close()
    g = Group.rendezvous("127.0.0.1", 0, 0, 1, timeout=10.0, prefix="token-test", token="not-in-the-store")
    try:
        claim = g._store.get("join/0")
        assert b"not-in-the-store" not in claim and b'"mac"' in claim
    finally:
        g.close()


# -------------------------------------------------------------------------------------------------------------
# Fault reports (kills rank 3: keep last; the pool is broken afterwards)
# -------------------------------------------------------------------------------------------------------------


def on_rank_closed_while_waiting(w, shut_first: bool) -> dict:
    """Rank 0 waits in a broadcast that rank 1 (its root) never joins; another thread of rank 0 closes the group (as
    an engine does when it drops a stage in flight): the wait ends with a `CommError` within seconds, not at the
    group's 60 s timeout. `shut_first`: the backends are shut down before the wait starts (the race in which a
    thread starts a collective while another closes the group: gloo then waits out the whole timeout)."""
    import reshard.comm._handshake as hs

    group = w.new_group(f"closed-while-waiting-{shut_first}", ranks=2, timeout=60) if w.rank < 2 else None
    if w.rank != 0:
        time.sleep(12.0)  # rank 1 (the root) never broadcasts, nor closes (its closing would end rank 0's wait)
        if group is not None:
            group.close()
        return {}
    out: dict = {}
    if shut_first:
        closer, group._closer = group._closer, None
        closer()  # what `close` does first: the wait below starts on shut-down backends, which `close` leaves be

    def wait() -> None:
        t0 = time.monotonic()
        try:
            hs.broadcast_bytes(group, None, root=1, size=8, timeout=datetime.timedelta(seconds=60), what="test wait")
            out["error"] = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            out["error"] = f"{type(e).__name__}: {e}"
        out["took"] = time.monotonic() - t0

    thread = threading.Thread(target=wait, name="reshard-stage-test")
    thread.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    group.close()
    out["close_s"] = time.monotonic() - t0
    thread.join(20.0)
    out["alive"], out["close_to_end"] = thread.is_alive(), time.monotonic() - t0
    try:
        hs.broadcast_bytes(group, None, root=1, size=8, timeout=datetime.timedelta(seconds=60), what="after close")
        out["after"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["after"] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.parametrize("shut_first", [False, True], ids=["waiting", "started-on-shut-backends"])
def test_closing_a_group_ends_another_threads_wait_on_it(pool, shut_first) -> None:
    out = pool.run_ok(on_rank_closed_while_waiting, shut_first, timeout=120)[0]
    assert not out["alive"], out
    assert out["close_to_end"] < 3.0, out  # not when rank 1 leaves (11 s), nor the group's 60 s timeout
    assert out["error"] is not None and out["error"].startswith("CommError") and "closed" in out["error"], out
    assert out["after"] is not None and "closed" in out["after"], out


def on_rank_killed_quietly(w, victim: int, timeout: float) -> dict:
    """Ranks 0 <-> 1 and 2 <-> 3 exchange in many chunks; `victim` (3) exits when posting its second chunk."""
    import reshard.comm._executor as ex
    from reshard.comm import reshard

    group = w.new_group("killed", timeout=timeout)
    src = Layout((128, 64), Mesh([0, 1, 2, 3]), [Shard(0)], torch.float32)
    dst = Layout((128, 64), Mesh([1, 0, 3, 2]), [Shard(0)], torch.float32)
    p = plan(src, dst, staging_bytes=2048, min_split_bytes=256)
    assert p.stats.num_chunks > 4
    full = full_tensor(src.shape, src.dtype, "killed")
    s, d = dtensor_local(full, src), torch.zeros(dst.local_shape(w.rank))
    original, calls = ex._post_tagged, []

    def dying_post(*args, **kw):  # on the zero-copy path (this plan's) as on the staged one
        calls.append(1)
        if len(calls) == 2:
            os._exit(17)
        return original(*args, **kw)

    if w.rank == victim:
        ex._post_tagged = dying_post
    try:
        reshard(s, d, p, group, timeout=timeout)
    except CommError as e:
        return {"error": str(e), "at": time.time()}
    finally:
        ex._post_tagged = original
    return {"error": None, "at": time.time()}


def test_a_killed_rank_is_reported_to_every_rank_within_2_s(pool) -> None:
    timeout = 30.0
    outs = pool.run(on_rank_killed_quietly, 3, timeout, timeout=120)
    assert outs[3].died and "exit code 17" in outs[3].error
    first = min(o.value["at"] for o in outs[:3])
    for o in outs[:3]:
        assert o.ok and o.value["error"] is not None, f"rank {o.rank}: {o.error} {o.value}"
        assert f"rank {o.rank} of" in o.value["error"]
        assert "rank 3 failed, seen by rank" in o.value["error"] or "rank 3 failed after" in o.value["error"], \
            o.value["error"]
        # ranks 0 and 1 never exchange data with rank 3: they learn from the verdict, not from their timeout
        assert o.value["at"] - first < 2.0, (o.rank, o.value["at"] - first, o.value["error"])
    assert "seen by rank" in outs[1].value["error"], outs[1].value["error"]
