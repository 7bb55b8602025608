# shellcheck shell=bash
# Sourced by scripts/run_train.sh and scripts/slurm/torchrun_cmd.sh: run torchrun so that a stop
# request (SIGUSR1 or SIGTERM: checkpoint, then stop) reaches the trainers and the launch then
# ends with the trainers' status: 0 after a clean stop.
#
# torchrun relays a SIGTERM it receives to the trainers, waits for them and then re-raises it:
# it exits 1 even when every trainer saved its checkpoint and exited 0 (torch's elastic agent,
# any version). So this script, torchrun's parent, delivers SIGUSR1 and SIGTERM to the trainers
# (torchrun's child processes) itself; torchrun, which never sees the signal, exits with their
# status. torchrun runs with SIGUSR1 ignored (the trainers set their own handler), so a SIGUSR1
# sent to every process of the job at once (SLURM signals all of a job step's processes) does
# not end it either. A SIGTERM sent to torchrun itself still stops the trainers cleanly, but
# torchrun then exits 1. SIGINT (Ctrl-C) goes to the trainers the same way (the first saves and
# stops, the second aborts) and torchrun ignores it where it can be told to (--signals-to-handle
# without SIGINT), so a Ctrl-C in the terminal, which reaches torchrun too, does not make it
# exit 1 after a clean stop; a third SIGINT sends torchrun SIGTERM (trainers that hang).

torchrun_signal_options=()
# The launcher: torchrun on PATH, or (run_train.sh) "$PYTHON" -m torch.distributed.run, the same
# program run by the interpreter PYTHON names.
torchrun_launcher=(torchrun)

# probe_torchrun SHUTDOWN_SECONDS: fills torchrun_signal_options for torchrun_launcher.
# Newer torchrun takes --shutdown-timeout: how long the trainers may take to checkpoint after a
# signal torchrun relays (scancel's SIGTERM) before it kills them; torch 2.11's has no such
# option and waits 30 s. --signals-to-handle (2.11 has it) keeps SIGINT out of torchrun's hands.
probe_torchrun() {
  local help
  help=$("${torchrun_launcher[@]}" --help 2> /dev/null || true)
  # shellcheck disable=SC2034  # read by the scripts that source this file
  if grep -q -- --shutdown-timeout <<< "$help"; then
    torchrun_signal_options+=(--shutdown-timeout "$1")
  fi
  if grep -q -- --signals-to-handle <<< "$help"; then
    # torchrun's default less SIGINT: Ctrl-C goes to the trainers from run_torchrun
    torchrun_signal_options+=(--signals-to-handle "SIGTERM,SIGHUP,SIGQUIT")
  fi
}

# The trainers: torchrun's child processes.
torchrun_workers() {
  pgrep -P "$1" 2> /dev/null || cat /proc/"$1"/task/*/children 2> /dev/null || true
}

# stop_trainers PID SIGNAL: send SIGNAL to the trainers of torchrun PID; before they exist
# (rendezvous) there is nothing to save, and torchrun itself gets SIGTERM.
stop_trainers() {
  local workers
  workers=$(torchrun_workers "$1")
  if [[ -n ${workers//[[:space:]]/} ]]; then
    # shellcheck disable=SC2086  # one pid per word
    kill -"$2" $workers 2> /dev/null || true
  else
    kill -TERM "$1" 2> /dev/null || true
  fi
}

# run_torchrun CMD...: run CMD (torchrun ...) as a child, pass stop requests on as described
# above and exit with its status.
run_torchrun() {
  (trap '' USR1 INT && exec "$@") &
  # shellcheck disable=SC2034  # ctrl_c: counted by the INT trap
  local pid=$! status=0 interrupted ctrl_c=0
  trap 'interrupted=1; stop_trainers "$pid" USR1' USR1
  trap 'interrupted=1; stop_trainers "$pid" TERM' TERM
  # The first two go to the trainers (save and stop; abort), a third stops torchrun.
  trap 'interrupted=1; if ((++ctrl_c < 3)); then stop_trainers "$pid" INT;
        else kill -TERM "$pid" 2> /dev/null || true; fi' INT
  # A trapped signal cuts wait short (status > 128) without consuming the child's status:
  # wait again until a wait was not interrupted, which returns torchrun's own status.
  while true; do
    interrupted=0
    wait "$pid" && status=0 || status=$?
    ((interrupted)) || break
  done
  exit "$status"
}
