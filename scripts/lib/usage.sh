# shellcheck shell=bash
# Sourced by the shell scripts first thing: `-h` or `--help` among the arguments prints the
# script's header comment (its usage) and exits 0 before the script does anything else.
# (train.sbatch has its own copy: sbatch runs it from a spool folder without this file.)

# exit_if_help_asked SCRIPT ARGS...
exit_if_help_asked() {
  local script=$1 arg
  shift
  for arg; do
    if [[ $arg == -h || $arg == --help ]]; then
      # The comment block under the shebang, without its leading "# ".
      sed -n '2,/^[^#]/{/^#/{s/^# //;s/^#$//;p;};}' "$script"
      exit 0
    fi
  done
}
