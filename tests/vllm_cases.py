"""Helpers of the real-vLLM tests (`tests/integrations/test_vllm_engine.py`): tiny Qwen3 configs and checkpoints, a pool of
trainer processes, and the functions run inside vLLM's workers (`collective_rpc`, shipped by value)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import traceback
from typing import Any

import torch

HIDDEN, INTER, HEADS, HEAD_DIM, LAYERS = 256, 512, 8, 32, 2


def config(kv_heads: int, vocab: int) -> dict[str, Any]:
    """A 2-layer Qwen3 (hidden 256, 8 query heads of 32, `kv_heads` KV heads), untied embeddings."""
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": HIDDEN,
            "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
            "num_key_value_heads": kv_heads, "head_dim": HEAD_DIM, "vocab_size": vocab,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
            "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1}


def moe_config(kv_heads: int, vocab: int, num_experts: int = 4) -> dict[str, Any]:
    """The same Qwen3 with a mixture-of-experts MLP in every layer (`num_experts` experts of 128, top 2)."""
    cfg = config(kv_heads, vocab)
    cfg.update({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": num_experts,
                "num_experts_per_tok": 2, "moe_intermediate_size": 128, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "norm_topk_prob": True})
    return cfg


def hf_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HuggingFace name -> shape of every weight of `cfg`'s Qwen3 (MoE experts stacked: `...mlp.experts.gate_proj
    .weight` `[E, I, H]`, as a trainer holds them; `write_checkpoint` stores them per expert, as HuggingFace does)."""
    h, i, v, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
                                       "lm_head.weight": (v, h)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,)})
        if "num_experts" in cfg:
            e, mi = cfg["num_experts"], cfg["moe_intermediate_size"]
            for k in ("gate_proj", "up_proj", "down_proj"):
                del out[p + f"mlp.{k}.weight"]
            out.update({p + "mlp.gate.weight": (e, h), p + "mlp.experts.gate_proj.weight": (e, mi, h),
                        p + "mlp.experts.up_proj.weight": (e, mi, h), p + "mlp.experts.down_proj.weight": (e, h, mi)})
    return out


Version = int | tuple  # a seed, or (seed, (lr, step seed), ...): the seed's weights after those training steps


def hf_weights(cfg: dict[str, Any], version: Version) -> dict[str, torch.Tensor]:
    """Random bfloat16 weights of `version`: a seed (norms near 1, matrices ~ N(0, 0.05)), or `(seed, (lr, s),
    ...)`, that seed's float32 master weights after steps of `lr * N(0, 1)` (noise of seed `s`), cast to bfloat16 as
    a trainer sends them (at a small `lr` most bfloat16 values do not change: what delta updates exploit)."""
    seed, steps = (version, ()) if isinstance(version, int) else (version[0], version[1:])
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in hf_shapes(cfg).items():
        w = torch.randn(shape, generator=g) * 0.05
        out[name] = w + 1.0 if len(shape) == 1 else w
    for lr, step_seed in steps:
        gs = torch.Generator().manual_seed(step_seed)
        for name in out:
            out[name] = out[name] + lr * torch.randn(out[name].shape, generator=gs)
    return {n: w.to(torch.bfloat16) for n, w in out.items()}


