"""GRPO with TRL, its weight sync through reshard: every trainer rank sends its own shards to a `vllm serve` server.

The one change to a TRL script is the import of `GRPOTrainer`; the rest is TRL's (`GRPOConfig(use_vllm=True,
vllm_mode="server")`, `accelerate launch`, a reward function). Two commands, in the TRL environment (`make trl-env`):

    # 1. the server: vLLM's own, with reshard's weight-transfer backend (dev mode serves the update routes)
    VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND='0|1' PYTHONPATH=$PWD \\
        .venv-trl/bin/python -m vllm.entrypoints.cli.main serve MODEL --tensor-parallel-size 2 --dtype bfloat16 \\
        --weight-transfer-config '{"backend":"reshard"}' --logprobs-mode processed_logprobs --port 8000

    # 2. the trainer: 2 processes (add --cpu-only machines: use_cpu=True below)
    PYTHONPATH=$PWD .venv-trl/bin/accelerate launch --multi_gpu --num_processes 2 examples/trl_grpo.py \\
        --model MODEL --url http://127.0.0.1:8000

MODEL is a Hugging Face checkpoint directory with its tokenizer (`--write-tiny DIR` writes a tiny random Qwen3 and a
word-level tokenizer there, offline). On a CPU machine the trainer runs with `use_cpu=True` (DDP over gloo).
"""

from __future__ import annotations

import argparse
import logging


def reward_distinct(completions: list[str], **_: object) -> list[float]:
    """A toy reward: the number of distinct words of a completion."""
    return [float(len(set(c.split()))) for c in completions]


def write_tiny(path: str) -> None:
    """A 2-layer Qwen3 (hidden 64, head_dim 32, tied embeddings) with random weights and a word-level tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    vocab = {w: i for i, w in enumerate(["<unk>", "<pad>", "<eos>"] + [f"w{i}" for i in range(200)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                            eos_token="<eos>").save_pretrained(path)
    cfg = Qwen3Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=2, pad_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint directory (with its tokenizer), the one the server serves")
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the vllm serve server")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="trl_grpo_out")
    ap.add_argument("--write-tiny", metavar="DIR", help="write a tiny random Qwen3 checkpoint to DIR and exit")
    args = ap.parse_args()
    if args.write_tiny:
        write_tiny(args.write_tiny)
        return
    logging.basicConfig(level=logging.INFO)

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from reshard.integrations.trl import GRPOTrainer  # the one change: instead of `from trl import GRPOTrainer`

    prompts = [" ".join(f"w{(7 * i + j) % 200}" for j in range(4)) for i in range(64)]
    config = GRPOConfig(output_dir=args.out, use_vllm=True, vllm_mode="server", vllm_server_base_url=args.url,
                        use_cpu=not torch.cuda.is_available(), per_device_train_batch_size=2, num_generations=4,
                        max_completion_length=8, max_steps=args.steps, learning_rate=1e-3, logging_steps=1,
                        report_to="none", save_strategy="no")
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32), args=config,
                          reward_funcs=reward_distinct, train_dataset=Dataset.from_dict({"prompt": prompts}),
                          processing_class=AutoTokenizer.from_pretrained(args.model))
    trainer.train()
    # the check: every trainer rank sent its own part of the weights at the last sync, and no rank sent them all (TRL's
    # own sync gathers every weight and sends it from rank 0 alone); together they sent at least the whole model in the
    # server's bfloat16 (the norms go to each of the server's TP workers)
    sync = trainer.vllm_generation.last_sync
    sent = trainer.accelerator.gather(torch.tensor([sync.bytes_sent if sync else 0])).tolist()
    model_bytes = 2 * sum(p.numel() for p in trainer.model.parameters())
    assert min(sent) > 0 and sum(sent) >= model_bytes and max(sent) < model_bytes, (sent, model_bytes)
    if trainer.accelerator.is_main_process:
        print(f"trl_grpo verified: {args.steps} GRPO steps, bytes sent at the last sync per trainer rank {sent} "
              f"(the model: {model_bytes} bytes in bfloat16)")


if __name__ == "__main__":
    main()
