#!/usr/bin/env bash
# The whole test suite on a machine with CUDA GPUs, in parallel (pytest-xdist).
#
# Usage: [JOBS=N] scripts/test_gpu.sh [pytest arguments ...]
#
#   scripts/test_gpu.sh                          # every test; the CUDA ones run, none skips for want of a GPU
#   scripts/test_gpu.sh tests/test_flce_*.py     # the loss's kernels, float8 GEMMs and compile on CUDA
#
# On a GPU machine the suite is not the one CI runs: the loss's tests gain CUDA cases (Triton
# kernels compiled for the GPU, float8 GEMMs, no host sync), the trainer runs on CUDA where a
# test leaves the device to "auto", and tests that need two GPUs (NCCL, FSDP/TP/CP across them)
# run when two are visible. Run it on one GPU and on two whenever a change touches a kernel,
# float8, a parallelism or the training step, before benchmarking.
# JOBS defaults to the CPU cores, at most 16. Each worker's torch gets OMP_NUM_THREADS=2 (unless
# set): workers x all cores threads, plus the multi-process tests' own processes, thrash.
# Needs pytest-xdist (in the [test] extra). Exits 2 without a CUDA device.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/lib/usage.sh
source "$repo/scripts/lib/usage.sh"
exit_if_help_asked "$0" "$@"
cd "$repo"

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "error: torch sees no CUDA device; on a CPU machine run: $PYTHON -m pytest -q" >&2
  exit 2
fi
cores=$(nproc)
JOBS=${JOBS:-$((cores < 16 ? cores : 16))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
echo "scripts/test_gpu.sh: $gpus GPU(s), $JOBS workers"
# pytest's own count line goes with a second -q (this passes one): say the outcome regardless.
# -rfEs: failures, errors and why each skipped test skipped (on one GPU: the two-GPU ones);
# --durations: the slowest tests, which set the suite's time on a GPU machine (5-6 min on 16 cores)
status=0
"$PYTHON" -m pytest -n "$JOBS" -p no:cacheprovider -q -rfEs --durations=15 "$@" || status=$?
echo "scripts/test_gpu.sh: pytest exit status $status on $gpus GPU(s) (0: no test failed)"
exit "$status"
