#!/usr/bin/env bash
# Single-node training.
#
# Usage: [NGPU=N] [CONFIG=FILE] scripts/run_train.sh [--section.key value ...]
#
#   NGPU=8 CONFIG=configs/llama_1b.toml scripts/run_train.sh --training.steps 300
#   scripts/run_train.sh                    # configs/debug.toml on every visible GPU, or the CPU
#
# NGPU defaults to the visible GPUs (CUDA_VISIBLE_DEVICES if set, else nvidia-smi), or 1.
# NGPU=1 runs plain `python3 train.py`: no launcher in between, so tracebacks, Ctrl-C and the
# trainer's SIGUSR1/SIGTERM checkpoint-and-exit reach the trainer directly. NGPU>1 runs
# torchrun (`python3 -m torch.distributed.run --standalone`: rendezvous on this machine, no port
# to choose).
# Arguments are train.py overrides (--section.key value), passed through unchanged. So is the
# environment: set NCCL_*, TORCH_*, OMP_NUM_THREADS, CUDA_VISIBLE_DEVICES in the caller.
# PYTHON picks the interpreter; DRY_RUN=1 prints the command instead of running it.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/lib/usage.sh
source "$repo/scripts/lib/usage.sh"
exit_if_help_asked "$0" "$@"
# shellcheck source=scripts/lib/gpus.sh
source "$repo/scripts/lib/gpus.sh"

exit_unless_ngpu_valid
if [[ -z ${NGPU:-} ]]; then
  NGPU=$(visible_gpus)
  ((NGPU >= 1)) || NGPU=1
fi
CONFIG=${CONFIG:-$repo/configs/debug.toml}
PYTHON=${PYTHON:-python3}

if ((NGPU == 1)); then
  cmd=("$PYTHON" "$repo/train.py" --config "$CONFIG" "$@")
else
  # `kill -USR1 <this script's pid>` (or -TERM) reaches the trainers, which checkpoint and stop;
  # the script then exits 0 (scripts/lib/torchrun.sh).
  # shellcheck source=scripts/lib/torchrun.sh
  source "$repo/scripts/lib/torchrun.sh"
  # torchrun under PYTHON: the one on PATH may be another environment's, or missing
  torchrun_launcher=("$PYTHON" -m torch.distributed.run)
  probe_torchrun "${SHUTDOWN_TIMEOUT:-240}"
  cmd=("${torchrun_launcher[@]}" --standalone --nproc-per-node "$NGPU"
       "${torchrun_signal_options[@]}" "$repo/train.py" --config "$CONFIG" "$@")
fi

if [[ ${DRY_RUN:-0} == 1 ]]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
if ((NGPU == 1)); then
  exec "${cmd[@]}"
fi
run_torchrun "${cmd[@]}"