def write_checkpoint(path: str, cfg: dict[str, Any], seed: Version) -> None:
    """`config.json` + `model.safetensors` of version `seed`: what a vLLM engine loads the normal way."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    weights = {}
    for name, w in hf_weights(cfg, seed).items():
        head, sep, tail = name.partition(".mlp.experts.")
        if sep:  # per expert on disk: ...mlp.experts.{e}.gate_proj.weight
            weights.update({f"{head}.mlp.experts.{e}.{tail}": w[e].clone() for e in range(w.shape[0])})
        else:
            weights[name] = w
    save_file(weights, os.path.join(path, "model.safetensors"))


# ---- model families from transformers configs (the sweep) ---------------------------------------------------------
_BASE = {"hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
         "num_attention_heads": HEADS, "head_dim": HEAD_DIM, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
         "rope_theta": 10000.0, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1}
FAMILIES: dict[str, dict[str, Any]] = {
    # tied, one KV head: fewer KV heads than the engine's TP 2 (vLLM replicates it)
    "llama-tied": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_key_value_heads": 1,
                   "vocab_size": 1001, "tie_word_embeddings": True, "hidden_act": "silu"},
    # q/k/v biases, tied (as Qwen2.5-0.5B), an odd vocabulary
    "qwen2-tied": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_key_value_heads": 2,
                   "vocab_size": 1003, "tie_word_embeddings": True, "hidden_act": "silu"},
    # q/k norms, tied (as Qwen3-0.6B)
    "qwen3-tied": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_key_value_heads": 4,
                   "vocab_size": 1000, "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False},
    # sliding-window attention (shorter than the prompts and outputs), untied
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "num_key_value_heads": 2,
                "vocab_size": 1000, "tie_word_embeddings": False, "hidden_act": "silu", "sliding_window": 4},
    # the embedding scaled by sqrt(hidden) and (1 + w) norms in the forward, GeLU-tanh MLP, tied
    "gemma": {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "num_key_value_heads": 1,
              "vocab_size": 1000, "tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh",
              "hidden_activation": "gelu_pytorch_tanh"},
    # fused in the checkpoint: `qkv_proj` [q; k; v] and `gate_up_proj` [gate; up], which vLLM loads whole, untied
    "phi3": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "num_key_value_heads": 2,
             "vocab_size": 1000, "tie_word_embeddings": False, "hidden_act": "silu", "pad_token_id": 0},
    # fused `c_attn` [q | k | v] of HuggingFace Conv1D layers (every Linear stored [in, out], which vLLM transposes
    # as it loads), learned positions, LayerNorms with biases, tied
    "gpt2": {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 1000,
             "tie_word_embeddings": True, "n_inner": INTER},
}


# families whose fused engine tensors `reshard.integrations.hf` does not describe as vLLM holds them (it takes Phi-3's
# `qkv_proj` / `gate_up_proj` for replicated tensors, GPT-2's Conv1D weights in their [in, out] orientation): the
# sweep's check that it names the backend's engine tensors is left out for them
HF_INTEGRATION_DIFFERS = {"phi3", "gpt2"}


def family_config(family: str) -> dict[str, Any]:
    """A tiny 2-layer config of `family` (a `config.json` dict)."""
    return {**_BASE, **FAMILIES[family]}


def hf_model(cfg: dict[str, Any], seed: int) -> torch.nn.Module:
    """The `transformers` model of `cfg`, bfloat16, with weights of version `seed` (the same on every call): norms
    near 1, everything else ~ N(0, 0.05); tied parameters stay tied."""
    from transformers import AutoConfig, AutoModelForCausalLM

    rest = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "torch_dtype")}
    config = AutoConfig.for_model(cfg["model_type"], **rest)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for k, (name, p) in enumerate(model.named_parameters()):
            g = torch.Generator().manual_seed(seed * 1000 + k)
            w = torch.randn(p.shape, generator=g) * 0.05
            p.copy_(w + 1.0 if "norm" in name and p.dim() == 1 and cfg["model_type"] != "gemma" else w)
    return model


def write_hf_checkpoint(path: str, cfg: dict[str, Any], seed: int) -> None:
    """`hf_model(cfg, seed).save_pretrained(path)`: the checkpoint as transformers writes it (a tied model stores
    its embedding once)."""
    hf_model(cfg, seed).save_pretrained(path)


def hf_engine_tensors(cfg: dict[str, Any], tp: int, first_rank: int) -> dict[str, list]:
    """What `reshard.integrations.hf` says the engine holds on its first rank: engine tensor -> (its global
    components, local shape)."""
    from reshard.integrations.hf import EngineParallel, engine_tensors

    ets = engine_tensors(hf_model(cfg, 0), EngineParallel(range(first_rank, first_rank + tp), tp=tp))
    return {t.name: [[g for g, _ in t.components], list(t.local_shape(first_rank))] for t in ets}


def engine_names(worker: Any) -> dict[str, list]:
    """What the live engine's backend registered on this worker: engine tensor -> (its global components, local
    shape), tied ones left out (they are the first name's tensor)."""
    return {t.name: [[g for g, _ in t.components], list(t.tensor.shape)]
            for t in worker.weight_transfer_engine.targets if t.alias_of is None}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the trainer: 2 ranks, TP-style (columns S(0), rows S(1)) and FSDP-style (S(0)) shards --------------------------
def trainer_layout(name: str, shape: tuple[int, ...], ranks: list[int]) -> Any:
    from reshard import Layout, Mesh, Shard

    if ".experts." in name:  # expert-parallel on the trainer: experts split over its ranks
        dim = 0
    else:
        dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight", "embed_tokens.weight")) else 0
    return Layout(shape, Mesh(ranks), [Shard(dim)], torch.bfloat16, name=name)


def _fill(local: torch.Tensor, full: torch.Tensor, layout: Any, rank: int) -> None:
    for piece in layout.pieces(rank):
        g = tuple(slice(o, o + s) for o, s in zip(piece.global_box.offsets, piece.global_box.shape))
        lo = tuple(slice(o, o + s) for o, s in zip(piece.local_box.offsets, piece.local_box.shape))
        local[lo] = full[g]


def _full_weights(cfg: dict[str, Any], seed: int, hf: bool) -> dict[str, torch.Tensor]:
    """Every weight of version `seed`, one per tensor (a tied one under its first name)."""
    if hf:
        return {n: p.detach() for n, p in hf_model(cfg, seed).named_parameters()}
    return hf_weights(cfg, seed)


def _trainer(rank: int, world: int, commands: Any, results: Any) -> None:
    """One trainer rank: `("init", port, cfg, engine_world, hf[, delta, planning, comm_backend])`, `("send", seed)`,
    `("close",)`,
    `("exit",)`, and the bad updates `("retype", name, dtype)`, `("narrow", name, bad)`;
    `hf`: the weights are a `transformers` model's (`hf_model`), else `hf_weights`."""
    from reshard.integrations.vllm import ReshardTrainer, ReshardTrainerInitInfo

    trainer = weights = layouts = cfg = hf = None
    narrowed: dict[str, torch.Tensor] = {}
    while True:
        cmd = commands.get()
        try:
            if cmd[0] == "exit":
                return
            if cmd[0] == "init":
                _, port, cfg, engine_world, hf, *rest = cmd
                full = _full_weights(cfg, 0, hf)
                layouts = {n: trainer_layout(n, tuple(w.shape), list(range(world))) for n, w in full.items()}
                weights = {n: torch.zeros(lay.local_shape(rank), dtype=torch.bfloat16) for n, lay in layouts.items()}
                info = ReshardTrainerInitInfo(rank=rank, master_address="127.0.0.1", master_port=port,
                                              world_size=world, engine_world_size=engine_world, timeout_s=120.0,
                                              delta=bool(rest and rest[0]),
                                              planning=rest[1] if len(rest) > 1 else "auto",
                                              comm_backend=rest[2] if len(rest) > 2 else None)
                if info.comm_backend == "reshard_nccl_rules":  # NCCL's rules on CPU: one device id per rank
                    from reshard.testing import set_rules_device

                    set_rules_device(1 + rank)  # the engine worker keeps device 0
                source = {n: (weights[n], layouts[n]) for n in weights}
                conv1d = []
                if hf:  # a state_dict's view: a tied parameter under each of its names, the same local tensor
                    from transformers.pytorch_utils import Conv1D

                    model = hf_model(cfg, 0)
                    first = {}
                    for n, p in model.named_parameters(remove_duplicate=False):
                        source[n] = source[first.setdefault(id(p), n)]
                    conv1d = [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Conv1D)]
                trainer = ReshardTrainer.trainer_init(info, source=source, transposed=conv1d)
                results.put((rank, "ok", None))
            elif cmd[0] == "send":
                for n, full in _full_weights(cfg, cmd[1], hf).items():  # the optimizer step: in place
                    _fill(narrowed.get(n, weights[n]), full, layouts[n], rank)
                report = trainer.send_weights(full=len(cmd) > 2 and cmd[2] == "full")
                results.put((rank, "ok", (report.first_run, report.network_bytes, sum(report.encoded_bytes.values()),
                                          sum(report.dense_bytes.values()))))
            elif cmd[0] == "die":  # a trainer rank that dies during an update: this one exits, the others send
                if rank == cmd[1]:
                    os._exit(3)
                for n, full in _full_weights(cfg, cmd[2], hf).items():
                    _fill(weights[n], full, layouts[n], rank)
                try:
                    trainer.send_weights()
                    results.put((rank, "ok", "sent"))
                except BaseException as e:
                    results.put((rank, "ok", f"{type(e).__name__}: {e}"))
            elif cmd[0] == "narrow":  # a bad update: the weight's local tensor loses its last row, or gets it back
                _, name, bad = cmd
                if bad:
                    narrowed[name] = weights[name].data
                    weights[name].data = weights[name].data[:-1].clone()
                else:
                    weights[name].data = narrowed.pop(name)
                results.put((rank, "ok", None))
            elif cmd[0] == "retype":  # a bad update: the weight's local tensor becomes another dtype, or back
                _, name, dtype = cmd
                weights[name].data = weights[name].data.to(getattr(torch, dtype))
                results.put((rank, "ok", None))
            elif cmd[0] == "close":
                trainer.shutdown()
                trainer = None
                results.put((rank, "ok", None))
        except BaseException as e:  # reported to the test, which fails with it
            results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class Trainers:
    """`world` trainer processes, started once and reused by every engine session (`target(rank, world, *args,
    commands, results)`: `_trainer` by default)."""

    what = "trainer"

    def __init__(self, world: int = 2, target: Any = None, args: tuple = ()) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.commands = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=target or _trainer, args=(r, world, *args, self.commands[r], self.results),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def post(self, *cmd: Any) -> None:
        for q in self.commands:
            q.put(cmd)

    def wait(self, timeout: float = 300.0) -> list[Any]:
        got = sorted(self.results.get(timeout=timeout) for _ in range(self.world))
        errors = [msg for _, status, msg in got if status == "error"]
        if errors:
            raise AssertionError(f"{self.what} failed:\n" + "\n".join(errors))
        return [value for _, _, value in got]

    def close(self) -> None:
        self.post("exit")
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


