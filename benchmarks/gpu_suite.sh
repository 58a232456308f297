#!/usr/bin/env bash
# The GPU proof in one command: every CUDA test (pytest -m cuda), then every GPU benchmark, on one GPU, in under
# 25 minutes on an H100. Results go to benchmarks/results/<benchmark>_<device>.md (e.g. pretrain_speed_h100.md),
# each with the device, the torch / torchao / CUDA versions, its configuration and the command that made it; the
# summary (every part's command, exit status and minutes) to benchmarks/results/gpu_suite_<device>.md.
#
#   bash benchmarks/gpu_suite.sh             # on the GPU machine, from any folder
#   bash benchmarks/gpu_suite.sh --dry-run   # print each part's budget and command; run nothing
#
# Budget, seconds on one H100 (each part runs under `timeout` of its budget, so the whole stays under 25 minutes;
# a part stopped by its budget is marked so in the summary, and the benchmarks that train several models write
# their results file after each model, so what finished is kept):
#   CUDA tests 200 | float8_linear 120 | pretrain_speed 360 | sft_ladder 410 | generation 150 | chunked_ce 45
#   | optimizer_memory 60 | dpo_memory 90 | checkpoint_async 45  = 1480 s (24 min 40 s)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
DRY_RUN=0
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1

if (( DRY_RUN )); then
    TAG=h100
else
    # "NVIDIA H100 80GB HBM3" -> h100: the results files are named by the device they ran on.
    TAG=$($PY -c 'import re, sys, torch
if not torch.cuda.is_available():
    sys.exit("no CUDA GPU here: benchmarks/gpu_suite.sh is for a GPU machine (--dry-run prints its commands)")
name = torch.cuda.get_device_name().replace("NVIDIA", "")
print(re.search(r"[A-Za-z]+[0-9]+", name).group(0).lower())') || exit 1
fi
R=benchmarks/results

# name | budget (s) | command
PARTS=(
    "cuda_tests|200|$PY -m pytest -m cuda -q -p no:cacheprovider tests"
    "float8_linear|120|$PY benchmarks/float8_linear.py --out $R/float8_linear_$TAG.md"
    "pretrain_speed|360|$PY benchmarks/pretrain_speed.py --steps 12 --log-freq 4 --run-timeout 150 --out $R/pretrain_speed_$TAG.md"
    "sft_ladder|410|$PY benchmarks/sft_ladder.py --steps 4 --log-freq 2 --run-timeout 90 --out $R/sft_ladder_$TAG.md"
    "generation|150|$PY benchmarks/generation.py --device cuda --dtype bfloat16 --batches 1 16 64 --out $R/generation_$TAG.md"
    "chunked_ce|45|$PY benchmarks/chunked_ce.py --device cuda --dtype bfloat16 --tokens 8192 --dim 4096 --out $R/chunked_ce_$TAG.md"
    "optimizer_memory|60|$PY benchmarks/optimizer_memory.py --out $R/optimizer_memory_$TAG.md"
    "dpo_memory|90|$PY benchmarks/dpo_memory.py --out $R/dpo_memory_$TAG.md"
    "checkpoint_async|45|$PY benchmarks/checkpoint_async.py --out $R/checkpoint_async_$TAG.md"
)

if (( DRY_RUN )); then
    for part in "${PARTS[@]}"; do
        IFS='|' read -r name budget cmd <<< "$part"
        printf '%s\t%s\t%s\n' "$name" "$budget" "$cmd"
    done
    exit 0
fi

SUMMARY=$R/gpu_suite_$TAG.md
LOGS=outputs/gpu_suite_$TAG  # the full logs (not committed)
mkdir -p "$R" "$LOGS"
{
    echo "# GPU suite on $TAG"
    echo
    echo "Command: \`bash benchmarks/gpu_suite.sh\`, started $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)."
    $PY -c 'import torch, torchao; print(f"Device: {torch.cuda.get_device_name()}; torch {torch.__version__}, torchao {torchao.__version__}, CUDA {torch.version.cuda}.")'
    echo
    echo "| part | budget s | seconds | result | command |"
    echo "|---|---:|---:|---|---|"
} > "$SUMMARY"

failed=0
for part in "${PARTS[@]}"; do
    IFS='|' read -r name budget cmd <<< "$part"
    echo "=== $name (budget ${budget}s): $cmd"
    start=$SECONDS
    timeout --kill-after=20 "$budget" bash -c "$cmd" 2>&1 | tee "$LOGS/$name.log"
    rc=${PIPESTATUS[0]}
    case $rc in
        0) result=ok ;;
        124|137) result="stopped by its budget (partial results)"; failed=1 ;;
        *) result="failed (exit $rc; see $LOGS/$name.log)"; failed=1 ;;
    esac
    echo "| $name | $budget | $((SECONDS - start)) | $result | \`$cmd\` |" >> "$SUMMARY"
done
# The test outcomes, in the results too.
{ echo; echo "CUDA tests (pytest -m cuda), last lines:"; echo; echo '```'; tail -n 30 "$LOGS/cuda_tests.log"; echo '```'; } >> "$SUMMARY"
cat "$SUMMARY"
exit $failed
