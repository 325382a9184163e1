"""Model refit times of whole-model plans on H100 / GB200 / GB300 clusters; a thin wrapper over `reshard.sim`.

Usage:
    python perf/simulate.py --model deepseek-v3 --system dsv3-128gpus-gb200 --hardware gb200
    python perf/simulate.py --model qwen3-235b-a22b --system "train=tp2,cp2,pp4,ep16 gen=tp8,dp8" -H gb200

Prints a table per (model, system) and writes `perf/out/simulate/simulate.csv` and one PNG per pair.
"""

import sys
from pathlib import Path

from reshard.sim import main

if __name__ == "__main__":
    sys.exit(main(default_out=Path(__file__).resolve().parent / "out" / "simulate"))
