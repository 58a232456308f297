#!/usr/bin/env bash
# The tests of the areas where torch versions differ (parallelism, pipeline schedules, the memory estimator,
# generation, compile, DCP checkpoints, float8) on a torch other than the main install's: above all the GPU
# machine's 2.11, whose CUDA build runs on a CPU.
#
#   bash scripts/test_torch_version.sh 2.11.0                 # makes .venvs/torch-2.11.0 on first use (~4.5 GB)
#   TORCH_VENV_BASE=/work/venv211 bash scripts/test_torch_version.sh 2.11.0   # on top of a venv with that torch
#   bash scripts/test_torch_version.sh 2.11.0 -x -k pp_parity # pytest options after the version
#
# The virtualenv (.venvs/torch-VERSION, ignored by git) gets torch==VERSION and the project's dependencies with its
# dev extra, as the main install has them, torch held at VERSION; titanium itself is imported from this checkout
# (PYTHONPATH is this folder only). With TORCH_VENV_BASE (a virtualenv that already has torch VERSION) the new one
# sees that one's packages through a .pth file and installs only what it lacks: nothing in the base changes, and
# torch is not downloaded again. The dependencies are checked again whenever pyproject.toml changes. Prints
# pytest's summary and the minutes it took; the exit status is pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: bash scripts/test_torch_version.sh TORCH_VERSION [pytest options]}
shift
VENV=.venvs/torch-$VERSION
PY=$VENV/bin/python
TESTS=(
    tests/unit/test_parallel_dims.py tests/unit/test_context_parallel.py tests/unit/test_activation_checkpoint.py
    tests/distributed/test_fsdp_parity.py tests/distributed/test_tp_parity.py tests/distributed/test_cp_parity.py
    tests/unit/test_pipeline_split.py tests/distributed/test_pp_parity.py
    tests/unit/test_memory_estimate.py tests/unit/test_dry_run.py
    tests/unit/test_generation.py tests/unit/test_sampling.py tests/distributed/test_generation_fsdp.py
    tests/unit/test_compile.py tests/unit/test_attention_kernels.py
    tests/unit/test_checkpoint_integrity.py tests/distributed/test_checkpoint_layouts.py
    tests/unit/test_float8.py tests/distributed/test_float8_fsdp.py
    tests/unit/test_grad_norm.py tests/distributed/test_reward_parity.py tests/unit/test_split_engine.py
)

if [[ ! -x $PY ]]; then
    if [[ -n ${TORCH_VENV_BASE:-} ]]; then
        "$TORCH_VENV_BASE/bin/python" -m venv "$VENV"
        base_site=$("$TORCH_VENV_BASE/bin/python" -c 'import site; print(site.getsitepackages()[0])')
        echo "$base_site" > "$("$PY" -c 'import site; print(site.getsitepackages()[0])')/torch_venv_base.pth"
    else
        python3 -m venv "$VENV"
    fi
fi
installed=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
if [[ -z $installed ]]; then
    "$PY" -m pip install -q "torch==$VERSION"
elif [[ ${installed%%+*} != "$VERSION" ]]; then
    echo "test_torch_version.sh: $VENV has torch $installed, not $VERSION (remove it, or pick another base)" >&2
    exit 2
fi
stamp=$VENV/.titanium-dependencies
if [[ ! -f $stamp || $(cat "$stamp") != $(sha256sum pyproject.toml) ]]; then
    "$PY" - > "$VENV/requirements.txt" <<'EOF'
try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["dev"]))
EOF
    echo "torch==$VERSION" > "$VENV/constraints.txt"
    "$PY" -m pip install -q -c "$VENV/constraints.txt" -r "$VENV/requirements.txt"
    sha256sum pyproject.toml > "$stamp"
fi

start=$SECONDS
set +e
PYTHONPATH=$PWD "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" "$@" | tee "$VENV/last_run.log"
status=${PIPESTATUS[0]}
set -e
minutes=$(awk "BEGIN { printf \"%.1f\", ($SECONDS - $start) / 60 }")
summary=$(tail -n 1 "$VENV/last_run.log" | sed 's/=//g; s/^ *//; s/ *$//')
echo "torch $("$PY" -c 'import torch; print(torch.__version__)'): $summary; $minutes minutes"
exit "$status"
