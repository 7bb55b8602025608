# shellcheck shell=bash
# Sourced by the scripts that train one config two ways and compare the loss curves
# (compare_fused_vs_unfused.sh, compare_float8_vs_bf16.sh). The sourcing script sets, then calls
# `compare_runs CONFIG [--section.key value ...]` (-h/--help prints the script's header):
#   REF=(NAME OVERRIDES...)   the reference run (curve A), e.g. (flce --loss.impl flce)
#   RUN=(NAME OVERRIDES...)   the run judged against it
#   PNG                       the plot's file name under OUT_DIR
#   DEFAULT_VERDICT           auto, band or absolute, where VERDICT is unset
#   DEFAULT_BAND_RATIO        where BAND_RATIO is unset
#   CPU_RUN_ARGS=(...)        overrides the judged run also gets when it trains on the CPU
# The band verdict trains a third run, REF at the config's seed + 1 (REF_seed<N>).

scripts=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
repo=$(dirname "$scripts")
# shellcheck source=scripts/lib/usage.sh
source "$scripts/lib/usage.sh"
# shellcheck source=scripts/lib/gpus.sh
source "$scripts/lib/gpus.sh"

run_folders() {
  PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$python" -m scripts.lib.run_folders "$@"
}

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

compare_runs() {
  exit_if_help_asked "$0" "$@"  # before anything is resolved, deleted or run
  if (($# < 1)) || [[ $1 == -* ]]; then
    echo "usage: $0 CONFIG [--section.key value ...]  (--help for more)" >&2
    exit 2
  fi
  config=$1
  shift
  args=("$@")
  out=${OUT_DIR:-outputs/compare}
  python=${PYTHON:-python3}
  dry_run=${DRY_RUN:-0}
  local verdict=${VERDICT:-$DEFAULT_VERDICT} device seed
  case $verdict in
    auto | band | absolute) ;;
    *) echo "error: VERDICT=$verdict: expected auto, band or absolute" >&2; exit 2 ;;
  esac
  exit_unless_ngpu_valid  # run_train.sh would refuse it only after the first folder was cleared
  # compare_losses.py reads these after every run trained: a typo must stop the script now
  local number='^([0-9]+[.]?[0-9]*|[.][0-9]+)([eE][-+]?[0-9]+)?$'
  if [[ -n ${TOLERANCE:-} && ! $TOLERANCE =~ $number ]]; then
    echo "error: TOLERANCE=$TOLERANCE: expected a number >= 0" >&2; exit 2
  fi
  if [[ -n ${BAND_RATIO:-} ]] && { [[ ! $BAND_RATIO =~ $number ]] ||
                                   ! awk -v r="$BAND_RATIO" 'BEGIN { exit !(r > 0) }'; }; then
    echo "error: BAND_RATIO=$BAND_RATIO: expected a number > 0" >&2; exit 2
  fi

  # Resolve the config before anything is deleted or run: a bad file or override fails here.
  # Prints the device the runs will use and the seed.
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
  local ref_name=${REF[0]} run_name=${RUN[0]}
  local noise=${ref_name}_seed$((seed + 1))  # the band verdict's run at the next seed
  local names=("$ref_name" "$run_name")
  if [[ $verdict == band ]]; then names+=("$noise"); fi
  # Every run's folder must be clearable before the first run starts (the reason is printed).
  # (paths built in a loop: in a ${x/#/...} replacement bash 5.2 reads an & in $out as the match)
  local folders=() name
  for name in "${names[@]}"; do folders+=("$out/$name"); done
  run_folders check "${folders[@]}" || exit 2

  local run_args=("${RUN[@]:1}")
  if [[ $device == cpu ]]; then run_args+=("${CPU_RUN_ARGS[@]}"); fi
  train "$ref_name" "${REF[@]:1}"
  train "$run_name" "${run_args[@]}"
  local compare=("$out/$ref_name" "$out/$run_name" --verdict "$verdict" --out "$out/$PNG"
                 --tolerance "${TOLERANCE:-0.02}" --band-ratio "${BAND_RATIO:-$DEFAULT_BAND_RATIO}")
  if [[ $verdict == band ]]; then
    train "$noise" "${REF[@]:1}" --training.seed $((seed + 1))
    compare+=(--seed-run "$out/$noise")
  fi
  if [[ $dry_run == 1 ]]; then
    printf '%q ' "$python" "$scripts/compare_losses.py" "${compare[@]}"
    echo
    exit 0
  fi
  exec "$python" "$scripts/compare_losses.py" "${compare[@]}"
}
