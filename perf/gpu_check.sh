#!/usr/bin/env bash
# GPU check: one command for a machine with a CUDA GPU. Runs each section below with its own time limit, logs it to
# DIR/<section>.log and writes one line per section to DIR/summary.txt. Exits non-zero if any section failed.
#
# Usage: perf/gpu_check.sh DIR
#
# Uses the system `python3` (else `python`; override with PYTHON=...), with torch, triton and pytest installed, and
# the repository root on PYTHONPATH. TRITON_INTERPRET is unset: the kernels run compiled. Whole run: under 6 minutes.
# A 30-second preflight runs first (versions, the torch NCCL APIs reshard uses, a one-rank NCCL group connected
# eagerly running a coalesced batch); if it fails, no other section runs.
# GPU_CHECK_SECTIONS="preflight refit_e2e" runs only the sections named (default: all).
#
# To add a check, append a section at the end: `section NAME LIMIT_SECONDS command args...`. Files it writes into
# "$DIR" come back with the others: the device tool returns at most 8 files, so the section logs are merged into
# DIR/logs.txt at the end (files now: summary.txt, logs.txt, bench_kernels.{csv,png,_summary.txt}, and the comm
# check's CSV and PNG, gpu_refit_check.csv). The section limits add up to 360 s (preflight 30, kernels_tests 110,
# kernels_bench 50, quant_tests 45, delta_tests 45, comm_streams 45, refit_e2e 35; tests/test_gpu_check.py checks the
# sum), so the whole run stays under 6 minutes.
#
# For a plumbing check on a machine without a GPU: GPU_CHECK_DEVICE=cpu GPU_CHECK_BACKEND=torch perf/gpu_check.sh DIR
# (the kernel tests then run Triton under its interpreter, and the bench times the torch path).
set -u -o pipefail

DIR=${1:?usage: perf/gpu_check.sh DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
PY=${PYTHON:-$(command -v python3 || command -v python)}
SECTIONS=${GPU_CHECK_SECTIONS:-all}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
BACKEND=${GPU_CHECK_BACKEND:-triton}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
SUMMARY="$DIR/summary.txt"
FAILED=0
START=$(date +%s)

# section NAME LIMIT_SECONDS CMD...: run CMD from the repository root, output to DIR/NAME.log, one summary line.
section() {
    local name=$1 limit=$2
    shift 2
    local t0 rc status
    if [ "$SECTIONS" != all ] && [[ " $SECTIONS " != *" $name "* ]]; then
        echo "$name: skipped (GPU_CHECK_SECTIONS)" >>"$SUMMARY"
        return 0
    fi
    t0=$(date +%s)
    echo "== $name (limit ${limit}s)"
    (cd "$ROOT" && timeout --kill-after=10 "$limit" "$@") >"$DIR/$name.log" 2>&1
    rc=$?
    if [ "$rc" -eq 0 ]; then
        status="ok"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        status="TIMED OUT after ${limit}s"
        FAILED=1
    else
        status="FAILED (exit $rc)"
        FAILED=1
    fi
    echo "$name: $status in $(($(date +%s) - t0))s (log: $name.log in logs.txt)" | tee -a "$SUMMARY"
    tail -n 8 "$DIR/$name.log"
}

{
    echo "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) device=$DEVICE backend=$BACKEND commit=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    if [ "$DEVICE" = cuda ]; then nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; fi
    "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
} >"$SUMMARY" 2>&1
cat "$SUMMARY"
if [ "$DEVICE" = cuda ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA GPU visible to torch: nothing to check (GPU_CHECK_DEVICE=cpu runs the plumbing on CPU)" | tee -a "$SUMMARY"
    exit 2
fi

# --- preflight: versions, NCCL APIs, a one-rank eager NCCL group and a coalesced batch; nothing else runs blind ----
section preflight 30 "$PY" perf/gpu_preflight.py --device "$DEVICE"
if [ "$FAILED" -ne 0 ]; then
    cat "$DIR/preflight.log" >>"$DIR/logs.txt"
    echo "preflight failed: no other section runs" | tee -a "$SUMMARY"
    exit 1
fi

# --- kernels (issue 3): tests on the device, then the pack/unpack bandwidth sweep with the Triton backend ---------
section kernels_tests 110 env RESHARD_TEST_DEVICE="$DEVICE" "$PY" -m pytest -q -p no:cacheprovider --durations=10 \
    tests/kernels/test_kernels.py tests/kernels/test_kernels_cast.py tests/kernels/test_kernels_large.py
section kernels_bench 50 "$PY" perf/bench_kernels.py --device "$DEVICE" --backend "$BACKEND" --out "$DIR" --repeat 3
if [ -f "$DIR/bench_kernels_summary.txt" ]; then grep -E "target" "$DIR/bench_kernels_summary.txt" | tee -a "$SUMMARY"; fi

# --- append further sections here (comm streams check, fp8 quant check), each with its own limit ----------------

# --- fp8 block quantization (issue 7): tests/kernels/test_kernels_quant.py on the device, compiled: kernel vs reference vs --
# numpy oracle, bit for bit, incl. offsets past 2**31 (6 GiB). About 25 kernel variants to compile. Writes only its log.
section quant_tests 45 env RESHARD_TEST_DEVICE="$DEVICE" "$PY" -m pytest -q -p no:cacheprovider --durations=10 \
    tests/kernels/test_kernels_quant.py
# --- end fp8 block quantization ----------------------------------------------------------------------------------

# --- delta encoding (issue 16): tests/kernels/test_kernels_delta.py on the device: the compiled Triton count / encode kernels
# bit-exact against the torch reference (which also runs on CUDA), round trips, versions. Writes only its log.
section delta_tests 45 env RESHARD_TEST_DEVICE="$DEVICE" "$PY" -m pytest -q -p no:cacheprovider --durations=10 \
    tests/kernels/test_kernels_delta.py
# --- end delta encoding ------------------------------------------------------------------------------------------

# --- comm (issue 4) begin: the executor's CUDA streams pipeline on one GPU ---------------------------------------
# Two ranks as threads over a loopback link on one device; the real executor with its pack/comm/unpack streams.
# Passes when results are bit-exact and two chunks in flight beat one slot by >= 1.25x (see the script's docstring).
section comm_streams 45 "$PY" perf/gpu_streams_check.py --device "$DEVICE" --out "$DIR" --mib 256 --chunks 8 --repeat 3
grep -E "^pipelined is" "$DIR/comm_streams.log" | tee -a "$SUMMARY"
# --- comm (issue 4) end ------------------------------------------------------------------------------------------

# --- one-GPU end-to-end refit: trainer ranks 0-1 as CPU gloo processes, an engine process on the GPU holding a Qwen3
# model's tensors laid out by reshard.integrations.hf (fused, vocabulary padded), received into pinned host staging and
# copied to the device; verified element for element and by logits against the trainer's model. Writes its CSV.
section refit_e2e 35 "$PY" perf/gpu_refit_check.py --device "$DEVICE" --out "$DIR"
grep -E "^engine on|^end-to-end refit is" "$DIR/refit_e2e.log" | tee -a "$SUMMARY"

for log in "$DIR"/*.log; do
    [ -e "$log" ] || continue
    { echo "===== $(basename "$log")"; cat "$log"; } >>"$DIR/logs.txt" && rm -f "$log"
done
echo "total $(($(date +%s) - START))s, $([ "$FAILED" -eq 0 ] && echo 'all sections ok' || echo 'SOME SECTIONS FAILED')" | tee -a "$SUMMARY"
exit "$FAILED"
