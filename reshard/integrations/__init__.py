"""Real trainers and engines: shared homes for both sides, and one package per framework.

Shared homes (import no specific integration):
- `reshard.integrations.fused`: `EngineTensor` and `engine_tensors` (per-weight inference layouts -> the engine's
  fused local tensors: `qkv_proj`, `gate_up_proj`, `w13_weight` / `w2_weight`, padded vocabularies).
- `reshard.integrations.group_layout`: `GroupLayout`, where every trainer rank and engine worker sits in the group.
- `reshard.integrations.model_config`: `model_facts`, `trainer_name`: what a Hugging Face config and names say.
- `reshard.integrations.trainer`: a trainer's weights as sources (`stream_source`: DTensors, local shards with a
  spec, full tensors every trainer rank holds as this rank's row block), a whole model's preparation (ties,
  `Conv1D` transposition), and the model and partition kinds the framework packages register.
- `reshard.integrations.trainer_link`: `TrainerLink`, the engine-neutral trainer side (join, registration, run,
  failure), driving any engine through an `EngineClient`.
- `reshard.integrations.engine_side`: the engine side's update state machine (`Updates`) and model facts.

Specific integrations (import only the shared homes; verl also drives the vLLM integration):
- `reshard.integrations.hf`: `EngineParallel` and `engine_tensors(model, parallel)`, every engine tensor of a
  `transformers` model (transformers 5 fused experts and older per-expert names), `name_map`, `trainer_name`.
- `reshard.integrations.vllm`: the `reshard` backend of vLLM's weight transfer (engine side, layouts read from the
  live model) and its trainer side; imported on its own (`import reshard.integrations.vllm`), vLLM only when used.
- `reshard.integrations.trl`: TRL's `GRPOTrainer` with reshard's server-mode weight sync; TRL only when used.
- `reshard.integrations.megatron`: `add_sources(refit, model, vocab_size=...)`, a live Megatron-core `GPTModel`
  chunk as sources under Hugging Face names; imported on its own, megatron-core only when called.
- `reshard.integrations.deepspeed`: `add_sources(refit, engine)`, every rank's own ZeRO partitions as sources.
- `reshard.integrations.verl`: verl's checkpoint-engine backend and its vLLM rollout manager.

Importing this package registers Megatron models and DeepSpeed ZeRO-3 parameters with the trainer side (neither
imports its framework until used), so a trainer link takes them as sources without importing either.
"""

from reshard.integrations import deepspeed, fused, hf, megatron  # deepspeed, megatron: they register their kinds
from reshard.integrations.fused import EngineTensor
from reshard.integrations.hf import EngineParallel

__all__ = ["EngineParallel", "EngineTensor", "fused", "hf"]


