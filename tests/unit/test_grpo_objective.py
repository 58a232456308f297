"""The GRPO objective on a tiny model in one process: what it serves step by step (ppo_epochs x minibatches,
policy lag), its loss against values computed independently, its metrics, and its checkpoint state."""

from __future__ import annotations

import copy
import dataclasses
import logging
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import (
    LOSS_TAG,
    REPO,
    LocalModels,
    scalars,
    split_sections,
    texts,
    tiny_args,
    train_until_first_save,
)
from titanium.config.sections import ChatSection, DataSection, GRPOSection, RLSection
from titanium.data.tokenizer import DEFAULT_TOKENIZER_PATH, TiktokenTokenizer
from titanium.generation.generate import Generation
from titanium.models.llama3 import LLAMA3_FLAVORS, Transformer
from titanium.objectives.base import LossResult, ModelOutput, ObjectiveContext, Prepared
from titanium.objectives.grpo import GRPOObjective
from titanium.parallel.distributed import shutdown_distributed
from titanium.rl.buffer import RolloutBatch, RolloutQueue
from titanium.rl.rollout import Rollout, rollout, to_rollout
from titanium.rl.source import NO_BATCH, rollout_seed

GROUP = 4
CPU = torch.device("cpu")
TASKS = str(REPO / "assets/tasks/arithmetic/train.jsonl")


def characters(completion: str, answer: str | None, row: Mapping[str, Any]) -> float:
    """A reward that tells responses of a random model apart."""
    return len(completion) / 10


@pytest.fixture(scope="module")
def tokenizer() -> TiktokenTokenizer:
    return TiktokenTokenizer(str(REPO / DEFAULT_TOKENIZER_PATH))


def _args(vocab_size: int) -> Any:
    return dataclasses.replace(
        LLAMA3_FLAVORS["debugmodel"], n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=vocab_size, max_seq_len=64
    )


def _model(vocab_size: int) -> Transformer:
    model = Transformer(_args(vocab_size))
    model.init_weights(seed=0)
    return model.train()


def _objective(
    tokenizer,
    model: Transformer,
    local_batch_size: int = 8,
    stop_every: int = 4,
    device: torch.device = CPU,
    **grpo: Any,
) -> GRPOObjective:
    """A GRPO objective as the loop builds it, lending ``model`` (on ``device``) as the policy and a copy of it as
    the reference."""
    reference = copy.deepcopy(model).requires_grad_(False)
    ctx = ObjectiveContext(
        tokenizer=tokenizer,
        model_name="llama3",
        chat_format="llama3",
        vocab_size=tokenizer.vocab_size,
        seq_len=64,
        local_batch_size=local_batch_size,
        dp_rank=0,
        dp_world=1,
        seed=0,
        models=LocalModels(lambda: reference, policy=model, policy_args=_args(tokenizer.vocab_size)),
        chat=ChatSection("llama3"),
        device=device,
    )
    settings = {"group_size": GROUP, "max_new_tokens": 6, "max_prompt_len": 40, "rewards": [f"{__name__}:characters"]}
    cfg, rl = split_sections({**settings, **grpo}, GRPOSection, RLSection)
    objective = GRPOObjective(ctx, DataSection(kind="chat", path=TASKS), cfg, rl)
    objective.source.engine.stop_ids = set(range(0, tokenizer.vocab_size, stop_every))  # some end before max_new_tokens
    return objective


def _steps(objective: GRPOObjective, steps: int, microbatches: int = 1) -> tuple[list[Prepared], list[int]]:
    """Serve ``steps`` steps (no training in between, but the engine follows the weights after each step as the
    loop makes it): each step's microbatches, and the steps that generated."""
    served, generated = [], []
    made = objective.source.batches_made
    for step in range(1, steps + 1):
        served.append(objective.prepare([objective.next_microbatch() for _ in range(microbatches)]))
        objective.source.policy.updated(objective.source.version)
        if objective.source.batches_made != made:
            generated.append(step)
            made = objective.source.batches_made
    return served, generated


def _means(prepared: Prepared, result: LossResult | None = None) -> dict[str, float]:
    """The step's metrics as the loop shows them (sum / count), from prepare and from the loss."""
    metrics = {**prepared.metrics, **(result.metrics if result is not None else {})}
    return {name: total.item() / count.item() for name, (total, count) in metrics.items()}


