"""`ReshardTrainer`: the trainer side of the `reshard` vLLM weight-transfer backend.

Every trainer rank registers the weights it holds, with their layouts (DTensors, or local tensors with a
`reshard.Layout`), under their HuggingFace names; fused engine tensors (`qkv_proj`, `gate_up_proj`) and padded
vocabularies are the engine's business. `send_weights()` moves the current values: each engine rank receives
exactly its shard, once, and no full tensor is gathered.

Two ways to drive vLLM:
- with a `client` (vLLM's `VLLMWeightSyncClient`: an `LLM`, an HTTP client, a Ray actor handle), trainer rank 0
  calls `init_weight_transfer_engine` / `start_weight_update` / `update_weights` / `finish_weight_update` itself,
  concurrently with the transfer;
- without one, the caller makes those calls on the engine while every trainer rank calls `trainer_init` and
  `send_weights`.

The work is the engine-neutral trainer link's (`reshard.integrations.trainer_link.TrainerLink`); this module is
vLLM's face of it (vLLM's `TrainerWeightTransferEngine` and `TrainerInitInfo` base classes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from reshard.comm import Group
from reshard.integrations.trainer_link import EngineClient, TrainerLink, TrainerLinkInfo, Weights
from reshard.refit import NameMap, Refit, RefitReport

try:  # vLLM's base classes, where vLLM is installed (the trainer may live in an environment without it)
    from vllm.distributed.weight_transfer.base import TrainerInitInfo as _InitBase
    from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine as _EngineBase
except ImportError:  # pragma: no cover - exercised only without vLLM
    @dataclass
    class _InitBase:  # type: ignore[no-redef]
        backend: ClassVar[str]
        rank: int = field(kw_only=True)

        @property
        def is_sender(self) -> bool:
            return self.rank == 0

    class _EngineBase:  # type: ignore[no-redef]
        def __init__(self, *, client: Any = None, source: Any = None, is_sender: bool = True) -> None:
            self.client, self.source, self.is_sender = client, source, is_sender


@dataclass
class ReshardTrainerInitInfo(TrainerLinkInfo, _InitBase):
    """Trainer-side init info of the `reshard` backend (every trainer rank passes its own `rank`): the fields of
    `reshard.integrations.trainer_link.TrainerLinkInfo` (store address and port, `world_size` trainer ranks,
    `engine_world_size` engine workers, `trainer_ranks`, `timeout_s`, `precision`, `verify`, `delta`, `token`,
    `prefix`, `host_store`, `planning`, `comm_backend`), as vLLM's `TrainerInitInfo`; `engine_init_info()` is the
    `init_info` dict for vLLM's `init_weight_transfer_engine`.
    """

    backend: ClassVar[str] = "reshard"
    rank: int = field(kw_only=True)


class ReshardTrainer(_EngineBase):
    """Trainer-side engine of the `reshard` backend; build it with `ReshardTrainer.trainer_init(...)`.

    Attributes:
        link: the `TrainerLink` doing the work.
        refit: the trainer's `Refit` (its plan after the first `send_weights()`).
        group: the rendezvous group spanning trainer and engine ranks.
    """

    init_info_cls = ReshardTrainerInitInfo

    def __init__(self, link: TrainerLink, *, source: Any = None) -> None:
        super().__init__(client=link.client, source=source, is_sender=link.info.is_sender)
        self.link = link

    @property
    def group(self) -> Group:
        return self.link.group

    @property
    def refit(self) -> Refit:
        return self.link.refit

    @property
    def info(self) -> ReshardTrainerInitInfo:
        return self.link.info  # type: ignore[return-value]

    @classmethod
    def trainer_init(cls, init_info: ReshardTrainerInitInfo, *, client: EngineClient | None = None,
                     source: Weights | None = None, name_map: NameMap = None, ignore_sources: Sequence[str] = (),
                     ties: Mapping[str, Sequence[str]] | None = None, config: Any = None,
                     transposed: Sequence[str] | None = None) -> ReshardTrainer:
        """Join the group and register this rank's weights (see the module docstring for `client`).

        Args:
            init_info: this rank's init info.
            client: optional; on rank 0 it is told to initialize the engines' side, concurrently.
            source: HuggingFace name -> DTensor, or -> `(local tensor, reshard.Layout)`; or a module whose
                parameters are DTensors; or a Megatron-core `GPTModel` chunk (registered by
                `reshard.integrations.megatron.add_sources`, the real vocabulary from `config`'s `vocab_size`).
                One tensor under several names (a module's tied parameters, a `state_dict()`'s tied entries) is
                sent once, the other names being its aliases (`find_ties`). A module is followed, not its
                parameter objects (`Refit.add_module_sources`): a parameter replaced by one of the same layout is
                sent from the next `send_weights()`, one of another layout or an untied one is refused on every
                rank, naming it.
            name_map: trainer name -> the engine's (HuggingFace) name, a dict or a callable returning None for a
                name to leave out of the map (which is then an error unless ignored); default identity.
            ignore_sources: trainer names the engine does not serve, left out on purpose (an MTP head, a value
                head).
            ties: more ties, name -> its other names (`{"model.embed_tokens.weight": ["lm_head.weight"]}`), for
                a source that holds one of them only.
            config: the model's HuggingFace config (default: the module's `.config`): with
                `tie_word_embeddings`, a source that has the input embedding but no `lm_head.weight` ties the two.
                Its facts that shapes cannot show (heads, KV heads, head dim, experts, vocabulary, tie:
                `reshard.integrations.model_config.model_facts`) are declared (`Refit.declare_facts`): an engine serving a
                model that differs in one is refused on every rank at the first send, naming it.
            transposed: trainer names of 2-D weights stored `[in, out]` (Hugging Face `Conv1D`: GPT-2's `c_attn`,
                `c_proj`, `c_fc`), which the engine holds `[out, in]`: registered as a transposed view (no copy).
                Default: a module source's `Conv1D` weights; none for a mapping.

        Raises:
            ValueError, TypeError (or what the registration raises): a mistake in the arguments or the source (a
                Megatron model without `vocab_size`, an unsupported layout, ...). It is raised after the group
                formed, and reported to the group first: every other rank (engine workers included) raises it,
                naming this rank, at its next wait on the group (within a fraction of a second), not at its timeout.
        """
        if not isinstance(init_info, ReshardTrainerInitInfo):
            raise TypeError(f"ReshardTrainer.trainer_init: init_info must be a ReshardTrainerInitInfo, got "
                            f"{type(init_info).__name__}")
        link = TrainerLink.join(init_info, client=client, source=source, name_map=name_map,
                                ignore_sources=ignore_sources, ties=ties, config=config, transposed=transposed,
                                who="ReshardTrainer.trainer_init")
        return cls(link, source=source)

    def send_weights(self, *, full: bool = False) -> RefitReport:
        """Move the registered weights' current values into every engine worker (every trainer rank calls it).

        Args:
            full: with `delta`, send every box whole this time (pass the engine `update_info` `"full": true` too).
        """
        return self.link.send(full=full)

    def shutdown(self) -> None:
        self.link.close()
