"""torchtitan 0.2.2's Llama 3 trainer on titanium's synthetic tokens, for ``benchmarks/peers.py``.

    torchrun --standalone --nproc_per_node 1 -m torchtitan.train \\
        --experimental.custom_import benchmarks.peer_torchtitan --model.name llama3_titanium_tokens \\
        --model.flavor 8B-6L ...

Imported by torchtitan's ``--experimental.custom_import``, this registers the train spec ``llama3_titanium_tokens``:
torchtitan's own Llama 3 spec (model, parallelization with its AC and compile, optimizer, loss) with two changes:

- flavors ``8B-<N>L``: Llama 3.1 8B (torchtitan's ``8B``) cut to N blocks, every other dimension kept, as
  ``pretrain_speed.py`` cuts titanium's; ``debugmodel`` keeps torchtitan's, with titanium's debug vocabulary;
- the data: titanium's ``SyntheticDataset`` (the windows titanium's ``--data.kind synthetic`` trains on, a pure
  function of the seed and the window's index) in torchtitan's batch form, so both train on the same tokens; no
  tokenizer is built (the ids are random, the vocabulary is the model's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.models.llama3 import get_train_spec, llama3_args
from torchtitan.protocols.train_spec import register_train_spec

from titanium.data.synthetic import SyntheticDataset

NAME = "llama3_titanium_tokens"
DEBUG_VOCAB = 2256
"""titanium's debug tokenizer's vocabulary (its ``debugmodel`` flavor's)."""


class TitaniumTokens(IterableDataset):
    """titanium's synthetic windows as torchtitan's samples: ({"input": ids}, labels)."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, dp_rank: int, dp_world: int) -> None:
        self.windows = SyntheticDataset(vocab_size, seq_len, seed, dp_rank, dp_world)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        for window in self.windows:
            yield {"input": window["input"]}, window["label"]


def flavors() -> dict:
    """torchtitan's Llama 3 flavors, and 8B cut to 1..32 blocks."""
    cut = {f"8B-{n}L": dataclasses.replace(llama3_args["8B"], n_layers=n) for n in range(1, 33)}
    debug = {"debugmodel": dataclasses.replace(llama3_args["debugmodel"], vocab_size=DEBUG_VOCAB)}
    return {**llama3_args, **cut, **debug}


def build_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config, **kwargs) -> ParallelAwareDataloader:
    """The spec's data: titanium's synthetic windows for the flavor's vocabulary and the job's seed."""
    vocab = flavors()[job_config.model.flavor].vocab_size
    seed = job_config.debug.seed or 0
    tokens = TitaniumTokens(vocab, job_config.training.seq_len, seed, dp_rank, dp_world_size)
    batch = job_config.training.local_batch_size
    return ParallelAwareDataloader(tokens, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=batch)


def train_spec():
    spec = get_train_spec()
    return dataclasses.replace(
        spec, model_args=flavors(), build_dataloader_fn=build_dataloader, build_tokenizer_fn=None,
        build_validator_fn=None,
    )  # fmt: skip


register_train_spec(NAME, train_spec())
