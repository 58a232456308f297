"""Send the loop's scalars to TensorBoard and/or Weights & Biases.

The loop hands over flat, short keys (``loss``, ``tps``, ``mem_peak_gib``, ...); this module
maps them to grouped tags (``loss_metrics/global_avg_loss``, ``throughput/tps``,
``memory/peak_gib``) so dashboards show related curves together. Both backends are optional
and imported only when enabled: a run with neither costs nothing, and W&B is not a hard
dependency of the library.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only for annotations: keeps importing metrics free of the config package
    from titanium.config.sections import MetricsSection
    from titanium.metrics.table import Table

__all__ = ["SCALAR_TAGS", "MetricsLogger", "WandbNotInstalledError"]

logger = logging.getLogger(__name__)

SCALAR_TAGS: dict[str, str] = {
    "loss": "loss_metrics/global_avg_loss",
    "loss_max": "loss_metrics/global_max_loss",
    "grad_norm": "optim/grad_norm",
    "lr": "optim/lr",
    "tps": "throughput/tps",
    "tflops": "throughput/tflops",
    "mfu_pct": "throughput/mfu_pct",
    "step_time_s": "time/step_s",
    "data_pct": "time/data_loading_pct",
    "eta_s": "time/eta_s",
    "mem_peak_gib": "memory/peak_gib",
    "mem_peak_pct": "memory/peak_pct",
    "mem_peak_reserved_gib": "memory/peak_reserved_gib",
    "mem_alloc_retries": "memory/num_alloc_retries",
    "mem_ooms": "memory/num_ooms",
}
"""Loop key -> logged tag. Keys not listed here are logged under their own name unchanged, so a
caller can pass a fully qualified tag such as ``"eval/loss"`` directly."""


def aliased(values: Mapping[str, float], aliases: Mapping[str, str]) -> dict[str, float]:
    """Copies of ``values`` (tag -> value) under the names ``aliases`` gives them: a tag's own, or for a key ending
    in "/" (every tag under it) a format of the rest of the tag (``grpo/reward/`` -> ``rewards/{}/mean``)."""
    out = {aliases[k]: v for k, v in values.items() if k in aliases}
    for prefix, alias in aliases.items():
        if prefix.endswith("/"):
            out.update({alias.format(k[len(prefix) :]): v for k, v in values.items() if k.startswith(prefix)})
    return out


class WandbNotInstalledError(ImportError):
    """``metrics.enable_wandb`` is set but the ``wandb`` package cannot be imported."""


_WANDB_HINT = (
    "metrics.enable_wandb is set but the 'wandb' package is not installed. "
    "Install it with: pip install 'titanium[wandb]'  "
    "(or turn W&B off with --metrics.enable_wandb false)."
)


class MetricsLogger:
    """Writes the scalars of each log step to the enabled backends, on the ranks that should.

    Which ranks write: TensorBoard on rank 0 only (folder ``{dump_folder}/{save_tb_folder}``),
    or on every rank with ``cfg.save_for_all_ranks`` (folder
    ``{dump_folder}/{save_tb_folder}/rank_{r}``, so per-rank curves can be compared, e.g. to find
    a straggler). W&B logs from rank 0 only: one run per job, not one per GPU. On all other
    ranks every method is a no-op, so the loop can call it unconditionally.

    If W&B is enabled but not installed, *every* rank raises :class:`WandbNotInstalledError` at
    construction: failing on rank 0 alone would leave the other ranks hanging in the next
    collective until the timeout.

    W&B honours its own environment variables; in particular ``WANDB_MODE=offline`` keeps the
    run local (under ``{dump_folder}/wandb``), which is what the tests use.

    Args:
        cfg: The ``[metrics]`` section.
        dump_folder: ``job.dump_folder``; all output goes beneath it.
        rank: Global rank of this process.
        run_config: The resolved job config as a plain dict; recorded as the W&B run config and
            as a text entry in TensorBoard so a curve can always be traced back to its settings.
        aliases: Other names to log some tags under too (see :func:`aliased`): the objective's
            ``trl_metric_names``.
    """

    def __init__(
        self,
        cfg: MetricsSection,
        dump_folder: str,
        rank: int,
        run_config: dict[str, Any] | None = None,
        aliases: Mapping[str, str] | None = None,
    ) -> None:
        self.cfg = cfg
        self.aliases = aliases or {}
        self.rank = rank
        self.tb_dir: str | None = None
        self._tb: Any = None  # torch.utils.tensorboard.SummaryWriter
        self._wandb_run: Any = None
        self._wandb: Any = None

        if cfg.enable_wandb and importlib.util.find_spec("wandb") is None:
            raise WandbNotInstalledError(_WANDB_HINT)

        if cfg.enable_tensorboard and (rank == 0 or cfg.save_for_all_ranks):
            base = os.path.join(dump_folder, cfg.save_tb_folder, cfg.run_name)  # ("": the tb folder itself)
            self.tb_dir = os.path.join(base, f"rank_{rank}") if cfg.save_for_all_ranks else base
            # Imported here: tensorboard is only needed when this rank actually writes.
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(self.tb_dir, exist_ok=True)
            self._tb = SummaryWriter(log_dir=self.tb_dir)
            if run_config is not None:
                text = json.dumps(run_config, indent=2, sort_keys=True, default=str)
                # Four-space indent makes TensorBoard's markdown render it as a code block.
                self._tb.add_text("run_config", "\n".join("    " + ln for ln in text.splitlines()))

        if cfg.enable_wandb and rank == 0:
            try:
                import wandb
            except ImportError as exc:  # find_spec succeeded but import failed (broken install)
                raise WandbNotInstalledError(f"{_WANDB_HINT} Import failed with: {exc}") from exc
            os.makedirs(dump_folder, exist_ok=True)
            self._wandb = wandb
            self._wandb_run = wandb.init(
                project=cfg.wandb_project, name=cfg.run_name or None, dir=dump_folder, config=run_config
            )

    @property
    def active(self) -> bool:
        """True if this rank writes anywhere (lets the loop skip building extra scalars)."""
        return self._tb is not None or self._wandb_run is not None

    @staticmethod
    def tag_for(key: str) -> str:
        """The tag a loop key is logged under (see :data:`SCALAR_TAGS`)."""
        return SCALAR_TAGS.get(key, key)

    def log(self, step: int, scalars: Mapping[str, float | None]) -> None:
        """Record one log step's scalars; None values (e.g. MFU on CPU) are skipped, not zeroed,
        so they do not draw a false curve."""
        if not self.active:
            return
        values = {self.tag_for(k): float(v) for k, v in scalars.items() if v is not None}
        values.update(aliased(values, self.aliases))
        if not values:
            return
        if self._tb is not None:
            for tag, value in values.items():
                self._tb.add_scalar(tag, value, step)
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=step)

    def log_table(self, step: int, name: str, table: Table) -> None:
        """Record a table of samples (``name``, e.g. ``grpo/completions``): a markdown table in TensorBoard's Text
        tab, a ``wandb.Table`` in W&B."""
        if self._tb is not None:
            self._tb.add_text(name, table.markdown(), step)
        if self._wandb_run is not None:
            data = [list(row) for row in table.rows]
            self._wandb_run.log({name: self._wandb.Table(columns=list(table.columns), data=data)}, step=step)

    def close(self) -> None:
        """Flush and close the backends (safe to call twice). Call at the end of training, also
        on error paths, or the last events may be lost."""
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
