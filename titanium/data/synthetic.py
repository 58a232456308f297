"""Random-token windows for benchmarks: no I/O, no tokenizer, reproducible and resumable."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from titanium.data.text import check_same_dp_world


class SyntheticDataset:
    """Rank r's k-th window is global window k * dp_world + r, a pure function of (seed, index).

    So any data-parallel layout with the same global batch trains on the same set of windows:
    parallel runs can be compared number for number with one process. The state is just k.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int, dp_rank: int = 0, dp_world: int = 1) -> None:
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.index = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            global_index = self.index * self.dp_world + self.dp_rank
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + global_index)
            window = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=gen)
            self.index += 1
            yield {"input": window[:-1], "label": window[1:]}

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index, "dp_world": self.dp_world}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_same_dp_world(state, self.dp_world)
        self.index = state["index"]
