"""The oldest torch reshard runs on, checked when `reshard` is imported.

Before torch 2.10, DTensor's `_StridedShard` (the placement FSDP2 gives a parameter that tensor parallelism has
already sharded) splits a dimension differently from the layouts reshard plans: a refit of such a parameter would
move the wrong bytes without any error. So an older torch is refused at import time, naming the version found.
"""

from __future__ import annotations

import re

import torch

MIN_TORCH = (2, 10)
"""The oldest `(major, minor)` torch release reshard supports (`pyproject.toml` says the same)."""


def check_torch_version(version: str) -> None:
    """Raise `ImportError` if the torch release `version` (`torch.__version__`, e.g. `"2.11.0+cu130"`) is older
    than `MIN_TORCH`; pre-releases of `MIN_TORCH` itself (`"2.10.0a0+git1234"`) pass.

    Example: `check_torch_version("2.9.1")` raises, naming 2.9.1 and the reason; `"2.10.0"` passes.
    """
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ImportError(f"reshard: cannot read the installed torch version {version!r} (expected 'MAJOR.MINOR...')")
    found = (int(match[1]), int(match[2]))
    if found < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise ImportError(
            f"reshard needs torch >= {need}, but torch {version} is installed: before {need}, DTensor's "
            f"_StridedShard (FSDP2 over tensor parallelism) splits a dimension differently from the layouts "
            f"reshard plans, so a refit would silently move the wrong bytes. Install a newer torch, e.g. "
            f"pip install 'torch>={need}'."
        )


check_torch_version(torch.__version__)
