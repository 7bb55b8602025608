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

# shellcheck source=scripts/lib/compare_runs.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/compare_runs.sh"
REF=(flce --loss.impl flce)
RUN=(unfused --loss.impl unfused)
PNG=fused_vs_unfused.png
DEFAULT_VERDICT=auto
DEFAULT_BAND_RATIO=0.5
CPU_RUN_ARGS=()
compare_runs "$@"
