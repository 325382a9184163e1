"""One-GPU end-to-end refit: trainer ranks as CPU processes (gloo), one engine process whose model runs on the GPU.

Ranks 0-1 hold a small Hugging Face Qwen3 model (random weights from a seed; nothing is downloaded) sharded by
rows over TP2. Rank 2 is the engine: its tensors are laid out as `reshard.integrations.hf.engine_tensors` lays them out
for one engine rank (`qkv_proj` and `gate_up_proj` fused, the vocabulary padded), received by `Refit` over gloo
into host staging (pinned memory when the device is CUDA), then copied to the device tensor by tensor. The engine checks
every received tensor element for element against the trainer's weights, loads them (unfused) into the same model
built on the device, and compares its logits with the trainer's model's on the CPU. It reports the refit's time and
bytes, and the copy to the device, in a CSV.

Then the same refit again with the staging done by the library: the engine registers its tensors on the device, and
since the trainers are CPU processes its group moves data over gloo, so the engine takes reshard's host-staged route
(a pinned host mirror of its staging, each chunk copied on to the device before it is unpacked there). Its tensors
are checked element for element too, and the CSV says which route it took (`host-staged` on CUDA, `direct` on
CPU) and how many bytes went through the mirror.

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


def _refit(w, state: dict, tensors: list, make) -> tuple:
    """One refit on a fresh `Refit`: trainer ranks add their row shards of `state`; the engine registers, per
    engine tensor, `make(t)`. Returns `(report, seconds, the engine's tensors by name)`."""
    from torch.distributed.tensor import Replicate, Shard

    from reshard import Layout, Mesh, Refit

    refit = Refit(w.group)
    train_mesh = Mesh(list(TRAINER))
    if w.rank in TRAINER:
        i = TRAINER.index(w.rank)
        for name, full in state.items():
            shardable = full.dim() >= 1 and full.shape[0] >= 2
            placement = Shard(0) if shardable else Replicate()
            local = full.chunk(2, dim=0)[i].clone() if shardable else full.clone()
            refit.add_source(name, local, Layout(tuple(full.shape), train_mesh, [placement], full.dtype, name=name))
    held: dict[str, torch.Tensor] = {}
    if w.rank == ENGINE:
        for t in tensors:
            held[t.name] = make(t)
            t.register(refit, held[t.name])
    t0 = time.perf_counter()
    report = refit.run()
    if w.rank == ENGINE and any(t.is_cuda for t in held.values()):
        torch.cuda.synchronize()
    return report, time.perf_counter() - t0, held


def _unfuse(tensors: list, held: dict, state: dict) -> tuple[list[str], dict]:
    """The engine's fused, padded tensors cut back into the model's parameters; `(names that differ from the
    trainer's weights, name -> the engine's part)`."""
    mismatches, loaded = [], {}
    for t in tensors:  # unfuse along the fusion dim, in component order
        sizes = [lay.local_shape(ENGINE)[t.dim] if len(t.components) > 1 else None for _, lay in t.components]
        parts = held[t.name].split(sizes, dim=t.dim) if len(t.components) > 1 else [held[t.name]]
        for (name, _), part in zip(t.components, parts):
            # a padded vocabulary: the rows past the model's vocabulary are the engine's padding
            part = part[tuple(slice(0, n) for n in state[name].shape)]
            loaded[name] = part
            if not torch.equal(part.cpu(), state[name]):
                mismatches.append(name)
    return mismatches, loaded


def rank_main(w, device: str) -> dict:
    from reshard.integrations.hf import EngineParallel, engine_tensors

    model = build_model("cpu")
    state = {n: p.detach() for n, p in model.named_parameters()}
    tensors = engine_tensors(model, EngineParallel([ENGINE], tp=1))
    pin = device.startswith("cuda")
    # 1. the script stages: the engine receives into host tensors (pinned on CUDA), then copies them to the device
    report, refit_s, staged = _refit(w, state, tensors, lambda t: torch.empty(t.local_shape(ENGINE), dtype=t.dtype,
                                                                             pin_memory=pin))
    # 2. the library stages: the engine registers its device tensors; on CUDA its group (gloo only, the trainers
    # are CPU processes) gives it the host-staged route, pinned mirror and chunked copies to the device included
    lib_report, lib_s, lib_held = _refit(w, state, tensors, lambda t: torch.full(
        t.local_shape(ENGINE), 7, dtype=t.dtype, device=device))
    out = {"rank": w.rank, "refit_s": refit_s, "network_bytes": report.network_bytes}
    if w.rank != ENGINE:
        return out
    t1 = time.perf_counter()
    on_device = {n: t.to(device, non_blocking=True) for n, t in staged.items()}
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    out["to_device_s"] = time.perf_counter() - t1
    out["bytes"] = sum(t.numel() * t.element_size() for t in staged.values())
    mismatches, loaded = _unfuse(tensors, on_device, state)
    lib_mismatches, _ = _unfuse(tensors, lib_held, state)
    ex = lib_report.execution
    out.update(mismatches=mismatches, checked=len(loaded), lib_mismatches=lib_mismatches, lib_refit_s=lib_s,
               lib_route=getattr(ex, "route", ""), lib_host_staged_bytes=getattr(ex, "bytes_host_staged", 0))
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
          f"logits max |diff| {engine['logits_max_abs_diff']:.2e}; library-staged refit ({engine['lib_route']}, "
          f"{engine['lib_host_staged_bytes']} B through host staging) {engine['lib_refit_s']:.3f} s, mismatches "
          f"{engine['lib_mismatches']}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_refit_check.csv"), "w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(["device", "torch", "tensors", "bytes", "refit_s", "to_device_s", "logits_max_abs_diff",
                     "lib_route", "lib_host_staged_bytes", "lib_refit_s", "ok"])
        # on CUDA the library's refit must have taken the host-staged route; on CPU the direct one
        route_ok = engine["lib_route"] == ("host-staged" if args.device.startswith("cuda") else "direct")
        ok = (not engine["mismatches"] and not engine["lib_mismatches"] and route_ok and engine["logits_ok"]
              and engine["checked"] > 0)
        wr.writerow([args.device, torch.__version__, engine["checked"], engine["bytes"], f"{engine['refit_s']:.4f}",
                     f"{engine['to_device_s']:.5f}", f"{engine['logits_max_abs_diff']:.3e}", engine["lib_route"],
                     engine["lib_host_staged_bytes"], f"{engine['lib_refit_s']:.4f}", ok])
    print("end-to-end refit is", "exact" if ok else "WRONG")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
