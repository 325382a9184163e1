"""Joining a `Group.rendezvous`: a store bound to the given host, claims signed with the job token, membership
proven over the new connections.

Protocol (every key under the group's prefix):

1. each joiner claims its rank with `compare_set("join/<rank>", "", claim)`: a wire message with its rank, world
   size, a fresh random nonce, whether it hosts the store, and `HMAC-SHA256(token, "claim|rank|world_size|nonce|
   store")`. A rank already claimed is a duplicate and is refused. The token itself never enters the store.
2. each joiner waits (polling, within the deadline) until ranks `0 .. world_size-1` have claimed, then checks
   every claim: right rank, same world size, a MAC that verifies with its own token. Any failure is a `CommError`
   naming the rank, and a fault verdict (signed with the token, see `reshard.comm._errors.Verdicts`) under
   `abort` tells the ranks still waiting.
3. after the gloo backend connected, the ranks all-gather `HMAC(token, "member|session|rank")`, where `session`
   hashes every claim's nonce: a process that took over a rank's connection without the token is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from reshard.comm._errors import JOIN_SESSION, CommError, Verdicts
from reshard.comm._wire import decode, encode

logger = logging.getLogger(__name__)

TOKEN_ENV = "RESHARD_TOKEN"
"""Environment variable read when `Group.rendezvous` gets no `token=`."""

_POLL_S = 0.05
_MAC_BYTES = 32


def resolve_token(token: str | bytes | None, host: str, *, warn: bool = True) -> bytes:
    """The job token as bytes (argument, else `RESHARD_TOKEN`); empty only for a loopback host, which logs a
    warning if `warn` (group rank 0 only: once per group, not once per process).

    Raises:
        ValueError: no token for a host that is not a loopback address; a token of the wrong type.
    """
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    if token is not None and not isinstance(token, (str, bytes)):
        raise TypeError(f"Group.rendezvous: token must be str or bytes, got {type(token).__name__}")
    if token:
        return token.encode() if isinstance(token, str) else bytes(token)
    if not is_loopback(host):
        raise ValueError(f"Group.rendezvous: host {host!r} is not a loopback address, so the group needs a job token: "
                         f"pass token=... or set {TOKEN_ENV} (the same secret on every rank)")
    if warn:
        logger.warning("Group.rendezvous at %s: no token (%s unset); the group is unauthenticated: any local "
                       "process that reaches the store can join", host, TOKEN_ENV)
    return b""


def is_loopback(host: str) -> bool:
    """Whether every address `host` resolves to is a loopback address (127.0.0.0/8, ::1)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    addrs = {info[4][0] for info in infos}
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket bound to `host` (not to every interface) for the store to serve on.

    Raises:
        CommError: the address cannot be bound (in use, not an address of this machine).
    """
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(1024)
    except OSError as e:
        raise CommError(f"Group.rendezvous: cannot listen on {host}:{port}: {e}") from e
    return sock


def serve_store(host: str, port: int, timeout: float) -> Any:
    """A `torch.distributed.TCPStore` served on `host:port` only (not on every interface), for `Group.rendezvous`
    calls with `is_master=False` to meet on, possibly one group after another under distinct prefixes; it lives as
    long as the returned object. `port` 0 picks a free port (the store's `.port`).

    Raises:
        CommError: the address cannot be bound.
    """
    import datetime

    import torch.distributed as dist

    sock = listen(host, port)
    return dist.TCPStore(host, sock.getsockname()[1], None, True, timeout=datetime.timedelta(seconds=timeout),
                         wait_for_workers=False, master_listen_fd=sock.detach())


def wait_for_listener(host: str, port: int, deadline: float, label: str) -> None:
    """Wait until something accepts TCP connections on `host:port`, polling until `deadline`.

    torch's store client retries with its own back-off and can overshoot a short timeout several times over, so
    the store is only built once its address answers.

    Raises:
        CommError: nothing listened there before `deadline`.
    """
    last: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CommError(f"{label}: cannot reach the store at {host}:{port} within the timeout: nothing accepted "
                            f"a connection ({last})")
        try:
            with socket.create_connection((host, port), timeout=min(max(left, 0.01), 1.0)):
                return
        except OSError as e:
            last = e
            time.sleep(min(_POLL_S * 2, max(deadline - time.monotonic(), 0)))


def _mac(token: bytes, *parts: object) -> str:
    return hmac.new(token, "|".join(map(str, parts)).encode(), hashlib.sha256).hexdigest()


def _fail(verdicts: Verdicts, rank: int, failed: int | None, message: str) -> CommError:
    """Record `message` as the group's fault verdict (signed; first valid one wins) and return the error to raise."""
    try:
        verdicts.record(failed, rank, message)
    except Exception:  # noqa: BLE001 - the store may be gone; the error is raised here anyway
        logger.debug("rendezvous: cannot record the verdict", exc_info=True)
    return CommError(message)


def _check_abort(verdicts: Verdicts, rank: int, label: str) -> None:
    v = verdicts.find()
    if v is not None:
        who = "a rank" if v["failed"] is None else f"rank {v['failed']}"
        raise CommError(f"rank {rank}: {label} refused: {who} failed, seen by rank {v['observer']}: {v['message']}")


def join(store: Any, rank: int, world_size: int, token: bytes, deadline: float, label: str, *,
         hosts_store: bool = False) -> tuple[str, int | None]:
    """Steps 1-2 of the protocol; returns the session string every member computes alike, and the rank that hosts
    the store (from the signed claims; None when the store is hosted outside the group).

    Raises:
        CommError: a duplicate rank, a rank with another world size or token, a malformed claim, a fault verdict
            of another rank, or ranks that did not join before `deadline` (`time.monotonic()`).
    """
    me = f"rank {rank} of {label}"
    verdicts = Verdicts(store, token, JOIN_SESSION)
    nonce = os.urandom(16).hex()
    claim = encode("claim", {"rank": rank, "world_size": world_size, "nonce": nonce, "store": bool(hosts_store),
                             "mac": _mac(token, "claim", rank, world_size, nonce, bool(hosts_store))})
    current = store.compare_set(f"join/{rank}", "", claim)
    if current != claim:
        raise _fail(verdicts, rank, rank, f"{me}: rank {rank} was already claimed by another process (a duplicate "
                                          "rank, or this prefix was used by an earlier group on this store); refused")
    keys = [f"join/{r}" for r in range(world_size)]
    while not store.check(keys):
        _check_abort(verdicts, rank, label)
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if not store.check([keys[r]])]
            if not missing:  # the last rank joined between the two checks: the group is complete
                break
            raise _fail(verdicts, rank, missing[0],
                        f"{me}: ranks {missing} did not join within the timeout (world size {world_size})")
        time.sleep(_POLL_S)
    nonces = []
    bad_mac = []
    hosts: list[int] = []
    for r, key in enumerate(keys):
        try:
            c = decode(store.get(key), r, "claim", me)
        except CommError as e:
            raise _fail(verdicts, rank, r, str(e)) from None
        if not isinstance(c, dict) or set(c) != {"rank", "world_size", "nonce", "store", "mac"} \
                or not all(isinstance(c[k], str) for k in ("nonce", "mac")) or not isinstance(c["store"], bool):
            raise _fail(verdicts, rank, r, f"{me}: rank {r} sent a malformed claim")
        if c["world_size"] != world_size or c["rank"] != r:
            raise _fail(verdicts, rank, r, f"{me}: rank {r} joined with world size {c['world_size']!r} (as rank "
                                        f"{c['rank']!r}), this rank with world size {world_size}; refused")
        if not hmac.compare_digest(c["mac"], _mac(token, "claim", r, world_size, c["nonce"], c["store"])):
            bad_mac.append(r)
        elif c["store"]:
            hosts.append(r)
        nonces.append(c["nonce"])
    if bad_mac:
        raise _fail(verdicts, rank, bad_mac[0], f"{me}: the join claims of ranks {bad_mac} are not signed with this "
                                             "rank's job token (a wrong token on one side, or not a member); refused")
    _check_abort(verdicts, rank, label)
    return hashlib.sha256("|".join(nonces).encode()).hexdigest(), (hosts[0] if len(hosts) == 1 else None)


