"""Start titanium on this node of a SLURM job: torchrun with a c10d rendezvous on the job's first node.

Run once per node (``srun --ntasks-per-node=1``, see train.sbatch); every node's torchrun joins the same
rendezvous, so ranks are numbered across nodes. What it reads:

    SLURM_JOB_NUM_NODES (or SLURM_NNODES)   number of nodes
    NGPU, else SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE ("8" or "h100:8")   processes per node
    SLURM_JOB_ID                            rendezvous id
    MASTER_ADDR, else the first host of SLURM_JOB_NODELIST   rendezvous host; MASTER_PORT (29500)
    CONFIG_FILE                             job config (train_configs/debug_model.toml)

Arguments are config overrides (--section.key value), as for run_train.sh. The config and the layout
are checked against the job's world size before torchrun starts (exit 2 with one message on a
mistake). ``--print`` prints the environment it adds and the command, and exits without running it.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Mapping

from titanium.config import ConfigError, load_config
from titanium.parallel.dims import ParallelDims

DEFAULT_ENV = {
    "PYTORCH_ALLOC_CONF": "expandable_segments:True",  # big allocations come and go every step
    "NCCL_DEBUG": "WARN",  # NCCL's own warnings (e.g. a network interface it cannot use) reach the log
    "PYTHONFAULTHANDLER": "1",  # Python stacks of every thread if a rank dies on a signal
}
"""Set on every node unless the job's environment already sets them."""
SHOWN_PREFIXES = ("NCCL_", "FI_", "TORCH_NCCL_", "TORCH_FR_", "CUDA_VISIBLE_DEVICES")
"""Inherited variables printed with --print, so the network settings in effect are in the job log."""


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: "gpu[017-020,031],cpu5" -> "gpu017" (what `scontrol show
    hostnames` prints first)."""
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,\[]*)", nodelist.strip())
    if not match or not match.group(0):
        raise ConfigError(f"cannot read a host from SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR")
    prefix, ranges, suffix = match.groups()
    first = re.split(r"[-,]", ranges)[0] if ranges else ""
    return f"{prefix}{first}{suffix or ''}"


def gpus_per_node(env: Mapping[str, str]) -> int:
    for key in ("NGPU", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        if env.get(key):
            count = env[key].split(",")[0].split(":")[-1]  # "8", "h100:8", "gpu:h100:8"
            if count.isdigit() and int(count) > 0:
                return int(count)
            raise ConfigError(f"{key}={env[key]!r} is not a number of GPUs per node; set NGPU=<processes per node>")
    raise ConfigError("no GPU count for this node: submit with --gpus-per-node N, or set NGPU=<processes per node>")


def launch_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables this launcher adds (those the job's environment does not set already)."""
    return {key: value for key, value in DEFAULT_ENV.items() if key not in env}


def torchrun_argv(env: Mapping[str, str], overrides: list[str]) -> list[str]:
    """The torchrun command for this node, after checking the config and layout at the job's world size."""
    nodes_value = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if not nodes_value:
        raise ConfigError("not inside a SLURM job (no SLURM_JOB_NUM_NODES): submit scripts/slurm/train.sbatch")
    nodes, per_node = int(nodes_value), gpus_per_node(env)
    config_file = env.get("CONFIG_FILE", "train_configs/debug_model.toml")
    train_args = ["--job.config_file", config_file, *overrides]
    cfg = load_config(train_args)
    ParallelDims.from_config(cfg.parallelism, nodes * per_node)  # a layout that cannot fit fails here, once
    host = env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST", ""))
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nodes}",
        f"--nproc_per_node={per_node}",
        f"--rdzv_id={env.get('SLURM_JOB_ID', 'titanium')}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={host}:{env.get('MASTER_PORT', '29500')}",
        f"--local-ranks-filter={env.get('LOG_RANK', '0')}",
        "-m", "titanium.train", *train_args,
    ]  # fmt: skip


def main(argv: list[str]) -> int:
    print_only = "--print" in argv
    overrides = [a for a in argv if a != "--print"]
    try:
        command = torchrun_argv(os.environ, overrides)
    except ConfigError as e:
        print(f"titanium: config error: {e}", file=sys.stderr)
        return 2
    added = launch_env(os.environ)
    if print_only:
        shown = {k: v for k, v in sorted(os.environ.items()) if k.startswith(SHOWN_PREFIXES)}
        for key, value in {**shown, **added}.items():
            print(f"export {key}={shlex.quote(value)}")
        print(shlex.join(command))
        return 0
    os.execve(command[0], command, {**os.environ, **added})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
