# shellcheck shell=bash
# Sourced by scripts/run_train.sh, scripts/lib/compare_runs.sh and scripts/slurm/torchrun_cmd.sh.

# visible_gpus: the GPUs this process may use, from CUDA_VISIBLE_DEVICES if set, else
# nvidia-smi; 0 without either.
visible_gpus() {
  if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then
    # Set but empty hides every GPU; otherwise one entry per GPU.
    local ids
    IFS=, read -r -a ids <<< "$CUDA_VISIBLE_DEVICES"
    echo "${#ids[@]}"
  elif command -v nvidia-smi > /dev/null 2>&1; then
    nvidia-smi --list-gpus 2> /dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}

# exit_unless_ngpu_valid: exit 2 with one line unless NGPU is unset or a count of processes.
exit_unless_ngpu_valid() {
  if [[ -n ${NGPU:-} && ! $NGPU =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NGPU=$NGPU: expected the number of processes, 1 or more (1: one process, the" \
      "CPU where there is no GPU)" >&2
    exit 2
  fi
}
