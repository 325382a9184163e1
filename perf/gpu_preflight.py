"""Preflight of the GPU check (well under 30 s): versions, the torch NCCL APIs reshard uses, and a one-rank NCCL group
made by `Group.rendezvous` (connected eagerly, device bound) running one coalesced batch polled to completion.

Usage: python perf/gpu_preflight.py --device cuda   (--device cpu: the same steps on `reshard_nccl_rules`)
Exits 1 naming what is missing or failed, so the sections after it are not run blind.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

NCCL_APIS = ("eager_connect_single_device", "_start_coalescing", "_end_coalescing", "abort", "shutdown")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    import triton

    import reshard
    from reshard.comm import Group
    from reshard.testing import NCCL_RULES, free_port

    print(f"python {sys.version.split()[0]} torch {torch.__version__} triton {triton.__version__} "
          f"cuda {torch.version.cuda} reshard {reshard.__file__}")
    missing: list[str] = []
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            print("FAILED: no CUDA device visible")
            return 1
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        missing = ["ProcessGroupNCCL"] if nccl is None else [a for a in NCCL_APIS if not hasattr(nccl, a)]
        if nccl is not None and not hasattr(nccl.Options(), "_timeout"):
            missing.append("ProcessGroupNCCL.Options._timeout")
        print(f"device {torch.cuda.get_device_name()} nccl {torch.cuda.nccl.version()}")
        torch.cuda.set_device(0)
        backend = "nccl"
    else:
        backend = NCCL_RULES
    if missing:
        print(f"FAILED: torch lacks the NCCL APIs reshard uses: {missing}")
        return 1
    t0 = time.perf_counter()
    group = Group.rendezvous("127.0.0.1", free_port(), 0, 1, backend=backend, prefix="preflight", timeout=20)
    connected = time.perf_counter() - t0
    dev = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    pg = group.data_backend(dev)
    a = torch.arange(1 << 16, dtype=torch.float32, device=dev)
    b = torch.zeros_like(a)
    pg._start_coalescing(dev)
    if backend == "nccl":  # NCCL moves a rank's batch to itself; gloo has no self pair, so on CPU the batch is empty
        pg.send([a], 0, 1)
        pg.recv([b], 0, 1)
    work = pg._end_coalescing(dev)
    deadline = time.monotonic() + 10
    while work is not None and not work.is_completed():
        if time.monotonic() > deadline:
            print("FAILED: the coalesced batch did not complete within 10 s")
            return 1
        time.sleep(0.001)
    ok = backend != "nccl" or torch.equal(a, b)
    watchdog = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    print(f"group: backend {backend}, devices {group.devices}, connected eagerly in {connected:.2f} s, batch "
          f"{'exact' if ok else 'WRONG'}; TORCH_NCCL_ASYNC_ERROR_HANDLING={watchdog}")
    group.close()
    print("preflight", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
