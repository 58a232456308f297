"""``python -m tests.objectives.fixed_rollouts <titanium.train args> | JOBS.json``: GRPO and PPO with responses
fixed in advance.

Sampling differs between data-parallel layouts (each rank draws from its own generator for its own share of
the prompts), so a layout test replaces it: response j to a prompt is drawn from a generator seeded by the
prompt's tokens, j and the rollout batch's number, some ending with a stop id and some cut at max_new_tokens.
Everything else is the real objective: the engine and its weight sync, the rewards (``characters`` below tells
such responses apart), advantages, old log-probs from a forward of the engine's copy of the policy (what sampling
returns), reference log-probs, the serving schedule and the loss. Any layout then trains on exactly the same
rollouts. An image-text model's responses carry their prompts' images, as sampled ones do. A GRPO job with
``--checkpoint.last_save_in_hf`` also writes its engine's weights (``export_with_engine``). A folder of a tiny
Qwen2.5-VL, Qwen3-VL or Llama 4 loads the tiny processor (``tests.objectives.tiny_processors``; theirs need
torchvision).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

import torch

from tests.objectives.synced_engine import write_engine
from titanium.data.prompts import PromptSample
from titanium.data.tokenizer import Tokenizer
from titanium.generation.generate import Generation
from titanium.generation.titanium_engine import TitaniumEngine
from titanium.rl.rollout import Rollout, image_inputs, response_logprobs, to_rollout
from titanium.rl.source import RolloutSource
from titanium.trainer import Trainer

_export = Trainer._export


def characters(completion: str, answer: str | None, row: Mapping[str, Any]) -> float:
    """A reward that tells the made-up responses apart."""
    return len(completion) / 10


def word_ids(tokenizer: Tokenizer) -> tuple[int, int]:
    """The ids responses are drawn from, ``[low, high)``: 200 to 1999, ordinary ids of the text tests' tokenizers, or
    in a smaller vocabulary (the tiny image-text models', specials first) the ids after its specials."""
    if tokenizer.vocab_size >= 2000:
        return 200, 2000
    return max(tokenizer.special_tokens.values()) + 1, tokenizer.vocab_size


def fixed_responses(samples: list[PromptSample], group: int, index: int, source: RolloutSource) -> Generation:
    """``group`` responses to each prompt that depend only on the prompt, j and ``index`` (the rollout batch's
    number), some ending with a stop id and some cut at max_new_tokens, on the source's device."""
    width, stop, rows = source.cfg.max_new_tokens, min(source.engine.stop_ids), []
    low, high = word_ids(source.tokenizer)
    for sample in samples:
        for j in range(group):
            g = torch.Generator().manual_seed(hash((tuple(sample.prompt), j, index)) & 0xFFFF_FFFF)
            length = int(torch.randint(1, width + 1, (1,), generator=g))
            tokens = torch.randint(low, high, (width,), generator=g)
            finished = bool(torch.rand(1, generator=g) < 0.5)
            if finished:
                tokens[length - 1] = stop
            else:
                length = width
            tokens[length:] = source.tokenizer.pad_id
            rows.append((tokens, length, finished))
    device = source.device
    return Generation(
        tokens=torch.stack([t for t, _, _ in rows]).to(device),
        logprobs=torch.zeros(len(rows), width, device=device),
        lengths=torch.tensor([n for _, n, _ in rows], device=device),
        finished=torch.tensor([f for _, _, f in rows], device=device),
    )


def fixed_sample(self: RolloutSource, samples: list[PromptSample], index: int) -> tuple[Rollout, int]:
    """Stands in for ``RolloutSource.sample``: responses that depend only on the prompt, j and ``index``."""
    group = self.draw.group_size
    generation = fixed_responses(samples, group, index, self)
    prompts = [s.prompt for s in samples for _ in range(group)]
    rewards = self.rewards.with_tokens(prompts, generation.token_lists(keep_stop=True))  # (as sample binds them)
    made = to_rollout(samples, group, generation, rewards, self.tokenizer, self.layout)  # (with the prompts' images)
    inputs = {"positions": made.positions, "document_ids": made.document_ids, **image_inputs(made.images)}
    with torch.no_grad():  # what the sampler's log-probs are: those of the engine's copy of the policy
        logits = self.engine.model(made.tokens, **inputs)
    old = response_logprobs(logits, made.tokens, self.cfg.max_new_tokens, self.cfg.temperature) * made.response_mask
    return dataclasses.replace(made, old_logprobs=old), self.engine.synced_version()


def export_with_engine(self: Trainer) -> None:
    """The trainer's exports, then, for a GRPO job exporting to Hugging Face format at the end, its titanium
    engine's weights next to them (``tests.objectives.synced_engine.write_engine``): the weights the last sync
    gathered from the trained layout, to compare with the export."""
    _export(self)
    source = getattr(self.objective, "source", None)
    engine = getattr(source, "engine", None)
    if self.cfg.checkpoint.last_save_in_hf and isinstance(engine, TitaniumEngine):
        write_engine(self, engine)


if __name__ == "__main__":  # <titanium.train args>, or JOBS.json: several jobs in one launch (jobs_worker)
    import transformers

    from tests.distributed.jobs_worker import run_jobs_file
    from tests.objectives.tiny_processors import load_processor
    from titanium.train import main

    RolloutSource.sample = fixed_sample
    Trainer._export = export_with_engine
    transformers.AutoProcessor.from_pretrained = load_processor
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        run_jobs_file(sys.argv[1])
    else:
        sys.exit(main())
