"""The ppo objective: its bad input (config time, exit code 2), and one short run in the loop whose rollout batch
is checked against the models run independently (scores, values, old log-probs, whitened advantages) and whose
value model trains beside the policy; and a run resumed mid rollout batch equal to the uninterrupted one."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import LOSS_TAG, REPO, scalars, tiny_args, train_until_first_save
from tests.objectives.tiny_hf import debug_model_hf
from titanium.config import load_config
from titanium.config.loader import ConfigError
from titanium.errors import UserError
from titanium.model_builder import ModelBuilder
from titanium.models import get_model_spec
from titanium.models.common.kv_cache import PAD_DOCUMENT
from titanium.models.reward import reward_spec
from titanium.parallel.distributed import shutdown_distributed
from titanium.train import main

TASKS = str(REPO / "assets/tasks/arithmetic/train.jsonl")
PROMPTS = ("--data.kind", "chat", "--data.path", TASKS, "--chat.chat_template", "llama3")


@pytest.fixture(scope="module")
def reward_folder(tmp_path_factory) -> str:
    return debug_model_hf(tmp_path_factory.mktemp("reward") / "hf", scalar=True)


@pytest.fixture(scope="module")
def causal_lm_folder(tmp_path_factory) -> str:
    return debug_model_hf(tmp_path_factory.mktemp("lm") / "hf", scalar=False)


PPO = ["--training.objective", "ppo", *PROMPTS, "--training.seq_len", "64", "--rl.max_prompt_len", "40"]
PPO += ["--rl.max_new_tokens", "8"]
RULE = ("--rl.rewards", "exact_match")
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "2"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ppo.kl_coef", "-1"], "--ppo.kl_coef must be >= 0"),
        (["--ppo.lam", "1.5"], r"--ppo.lam must be in \[0, 1\]"),
        (["--ppo.epsilon", "0"], "--ppo.epsilon must be > 0"),
        (["--ppo.ppo_epochs", "0"], "--ppo.ppo_epochs must be >= 1"),
        (["--rl.max_new_tokens", "32"], "must fit in --training.seq_len 64"),
        (["--validation.interval", "5"], "held-out loss has no meaning for --training.objective ppo"),
        (["--data.kind", "synthetic"], "ppo reads prompts"),
    ],
)
def test_bad_ppo_configs_are_refused(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config([*PPO, *RULE, *args])


@pytest.mark.parametrize("layout", [["--parallelism.context_parallel_degree", "2"], PP2])
def test_context_or_pipeline_parallelism_is_accepted(layout):
    """PPO splits its rollouts over context-parallel ranks, or trains its value model through a pipeline of its own
    (tests/distributed/test_grpo_fsdp.py checks the numbers)."""
    cfg = load_config([*PPO, *RULE, *layout])
    assert cfg.parallelism.context_parallel_degree * cfg.parallelism.pipeline_parallel_degree == 2


def test_a_reward_model_without_a_scalar_head_is_refused(causal_lm_folder, tmp_path):
    """Before any process starts: the reward model named in [rl] rewards by the preflight check (it resolves every
    reward), the value model's folder when the config is read."""
    from titanium.preflight import check_job

    with pytest.raises(UserError, match="--rl.rewards: .* is not a sequence-classification .*no scalar score head"):
        check_job(load_config([*PPO, "--rl.rewards", causal_lm_folder]), world_size=1, device_type="cpu")
    with pytest.raises(ConfigError, match="--ppo.value_model_path .*no readable config.json"):
        load_config([*PPO, *RULE, "--ppo.value_model_path", str(tmp_path)])


def test_ppo_without_rewards_exits_2_with_one_message(tmp_path, capsys):
    assert main(tiny_args(tmp_path, *PPO, "--rl.rewards")) == 2
    err = capsys.readouterr().err
    assert err.startswith("titanium: config error: --rl.rewards is empty; name at least one reward function")
    assert err.count("\n") == 1, err


