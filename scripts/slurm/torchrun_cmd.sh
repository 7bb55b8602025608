#!/usr/bin/env bash
# One node's torchrun for a multi-node SLURM job: train.sbatch starts one copy per node
# (srun --ntasks-per-node=1), and each copy execs torchrun with that node's GPUs.
#
# Usage: scripts/slurm/torchrun_cmd.sh [--dry-run] [train.py overrides...]
#
# Reads SLURM_JOB_NODELIST, SLURM_NNODES, SLURM_JOB_ID and SLURM_NODEID (or SLURM_PROCID: one
# task per node makes them equal), plus optional GPUS_PER_NODE (else SLURM_GPUS_ON_NODE, else 8),
# CONFIG (else the repository's configs/llama_1b.toml), MASTER_ADDR (else the job's first
# node), MASTER_PORT (else derived from the job id) and SHUTDOWN_TIMEOUT (seconds, else 240).
# Outside a job (no SLURM_JOB_ID) it is one node, this machine: the rendezvous on localhost
# (MASTER_PORT, else 29500) and GPUS_PER_NODE, else the visible GPUs, else 1.
# --dry-run prints the command, shell-quoted, instead of running it: tests build it from fake
# SLURM variables on a machine without SLURM.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# shellcheck source=scripts/lib/usage.sh
source "$repo/scripts/lib/usage.sh"
exit_if_help_asked "$0" "$@"
dry_run=0
if [[ ${1:-} == --dry-run ]]; then
  dry_run=1
  shift
fi

# The first host of a SLURM nodelist ("node[01-02]" -> node01, "gpu-a,gpu-b" -> gpu-a).
first_host() {
  local hosts
  # scontrol needs a slurm.conf (a machine with SLURM's client but no cluster has none).
  if command -v scontrol > /dev/null 2>&1 && hosts=$(scontrol show hostnames "$1" 2> /dev/null)
  then
    # sed, not head: head exits early and the writer's SIGPIPE would fail a pipe (pipefail).
    sed -n 1p <<< "$hosts"
  else
    # No SLURM here (tests, a laptop): take the first comma-separated group (commas inside
    # brackets do not split) and, in each [...], the first number of its first range.
    python3 -c 'import re, sys
group = re.split(r",(?![^\[]*\])", sys.argv[1])[0]
print(re.sub(r"\[([^],-]+)[^]]*\]", r"\1", group))' "$1"
  fi
}

if [[ -n ${SLURM_JOB_ID:-} ]]; then
  nodelist=${SLURM_JOB_NODELIST:?not set: is this a SLURM job step (SLURM_JOB_ID is set)?}
  nnodes=${SLURM_NNODES:?not set: is this a SLURM job step (SLURM_JOB_ID is set)?}
  node_id=${SLURM_NODEID:-${SLURM_PROCID:?neither SLURM_NODEID nor SLURM_PROCID is set}}
  job_id=$SLURM_JOB_ID
  gpus=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
  # A port per job, so two jobs sharing a first node do not collide.
  default_port=$((20000 + SLURM_JOB_ID % 20000))
else
  nodelist=localhost nnodes=1 node_id=0 job_id=local default_port=29500
  # shellcheck source=scripts/lib/gpus.sh
  source "$repo/scripts/lib/gpus.sh"
  gpus=${GPUS_PER_NODE:-$(visible_gpus)}
  ((gpus >= 1)) || gpus=1
fi
# A CONFIG given is read from the working directory (the submit dir in a job), as a user typed
# it; the default is the repository's, wherever this runs from.
config=${CONFIG:-$repo/configs/llama_1b.toml}
if [[ ! -f $config ]]; then
  echo "error: CONFIG=$config: no such file (from $PWD)" >&2
  exit 2
fi
master_addr=${MASTER_ADDR:-$(first_host "$nodelist")}
master_port=${MASTER_PORT:-$default_port}
# The c10d rendezvous guesses which node hosts its store by matching hostnames, which fails
# when the nodelist's names are not the machines' own (short vs. FQDN): say it explicitly.
if [[ $node_id == 0 ]]; then is_host=true; else is_host=false; fi
# shellcheck source=scripts/lib/torchrun.sh
source "$repo/scripts/lib/torchrun.sh"
probe_torchrun "${SHUTDOWN_TIMEOUT:-240}"

cmd=(torchrun
  --nnodes "$nnodes" --nproc-per-node "$gpus"
  --rdzv-backend c10d --rdzv-endpoint "$master_addr:$master_port"
  --rdzv-id "$job_id" --rdzv-conf "is_host=$is_host"
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
echo "node $node_id/$nnodes on $(hostname): ${cmd[*]}" >&2
run_torchrun "${cmd[@]}"
