"""Real `transformers` trainers (FSDP2 + TP, EP + FSDP over edp) refit to vLLM-style engines, on 8 gloo ranks.

Every engine tensor is compared bit for bit with the trainer's `full_tensor()` sliced by the rules written below
(not the library's layout code), and the engine's shards, put back together by hand into a Hugging Face model, must
give `torch.equal` logits to the trainer's weights in the same model. Both after the first run and after an
optimizer step and a second run; with the group numbered as the world, engine first, and trainer first.
"""

from __future__ import annotations

import importlib.util
import re

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("transformers") is None:  # imported where the jobs build models: collection stays cheap
    pytest.skip("needs transformers", allow_module_level=True)

from hf_cases import SENTINEL, build_model, configs, job_refit  # noqa: E402
from vllm_oracle import vllm_local  # noqa: E402

pytestmark = pytest.mark.distributed

TP = 2


RANK_POOL = {"world_size": 8}  # the `pool` fixture's ranks (tests/conftest.py)


@pytest.fixture(scope="module")
def shapes():
    """Parameter name -> global shape of each model (the engine side reads no transformers)."""
    return {k: {n: tuple(p.shape) for n, p in build_model(k).named_parameters()} for k in configs()}


def expected(name: str, full: dict, cfg: dict, t: int, *, ep: int, e: int, like: torch.Tensor,
             pad: float = SENTINEL) -> torch.Tensor:
    """Engine tensor `name` on TP rank `t` (EP rank `e`), cut from the trainer's full tensors by vLLM's rules
    (`tests/vllm_oracle.py`)."""
    def experts(layer: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gu = full[f"{layer}.experts.gate_up_proj"]  # [E, 2I, H], gate rows then up rows
        i = gu.shape[1] // 2
        return gu[:, :i], gu[:, i:], full[f"{layer}.experts.down_proj"]  # down: [E, H, I]

    return vllm_local(name, full.__getitem__, tp=TP, t=t, kv_heads=cfg["num_key_value_heads"],
                      head_dim=cfg["head_dim"], padded=like.clone().fill_(pad), experts=experts, ep=ep, e=e)


def reassemble(engine: dict[int, dict], cfg: dict, *, ep: int) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict from one replica's shards (engine TP ranks 0 and 1, or EP ranks 0..ep-1)."""
    tp_locals = [engine[0], engine[1]]
    ep_locals = [engine[i] for i in range(ep)]
    nh, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    sd = {}
    for name in tp_locals[0]:
        parts = [loc[name] for loc in tp_locals]
        m = re.match(r"^(.*)\.qkv_proj\.weight$", name)
        if m:
            nq, nkv = nh * hd // TP, max(kv // TP, 1) * hd
            qs, ks, vs = zip(*(p.split([nq, nkv, nkv]) for p in parts))
            sd[f"{m.group(1)}.q_proj.weight"] = torch.cat(qs)
            step = 1 if kv >= TP else TP // kv  # replicated KV: one copy per head
            sd[f"{m.group(1)}.k_proj.weight"] = torch.cat(ks[::step])
            sd[f"{m.group(1)}.v_proj.weight"] = torch.cat(vs[::step])
            continue
        m = re.match(r"^(.*)\.gate_up_proj\.weight$", name)
        if m:
            gs, us = zip(*(p.chunk(2) for p in parts))
            sd[f"{m.group(1)}.gate_proj.weight"], sd[f"{m.group(1)}.up_proj.weight"] = torch.cat(gs), torch.cat(us)
            continue
        m = re.match(r"^(.*)\.experts\.(w13|w2)_weight$", name)
        if m:
            hf_name = f"{m.group(1)}.experts.{'gate_up_proj' if m.group(2) == 'w13' else 'down_proj'}"
            if ep > 1:
                sd[hf_name] = torch.cat([loc[name] for loc in ep_locals])
            elif m.group(2) == "w13":
                gs, us = zip(*(p.chunk(2, dim=1) for p in parts))
                sd[hf_name] = torch.cat([torch.cat(gs, 1), torch.cat(us, 1)], 1)
            else:
                sd[hf_name] = torch.cat(parts, 2)
            continue
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            sd[name] = torch.cat(parts)[: cfg["vocab_size"]]
        elif re.search(r"\.(o_proj|down_proj)\.weight$", name):
            sd[name] = torch.cat(parts, 1)
        else:
            sd[name] = parts[0]
    return sd


def logits(kind: str, state: dict[str, torch.Tensor]) -> torch.Tensor:
    model = build_model(kind, seed=1)  # other random weights: every one must be overwritten
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if configs()[kind]["tie_word_embeddings"]:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.arange(24).reshape(2, 12) * 7 % configs()[kind]["vocab_size"]
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def mismatches(out: list[dict], run: int, kind: str, ep: int, pad: float = SENTINEL) -> list[str]:
    cfg = configs()[kind]
    full = next(o["runs"][run] for o in out if o["runs"][run] is not None and "tp_index" not in o)
    bad = []
    for o in out:
        if "tp_index" not in o:
            continue
        for name, local in o["runs"][run].items():
            want = expected(name, full, cfg, o["tp_index"], ep=ep, e=o["ep_index"], like=local, pad=pad)
            if want.shape != local.shape or not torch.equal(want, local):
                bad.append(f"group rank {o['group_rank']}: {name}")
    return bad


def engine_by_index(out: list[dict], run: int) -> dict[int, dict]:
    """Engine locals of the first replica's TP (or EP) ranks, by engine position."""
    engine = sorted((o for o in out if "tp_index" in o), key=lambda o: o["group_rank"])
    return {i: o["runs"][run] for i, o in enumerate(engine)}


def check(out: list[dict], kind: str, ep: int = 1) -> None:
    for run in (0, 1):
        assert mismatches(out, run, kind, ep) == [], run
        full = next(o["runs"][run] for o in out if o["runs"][run] is not None and "tp_index" not in o)
        got = logits(kind, reassemble(engine_by_index(out, run), configs()[kind], ep=ep))
        assert torch.equal(got, logits(kind, full)), run
    first = next(o["runs"][0] for o in out if "tp_index" not in o and o["runs"][0] is not None)
    second = next(o["runs"][1] for o in out if "tp_index" not in o and o["runs"][1] is not None)
    assert all(not torch.equal(first[n], second[n]) for n in first), "the optimizer step changed every weight"


@pytest.mark.parametrize("numbering", ["world", "engine_first", "trainer_first"])
def test_qwen3_fsdp2_tp_plain_loop_refit_is_exact(pool, shapes, numbering: str) -> None:
    """FSDP2 over dp x HF's TP plan, registered with `for name, p in model.named_parameters()`, to 2 TP2 engines."""
    out = pool.run_ok(job_refit, "qwen3", numbering, shapes["qwen3"])
    check(out, "qwen3")
    if numbering == "engine_first":
        assert sorted(o["group_rank"] for o in out if "tp_index" in o) == [0, 1, 2, 3]


@pytest.mark.parametrize("numbering,ep", [("world", 1), ("engine_first", 4), ("trainer_first", 1)])
def test_qwen3_moe_ep_fsdp_refit_is_exact(pool, shapes, numbering: str, ep: int) -> None:
    """transformers 5 fused experts `S(0)` over ep x FSDP2 over edp, to TP2 x 2 engines and to an EP4 engine."""
    out = pool.run_ok(job_refit, "qwen3_moe", numbering, shapes["qwen3_moe"], ep=ep)
    check(out, "qwen3_moe", ep)
    # policy auto, decided with the whole-model plan: no expert goes by gather-and-broadcast for a 0.3% gain
    assert set(out[0]["choices"].values()) == {"reshard"}


def test_swapped_tp_halves_fail_both_checks(pool, shapes) -> None:
    """Negative control: the checks above catch two TP ranks' qkv shards swapped."""
    out = pool.run_ok(job_refit, "qwen3", "world", shapes["qwen3"], steps=0)
    engine = [o for o in out if "tp_index" in o]
    a, b = engine[0]["runs"][0], engine[1]["runs"][0]
    name = "model.layers.1.self_attn.qkv_proj.weight"
    a[name], b[name] = b[name], a[name]
    assert mismatches(out, 0, "qwen3", 1) == [f"group rank 4: {name}", f"group rank 5: {name}"]
    full = out[0]["runs"][0]
    assert not torch.equal(logits("qwen3", reassemble(engine_by_index(out, 0), configs()["qwen3"], ep=1)),
                           logits("qwen3", full))


def test_replica_check_names_the_weight_and_ranks(pool, shapes) -> None:
    """TP copies of a norm that differ (as without the gradient all-reduce over TP) fail on every rank."""
    name = "model.layers.0.self_attn.q_norm.weight"
    outs = pool.run(job_refit, "qwen3", "world", shapes["qwen3"], check_replicas=True, corrupt=name)
    for o in outs:
        assert not o.ok and o.error_type == "ValueError", o
        assert re.search(rf"'{re.escape(name)}': copies that its layout says are equal differ in box \[0:8\]: "
                         r"ranks \[0(, 2)?\] vs ranks \[1\]", o.error), o.error[:1500]


def test_quick_start_example_is_exact(pool) -> None:
    """`examples/fsdp_tp_refit.py` (the README's FSDP2 + TP quick start) gives the engine the trainer's model."""
    from hf_cases import job_example

    out = pool.run_ok(job_example)
    assert mismatches(out, 0, "qwen3", 1, pad=0.0) == []  # the example's engine starts from zeros
    full = out[0]["runs"][0]
    assert torch.equal(logits("qwen3", reassemble(engine_by_index(out, 0), configs()["qwen3"], ep=1)),
                       logits("qwen3", full))


@pytest.mark.parametrize("ep", [1, 4])
def test_per_expert_checkpoint_names_fill_w13_and_w2(pool, shapes, ep: int) -> None:
    """Older checkpoints' per-expert weights, plain tensors with a `Layout`, into the engine's fused experts."""
    from hf_cases import job_per_expert, per_expert_state

    fused = {n: p.detach() for n, p in build_model("qwen3_moe").named_parameters()}
    per = {n: tuple(t.shape) for n, t in per_expert_state(fused).items()}
    out = pool.run_ok(job_per_expert, per, ep)
    out[0]["runs"][0] = fused  # the oracle slices the fused full tensors
    engine = [o for o in out if "tp_index" in o]
    assert sorted(engine[0]["runs"][0]) == [f"model.layers.{i}.mlp.experts.{w}_weight" for i in (0, 1)
                                            for w in ("w13", "w2")]
    assert mismatches(out, 0, "qwen3_moe", ep) == []


def test_conflicting_registrations_raise_on_every_rank_with_each_layout(pool) -> None:
    from hf_cases import job_conflict

    for o in pool.run(job_conflict):
        assert not o.ok and o.error_type == "ValueError", o
        assert re.search(r"source 'w': ranks disagree on its layout:\n    ranks \[0\]: Layout\('w' \[8, 4\] float32 "
                         r"ranks=0-1 mesh=2 \[S\(0\)\]\)\n    ranks \[1\]: .*\[S\(1\)\]\)\n  rank 0 is in the layout",
                         o.error), o.error[:1500]
