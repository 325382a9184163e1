"""Real Megatron-core `GPTModel`s on CPU gloo ranks, for `test_integrations_megatron.py` and the Megatron example.

Everything here is test code: the CPU workarounds megatron-core 0.16.1 needs without CUDA, TransformerEngine or
Apex (`cpu_patches`), tiny Qwen3-style models at TP x PP x EP (`build`), Megatron's own forward chained over the
pipeline stages (`megatron_logits`), and the oracle: every rank's `sharded_state_dict()` tensors placed at their
stated offsets into full Megatron tensors (`megatron_full`), then cut into Hugging Face tensors by this file's own
rules (`hf_from_megatron`, which knows nothing of the library's mapping), checked by a plain-torch forward
(`hf_logits`) against Megatron's logits.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

VOCAB = 203  # the real vocabulary; Megatron holds it padded to PADDED rows
PADDED = 256
CASES: dict[str, dict[str, Any]] = {
    # TP2 x PP2, tied embeddings (the last stage holds a synced copy of the embedding as its output layer)
    "dense": dict(tp=2, pp=2, ep=1, moe=False, tied=True),
    # PP2 x EP2 (TP1, DP2), 4 experts top-2, SequentialMLP, allgather dispatcher, untied output layer
    "moe": dict(tp=1, pp=2, ep=2, moe=True, tied=False),
    # TP2 x DP2, untied, a single stage
    "tpdp": dict(tp=2, pp=1, ep=1, moe=False, tied=False),
}
# head dim 32: vLLM's CPU attention refuses 16
HIDDEN, LAYERS, HEADS, GROUPS, HEAD_DIM, FFN, MOE_FFN, EXPERTS, TOPK = 64, 4, 8, 2, 32, 96, 32, 4, 2


def cpu_patches() -> None:
    """The four CPU workarounds megatron-core 0.16.1 needs here (each answers a real error; idempotent).

    1. the RNG tracker keeps CUDA generator states: keep none (no dropout runs here), `torch.cuda.manual_seed` a no-op;
    2. tied embeddings under PP call `weight.data.cuda()` at construction: `Tensor.cuda` returns the tensor itself;
    3. `torch.cuda.current_device()` is an allocation device (RoPE, TP gathers, router): answer `"cpu"`;
    4. the MoE router without TE reads `moe_utils.te_general_gemm`: define it as None.
    """
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    mrandom.CudaRNGStatesTracker.add = lambda self, name, seed: self.states_.__setitem__(name, None)
    mrandom.CudaRNGStatesTracker.fork = contextlib.contextmanager(lambda self, name=None: (yield))
    torch.cuda.manual_seed = lambda seed: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.current_device = lambda: "cpu"
    moe_utils.te_general_gemm = None


def config(case: str) -> Any:
    from megatron.core.transformer import TransformerConfig

    c = CASES[case]
    kw: dict[str, Any] = dict(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        num_query_groups=GROUPS, kv_channels=HEAD_DIM, normalization="RMSNorm", layernorm_epsilon=1e-6,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False, qk_layernorm=True,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=c["tp"], pipeline_model_parallel_size=c["pp"],
        expert_model_parallel_size=c["ep"], use_cpu_initialization=True, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, init_method_std=0.05,
    )
    if c.get("bias"):  # DeepSeek-V3 / GLM-4.5 routing: sigmoid scores plus a per-expert bias training updates
        kw.update(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
    if c["moe"]:
        kw.update(num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=MOE_FFN,
                  moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
                  moe_aux_loss_coeff=0.0, moe_grouped_gemm=c.get("grouped", False))
    return TransformerConfig(**kw)


def init_parallel(case: str) -> None:
    """(Re)initialise Megatron's parallel state for `case` on the 4 ranks of the default world."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    cpu_patches()
    c = CASES[case]
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=c["tp"], pipeline_model_parallel_size=c["pp"],
                                 expert_model_parallel_size=c["ep"])
    model_parallel_cuda_manual_seed(1234)


