"""A single-sender checkpoint engine for verl, over gloo: verl's `nccl` backend's algorithm where NCCL is absent.

verl's `nccl` backend (`verl/checkpoint_engine/nccl_checkpoint_engine.py`, 0.9) needs cupy and NCCL. Its data path:
trainer rank 0 alone packs the full tensors that every trainer rank streams into buckets of `bucket_size` bytes and
broadcasts each bucket (and its manifest) to every rollout worker; the other trainer ranks walk the stream (it is
collective over the trainer) and send nothing. NCCL's broadcast is a ring pipeline: the root sends each byte once,
and the receivers pass it along. This engine does the same over a gloo group: rank 0 sends each bucket to the
first rollout rank, which forwards it to the next (a chain, NCCL's ring without the pipelining inside a bucket).
Bytes sent and received are counted per rank from the sizes of the messages; a trainer rank also times its wait for
the stream's next item (`seconds_stream`: the assembly, `full_tensor()` of every parameter) and until its first send.
Registered as `gloo-single-sender`; used by `perf/bench_frameworks.py` only.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import time
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngineRegistry

from reshard.comm import Group
from reshard.integrations.verl import ReshardCheckpointEngine
from reshard.integrations.verl import _buckets as bk

BACKEND = "gloo-single-sender"


@CheckpointEngineRegistry.register(BACKEND)
class SingleSenderCheckpointEngine(ReshardCheckpointEngine):
    """Trainer rank 0 sends every bucket; rollout ranks forward along a chain. The group set-up (`prepare`,
    `build_topology`, `init_process_group`, `finalize`) is reshard's; only the data path differs."""

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        group = self._require("send_weights", trainer=True)
        self.bytes_sent = 0
        self.seconds_stream, self.seconds_first_send = 0.0, 0.0
        self._t0 = time.perf_counter()
        rows: list[list] = []
        parts: list[torch.Tensor] = []
        used = 0
        items = iter(weights)
        while True:  # every trainer rank walks the stream (it is collective over the trainer)
            t_item = time.perf_counter()
            item = next(items, None)
            self.seconds_stream += time.perf_counter() - t_item
            if item is None:
                break
            name, tensor = item
            if group.rank != 0:
                continue
            size = bk.aligned(tensor.nbytes)
            if rows and used + size > self.bucket_size:
                await asyncio.to_thread(self._send, group, rows, parts, False)
                rows, parts, used = [], [], 0
            rows.append(bk.manifest_row(name, tuple(tensor.shape), tensor.dtype, "full"))
            parts.append(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
            used += size
        if group.rank == 0:
            await asyncio.to_thread(self._send, group, rows, parts, True)
        return {f"{BACKEND}/rank{group.rank}/bytes_sent": float(self.bytes_sent)}

    def _send(self, group: Group, rows: list, parts: list[torch.Tensor], last: bool) -> None:
        if not self.seconds_first_send:
            self.seconds_first_send = time.perf_counter() - self._t0
        entries = bk.layout_entries(rows)
        payload = torch.zeros(bk.buffer_bytes(entries), dtype=torch.uint8)
        for e, p in zip(entries, parts):
            payload[e.offset: e.offset + e.nbytes] = p
        self.bytes_sent += self._pass_on(group, json.dumps({"rows": rows, "last": last}).encode(), payload,
                                         self._num_trainers)

    def _pass_on(self, group: Group, manifest: bytes, payload: torch.Tensor, dst: int) -> int:
        pg, timeout = group.control, datetime.timedelta(seconds=self.timeout_s)
        m = torch.frombuffer(bytearray(manifest), dtype=torch.uint8)
        head = torch.tensor([m.numel(), payload.numel()], dtype=torch.int64)
        for t in (head, m, payload):
            pg.send([t], dst, 0).wait(timeout)
        return head.nbytes + m.numel() + payload.numel()

    async def receive_weights(self, global_steps: int | None = None):
        group = self._require("receive_weights", trainer=False)
        self.bytes_sent, self.bytes_received = 0, 0
        src = 0 if group.rank == self._num_trainers else group.rank - 1
        nxt = group.rank + 1 if group.rank + 1 < group.size else None
        while True:
            rows, last, payload = await asyncio.to_thread(self._recv, group, src, nxt)
            for e in bk.layout_entries(rows):
                yield e.name, bk.view(payload, e)
            if last:
                break

    def _recv(self, group: Group, src: int, nxt: int | None) -> tuple[list, bool, torch.Tensor]:
        pg, timeout = group.control, datetime.timedelta(seconds=self.timeout_s)
        head = torch.empty(2, dtype=torch.int64)
        pg.recv([head], src, 0).wait(timeout)
        m = torch.empty(int(head[0]), dtype=torch.uint8)
        pg.recv([m], src, 0).wait(timeout)
        payload = torch.empty(int(head[1]), dtype=torch.uint8)
        pg.recv([payload], src, 0).wait(timeout)
        self.bytes_received += head.nbytes + m.numel() + payload.numel()
        manifest = bytes(m.numpy().tobytes())
        if nxt is not None:
            self.bytes_sent += self._pass_on(group, manifest, payload, nxt)
        meta = json.loads(manifest)
        return meta["rows"], bool(meta["last"]), payload
