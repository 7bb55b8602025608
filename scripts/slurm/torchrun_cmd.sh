#!/usr/bin/env bash
# One node's torchrun for a multi-node SLURM job: train.sbatch starts one copy per node
# (srun --ntasks-per-node=1), and each copy execs torchrun with that node's GPUs.
#
#   scripts/slurm/torchrun_cmd.sh [--dry-run] [train.py overrides...]
#
# Reads SLURM_JOB_NODELIST, SLURM_NNODES, SLURM_JOB_ID and SLURM_NODEID (or SLURM_PROCID: one
# task per node makes them equal), plus optional GPUS_PER_NODE (else SLURM_GPUS_ON_NODE, else 8),
# CONFIG (else configs/llama_1b.toml), MASTER_ADDR (else the job's first node), MASTER_PORT
# (else derived from the job id) and SHUTDOWN_TIMEOUT (seconds, else 240).
# --dry-run prints the command, shell-quoted, instead of running it: tests build it from fake
# SLURM variables on a machine without SLURM.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dry_run=0
if [[ ${1:-} == --dry-run ]]; then
  dry_run=1
  shift
fi

# The first host of a SLURM nodelist ("node[01-02]" -> node01, "gpu-a,gpu-b" -> gpu-a).
first_host() {
  if command -v scontrol > /dev/null 2>&1; then
    # sed, not head: head exits early and scontrol's SIGPIPE would fail the pipe (pipefail).
    scontrol show hostnames "$1" | sed -n 1p
  else
    # No SLURM here (tests, a laptop): take the first comma-separated group (commas inside
    # brackets do not split) and, in each [...], the first number of its first range.
    python3 -c 'import re, sys
group = re.split(r",(?![^\[]*\])", sys.argv[1])[0]
print(re.sub(r"\[([^],-]+)[^]]*\]", r"\1", group))' "$1"
  fi
}

: "${SLURM_JOB_NODELIST:?not set: run inside a SLURM job (or set it for --dry-run)}"
: "${SLURM_NNODES:?not set: run inside a SLURM job (or set it for --dry-run)}"
: "${SLURM_JOB_ID:?not set: run inside a SLURM job (or set it for --dry-run)}"
node_id=${SLURM_NODEID:-${SLURM_PROCID:?neither SLURM_NODEID nor SLURM_PROCID is set}}
gpus=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
config=${CONFIG:-configs/llama_1b.toml}
master_addr=${MASTER_ADDR:-$(first_host "$SLURM_JOB_NODELIST")}
# A port per job, so two jobs sharing a first node do not collide.
master_port=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
# The c10d rendezvous guesses which node hosts its store by matching hostnames, which fails
# when the nodelist's names are not the machines' own (short vs. FQDN): say it explicitly.
if [[ $node_id == 0 ]]; then is_host=true; else is_host=false; fi
# shellcheck source=scripts/lib/torchrun.sh
source "$repo/scripts/lib/torchrun.sh"
probe_torchrun "${SHUTDOWN_TIMEOUT:-240}"

cmd=(torchrun
  --nnodes "$SLURM_NNODES" --nproc-per-node "$gpus"
  --rdzv-backend c10d --rdzv-endpoint "$master_addr:$master_port"
  --rdzv-id "$SLURM_JOB_ID" --rdzv-conf "is_host=$is_host"
  # No elastic restarts: a failed rank ends the job; a requeue resumes from the checkpoint.
  --max-restarts 0
  # After a signal torchrun relays (scancel's SIGTERM), wait up to SHUTDOWN_TIMEOUT for the
  # trainers to checkpoint before SIGKILL (torchrun's default is 30 s); empty for a torchrun
  # without the option. SIGUSR1 goes to the trainers from run_torchrun, not through torchrun.
  "${torchrun_signal_options[@]}"
  "$repo/train.py" --config "$config" "$@")

if ((dry_run)); then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
echo "node $node_id/$SLURM_NNODES on $(hostname): ${cmd[*]}" >&2
run_torchrun "${cmd[@]}"