def build(case: str, seed: int = 0) -> Any:
    """This rank's `GPTModel` chunk of `case`, replicas made equal as Megatron's DDP makes them at start."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    init_parallel(case)
    c = CASES[case]
    cfg = config(case)
    if c.get("grouped"):  # GroupedMLP builds (it never runs here: its forward needs the grouped-GEMM kernels)
        from megatron.core.transformer.moe import grouped_gemm_util

        grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS if c["moe"] else None,
                                    moe_grouped_gemm=c.get("grouped", False), qk_layernorm=True)
    torch.manual_seed(seed)
    model = GPTModel(cfg, spec, vocab_size=PADDED, max_sequence_length=64,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=c["tied"], position_embedding_type="rope",
                     rotary_base=10000)
    # Megatron's DDP broadcasts parameters over the data-parallel group at start (experts over expert-DP)
    with torch.no_grad():
        for name, p in model.named_parameters():
            expert = ".experts." in name
            group = ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group()
            ranks = dist.get_process_group_ranks(group)
            dist.broadcast(p.data, src=ranks[0], group=group)
    return model


def megatron_logits(model: Any, ids: torch.Tensor) -> torch.Tensor | None:
    """Megatron's own forward over the pipeline (stages chained by send/recv); full-vocabulary logits `[b, s, V]`
    on the last stage's TP rank 0 of DP replica 0, None elsewhere."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    b, s = ids.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    model.eval()
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            x = torch.empty(s, b, HIDDEN)
            dist.recv(x, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(x)
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]  # True: masked out (Megatron's convention)
        out = model(ids, pos, mask)
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
    tp_group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, out.contiguous(), group=tp_group)
    if ps.get_tensor_model_parallel_rank() or ps.get_data_parallel_rank():
        return None
    return torch.cat(parts, dim=-1)[..., :VOCAB]


# ---- the oracle: Megatron's sharded_state_dict() offsets -> full Megatron tensors -> Hugging Face tensors -----------

