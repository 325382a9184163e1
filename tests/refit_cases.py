"""Jobs that run on every rank of a `RankPool` for the model-refit tests (top-level functions, so they pickle).

The oracle here is independent of the planner: the expected inference local tensors are cut from full tensors
with vLLM's own rules, written out by hand (TP chunks, K/V head replication, padded vocabulary, fused
`qkv_proj` / `gate_up_proj` / `w13`).
"""

from __future__ import annotations

import zlib

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from vllm_oracle import vllm_local

from reshard.comm import Group
from reshard.integrations.fused import engine_tensors
from reshard.models import PRESETS, param_specs
from reshard.planner import Topology
from reshard.refit import Refit
from reshard.sim import System, model_layouts

SENTINEL = 0x5A5A  # fills inference tensors before a refit; padding rows must keep it


def full_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bits (every bit pattern, NaNs included) for `name`, the same in every process."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) ^ (seed * 7919))
    int_dtype = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    info = torch.iinfo(int_dtype)
    return torch.empty(shape, dtype=int_dtype).random_(info.min, info.max, generator=g).view(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.dtype.itemsize])


def small_models() -> dict:
    return {
        # Qwen3-0.6B's per-tensor shapes, two decoder layers instead of 28 to keep CI within its budget
        "qwen3-0.6b": PRESETS["qwen3-0.6b"].replace(num_hidden_layers=2),
        # DeepSeek-V3's structure (MLA, shared + routed experts, a dense first layer) at toy size
        "tiny-deepseek": PRESETS["deepseek-v3"].replace(
            name="tiny-deepseek", hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=200, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            first_k_dense_replace=1, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16),
    }


def setup(model: str, system: str, rank: int, seed: int, *, dtensor_every: int = 2,
          staging_bytes: int = 64 << 20, group=None, **refit_kwargs):
    """Build this rank's side of the refit (on `group`, default the world): trainer weights from full tensors via
    DTensor, zeroed engine tensors.

    Returns `(refit, sources, dests, system)`: `sources` name -> local tensor (trainer), `dests` name -> local
    tensor (inference).
    """
    config = small_models()[model]
    sysm = System.parse(system)
    weights = model_layouts(config, sysm, stack_experts=True)
    refit = Refit(group or Group.world(), topology=Topology(domain_size=sysm.domain_size), staging_bytes=staging_bytes,
                  **refit_kwargs)
    sources: dict[str, torch.Tensor] = {}
    for i, w in enumerate(weights):
        lay = w.train
        if rank not in lay.ranks:
            continue
        full = full_tensor(w.spec.name, w.spec.shape, w.spec.dtype, seed)
        mesh = DeviceMesh("cpu", torch.tensor(lay.mesh.ranks).reshape(lay.mesh.shape), _init_backend=False)
        dt = distribute_tensor(full, mesh, list(lay.placements), src_data_rank=None)
        if i % dtensor_every == 0:
            refit.add_source(w.spec.name, dt)  # the DTensor form
        else:
            refit.add_source(w.spec.name, dt.to_local(), lay)  # the local tensor + Layout form
        sources[w.spec.name] = dt.to_local()
    dests: dict[str, torch.Tensor] = {}
    for et in engine_tensors([(w.spec.name, w.gen) for w in weights]):
        if rank not in et.ranks:
            continue
        local = bits(torch.empty(et.local_shape(rank), dtype=et.dtype)).fill_(SENTINEL).view(et.dtype)
        refit.add_destination(et.name, local, list(et.components), dim=et.dim)
        dests[et.name] = local
    return refit, sources, dests, sysm, config


