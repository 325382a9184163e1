"""Helpers of the real-vLLM tests (`tests/test_vllm_engine.py`): tiny Qwen3 configs and checkpoints, a pool of
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


def hf_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Random bfloat16 weights of version `seed` (norms near 1, matrices ~ N(0, 0.05))."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in hf_shapes(cfg).items():
        w = torch.randn(shape, generator=g) * 0.05
        out[name] = (w + 1.0 if len(shape) == 1 else w).to(torch.bfloat16)
    return out


def write_checkpoint(path: str, cfg: dict[str, Any], seed: int) -> None:
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


def _trainer(rank: int, world: int, commands: Any, results: Any) -> None:
    """One trainer rank: `("init", port, cfg, engine_world)`, `("send", seed)`, `("close",)`, `("exit",)`."""
    from reshard.integrations.vllm import ReshardTrainer, ReshardTrainerInitInfo

    trainer = weights = layouts = cfg = None
    while True:
        cmd = commands.get()
        try:
            if cmd[0] == "exit":
                return
            if cmd[0] == "init":
                _, port, cfg, engine_world = cmd
                layouts = {n: trainer_layout(n, s, list(range(world))) for n, s in hf_shapes(cfg).items()}
                weights = {n: torch.zeros(lay.local_shape(rank), dtype=torch.bfloat16) for n, lay in layouts.items()}
                info = ReshardTrainerInitInfo(rank=rank, master_address="127.0.0.1", master_port=port,
                                              world_size=world, engine_world_size=engine_world, timeout_s=120.0)
                trainer = ReshardTrainer.trainer_init(info, source={n: (weights[n], layouts[n]) for n in weights})
                results.put((rank, "ok", None))
            elif cmd[0] == "send":
                for n, full in hf_weights(cfg, cmd[1]).items():  # the optimizer step: in place
                    _fill(weights[n], full, layouts[n], rank)
                report = trainer.send_weights()
                results.put((rank, "ok", (report.first_run, report.network_bytes)))
            elif cmd[0] == "close":
                trainer.shutdown()
                trainer = None
                results.put((rank, "ok", None))
        except BaseException as e:  # reported to the test, which fails with it
            results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class Trainers:
    """`world` trainer processes, started once and reused by every engine session."""

    def __init__(self, world: int = 2) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.commands = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_trainer, args=(r, world, self.commands[r], self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def post(self, *cmd: Any) -> None:
        for q in self.commands:
            q.put(cmd)

    def wait(self, timeout: float = 300.0) -> list[Any]:
        got = sorted(self.results.get(timeout=timeout) for _ in range(self.world))
        errors = [msg for _, status, msg in got if status == "error"]
        if errors:
            raise AssertionError("trainer failed:\n" + "\n".join(errors))
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
                k, bias = layer.input_size_per_partition, None if layer.skip_bias_add else layer.bias
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


def reprocessed_layers(worker: Any) -> list[str]:
    """The layers whose weights the backend re-processes after each update (asked of the live engine)."""
    return worker.weight_transfer_engine.reprocessed_layers()


def skip_reprocessing(worker: Any, skip: bool) -> None:
    """Negative control: make the backend skip re-processing (its loader-format writes then reach no forward)."""
    engine = worker.weight_transfer_engine
    if skip:
        engine.reprocess = lambda: None
    elif "reprocess" in vars(engine):
        del engine.reprocess


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
