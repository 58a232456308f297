"""What the log line shows about an objective's data: rows skipped, samples cut or left out, and padding."""

from __future__ import annotations

from typing import Protocol

import torch

from titanium.data.packing import padding_mask


class CountsRows(Protocol):
    """A dataset that counts its bad rows and its truncated and dropped samples (SFT samples, DPO pairs)."""

    bad_rows: int
    truncated: int
    dropped: int


class DataMeter:
    """Counters of a dataset, and the share of padding in the rows handed out since the last log line."""

    def __init__(self, dataset: CountsRows) -> None:
        self.dataset = dataset
        self._padding = self._tokens = 0

    def add(self, batch: dict[str, torch.Tensor]) -> None:
        """Count a microbatch's padding (rows made by titanium.data.packing.make_row, on the CPU: no sync)."""
        self._padding += int(padding_mask(batch).sum())
        self._tokens += batch["input"].numel()

    def metrics(self) -> dict[str, float]:
        """Non-zero counters, and ``data/padding_pct`` since the last call."""
        counters = {
            "data/skipped_rows": self.dataset.bad_rows,
            "data/truncated_samples": self.dataset.truncated,
            "data/dropped_samples": self.dataset.dropped,
            # prompts cut to max_prompt_length (SFT prompt/completion rows, DPO pairs; other datasets cut none)
            "data/truncated_prompts": getattr(self.dataset, "prompt_truncated", 0),
        }
        metrics = {k: float(v) for k, v in counters.items() if v}
        if self._tokens:  # share of the rows that is padding: what packing saves
            metrics["data/padding_pct"] = 100.0 * self._padding / self._tokens
            self._padding = self._tokens = 0
        return metrics