def vllm_expected(name: str, config, seed: int, tp: int, tp_idx: int, padded: torch.Tensor) -> torch.Tensor:
    """The engine's local tensor `name` on TP rank `tp_idx`, cut from the seeded full tensors by vLLM's rules
    (`tests/vllm_oracle.py`); `padded`: the engine's tensor before the refit (its vocabulary padding)."""
    specs = {s.name: s for s in param_specs(config, stack_experts=True)}

    def full(n: str) -> torch.Tensor:
        return full_tensor(n, specs[n].shape, specs[n].dtype, seed)

    def experts(layer: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # stacked [E, I, H] / [E, H, I]
        return tuple(full(f"{layer}.experts.{x}_proj.weight") for x in ("gate", "up", "down"))

    return vllm_local(name, full, tp=tp, t=tp_idx, kv_heads=config.num_key_value_heads,
                      head_dim=config.attn_head_dim, padded=padded, experts=experts)


def job_refit(w, model: str, system: str, seed: int, new_seed: int | None = None,
              **refit_kwargs) -> dict:
    """Refit, verify every engine tensor bit for bit; optionally change the trainer's weights and run again."""
    rank = w.rank
    refit, sources, dests, sysm, config = setup(model, system, rank, seed, **refit_kwargs)
    reports = [refit.run()]
    mismatches = _verify(rank, dests, sysm, config, seed)
    if new_seed is not None:
        train = {w.spec.name: w for w in model_layouts(config, sysm)}
        for name, local in sources.items():  # an optimizer step: new values, in place, same tensors
            spec, lay = train[name].spec, train[name].train
            new_full = full_tensor(name, spec.shape, spec.dtype, new_seed)
            mesh = DeviceMesh("cpu", torch.tensor(lay.mesh.ranks).reshape(lay.mesh.shape), _init_backend=False)
            local.copy_(distribute_tensor(new_full, mesh, list(lay.placements), src_data_rank=None).to_local())
        reports.append(refit.run())
        mismatches += _verify(rank, dests, sysm, config, new_seed)
    return {
        "mismatches": mismatches,
        "checked": len(dests),
        "first_run": [r.first_run for r in reports],
        "metadata_s": [r.seconds["metadata"] for r in reports],
        "network_bytes": reports[0].network_bytes,
        "messages": reports[0].messages,
        "num_items": len(refit.plan.items),
        "choices": sorted(set(reports[0].choices.values())),
        "gather_broadcast_bytes": reports[0].gather_broadcast_bytes,
    }


def job_refit_mixed_planning(w) -> None:
    """Half the ranks plan the whole model, the other half their own part: the plan handshake must refuse."""
    refit, _, _, _, _ = setup("tiny-deepseek", "train=ep2,dp2 gen=tp2,dp2 domain=4", w.rank, 3,
                              planning="local" if w.rank % 2 else "global")
    refit.run()


def _verify(rank: int, dests: dict, sysm, config, seed: int) -> list[str]:
    if rank not in sysm.gen_ranks:
        return []
    i = rank - sysm.gen_offset
    tp = sysm.gen.tp
    out = []
    for name, local in dests.items():
        expected = vllm_expected(name, config, seed, tp, i % tp, bits(torch.empty_like(local)).fill_(SENTINEL)
                                 .view(local.dtype))
        if expected.shape != local.shape or not torch.equal(bits(expected), bits(local)):
            out.append(f"rank {rank}: {name} shape {tuple(local.shape)} vs expected {tuple(expected.shape)}")
    return out


def job_refit_error(w, model: str, system: str, case: str) -> str:
    """Build a refit with one deliberate mistake; every rank must raise the same ValueError naming it."""
    rank = w.rank
    kwargs: dict = {}
    if case == "unmapped":
        kwargs["name_map"] = lambda n: None if n.endswith("input_layernorm.weight") else n
    elif case == "extra":
        kwargs["name_map"] = lambda n: n.replace("post_attention_layernorm", "post_attn_norm")
    refit, sources, dests, sysm, config = setup(model, system, rank, 0, **kwargs)
    if case == "shape" and rank in sysm.gen_ranks:
        # the engine declares a different global shape for one weight
        from reshard.planner import Layout

        name = "model.layers.0.self_attn.o_proj.weight"
        local, d = refit._dests[name]
        lay = d.components[0][1]
        bad = Layout((lay.shape[0], lay.shape[1] + 2), lay.mesh, lay.placements, lay.dtype, name=name)
        del refit._dests[name]
        refit.add_destination(name, torch.zeros(bad.local_shape(rank), dtype=bad.dtype), bad)
    if case == "refused" and rank == 1:  # an integration found its model chunk wrong on this rank only
        refit.refuse("the model chunk is another stage's")
    refit.run()
    return "no error"


# ---- precision modes ----------------------------------------------------------------------------------------

FP8_WEIGHTS = {
    # name: (shape, trainer layout on ranks 0-3, inference layout on ranks 4-6 (TP3 cuts inside 128-blocks))
    # stacked experts, trainer EP2 x DP2 (whole matrices per rank: quantized on the source), inference TP3 rows
    "experts.w1": ((4, 200, 320), ((2, 2), "R,S(0)"), ((3,), "S(1)")),
    # dense, trainer TP2 cut at row 256 (block-aligned: quantized on the source), inference TP3 rows
    "dense.aligned": ((512, 200), ((2, 2), "R,S(0)"), ((3,), "S(0)")),
    # dense, uneven trainer cut at row 169 (inside a block: quantized on the destination), inference TP3 columns
    "dense.uneven": ((337, 320), ((2, 2), "R,S(0)"), ((3,), "S(1)")),
}
CAST_WEIGHT = ("norm.cast", (5, 300))


def _fp8_layouts(name: str):
    from reshard.planner import Layout, Mesh
    from reshard.planner._notation import parse_placements

    shape, (tmesh, tpl), (imesh, ipl) = FP8_WEIGHTS[name]
    train = Layout(shape, Mesh(torch.arange(4).reshape(tmesh)), parse_placements(tpl), torch.float32, name=name)
    infer = Layout(shape, Mesh(torch.arange(4, 7).reshape(imesh)), parse_placements(ipl), torch.float8_e4m3fn,
                   name=name)
    return train, infer


def special_floats(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """float32 values with NaN, +-Inf, subnormals, huge values and rounding ties sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())
    flat = x.view(-1)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, -1e-45, 3.0e38, 0.0, -0.0,
                             1.00390625, 65520.0, 448.0, 464.0])
    flat[: min(len(specials), flat.numel())] = specials[: flat.numel()]
    return x


def job_precision(w, case: str = "ok", seed: int = 11, planning: str = "global") -> dict:
    """Refit FP8 block weights (source- and destination-side quantization) and one cast weight; check them
    bit for bit against quantizing (casting) the full tensor in one process and slicing it by hand."""
    from reshard import Layout, Mesh, Replicate
    from reshard.kernels import quantize_fp8_block_reference
    from reshard.planner._blocks import scale_layout

    rank = w.rank

    refit = Refit(Group.world(), precision=lambda n: "cast" if n == CAST_WEIGHT[0] else "fp8_block",
                  staging_bytes=1 << 16, planning=planning)
    fulls = {n: special_floats(FP8_WEIGHTS[n][0], seed + i) for i, n in enumerate(FP8_WEIGHTS)}
    dests = {}
    for n in FP8_WEIGHTS:
        train, infer = _fp8_layouts(n)
        if rank in train.ranks:
            local = torch.empty(train.local_shape(rank))
            for p in train.pieces(rank):
                local[p.local_box.slices()] = fulls[n][p.global_box.slices()]
            refit.add_source(n, local, train)
        if rank in infer.ranks:
            q = torch.zeros(infer.local_shape(rank), dtype=torch.float8_e4m3fn)
            s_shape = scale_layout(infer).local_shape(rank)
            if case == "missing_scale" and n == "dense.uneven":
                scale = None
            elif case == "bad_scale" and n == "dense.uneven":
                scale = torch.zeros(tuple(x + 1 for x in s_shape))
            else:
                scale = torch.zeros(s_shape)
            refit.add_destination(n, q, infer, scale=scale)
            dests[n] = (q, scale, infer)
    cname, cshape = CAST_WEIGHT
    cfull = special_floats(cshape, seed + 99)
    ctrain = Layout(cshape, Mesh([0, 1, 2, 3]), [Replicate()], torch.float32, name=cname)
    cinfer = Layout(cshape, Mesh([4, 5, 6, 7]), [Shard(1)], torch.bfloat16, name=cname)
    if rank < 4:
        refit.add_source(cname, cfull.clone(), ctrain)
    else:
        refit.add_destination(cname, torch.zeros(cinfer.local_shape(rank), dtype=torch.bfloat16), cinfer)
    report = refit.run()
    bad = []
    if rank in range(4, 7):
        i = rank - 4
        for n, (q, scale, infer) in dests.items():
            ref_q, ref_s = quantize_fp8_block_reference(fulls[n])
            dim = infer.placements[0].dim
            size = fulls[n].shape[dim]
            lo, hi = i * -(-size // 3), min((i + 1) * -(-size // 3), size)  # torch.chunk rows of TP rank i
            want_q = ref_q.narrow(dim, lo, hi - lo)
            blocks = ref_s.narrow(dim, lo // 128, -(-hi // 128) - lo // 128)  # every block the shard touches
            if not torch.equal(bits(q), bits(want_q)):
                bad.append(f"rank {rank}: {n} fp8 weight differs")
            if not torch.equal(bits(scale), bits(blocks)):
                bad.append(f"rank {rank}: {n} scale differs")
    if rank >= 4:
        cl = refit._dests[cname][0]
        want = cfull.to(torch.bfloat16).chunk(4, 1)[rank - 4]
        if not torch.equal(bits(cl), bits(want)):
            bad.append(f"rank {rank}: cast weight differs")
    return {"bad": bad, "choices": dict(report.choices), "network": report.network_bytes}

