"""Run the vLLM tier as on a processor whose CPU GEMM dispatch can take `F.linear` only (an AVX2-only x86: no AMX,
no oneDNN kernels), on any processor: put this folder first on `PYTHONPATH`, e.g.

    PYTHONPATH=tests/emulate_torch_gemm:. .venv-vllm/bin/python -m pytest -q -n 0 -m vllm tests/integrations/test_vllm_engine.py

Python imports this module at start-up in every process of the run (vLLM's worker processes included, as they
inherit `PYTHONPATH`). It turns off vLLM's `_supports_onednn` as `vllm._custom_ops` is imported; AMX is already off
on a processor without it (check the run's "reshard notes" summary). Zen builds with zentorch are not covered.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys


class _NoOneDNN(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "vllm._custom_ops":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            module._supports_onednn = False

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _NoOneDNN())