def local_shards(model: Any) -> list[tuple[str, tuple, tuple, torch.Tensor]]:
    """This rank's `(key, global_shape, global_offset, data)` per sharded tensor that `sharded_state_dict()` states
    (factories built: `linear_fc1`'s gate and up halves come out as two tensors)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = []

    def visit(v: Any) -> None:
        if isinstance(v, ShardedTensorFactory):
            visit(v.build())
        elif isinstance(v, ShardedTensor):
            if v.key.endswith("_extra_state") or v.flattened_range is not None:
                return
            out.append((v.key, tuple(v.global_shape), tuple(v.global_offset), v.data.detach().clone()))
        elif isinstance(v, dict):
            for x in v.values():
                visit(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)

    visit(model.sharded_state_dict())
    return out


def megatron_full(shards: list[list[tuple]]) -> dict[str, torch.Tensor]:
    """Every rank's shards placed at their offsets: Megatron's global tensors (keys with the layer axis first)."""
    full: dict[str, torch.Tensor] = {}
    for rank_shards in shards:
        for key, shape, offset, data in rank_shards:
            t = full.setdefault(key, torch.full(shape, float("nan")))
            view = t
            pre = len(shape) - data.dim()
            for d, o in enumerate(offset):
                size = 1 if d < pre else data.shape[d - pre]
                view = view.narrow(d, o, size)
            view.copy_(data.reshape(view.shape))
    for key, t in full.items():
        assert not t.isnan().any(), f"{key}: some elements are held by no rank"
    return full


def hf_from_megatron(full: dict[str, torch.Tensor], case: str) -> dict[str, torch.Tensor]:
    """Hugging Face (Qwen3 / Qwen3-MoE) tensors cut from Megatron's global tensors by this file's rules.

    `sharded_state_dict()` names the two layer norms as checkpoints (and the TE spec) do:
    `linear_qkv.layer_norm_weight` and `linear_fc1.layer_norm_weight`, whatever the spec."""
    c = CASES[case]
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": full["embedding.word_embeddings.weight"][:VOCAB],
                                    "model.norm.weight": full["decoder.final_layernorm.weight"]}
    if not c["tied"]:
        out["lm_head.weight"] = full["output_layer.weight"][:VOCAB]
    hpg = HEADS // GROUPS
    for i in range(LAYERS):
        p, L = f"model.layers.{i}.", lambda k: full["decoder.layers." + k][i]
        qkv = L("self_attention.linear_qkv.weight").reshape(GROUPS, hpg + 2, HEAD_DIM, HIDDEN)
        out[p + "self_attn.q_proj.weight"] = qkv[:, :hpg].reshape(-1, HIDDEN)
        out[p + "self_attn.k_proj.weight"] = qkv[:, hpg].reshape(-1, HIDDEN)
        out[p + "self_attn.v_proj.weight"] = qkv[:, hpg + 1].reshape(-1, HIDDEN)
        out[p + "self_attn.o_proj.weight"] = L("self_attention.linear_proj.weight")
        out[p + "self_attn.q_norm.weight"] = L("self_attention.q_layernorm.weight")
        out[p + "self_attn.k_norm.weight"] = L("self_attention.k_layernorm.weight")
        out[p + "input_layernorm.weight"] = L("self_attention.linear_qkv.layer_norm_weight")
        out[p + "post_attention_layernorm.weight"] = L("mlp.linear_fc1.layer_norm_weight")
        if c["moe"]:
            out[p + "mlp.gate.weight"] = L("mlp.router.weight")
            fc1, fc2 = L("mlp.experts.experts.linear_fc1.weight"), L("mlp.experts.experts.linear_fc2.weight")
            for e in range(EXPERTS):
                out[p + f"mlp.experts.{e}.gate_proj.weight"] = fc1[e][:MOE_FFN]
                out[p + f"mlp.experts.{e}.up_proj.weight"] = fc1[e][MOE_FFN:]
                out[p + f"mlp.experts.{e}.down_proj.weight"] = fc2[e]
        else:
            fc1 = L("mlp.linear_fc1.weight")
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = fc1[:FFN], fc1[FFN:]
            out[p + "mlp.down_proj.weight"] = L("mlp.linear_fc2.weight")
    return {k: v.contiguous() for k, v in out.items()}


def hf_config(case: str) -> dict:
    """The Hugging Face config of `case` (for `reshard.integrations.hf` and for `hf_logits`)."""
    c = CASES[case]
    kw = dict(model_type="qwen3", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
              num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=HEAD_DIM,
              rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=c["tied"], max_position_embeddings=64)
    if c["moe"]:
        kw.update(model_type="qwen3_moe", moe_intermediate_size=MOE_FFN, num_experts=EXPERTS,
                  num_experts_per_tok=TOPK, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return kw


def hf_logits(hf: dict[str, torch.Tensor], case: str, ids: torch.Tensor) -> torch.Tensor:
    """A plain-torch forward of the Hugging Face tensors (Qwen3 / Qwen3-MoE, per-expert weights), `[b, s, V]`."""
    c = CASES[case]
    hpg = HEADS // GROUPS

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    b, s = ids.shape
    inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    ang = torch.outer(torch.arange(s).float(), inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rope(x: torch.Tensor) -> torch.Tensor:  # [b, h, s, d]
        x1, x2 = x[..., :HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def swiglu(x: torch.Tensor, g: torch.Tensor, u: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ d.T

    x = hf["model.embed_tokens.weight"][ids]
    mask = torch.full((s, s), float("-inf")).triu(1)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        h = rms(x, hf[p + "input_layernorm.weight"])
        q = (h @ hf[p + "self_attn.q_proj.weight"].T).view(b, s, HEADS, HEAD_DIM)
        k = (h @ hf[p + "self_attn.k_proj.weight"].T).view(b, s, GROUPS, HEAD_DIM)
        v = (h @ hf[p + "self_attn.v_proj.weight"].T).view(b, s, GROUPS, HEAD_DIM).transpose(1, 2)
        q = rope(rms(q, hf[p + "self_attn.q_norm.weight"]).transpose(1, 2))
        k = rope(rms(k, hf[p + "self_attn.k_norm.weight"]).transpose(1, 2))
        k, v = k.repeat_interleave(hpg, 1), v.repeat_interleave(hpg, 1)
        att = torch.softmax(q @ k.transpose(-1, -2) / HEAD_DIM ** 0.5 + mask, -1) @ v
        x = x + att.transpose(1, 2).reshape(b, s, -1) @ hf[p + "self_attn.o_proj.weight"].T
        h = rms(x, hf[p + "post_attention_layernorm.weight"])
        if c["moe"]:
            probs = torch.softmax(h @ hf[p + "mlp.gate.weight"].T, -1)
            top, idx = probs.topk(TOPK, -1)
            top = top / top.sum(-1, keepdim=True)
            y = torch.zeros_like(h)
            for e in range(EXPERTS):
                w = (top * (idx == e)).sum(-1, keepdim=True)
                pe = p + f"mlp.experts.{e}."
                y = y + w * swiglu(h, hf[pe + "gate_proj.weight"], hf[pe + "up_proj.weight"],
                                   hf[pe + "down_proj.weight"])
            x = x + y
        else:
            x = x + swiglu(h, hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"],
                           hf[p + "mlp.down_proj.weight"])
    x = rms(x, hf["model.norm.weight"])
    head = hf["model.embed_tokens.weight"] if c["tied"] else hf["lm_head.weight"]
    return x @ head.T


# ---- jobs (one per pool run; every rank is both a Megatron trainer rank and an engine rank) ----------------------

SENTINEL = -7.0  # engine tensors start filled with it; padded vocabulary rows must keep it


def hf_param_shapes(case: str) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter name -> shape of `case` (per-expert names, as checkpoints and vLLM name experts)."""
    import transformers

    cfg = dict(hf_config(case))
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    out = {}
    for n, p in model.named_parameters():
        if n.endswith("mlp.experts.gate_up_proj"):  # transformers 5 fuses experts: name them one by one
            pre = n[: -len("gate_up_proj")]
            for e in range(EXPERTS):
                out[f"{pre}{e}.gate_proj.weight"] = (MOE_FFN, HIDDEN)
                out[f"{pre}{e}.up_proj.weight"] = (MOE_FFN, HIDDEN)
                out[f"{pre}{e}.down_proj.weight"] = (HIDDEN, MOE_FFN)
        elif not n.endswith("mlp.experts.down_proj"):
            out[n] = tuple(p.shape)
    return out


