"""Test-side workaround for a vLLM CPU bug, put first on `PYTHONPATH` of the examples' vLLM runs
(`tests/test_examples.py`), so that every process of the run (the engine's spawned workers included) runs it at start.

On a processor with AMX, a vLLM CPU worker dies (SIGILL, "Worker proc VllmWorker-0 died unexpectedly") in its first
attention (`vllm/_custom_ops.py:3927 cpu_attention_with_kv_cache`) when its first AMX instruction comes before anything
in the process asked Linux for AMX tile state: `vllm/v1/attention/backends/cpu_attn.py:544` picks the AMX kernel by
`torch.cpu._is_amx_tile_supported()`, which reads CPUID only. Asked here as `torch._C._cpu._init_amx()` asks, with
`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, without importing torch; elsewhere the call fails harmlessly.
The tests' own engines do the same through `vllm_cases.amx_permission`.
"""

import ctypes
import platform

if platform.system() == "Linux" and platform.machine() == "x86_64":
    try:
        ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18)  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XTILEDATA
    except (OSError, AttributeError):
        pass
