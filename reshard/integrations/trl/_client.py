"""The HTTP weight-update endpoints of a `vllm serve` server (dev mode), as `ReshardTrainer`'s `client`.

vLLM's server (`VLLM_SERVER_DEV_MODE=1`, `--weight-transfer-config '{"backend": "reshard"}'`) serves
`POST /init_weight_transfer_engine {"init_info": ...}`, `/start_weight_update`, `/update_weights {"update_info": ...}`,
`/finish_weight_update`, and `GET /get_world_size`, `/server_info?config_format=json`. Trainer rank 0 holds this
client; `ReshardTrainer` calls its methods concurrently with the transfer.
"""

from __future__ import annotations

import ast
import json
import logging
import urllib.error
import urllib.request
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["ServerClient", "ServerError"]


class ServerError(RuntimeError):
    """A weight-update request to the vLLM server failed (its HTTP status and body, or the connection error)."""


class ServerClient:
    """vLLM's weight-update routes of one server: an `EngineClient` of the trainer link
    (`reshard.integrations.trainer_link`), which trainer rank 0's sync drives.

    Args:
        base_url: the server, `http://host:port`.
        timeout_s: seconds one request may last (an update request lasts as long as its transfer).
    """

    def __init__(self, base_url: str, *, timeout_s: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def _request(self, route: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + route, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                text = r.read().decode()
        except urllib.error.HTTPError as e:
            raise ServerError(f"vLLM server {self.base_url}{route}: HTTP {e.code}: {e.read().decode()[:500]}") from e
        except (urllib.error.URLError, OSError) as e:
            raise ServerError(f"vLLM server {self.base_url}{route}: {type(e).__name__}: {e}") from e
        return json.loads(text) if text.strip() else None

    def world_size(self) -> int:
        """The server's workers (TP x PP x DP)."""
        return int(self._request("/get_world_size")["world_size"])

    def backend(self) -> str | None:
        """The server's weight-transfer backend (`--weight-transfer-config`), or None without one."""
        info = self._request("/server_info?config_format=json")
        cfg = info.get("vllm_config", info).get("weight_transfer_config")
        if isinstance(cfg, str):  # some versions show the config's repr
            cfg = ast.literal_eval(cfg) if cfg.strip().startswith("{") else {"backend": cfg}
        return cfg.get("backend") if isinstance(cfg, dict) else None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._request("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._request("/start_weight_update", {})

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._request("/update_weights", {"update_info": update_info})

    def finish_weight_update(self) -> None:
        self._request("/finish_weight_update", {})