def test_a_rollout_batch_serves_ppo_epochs_x_minibatches_steps(tokenizer) -> None:
    objective = _objective(tokenizer, _model(tokenizer.vocab_size), ppo_epochs=2, minibatches=2)
    served, generated = _steps(objective, 8, microbatches=2)
    assert generated == [1, 5]  # one batch per 2 x 2 steps
    batch = objective.source.current
    assert batch is not None and batch.rows["tokens"].shape[0] == 2 * 8 * 2  # microbatches x responses x minibatches
    first = torch.cat([mb.tokens for mb in served[0].batches])
    second = torch.cat([mb.tokens for mb in served[1].batches])
    assert first.shape[0] == second.shape[0] == 16 and not torch.equal(first, second)  # the two minibatches
    assert torch.equal(torch.cat([mb.tokens for mb in served[2].batches]), first)  # epoch 2: the same again
    assert torch.equal(torch.cat([mb.tokens for mb in served[3].batches]), second)
    lags = [_means(step)["grpo/policy_lag"] for step in served]
    assert lags == [0, 1, 2, 3, 0, 1, 2, 3]  # each step on the same rollouts is one update further from them
    assert "grpo/gen_tokens_per_s" in served[0].metrics and "grpo/gen_tokens_per_s" not in served[1].metrics


LAG_CASES = [(1, [0, 1, 1, 2, 1, 2], [1, 2, 4, 6]), (2, [0, 1, 2, 3, 2, 3], [1, 3, 5])]


@pytest.mark.parametrize("max_lag, lags, generated", LAG_CASES)
def test_bounded_policy_lag_makes_the_next_batch_while_this_one_trains(tokenizer, max_lag, lags, generated) -> None:
    """minibatches 2: a batch serves 2 steps. Its successor is made as early as its lag at first use allows."""
    objective = _objective(tokenizer, _model(tokenizer.vocab_size), minibatches=2, max_policy_lag=max_lag)
    served, made_at = _steps(objective, 6)
    assert [_means(step)["grpo/policy_lag"] for step in served] == lags
    assert made_at == generated
    first_uses = [lag for i, lag in enumerate(lags) if i % 2 == 0][1:]
    assert max(first_uses) == max_lag and objective.source.queue.dropped == 0


def test_a_queued_batch_older_than_the_lag_is_dropped_and_counted() -> None:
    queue = RolloutQueue(max_lag=1)
    rows = {"tokens": torch.zeros(8, 3)}
    for version in (0, 2, 3):
        queue.put(RolloutBatch(rows, version=version, minibatches=1, epochs=1))
    batch = queue.pop_fresh(version=3)  # lags 3 and 1: the first is dropped
    assert batch is not None and batch.version == 2 and queue.dropped == 8
    batch = queue.pop_fresh(version=5)
    assert batch is None and queue.dropped == 16 and len(queue) == 0


def _independent_advantages(rewards: list[float]) -> list[float]:
    out = []
    for g in range(0, len(rewards), GROUP):
        group = rewards[g : g + GROUP]
        out += [(r - statistics.fmean(group)) / (statistics.stdev(group) + 1e-4) for r in group]
    return out


