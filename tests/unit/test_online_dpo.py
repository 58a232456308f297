"""Online DPO: its loss and gradients against TRL 1.16's own ``OnlineDPOTrainer.training_step`` on identical sampled
pairs (generation replaced by fixed completions, ties and truncated responses among them), and the objective in the
loop: pairs ranked by their rewards, the reference's log-probs the start policy's (so the first step's sigmoid loss
is exactly log 2), and a bad config refused before anything starts."""

from __future__ import annotations

import math
import tempfile
from typing import Any

import pytest
import torch

from tests.helpers import REPO, tiny_args
from tests.objectives.tiny_hf import BOS, EOS, PAD, tiny_llama, word_tokenizer
from titanium.config import load_config
from titanium.config.components import DPO_LOSSES
from titanium.config.loader import ConfigError
from titanium.config.sections import DPOSection
from titanium.generation.sampling import token_logprobs
from titanium.objectives.losses.dpo import as_pair_loss
from titanium.objectives.online_dpo import chosen_of_pairs, pair_losses

PROMPTS = [[BOS, 5, 6, 7], [BOS, 11, 12], [BOS, 20]]
WIDTH, BETA, PENALTY = 5, 0.3, 0.5
# TRL's order: the first completion of every prompt, then the second of every prompt; lengths < WIDTH end with EOS
LENGTHS = [5, 3, 2, 4, 5, 2]
REWARDS = [1.0, 0.0, 0.5, 1.0, 0.25, 0.5]  # prompt 0: a tie broken by the missing EOS; prompt 2: a tie (first wins)
TOLERANCE = 1e-6


def completions() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(prompt_ids, prompt_mask, completion_ids, completion_mask)`` in TRL's layout for 2 x len(PROMPTS) rows."""
    g = torch.Generator().manual_seed(0)
    width = max(map(len, PROMPTS))
    prompts = PROMPTS + PROMPTS
    prompt_ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    rows, masks = [], []
    for length in LENGTHS:
        tokens = torch.randint(3, 48, (WIDTH,), generator=g).tolist()
        if length < WIDTH:
            tokens[length - 1] = EOS
            tokens[length:] = [PAD] * (WIDTH - length)
        rows.append(tokens)
        masks.append([1] * length + [0] * (WIDTH - length))
    return prompt_ids, prompt_mask, torch.tensor(rows), torch.tensor(masks)


def scripted_reward(completions: list[Any], completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """REWARDS by row (TRL calls it once with the whole batch, in its order)."""
    assert len(completion_ids) == len(REWARDS)
    return list(REWARDS)


def trl_step(loss_type: str) -> tuple[float, dict[str, torch.Tensor]]:
    """TRL's loss and gradients: ``OnlineDPOTrainer.training_step`` with ``_generate`` returning the fixed pairs."""
    pytest.importorskip("trl", reason="pip install 'trl>=1.16,<2' (in the dev extra) to compare with TRL")
    from datasets import Dataset
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    args = OnlineDPOConfig(
        output_dir=tempfile.mkdtemp(),
        report_to=[],
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=len(PROMPTS),
        max_new_tokens=WIDTH,
        max_length=64,
        beta=BETA,
        loss_type=loss_type,
        missing_eos_penalty=PENALTY,
    )
    trainer = OnlineDPOTrainer(
        model=tiny_llama(0),
        ref_model=tiny_llama(1),
        reward_funcs=scripted_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["t5"] * len(PROMPTS)}),
        processing_class=word_tokenizer(),
    )
    fixed = completions()
    trainer._generate = lambda model, prompts, images=None: (*fixed, None)
    loss = trainer.training_step(trainer.model, {"prompt": ["t5"] * len(PROMPTS)})
    return loss.item(), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def untempered_logprobs(model: Any, fixed: tuple[torch.Tensor, ...]) -> torch.Tensor:
    prompt_ids, prompt_mask, completion_ids, completion_mask = fixed
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    logits = model(input_ids=ids, attention_mask=torch.cat([prompt_mask, completion_mask], dim=1)).logits
    return token_logprobs(logits[:, -WIDTH - 1 : -1], completion_ids)


