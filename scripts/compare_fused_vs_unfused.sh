#!/usr/bin/env bash
# Train one config twice, with the fused loss (flce) and the unfused baseline, and compare the
# loss curves step by step. Exits with compare_losses.py's status: 0 when they agree within
# TOLERANCE (default 0.02), 1 when not, 2 on bad input; or, when a training run fails, with
# that run's status.
#
#   scripts/compare_fused_vs_unfused.sh configs/debug.toml --training.steps 100
#   NGPU=8 TOLERANCE=0.01 OUT_DIR=outputs/cmp_1b scripts/compare_fused_vs_unfused.sh configs/llama_1b.toml
#
# Both runs go through run_train.sh (NGPU, PYTHON and the environment apply) with the same seed
# and data; only --loss.impl differs. Every step is logged (--metrics.log_freq 1). Results:
# ${OUT_DIR:-outputs/compare}/{flce,unfused}/metrics.jsonl and fused_vs_unfused.png there.
set -euo pipefail

if (($# < 1)); then
  echo "usage: $0 CONFIG [--section.key value ...]" >&2
  exit 2
fi
config=$1
shift
scripts=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${OUT_DIR:-outputs/compare}

for impl in flce unfused; do
  # metrics.jsonl is appended to and a checkpoint would be resumed: start from an empty folder.
  rm -rf -- "${out:?}/$impl"
  echo "=== --loss.impl $impl -> $out/$impl"
  # Ours come last: the trainer applies overrides in order, so they win over the caller's.
  rc=0
  CONFIG=$config "$scripts/run_train.sh" "$@" \
    --loss.impl "$impl" --metrics.log_freq 1 --job.dump_folder "$out/$impl" || rc=$?
  if ((rc != 0)); then
    echo "error: the --loss.impl $impl run failed (exit $rc); nothing compared" >&2
    exit "$rc"
  fi
done

exec "${PYTHON:-python3}" "$scripts/compare_losses.py" "$out/flce" "$out/unfused" \
  --tolerance "${TOLERANCE:-0.02}" --out "$out/fused_vs_unfused.png"
