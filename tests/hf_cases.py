"""Jobs for `test_integrations_hf.py`: real `transformers` models sharded as trainers shard them, refit to engines.

Trainer: world ranks 0-3 hold a tiny model built from a config with random weights:
- `qwen3`: HF's own TP plan (`config.base_model_tp_plan`, `colwise` / `rowwise` as torch's `ColwiseParallel` /
  `RowwiseParallel` through `parallelize_module`), then FSDP2 (`fully_shard`) over the dp axis of a `(dp, tp)` mesh:
  norms and embeddings become 1-D DTensors on each TP rank's own dp sub-mesh. `q_norm` / `k_norm` gradients are
  all-reduced over TP, as HF's `replicated_with_grad_allreduce` says.
- `qwen3_moe`: experts (transformers 5's fused `gate_up_proj` / `down_proj`) `S(0)` over an `ep` mesh axis, then
  FSDP2 over `edp`; everything else FSDP2 over all 4 ranks.

Engine: world ranks 4-7, 2 TP2 replicas (or EP4 for experts), tensors from `reshard.integrations.hf`.

The jobs only move data and return it; the test process checks it with its own slicing rules.
"""

from __future__ import annotations

import torch

SENTINEL = -7.0  # engine tensors start filled with it; padded vocabulary rows must keep it
TRAIN_RANKS = (0, 1, 2, 3)
ENGINE_RANKS = (4, 5, 6, 7)


def configs() -> dict:
    """Tiny configs: hidden 64, 2 layers; vocabularies that neither TP2 nor 64 divide."""
    return {
        "qwen3": dict(model_type="qwen3", vocab_size=203, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
        # one KV head: replicated over the engine's TP2; tied embeddings; 4 experts of intermediate size 32
        "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=157, hidden_size=64, intermediate_size=96,
                          moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
                          norm_topk_prob=True),
    }


def build_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """The plain (unsharded) model, the same on every process for one seed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(configs()[kind])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    return model.float()


def _meshes(worker, kind: str):
    """The trainer's device meshes (built by every rank of the world: `new_group` is collective), cached."""
    from torch.distributed.device_mesh import DeviceMesh

    key = f"mesh/{kind}"
    if key not in worker.scratch:
        names = ("dp", "tp") if kind == "qwen3" else ("edp", "ep")
        mesh = DeviceMesh("cpu", torch.tensor(TRAIN_RANKS).reshape(2, 2), mesh_dim_names=names)
        flat = mesh._flatten("dp_all") if kind != "qwen3" else None
        worker.scratch[key] = (mesh, flat)
    return worker.scratch[key]


def _trainer(worker, kind: str):
    """This trainer rank's sharded model and optimizer, built once per pool and kept (steps accumulate)."""
    key = f"trainer/{kind}"
    if key in worker.scratch:
        return worker.scratch[key]
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh, flat = _meshes(worker, kind)
    model = build_model(kind)
    if kind == "qwen3":
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        plan = {k: styles[v]() for k, v in model.config.base_model_tp_plan.items() if v in styles}
        parallelize_module(model.model, mesh["tp"], plan)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    else:
        for layer in model.model.layers:
            experts = layer.mlp.experts
            for pname, p in list(experts.named_parameters(recurse=False)):
                dt = distribute_tensor(p.detach(), mesh["ep"], [Shard(0)], src_data_rank=None)
                experts.register_parameter(pname, torch.nn.Parameter(dt))
            fully_shard(experts, mesh=mesh["edp"])
            fully_shard(layer, mesh=flat)
        fully_shard(model, mesh=flat)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    worker.scratch[key] = (model, opt)
    return model, opt


def optimizer_step(worker, kind: str, step: int) -> None:
    """One real optimizer step on the sharded trainer."""
    import torch.distributed as dist

    model, opt = _trainer(worker, kind)
    mesh, _ = _meshes(worker, kind)
    g = torch.Generator().manual_seed(100 + step)
    if kind == "qwen3":
        ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        tp_group = mesh["tp"].get_group()
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):  # HF: replicated_with_grad_allreduce
                dist.all_reduce(p.grad.to_local(), group=tp_group)
    else:
        # the experts' EP forward needs token dispatch that HF's eager experts do not do; a loss on the sharded
        # parameters themselves still takes a real backward through every DTensor layout and a real AdamW step
        # (each rank's loss is the sum over its own shards: the gradient of a sum is elementwise, so every shard
        # gets its exact gradient without a collective)
        loss = sum(((p.to_local() - 0.01 * step) ** 2).sum() * (1 + i % 3) for i, p in enumerate(model.parameters()))
        loss.backward()
    opt.step()
    opt.zero_grad()


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's `full_tensor()` (collective over the trainer ranks)."""
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _group(worker, numbering: str):
    from reshard.comm import Group

    if numbering == "world":
        return Group.world()
    n = worker.scratch["hf_groups"] = worker.scratch.get("hf_groups", 0) + 1  # a fresh tag per group
    if numbering == "trainer_first":
        return worker.new_group(f"hf/{numbering}/{n}", rank=worker.rank)
    # the engine's processes take group ranks 0-3, the trainer's 4-7: DTensor ranks 0-3 are group ranks 4-7
    return worker.new_group(f"hf/{numbering}/{n}", rank=(worker.rank + 4) % 8)


