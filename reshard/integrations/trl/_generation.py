"""TRL's classes with reshard's weight sync (defined on first use: they subclass TRL's)."""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

from reshard.integrations.trainer import parameter_source
from reshard.integrations.trl._client import ServerClient
from reshard.integrations.trl._sync import ShardSync

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0


def define() -> dict[str, type]:
    """`{"ReshardVLLMGeneration": ..., "GRPOTrainer": ...}`, subclasses of TRL's (imports `trl`)."""
    import trl
    import trl.trainer.grpo_trainer as grpo_module
    from trl.generation.vllm_client import VLLMClient
    from trl.generation.vllm_generation import VLLMGeneration

    class ReshardVLLMGeneration(VLLMGeneration):
        """TRL's `VLLMGeneration` whose server-mode weight sync goes through reshard: every trainer rank sends its
        own parameters' shards (`ShardSync`), trainer rank 0 drives the server's weight-update routes; generation
        and colocate mode are TRL's. The server runs `vllm serve ... --weight-transfer-config
        '{"backend":"reshard"}'` with `VLLM_SERVER_DEV_MODE=1`.

        Attributes:
            reshard_timeout_s: seconds any wait for a peer may last in a sync.
            last_sync: this rank's `SyncResult` of the last sync (None before the first).
        """

        reshard_timeout_s: float = DEFAULT_TIMEOUT_S

        def _init_vllm(self) -> None:
            if self.mode != "server":
                return super()._init_vllm()
            acc = self.accelerator
            base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
            meta: list[Any] = [None]
            client = None
            if acc.is_main_process:
                self.vllm_client = VLLMClient(base_url=base_url, group_port=self.group_port,
                                              connection_timeout=self.server_timeout)
                client = ServerClient(base_url, timeout_s=self.reshard_timeout_s)
                backend = client.backend()
                meta[0] = {"backend": backend, "world": client.world_size(),
                           "address": _address_for(urlparse(base_url).hostname or "127.0.0.1")}
            meta = _broadcast(acc, meta)
            if meta[0]["backend"] != "reshard":
                raise ValueError(f"reshard TRL sync: the vLLM server at {base_url} has weight-transfer backend "
                                 f"{meta[0]['backend']!r}; start it with --weight-transfer-config "
                                 "'{\"backend\":\"reshard\"}' (and VLLM_SERVER_DEV_MODE=1)")
            cfg = getattr(_unwrapped(self.model), "config", None)
            self.reshard_sync = ShardSync(acc.process_index, acc.num_processes, meta[0]["world"], meta[0]["address"],
                                          self.group_port, client=client, timeout_s=self.reshard_timeout_s,
                                          config=cfg)
            self.last_sync = None
            acc.wait_for_everyone()

        def sync_weights(self) -> None:
            if self.mode != "server":
                return super().sync_weights()
            if is_peft(self.model):
                raise NotImplementedError("reshard TRL sync: PEFT models (merged adapters) are not supported yet; "
                                          "TRL's own sync gathers the whole model for them")
            self.last_sync = self.reshard_sync.sync(self._shard_params)
            if self.accelerator.is_main_process:
                self.vllm_client.reset_prefix_cache()

        def _shard_params(self) -> Iterator[tuple[str, Any]]:
            """`(vLLM name, parameter)` of this rank's parameters, not gathered (DTensors under FSDP2); under
            DeepSpeed ZeRO-3 `(vLLM name, (window, FlatRangeLayout))` of this rank's own partition (a rank whose
            range of a small tensor is only padding yields nothing for it)."""
            rank = self.accelerator.process_index
            for name, p in _unwrapped(self.model).named_parameters():
                vname = self._fix_param_name_to_vllm(name)
                if hasattr(p, "ds_tensor"):  # ZeRO-3: `p.data` is empty or a transient gather; the partition is real
                    src = parameter_source(vname, p, rank)  # the DeepSpeed integration's partition kind
                    if src is not None:
                        yield vname, src
                    continue
                yield vname, p

    class GRPOTrainer(trl.GRPOTrainer):
        """TRL's `GRPOTrainer` with reshard's weight sync in server mode (`GRPOConfig(use_vllm=True,
        vllm_mode="server")`): change the import, keep the rest.

        Args:
            reshard_timeout_s: seconds any wait for a peer may last in a sync (a dead peer's error comes within it).
            *args, **kwargs: TRL's.
        """

        def __init__(self, *args: Any, reshard_timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> None:
            cls = type("ReshardVLLMGeneration", (ReshardVLLMGeneration,), {"reshard_timeout_s": reshard_timeout_s})
            with _swapped(grpo_module, "VLLMGeneration", cls):
                super().__init__(*args, **kwargs)

    return {"ReshardVLLMGeneration": ReshardVLLMGeneration, "GRPOTrainer": GRPOTrainer}


@contextlib.contextmanager
def _swapped(module: Any, name: str, value: Any) -> Iterator[None]:
    # GRPOTrainer.__init__ builds its generation backend by this module-global name, with no injection argument
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _broadcast(acc: Any, objs: list[Any]) -> list[Any]:
    if acc.num_processes == 1:
        return objs
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list(objs, from_process=0)


def _unwrapped(model: Any) -> Any:
    while hasattr(model, "module") and not hasattr(model, "config"):
        model = model.module
    return model


def is_peft(model: Any) -> bool:
    return any(type(m).__name__.startswith("Peft") for m in [model, _unwrapped(model)])


def _address_for(server_host: str) -> str:
    """This host's address as the server reaches it: loopback for a local server, else the interface that routes
    to it."""
    if server_host in ("localhost", "127.0.0.1", "0.0.0.0", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((server_host, 9))  # no packet is sent: it picks the route
        return s.getsockname()[0]
