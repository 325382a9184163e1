"""Tied weights (one tensor under two names, declared by its own side): the name rules in one process, and the
four tie cases across 4 gloo ranks (trainer ranks 0-1, engine ranks 2-3), bit for bit against the full tensors."""

from __future__ import annotations

import pytest
import torch

from reshard.refit._names import match_names, merge_aliases

E, L, N = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"


@pytest.mark.parametrize("src_tied,dst_tied,want", [
    (True, True, [(E, E), (N, N)]),
    (True, False, [(E, E), (N, N), (E, L)]),  # one trainer tensor feeds both engine tensors
    (False, False, [(L, L), (E, E), (N, N)]),
])
def test_ties_pair_names(src_tied: bool, dst_tied: bool, want: list) -> None:
    sources = [E, N] if src_tied else [E, L, N]
    dests = [E, N] if dst_tied else [E, L, N]
    pairs, errors = match_names(sources, dests, src_aliases={E: [L]} if src_tied else None,
                                dst_aliases={E: [L]} if dst_tied else None)
    assert errors == [] and sorted(pairs) == sorted(want)


def test_an_engine_tie_the_trainer_lacks_is_refused_naming_both() -> None:
    for sources in ([E, L, N], [L, E, N]):
        pairs, errors = match_names(sources, [E, N], dst_aliases={E: [L]})
        assert len(errors) == 1 and f"the engine ties {L!r} to {E!r}" in errors[0], errors
        assert repr(E) in errors[0] and repr(L) in errors[0]


def test_a_trainer_weight_under_an_engine_alias_writes_the_tied_tensor() -> None:
    pairs, errors = match_names([L, N], [E, N], dst_aliases={E: [L]})
    assert errors == [] and sorted(pairs) == [(L, E), (N, N)]


def test_without_ties_the_one_sided_cases_are_plain_name_errors() -> None:
    """Negative control: the pairs above come from the aliases, not from the names alone."""
    _, errors = match_names([E, N], [E, L, N])
    assert any("(missing): ['lm_head.weight']" in e for e in errors), errors
    _, errors = match_names([E, L, N], [E, N])
    assert any("(extra)" in e for e in errors), errors


def test_conflicting_tie_declarations_are_errors() -> None:
    errors: list[str] = []
    merge_aliases([(0, {E: [L]}), (1, {N: [L]})], "trainer", errors)
    assert errors and "'lm_head.weight' is tied to 'model.embed_tokens.weight' on rank 0" in errors[0]
    errors = []
    merge_aliases([(0, {E: [L], L: ["x"]})], "inference", errors)
    assert errors and "which is itself tied" in errors[0]


def _full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(name))
    return torch.randn((10, 6) if name != N else (6,), generator=g).to(torch.bfloat16)


def job_ties(w, src_tied: bool, dst_tied: bool, map_alias: bool = False) -> dict:
    """Trainer ranks 0-1 hold each weight `S(0)`, engine ranks 2-3 `S(1)`; a tied side registers the embedding once
    with `lm_head.weight` as its alias. Returns each engine tensor's equality with the trainer's full tensor."""
    from reshard import Layout, Mesh, Refit, Shard
    from reshard.comm import Group

    trainer, engine = [0, 1], [2, 3]
    refit = Refit(Group.world(), name_map=(lambda n: n.replace("lm_head", "output")) if map_alias else None)
    dnames = {L: "output.weight"} if map_alias else {}
    got: dict[str, torch.Tensor] = {}
    if w.rank in trainer:
        for name in ([E, N] if src_tied else [E, L, N]):
            full = _full(E if src_tied and name == E else name)
            lay = Layout(tuple(full.shape), Mesh(trainer), [Shard(0)], full.dtype, name=name)
            box = lay.pieces(w.rank)[0].global_box
            local = full[box.offsets[0]:box.offsets[0] + box.shape[0]].clone()
            refit.add_source(name, local, lay, aliases=[L] if src_tied and name == E else ())
    else:
        for name in ([E, N] if dst_tied else [E, L, N]):
            gname = dnames.get(name, name)
            shape = (10, 6) if name != N else (6,)
            lay = Layout(shape, Mesh(engine), [Shard(len(shape) - 1)], torch.bfloat16, name=gname)
            got[name] = torch.zeros(lay.local_shape(w.rank), dtype=torch.bfloat16)
            alias = [dnames.get(L, L)] if dst_tied and name == E else ()
            refit.add_destination(gname, got[name], lay, aliases=alias)
    refit.run()
    out = {}
    for name, t in got.items():
        src = E if src_tied and name == L else name  # a tied trainer sends its embedding for lm_head
        k = engine.index(w.rank)
        full = _full(src)[..., k * 3:(k + 1) * 3]  # S(last dim) over the 2 engine ranks: 3 columns each
        out[name] = torch.equal(t.view(torch.int16), full.reshape(t.shape).view(torch.int16))
    return out


RANK_POOL = {"world_size": 4, "timeout_s": 120}  # the `pool` fixture's ranks (tests/conftest.py)


@pytest.mark.distributed
@pytest.mark.parametrize("src_tied,dst_tied,map_alias", [(True, True, False), (True, False, False),
                                                          (False, False, False), (True, False, True)])
def test_tied_refit_is_bit_exact(pool, src_tied: bool, dst_tied: bool, map_alias: bool) -> None:
    out = pool.run_ok(job_ties, src_tied, dst_tied, map_alias)
    for o in out[2:]:
        assert o and all(o.values()), o
    assert (L in out[2]) == (not dst_tied)


@pytest.mark.distributed
def test_engine_ties_trainer_does_not_every_rank_raises_naming_both(pool) -> None:
    out = pool.run(job_ties, False, True)
    for r, o in enumerate(out):
        assert not o.ok and o.error_type == "ValueError", (r, o)
        assert f"the engine ties {L!r} to {E!r}" in o.message and "nothing was moved" in o.message, o.message


def test_trainer_finds_ties_in_a_module_and_a_state_dict() -> None:
    """A tied transformers model: `named_parameters()` shows the embedding once, `state_dict()` twice; the vLLM
    trainer side sends it once with `lm_head.weight` as its alias either way, and an untied one has no ties."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from reshard.integrations.trainer import config_ties, source_weights

    cfg = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, vocab_size=37)
    tied = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **cfg))
    for source in (tied, tied.state_dict()):
        weights, ties = source_weights(source)
        assert ties == {E: [L]} and L not in weights and E in weights
    untied = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **cfg))
    weights, ties = source_weights(untied)
    assert ties == {} and L in weights  # negative control: two tensors are no tie
    # the config's tie, for a mapping that holds the embedding only (`dict(model.named_parameters())`)
    only = dict(tied.named_parameters())
    weights, ties = source_weights(only)
    assert ties == {} and config_ties(weights, ties, tied.config) == {E: [L]}
    assert config_ties(weights, {}, untied.config) == {}
