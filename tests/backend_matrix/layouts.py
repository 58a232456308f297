"""The layout cells of the compatibility matrix: FSDP 2, TP 2 and PP 2 trained by ``titanium.train`` against one
process.

Each architecture's tiny config (``configs.py``) is written as a ``config.json`` folder; ``titanium.train`` builds
the model from it (``--model.hf_config``: seeded initialization, which is the same in every layout) and trains 2
steps on synthetic data: once in one process, then under dp_shard 2, tensor parallel 2 and pipeline parallel 2.
MoE models balance their routing with titanium's bias (``balancing``). A layout cell is ``yes`` when its losses
equal the one-process run's to 1e-5 relative, ``refused`` with the message
titanium gives (before any process group for the model's own limits), ``no`` otherwise. Every architecture's
one-process jobs run in launches of one process and the layout jobs in launches of 2 (``layout_worker.py``),
``JOBS_PER_LAUNCH`` jobs each, a launch ending early at a job that fails (its group may be broken).

Adam with eps 0.1 as in tests/distributed/test_backend_parity.py: rounding-level gradient differences between
layouts stay rounding-level.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.backend_matrix.cells import NO, REFUSED, UNTESTED, YES, Cell
from tests.backend_matrix.configs import tiny_config_dict
from tests.helpers import REPO, env, scalars, tiny_args, train_cmd

STEPS = 2
COMMON = ("--data.kind", "synthetic", "--optimizer.eps", "0.1", "--training.steps", str(STEPS))
LAYOUTS = {
    "fsdp": ("--training.local_batch_size", "2"),  # (2 ranks x 2 rows: the one-process run's 4 rows)
    "tp": ("--parallelism.tensor_parallel_degree", "2"),
    "pp": ("--parallelism.pipeline_parallel_degree", "2"),
}
EXPERT_PARALLEL = ("--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2")
"""Expert parallelism 2 (borrowed from dp_shard 2): each rank holds half of every MoE layer's experts."""
RTOL = 1e-5
JOBS_PER_LAUNCH = 30


def balancing(config: Path) -> tuple[str, ...]:
    """The ``[moe]`` setting an MoE model trains with in every layout: titanium's routing bias where titanium's MoE
    computes its blocks (the auxiliary loss needs all layers in one backward: no pipeline stages), none where the
    blocks are the model's own (titanium refuses to balance them); nothing for a dense model."""
    import torch

    from titanium.models.transformers import TransformersArgs, TransformersModel

    args = TransformersArgs.from_config(json.loads((config / "config.json").read_text()))
    with torch.device("meta"):
        model = TransformersModel(args)
    if model.moe_layers:
        return ("--moe.load_balance", "bias")
    return ("--moe.load_balance", "none") if model.own_moe_blocks else ()


def write_config(folder: Path, model_type: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(tiny_config_dict(model_type)))
    return folder


def job(out: Path, config: Path, *extra: str) -> list[str]:
    model = ("--model.backend", "transformers", "--model.hf_config", str(config), *balancing(config))
    return tiny_args(out, *COMMON, *model, *extra)


def launch(jobs: dict[str, list[str]], nproc: int, folder: Path, timeout: int) -> dict[str, list[str]]:
    """Every job of ``jobs`` in launches of ``nproc`` processes, ``JOBS_PER_LAUNCH`` at a time (what a process
    keeps of each job adds up), a launch stopping at its first failed job (``layout_worker``) and the jobs after it
    going to the next; name -> [outcome, detail]."""
    pending = list(jobs)
    results: dict[str, list[str]] = {}
    while pending:
        part = {name: jobs[name] for name in pending[:JOBS_PER_LAUNCH]}
        results.update(_launch(part, nproc, folder / f"launch_{nproc}_{len(results)}", timeout))
        pending = [name for name in pending if name not in results]
    return results


def _launch(jobs: dict[str, list[str]], nproc: int, folder: Path, timeout: int) -> dict[str, list[str]]:
    """The answered jobs of one launch; where the launch itself failed, its first unanswered job carries why (so each
    launch answers at least one job)."""
    folder.mkdir(parents=True, exist_ok=True)
    jobs_file, results_file = folder / "jobs.json", folder / "results.json"
    jobs_file.write_text(json.dumps(jobs))
    cmd = train_cmd([str(jobs_file), str(results_file)], nproc, module="tests.backend_matrix.layout_worker")
    try:
        result = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)
        crash = "" if result.returncode == 0 else f"the launch failed ({result.returncode}): {result.stderr[-600:]}"
    except subprocess.TimeoutExpired:
        crash = f"the launch did not finish in {timeout} s"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    unanswered = [name for name in jobs if name not in results]
    if unanswered and (crash or not results):
        results[unanswered[0]] = ["error", crash or "the launch answered no job"]
    return results


def layout_cells(
    model_types: list[str],
    folder: Path,
    timeout: int = 3600,
    extra: dict[str, dict[str, tuple[str, ...]]] | None = None,
) -> dict[str, dict[str, Cell]]:
    """model_type -> the ``fsdp``, ``tp`` and ``pp`` cells, for every architecture whose one-process run trains, and
    the cells of ``extra`` layouts (model_type -> cell name -> its arguments, on 2 processes: expert parallelism)."""
    extra = extra or {}
    configs = {mt: write_config(folder / "configs" / mt, mt) for mt in model_types}
    single = {mt: job(folder / "single" / mt, configs[mt]) for mt in model_types}
    single_results = launch(single, 1, folder, timeout)
    out: dict[str, dict[str, Cell]] = {}
    parallel = {}
    for mt in model_types:
        outcome, detail = single_results[mt]
        if outcome != "ok":
            out[mt] = {
                name: Cell(UNTESTED, f"one process: {outcome}: {detail}") for name in {**LAYOUTS, **extra.get(mt, {})}
            }
            continue
        for name, arguments in {**LAYOUTS, **extra.get(mt, {})}.items():
            parallel[f"{mt}/{name}"] = job(folder / name / mt, configs[mt], *arguments)
    parallel_results = launch(parallel, 2, folder, timeout) if parallel else {}
    for mt in model_types:
        if mt in out:
            continue
        expected = scalars(folder / "single" / mt / "tb")
        names = {**LAYOUTS, **extra.get(mt, {})}
        out[mt] = {name: _cell(parallel_results[f"{mt}/{name}"], folder / name / mt, expected) for name in names}
    return out


def _cell(result: list[str], out: Path, expected: dict[int, float]) -> Cell:
    outcome, detail = result
    if outcome == "refused":
        return Cell(REFUSED, detail)
    if outcome != "ok":
        return Cell(NO, detail)
    got = scalars(out / "tb")
    if sorted(got) != sorted(expected):
        return Cell(NO, f"logged steps {sorted(got)}, expected {sorted(expected)}")
    worst = max(abs(got[s] - v) / max(abs(v), 1e-12) for s, v in expected.items())
    return Cell(YES if worst <= RTOL else NO, f"losses max rel diff {worst:.1e} over {STEPS} steps")
