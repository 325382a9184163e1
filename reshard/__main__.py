"""Command line: `python -m reshard {plan,simulate}`.

- `plan`: plan one tensor between two layouts written in DTensor notation and print the statistics next to
  gather-and-broadcast's bytes (`--describe` lists the transfers).
- `simulate`: the cluster-scale refit simulator (see `reshard.sim`).
"""

from __future__ import annotations

import argparse
import logging
import sys

from reshard._progress import Progress
from reshard.cost import print_plan_report
from reshard.planner import Topology, dtype_from_name, parse_layout
from reshard.sim import main as sim_main


LAYOUT_NOTATION = """layout notation (--src, --dst): "ranks=<ranges> [mesh=<AxB...>] [names=<a,b>] <placements>"
  ranks=0-7, ranks=0-3,8-11   the layout's ranks: a comma list of ranks and inclusive ranges
  mesh=2x4                    those ranks reshaped row-major into a mesh (default: 1-D, all of them)
  names=dp,tp                 mesh axis names (optional)
  placements                  one per mesh axis, comma separated: S(d) shards tensor dim d over the axis,
                              R replicates it, _S(d,k) is DTensor's _StridedShard of dim d, split factor k
example: --src "ranks=0-7 mesh=2x4 R,S(0)" --dst "ranks=8-11 S(1)" --shape 4096,4096
  (TP4 x DP2 on ranks 0-7, rows over TP, into 4 ranks holding column blocks)"""


def parse_shape(text: str) -> tuple[int, ...]:
    """`"25600,5120"`, `"25600x5120"` or `"(25600, 5120)"` -> `(25600, 5120)`; `ValueError` otherwise."""
    body = text.strip().strip("()[]")
    if not body:
        return ()
    parts = [x.strip() for x in body.replace("x", ",").split(",") if x.strip()]
    if not all(x.isdigit() for x in parts):
        raise ValueError(f"shape: cannot read {text!r} (expected e.g. 25600,5120)")
    return tuple(int(x) for x in parts)


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        shape = parse_shape(args.shape)
        dtype = dtype_from_name(args.dtype, what="--dtype")
        src = parse_layout(args.src, shape, dtype, name=args.name)
        dst = parse_layout(args.dst, shape, dtype, name=args.name)
        topo = Topology(domain_size=args.domain_size) if args.domain_size else Topology()
    except ValueError as e:  # bad input from the command line: one line, not a traceback
        print(f"python -m reshard plan: error: {e}", file=sys.stderr)
        return 2
    with Progress("python -m reshard plan: planning"):  # a big cluster's plan takes seconds
        print_plan_report(src, dst, topo, relay=not args.no_relay, describe=args.describe)
    return 0


def cmd_simulate(argv: list[str]) -> int:
    with Progress("python -m reshard simulate: planning and modelling"):  # 26-35 s for Kimi-K2 on 512 GPUs
        return int(sim_main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if argv and argv[0] == "simulate":
        return cmd_simulate(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m reshard", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="plan one tensor and print its statistics", epilog=LAYOUT_NOTATION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", required=True, help='source layout, e.g. "ranks=0-7 mesh=2x4 R,S(0)"')
    p.add_argument("--dst", required=True, help='destination layout, e.g. "ranks=8-15 mesh=4x2 R,S(0)"')
    p.add_argument("--shape", required=True, help="global shape, e.g. 25600,5120")
    p.add_argument("--dtype", default="bfloat16", help="torch dtype name, e.g. bfloat16, float32, float8_e4m3fn")
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