def test_loss_and_metrics_of_the_first_step_equal_independent_values(tokenizer) -> None:
    """Before any update the ratio is 1 and the reference is the policy: the token-mode loss is -sum_i A_i n_i
    (n_i: response i's tokens), clip fraction and KL are 0, and the metrics are plain means of the rollouts."""
    model = _model(tokenizer.vocab_size)
    objective = _objective(tokenizer, model, local_batch_size=8, beta=0.1)
    prepared = objective.prepare([objective.next_microbatch()])
    (microbatch,) = prepared.batches
    rows = objective.source.current.rows
    rewards = rows["grpo/reward"].tolist()
    lengths = rows["loss_mask"].sum(dim=1)
    assert 0 < lengths.min() < lengths.max() == 6, "degenerate test: responses should differ in length"
    advantages = _independent_advantages(rewards)
    assert rows["advantages"].tolist() == pytest.approx(advantages, rel=1e-5, abs=1e-6)

    logits = model(**microbatch.model_inputs())
    result = objective.loss(ModelOutput(logits=logits), microbatch)
    expected = -sum(a * float(n) for a, n in zip(advantages, lengths))
    assert result.loss_sum.item() == pytest.approx(expected, rel=1e-4, abs=1e-4)
    assert microbatch.units().item() == lengths.sum().item()
    metrics = _means(prepared, result)
    assert metrics["grpo/reward"] == pytest.approx(statistics.fmean(rewards), rel=1e-6)
    assert metrics["grpo/response_len"] == pytest.approx(lengths.float().mean().item())
    assert metrics["grpo/clip_frac"] == 0 and metrics["grpo/kl"] == pytest.approx(0, abs=1e-6)
    group_stds = [statistics.stdev(rewards[g : g + GROUP]) for g in range(0, len(rewards), GROUP)]
    assert metrics["grpo/reward_std"] == pytest.approx(statistics.fmean(group_stds), rel=1e-5)
    assert metrics["grpo/reward/characters"] == pytest.approx(metrics["grpo/reward"])
    responses = [row[: int(n)] for row, n in zip(microbatch.tokens[:, -6:].tolist(), lengths)]
    truncated = [not any(t in objective.source.engine.stop_ids for t in response) for response in responses]
    assert metrics["grpo/truncated"] == pytest.approx(statistics.fmean(truncated))
    assert 0 < metrics["grpo/entropy"] <= torch.log(torch.tensor(float(tokenizer.vocab_size))).item()
    assert metrics["grpo/gen_tokens_per_s"] > 0
    result.loss_sum.backward()
    assert model.output.weight.grad.abs().sum() > 0


def test_after_an_update_the_ratio_clip_and_kl_follow_the_formulas(tokenizer) -> None:
    """The second epoch on the same rollouts sees the updated policy: the loss equals the clipped objective
    plus beta x k3 KL, computed here in float64 from the updated model's logits and the stored log-probs."""
    model = _model(tokenizer.vocab_size)
    beta, eps = 0.1, 0.05
    objective = _objective(tokenizer, model, beta=beta, ppo_epochs=2, epsilon_low=eps, epsilon_high=eps)
    (first,) = objective.prepare([objective.next_microbatch()]).batches
    objective.loss(ModelOutput(logits=model(**first.model_inputs())), first).loss_sum.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad.sign() * 1e-2  # a large enough step that some ratios leave [1 - eps, 1 + eps]
    (second,) = objective.prepare([objective.next_microbatch()]).batches
    assert torch.equal(second.tokens, first.tokens)
    logits = model(**second.model_inputs())
    result = objective.loss(ModelOutput(logits=logits), second)

    fields = second.fields
    width = fields.old_logprobs.shape[1]
    logp = torch.log_softmax(logits[:, -width - 1 : -1].double(), dim=-1)
    logp = logp.gather(-1, second.tokens[:, -width:, None]).squeeze(-1)
    mask, adv = fields.loss_mask, fields.advantages.double()
    ratio = torch.exp(logp - fields.old_logprobs.double())
    policy = -torch.minimum(ratio * adv[:, None], ratio.clamp(1 - eps, 1 + eps) * adv[:, None])
    log_ref_ratio = fields.ref_logprobs.double() - logp
    kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
    expected = ((policy + beta * kl) * mask).sum().item()
    assert result.loss_sum.item() == pytest.approx(expected, rel=1e-5)
    clipped = (((ratio < 1 - eps) & (adv[:, None] < 0)) | ((ratio > 1 + eps) & (adv[:, None] > 0))) & mask
    total, count = result.metrics["grpo/clip_frac"]
    assert 0 < total.item() == clipped.sum().item() and count.item() == mask.sum().item()
    assert result.metrics["grpo/kl"][0].item() == pytest.approx((kl * mask).sum().item(), rel=1e-4)


def test_truncated_responses_masked_and_sequence_units(tokenizer) -> None:
    model = _model(tokenizer.vocab_size)
    objective = _objective(tokenizer, model, stop_every=16, mask_truncated=True, loss_type="grpo")
    (microbatch,) = objective.prepare([objective.next_microbatch()]).batches
    finished = objective.source.current.rows["grpo/truncated"] == 0
    assert finished.any() and not finished.all(), "degenerate test"
    mask = microbatch.fields.loss_mask
    assert not mask[~finished].any() and mask[finished].any(dim=1).all()
    assert microbatch.units().item() == len(finished)  # units: every response, masked ones too (TRL)


