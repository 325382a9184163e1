"""Quick start: plan one tensor between two layouts, with no process and no device.

A (6, 4) float32 weight, trainer TP2 x DP2 on ranks 0-3 (rows sharded over TP) -> inference TP2 x 2 replicas on
ranks 4-7 (columns sharded over TP), ranks 0-3 and 4-7 being two NVLink domains. Run: `python
examples/plan_one_tensor.py`.
"""

import torch

from reshard import Layout, Mesh, Replicate, Shard, Topology, gather_broadcast_bytes, plan


def main() -> None:
    src = Layout((6, 4), Mesh([[0, 1], [2, 3]], ("dp", "tp")), [Replicate(), Shard(0)], torch.float32, name="w")
    dst = Layout((6, 4), Mesh([[4, 5], [6, 7]], ("replica", "tp")), [Replicate(), Shard(1)], torch.float32, name="w")
    print(src.pieces(1))       # rank 1 (tp=1) holds rows 3-6 of every column
    print(src.local_shape(1))  # (3, 4)

    p = plan(src, dst, Topology(domain_size=4))
    print(p.describe())

    # By hand: each of the 4 destination ranks needs 6 x 2 floats (48 B). The whole tensor (96 B) must cross into
    # domain 4-7 once; its second copy goes by NVLink inside the domain.
    s = p.stats
    assert s.needed_bytes == 4 * 48, s
    assert s.network_bytes == s.network_lower_bound == 96, s
    gb = gather_broadcast_bytes(src, dst)["total"]
    print(f"plan verified: network {s.network_bytes} B (lower bound {s.network_lower_bound} B), nvlink "
          f"{s.nvlink_bytes} B; gather-and-broadcast would move {gb} B")


if __name__ == "__main__":
    main()