def _engine(refit: Any, case: str, engine_tp: int, rank: int, config: dict | None = None) -> dict[str, torch.Tensor]:
    """This rank's engine tensors of `case` (vLLM's layouts, `engine_tp`) from the config it serves (`config`,
    default `hf_config(case)`), registered: `EngineTensor.register` declares that config's facts itself."""
    from reshard.integrations import hf

    config = config or hf_config(case)
    par = hf.EngineParallel(range(4), tp=engine_tp)
    locals_ = {}
    for t in hf.engine_tensors(hf_param_shapes(case), par, config=config, dtype=torch.float32):
        if rank in t.ranks:
            locals_[t.name] = torch.full(t.local_shape(rank), SENTINEL)
            t.register(refit, locals_[t.name])
    return locals_


def _step(model: Any, opt: Any) -> None:
    """A real optimizer step whose gradient is an elementwise function of the weights, so replicas stay equal."""
    for p in model.parameters():
        p.grad = (p.detach() * 3.0 - 0.01).clone()
    opt.step()
    opt.zero_grad()


REPLACED = "decoder.layers.0.mlp.linear_fc2.weight"


def _replace(model: Any, dtype: torch.dtype = torch.float32) -> None:
    """Replace `REPLACED` by a new `nn.Parameter` of new values (an elementwise function of the old: replicas stay
    equal), as a training step that re-creates a parameter does."""
    mod = model.get_submodule(REPLACED.rsplit(".", 1)[0])
    mod.weight = torch.nn.Parameter((mod.weight.detach() * -2.0 + 0.5).to(dtype))