def test_resume_mid_batch_trains_on_the_saved_rows_then_goes_on(tokenizer) -> None:
    """The checkpoint holds the batch being served (its rows, as far as served) and the prompt position after it:
    a resumed objective serves the rest of that batch as saved, then makes the next one from the same prompts with
    the same seed (the same tokens, as long as the policy is the same): the uninterrupted run's steps exactly."""
    model = _model(tokenizer.vocab_size)
    straight = _objective(tokenizer, model, minibatches=2)
    served, _ = _steps(straight, 4)
    resumed = _objective(tokenizer, model, minibatches=2)
    _steps(resumed, 1)
    state = resumed.state_dict()  # mid-batch: the batch made at step 1 is in flight
    assert state["in_flight"] and state["batches_made"] == 1
    again = _objective(tokenizer, model, minibatches=2)
    again.load_state_dict(state)
    replay, generated = _steps(again, 3)
    assert generated == [2]  # (the straight run's step 3)
    for got, want in zip(replay, served[1:]):
        assert torch.equal(got.batches[0].tokens, want.batches[0].tokens)
        assert torch.equal(got.batches[0].fields.advantages, want.batches[0].fields.advantages)
    at_boundary = straight.state_dict()  # after step 4 the second batch is used up
    assert at_boundary["batches_made"] == 2 and at_boundary["prompts"] == straight.source.prompts.state_dict()
    assert at_boundary["in_flight"] == NO_BATCH


def test_accuracy_and_rewards_of_known_responses(tokenizer) -> None:
    """Responses made to order (the reference answer, or not) through the same rollout assembly: exact-match
    reward and accuracy count the right ones."""
    model = _model(tokenizer.vocab_size)
    objective = _objective(tokenizer, model, rewards=["exact_match", "format"], reward_weights=[1.0, 0.5])
    eot = [tokenizer.special_tokens["<|eot_id|>"]]

    def answer_every_other(samples, index) -> tuple[Rollout, int]:
        responses = []
        for sample in samples:
            for j in range(GROUP):
                text = sample.answer if j % 2 == 0 else sample.answer + "0"
                responses.append(tokenizer.encode(text, bos=False, eos=False) + eot)
        width = max(len(r) for r in responses)
        tokens = torch.tensor([r + [tokenizer.pad_id] * (width - len(r)) for r in responses])
        lengths = torch.tensor([len(r) for r in responses])
        out = Generation(tokens, torch.zeros(tokens.shape), lengths, torch.ones(len(responses), dtype=torch.bool))
        return to_rollout(samples, GROUP, out, objective.source.rewards, tokenizer), 0

    objective.source.sample = answer_every_other
    prepared = objective.prepare([objective.next_microbatch()])
    (microbatch,) = prepared.batches
    result = objective.loss(ModelOutput(logits=model(**microbatch.model_inputs())), microbatch)
    metrics = _means(prepared, result)
    assert metrics["grpo/accuracy"] == metrics["grpo/reward/exact_match"] == 0.5
    assert metrics["grpo/reward/format"] == 0 and metrics["grpo/reward"] == 0.5
    advantages = microbatch.fields.advantages
    assert advantages[0::2].gt(0).all() and advantages[1::2].lt(0).all()


GRPO_JOB = (
    "--training.objective", "grpo",
    "--data.kind", "chat", "--data.path", TASKS, "--chat.chat_template", "llama3",
    "--grpo.group_size", "4", "--rl.max_new_tokens", "6", "--rl.max_prompt_len", "40",
    "--rl.rewards", f"{__name__}:characters", "--grpo.minibatches", "2",
    "--training.local_batch_size", "8", "--optimizer.lr", "1e-4",
)  # fmt: skip


