"""Systems: NCCL M2N's system-config JSON, the command-line form, rank placement and errors."""

from __future__ import annotations

import json

import pytest

from reshard.sim import InferenceParallel, System, TrainerParallel, load_system, system_config_names


def test_shipped_m2n_configs():
    names = system_config_names()
    assert "dsv3-128gpus-gb200" in names and "qwen235b-TP2CP2PP4EP16-128gpus-gb200" in names
    for name in names:
        s = load_system(name)
        assert s.train.num_gpus == s.train.tp * s.train.cp * s.train.dp * s.train.pp
        assert s.gen.num_gpus == s.gen.tp * s.gen.dp


def test_m2n_moe_configs_derive_dense_dp():
    # M2N writes dp_size=1 next to ep_size=16; the GPU count says dense dp is 16 (TP1 x PP4 on 64 GPUs).
    s = load_system("dsv3-128gpus-gb200")
    assert (s.train.tp, s.train.pp, s.train.ep, s.train.dp, s.train.edp, s.train.num_gpus) == (1, 4, 16, 16, 1, 64)
    assert (s.gen.tp, s.gen.dp, s.gen.num_gpus) == (8, 8, 64)
    q = load_system("qwen235b-TP2CP2PP4EP16-128gpus-gb200")
    assert (q.train.tp, q.train.cp, q.train.pp, q.train.dp, q.train.stage_size, q.train.edp) == (2, 2, 4, 4, 16, 1)


def test_m2n_dense_config_and_path(tmp_path):
    s = load_system("qwen3-32b-tp4pp4dp2-to-tp4dp8-64gpus-h100")
    assert (s.train.tp, s.train.pp, s.train.dp, s.gen.tp, s.gen.dp) == (4, 4, 2, 4, 8)
    cfg = {"train": {"tp_size": 2, "pp_size": 1, "dp_size": 3}, "generation": {"tp_size": 3, "dp_size": 2}}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(cfg))
    s = load_system(str(path), domain_size=4)
    assert (s.train.num_gpus, s.gen.num_gpus, s.domain_size, s.name) == (6, 6, 4, "mine")


def test_m2n_refusals():
    with pytest.raises(NotImplementedError, match="fsdp_size=2"):
        System.from_m2n({"train": {"fsdp_size": 2}, "generation": {}})
    with pytest.raises(NotImplementedError, match="generation pp_size=2"):
        System.from_m2n({"train": {}, "generation": {"pp_size": 2}})
    with pytest.raises(ValueError, match="missing 'generation'"):
        System.from_m2n({"train": {}})


def test_command_line_form():
    s = System.parse("train=tp2,cp2,pp4,ep16 gen=tp8,dp8 domain=72")
    # without dp or gpus, dp is the smallest that makes room for EP16 next to TP2 x CP2: 4
    assert (s.train.dp, s.train.num_gpus, s.gen.num_gpus, s.domain_size) == (4, 64, 64, 72)
    s = System.parse("train=pp4,ep16,gpus128 gen=tp8,gpus128")
    assert (s.train.dp, s.train.edp, s.gen.dp, s.domain_size) == (32, 2, 16, None)
    s = System.parse("train=tp2,pp2,layers=10/18 gen=tp2 packed")
    assert s.train.stage_layers == (10, 18) and not s.separate_domains
    assert System.parse("train=tp2,dp2 gen=tp4 colocated").colocated


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("train=tp2", "expected 'train=<spec> gen=<spec>"),
        ("train=tp2 gen=tp2 nodes=3", r"unknown \['nodes'\]"),
        ("train=xx2 gen=tp2", "cannot read 'xx2'"),
        ("train=tp2 gen=cp2", "cannot read 'cp2'"),
        ("train=tp2,dp1,ep4 gen=tp2", "ep\\*etp=4\\*1 must divide the 2 ranks"),
        ("train=tp2,dp2 gen=tp2 colocated", "colocated needs equal GPU counts"),
        ("train=tp4,gpus6 gen=tp2", "num_gpus=6 is not a multiple"),
    ],
)
def test_command_line_errors(text, match):
    with pytest.raises(ValueError, match=match):
        System.parse(text)


def test_rank_placement():
    t, g = TrainerParallel(tp=2, pp=2, ep=4, num_gpus=64), InferenceParallel(tp=8, dp=8)
    assert System(t, g, domain_size=72).gen_ranks == range(72, 136)  # next domain boundary
    assert System(t, g, domain_size=72, separate_domains=False).gen_ranks == range(64, 128)
    assert System(t, g, domain_size=8).gen_ranks == range(64, 128)  # already on a boundary
    assert System(t, g, domain_size=72, colocated=True).gen_ranks == range(64)
    assert System(t, g).train_ranks == range(64)
    assert "train tp2pp2ep4dp16 (64 GPUs) -> gen tp8dp8 (64 GPUs)" in System(t, g, domain_size=72).describe()


def test_unknown_system():
    with pytest.raises(ValueError, match="unknown system 'nope'.*dsv3-128gpus-gb200"):
        load_system("nope")
