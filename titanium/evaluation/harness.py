"""Running lm-evaluation-harness tasks on titanium's ``LM`` (titanium/evaluation/lm.py), shared by the eval tool and
the periodic evaluation in training: finding the tasks, running them, and the numbers to log.

lm-eval is an optional dependency (``pip install -e '.[eval]'``): nothing here imports it before ``require_lm_eval``
has said how to install it. Its mistakes that are the user's (a task name it does not know, a task whose data must
be downloaded while the Hub is unreachable) become ``UserError``s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titanium.config.lm_eval_section import INSTALL_HINT
from titanium.errors import UserError

logger = logging.getLogger(__name__)


def require_lm_eval() -> None:
    """Raise a ``UserError`` saying how to install lm-evaluation-harness when it cannot be imported."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(f"lm-evaluation-harness is not installed: {INSTALL_HINT}") from None


def task_manager(tasks: list[str], include_path: str | None, flag: str = "--tasks") -> Any:
    """lm-eval's ``TaskManager`` that knows every task of ``tasks`` (an error names those it does not). When
    ``include_path`` holds them all, lm-eval's own 14,000 tasks are not indexed (that takes seconds)."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    if include_path:
        if not Path(include_path).is_dir():
            raise UserError(f"--include_path {include_path}: no such folder (a folder of lm-eval task YAMLs)")
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(task in local.all_tasks for task in tasks):
            return local
    manager = TaskManager(include_path=include_path or None)
    unknown = [task for task in tasks if task not in manager.all_tasks and not Path(task).is_file()]
    if unknown:
        where = f" or in --include_path {include_path}" if include_path else " (your own task YAMLs: --include_path)"
        raise UserError(
            f"{flag}: unknown lm-eval task {', '.join(map(repr, unknown))}: not one of lm-eval's tasks{where}; "
            "`lm-eval ls tasks` lists them"
        )
    return manager


@dataclass(frozen=True)
class TaskRun:
    """What to run, as lm_eval's command line names it."""

    tasks: list[str]
    limit: int | float | None = None
    num_fewshot: int | None = None
    apply_chat_template: bool = False
    fewshot_as_multiturn: bool | None = None
    """None: as --apply_chat_template (lm_eval's default)."""
    system_instruction: str | None = None
    gen_kwargs: str | None = None
    log_samples: bool = False
    bootstrap_iters: int = 100000
    seed: int = 0


def run_tasks(lm: Any, run: TaskRun, manager: Any, tracker: Any = None) -> dict[str, Any] | None:
    """lm_eval's ``simple_evaluate`` of ``run`` on ``lm`` (every data-parallel rank together): its results dict on
    rank 0, None on the others."""
    from lm_eval import simple_evaluate

    multiturn = run.apply_chat_template if run.fewshot_as_multiturn is None else run.fewshot_as_multiturn
    try:
        return simple_evaluate(
            model=lm,
            model_args=f"pretrained={lm.name}" if hasattr(lm, "name") else None,  # (names the output folder)
            tasks=run.tasks,
            task_manager=manager,
            num_fewshot=run.num_fewshot,
            limit=run.limit,
            apply_chat_template=run.apply_chat_template,
            fewshot_as_multiturn=multiturn,
            system_instruction=run.system_instruction,
            gen_kwargs=run.gen_kwargs,
            log_samples=run.log_samples,
            bootstrap_iters=run.bootstrap_iters,
            evaluation_tracker=tracker,
            random_seed=run.seed,
            numpy_random_seed=run.seed,
            torch_random_seed=run.seed,
            fewshot_random_seed=run.seed,
        )
    except ConnectionError as e:  # (datasets' way of saying a dataset must be downloaded and cannot be)
        raise UserError(
            f"{e}: a task's data must be downloaded from the Hugging Face Hub, which cannot be reached (offline: "
            "HF_DATASETS_OFFLINE / HF_HUB_OFFLINE). Run it once online to cache the data, or point a task YAML at "
            "local files (dataset_path: json, dataset_kwargs.data_files) and pass its folder as --include_path"
        ) from None


def metric_scalars(results: dict[str, Any], prefix: str = "lm_eval") -> dict[str, float]:
    """``<prefix>/<task>/<metric>`` for each numeric metric of each task and group (``/<filter>`` after the metric
    where a task filters its answers by more than lm-eval's "none"; standard errors are left out)."""
    scalars: dict[str, float] = {}
    for section in ("results", "groups"):
        for task, metrics in results.get(section, {}).items():
            for key, value in metrics.items():
                metric, _, filter_name = key.partition(",")
                if not filter_name or metric.endswith("_stderr") or isinstance(value, bool):
                    continue
                if isinstance(value, (int, float)):
                    name = metric if filter_name == "none" else f"{metric}/{filter_name}"
                    scalars[f"{prefix}/{task}/{name}"] = float(value)
    return scalars
