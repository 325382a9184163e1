"""The main job of `make demo`: a realistic trainer -> inference reshard of one Qwen3-32B MLP weight.

Trainer: TP4 x DP2 on ranks 0-7 (`gate_proj.weight` is column-parallel: dim 0 sharded over TP).
Inference: TP2 x 4 replicas on ranks 8-15. NVLink domains of 8 GPUs (two DGX-style nodes).
"""

from __future__ import annotations

import argparse

import torch
from torch.distributed.tensor import Replicate, Shard

from reshard.planner import Layout, Mesh, Topology

QWEN3_32B_MLP = (25600, 5120)  # gate_proj.weight: intermediate_size x hidden_size


def demo_layouts(shape: tuple[int, ...] = QWEN3_32B_MLP, dtype: torch.dtype = torch.bfloat16) -> tuple[Layout, Layout]:
    """TP4 x DP2 on ranks 0-7 -> TP2 x 4 replicas on ranks 8-15, dim 0 sharded by TP on both sides."""
    src = Layout(shape, Mesh(torch.arange(8).reshape(2, 4), ("dp", "tp")), [Replicate(), Shard(0)], dtype,
                 name="mlp.gate_proj.weight")
    dst = Layout(shape, Mesh(torch.arange(8, 16).reshape(4, 2), ("replica", "tp")), [Replicate(), Shard(0)], dtype,
                 name="mlp.gate_proj.weight")
    return src, dst


def run_demo(args: argparse.Namespace) -> int:
    from reshard.__main__ import print_plan_report

    src, dst = demo_layouts()
    print("== plan: Qwen3-32B mlp.gate_proj.weight, trainer TP4 x DP2 -> inference TP2 x 4 replicas ==")
    print_plan_report(src, dst, Topology(domain_size=8), relay=True, describe=False)
    return 0