def _unpadded_scores(model: torch.nn.Module, rows: dict[str, torch.Tensor], prompt_width: int) -> torch.Tensor:
    """Each row's prompt + response alone (no padding, plain causal attention) through ``model``: its per-position
    outputs ``[S_i]``, one row at a time."""
    out = []
    for i in range(rows["tokens"].shape[0]):
        keep = rows["document_ids"][i] != PAD_DOCUMENT  # (left padding)
        length = int(keep[:prompt_width].sum()) + int(rows["response_mask"][i].sum())
        tokens = rows["tokens"][i][keep][:length]
        with torch.no_grad():
            out.append(model(tokens[None]).squeeze(0).squeeze(-1).float())
    return out


def test_a_ppo_run_scores_values_and_trains_both_models(make_trainer, reward_folder, tmp_path):
    """Two optimizer steps on one rollout batch (ppo_epochs 2) with a reward model that also starts the value model.
    The batch's scores are the reward model's at each response's last token, its old values the value model's start
    (the reward model's per-position outputs) where each response token is predicted, its old log-probs the start
    policy's (its KL to the reference 0, its gap to the engine's sampling log-probs within 1e-5), its advantages
    whitened; afterwards policy and value model have moved. With --rl.log_completions 2 the table logged at step 2
    shows the batch's first responses with their scores and KL-penalized rewards."""
    extra = ("--ppo.reward_model_path", reward_folder, "--ppo.ppo_epochs", "2", "--training.steps", "2")
    extra += ("--rl.log_completions", "2", "--rl.log_completions_count", "3")
    trainer = make_trainer(*tiny_args(tmp_path, *PPO, *extra, "--training.local_batch_size", "8"))
    objective = trainer.objective
    start_value = {n: p.detach().clone() for n, p in objective.value.model.named_parameters()}
    start_policy = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    tables = {}
    trainer.metrics.log_table = lambda step, name, table: tables.setdefault((step, name), table)
    trainer.train()
    batch = objective.source.current
    assert batch is not None and batch.served == 2 and batch.version == 0
    rows, mask = batch.rows, batch.rows["response_mask"]
    (key, table), *others = tables.items()
    columns = ("prompt", "completion", reward_folder, "score", "reward")  # (the reward model is one of [rl] rewards)
    assert key == (2, "ppo/completions") and not others and table.columns == columns
    _, _, _, scores, rewards = zip(*table.rows)
    assert list(scores) == rows["ppo/score"][:3].tolist() and list(rewards) == rows["ppo/reward"][:3].tolist()
    width = mask.shape[1]
    prompt_width = rows["tokens"].shape[1] - width
    spec = reward_spec(get_model_spec("llama3"), pad_token_id=objective.source.tokenizer.pad_id)
    reward_model = ModelBuilder(torch.device("cpu")).load_hf(spec, reward_folder, max_seq_len=64).model
    outputs = _unpadded_scores(reward_model, rows, prompt_width)
    for i, out in enumerate(outputs):
        n = int(mask[i].sum())
        assert n > 0
        torch.testing.assert_close(rows["ppo/score"][i], out[-1], rtol=0, atol=1e-5)
        torch.testing.assert_close(rows["old_values"][i, :n], out[-n - 1 : -1], rtol=0, atol=1e-5)
    assert not rows["ppo/kl"].any()  # made by the start policy, which the reference is
    assert 0 <= rows["ppo/logprob_mismatch"].max() <= 1e-5  # the engine's sampling log-probs: its weights synced
    torch.testing.assert_close(rows["old_logprobs"], rows["old_logprobs"] * mask)
    advantages = rows["advantages"][mask].double()
    assert abs(advantages.mean()) < 1e-6 and abs(advantages.std() - 1) < 1e-4
    moved = lambda start, model: max(  # noqa: E731
        (p.detach() - start[n]).abs().max().item() for n, p in model.named_parameters()
    )
    assert moved(start_value, objective.value.model) > 0
    assert moved(start_policy, trainer.model) > 0


