"""One-GPU end-to-end refit: trainer ranks as CPU processes (gloo), one engine process whose model runs on the GPU.

Ranks 0-1 hold a small Hugging Face Qwen3 model (random weights from a seed; nothing is downloaded) sharded by
rows over TP2. Rank 2 is the engine: its tensors are laid out as `reshard.integrations.hf.engine_tensors` lays them out
for one engine rank (`qkv_proj` and `gate_up_proj` fused, the vocabulary padded), received by `Refit` over gloo
into host staging (pinned memory when the device is CUDA), then copied to the device tensor by tensor. The engine checks
every received tensor element for element against the trainer's weights, loads them (unfused) into the same model
built on the device, and compares its logits with the trainer's model's on the CPU. It reports the refit's time and
bytes, and the copy to the device, in a CSV.

This is the host-staged shape of a CPU trainer feeding a GPU engine, done here by the script (gloo into host
memory, then a copy to the device), not by the library's NCCL path.

Usage: python perf/gpu_refit_check.py --device cuda --out DIR   (--device cpu: the plumbing, on any machine)
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time

import torch

CONFIG = dict(vocab_size=203, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
TRAINER, ENGINE = (0, 1), 2


def build_model(device: str):
    """The trainer's model (seed 0, float32), the same in every process."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**CONFIG)).eval()
    return model.to(device)


def rank_main(w, device: str) -> dict:
    from torch.distributed.tensor import Replicate, Shard

    from reshard import Layout, Mesh, Refit
    from reshard.integrations.hf import EngineParallel, engine_tensors

    model = build_model("cpu")
    state = {n: p.detach() for n, p in model.named_parameters()}
    refit = Refit(w.group)
    train_mesh = Mesh(list(TRAINER))
    if w.rank in TRAINER:
        i = TRAINER.index(w.rank)
        for name, full in state.items():
            shardable = full.dim() >= 1 and full.shape[0] >= 2
            placement = Shard(0) if shardable else Replicate()
            local = full.chunk(2, dim=0)[i].clone() if shardable else full.clone()
            refit.add_source(name, local, Layout(tuple(full.shape), train_mesh, [placement], full.dtype, name=name))
    tensors = engine_tensors(model, EngineParallel([ENGINE], tp=1))
    staged: dict[str, torch.Tensor] = {}
    if w.rank == ENGINE:
        pin = device.startswith("cuda")
        for t in tensors:
            staged[t.name] = torch.empty(t.local_shape(ENGINE), dtype=t.dtype, pin_memory=pin)
            t.register(refit, staged[t.name])
    t0 = time.perf_counter()
    report = refit.run()
    refit_s = time.perf_counter() - t0
    out = {"rank": w.rank, "refit_s": refit_s, "network_bytes": report.network_bytes}
    if w.rank != ENGINE:
        return out
    t1 = time.perf_counter()
    on_device = {n: t.to(device, non_blocking=True) for n, t in staged.items()}
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    out["to_device_s"] = time.perf_counter() - t1
    out["bytes"] = sum(t.numel() * t.element_size() for t in staged.values())
    mismatches, loaded = [], {}
    for t in tensors:  # unfuse along the fusion dim, in component order
        sizes = [lay.local_shape(ENGINE)[t.dim] if len(t.components) > 1 else None for _, lay in t.components]
        parts = on_device[t.name].split(sizes, dim=t.dim) if len(t.components) > 1 else [on_device[t.name]]
        for (name, _), part in zip(t.components, parts):
            # a padded vocabulary: the rows past the model's vocabulary are the engine's padding
            part = part[tuple(slice(0, n) for n in state[name].shape)]
            loaded[name] = part
            if not torch.equal(part.cpu(), state[name]):
                mismatches.append(name)
    out["mismatches"] = mismatches
    out["checked"] = len(loaded)
    engine = build_model(device)
    with torch.no_grad():
        for name, p in engine.named_parameters():
            p.copy_(loaded[name])
        ids = torch.arange(24).reshape(2, 12) % CONFIG["vocab_size"]
        want = model(ids).logits
        got = engine(ids.to(device)).logits.cpu()
    out["logits_max_abs_diff"] = float((got - want).abs().max())
    out["logits_ok"] = bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    from reshard.testing import launch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device visible", file=sys.stderr)
        return 2
    outs = launch(rank_main, 3, args.device, timeout=240)
    engine = outs[ENGINE]
    print(f"engine on {args.device}: {engine['checked']} tensors, mismatches {engine['mismatches']}, "
          f"{engine['bytes']} B, refit {engine['refit_s']:.3f} s, to device {engine['to_device_s']:.4f} s, "
          f"logits max |diff| {engine['logits_max_abs_diff']:.2e}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_refit_check.csv"), "w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(["device", "torch", "tensors", "bytes", "refit_s", "to_device_s", "logits_max_abs_diff", "ok"])
        ok = not engine["mismatches"] and engine["logits_ok"] and engine["checked"] > 0
        wr.writerow([args.device, torch.__version__, engine["checked"], engine["bytes"], f"{engine['refit_s']:.4f}",
                     f"{engine['to_device_s']:.5f}", f"{engine['logits_max_abs_diff']:.3e}", ok])
    print("end-to-end refit is", "exact" if ok else "WRONG")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