def connect(build: Callable[[], Any], verdicts: Verdicts, rank: int, label: str) -> Any:
    """`build()` (a backend connecting through the store, bounded by the store's timeout) in a daemon thread,
    while watching for another rank's fault verdict, so a rendezvous refused elsewhere is refused here at once.

    Raises:
        CommError: a rank reported a fault while the backend connected.
    """
    result: list[Any] = []
    error: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            result.append(build())
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            error.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name=f"reshard-connect-{rank}", daemon=True).start()
    while not done.wait(_POLL_S):
        _check_abort(verdicts, rank, label)
    if error:
        raise error[0]
    return result[0]


def prove_membership(control: Any, verdicts: Verdicts, rank: int, world_size: int, token: bytes, session: str,
                     timeout: Any, label: str) -> None:
    """Step 3: all-gather each rank's membership MAC over `control` (gloo) and check every one.

    Raises:
        CommError: a peer's MAC does not verify, or the all-gather failed.
    """
    me = f"rank {rank} of {label}"
    mine = torch.frombuffer(bytearray(bytes.fromhex(_mac(token, "member", session, rank))), dtype=torch.uint8)
    outs = [torch.empty(_MAC_BYTES, dtype=torch.uint8) for _ in range(world_size)]
    try:
        control.allgather([outs], [mine]).wait(timeout)
    except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError on timeouts and closed connections
        raise _fail(verdicts, rank, None, f"{me}: membership check over the new connections failed: {e}") from e
    bad = [r for r, t in enumerate(outs)
           if not hmac.compare_digest(t.numpy().tobytes().hex(), _mac(token, "member", session, r))]
    if bad:
        raise _fail(verdicts, rank, bad[0], f"{me}: the processes connected as ranks {bad} did not prove membership "
                                         "(not the processes that claimed those ranks); refused")
