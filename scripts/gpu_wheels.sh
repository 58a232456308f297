#!/usr/bin/env bash
# The wheels a GPU machine without registry access lacks, into .gpu_wheels/ (ignored by git, carried to the
# machine with the working tree): benchmarks/gpu_suite.sh installs exactly these with `pip --no-index --no-deps`.
#
#   bash scripts/gpu_wheels.sh          # here, with registry access; 3.5 MiB with the peers below
#
# The GPU image (Python 3.12, torch 2.11 with CUDA) has torch, transformers, safetensors, tiktoken, tokenizers,
# jinja2, tensorboard and huggingface_hub; it lacks torchao and tyro (with tyro's own needs) and tomli-w. The
# versions are the ones the CPU install resolves today; pinned, so the machine gets what was tested here.
#
# The peers (benchmarks/peers.py) and what they need that the image lacks: torchtitan 0.2.2, the newest release
# that imports on torch 2.11 (0.3.0 imports torch.distributed.fsdp.DataParallelMeshDims, which 2.11 does not
# have) with torchdata; torchtune 0.6.1 (its last release) with omegaconf, blobfile (and pycryptodomex) and
# kagglehub (and kagglesdk), which it imports at start; TRL 1.16 with datasets (dill, multiprocess). The image's
# transformers (5.17), accelerate and peft satisfy TRL's floors. Every part installs the one set (seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(torchao==0.18.0 tyro==1.0.17 typeguard==4.6.1 docstring-parser==0.18.0 tomli-w==1.2.0)
PEERS=(
    torchtitan==0.2.2 torchdata==0.11.0
    torchtune==0.6.1 omegaconf==2.4.0 blobfile==3.3.0 pycryptodomex==3.23.0 kagglehub==1.0.3 kagglesdk==0.1.19
    trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
)
rm -rf .gpu_wheels
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)
mkdir -p .gpu_wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" -d .gpu_wheels "${WHEELS[@]}" "${PEERS[@]}"
ls -1 .gpu_wheels
du -sh .gpu_wheels
