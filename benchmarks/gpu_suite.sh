#!/usr/bin/env bash
# The GPU proof, cut into parts that each fit one device lease (8 minutes of wall time on one H100, install
# included). Part 1 is the one to run first: the CUDA tests (compile, FlexAttention on packed documents, float8,
# compiled decoding, memory, MoE grouped GEMM) and the headline, a Llama-3-8B-shaped model's tokens/s and MFU beside
# torchtitan's. Part 5 is Mixture of Experts: the experts' grouped GEMM three ways and a Qwen3-30B-A3B-shaped model.
# Part 6 is GRPO at Qwen3-1.7B's shape on one GPU (titanium's engine): generation tokens/s, sync, reference, train
# and step seconds, with generation in the loop, on the generation thread (lag 1) and compiled. Part 7 is what part 1
# and 6 left after the generation thread got a CUDA stream of its own: its three CUDA tests and the lag 1 row (with
# lag 0 beside it, on the same card). Parts "peers" and "peers_post" are titanium beside torchtitan (pretraining),
# torchtune (SFT) and TRL (DPO, GRPO) on the same card (benchmarks/peers.py), into one peers_<device>.md. Part
# "backend" is the transformers backend against the native Llama 3 on the 8B-shaped model, eager and compiled.
#
#   bash benchmarks/gpu_suite.sh --list                 # every part's steps, budgets and commands, in ORDER; runs nothing
#   bash benchmarks/gpu_suite.sh --part 1 --out "$OUT"  # one part; its results and logs into that folder
#   bash benchmarks/gpu_suite.sh                        # every part, in ORDER (a machine without a lease)
#
# Install: a GPU machine without registry access gets the wheels the project needs and its image lacks from
# `.gpu_wheels/` in the working tree (made here by `bash scripts/gpu_wheels.sh`); each part installs them with
# `pip --no-index --no-deps` into a folder of its own and puts it on PYTHONPATH. Without that folder nothing is
# installed (a machine where `pip install -e .` ran).
#
# Results: each step runs under `timeout` of its budget and writes its file as it goes, so a step or part stopped by
# its limit keeps what finished. Files are named by the device (pretrain_8b_h100.md) and hold the device, the torch /
# torchao / CUDA versions, the configuration and the command. With --out DIR they go flat into DIR with the logs in
# one DIR/logs_part<N>_<device>.tar.gz (at most 6 files a part, for a lease that returns 8); else into
# benchmarks/results/ and the logs into outputs/gpu_suite_<device>/. The part's summary (each step's command, exit
# status and seconds, and the test outcome) is gpu_suite_part<N>_<device>.md.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
R=benchmarks/results

