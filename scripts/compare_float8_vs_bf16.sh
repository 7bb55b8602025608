#!/usr/bin/env bash
# Train one config in bf16 and with float8 (torchao's float8 linear layers and the float8 loss)
# and compare the loss curves: does float8 train this model as bf16 does? Exits with
# compare_losses.py's status: 0 when they agree, 1 when not, 2 on bad input; or, when a training
# run fails, with that run's status.
#
# Usage: [VERDICT=band|absolute] [OUT_DIR=DIR] scripts/compare_float8_vs_bf16.sh CONFIG
#            [--section.key value ...]
#
#   NGPU=2 OUT_DIR=outputs/fidelity_8b scripts/compare_float8_vs_bf16.sh configs/llama_8b.toml \
#       --training.steps 200 --lr_scheduler.warmup_steps 20 --activation_checkpoint.mode none
#   FLOAT8="--model.converters quantize.linear.float8" scripts/compare_float8_vs_bf16.sh ...
#
# Three runs through run_train.sh (NGPU, PYTHON and the environment apply), each logging every
# step (--metrics.log_freq 1): bf16 at the config's seed, float8 at the same seed and data
# (FLOAT8's overrides, by default "--model.converters quantize.linear.float8 --loss.float8
# logits+dx"), and bf16 at the seed + 1, which measures the noise band. The verdict
# (compare_losses.py --verdict band, the default): the smoothed float8-bf16 difference within
# BAND_RATIO (1.0) of the smoothed seed-to-seed difference, i.e. float8 moves the curve no more
# than another seed does. On the CPU the float8 layers are emulated
# ([quantize.linear.float8] emulate = true; slow, for testing the numerics).
# Results: ${OUT_DIR:-outputs/compare}/{bf16,float8,bf16_seed<N>}/metrics.jsonl and
# float8_vs_bf16.png there; each folder is emptied before its run, but only one that a script
# run made (it holds .scratch-run): a folder holding anything else (another run of yours) stops
# the script before any run starts. DRY_RUN=1 prints the commands instead (and deletes nothing).
set -euo pipefail

# shellcheck source=scripts/lib/compare_runs.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/compare_runs.sh"
read -r -a float8 <<< "${FLOAT8:---model.converters quantize.linear.float8 --loss.float8 logits+dx}"
REF=(bf16)
RUN=(float8 "${float8[@]}")
PNG=float8_vs_bf16.png
DEFAULT_VERDICT=band
DEFAULT_BAND_RATIO=1.0
CPU_RUN_ARGS=(--quantize.linear.float8.emulate true)
compare_runs "$@"
