#!/usr/bin/env bash
# Train one config with the fused loss (flce) and the unfused baseline and compare the loss
# curves. Exits with compare_losses.py's status: 0 when they agree, 1 when not, 2 on bad input;
# or, when a training run fails, with that run's status.
#
# Usage: [VERDICT=auto|band|absolute] [OUT_DIR=DIR] scripts/compare_fused_vs_unfused.sh CONFIG
#            [--section.key value ...]
#
#   scripts/compare_fused_vs_unfused.sh configs/debug.toml --training.steps 100
#   NGPU=8 OUT_DIR=outputs/cmp_1b scripts/compare_fused_vs_unfused.sh configs/llama_1b.toml
#
# Both runs go through run_train.sh (NGPU, PYTHON and the environment apply) with the same seed
# and data; only --loss.impl differs. Every step is logged (--metrics.log_freq 1).
# The verdict (compare_losses.py --verdict), VERDICT=auto by default:
#   band      on a GPU: bf16 curves separate chaotically, so one step's difference says little.
#             A third run, flce at the config's seed + 1, measures the noise band; the smoothed
#             fused-unfused difference must stay within BAND_RATIO (0.5) of the smoothed
#             seed-to-seed difference.
#   absolute  on the CPU, which trains in fp32 and deterministically (debug config: 1.6e-4 at most):
#             every step's |flce - unfused| within TOLERANCE (0.02).
# Results: ${OUT_DIR:-outputs/compare}/{flce,unfused,flce_seed<N>}/metrics.jsonl and
# fused_vs_unfused.png there; each folder is emptied before its run, but only one that a script
# run made (it holds .scratch-run): a folder holding anything else (another run of yours) stops
# the script before any run starts. DRY_RUN=1 prints the commands instead (and deletes nothing).
set -euo pipefail

scripts=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$scripts")
# shellcheck source=scripts/lib/usage.sh
source "$scripts/lib/usage.sh"
exit_if_help_asked "$0" "$@"

if (($# < 1)) || [[ $1 == -* ]]; then
  echo "usage: $0 CONFIG [--section.key value ...]  (--help for more)" >&2
  exit 2
fi
config=$1
shift
out=${OUT_DIR:-outputs/compare}
verdict=${VERDICT:-auto}
python=${PYTHON:-python3}
dry_run=${DRY_RUN:-0}
case $verdict in
  auto | band | absolute) ;;
  *) echo "error: VERDICT=$verdict: expected auto, band or absolute" >&2; exit 2 ;;
esac

# Resolve the config before anything is deleted or run: a bad file or override fails here. Prints
# the device the runs will use and the seed.
read -r device seed < <(PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$python" -c '
import sys
from components.config.parse import load_config
from components.config.schema import ConfigError
try:
    cfg = load_config(sys.argv[1:])
except ConfigError as e:
    sys.exit(f"error: {e}")
device = cfg.training.device
if device == "auto":
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
print(device, cfg.training.seed)' --config "$config" "$@" || echo "error")
if [[ $device == error ]]; then
  exit 2  # the reason is printed above
fi
if [[ $verdict == auto ]]; then
  if [[ $device == cpu ]]; then verdict=absolute; else verdict=band; fi
fi
echo "=== device $device: verdict $verdict"
noise=flce_seed$((seed + 1))  # the band verdict's run at the next seed
names=(flce unfused)
if [[ $verdict == band ]]; then names+=("$noise"); fi
run_folders() {
  PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$python" -m scripts.lib.run_folders "$@"
}
# Every run's folder must be clearable before the first run starts (the reason is printed).
run_folders check "${names[@]/#/$out/}" || exit 2

# train NAME OVERRIDES...: one run into $out/NAME.
train() {
  local name=$1 rc=0
  shift
  echo "=== $* -> $out/$name"
  # metrics.jsonl is appended to and a checkpoint would be resumed: start from an empty folder.
  # (With DRY_RUN=1, run_train.sh prints its command instead of running it.)
  if [[ $dry_run != 1 ]]; then run_folders fresh "$out/$name"; fi
  # Ours come last: the trainer applies overrides in order, so they win over the caller's.
  CONFIG=$config "$scripts/run_train.sh" "${args[@]}" "$@" \
    --metrics.log_freq 1 --job.dump_folder "$out/$name" || rc=$?
  if ((rc != 0)); then
    echo "error: the run $* failed (exit $rc); nothing compared" >&2
    exit "$rc"
  fi
}

args=("$@")
train flce --loss.impl flce
train unfused --loss.impl unfused
compare=("$out/flce" "$out/unfused" --verdict "$verdict" --out "$out/fused_vs_unfused.png"
         --tolerance "${TOLERANCE:-0.02}" --band-ratio "${BAND_RATIO:-0.5}")
if [[ $verdict == band ]]; then
  train "$noise" --loss.impl flce --training.seed $((seed + 1))
  compare+=(--seed-run "$out/$noise")
fi
if [[ $dry_run == 1 ]]; then
  printf '%q ' "$python" "$scripts/compare_losses.py" "${compare[@]}"
  echo
  exit 0
fi
exec "$python" "$scripts/compare_losses.py" "${compare[@]}"
