"""Shared fixtures and test tiers.

Tiers (markers, registered in pyproject.toml; `--strict-markers` refuses others):
    distributed: starts several processes (the rank pool, torchrun); `pytest -m "not distributed"` runs none.
    slow: 15 s or more on its own; `make test-fast` (`-m "not slow"`) leaves it out, `make test` runs it.
    gpu: needs a CUDA device (`RESHARD_TEST_DEVICE=cuda`); skipped without one.
    vllm: needs vLLM installed; skipped without it.
    frameworks: needs verl and Ray (`.venv-verl`, `make test-frameworks`); its modules skip themselves without them.

The device: the `device` fixture, from `RESHARD_TEST_DEVICE` (`cpu` unless set to `cuda`; see
`reshard.testing.device_under_test`). Modules that need it at import time call `device_under_test()` themselves.

Parallel runs (pytest-xdist, on by default through `addopts = -n auto --dist loadfile`; `-n 0` turns it off):
`pytest_xdist_auto_num_workers` picks the workers (the CPUs this process may use, at most 4). Each test file runs
whole on one worker, so a module's fixtures (its rank pool, the 2 GiB arena of `test_kernels_large.py`, the vLLM
trainers) are built once; each worker has its own `shared_pool`s and runs torch with one intra-op thread.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch

# torch and reshard are imported inside the hooks and fixtures, not here: under xdist the controller process only
# hands out files and would otherwise spend ~3.5 s importing torch before any worker starts.


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device the tests run on (`RESHARD_TEST_DEVICE`, default `cpu`)."""
    from reshard.testing import device_under_test

    return device_under_test()


@pytest.fixture
def max_interpreted_block(monkeypatch: pytest.MonkeyPatch):
    """`cap(lanes)`: for this test, Triton's interpreter (CPU tensors) makes tiles of at most `lanes` lanes, so a
    larger box is several programs, the last partly masked. By default it makes most test boxes one program
    (`reshard.kernels.launch_config`); GPU tiles do not change."""

    from reshard.kernels import _tiles

    def cap(lanes: int) -> None:
        monkeypatch.setattr(_tiles, "INTERPRETED_MAX_BLOCK", lanes)

    return cap


@pytest.fixture(scope="module")
def pool(request: pytest.FixtureRequest):
    """The module's rank pool (`reshard.testing.RankPool`), as the module's `RANK_POOL` says:

    - `RANK_POOL = n`: this worker's shared pool of `n` gloo ranks (`reshard.testing.shared_pool`), started by the
      first module that asks and reused by the next ones (one start-up per worker and size);
    - `RANK_POOL = {"world_size": n, ...}`: a pool of the module's own, built with these `RankPool` arguments and
      closed after the module: for modules whose cases kill or stall ranks, or need other timeouts.

    A module with `RANK_POOL_BACKENDS = ("gloo", "reshard_nccl_rules")` runs each of its pool tests once per
    backend (`pytest_generate_tests`), on a pool of that backend.
    """
    from reshard.testing import RankPool, shared_pool

    spec = getattr(request.module, "RANK_POOL", None)
    backend = getattr(request, "param", "gloo")
    if isinstance(spec, int):
        yield shared_pool(spec, backend=backend)
        return
    if not isinstance(spec, dict):
        raise TypeError(f"{request.module.__name__}: the pool fixture needs RANK_POOL = <ranks> or a dict of "
                        f"RankPool arguments, got {spec!r}")
    with RankPool(**{"backend": backend, **spec}) as p:
        yield p


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    backends = getattr(metafunc.module, "RANK_POOL_BACKENDS", None)
    if backends and "pool" in metafunc.fixturenames:
        metafunc.parametrize("pool", backends, indirect=True, scope="module")


@pytest.fixture(scope="module")
def fake_world():
    """For the module: `reshard.testing.dtensor_local` / `use_fake_rank` may make a fake default process group;
    it is destroyed after the module (`pytestmark = pytest.mark.usefixtures("fake_world")`)."""
    from reshard.testing import close_fake_world

    yield
    close_fake_world()


MAX_WORKERS = 4

if os.environ.get("PYTEST_XDIST_WORKER"):
    # workers share the CPUs: one intra-op thread each, so no worker's thread pool spins against another's
    import torch

    torch.set_num_threads(1)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: `PYTEST_XDIST_AUTO_NUM_WORKERS` if set, else the usable CPUs, at most `MAX_WORKERS`."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus, MAX_WORKERS))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from reshard.testing import device_under_test

    on_gpu = device_under_test().type == "cuda"
    has_vllm = importlib.util.find_spec("vllm") is not None
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a GPU: set RESHARD_TEST_DEVICE=cuda on a CUDA machine"))
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="needs vLLM installed"))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what collection built (torch, reshard, the test modules and items: ~400k objects per worker) out of the
    garbage collector's reach, and collect the young generations less often. Otherwise every full collection rescans
    them: a worker of the no-process tier spent up to 6 s of its ~40 s in collections, 1.5 s after (timed with
    `gc.callbacks`). Objects made by the tests are collected as before."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


# The processor's features that change which kernels torch and vLLM's CPU backend run (the tests assert behaviour,
# never these; they are printed so a failure log says what machine it came from).
_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def processor_summary(cpuinfo: str = "/proc/cpuinfo") -> str:
    """One line: the processor's model name, which of `_CPU_FLAGS` it has, and the CPUs this process may use."""
    model, flags = "unknown", set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    has = [f for f in _CPU_FLAGS if f in flags]
    missing = [f for f in _CPU_FLAGS if f not in flags]
    return f"processor: {model}; {cpus} usable CPUs; has {', '.join(has) or 'none'} of {', '.join(_CPU_FLAGS)}" + (
        f" (not {', '.join(missing)})" if missing else "")


def pytest_report_header(config: pytest.Config) -> str:
    return processor_summary()  # shown without -q; the summary below repeats it for -q runs


_NOTES: list[str] = []
NOTE = "reshard-note"  # a `record_property` key (tests/vllm_cases.py uses the same) printed in the run's summary


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Collect the `NOTE` properties tests record (in this process or, under xdist, sent from a worker)."""
    if report.when == "call":
        _NOTES.extend(f"{report.nodeid}: {value}" for key, value in report.user_properties if key == NOTE)


def stack_summary() -> str:
    """One line: the Python, torch, Triton and numpy this run used (the compatibility tier's runs differ in these)."""
    import platform
    from importlib import metadata

    versions = []
    for name in ("torch", "triton", "numpy"):
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{name} not installed")
    return f"stack: Python {platform.python_version()}, " + ", ".join(versions)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    terminalreporter.section("reshard notes")
    for line in [processor_summary(), *_NOTES, stack_summary()]:
        terminalreporter.write_line(line)
