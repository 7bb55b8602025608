# shellcheck shell=bash
# Sourced by scripts/run_train.sh and scripts/slurm/torchrun_cmd.sh: run torchrun so that
# SIGUSR1 (checkpoint, then stop) reaches the trainers whatever the installed torchrun.
#
# Newer torchrun takes --signals-to-handle (forward SIGUSR1 too) and --shutdown-timeout (how
# long to wait for the workers before SIGKILL). torch 2.11's torchrun has neither and forwards
# only SIGTERM/SIGINT/SIGHUP/SIGQUIT, then kills the workers after 30 s. There the script stays
# torchrun's parent and turns a SIGUSR1 into a SIGTERM, which the trainer handles the same way
# (checkpoint after the current step, exit); a checkpoint must then be written within 30 s.

torchrun_signal_options=()
torchrun_forwards_usr1=false

# probe_torchrun SHUTDOWN_SECONDS: fills torchrun_signal_options for the installed torchrun.
probe_torchrun() {
  local help
  help=$(torchrun --help 2> /dev/null || true)
  if grep -q -- --signals-to-handle <<< "$help"; then
    torchrun_forwards_usr1=true
    torchrun_signal_options=(--signals-to-handle "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    if grep -q -- --shutdown-timeout <<< "$help"; then
      torchrun_signal_options+=(--shutdown-timeout "$1")
    fi
  fi
}

# run_torchrun CMD...: exec CMD when torchrun forwards SIGUSR1 itself; otherwise run it as a
# child, pass SIGUSR1 on as SIGTERM (SIGTERM and SIGINT as they are) and exit with its status.
run_torchrun() {
  if [[ $torchrun_forwards_usr1 == true ]]; then
    exec "$@"
  fi
  echo "torchrun without --signals-to-handle: SIGUSR1 is passed on as SIGTERM" >&2
  "$@" &
  local pid=$! status=0 interrupted
  trap 'interrupted=1; kill -TERM "$pid" 2> /dev/null || true' USR1 TERM
  trap 'interrupted=1; kill -INT "$pid" 2> /dev/null || true' INT
  # A trapped signal cuts wait short (status > 128) without consuming the child's status:
  # wait again until a wait was not interrupted, which returns torchrun's own status.
  while true; do
    interrupted=0
    wait "$pid" && status=0 || status=$?
    ((interrupted)) || break
  done
  exit "$status"
}