def job_refit(worker: Any, case: str, engine_tp: int, change: str = "step") -> dict:
    """Register the Megatron model, refit into an engine of `engine_tp` (replicas over the rest), change the model
    (`change`: `"step"`, an optimizer step; `"replace"`: `REPLACED` re-created as a new parameter; `"replace64"`: as a
    float64 one), refit again.

    Returns per run: this rank's stated shards (the oracle's input) and its engine tensors; Megatron's logits of
    the first run (on one rank), the plan's bytes, and the second run's `ValueError` message (`error`)."""
    from reshard.comm import Group
    from reshard.integrations import megatron
    from reshard.refit import Refit

    model = build(case)
    ids = torch.arange(14).reshape(2, 7) * 13 % VOCAB
    out: dict = {"logits": megatron_logits(model, ids), "runs": []}
    refit = Refit(Group.world(), timeout=120, policy="reshard")  # every weight shard to shard, none broadcast
    out["names"] = megatron.add_sources(refit, model, vocab_size=VOCAB)
    locals_ = _engine(refit, case, engine_tp, worker.rank)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    out["error"] = None
    for run in range(2):
        if run and change == "step":
            _step(model, opt)
        elif run:
            _replace(model, torch.float64 if change == "replace64" else torch.float32)
        try:
            report = refit.run()
        except ValueError as e:
            out["error"] = str(e)
        out["runs"].append({"shards": local_shards(model), "engine": {n: t.clone() for n, t in locals_.items()}})
    out["moved_bytes"] = report.network_bytes + report.nvlink_bytes + report.local_bytes
    return out


def job_refused(worker: Any, what: str) -> dict:
    """A bad registration on one rank (`wrong_stage`: rank 2 registers a chunk built for pipeline stage 0;
    `bad_shape`: rank 1's `linear_qkv` disagrees with the config): run() must raise on every rank, moving nothing."""
    from unittest import mock

    from megatron.core import parallel_state as ps

    from reshard.comm import Group
    from reshard.integrations import megatron
    from reshard.refit import Refit

    case = "moe" if what == "wrong_stage" else "tpdp"
    model = build(case)
    if what == "wrong_stage" and worker.rank in (2, 3):  # both stage-1 ranks build it (EP collectives), rank 2 uses it
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        with mock.patch.object(ps, "get_pipeline_model_parallel_rank", return_value=0):
            other = GPTModel(config(case), get_gpt_layer_local_spec(num_experts=EXPERTS, qk_layernorm=True),
                             vocab_size=PADDED, max_sequence_length=64, pre_process=True, post_process=False,
                             position_embedding_type="rope")
        if worker.rank == 2:
            model = other
    if what == "bad_shape" and worker.rank == 1:
        attn = model.decoder.layers[0].self_attention.linear_qkv
        attn.weight = torch.nn.Parameter(torch.zeros(attn.weight.shape[0] - 16, HIDDEN))
    refit = Refit(Group.world(), timeout=120)
    megatron.add_sources(refit, model, vocab_size=VOCAB)
    locals_ = _engine(refit, case, 2, worker.rank)
    try:
        refit.run()
    except ValueError as e:
        return {"error": str(e), "untouched": all(bool((t == SENTINEL).all()) for t in locals_.values())}
    return {"error": None}


