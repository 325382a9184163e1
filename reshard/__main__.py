"""Command line: `python -m reshard {plan,simulate}`.

- `plan`: plan one tensor between two layouts written in DTensor notation and print the statistics next to
  gather-and-broadcast's bytes (`--describe` lists the transfers).
- `simulate`: the cluster-scale refit simulator (see `reshard.sim`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from reshard.planner import Topology, format_bytes, gather_broadcast_bytes, plan
from reshard.planner._plan import format_stats
from reshard.planner._notation import parse_layout

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8": torch.float8_e4m3fn,
    "int8": torch.int8,
    "int32": torch.int32,
    "int64": torch.int64,
    "float64": torch.float64,
}


def parse_dtype(text: str) -> torch.dtype:
    try:
        return _DTYPES[text.lower().removeprefix("torch.")]
    except KeyError:
        raise SystemExit(f"unknown dtype {text!r}; expected one of {sorted(_DTYPES)}") from None


def parse_shape(text: str) -> tuple[int, ...]:
    text = text.strip().strip("()[]")
    if not text:
        return ()
    return tuple(int(x) for x in text.replace("x", ",").split(",") if x.strip())


def print_plan_report(src, dst, topology: Topology, *, relay: bool, describe: bool, out=sys.stdout,
                      staging_bytes: int | None = None) -> None:
    """Plan `src -> dst` and print its statistics beside gather-and-broadcast's bytes."""
    kwargs = {"staging_bytes": staging_bytes} if staging_bytes else {}
    t0 = time.perf_counter()
    p = plan(src, dst, topology, relay=relay, **kwargs)
    dt = time.perf_counter() - t0
    gb = gather_broadcast_bytes(src, dst)
    moved = p.stats.network_bytes + p.stats.nvlink_bytes
    print(f"source      {src!r}", file=out)
    print(f"destination {dst!r}", file=out)
    print(f"topology    {topology}, relay={relay}; planned in {dt * 1e3:.1f} ms", file=out)
    print("reshard plan:", file=out)
    print(format_stats(p.stats), file=out)
    print("gather-and-broadcast:", file=out)
    print(f"  all-gather on the source ranks {format_bytes(gb['gather']):>12}", file=out)
    print(f"  broadcast to destination ranks {format_bytes(gb['broadcast']):>12}", file=out)
    print(f"  total                          {format_bytes(gb['total']):>12}", file=out)
    if moved:
        print(f"reshard moves {gb['total'] / moved:.1f}x fewer bytes over links "
              f"({format_bytes(moved)} vs {format_bytes(gb['total'])})", file=out)
    if describe:
        print(p.describe(max_transfers=10**9), file=out)


def cmd_plan(args: argparse.Namespace) -> int:
    shape = parse_shape(args.shape)
    dtype = parse_dtype(args.dtype)
    src = parse_layout(args.src, shape, dtype, name=args.name)
    dst = parse_layout(args.dst, shape, dtype, name=args.name)
    topo = Topology(domain_size=args.domain_size) if args.domain_size else Topology()
    print_plan_report(src, dst, topo, relay=not args.no_relay, describe=args.describe)
    return 0


def cmd_simulate(argv: list[str]) -> int:
    from reshard.sim import main as sim_main

    return int(sim_main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if argv and argv[0] == "simulate":
        return cmd_simulate(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m reshard", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="plan one tensor and print its statistics")
    p.add_argument("--src", required=True, help='source layout, e.g. "ranks=0-7 mesh=2x4 R,S(0)"')
    p.add_argument("--dst", required=True, help='destination layout, e.g. "ranks=8-15 mesh=4x2 R,S(0)"')
    p.add_argument("--shape", required=True, help="global shape, e.g. 25600,5120")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--domain-size", type=int, default=None, help="GPUs per NVLink domain (default: one each)")
    p.add_argument("--no-relay", action="store_true", help="every destination receives directly")
    p.add_argument("--describe", action="store_true", help="also list every transfer")
    p.add_argument("--name", default="weight")
    p.set_defaults(func=cmd_plan)
    sub.add_parser("simulate", help="cluster-scale refit simulator (see --help after it)")
    args = ap.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