def titanium_step(loss_type: str) -> tuple[float, dict[str, torch.Tensor]]:
    """titanium's: the same rows in its order (each prompt's pair contiguous), ranked by ``chosen_of_pairs`` on the
    rewards less the missing-EOS penalty, the loss of ``pair_losses`` as the loop divides it (sum / pairs)."""
    model, reference, fixed = tiny_llama(0), tiny_llama(1), completions()
    n = len(PROMPTS)
    order = torch.tensor([i + half * n for i in range(n) for half in (0, 1)])  # TRL's (i, i + n) -> rows 2i, 2i + 1
    finished = torch.tensor([length < WIDTH for length in LENGTHS])
    rewards = torch.tensor(REWARDS) - PENALTY * (~finished).float()
    logprobs = untempered_logprobs(model, fixed)[order]
    with torch.no_grad():
        ref_logprobs = untempered_logprobs(reference, fixed)[order]
    mask, chosen = fixed[3][order], chosen_of_pairs(rewards[order])
    loss = as_pair_loss(DPO_LOSSES.load(loss_type))
    losses, _, _ = pair_losses(logprobs, ref_logprobs, mask, chosen, loss, DPOSection(beta=BETA, loss_type=loss_type))
    step = losses.sum() / n
    step.backward()
    return step.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_the_loss_and_gradients_equal_trls_online_dpo_trainer(loss_type: str) -> None:
    trl_loss, trl_grads = trl_step(loss_type)
    loss, grads = titanium_step(loss_type)
    assert loss == pytest.approx(trl_loss, rel=TOLERANCE)  # (ipo's loss is ~9, its gradients up to ~11: fp32 rounding)
    scale = max(trl_grads[n].abs().max().item() for n in trl_grads)
    assert max((grads[n] - trl_grads[n]).abs().max().item() for n in grads) <= TOLERANCE * scale


def test_pairs_are_ranked_by_reward_the_first_winning_a_tie() -> None:
    chosen = chosen_of_pairs(torch.tensor([1.0, 2.0, 0.5, 0.5, 3.0, -1.0]))
    assert chosen.tolist() == [False, True, True, False, True, False]


PROMPT_JOB = ["--data.kind", "chat", "--data.path", str(REPO / "assets/tasks/arithmetic/train.jsonl")]
ONLINE = ["--training.objective", "online_dpo", *PROMPT_JOB, "--chat.chat_template", "llama3"]
ONLINE += ["--training.seq_len", "64", "--rl.max_prompt_len", "40", "--rl.max_new_tokens", "8"]


def test_the_first_step_starts_from_the_reference(make_trainer, tmp_path) -> None:
    """The reference is the policy as it started: at the first step every log-ratio is 0 and the sigmoid loss is
    exactly log 2; each pair's chosen response has the larger reward (the rows keep them, with the reference's
    log-probs); the policy moves."""
    args = (*ONLINE, "--training.steps", "1", "--training.local_batch_size", "8", "--rl.rewards", "format")
    trainer = make_trainer(*tiny_args(tmp_path, *args, "--rl.temperature", "1.5"))
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result, _, _ = trainer.train_step()
    assert (result.loss_sum / result.units).item() == pytest.approx(math.log(2), abs=1e-6)
    rows = trainer.objective.source.current.rows
    rewards = rows["online_dpo/score"].view(-1, 2)
    chosen = rows["chosen"].view(-1, 2)
    assert (chosen.sum(dim=1) == 1).all()
    assert (rewards[chosen] >= rewards[~chosen]).all()
    assert any(not torch.equal(p, start[n]) for n, p in trainer.model.named_parameters())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--training.local_batch_size", "3"], "online DPO needs whole pairs"),
        (["--online_dpo.loss_type", "simpo"], "--online_dpo.loss_type simpo needs no reference"),
        (["--online_dpo.beta", "0"], "--online_dpo.beta must be > 0"),
        (["--data.kind", "synthetic"], "online_dpo reads prompts"),
    ],
)
def test_bad_online_dpo_configs_are_refused_before_the_run(args: list[str], message: str, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match=message):
        load_config([*ONLINE, *args])