WHEELS=.gpu_wheels
# Only the carried wheels, without an index or dependencies: the image has the rest (see scripts/gpu_wheels.sh).
INSTALL="$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target \$SITE $WHEELS/*.whl"
# part | step | budget (s) | command. Each part starts with the install; its budgets sum to at most 480 s.
STEPS=(
    "1|install|20|$INSTALL"
    "1|cuda_tests|150|$PY -m pytest -m cuda -q -p no:cacheprovider --continue-on-collection-errors tests"
    "1|pretrain_8b|180|$PY benchmarks/pretrain_speed.py --models 8B --variants eager compile float8_tensorwise --steps 10 --log-freq 3 --run-timeout 100 --out \$R/pretrain_8b_\$TAG.md"
    "1|generation|120|$PY benchmarks/generation.py --device cuda --dtype bfloat16 --batches 1 16 64 --repeats 3 --out \$R/generation_\$TAG.md"
    "2|install|20|$INSTALL"
    "2|sft_ladder|450|$PY benchmarks/sft_ladder.py --models 0.6B 1.7B --steps 4 --log-freq 2 --run-timeout 60 --out \$R/sft_ladder_\$TAG.md"
    "3|install|20|$INSTALL"
    "3|float8_linear|140|$PY benchmarks/float8_linear.py --out \$R/float8_linear_\$TAG.md"
    "3|pretrain_1b|200|$PY benchmarks/pretrain_speed.py --models 1B --steps 10 --log-freq 3 --run-timeout 60 --out \$R/pretrain_1b_\$TAG.md"
    "3|pretrain_8b_rowwise|110|$PY benchmarks/pretrain_speed.py --models 8B --variants float8_rowwise --steps 10 --log-freq 3 --run-timeout 100 --out \$R/pretrain_8b_rowwise_\$TAG.md"
    "4|install|20|$INSTALL"
    "4|dpo_memory|120|$PY benchmarks/dpo_memory.py --run-timeout 45 --out \$R/dpo_memory_\$TAG.md"
    "4|chunked_ce|60|$PY benchmarks/chunked_ce.py --device cuda --dtype bfloat16 --tokens 8192 --dim 4096 --out \$R/chunked_ce_\$TAG.md"
    "4|optimizer_memory|80|$PY benchmarks/optimizer_memory.py --out \$R/optimizer_memory_\$TAG.md"
    "4|checkpoint_async|60|$PY benchmarks/checkpoint_async.py --out \$R/checkpoint_async_\$TAG.md"
    "4|sft_ladder_4b|140|$PY benchmarks/sft_ladder.py --models 4B --steps 4 --log-freq 2 --run-timeout 60 --out \$R/sft_ladder_4b_\$TAG.md"
    "5|install|20|$INSTALL"
    "5|moe_layer|120|$PY benchmarks/moe_layer.py --device cuda --dtype bfloat16 --shape 8192,2048,768,128,8 --shape 16384,2048,768,128,8 --shape 16384,4096,1536,128,8 --out \$R/moe_layer_\$TAG.md"
    "5|pretrain_moe|250|$PY benchmarks/pretrain_speed.py --models 30B-A3B --variants eager compile --steps 10 --log-freq 3 --run-timeout 120 --out \$R/pretrain_moe_\$TAG.md"
    "6|install|20|$INSTALL"
    "6|grpo|450|$PY benchmarks/grpo_gpu.py --variants lag0 lag1 compiled --steps 5 --run-timeout 140 --out \$R/grpo_\$TAG.md"
    "7|install|20|$INSTALL"
    "7|side_stream_tests|90|$PY -m pytest -m cuda -q -p no:cacheprovider tests/unit/test_side_stream.py"
    "7|grpo_lag1|300|$PY benchmarks/grpo_gpu.py --variants lag0 lag1 --steps 5 --run-timeout 140 --out \$R/grpo_lag1_\$TAG.md"
    "backend|install|20|$INSTALL"
    "backend|backend_8b|440|$PY benchmarks/pretrain_speed.py --models 8B --variants eager backend compile backend_compile --steps 10 --log-freq 3 --run-timeout 100 --out \$R/backend_8b_\$TAG.md"
    "peers|install|30|$INSTALL"
    "peers|peers_pretrain|440|$PY benchmarks/peers.py --work pretrain --layers 6 --steps 8 --run-timeout 70 --out \$R/peers_\$TAG.md"
    "peers_post|install|30|$INSTALL"
    "peers_post|peers_sft|150|$PY benchmarks/peers.py --work sft --steps 5 --run-timeout 70 --out \$R/peers_\$TAG.md"
    "peers_post|peers_dpo|100|$PY benchmarks/peers.py --work dpo --steps 5 --run-timeout 50 --out \$R/peers_\$TAG.md"
    "peers_post|peers_grpo|190|$PY benchmarks/peers.py --work grpo --steps 4 --run-timeout 90 --out \$R/peers_\$TAG.md"
)
# The order to run the parts in (--list prints it, a run of every part follows it): the parts no GPU has run yet
# first (7, 2, 4), then the peers (pretraining; then SFT, DPO and GRPO: together they need more than one part's
# 8 minutes), then the parts already run (their results are in benchmarks/results/*_h200.md).
ORDER=(7 2 4 peers peers_post backend 1 3 5 6)

usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
PART=all LIST=0 OUTDIR=
while (( $# )); do
    case $1 in
        --list) LIST=1 ;;
        --part) PART=${2:?--part needs a number}; shift ;;
        --out) OUTDIR=${2:?--out needs a folder}; shift ;;
        -h|--help) usage ;;
        *) echo "gpu_suite.sh: unknown argument '$1'" >&2; usage ;;
    esac
    shift
done