def test_the_loop_resumes_a_ppo_run_exactly_mid_batch(make_trainer, tmp_path):
    """5 steps, a rollout batch every 2 (ppo_epochs 2), a checkpoint at step 3: halfway through the second batch. A
    job killed right after it resumes with the batch's saved rows, the value model and its optimizer, and logs the
    same losses and PPO metrics at steps 4 (the batch's second epoch) and 5 (a new batch, sampled from the resumed
    policy) as the run that went straight through, bitwise, and ends with the same policy and value weights."""
    common = tiny_args(
        tmp_path / "run", *PPO, *RULE, "--ppo.ppo_epochs", "2", "--ppo.kl_coef", "0.1", "--training.steps", "5",
        "--checkpoint.enable", "--checkpoint.interval", "3", "--debug.deterministic", "--optimizer.lr", "1e-3",
    )  # fmt: skip
    straight = make_trainer(*common, "--job.dump_folder", str(tmp_path / "straight"))
    straight.train()
    shutdown_distributed()

    resumed_args = (*common, "--job.dump_folder", str(tmp_path / "resumed"))
    train_until_first_save(make_trainer, *resumed_args, at_step=3)
    resumed = make_trainer(*resumed_args)
    batch = resumed.objective.source.current
    assert resumed.train_state.step == 3 and batch is not None and (batch.served, batch.steps_left) == (1, 1)
    resumed.train()
    for tag in (LOSS_TAG, "ppo/value_loss", "ppo/policy_loss", "ppo/score", "ppo/kl"):
        expected, got = scalars(tmp_path / "straight/tb", tag), scalars(tmp_path / "resumed/tb", tag)
        assert [got[s] for s in (4, 5)] == [expected[s] for s in (4, 5)], tag
    assert len({scalars(tmp_path / "straight/tb")[s] for s in range(1, 6)}) == 5
    for want, got in ((straight.model, resumed.model), (straight.objective.value.model, resumed.objective.value.model)):
        for (name, a), b in zip(want.named_parameters(), got.parameters()):
            assert torch.equal(a, b), name


def test_a_guard_skipped_step_changes_neither_the_policy_nor_the_value_model(make_trainer, tmp_path):
    """The loop steps the value model's optimizer with the policy's, under the guard: a step whose loss is not finite
    (--guards.on_nonfinite skip) leaves both models' weights bitwise as they were, and the next finite step moves
    both. (The value model's AdamW used to be stepped in an after-optimizer-step hook, skipped step or not.)"""
    from titanium.objectives.base import LossResult

    args = (*PPO, *RULE, "--guards.on_nonfinite", "skip", "--training.steps", "3", "--training.local_batch_size", "8")
    trainer = make_trainer(*tiny_args(tmp_path, *args))
    objective, loss = trainer.objective, trainer.objective.loss

    def weights() -> dict[str, torch.Tensor]:
        models = {"policy": trainer.model, "value": objective.value.model}
        return {f"{k}.{n}": p.detach().clone() for k, m in models.items() for n, p in m.named_parameters()}

    def changed(before: dict[str, torch.Tensor]) -> set[str]:
        return {name.split(".")[0] for name, value in weights().items() if not torch.equal(value, before[name])}

    trainer.train_step()  # (a finite first step: the value model's gradients and moments exist)
    objective.loss = lambda output, batch: LossResult(loss(output, batch).loss_sum * float("nan"))
    before = weights()
    trainer.train_step()
    assert changed(before) == set()
    assert trainer.guard.check(2) == {"guards/skipped_steps": 1.0}
    objective.loss = loss
    before = weights()
    trainer.train_step()
    assert changed(before) == {"policy", "value"}


def test_ppo_rewards_get_trls_trainer_state(make_trainer, tmp_path):
    """A TRL reward function reading ``trainer_state`` gets, from PPO as from GRPO (both through the rollout source),
    the optimizer steps taken when its responses were sampled and the run's steps: TRL 1.16's GRPOTrainer passes its
    TrainerState, whose global_step is 0 while the first step's batch is scored (transformers counts a step once its
    optimizer step is done). Three steps, a rollout batch each (ppo_epochs 1): 0, 1, 2 of 3."""
    (tmp_path / "state.py").write_text(
        "seen = []\n\n\n"
        "def record(completions, trainer_state, **kwargs):\n"
        "    seen.append((trainer_state.global_step, trainer_state.max_steps))\n"
        "    return [0.0] * len(completions)\n"
    )
    reward = f"{tmp_path}/state.py:record"
    args = (*PPO, "--rl.rewards", reward, "--ppo.ppo_epochs", "1", "--training.steps", "3")
    trainer = make_trainer(*tiny_args(tmp_path / "run", *args))
    trainer.train()
    assert trainer.objective.source.rewards.functions[reward].__globals__["seen"] == [(0, 3), (1, 3), (2, 3)]
