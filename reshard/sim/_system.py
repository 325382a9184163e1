"""The system being simulated: trainer and inference parallelism, GPU counts and NVLink domains.

Two input forms:

- NCCL M2N's system-config JSON, `{"train": {...}, "generation": {...}}` with `num_gpus`, `tp_size`, `cp_size`,
  `ep_size`, `pp_size`, `fsdp_size` and `dp_size` per side (`System.from_m2n`, `load_system`);
- a command-line form, `"train=tp2,cp2,pp4,ep16 gen=tp8,dp8 domain=72"` (`System.parse`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainerParallel:
    """Megatron-style trainer parallelism.

    Ranks are ordered `tp` fastest, then `cp`, then `dp`, then `pp` (Megatron's default `tp-cp-ep-dp-pp`), so each
    pipeline stage owns a contiguous block of `tp * cp * dp` ranks. Inside a stage the same ranks are also an expert
    mesh `(edp, ep, etp)`, `etp` fastest.

    Attributes:
        tp, cp, pp: tensor-, context- and pipeline-parallel sizes.
        dp: data-parallel size of the dense weights; when None, derived from `num_gpus`, or without it the
            smallest that fits the expert mesh.
        ep, etp: expert-parallel and expert-tensor-parallel sizes; `ep * etp` must divide `tp * cp * dp`.
        num_gpus: total trainer GPUs; `tp * cp * dp * pp` when None.
        stage_layers: decoder layers per pipeline stage, or None to split them as evenly as possible.
    """

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int | None = None
    ep: int = 1
    etp: int = 1
    num_gpus: int | None = None
    stage_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for f in ("tp", "cp", "pp", "ep", "etp"):
            if getattr(self, f) < 1:
                raise ValueError(f"trainer: {f} must be >= 1, got {getattr(self, f)}")
        per_stage_model = self.tp * self.cp
        if self.dp is None:
            if self.num_gpus is None:
                # the smallest dp that makes room for the expert mesh (ep * etp must divide tp * cp * dp)
                experts = self.ep * self.etp
                object.__setattr__(self, "dp", experts // math.gcd(experts, per_stage_model))
            else:
                if self.num_gpus % (per_stage_model * self.pp):
                    raise ValueError(
                        f"trainer: num_gpus={self.num_gpus} is not a multiple of tp*cp*pp={self.tp}*{self.cp}*{self.pp}"
                    )
                object.__setattr__(self, "dp", self.num_gpus // (per_stage_model * self.pp))
        assert self.dp is not None
        total = per_stage_model * self.dp * self.pp
        if self.num_gpus is None:
            object.__setattr__(self, "num_gpus", total)
        elif self.num_gpus != total:
            raise ValueError(
                f"trainer: num_gpus={self.num_gpus} but tp*cp*dp*pp={self.tp}*{self.cp}*{self.dp}*{self.pp}={total}"
            )
        if self.stage_size % (self.ep * self.etp):
            raise ValueError(
                f"trainer: ep*etp={self.ep}*{self.etp} must divide the {self.stage_size} ranks of a pipeline stage "
                f"(tp*cp*dp={self.tp}*{self.cp}*{self.dp})"
            )
        if self.stage_layers is not None and len(self.stage_layers) != self.pp:
            raise ValueError(f"trainer: stage_layers {self.stage_layers} must have pp={self.pp} entries")

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage."""
        return self.tp * self.cp * self.dp  # type: ignore[operator]

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: replicas of each expert shard within a stage."""
        return self.stage_size // (self.ep * self.etp)

    def describe(self) -> str:
        parts = [f"tp{self.tp}"]
        parts += [f"{k}{v}" for k, v in (("cp", self.cp), ("pp", self.pp), ("ep", self.ep), ("etp", self.etp)) if v > 1]
        parts.append(f"dp{self.dp}")
        return "".join(parts) + f" ({self.num_gpus} GPUs)"


@dataclass(frozen=True)
class InferenceParallel:
    """vLLM-style inference parallelism: `dp` replicas of `tp` ranks each, replica `k` on ranks `k*tp .. k*tp+tp-1`.

    With `ep > 1` routed experts are spread over expert-parallel groups of `ep` consecutive ranks (vLLM's
    `--enable-expert-parallel` uses `ep = tp * dp`); with `ep == 1` each expert is tensor-parallel like a dense MLP.
    """

    tp: int = 1
    dp: int = 1
    ep: int = 1
    num_gpus: int | None = None

    def __post_init__(self) -> None:
        for f in ("tp", "dp", "ep"):
            if getattr(self, f) < 1:
                raise ValueError(f"inference: {f} must be >= 1, got {getattr(self, f)}")
        total = self.tp * self.dp
        if self.num_gpus is None:
            object.__setattr__(self, "num_gpus", total)
        elif self.num_gpus != total:
            raise ValueError(f"inference: num_gpus={self.num_gpus} but tp*dp={self.tp}*{self.dp}={total}")
        if total % self.ep:
            raise ValueError(f"inference: ep={self.ep} must divide tp*dp={total}")

    def describe(self) -> str:
        ep = f"ep{self.ep}" if self.ep > 1 else ""
        return f"tp{self.tp}{ep}dp{self.dp} ({self.num_gpus} GPUs)"


@dataclass(frozen=True)
class System:
    """A trainer and an inference engine on one cluster.

    Attributes:
        train, gen: the two sides' parallelism.
        domain_size: GPUs per NVLink domain; None takes the hardware preset's.
        colocated: inference ranks are the trainer ranks (the same GPUs); else they follow the trainer's.
        separate_domains: when not colocated, start the inference ranks at the next domain boundary, so no domain
            holds both trainer and inference GPUs (disaggregated clusters); else they follow right after.
        name: a label for tables.
    """

    train: TrainerParallel
    gen: InferenceParallel
    domain_size: int | None = None
    colocated: bool = False
    separate_domains: bool = True
    name: str = ""

    def __post_init__(self) -> None:
        if self.colocated and self.gen.num_gpus != self.train.num_gpus:
            raise ValueError(
                f"system {self.name!r}: colocated needs equal GPU counts, trainer {self.train.num_gpus}, "
                f"inference {self.gen.num_gpus}"
            )
        if self.domain_size is not None and self.domain_size < 1:
            raise ValueError(f"system {self.name!r}: domain_size must be >= 1, got {self.domain_size}")

    def with_domain_size(self, domain_size: int) -> System:
        """This system with `domain_size` filled in (from the hardware preset when the system gave none)."""
        return dataclasses.replace(self, domain_size=domain_size)

    @property
    def gen_offset(self) -> int:
        """The global rank of inference rank 0."""
        if self.colocated:
            return 0
        n = self.train.num_gpus
        assert n is not None
        if self.separate_domains and self.domain_size:
            return math.ceil(n / self.domain_size) * self.domain_size
        return n

    @property
    def train_ranks(self) -> range:
        return range(self.train.num_gpus or 0)

    @property
    def gen_ranks(self) -> range:
        return range(self.gen_offset, self.gen_offset + (self.gen.num_gpus or 0))

    def describe(self) -> str:
        where = "colocated" if self.colocated else ("separate domains" if self.separate_domains else "packed")
        return (
            f"{self.name + ': ' if self.name else ''}train {self.train.describe()} -> gen {self.gen.describe()}, "
            f"{self.domain_size or '?'} GPUs per NVLink domain, {where}"
        )

    # ---- parsing -----------------------------------------------------------------------------------------------
    @classmethod
    def from_m2n(cls, config: dict[str, Any], *, name: str = "", **options: Any) -> System:
        """Read NCCL M2N's system-config format.

        M2N's `dp_size` is 1 in its MoE configs even where `num_gpus / (tp*cp*pp)` is larger (the expert-parallel
        ranks are counted there); we take `num_gpus` as the truth and derive the dense data-parallel size from it.
        `fsdp_size > 1`, and `pp_size`/`cp_size > 1` on the generation side, are refused (not modelled).
        """
        try:
            t, g = config["train"], config["generation"]
        except KeyError as e:
            raise ValueError(f"system config {name!r}: missing {e.args[0]!r}; expected keys 'train' and 'generation'")
        for side, d in (("train", t), ("generation", g)):
            if int(d.get("fsdp_size", 1)) != 1:
                raise NotImplementedError(f"system config {name!r}: {side} fsdp_size={d['fsdp_size']} (only 1)")
        for key in ("pp_size", "cp_size"):
            if int(g.get(key, 1)) != 1:
                raise NotImplementedError(f"system config {name!r}: generation {key}={g[key]} (only 1)")
        tp, cp, pp = int(t.get("tp_size", 1)), int(t.get("cp_size", 1)), int(t.get("pp_size", 1))
        num = int(t["num_gpus"]) if "num_gpus" in t else None
        dp = None if num is not None else int(t.get("dp_size", 1))
        train = TrainerParallel(tp=tp, cp=cp, pp=pp, dp=dp, ep=int(t.get("ep_size", 1)), num_gpus=num)
        if "dp_size" in t and int(t["dp_size"]) != train.dp:
            logger.info("%s: M2N dp_size=%s, derived dense dp=%s from num_gpus", name, t["dp_size"], train.dp)
        gen = InferenceParallel(
            tp=int(g.get("tp_size", 1)),
            dp=int(g.get("dp_size", 1)),
            ep=int(g.get("ep_size", 1)),
            num_gpus=int(g["num_gpus"]) if "num_gpus" in g else None,
        )
        return cls(train, gen, name=name, **options)

    @classmethod
    def parse(cls, text: str, *, name: str = "") -> System:
        """Read the command-line form.

        Grammar: space-separated `train=<spec>`, `gen=<spec>` and optional `domain=<int>`, `colocated`, `packed`.
        A spec is comma-separated `<key><int>`: trainer keys `tp cp pp dp ep etp gpus`, inference keys
        `tp dp ep gpus`, and `layers=a/b/c` for the trainer's layers per stage.

        Example:
            >>> System.parse("train=tp2,cp2,pp4,ep16 gen=tp8,dp8 domain=72").train.dp
            4
        """
        fields: dict[str, str] = {}
        flags: set[str] = set()
        for tok in text.split():
            if "=" in tok:
                k, v = tok.split("=", 1)
                fields[k] = v
            else:
                flags.add(tok)
        unknown = (set(fields) - {"train", "gen", "domain"}) | (flags - {"colocated", "packed"})
        if unknown or "train" not in fields or "gen" not in fields:
            raise ValueError(
                f"system {text!r}: expected 'train=<spec> gen=<spec> [domain=N] [colocated] [packed]'"
                + (f", unknown {sorted(unknown)}" if unknown else "")
            )
        t = _parse_spec(fields["train"], {"tp", "cp", "pp", "dp", "ep", "etp", "gpus", "layers"}, "train")
        g = _parse_spec(fields["gen"], {"tp", "dp", "ep", "gpus"}, "gen")
        layers = t.pop("layers", None)
        train = TrainerParallel(num_gpus=t.pop("gpus", None), stage_layers=layers, **t)  # type: ignore[arg-type]
        gen_dp = g.pop("dp", None)
        gen_num = g.pop("gpus", None)
        if gen_dp is None and gen_num is not None:
            gen_dp = gen_num // g.get("tp", 1)
        gen = InferenceParallel(dp=gen_dp or 1, num_gpus=gen_num, **g)  # type: ignore[arg-type]
        return cls(
            train,
            gen,
            domain_size=int(fields["domain"]) if "domain" in fields else None,
            colocated="colocated" in flags,
            separate_domains="packed" not in flags,
            name=name or text,
        )


def _parse_spec(spec: str, keys: set[str], side: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in filter(None, spec.split(",")):
        if part.startswith("layers="):
            out["layers"] = tuple(int(x) for x in part.removeprefix("layers=").split("/"))
            continue
        m = re.fullmatch(r"([a-z]+)(\d+)", part)
        if not m or m.group(1) not in keys:
            raise ValueError(
                f"{side} spec {spec!r}: cannot read {part!r}; expected <key><int> with key in {sorted(keys)}"
            )
        out[m.group(1)] = int(m.group(2))
    return out


def system_config_names() -> list[str]:
    """Names of the M2N system configs shipped in `reshard/sim/configs/`."""
    return sorted(
        p.name.removesuffix(".json")
        for p in resources.files(__package__).joinpath("configs").iterdir()
        if p.name.endswith(".json")
    )


def load_system(name_or_path: str, **options: Any) -> System:
    """A `System` from a shipped M2N config name (see `system_config_names`), a JSON path, or the command-line form.

    Args:
        name_or_path: `"dsv3-128gpus-gb200"`, `"path/to/config.json"` or `"train=... gen=..."`.
        options: `System` fields to set (`domain_size`, `colocated`, `separate_domains`).
    """
    if "=" in name_or_path:
        system = System.parse(name_or_path)
        return dataclasses.replace(system, **options) if options else system
    path = Path(name_or_path)
    if path.suffix == ".json" and path.exists():
        return System.from_m2n(json.loads(path.read_text()), name=path.stem, **options)
    shipped = resources.files(__package__).joinpath("configs", f"{name_or_path}.json")
    if shipped.is_file():
        return System.from_m2n(json.loads(shipped.read_text()), name=name_or_path, **options)
    raise ValueError(
        f"unknown system {name_or_path!r}: not a JSON file, a shipped config ({system_config_names()}) "
        "or a 'train=... gen=...' spec"
    )
