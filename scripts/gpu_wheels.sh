#!/usr/bin/env bash
# The wheels a GPU machine without registry access lacks, into .gpu_wheels/ (ignored by git, carried to the
# machine with the working tree): benchmarks/gpu_suite.sh installs exactly these with `pip --no-index --no-deps`.
#
#   bash scripts/gpu_wheels.sh          # here, with registry access; 3.5 MiB
#
# The GPU image (Python 3.12, torch 2.11 with CUDA) has torch, transformers, safetensors, tiktoken, tokenizers,
# jinja2, tensorboard and huggingface_hub; it lacks torchao and tyro (with tyro's own needs) and tomli-w. The
# versions are the ones the CPU install resolves today; pinned, so the machine gets what was tested here.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(torchao==0.18.0 tyro==1.0.17 typeguard==4.6.1 docstring-parser==0.18.0 tomli-w==1.2.0)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)
mkdir -p .gpu_wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" -d .gpu_wheels "${WHEELS[@]}"
ls -1 .gpu_wheels
