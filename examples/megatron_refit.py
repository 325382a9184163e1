"""Refit a Megatron-core trainer (TP2 x PP2, tied embeddings, padded vocabulary) into vLLM-style engine tensors.

    torchrun --nproc-per-node 4 examples/megatron_refit.py

Every rank holds its Megatron `GPTModel` chunk and, colocated, one engine replica at TP1 (fused `qkv_proj` and
`gate_up_proj`, the vocabulary padded to 64 rows). `reshard.integrations.megatron.add_sources` registers the chunk
under Hugging Face names, with layouts read from its `sharded_state_dict()`; one `run()` moves every weight shard
to shard. The check: a Hugging Face `Qwen3ForCausalLM` holding the engine's tensors gives Megatron's own logits.

Needs `megatron-core` (0.16.1 on Python 3.11) and `transformers`. Without CUDA, the four CPU workarounds below
stand in for what Megatron expects of a GPU; a trainer on GPUs does not need them.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

VOCAB, PADDED, HIDDEN, LAYERS, HEADS, GROUPS, HEAD_DIM, FFN = 203, 256, 64, 4, 8, 2, 32, 96


def cpu_workarounds() -> None:
    """megatron-core 0.16.1 without CUDA: no CUDA RNG states, `.cuda()` and the current device stay on the CPU."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker.add = lambda self, name, seed: self.states_.__setitem__(name, None)
    mrandom.CudaRNGStatesTracker.fork = contextlib.contextmanager(lambda self, name=None: (yield))
    torch.cuda.manual_seed = lambda seed: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.current_device = lambda: "cpu"


def megatron_model():
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    model_parallel_cuda_manual_seed(0)
    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        num_query_groups=GROUPS, kv_channels=HEAD_DIM, normalization="RMSNorm", layernorm_epsilon=1e-6,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, qk_layernorm=True,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2, use_cpu_initialization=True, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, init_method_std=0.05)
    torch.manual_seed(0)
    return GPTModel(cfg, get_gpt_layer_local_spec(qk_layernorm=True), vocab_size=PADDED, max_sequence_length=64,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=True, position_embedding_type="rope", rotary_base=10000)


def megatron_logits(model, ids: torch.Tensor) -> torch.Tensor | None:
    """Megatron's forward over both stages; the full-vocabulary logits on the last stage's TP rank 0."""
    from megatron.core import parallel_state as ps

    b, s = ids.shape
    model.eval()
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            x = torch.empty(s, b, HIDDEN)
            dist.recv(x, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(x)
        out = model(ids, torch.arange(s).expand(b, s), torch.ones(s, s, dtype=torch.bool).triu(1)[None, None])
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
        parts = [torch.empty_like(out) for _ in range(2)]
        dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, -1)[..., :VOCAB] if ps.get_tensor_model_parallel_rank() == 0 else None


def main() -> None:
    import transformers

    from reshard.comm import Group
    from reshard.integrations import hf, megatron
    from reshard.refit import Refit

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cpu_workarounds()
    model = megatron_model()

    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      num_key_value_heads=GROUPS, head_dim=HEAD_DIM, rms_norm_eps=1e-6,
                                      rope_theta=10000.0, tie_word_embeddings=True)
    refit = Refit(Group.world(), policy="reshard")
    names = megatron.add_sources(refit, model, vocab_size=VOCAB)  # the trainer side: one call
    engine = {}
    for t in hf.engine_tensors(config, hf.EngineParallel(range(4), tp=1), dtype=torch.float32):
        engine[t.name] = torch.zeros(t.local_shape(rank))  # the engine side: its own tensors, as vLLM lays them out
        t.register(refit, engine[t.name])
    report = refit.run()

    logits = megatron_logits(model, ids := torch.arange(14).reshape(2, 7) * 13 % VOCAB)
    if logits is not None:  # rank 2: the engine's tensors, unfused, in Hugging Face's model give Megatron's logits
        state = {}
        for name, t in engine.items():
            if name.endswith("qkv_proj.weight"):
                q, k, v = t.split([HEADS * HEAD_DIM, GROUPS * HEAD_DIM, GROUPS * HEAD_DIM])
                for part, w in zip(("q_proj", "k_proj", "v_proj"), (q, k, v)):
                    state[name.replace("qkv_proj", part)] = w
            elif name.endswith("gate_up_proj.weight"):
                for part, w in zip(("gate_proj", "up_proj"), t.chunk(2)):
                    state[name.replace("gate_up_proj", part)] = w
            else:
                state[name] = t[:VOCAB] if name.endswith("embed_tokens.weight") else t
        ref = transformers.Qwen3ForCausalLM(config).eval()
        missing, unexpected = ref.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # lm_head: tied
        with torch.no_grad():
            got = ref(input_ids=ids).logits
        torch.testing.assert_close(got, logits, rtol=1e-4, atol=1e-4)
        print(f"megatron_refit verified: {len(engine)} engine tensors from {len(names)} weights of rank {rank}, "
              f"{report.network_bytes + report.local_bytes} bytes moved; Hugging Face logits match Megatron's")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