def job_refit(worker, kind: str, numbering: str, shapes: dict, *, ep: int = 1, steps: int = 1,
              check_replicas: bool = False, corrupt: str | None = None) -> dict:
    """Register with the plain loop, refit, step the optimizer, refit again.

    Returns, per run: on trainer rank 0 the full tensors, on engine ranks their local tensors; and the reports.
    With `corrupt`, trainer rank 1 adds 1 to its copy of that (TP-replicated) weight before the second run.
    """
    from reshard.integrations import hf
    from reshard.refit import Refit

    group = _group(worker, numbering)
    engine_first = numbering == "engine_first"
    engine_ranks = TRAIN_RANKS if engine_first else ENGINE_RANKS
    refit = Refit(group, check_replicas=check_replicas, timeout=90)
    out: dict = {"runs": [], "choices": None}
    is_trainer = worker.rank in TRAIN_RANKS
    if is_trainer:
        model, _ = _trainer(worker, kind)
        for name, p in model.named_parameters():  # the plain registration loop
            refit.add_source(name, p)
    else:
        par = hf.EngineParallel(engine_ranks, tp=2, ep=ep)
        locals_ = {}
        for t in hf.engine_tensors(shapes, par, config=configs()[kind], dtype=torch.float32):
            if group.rank in t.ranks:
                locals_[t.name] = torch.full(t.local_shape(group.rank), SENTINEL)
                t.register(refit, locals_[t.name])
        out["tp_index"] = par.ranks.index(group.rank) % 2
        out["ep_index"] = par.ranks.index(group.rank) % ep
    try:
        for run in range(steps + 1):
            if run and is_trainer:
                optimizer_step(worker, kind, run)
            bad = corrupt is not None and run > 0 and worker.rank == 1
            if bad:  # what a missing gradient all-reduce over TP does to one copy
                local = dict(model.named_parameters())[corrupt].to_local().data
                saved = local.clone()
                local.add_(1.0)
            try:
                report = refit.run()
            finally:
                if bad:
                    local.copy_(saved)
            out["choices"] = {k: str(v) for k, v in report.choices.items()}
            if is_trainer:
                state = full_state(model)
                out["runs"].append(state if worker.rank == 0 else None)
            else:
                out["runs"].append({n: t.clone() for n, t in locals_.items()})
    finally:
        if numbering != "world":
            group.close()
    out["group_rank"] = group.rank
    return out



def job_example(worker) -> dict:
    """`examples/fsdp_tp_refit.py`'s `run` on this rank, its results in `job_refit`'s form (one run)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "fsdp_tp_refit.py"
    spec = importlib.util.spec_from_file_location("fsdp_tp_refit", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.run(worker.rank)
    if worker.rank in TRAIN_RANKS:
        return {"group_rank": worker.rank, "runs": [out.get("full")]}
    return {"group_rank": worker.rank, "runs": [out["engine"]], "tp_index": (worker.rank - 4) % 2, "ep_index": 0}


def per_expert_state(fused: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Older checkpoints' per-expert weights (`experts.{e}.gate_proj.weight` ...) cut from transformers 5's fused
    `gate_up_proj` `[E, 2I, H]` (gate rows first) and `down_proj` `[E, H, I]`."""
    out = {}
    for n, t in fused.items():
        m = n.removesuffix("gate_up_proj")
        if n.endswith(".mlp.experts.gate_up_proj"):
            i = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{m}{e}.gate_proj.weight"], out[f"{m}{e}.up_proj.weight"] = t[e, :i], t[e, i:]
        elif n.endswith(".mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{n.removesuffix('down_proj')}{e}.down_proj.weight"] = t[e]
    return out


def job_per_expert(worker, shapes: dict, ep: int) -> dict:
    """Per-expert trainer weights (each `S(0)` over the trainer ranks) into the engine's fused w13 / w2."""
    from reshard import Layout, Mesh, Shard
    from reshard.comm import Group
    from reshard.integrations import hf
    from reshard.refit import Refit

    refit = Refit(Group.world(), timeout=90)
    if worker.rank in TRAIN_RANKS:
        full = per_expert_state({n: p.detach() for n, p in build_model("qwen3_moe").named_parameters()})
        for n, t in full.items():
            lay = Layout(tuple(t.shape), Mesh(list(TRAIN_RANKS)), [Shard(0)], name=n)
            refit.add_source(n, t.chunk(4)[worker.rank].clone(), lay)
        refit.run()
        return {"group_rank": worker.rank, "runs": [None]}
    par = hf.EngineParallel(ENGINE_RANKS, tp=2, ep=ep)
    locals_ = {}
    for t in hf.engine_tensors(shapes, par, config=configs()["qwen3_moe"], dtype=torch.float32):
        locals_[t.name] = torch.full(t.local_shape(worker.rank), SENTINEL)
        t.register(refit, locals_[t.name])
    refit.run()
    i = ENGINE_RANKS.index(worker.rank)
    return {"group_rank": worker.rank, "runs": [locals_], "tp_index": i % 2, "ep_index": i % ep}


def job_conflict(worker) -> None:
    """Trainer ranks 0 and 1 register one weight with different placements on the same two ranks."""
    from reshard import Layout, Mesh, Shard
    from reshard.comm import Group
    from reshard.refit import Refit

    refit = Refit(Group.world(), timeout=90)
    if worker.rank in (0, 1):
        lay = Layout((8, 4), Mesh([0, 1]), [Shard(worker.rank)], name="w")
        refit.add_source("w", torch.zeros(lay.local_shape(worker.rank)), lay)
    if worker.rank in ENGINE_RANKS:
        lay = Layout((8, 4), Mesh(list(ENGINE_RANKS)), [Shard(0)], name="w")
        refit.add_destination("w", torch.zeros(lay.local_shape(worker.rank)), lay)
    refit.run()