# ---- run inside vLLM's workers (collective_rpc) -------------------------------------------------------------------
def forward_tensors(worker: Any) -> dict[str, torch.Tensor]:
    """Every tensor the model's forward can read, and what each GEMM layer computes, as CPU copies.

    Keys: `module.param` for parameters and buffers, `module|cpu_linear[k]` for the tensors held by the CPU
    backend's GEMM closures (`cpu_linear`), and `module|probe` for a per-layer GEMM probe (`gemm_probes`): the
    CPU backend may hold a Linear weight in a form no tensor shows (a oneDNN handle, with the parameter left empty,
    on processors without AMX), so the probe is what checks those weights, on every processor.
    """
    model = worker.model_runner.get_model()
    out = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        out[name] = t.detach().cpu().clone()
    for name, module in model.named_modules(remove_duplicate=False):
        fn = getattr(module, "cpu_linear", None)
        for k, cell in enumerate(getattr(fn, "__closure__", None) or ()):
            if isinstance(cell.cell_contents, torch.Tensor):
                out[f"{name}|cpu_linear[{k}]"] = cell.cell_contents.detach().cpu().clone()
    out.update(gemm_probes(model))
    return out


def gemm_probes(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`module|probe` -> the layer's own GEMM (`quant_method.apply`, as its forward calls it, bias included) on a
    fixed `[3, in_features]` input, for every Linear and vocabulary layer (tied layers under each name)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    out = {}
    with torch.no_grad():
        for name, layer in model.named_modules(remove_duplicate=False):
            if isinstance(layer, LinearBase):
                k = getattr(layer, "input_size_per_partition", None) or layer.input_size  # (a router: whole)
                bias = None if layer.skip_bias_add else layer.bias
            elif isinstance(layer, VocabParallelEmbedding):
                k, bias = layer.embedding_dim, None
            else:
                continue
            dtype = getattr(layer, "params_dtype", torch.bfloat16)
            x = torch.randn(3, k, generator=torch.Generator().manual_seed(k)).to(dtype)
            out[f"{name}|probe"] = layer.quant_method.apply(layer, x, bias).detach().cpu().clone()
    return out


def module_of(key: str) -> str:
    """The module a `forward_tensors` key belongs to (`model.norm.weight` -> `model.norm`)."""
    return key.partition("|")[0] if "|" in key else key.rpartition(".")[0]


def reprocessed_layers(worker: Any) -> tuple[list[str], list[str]]:
    """Asked of the live engine: the layers whose weights the backend re-processes after each update, and every
    layer whose forward tensors its commit writes (those and the staged norms)."""
    engine = worker.weight_transfer_engine
    return engine.reprocessed_layers(), engine.committed_layers()


NOTE = "reshard-note"  # a `record_property` key whose value the run's summary prints (tests/conftest.py)


def omp_threads_bind(tp: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for a CPU engine of `tp` workers: one CPU this process may use per worker (the
    first `tp` of its affinity set, whatever their numbers), or `nobind` for TP 1 or with fewer CPUs than workers."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return "|".join(str(c) for c in cpus[:tp]) if 1 < tp <= len(cpus) else "nobind"


def gemm_branches(worker: Any) -> dict[str, str]:
    """Which CPU GEMM each Linear layer's `cpu_linear` is (vLLM chooses by processor and shape; `_branch` names
    them). Used to check that a forced branch was taken, and to report the branches a run took."""
    from vllm.model_executor.layers.linear import LinearBase

    out = {}
    for name, layer in worker.model_runner.get_model().named_modules():
        fn = getattr(layer, "cpu_linear", None)
        if isinstance(layer, LinearBase) and fn is not None:
            out[name] = _branch(fn)
    return out


def dispatched_branch(shape: tuple[int, int] = (512, 256)) -> str:
    """The branch vLLM's own CPU GEMM dispatch takes in this process (with whatever `force_gemm` set) for a bfloat16
    weight of `shape` on a bare layer, after running it once: the branch can execute here, and its output is
    `F.linear`'s to bfloat16 accuracy."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=gen).to(torch.bfloat16)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    x = torch.randn(3, shape[1], generator=gen).to(torch.bfloat16)
    got = layer.cpu_linear(x, layer.weight, None).float()
    want = torch.nn.functional.linear(x.float(), weight.float())
    assert torch.allclose(got, want, rtol=0.05, atol=0.05 * float(want.abs().max())), "the branch computes wrongly"
    return _branch(layer.cpu_linear)


def _branch(fn: Any) -> str:
    """A dispatched `cpu_linear` by what its closure holds: `"sgl"` (a packed weight for the AMX kernel),
    `"onednn"` (a oneDNN handle), `"zentorch"` (a zentorch weight) or `"torch"` (`F.linear`)."""
    free = set(getattr(getattr(fn, "__code__", None), "co_freevars", ()))
    return ("sgl" if "packed_weight" in free else "onednn" if "handler" in free
            else "zentorch" if "zen_weight" in free else "torch")


# The switches of vLLM's CPU GEMM dispatch (`dispatch_cpu_unquantized_gemm`, read in vLLM 0.32): it takes zentorch
# on a Zen platform with zentorch installed, else the AMX kernel where `check_cpu_sgl_kernel` allows it (AMX tiles,
# shape limits), else oneDNN where vLLM was built with it (`_supports_onednn`) and the handle can be made, else
# `F.linear`. Forcing a branch turns off the ones before it; what the dispatch then takes is asked of it
# (`forced_branch`), since a processor may lack the branch asked for too.
GEMM_FORCINGS = ("onednn", "torch")


def force_gemm(monkeypatch: Any, branch: str) -> None:
    """Make the CPU GEMM dispatch in this process skip every branch it prefers to `branch` (one of
    `GEMM_FORCINGS`) until `monkeypatch` undoes it: an in-process engine's worker then loads, and re-processes,
    every Linear layer that way where the processor can, else on the next branch it can run."""
    import vllm._custom_ops as ops
    from vllm.model_executor.layers import utils
    from vllm.platforms import current_platform

    assert branch in GEMM_FORCINGS, branch
    monkeypatch.setattr(current_platform, "is_zen_cpu", lambda: False)
    monkeypatch.setattr(utils, "check_cpu_sgl_kernel", lambda n, k, dtype: False)
    if branch == "torch":
        monkeypatch.setattr(ops, "_supports_onednn", False)


def forced_branch(branch: str) -> str:
    """The branch the dispatch takes on this processor when `branch` is forced (`force_gemm`)."""
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        force_gemm(mp, branch)
        return dispatched_branch()


def other_gemm_branches() -> list[str]:
    """The forcings that make the dispatch take a branch other than its default on this processor, one per
    distinct branch (empty where `F.linear` is all this processor runs)."""
    seen = {dispatched_branch()}
    out = []
    for forcing in GEMM_FORCINGS:
        got = forced_branch(forcing)
        if got not in seen:
            seen.add(got)
            out.append(forcing)
    return out


def skip_reprocessing(worker: Any, skip: bool) -> None:
    """Negative control: make the backend skip its commit (re-processing and the norms' copy: its writes then reach
    no tensor the forward reads)."""
    engine = worker.weight_transfer_engine
    if skip:
        engine.reprocess = lambda: None
    elif "reprocess" in vars(engine):
        del engine.reprocess


def add_unreachable(worker: Any, add: bool) -> None:
    """Give (or take back from) layer 0's MLP a parameter with its own weight_loader that no layout rule covers."""
    layer = worker.model_runner.get_model().model.layers[0].mlp
    if add:
        extra = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        extra.weight_loader = lambda param, w: param.data.copy_(w)
        layer.register_parameter("router_bias", extra)
    else:
        del layer._parameters["router_bias"]


def versions(worker: Any) -> tuple[str | None, str | None]:
    """The backend's `(live_version, staged_version)`."""
    e = worker.weight_transfer_engine
    return e.live_version, e.staged_version


def last_error(worker: Any) -> str | None:
    return worker.weight_transfer_engine.last_error


def unreachable_error(worker: Any) -> str:
    """Give a layer a parameter with its own weight_loader that no layout rule covers; return the error."""
    from reshard.integrations.vllm import engine_targets

    model = worker.model_runner.get_model()
    layer = model.model.layers[0].mlp
    extra = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    extra.weight_loader = lambda param, w: param.data.copy_(w)
    layer.register_parameter("router_bias", extra)
    try:
        engine_targets(model, [list(range(worker.vllm_config.parallel_config.tensor_parallel_size))])
    except ValueError as e:
        return str(e)
    finally:
        del layer._parameters["router_bias"]
    return ""


def last_report(worker: Any) -> Any:
    return worker.weight_transfer_engine.last_report


def planning(worker: Any) -> str:
    """How the backend's refit plans (`Refit.planning`): `"global"` or `"local"`."""
    return worker.weight_transfer_engine.refit.planning


def received_bytes(worker: Any) -> int:
    """The bytes this worker received in the backend's last update (its `ExecutionReport`'s counters: network and
    local copies)."""
    ex = worker.weight_transfer_engine.last_report.execution
    return 0 if ex is None else ex.bytes_received + ex.bytes_copied_locally


def stage_layers(worker: Any) -> tuple[int, int]:
    """The live model's own `[start_layer, end_layer)` on this worker's pipeline stage."""
    model = worker.model_runner.get_model()
    return model.model.start_layer, model.model.end_layer


# ---- engines for the vLLM test modules -------------------------------------------------------------------

PROMPTS = [[5, 6, 7, 8], [100, 200, 300, 17, 42]]
"""The prompts `observe` generates from."""


def start_engine(path: str, tp: int, monkeypatch: Any, *, in_process: bool = False, pp: int = 1, ep: bool = False):
    """A vLLM CPU engine of the checkpoint at `path`. `in_process` (TP 1): the engine core and its worker run in
    this process (vLLM's `uni` executor without engine-core multiprocessing), which starts in ~3 s instead of ~20 s
    of spawning and importing two processes; the TP 2 engines keep vLLM's multiprocess executor. `pp`: pipeline
    stages (multiprocess; `pp_intermediate_tensors` is applied to every worker before the first `generate`). `ep`:
    expert parallelism over the TP ranks (`enable_expert_parallel`; `ep_expert_map` is applied likewise)."""
    from vllm import LLM

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of the test's own functions
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", omp_threads_bind(tp * pp))
    extra = {}
    if in_process:
        assert tp == 1 and pp == 1
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        extra["distributed_executor_backend"] = "uni"
    else:
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    if pp > 1:
        extra["pipeline_parallel_size"] = pp
    if ep:
        extra["enable_expert_parallel"] = True
    llm = LLM(model=path, tensor_parallel_size=tp, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=128, max_num_seqs=2, seed=0, weight_transfer_config={"backend": "reshard"}, **extra)
    llm.collective_rpc(amx_permission)
    if pp > 1:
        llm.collective_rpc(pp_intermediate_tensors)
    if ep:
        llm.collective_rpc(ep_expert_map)
    return llm


def amx_permission(worker: Any) -> None:
    """vLLM CPU workaround (test-side only), on every worker before the first forward: on a processor with AMX, a
    worker dies of SIGILL in an attention (`vllm/_custom_ops.py:3927 cpu_attention_with_kv_cache`) when its first
    AMX instruction comes before anything in its process asked Linux for AMX tile state
    (`arch_prctl(ARCH_REQ_XCOMP_PERM)`): `vllm/v1/attention/backends/cpu_attn.py:544` picks the AMX kernel by
    `torch.cpu._is_amx_tile_supported()`, which reads CPUID only. Seen on a PP engine's first stage and on an
    in-process TP1 engine generating one prompt at a time (the pytest process itself died). Asked here with
    `torch._C._cpu._init_amx()` (False and harmless without AMX)."""
    torch._C._cpu._init_amx()


def ep_expert_map(worker: Any) -> None:
    """vLLM CPU workaround (test-side only), expert parallelism: `CPUUnquantizedExperts.apply`
    (`vllm/model_executor/layers/fused_moe/experts/cpu_moe.py:269`) never passes its `expert_map` to the kernel
    (`cpu_fused_moe`, `cpu_moe.py:303`), so the kernel indexes this rank's local experts with global ids and the
    second EP rank segfaults in its first forward (`csrc/cpu/cpu_fused_moe.cpp:242 fused_moe_impl`). Patched in this
    worker's process: the top-k ids are mapped through the expert map to local slots, and other ranks' experts get
    zero weight (the layer's all-reduce sums the ranks' partial outputs)."""
    import inspect

    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    original = CPUUnquantizedExperts.apply
    if getattr(original, "__ep_map__", False):
        return

    signature = inspect.signature(original)

    def apply(*args: Any, **kwargs: Any) -> Any:
        call = signature.bind(*args, **kwargs)
        expert_map = call.arguments["expert_map"]
        if expert_map is not None:
            ids, weights = call.arguments["topk_ids"], call.arguments["topk_weights"]
            local = expert_map[ids.long()]
            call.arguments["topk_weights"] = weights.masked_fill(local < 0, 0.0)
            call.arguments["topk_ids"] = local.clamp(min=0).to(ids.dtype)
        return original(*call.args, **call.kwargs)

    apply.__ep_map__ = True
    CPUUnquantizedExperts.apply = apply


def local_experts(worker: Any) -> list[list[int]]:
    """Per MoE layer, the global expert ids the live layer holds (`expert_map_manager.get_local_expert_ids()`)."""
    model = worker.model_runner.get_model()
    return [[int(g) for g in layer.mlp.experts.expert_map_manager.get_local_expert_ids()]
            for layer in model.model.layers]


def pp_intermediate_tensors(worker: Any) -> None:
    """vLLM CPU workarounds (test-side only) for pipeline parallelism, on every worker before the first forward:
    - a later stage's first forward fails at `vllm/v1/worker/gpu_model_runner.py:3174` (`assert
      self.intermediate_tensors is not None` in `sync_and_gather_intermediate_tensors`), because
      `CPUWorker._should_warm_up_model()` (`vllm/v1/worker/cpu_worker.py:190`) skips the warm-up `_dummy_run` for an
      eager model with `VLLM_CPU_KVCACHE_SPACE`, and that run is what allocates them (`gpu_model_runner.py:5801`):
      allocated here as the warm-up would;
    - (the first stage's SIGILL on a processor with AMX: `amx_permission`, which `start_engine` applies to every
      engine)."""
    from vllm.distributed.parallel_state import get_pp_group

    runner = worker.model_runner
    if not get_pp_group().is_first_rank and runner.intermediate_tensors is None:
        runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
            batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)


def close_engine(llm) -> None:
    """Stop the engine now, so no two engines share the 2 CPUs. vLLM does this when the `LLM` is collected (not
    always promptly), granting 5 s before it kills its processes; its CPU workers never exit in that time. An
    in-process engine's distributed state is torn down too, so the next engine can build its own."""
    llm.llm_engine.engine_core.shutdown(timeout=1.0)
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()


def reload(llm, path: str) -> None:
    """vLLM's own in-place reload of the checkpoint at `path` (its loader, then its weight post-processing)."""
    llm.collective_rpc("reload_weights", kwargs={"weights_path": path})


def observe(llm, one_by_one: bool = True) -> tuple[list, list[dict[str, torch.Tensor]]]:
    """Greedy tokens with their log-probs, and every worker's forward tensors. `one_by_one` (the default): each
    prompt in a `generate` of its own, after a prefix-cache reset: how vLLM batches the prompts can change from run
    to run (a pipelined engine's batch queue; the scheduler's timing on a loaded machine), and the CPU GEMM's result
    depends on the batch's rows on some processors (on an Intel Xeon with AMX, a Qwen2 TP2 engine with weights
    bit-equal to the oracle's gave log-probs up to 0.016 apart with the prompts batched together)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)
    if one_by_one:
        outs = []
        for p in PROMPTS:
            llm.reset_prefix_cache()
            outs.extend(llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False))
    else:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    tokens = [(list(o.outputs[0].token_ids),
               [{k: v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs]) for o in outs]
    return tokens, llm.collective_rpc(forward_tensors)


def differences(got, want, logprob_atol: float = 0.0) -> list[str]:
    """What differs between two observations (empty when equal bit for bit; with `logprob_atol`, the tokens and the
    top log-probs' token ids must be equal, their log-probs within `logprob_atol`)."""
    (gt, gtens), (wt, wtens) = got, want
    diffs = [] if _close(gt, wt, logprob_atol) else [f"tokens/logprobs ({_first_difference(gt, wt)}) {gt} != {wt}"]
    for w, (a, b) in enumerate(zip(gtens, wtens)):
        if a.keys() != b.keys():
            diffs.append(f"worker {w}: tensor names differ: {sorted(a.keys() ^ b.keys())}")
        for n in sorted(a.keys() & b.keys()):
            x, y = a[n], b[n]
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x.view(-1).view(torch.uint8),
                                                                            y.view(-1).view(torch.uint8)):
                diffs.append(f"worker {w}: {n}")
    return diffs


def _first_difference(got: list, want: list) -> str:
    for i, ((gtok, gsteps), (wtok, wsteps)) in enumerate(zip(got, want)):
        if gtok != wtok:
            return f"prompt {i}: tokens {gtok} != {wtok}"
        for k, (g, w) in enumerate(zip(gsteps, wsteps)):
            if g != w:
                return f"prompt {i} step {k}: {g} != {w}"
    return "lengths"


def _close(got: list, want: list, atol: float) -> bool:
    if got == want or atol == 0.0:
        return got == want
    if [t for t, _ in got] != [t for t, _ in want]:
        return False
    for (_, gsteps), (_, wsteps) in zip(got, want):
        for g, w in zip(gsteps, wsteps):
            if g.keys() != w.keys() or any(abs(g[k] - w[k]) > atol for k in g):
                return False
    return True


def assert_same(got, want, logprob_atol: float = 0.0) -> None:
    diffs = differences(got, want, logprob_atol)
    assert not diffs, f"{len(diffs)} differences from the reference engine:\n" + "\n".join(d[:300] for d in diffs)


def update(llm, trainers: Trainers, seed: int) -> list:
    """One full update to version `seed` through vLLM's own calls; the trainers' replies."""
    trainers.post("send", seed)
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": str(seed)}})
    llm.finish_weight_update()
    return trainers.wait()


def engine_session(tmp: Any, cfg: dict[str, Any], versions: tuple[int, int], start: Any, observe_fn: Any = observe):
    """A module's refit session (a generator for a module-scoped fixture): checkpoints of `versions` (V1, V2) in
    `tmp`; a reference engine `start(path, monkeypatch)` of V2 observed then closed; the live engine of V1, observed,
    and 2 trainer processes joined to it. Yields `(llm, trainers, want_v1, want_v2)`; closes everything after."""
    import pytest

    ck1, ck2 = str(tmp / "v1"), str(tmp / "v2")
    write_checkpoint(ck1, cfg, versions[0])
    write_checkpoint(ck2, cfg, versions[1])
    trainers = Trainers(2)
    try:
        with pytest.MonkeyPatch.context() as mp:
            ref = start(ck2, mp)
            try:
                want_v2 = observe_fn(ref)
            finally:
                close_engine(ref)
            llm = start(ck1, mp)
            try:
                want_v1 = observe_fn(llm)
                assert differences(want_v1, want_v2), "the two versions must differ, or the test could not fail"
                world = llm.llm_engine.vllm_config.parallel_config.world_size
                port = free_port()
                trainers.post("init", port, cfg, world, False)
                llm.init_weight_transfer_engine({"init_info": {"master_address": "127.0.0.1", "master_port": port,
                                                               "trainer_world_size": 2, "timeout_s": 120.0}})
                trainers.wait()
                yield llm, trainers, want_v1, want_v2
                trainers.post("close")
                trainers.wait()
                llm.shutdown_weight_transfer_engine()
            finally:
                close_engine(llm)
    finally:
        trainers.close()


def refused_then_good(llm, trainers: Trainers, bad: tuple, good: tuple, name: str, world: int,
                      versions: tuple[int, int], wants: tuple[Any, Any], observe_fn: Any = observe,
                      atol: float = 0.0) -> None:
    """From V1 (`versions`, observed as `wants`): the trainer command `bad` makes the update to V2 refused before
    data moves (naming `name`): it raises once, on the last worker, every worker's next reply is in step, the
    engine still generates V1; after `good`, updates to V2 and back land exactly."""
    import re

    import pytest

    trainers.post(*bad)
    trainers.wait()
    (v1, v2), (want_v1, want_v2) = versions, wants
    trainers.post("send", v2)
    llm.start_weight_update()
    with pytest.raises(Exception, match=rf"update_weights failed on {world} of {world} worker(.|\n)*{re.escape(name)}"):
        llm.update_weights({"update_info": {"version": "bad"}})
    with pytest.raises(AssertionError, match=rf"ValueError(.|\n)*{re.escape(name)}"):
        trainers.wait()
    errors = llm.collective_rpc(last_error)  # one reply per worker, this call's: the RPCs are in step
    assert len(errors) == world and all(name in e for e in errors), errors
    assert_same(observe_fn(llm), want_v1, atol)  # generate works, on the weights it had
    trainers.post(*good)
    trainers.wait()
    update(llm, trainers, v2)
    assert llm.collective_rpc(last_error) == [None] * world
    assert_same(observe_fn(llm), want_v2, atol)
    update(llm, trainers, v1)
    assert_same(observe_fn(llm), want_v1, atol)


# ---- offline data parallelism: one `LLM` per process (`VLLM_DP_*`), driven together --------------------------------
def dp_communicator(worker: Any = None) -> None:
    """vLLM CPU workaround (test-side only), DP + EP: the first MoE forward fails in
    `vllm/distributed/device_communicators/base_device_communicator.py:296` (`all_gatherv: NotImplementedError`; and
    `:334` `reduce_scatterv`): the CPU communicator falls back to `AgRsAll2AllManager` (`cpu_communicator.py:67`),
    which needs both. Given to `CpuCommunicator` here over its gloo group: `all_gatherv` pads to the largest size and
    all-gathers, `reduce_scatterv` all-reduces and keeps this rank's slice."""
    import torch.distributed as dist
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    def all_gatherv(self, input_, dim: int = 0, sizes: list[int] | None = None):  # noqa: ANN001, ANN202
        def one(t: torch.Tensor) -> torch.Tensor:
            d = dim % t.dim()
            counts = sizes or [t.shape[d]] * self.world_size
            shape = list(t.shape)
            shape[d] = max(counts)
            buf = t.new_zeros(shape)
            buf.narrow(d, 0, t.shape[d]).copy_(t)
            out = [torch.empty_like(buf) for _ in range(self.world_size)]
            dist.all_gather(out, buf, group=self.device_group)
            return torch.cat([o.narrow(d, 0, n) for o, n in zip(out, counts)], dim=d)

        return [one(t) for t in input_] if isinstance(input_, list) else one(input_)

    def reduce_scatterv(self, input_, dim: int = -1, sizes: list[int] | None = None):  # noqa: ANN001, ANN202
        d = dim % input_.dim()
        counts = sizes or [input_.shape[d] // self.world_size] * self.world_size
        total = input_.clone()
        dist.all_reduce(total, group=self.device_group)
        start = sum(counts[:self.rank_in_group])
        return total.narrow(d, start, counts[self.rank_in_group]).contiguous()

    CpuCommunicator.all_gatherv = all_gatherv
    CpuCommunicator.reduce_scatterv = reduce_scatterv


def _dp_engine(dp_rank: int, dp_size: int, dp_port: int, path: str, commands: Any, results: Any) -> None:
    """One offline DP rank's `LLM` (TP 1, expert parallel, in this process): `("observe",)`, `("init", port)`,
    `("update", seed)`, `("update_error", seed)` (expects a failure: returns its message), `("rpc", name)` (a
    `vllm_cases` function through `collective_rpc`), `("exit",)`."""
    os.environ.update({"VLLM_DP_SIZE": str(dp_size), "VLLM_DP_RANK": str(dp_rank), "VLLM_DP_RANK_LOCAL": str(dp_rank),
                       "VLLM_DP_MASTER_IP": "127.0.0.1", "VLLM_DP_MASTER_PORT": str(dp_port),
                       "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
                       "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    llm = None
    while True:
        cmd = commands.get()
        try:
            if cmd[0] == "exit":
                if llm is not None:
                    close_engine(llm)
                results.put((dp_rank, "ok", None))
                return
            if llm is None:
                from vllm import LLM

                llm = LLM(model=path, tensor_parallel_size=1, dtype="bfloat16", enforce_eager=True,
                          skip_tokenizer_init=True, max_model_len=128, max_num_seqs=2, seed=0,
                          enable_expert_parallel=True, distributed_executor_backend="uni",
                          weight_transfer_config={"backend": "reshard"})
                dp_communicator()
                llm.collective_rpc(amx_permission)
                llm.collective_rpc(ep_expert_map)
            if cmd[0] == "start":
                out = None
            elif cmd[0] == "observe":
                out = observe(llm)
            elif cmd[0] == "init":
                llm.init_weight_transfer_engine({"init_info": {"master_address": "127.0.0.1", "master_port": cmd[1],
                                                               "trainer_world_size": 2, "timeout_s": 120.0}})
                out = None
            elif cmd[0] in ("update", "update_error"):
                llm.start_weight_update()
                try:
                    llm.update_weights({"update_info": {"version": str(cmd[1])}})
                    llm.finish_weight_update()
                    out = None
                except Exception as e:
                    if cmd[0] == "update":
                        raise
                    out = str(e)
            elif cmd[0] == "rpc":
                out = llm.collective_rpc(globals()[cmd[1]])
            elif cmd[0] == "shutdown":
                llm.shutdown_weight_transfer_engine()
                out = None
            results.put((dp_rank, "ok", out))
        except BaseException as e:  # reported to the test, which fails with it
            results.put((dp_rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class DPEngines(Trainers):
    """`dp` offline DP ranks of one engine (`_dp_engine`), each its own process and `LLM`, driven in lockstep (MoE
    steps need every EP rank)."""

    what = "DP engine"

    def __init__(self, path: str, dp: int = 2) -> None:
        super().__init__(dp, _dp_engine, (free_port(), path))

    def call(self, *cmd: Any, timeout: float = 600.0) -> list[Any]:
        self.post(*cmd)
        return self.wait(timeout)

    def close(self) -> None:
        try:
            self.call("exit", timeout=60)
        finally:
            for p in self.procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()


TP_SPLIT = ("q_proj", "k_proj", "v_proj", "o_proj")  # vLLM shards these evenly over TP
VOCAB = ("embed_tokens", "lm_head")  # vocabulary-parallel: padded to a multiple of 64, then split evenly


def ep_expected_bytes(cfg: dict[str, Any], version: Version, experts: list[list[int]], tp: int,
                      rank: int) -> tuple[int, int]:
    """From the weights of `version` themselves: (what TP rank `rank` of an expert-parallel engine holding `experts`
    (per layer) should receive: those experts and its TP share of the rest; what a whole-expert sender (vLLM
    `nccl_m2n`'s rule) sends it: every expert, and its TP share of the rest)."""
    own = whole = 0
    vocab = cfg["vocab_size"]
    per = -(-vocab // 64) * 64 // tp
    for name, w in hf_weights(cfg, version).items():
        size = w.numel() * w.element_size()
        if ".mlp.experts." in name:
            own += size * len(experts[int(name.split(".")[2])]) // w.shape[0]
            whole += size
            continue
        if tp > 1 and any(k in name for k in TP_SPLIT):
            share = size // tp
        elif tp > 1 and any(k in name for k in VOCAB):
            share = size // vocab * (min(vocab, (rank + 1) * per) - rank * per)
        else:
            share = size
        own += share
        whole += share
    return own, whole
