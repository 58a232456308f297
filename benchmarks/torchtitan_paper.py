"""Launch configurations of the torchtitan paper's performance tables (Llama 3.1 8B/70B/405B, 8-512 H100s).

Each row of Tables 1-6 becomes a titanium job: the shipped TOML of its model plus the overrides for the
paper's layout, batch sizes, sequence length, activation checkpointing, compile and AsyncTP; 8 GPUs per
node, as in the paper. For every row this prints the SLURM submission, a one-node torchrun command where
the row fits one node, and the dry run that checks the layout here without GPUs.

    python benchmarks/torchtitan_paper.py --list                   # rows and the paper's numbers
    python benchmarks/torchtitan_paper.py --row table4             # commands of Table 4's rows
    python benchmarks/torchtitan_paper.py --row table3/async_tp --dry-run   # build its plan on a fake group
    python benchmarks/torchtitan_paper.py --row table1 --submit    # sbatch each row

The paper reads tokens/s per GPU at step 90 with a log every 10 steps, so every row runs 100 steps and
logs every 10. What the captions leave out is torchtitan's default for these models: sequence length 8192
(Tables 1-4), op-level selective AC, pipeline microbatches of one sequence. Rows whose paper setup includes
Float8 train with titanium's Float8 converter as torchtitan did: tensorwise scaling, weights all-gathered in
float8 by FSDP, their scales precomputed after each optimizer step.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from dataclasses import dataclass

GPUS_PER_NODE = 8
MEASURE = ("--training.steps", "100", "--metrics.log_freq", "10")
SAC = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op")
FULL_AC = ("--activation_checkpoint.mode", "full")
COMPILE = ("--compile.enable",)
ASYNC_TP = ("--compile.enable_async_tensor_parallel",)
FLOAT8 = (
    "--float8.enable",
    "--float8.recipe", "tensorwise",
    "--float8.enable_fsdp_float8_all_gather",
    "--float8.precompute_float8_dynamic_scale_for_fsdp",
)  # fmt: skip
CONFIGS = {
    "8B": "train_configs/llama3_8b.toml",
    "70B": "train_configs/llama3_70b.toml",
    "405B": "train_configs/llama3_405b.toml",
}


@dataclass(frozen=True)
class Row:
    table: int
    name: str
    model: str
    gpus: int
    overrides: tuple[str, ...]
    paper: str
    """The paper's result for this row (tokens/s per GPU, peak memory), to compare against."""
    float8: bool = False
    """The paper's row trains with Float8 (tensorwise, float8 all-gather): so does the job."""

    @property
    def id(self) -> str:
        return f"table{self.table}/{self.name}"

    @property
    def config(self) -> str:
        return CONFIGS[self.model]

    @property
    def args(self) -> list[str]:
        return [*MEASURE, *self.overrides, *(FLOAT8 if self.float8 else ())]

    def sbatch_command(self) -> str:
        nodes = self.gpus // GPUS_PER_NODE
        job = f"tt-{self.id.replace('/', '-')}"
        return (
            f"CONFIG_FILE={self.config} sbatch --nodes {nodes} --job-name {job} scripts/slurm/train.sbatch "
            + shlex.join(self.args)
        )

    def torchrun_command(self) -> str | None:
        if self.gpus > GPUS_PER_NODE:
            return None
        return f"NGPU={self.gpus} CONFIG_FILE={self.config} ./run_train.sh " + shlex.join(self.args)

    def dry_run_argv(self) -> list[str]:
        return ["--job.config_file", self.config, *self.args, "--world_size", str(self.gpus)]


def _layout(dp_shard: int, tp: int = 1, pp: int = 1, cp: int = 1) -> tuple[str, ...]:
    return (
        "--parallelism.data_parallel_shard_degree", str(dp_shard),
        "--parallelism.tensor_parallel_degree", str(tp),
        "--parallelism.pipeline_parallel_degree", str(pp),
        "--parallelism.context_parallel_degree", str(cp),
    )  # fmt: skip


def _batch(local: int, global_: int, seq_len: int = 8192) -> tuple[str, ...]:
    return (
        "--training.local_batch_size", str(local),
        "--training.global_batch_size", str(global_),
        "--training.seq_len", str(seq_len),
    )  # fmt: skip


def _fsdp_8b_rows(table: int, gpus: int, paper: tuple[str, str, str]) -> list[Row]:
    """Tables 1 and 2: Llama 3.1 8B, FSDP only, selective AC, local batch 2."""
    base = (*_layout(gpus), *_batch(2, 2 * gpus), *SAC)
    return [
        Row(table, "fsdp", "8B", gpus, base, paper[0]),
        Row(table, "compile", "8B", gpus, (*base, *COMPILE), paper[1]),
        Row(table, "compile_float8", "8B", gpus, (*base, *COMPILE), paper[2], float8=True),
    ]