def job_facts(worker: Any) -> dict:
    """The TP2 x DP2 model (8 heads of 32, 2 query groups) into a TP1 engine whose config says 4 heads of 64 and 1
    KV head: every tensor has the same shape. Returns the `ValueError` of the run (None if it ran) and whether the
    engine's tensors are untouched."""
    from reshard.comm import Group
    from reshard.integrations import megatron
    from reshard.refit import Refit

    model = build("tpdp")
    refit = Refit(Group.world(), timeout=120)
    megatron.add_sources(refit, model, vocab_size=VOCAB)
    other = {**hf_config("tpdp"), "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64}
    locals_ = _engine(refit, "tpdp", 1, worker.rank, config=other)
    try:
        refit.run()
    except ValueError as e:
        return {"error": str(e), "untouched": all(bool((t == SENTINEL).all()) for t in locals_.values())}
    return {"error": None, "untouched": all(bool((t == SENTINEL).all()) for t in locals_.values())}


def job_unsupported(worker: Any) -> dict:
    """Registration errors every rank raises at once: no vocab_size, virtual stages, fewer query groups than TP."""
    from reshard.comm import Group
    from reshard.integrations import megatron
    from reshard.refit import Refit

    out = {}
    model = build("tpdp")
    for what, call in (("no_vocab", lambda r: megatron.add_sources(r, model)),
                       ("vpp", lambda r: megatron.add_sources(r, [model, model], vocab_size=VOCAB)),
                       ("not_megatron", lambda r: megatron.add_sources(r, torch.nn.Linear(2, 2), vocab_size=VOCAB))):
        try:
            call(Refit(Group.world()))
            out[what] = None
        except Exception as e:  # noqa: BLE001 - the test checks the type and message
            out[what] = f"{type(e).__name__}: {e}"
    CASES["tp4"] = dict(tp=4, pp=1, ep=1, moe=False, tied=False)  # 2 query groups over 4 TP ranks
    CASES["grouped"] = dict(tp=1, pp=2, ep=2, moe=True, tied=False, grouped=True)  # GroupedMLP experts
    for what in ("tp4", "grouped"):
        try:
            megatron.add_sources(Refit(Group.world()), build(what), vocab_size=VOCAB)
            out[what] = None
        except Exception as e:  # noqa: BLE001
            out[what] = f"{type(e).__name__}: {e}"
    return out


BIAS = "decoder.layers.mlp.router.expert_bias"  # Megatron's key; the engine's name is e_score_correction_bias


def job_expert_bias(worker: Any, engine_has_it: bool) -> dict:
    """A PP2 x EP2 MoE with `moe_router_enable_expert_bias`: every layer's router `expert_bias` (a buffer) is set to
    distinct values, refit into a TP2 engine that holds `mlp.gate.e_score_correction_bias` per layer (replicated on
    every engine rank), updated in place as Megatron's `finalize_model_grads` does, refit again. Returns per run the
    stated shards (the oracle) and the engine's biases; or, with `engine_has_it=False`, the `ValueError` message."""
    from megatron.core import parallel_state as ps
    from torch.distributed.tensor import Replicate

    from reshard.comm import Group
    from reshard.integrations import megatron
    from reshard.planner import Layout, Mesh
    from reshard.refit import Refit

    CASES["moe_bias"] = dict(tp=1, pp=2, ep=2, moe=True, tied=False, bias=True)
    model = build("moe_bias")
    offset = ps.get_pipeline_model_parallel_rank() * (LAYERS // 2)

    def set_bias(seed: float) -> None:
        with torch.no_grad():
            for i, layer in enumerate(model.decoder.layers):
                layer.mlp.router.expert_bias.copy_(torch.arange(EXPERTS) * 0.25 + (offset + i) + seed)

    set_bias(0.5)
    refit = Refit(Group.world(), timeout=120, policy="reshard")
    megatron.add_sources(refit, model, vocab_size=VOCAB)
    _engine(refit, "moe_bias", 2, worker.rank)
    biases = {}
    if engine_has_it:
        for i in range(LAYERS):
            name = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
            biases[name] = torch.full((EXPERTS,), SENTINEL)
            refit.add_destination(name, biases[name], Layout((EXPERTS,), Mesh(list(range(4))), [Replicate()],
                                                             torch.float32, name=name))
    out: dict = {"runs": [], "error": None}
    for run in range(2):
        if run:
            set_bias(10.0)  # in place, as finalize_model_grads' expert_bias.copy_(updated)
        try:
            refit.run()
        except ValueError as e:
            out["error"] = str(e)
            return out
        out["runs"].append({"shards": local_shards(model), "engine": {n: t.clone() for n, t in biases.items()}})
    return out


# ---- a real vLLM engine as the destination (tests/integrations/test_megatron_vllm.py) -----------------------------------------

def vllm_config(case: str) -> dict:
    """The `config.json` a vLLM engine loads for `case` (Qwen3, bfloat16)."""
    cfg = hf_config(case)
    cfg.update(architectures=["Qwen3MoeForCausalLM" if CASES[case]["moe"] else "Qwen3ForCausalLM"],
               max_position_embeddings=256, torch_dtype="bfloat16", hidden_act="silu", attention_bias=False,
               bos_token_id=0, eos_token_id=1)
    return cfg


def write_checkpoint(path: str, case: str, hf: dict[str, torch.Tensor]) -> None:
    """`config.json` + `model.safetensors` (bfloat16) of the Hugging Face tensors `hf`."""
    import json
    import os

    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(vllm_config(case), f)
    save_file({n: t.to(torch.bfloat16).contiguous() for n, t in hf.items()}, os.path.join(path, "model.safetensors"))


def job_shards(worker: Any, case: str) -> list:
    """Build this rank's model (kept for the trainer jobs) and return its stated shards (the oracle's input)."""
    model = build(case)
    worker.scratch["megatron/model"] = model
    return local_shards(model)


def job_trainer_init(worker: Any, case: str, port: int, engine_world: int) -> None:
    """`ReshardTrainer.trainer_init` with the Megatron model as its source (the engine joins concurrently)."""
    from reshard.integrations.vllm import ReshardTrainer, ReshardTrainerInitInfo

    info = ReshardTrainerInitInfo(rank=worker.rank, master_address="127.0.0.1", master_port=port, world_size=4,
                                  engine_world_size=engine_world, timeout_s=120.0, precision="cast")
    worker.scratch["megatron/trainer"] = ReshardTrainer.trainer_init(
        info, source=worker.scratch["megatron/model"], config=vllm_config(case))


def job_send(worker: Any) -> int:
    """`send_weights()` (the engine updates concurrently); the plan's network bytes."""
    return worker.scratch["megatron/trainer"].send_weights().network_bytes


def job_trainer_close(worker: Any) -> None:
    worker.scratch.pop("megatron/trainer").shutdown()


@contextlib.contextmanager
def _cuda_to_cpu() -> Any:
    """A fifth CPU workaround, for Megatron's optimizers only, undone on exit: they allocate small buffers with
    `device='cuda'` (`MegatronOptimizer._dummy_overflow_buf`) and accept parameters whose `Tensor.type()` is a
    `torch.cuda.*Tensor` only: tensor factories asked for `'cuda'` make CPU tensors, and `type()` names CPU tensors
    as CUDA ones."""
    saved = {n: getattr(torch, n) for n in ("tensor", "zeros", "empty", "ones", "full")}
    real_type = torch.Tensor.type

    def factory(f: Any) -> Any:
        def patched(*a: Any, **k: Any) -> Any:
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return f(*a, **k)
        return patched

    def tensor_type(self: torch.Tensor, *a: Any, **k: Any) -> Any:
        out = real_type(self, *a, **k)
        return out.replace("torch.", "torch.cuda.", 1) if not a and not k and isinstance(out, str) else out

    try:
        for n, f in saved.items():
            setattr(torch, n, factory(f))
        torch.Tensor.type = tensor_type
        yield
    finally:
        for n, f in saved.items():
            setattr(torch, n, f)
        torch.Tensor.type = real_type


def job_overlap_param_gather(worker: Any, probe: bool) -> dict:
    """TP2 x DP2 in Megatron's `DistributedDataParallel` with the distributed optimizer and `overlap_param_gather`:
    refit, one real training step (forward, backward, `finish_grad_sync`, `optimizer.step()`, `zero_grad()`), refit
    right after it. Megatron leaves the other DP ranks' updated shards out of the parameters until the next
    forward's all-gather, so the probe (`probe=True`) reads the parameters right after the step and again after
    forcing that all-gather (`start_param_sync(force_sync=True)`). Returns per run the stated shards after the
    gather (the oracle) and the engine's tensors; the probe returns how many parameter elements the gather changed.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from reshard.comm import Group
    from reshard.integrations import megatron
    from reshard.refit import Refit

    case = "tpdp"
    model = build(case)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_param_gather=True,
                                               overlap_grad_reduce=False, grad_reduce_in_fp32=True)
    ddp = DistributedDataParallel(config(case), ddp_config, model)
    with _cuda_to_cpu():
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.05, use_distributed_optimizer=True,
                                                     params_dtype=torch.float32), [ddp])
    ids = torch.arange(14).reshape(2, 7) * 13 % VOCAB

    def train_step() -> None:
        ddp.train()
        ddp.zero_grad_buffer()
        pos = torch.arange(7).unsqueeze(0).expand(2, 7)
        mask = torch.ones(7, 7, dtype=torch.bool).triu(1)[None, None]
        logits = ddp(ids, pos, mask)
        (logits.float().pow(2).mean() * 100).backward()
        finalize_model_grads([ddp])  # Megatron's own: DP reduce-scatter, TP all-reduce of replicated weights' grads
        with _cuda_to_cpu():
            opt.step()
        opt.zero_grad()

    if probe:
        train_step()
        before = [p.detach().clone() for p in model.parameters()]
        ddp.start_param_sync(force_sync=True)
        changed = sum(int((a != p.detach()).sum()) for a, p in zip(before, model.parameters()))
        return {"changed": changed, "total": sum(p.numel() for p in model.parameters())}
    refit = Refit(Group.world(), timeout=120, policy="reshard")
    megatron.add_sources(refit, ddp, vocab_size=VOCAB)
    locals_ = _engine(refit, case, 1, worker.rank)
    out: dict = {"runs": []}
    for run in range(2):
        if run:
            train_step()
        refit.run()
        engine = {n: t.clone() for n, t in locals_.items()}
        ddp.start_param_sync(force_sync=True)  # the oracle: the parameters once the all-gather has run
        out["runs"].append({"shards": local_shards(model), "engine": engine})
    return out


def job_trainer_init_fails(worker: Any, port: int) -> str | None:
    """`ReshardTrainer.trainer_init(source=GPTModel)` without `vocab_size` (4 trainer ranks, 1 engine rank that the
    test process runs): every trainer rank's error (`"TypeName: message"`), None if it ran."""
    from reshard.integrations.vllm import ReshardTrainer, ReshardTrainerInitInfo

    model = build("tpdp")
    info = ReshardTrainerInitInfo(rank=worker.rank, master_address="127.0.0.1", master_port=port, world_size=4,
                                  engine_world_size=1, timeout_s=60.0)
    try:
        ReshardTrainer.trainer_init(info, source=model)
    except Exception as e:  # noqa: BLE001 - the test checks the type and message
        return f"{type(e).__name__}: {e}"
    return None
