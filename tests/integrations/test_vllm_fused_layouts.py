"""Single-process checks (no vLLM needed) of the vLLM backend's rules for checkpoints that fuse weights: Phi-3's /
GPT-2's fused `qkv_proj` / `c_attn` described as one global, and GPT-2's `[in, out]` Conv1D weights registered
transposed. Each is compared with the slicing written out in torch (vLLM's `QKVParallelLinear.weight_loader` with
`loaded_shard_id=None`; a transpose), not with the library's layout code. The real engine's loading is the oracle of
`test_vllm_engine.py::test_family_refit[phi3-2]` / `[gpt2-1]`."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from reshard.integrations.trainer import transpose_weight, transposed_layout
from reshard.integrations.vllm._layouts import fused_checkpoint_layout
from reshard.planner import Layout, Mesh


def _local(layout, rank: int, full: torch.Tensor) -> torch.Tensor:
    """Rank `rank`'s local tensor, written piece by piece from `full` as `Refit` writes it (NaN where none)."""
    out = torch.full(layout.local_shape(rank), float("nan"))
    for p in layout.pieces(rank):
        out[p.local_box.slices()] = full[p.global_box.slices()]
    return out


@pytest.mark.parametrize("heads,kv,tp", [(8, 2, 2), (8, 2, 4), (8, 1, 4), (4, 4, 1)])
def test_fused_checkpoint_qkv_is_what_vllm_loads(heads: int, kv: int, tp: int) -> None:
    d, hidden = 4, 6
    ranks = list(range(10, 10 + tp))
    rep = max(1, tp // kv)  # TP ranks that share one KV head (vLLM's num_kv_head_replicas)
    q = Layout((heads * d, hidden), Mesh([ranks]), [Replicate(), Shard(0)], torch.float32, name="q")
    if rep == 1:
        k = Layout((kv * d, hidden), Mesh([ranks]), [Replicate(), Shard(0)], torch.float32, name="k")
    else:
        groups = [ranks[i:i + rep] for i in range(0, tp, rep)]
        k = Layout((kv * d, hidden), Mesh([groups]), [Replicate(), Shard(0), Replicate()], torch.float32, name="k")
    v = Layout(k.shape, k.mesh, k.placements, torch.float32, name="v")
    fused = fused_checkpoint_layout([q, k, v], "qkv_proj.weight")
    assert fused.shape == ((heads + 2 * kv) * d, hidden) and fused.name == "qkv_proj.weight"
    full = torch.randn(fused.shape)  # the checkpoint's [q; k; v]
    wq, wk, wv = full.split([heads * d, kv * d, kv * d])
    for t, r in enumerate(ranks):  # vLLM: q by TP rank, k and v by the KV head index tp_rank // replicas
        want = torch.cat([wq.chunk(tp)[t], wk.chunk(tp // rep)[t // rep], wv.chunk(tp // rep)[t // rep]])
        assert torch.equal(_local(fused, r, full), want), (t, r)


def test_transposed_conv1d_weight_is_a_view() -> None:
    hidden, out, world = 6, 18, 2
    full = torch.randn(hidden, out)  # HuggingFace Conv1D: [in, out]
    lay = Layout((hidden, out), Mesh([0, 1]), [Shard(0)], torch.float32, name="c_attn.weight")
    tl = transposed_layout(lay)
    assert tl.shape == (out, hidden) and tl.name == "c_attn.weight"
    for r in range(world):
        local = full.chunk(world)[r].clone()  # what the trainer rank holds
        view, got = transpose_weight("c_attn.weight", (local, lay))
        assert view.data_ptr() == local.data_ptr() and got == tl
        for p in got.pieces(r):  # every piece of the engine's [out, in] tensor, read from the view
            assert torch.equal(view[p.local_box.slices()], full.t()[p.global_box.slices()])
        local.mul_(2)  # an optimizer step in place is seen through the view
        assert torch.equal(view, local.t())
    with pytest.raises(ValueError, match="only a 2-D weight"):
        transposed_layout(Layout((4,), Mesh([0]), [Replicate()], torch.float32, name="b"))


def test_trainer_finds_conv1d_weights_and_refuses_unknown_names() -> None:
    utils = pytest.importorskip("transformers.pytorch_utils")
    from reshard.integrations.trainer import conv1d_weights
    from reshard.integrations.vllm import ReshardTrainer, ReshardTrainerInitInfo

    model = torch.nn.Module()  # GPT-2's attention block: Conv1D layers (nf = out, nx = in) and a plain Linear
    model.attn = torch.nn.Module()
    model.attn.c_attn, model.attn.c_proj = utils.Conv1D(24, 8), utils.Conv1D(8, 8)
    model.lm_head = torch.nn.Linear(8, 10)
    assert conv1d_weights(model) == ["attn.c_attn.weight", "attn.c_proj.weight"]
    lay = Layout((4, 6), Mesh([0]), [Replicate()], torch.float32, name="w")
    # the mistake is raised after the group formed, and the engine rank (a thread here) is told the reason
    import socket
    import threading

    from reshard.comm import CommError, Group
    from reshard.refit import Refit

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    seen: list = []

    def engine() -> None:
        group = Group.rendezvous("127.0.0.1", port, 1, 2, timeout=30)
        try:
            Refit(group, timeout=30).run()
        except CommError as e:
            seen.append(str(e))
        finally:
            group.close()

    thread = threading.Thread(target=engine, daemon=True)
    thread.start()
    with pytest.raises(ValueError, match="transposed names 'c_proj.weight', which the source does not hold"):
        ReshardTrainer.trainer_init(ReshardTrainerInitInfo(rank=0, master_port=port, timeout_s=30),
                                    source={"w": (torch.zeros(4, 6), lay)}, transposed=["c_proj.weight"])
    thread.join(30)
    assert seen and "transposed names 'c_proj.weight'" in seen[0], seen
