#!/usr/bin/env bash
# Launch training with torchrun.
#   NGPU=8 CONFIG_FILE=train_configs/llama3_8b.toml ./run_train.sh --training.steps 100
# NGPU is the number of processes on this node (GPUs, or CPU processes on the gloo backend when no
# GPU is present). Extra arguments are passed through as config overrides (--section.key value).
set -euo pipefail

NGPU=${NGPU:-1}
CONFIG_FILE=${CONFIG_FILE:-"./train_configs/debug_model.toml"}
LOG_RANK=${LOG_RANK:-0}
MASTER_PORT=${MASTER_PORT:-29500}

# Big allocations come and go every step; expandable segments avoid fragmentation on CUDA.
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-"expandable_segments:True"}

# Check the config (and layout, model, batch, starting checkpoint) before torchrun starts any worker:
# a mistake then prints one message (exit code 2). Costs ~2.5 s (importing torch and the model registry).
WORLD_SIZE="${NGPU}" python3 -m titanium.preflight --job.config_file "${CONFIG_FILE}" "$@"

exec torchrun --nproc_per_node="${NGPU}" --rdzv_backend c10d --rdzv_endpoint="localhost:${MASTER_PORT}" \
    --local-ranks-filter "${LOG_RANK}" \
    -m titanium.train --job.config_file "${CONFIG_FILE}" "$@"
