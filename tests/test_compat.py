"""The torch version guard: importing reshard under a torch older than 2.10 raises, naming the version and why."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from reshard._compat import check_torch_version


@pytest.mark.parametrize("version", ["2.10.0", "2.10.0a0+git1234", "2.11.0+cu130", "2.13.0+cpu", "3.0.0"])
def test_supported_versions_pass(version: str) -> None:
    assert check_torch_version(version) is None


@pytest.mark.parametrize("version", ["2.9.1", "2.9.0+cu128", "1.13.1", "2.1.0"])
def test_older_versions_refused(version: str) -> None:
    with pytest.raises(ImportError, match=rf"torch >= 2\.10, but torch {re.escape(version)} .*_StridedShard"):
        check_torch_version(version)


def test_unreadable_version_refused() -> None:
    with pytest.raises(ImportError, match="cannot read the installed torch version 'nightly'"):
        check_torch_version("nightly")


def test_import_refuses_old_torch() -> None:
    """The real wiring: `import reshard` in a fresh interpreter whose torch reports 2.9.1 fails with the message."""
    code = "import torch; torch.__version__ = '2.9.1'; import reshard"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "ImportError: reshard needs torch >= 2.10, but torch 2.9.1 is installed" in run.stderr, run.stderr[-2000:]