def test_the_loop_resumes_a_grpo_run_exactly_where_a_rollout_batch_ends(make_trainer, tmp_path) -> None:
    """6 steps, a rollout batch every 2 (minibatches 2), checkpoints at 2 and 4; a job killed right after its
    step-4 checkpoint resumes from the prompt position and sampling seed of the batch of steps 5-6 and logs
    the same losses and rewards as the run that went straight through."""
    common = (*GRPO_JOB, "--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "2")
    common = (*common, "--debug.deterministic")
    make_trainer(*tiny_args(tmp_path / "straight", *common)).train()
    shutdown_distributed()

    train_until_first_save(make_trainer, *tiny_args(tmp_path / "resumed", *common), at_step=4)
    resumed = make_trainer(*tiny_args(tmp_path / "resumed", *common))
    assert resumed.train_state.step == 4 and resumed.objective.source.batches_made == 2
    resumed.train()
    for tag in (LOSS_TAG, "grpo/reward"):
        expected, got = scalars(tmp_path / "straight/tb", tag), scalars(tmp_path / "resumed/tb", tag)
        assert [got[s] for s in (5, 6)] == [expected[s] for s in (5, 6)], tag
    assert len({expected[s] for s in range(1, 7)}) > 1


def test_a_step_retried_under_fault_tolerance_trains_on_the_same_rollouts(make_trainer, tmp_path) -> None:
    """A step the replica groups do not commit is run again on the same prepared microbatches: prepare (which
    serves the next minibatch of rollouts, and counts policy versions) is not repeated, so the run logs what an
    uninterrupted one does."""
    common = (*GRPO_JOB, "--training.steps", "3", "--debug.deterministic")
    make_trainer(*tiny_args(tmp_path / "straight", *common)).train()
    shutdown_distributed()

    retried = make_trainer(*tiny_args(tmp_path / "retried", *common))
    votes = iter([False])  # the first vote fails (a group died mid-step), every later one commits
    retried.fault_tolerance.commit_gradients = lambda model: next(votes, True)
    retried.train()
    assert retried.objective.source.version == 3
    for tag in (LOSS_TAG, "grpo/reward"):
        expected, got = scalars(tmp_path / "straight/tb", tag), scalars(tmp_path / "retried/tb", tag)
        assert got == expected, tag


def test_a_group_that_heals_under_fault_tolerance_trains_on_as_if_it_had_never_stopped(make_trainer, tmp_path) -> None:
    """A replica group that rejoins takes a live peer's weights, optimizer, schedule and step (here the straight
    run's at step 4, read from its checkpoint) in its first quorum, with its own prompt stream still at the start: it
    skips the 2 rollout batches' prompts (and sampling seeds) it missed and its engine takes the healed weights, so
    its steps 5-6 are the straight run's, bitwise. Without the skip it would train on batch 0's prompts; without the
    sync its engine would sample from the initial weights."""
    common = (*GRPO_JOB, "--training.steps", "6", "--debug.deterministic")
    saving = ("--checkpoint.enable", "--checkpoint.interval", "4")
    make_trainer(*tiny_args(tmp_path / "straight", *common, *saving)).train()
    shutdown_distributed()

    healed = make_trainer(*tiny_args(tmp_path / "healed", *common))
    peer = tmp_path / "straight/checkpoint/step-4"
    start_step = healed.fault_tolerance.start_step

    def heal_in_the_first_quorum() -> None:
        start_step()
        if healed.train_state.step == 0:
            healed.checkpointer._load(peer, ["model", "optimizer", "lr_scheduler", "train_state"])
            healed._healed(4, 4)

    healed.fault_tolerance.start_step = heal_in_the_first_quorum
    healed.train()
    assert healed.objective.source.batches_made == 3
    for tag in (LOSS_TAG, "grpo/reward", "grpo/response_len"):
        expected, got = scalars(tmp_path / "straight/tb", tag), scalars(tmp_path / "healed/tb", tag)
        assert sorted(got) == [5, 6] and [got[s] for s in (5, 6)] == [expected[s] for s in (5, 6)], tag


def test_a_group_that_heals_mid_run_drops_the_batch_its_generation_thread_made(make_trainer, tmp_path, caplog):
    """With a policy lag of 1 a live group has the next batch on its generation thread when it heals (here after its
    own step 2, to another run's step 4): that batch is dropped (its prompts go back), the stream skips to the
    batch an uninterrupted group starts at step 5, and that batch is made from the healed weights (lag 0 at step
    5), the next one ahead again (lag 1 at step 6)."""
    common = (*GRPO_JOB, "--training.steps", "6", "--rl.max_policy_lag", "1")
    make_trainer(*tiny_args(tmp_path / "peer", *common, "--checkpoint.enable", "--checkpoint.interval", "4")).train()
    shutdown_distributed()

    healed = make_trainer(*tiny_args(tmp_path / "healed", *common))
    start_step = healed.fault_tolerance.start_step

    def heal_after_step_2() -> None:
        start_step()
        if healed.train_state.step == 2:
            healed.checkpointer._load(
                tmp_path / "peer/checkpoint/step-4", ["model", "optimizer", "lr_scheduler", "train_state"]
            )
            healed._healed(2, 4)

    healed.fault_tolerance.start_step = heal_after_step_2
    with caplog.at_level(logging.INFO, logger="titanium"):
        healed.train()
    assert "skipped 4 prompts (1 rollout batches)" in caplog.text  # (batch 1, in flight, went back; 2 is next)
    lag = scalars(tmp_path / "healed/tb", "grpo/policy_lag")
    assert lag == {1: 0.0, 2: 1.0, 5: 0.0, 6: 1.0} and healed.objective.source.batches_made == 4


def test_log_completions_shows_the_batchs_rollouts_with_their_rewards_and_advantages(make_trainer, tmp_path, caplog):
    """--rl.log_completions 2: after steps 2 and 4 (not 1 or 3) a table of the first group of the batch trained on
    goes to TensorBoard and to the console. Each row's reward is its own completion's (the ``characters`` reward:
    length / 10) and the advantages are the group's rewards standardized, ``(r - mean) / (std + 1e-4)``."""
    args = (*GRPO_JOB, "--training.steps", "4", "--rl.log_completions", "2", "--rl.log_completions_count", "4")
    trainer = make_trainer(*tiny_args(tmp_path, *args))
    logged: dict[int, Any] = {}
    log_table = trainer.metrics.log_table
    trainer.metrics.log_table = lambda step, name, table: (
        logged.setdefault(step, table) and log_table(step, name, table)
    )
    with caplog.at_level(logging.INFO, logger="titanium"):
        trainer.train()
    assert sorted(logged) == [2, 4]
    for step, table in logged.items():
        assert table.columns == ("prompt", "completion", f"{__name__}:characters", "reward", "advantage")
        prompts, completions, rewards, totals, advantages = zip(*table.rows)
        assert len(set(prompts)) == 1 and f'"content":"{prompts[0]}"' in Path(TASKS).read_text()  # as written
        assert (
            [round(r, 5) for r in rewards]
            == [round(len(c) / 10, 5) for c in completions]
            == [round(t, 5) for t in totals]
        )
        r = torch.tensor(totals)
        assert torch.allclose(torch.tensor(advantages), (r - r.mean()) / (r.std() + 1e-4), atol=1e-5)
        assert f"grpo/completions at step {step}:" in caplog.text
    assert sorted(texts(tmp_path / "tb", "grpo/completions")) == [2, 4]


def test_engine_rollouts_equal_sampling_from_the_live_model(tokenizer) -> None:
    """The titanium engine with lag 0 makes, batch by batch, exactly the rollouts that sampling from the live model
    with the same seed makes (same tokens, same old log-probs, bitwise), before and after an update: its copy holds
    the synced weights and draws from a generator seeded alike. Equal rows give equal losses."""
    model = _model(tokenizer.vocab_size)
    objective = _objective(tokenizer, model)
    prompts = _objective(tokenizer, model).source._next_prompts(4 * 2)  # the same prompt stream: 2 batches of 2 prompts
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(2):
        (microbatch,) = objective.prepare([objective.next_microbatch()]).batches
        generator = torch.Generator().manual_seed(rollout_seed(0, 0, step))
        with torch.no_grad():
            live = rollout(
                model,
                prompts[2 * step : 2 * step + 2],
                GROUP,
                objective.source.params,
                objective.source.rewards,
                tokenizer,
                objective.source.engine.stop_ids,
                generator=generator,
            )
        assert torch.equal(microbatch.tokens, live.tokens)
        assert torch.equal(microbatch.fields.old_logprobs, live.old_logprobs)
        objective.loss(ModelOutput(logits=model(**microbatch.model_inputs())), microbatch).loss_sum.backward()
        optimizer.step()
        optimizer.zero_grad()
        objective.source.policy.updated(step + 1)  # the loop's after_optimizer_step


@pytest.mark.parametrize("synced", [True, False])
def test_recomputed_old_logprobs_measure_the_engine_gap_and_a_skipped_sync(tokenizer, synced) -> None:
    """old_logprobs recompute: the trained policy's forward gives the old log-probs, the engine's are kept for the
    importance weights. After a large update the synced engine agrees with the trainer (gap ~1e-7, weights 1); an
    engine that missed the sync samples from the old weights, and the gap shows it."""
    model = _model(tokenizer.vocab_size)
    objective = _objective(tokenizer, model, old_logprobs="recompute", is_correction="token_truncate", is_cap=2.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    (microbatch,) = objective.prepare([objective.next_microbatch()]).batches
    objective.loss(ModelOutput(logits=model(**microbatch.model_inputs())), microbatch).loss_sum.backward()
    optimizer.step()
    if synced:
        objective.source.policy.updated(1)
    prepared = objective.prepare([objective.next_microbatch()])
    metrics = _means(prepared)
    (microbatch,) = prepared.batches
    if synced:
        assert metrics["grpo/logprob_mismatch_max"] < 1e-5
        assert metrics["grpo/is_weight"] == pytest.approx(1, abs=1e-5) and metrics["grpo/is_changed"] == 0
    else:
        assert metrics["grpo/logprob_mismatch"] > 1e-2
        assert metrics["grpo/is_weight_max"] <= 2.0 and abs(metrics["grpo/is_weight"] - 1) > 1e-3
    weights = microbatch.fields.is_weights
    assert weights is not None and weights.shape == microbatch.fields.old_logprobs.shape
    parts = {name.split("/")[-1] for name in prepared.metrics if name.startswith("grpo/time/")}
    assert parts == {"generate", "wait", "old_logprobs", *(("sync", "train") if synced else ())}


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_microbatches_narrowed_to_the_columns_they_use_give_the_full_width_loss_and_gradients(
    tokenizer, loss_type
) -> None:
    """--rl.pad_to longest vs seq_len on the same rollouts (4 microbatches of one prompt's group each, responses
    of 1 to 12 tokens): narrower microbatches, the same old and reference log-probs (recomputed, with importance
    weights) where responses are, and the same loss, units, metrics and gradients (fp32, 1e-6)."""
    model = _model(tokenizer.vocab_size)
    settings = {"beta": 0.1, "old_logprobs": "recompute", "is_correction": "token_truncate", "loss_type": loss_type}
    results = {}
    for pad_to in ("seq_len", "longest"):
        objective = _objective(tokenizer, model, 4, stop_every=8, max_new_tokens=12, pad_to=pad_to, **settings)
        prepared = objective.prepare([objective.next_microbatch() for _ in range(4)])
        model.zero_grad()
        loss, units, metrics = torch.zeros(()), torch.zeros(()), {}
        for batch in prepared.batches:
            result = objective.loss(ModelOutput(logits=model(**batch.model_inputs())), batch)
            loss, units = loss + result.loss_sum, units + batch.units()
            for name, (total, count) in result.metrics.items():
                metrics[name] = metrics.get(name, 0) + total.detach() / count
        (loss / units).backward()
        logprobs = [(b.fields.old_logprobs, b.fields.ref_logprobs, b.fields.loss_mask) for b in prepared.batches]
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        widths = [b.tokens.shape[1] for b in prepared.batches]
        results[pad_to] = (widths, loss.detach() / units, units, metrics, logprobs, grads)
    (full, full_loss, full_units, full_metrics, full_logprobs, full_grads) = results["seq_len"]
    (short, loss, units, metrics, logprobs, grads) = results["longest"]
    assert len(set(full)) == 1 and max(short) <= full[0] and min(short) < full[0], (full, short)
    assert units == full_units and torch.isfinite(loss)
    torch.testing.assert_close(loss, full_loss, rtol=0, atol=1e-6)
    for name, value in metrics.items():
        torch.testing.assert_close(value, full_metrics[name], rtol=0, atol=1e-6, msg=name)
    for (old, ref, mask), (full_old, full_ref, full_mask) in zip(logprobs, full_logprobs):
        width = mask.shape[1]
        assert torch.equal(mask, full_mask[:, :width]) and not full_mask[:, width:].any()
        torch.testing.assert_close(old * mask, full_old[:, :width] * mask, rtol=0, atol=1e-6)
        torch.testing.assert_close(ref * mask, full_ref[:, :width] * mask, rtol=0, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, full_grads[name], rtol=0, atol=1e-6, msg=name)
