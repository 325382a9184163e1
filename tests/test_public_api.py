"""The public face: every exported name imports, `__all__` lists are sorted, and the names the docs use are there."""

from __future__ import annotations

import importlib

import pytest

PUBLIC_PACKAGES = ["reshard", "reshard.planner", "reshard.cost", "reshard.kernels", "reshard.comm", "reshard.refit",
                   "reshard.sim"]

DOCUMENTED = {
    "reshard": [
        "Box", "ChecksumError", "CommError", "DEFAULT_STAGING_BYTES", "DEFAULT_TIMEOUT", "ExecutionReport",
        "ExplicitLayout", "Group", "Layout", "Mesh", "Plan", "PlanItem", "Refit", "RefitReport", "Replicate", "Shard",
        "Staging", "Topology", "TransferHandle", "exchange_layouts", "execute", "fuse", "gather_broadcast_bytes",
        "pack", "plan", "plan_many", "relabel", "reshard", "reshard_dtensor", "transfer", "unpack",
        "vocab_parallel_layout",
    ],
    "reshard.kernels": ["Box", "pack", "unpack", "quantize_fp8_block", "block_aligned", "scale_box"],
    "reshard.cost": ["Hardware", "get_hardware", "gather_broadcast", "gather_broadcast_bytes", "link_time"],
    "reshard.planner": ["scale_layout", "block_halo_layout", "encode_layout", "decode_layout", "parse_layout",
                        "FlatRangeLayout", "flat_boxes", "flat_window", "flat_partition"],
}


def isort_key(name: str) -> tuple[int, str]:
    """The order ruff's RUF022 keeps `__all__` in: CONSTANTS, then Classes, then functions, each alphabetical."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


@pytest.mark.parametrize("name", PUBLIC_PACKAGES)
def test_all_is_sorted_and_importable(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__doc__, f"{name} has no docstring"
    names = module.__all__
    assert names == sorted(names, key=isort_key), f"{name}.__all__ is not sorted (constants, classes, functions)"
    assert len(set(names)) == len(names), f"{name}.__all__ repeats a name"
    for n in names:
        assert hasattr(module, n), f"{name}.__all__ lists {n!r}, which it does not define"
    star: dict = {}
    exec(f"from {name} import *", star)  # what `import *` gives is exactly __all__
    assert set(star) - {"__builtins__"} == set(names)


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_documented_names_are_exported(name: str) -> None:
    module = importlib.import_module(name)
    missing = sorted(set(DOCUMENTED[name]) - set(module.__all__))
    assert not missing, f"{name} does not export {missing}"


def test_reexports_are_the_same_objects() -> None:
    import reshard
    import reshard.comm
    import reshard.cost
    import reshard.kernels
    import reshard.planner
    import reshard.sim

    assert reshard.sim.gather_broadcast is reshard.cost.gather_broadcast
    assert reshard.sim.Hardware is reshard.cost.Hardware
    assert reshard.kernels.Box is reshard.planner.Box is reshard.Box
    assert reshard.gather_broadcast_bytes is reshard.cost.gather_broadcast_bytes
    assert reshard.execute is reshard.comm.execute and reshard.ExplicitLayout is reshard.planner.ExplicitLayout