def _table3() -> list[Row]:
    """70B on 256 GPUs: FSDP 32 x TP 8, compile + Float8, full AC, local batch 16, global 512."""
    base = (*_layout(32, tp=8), *_batch(16, 512), *FULL_AC, *COMPILE)
    return [
        Row(3, "2d", "70B", 256, base, "897 tok/s, 70.3 GiB", float8=True),
        Row(3, "async_tp", "70B", 256, (*base, *ASYNC_TP), "1,010 tok/s, 67.7 GiB", float8=True),
    ]


def _table4() -> list[Row]:
    """405B on 512 GPUs: FSDP 4 x TP 8 x PP 16, compile + Float8 + AsyncTP, full AC, local batch 32, global 128."""
    base = (*_layout(4, tp=8, pp=16), *_batch(32, 128), *FULL_AC, *COMPILE, *ASYNC_TP)
    return [
        Row(4, name, "405B", 512, (*base, "--parallelism.pipeline_parallel_schedule", schedule), paper, float8=True)
        for name, schedule, paper in (
            ("1f1b", "1F1B", "100 tok/s, 78.0 GiB"),
            ("interleaved_1f1b", "Interleaved1F1B", "130 tok/s, 80.3 GiB"),
        )
    ]


def _cp_rows(table: int, model: str, gpus: int, papers: tuple[str, ...], tp: int = 1, pp: int = 1) -> list[Row]:
    """Tables 5 and 6: compile + Float8 (+ AsyncTP with TP), full AC; the sequence grows with the
    context-parallel degree (32k x CP) and FSDP takes the rest of the GPUs."""
    rows = []
    for cp, paper in zip((1, 2, 4, 8), papers, strict=True):
        dp = gpus // (tp * pp * cp)
        local = 1 if pp == 1 else 8
        overrides = (*_layout(dp, tp, pp, cp), *_batch(local, local * dp, 32768 * cp), *COMPILE, *FULL_AC)
        if tp > 1:
            overrides = (*overrides, *ASYNC_TP)
        if pp > 1:
            overrides = (*overrides, "--parallelism.pipeline_parallel_schedule", "1F1B")
        rows.append(Row(table, f"fsdp{dp}_cp{cp}", model, gpus, overrides, paper, float8=True))
    return rows


TABLE5 = ("3,890 tok/s, 83.9 GiB", "2,540 tok/s, 84.2 GiB", "1,071 tok/s, 84.0 GiB", "548 tok/s, 84.5 GiB")
TABLE6 = ("76 tok/s, 75.3 GiB", "47 tok/s, 75.9 GiB", "31 tok/s, 77.1 GiB", "16 tok/s, 84.9 GiB")
ROWS: list[Row] = [
    *_fsdp_8b_rows(1, 8, ("6,258 tok/s, 81.9 GiB", "6,674 tok/s, 77.0 GiB", "9,409 tok/s, 76.8 GiB")),
    *_fsdp_8b_rows(2, 128, ("5,645 tok/s, 67.0 GiB", "6,482 tok/s, 62.1 GiB", "9,319 tok/s, 61.8 GiB")),
    *_table3(),
    *_table4(),
    *_cp_rows(5, "8B", 8, TABLE5),  # 8B on 8 GPUs, local batch 1
    *_cp_rows(6, "405B", 512, TABLE6, tp=8, pp=8),  # 405B on 512 GPUs, 1F1B, local batch 8
]


def select(patterns: list[str]) -> list[Row]:
    """Rows whose id equals a pattern or starts with it plus "/" (a whole table); all without patterns."""
    if not patterns:
        return ROWS
    rows = [r for r in ROWS if any(r.id == p or r.id.startswith(p.rstrip("/") + "/") for p in patterns)]
    if not rows:
        raise SystemExit(f"no row matches {patterns}; --list shows them")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--row", action="append", default=[], help="row id or table (e.g. table4); repeatable")
    parser.add_argument("--list", action="store_true", help="list the rows and the paper's numbers")
    parser.add_argument("--dry-run", action="store_true", help="build each row's plan here (fake process group)")
    parser.add_argument("--submit", action="store_true", help="submit each row with sbatch")
    args = parser.parse_args(argv)
    rows = select(args.row)
    if args.list:
        for r in rows:
            print(f"{r.id:<26} {r.model:>4} on {r.gpus:>3} GPUs  paper: {r.paper}{'  (Float8)' if r.float8 else ''}")
        return 0
    if args.dry_run:
        from titanium.tools import dry_run

        # The plans only: the dry-run command printed for a row also estimates its memory per rank.
        return max(dry_run.main([*r.dry_run_argv(), "--no_memory"]) for r in rows)
    for r in rows:
        print(f"# {r.id}: Llama 3.1 {r.model} on {r.gpus} GPUs; paper: {r.paper}")
        print(r.sbatch_command())
        if (single_node := r.torchrun_command()) is not None:
            print(single_node)
        print("python -m titanium.tools.dry_run " + shlex.join(r.dry_run_argv()))
        print()
        if args.submit:
            subprocess.run(r.sbatch_command(), shell=True, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
