"""Real trainers and engines: Hugging Face naming, vLLM-style engine layouts, and a vLLM weight-transfer backend.

- `reshard.integrations.engine`: `EngineTensor` and `engine_tensors` (per-weight inference layouts -> the engine's
  fused local tensors: `qkv_proj`, `gate_up_proj`, `w13_weight` / `w2_weight`, padded vocabularies).
- `reshard.integrations.hf`: `EngineParallel` and `engine_tensors(model, parallel)`, every engine tensor of a
  `transformers` model (transformers 5 fused experts and older per-expert names), `name_map`, `trainer_name`.
- `reshard.integrations.vllm`: the `reshard` backend of vLLM's weight transfer (engine side, layouts read from the
  live model) and its trainer side; imported on its own (`import reshard.integrations.vllm`), vLLM only when used.
- `reshard.integrations.trainer`: a trainer's weights as sources (`stream_source`: DTensors, local shards with a
  spec, full tensors every trainer rank holds as this rank's row block), and a whole model's preparation (Megatron
  detection and registration, ties, `Conv1D` transposition), shared by the framework integrations.
- `reshard.integrations.trl`: TRL's `GRPOTrainer` with reshard's server-mode weight sync; TRL only when used.
- `reshard.integrations.megatron`: `add_sources(refit, model, vocab_size=...)`, a live Megatron-core `GPTModel`
  chunk as sources under Hugging Face names; imported on its own, megatron-core only when called.
"""

from reshard.integrations import engine, hf
from reshard.integrations.engine import EngineTensor
from reshard.integrations.hf import EngineParallel

__all__ = ["EngineParallel", "EngineTensor", "engine", "hf"]
