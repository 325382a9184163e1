"""Hardware presets: per-GPU link bandwidths, NVLink-domain size and per-message latency."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GB = 1e9
"""Bandwidths are in bytes per second, quoted in decimal GB/s as vendors do."""


@dataclass(frozen=True)
class Hardware:
    """What the cost model needs to know about a cluster's GPUs.

    Attributes:
        name: preset name.
        nvlink_bytes_per_s: NVLink bandwidth of one GPU, per direction (bytes/s).
        network_bytes_per_s: the network (NIC) bandwidth of one GPU, per direction (bytes/s).
        domain_size: GPUs per NVLink domain (a node, or a rack for NVL72).
        nvlink_latency_s: fixed cost of one message over NVLink (s).
        network_latency_s: fixed cost of one message over the network (s).
        copy_bytes_per_s: on-device copy bandwidth (read + write counted once), for local copies.
        source: where the figures come from.

    Latencies are modelling assumptions, not measurements: a few microseconds per NCCL point-to-point message
    (launch, protocol hand-shake, first byte), more across the network than over NVLink.
    """

    name: str
    nvlink_bytes_per_s: float
    network_bytes_per_s: float
    domain_size: int
    nvlink_latency_s: float = 3e-6
    network_latency_s: float = 8e-6
    copy_bytes_per_s: float = 1.5e12
    source: str = ""

    def __post_init__(self) -> None:
        for f in ("nvlink_bytes_per_s", "network_bytes_per_s", "copy_bytes_per_s"):
            if getattr(self, f) <= 0:
                raise ValueError(f"Hardware {self.name!r}: {f} must be > 0, got {getattr(self, f)}")
        if self.domain_size < 1:
            raise ValueError(f"Hardware {self.name!r}: domain_size must be >= 1, got {self.domain_size}")
        if self.nvlink_latency_s < 0 or self.network_latency_s < 0:
            raise ValueError(f"Hardware {self.name!r}: latencies must be >= 0")

    def _link(self, link: str) -> tuple[float, float]:
        """(bytes/s, seconds per message) of one GPU's link of kind `link`."""
        if link == "nvlink":
            return self.nvlink_bytes_per_s, self.nvlink_latency_s
        if link == "network":
            return self.network_bytes_per_s, self.network_latency_s
        if link == "local":
            return self.copy_bytes_per_s, 0.0
        raise ValueError(f"unknown link kind {link!r}; valid: 'nvlink', 'network', 'local'")

    def bandwidth(self, link: str) -> float:
        """Bytes/s of one GPU's `"nvlink"`, `"network"` or `"local"` link, per direction."""
        return self._link(link)[0]

    def latency(self, link: str) -> float:
        """Seconds per message on `link` (local copies cost none)."""
        return self._link(link)[1]

    def replace(self, **changes: object) -> Hardware:
        """A copy with some figures changed, e.g. `domain_size=4` for GB200 trays without multi-node NVLink."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware(
            name="h100",
            nvlink_bytes_per_s=450 * GB,
            network_bytes_per_s=400e9 / 8,
            domain_size=8,
            copy_bytes_per_s=1.5e12,
            source=(
                "DGX H100: NVLink 4, 18 links, 900 GB/s per GPU both directions together (450 GB/s each way); "
                "8x ConnectX-7 400 Gb/s, one per GPU; 8 GPUs per NVSwitch node"
            ),
        ),
        Hardware(
            name="gb200",
            nvlink_bytes_per_s=900 * GB,
            network_bytes_per_s=400e9 / 8,
            domain_size=72,
            copy_bytes_per_s=3.5e12,
            source=(
                "GB200 NVL72: NVLink 5, 1.8 TB/s per GPU both directions together (900 GB/s each way), 72 GPUs in "
                "one NVLink domain; 4 ConnectX-7 (400 Gb/s) per 4-GPU compute tray, one per GPU (e.g. MLCommons "
                "inference v6.1 system description GB200-NVL72, Crusoe)"
            ),
        ),
        Hardware(
            name="gb300",
            nvlink_bytes_per_s=900 * GB,
            network_bytes_per_s=800e9 / 8,
            domain_size=72,
            copy_bytes_per_s=3.5e12,
            source=(
                "GB300 NVL72: NVLink 5 as GB200 (900 GB/s each way, 72 GPUs); 4 ConnectX-8 SuperNICs (800 Gb/s) per "
                "4-GPU compute tray (NVIDIA Enterprise RA, NVL72 AI factory, components)"
            ),
        ),
    )
}


def get_hardware(name: str) -> Hardware:
    """The preset `name` (`h100`, `gb200`, `gb300`), with a `ValueError` listing the valid names otherwise."""
    try:
        return HARDWARE[name.lower()]
    except KeyError:
        raise ValueError(f"unknown hardware preset {name!r}; valid: {sorted(HARDWARE)}") from None