if (( LIST )); then  # part, step, budget, command (tab-separated), the parts in ORDER
    for p in "${ORDER[@]}"; do
        for s in "${STEPS[@]}"; do
            IFS='|' read -r part name budget cmd <<< "$s"
            [[ $part == "$p" && ($PART == all || $PART == "$part") ]] && printf '%s\t%s\t%s\t%s\n' "$part" "$name" "$budget" "$cmd"
        done
    done
    exit 0
fi

install_wheels() {  # $1: the install command
    compgen -G "$WHEELS/*.whl" > /dev/null || { echo "no $WHEELS/: nothing to install"; return 0; }
    bash -c "$1"
}

# The offline machine: no hub, and one allocator setting that keeps long runs from fragmenting.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTORCH_ALLOC_CONF=expandable_segments:True PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
SITE=${TMPDIR:-/tmp}/titanium_gpu_site
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"

# "NVIDIA H100 80GB HBM3" -> h100: the results files are named by the device they ran on.
TAG=$($PY -c 'import re, sys, torch
if not torch.cuda.is_available():
    sys.exit("no CUDA GPU here: benchmarks/gpu_suite.sh is for a GPU machine (--list prints its commands)")
name = torch.cuda.get_device_name().replace("NVIDIA", "")
print(re.search(r"[A-Za-z]+[0-9]+", name).group(0).lower())') || exit 1
if [[ -n $OUTDIR ]]; then
    mkdir -p "$OUTDIR" && R=$(cd "$OUTDIR" && pwd)
fi
LOGS=outputs/gpu_suite_$TAG
mkdir -p "$R" "$LOGS"

run_part() {  # one part's steps; its summary rewritten after each, so a part stopped by its limit keeps it
    local want=$1 failed=0 rows="" versions="" started
    started="$(date -u '+%Y-%m-%d %H:%M UTC'), commit ${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
    for s in "${STEPS[@]}"; do
        IFS='|' read -r part name budget cmd <<< "$s"
        [[ $part == "$want" ]] || continue
        cmd=${cmd//\$R/$R}; cmd=${cmd//\$TAG/$TAG}; cmd=${cmd//\$SITE/$SITE}
        echo "=== part $part: $name (budget ${budget}s): $cmd"
        local start=$SECONDS rc result
        if [[ $name == install ]]; then
            install_wheels "$cmd" 2>&1 | tee "$LOGS/$name.log"; rc=${PIPESTATUS[0]}
            versions=$($PY -c 'import torch, torchao; print(f"Device: {torch.cuda.get_device_name()}; torch {torch.__version__}, torchao {torchao.__version__}, CUDA {torch.version.cuda}.")' 2>/dev/null)
        else
            timeout --kill-after=15 "$budget" bash -c "$cmd" 2>&1 | tee "$LOGS/$name.log"; rc=${PIPESTATUS[0]}
        fi
        case $rc in
            0) result=ok ;;
            124|137) result="stopped by its budget (partial results)"; failed=1 ;;
            *) result="failed (exit $rc; see its log)"; failed=1 ;;
        esac
        rows+="| $name | $budget | $((SECONDS - start)) | $result | \`$cmd\` |"$'\n'
        {
            echo "# GPU suite part $want on $TAG"
            echo
            echo "Command: \`bash benchmarks/gpu_suite.sh --part $want\`, started $started. $versions"
            echo
            echo "| step | budget s | seconds | result | command |"
            echo "|---|---:|---:|---|---|"
            printf '%s' "$rows"
            if [[ -f $LOGS/cuda_tests.log && $want == 1 ]]; then
                echo; echo "CUDA tests (pytest -m cuda), last lines:"; echo; echo '```'; tail -n 40 "$LOGS/cuda_tests.log"; echo '```'
            fi
        } > "$R/gpu_suite_part${want}_$TAG.md"
        [[ -n $OUTDIR ]] && tar -czf "$R/logs_part${want}_$TAG.tar.gz" -C "$LOGS" .
    done
    cat "$R/gpu_suite_part${want}_$TAG.md"
    return $failed
}

failed=0
parts=("${ORDER[@]}")
[[ $PART == all ]] || parts=("$PART")
for p in "${parts[@]}"; do
    run_part "$p" || failed=1
done
exit $failed
