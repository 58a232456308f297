#!/usr/bin/env bash
# Fault tolerance on one machine: a torchft lighthouse on loopback and NUM_GROUPS replica groups, each its own
# torchrun job of NGPU processes (FSDP inside the group), started through run_train.sh.
#   NUM_GROUPS=2 NGPU=1 ./scripts/ft_local.sh --training.steps 200
# Group i logs to $FT_OUT/group_i.log and writes to its own dump folder $FT_OUT/group_i (group 0 checkpoints).
# Kill a group's processes (their PIDs are printed) and run the printed command again: it rejoins and heals.
# With GPUs, group i gets GPUs i*NGPU .. (i+1)*NGPU-1.
set -euo pipefail

NUM_GROUPS=${NUM_GROUPS:-2}
NGPU=${NGPU:-1}
LIGHTHOUSE_PORT=${LIGHTHOUSE_PORT:-29510}
FT_OUT=${FT_OUT:-./outputs/ft_local}
mkdir -p "${FT_OUT}"

torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000 --bind "127.0.0.1:${LIGHTHOUSE_PORT}" \
    > "${FT_OUT}/lighthouse.log" 2>&1 &
LIGHTHOUSE_PID=$!
trap 'kill ${LIGHTHOUSE_PID} 2>/dev/null || true' EXIT

GPUS=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
PIDS=()
for ((i = 0; i < NUM_GROUPS; i++)); do
    GROUP_ENV=(MASTER_PORT=$((29600 + i)) NGPU="${NGPU}")
    if [ "${GPUS}" -gt 0 ]; then
        GROUP_ENV+=(CUDA_VISIBLE_DEVICES="$(seq -s, $((i * NGPU)) $(((i + 1) * NGPU - 1)))")
    fi
    CMD=(env "${GROUP_ENV[@]}" ./run_train.sh --fault_tolerance.enable --fault_tolerance.replica_id "${i}"
        --fault_tolerance.group_size "${NUM_GROUPS}" --fault_tolerance.lighthouse "http://127.0.0.1:${LIGHTHOUSE_PORT}"
        --fault_tolerance.hostname 127.0.0.1 --job.dump_folder "${FT_OUT}/group_${i}" "$@")
    "${CMD[@]}" > "${FT_OUT}/group_${i}.log" 2>&1 &
    PIDS+=($!)
    echo "group ${i}: pid $! (log ${FT_OUT}/group_${i}.log); to restart it: ${CMD[*]}"
done

STATUS=0
for pid in "${PIDS[@]}"; do
    wait "${pid}" || STATUS=$?
done
exit "${STATUS}"
