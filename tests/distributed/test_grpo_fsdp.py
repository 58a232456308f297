"""GRPO under FSDP, TP, PP, CP, two of them and all three on gloo: 2, 4 or 8 processes train as one process does,
given the same rollouts; and rollouts sampled by the titanium engine synced from the sharded policy through the
real loop.

The layout runs (tests/objectives/fixed_rollouts.py) replace sampling by responses fixed in advance (sampling draws
differ between layouts); the rest is the real objective, engine and weight sync included (under TP 2 the engine is
split over the tp ranks, ``--rollout.tensor_parallel_size 2``, and its log-probs are the loss's old ones). Each step
trains on 16 responses (4 prompts x group 4) in 2 microbatches; every rollout batch serves 2 minibatches. Per-step
losses must agree to 1e-5 relative and grad norms to 2e-4 (tests/distributed/parity.py says why), and the reduced
metrics to 1e-5. Two configurations cover the options: token aggregation with a KL-penalized frozen reference,
batch-scaled rewards, 2 PPO epochs and a tight clip (so tokens get clipped); sequence aggregation with truncated
responses masked, a policy lag of 1 and old log-probs recomputed by the trained policy with importance weights
(under PP: the pipeline's forward, broadcast from the last stage; under CP: each rank's part of every row, the
response log-probs completed over the context-parallel group). On 4 processes, in the launch the layout tests share
(conftest.py's ``four_process_runs``), the second configuration runs under CP 2 x TP 2 (its engines split over the
tp ranks, gathered and compared with the run's Hugging Face export, bitwise) and the first under CP 2 x PP 2. PPO
rides in the same launches: on fixed responses too, one process against FSDP 2, TP 2 and CP 2, and a TP 2 run
resumed from a checkpoint taken mid rollout batch. Every job of a process count runs in one launch
(tests/distributed/jobs_worker.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.parity import STEPS, Run, assert_matches, layout_runs
from tests.helpers import run_train, scalar_tags, scalars, tiny_args
from tests.objectives.synced_engine import assert_engines_hold_the_export

GRPO = (
    "--training.objective", "grpo",
    "--data.kind", "chat", "--data.path", "assets/tasks/arithmetic/train.jsonl",
    "--chat.chat_template", "llama3",
    "--data.shards", "2",  # one process reads the file's 2 byte ranges in turn, 2 DP ranks one each: same prompts
    "--grpo.group_size", "4", "--rl.max_new_tokens", "8", "--rl.max_prompt_len", "40",
    "--grpo.minibatches", "2",
    "--training.global_batch_size", "16",
    "--optimizer.lr", "3e-4",
)  # fmt: skip
FIXED = ("--rl.rewards", "tests.objectives.fixed_rollouts:characters")
CONFIGS = {
    "kl_batch_epochs": (
        "--grpo.beta", "0.05", "--grpo.scale_rewards", "batch", "--grpo.ppo_epochs", "2",
        "--grpo.epsilon_low", "0.01", "--grpo.epsilon_high", "0.01",
    ),
    "sequence_masked_lag": (
        "--grpo.loss_type", "grpo", "--grpo.mask_truncated", "--rl.max_policy_lag", "1",
        "--grpo.old_logprobs", "recompute", "--grpo.is_correction", "sequence_truncate",
    ),
}  # fmt: skip
METRICS = ("grpo/reward", "grpo/reward_std", "grpo/response_len", "grpo/entropy", "grpo/clip_frac", "grpo/policy_lag")
PP2 = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2")
TP2, CP2 = ("--parallelism.tensor_parallel_degree", "2"), ("--parallelism.context_parallel_degree", "2")
SPLIT_ENGINE = ("--rollout.tensor_parallel_size", "2")  # (the engine split over the tp ranks: generation/tp_plan.py)
LAYOUTS = {  # processes, what the layout adds
    "single": (1, ("--training.local_batch_size", "8")),
    "fsdp2": (2, ("--training.local_batch_size", "4")),
    "tp2": (2, ("--training.local_batch_size", "8", *TP2, *SPLIT_ENGINE)),
    "pp2": (2, ("--training.local_batch_size", "8", *PP2)),
    "cp2": (2, ("--training.local_batch_size", "8", *CP2)),
}
FOUR_PROCESS = {  # one configuration each, in the shared 4-process launch (conftest.py's four_process_runs)
    "sequence_masked_lag_cp2_tp2": (
        *GRPO, *FIXED, *CONFIGS["sequence_masked_lag"], "--training.local_batch_size", "8", *CP2, *TP2,
        *SPLIT_ENGINE, "--checkpoint.last_save_in_hf",  # (its engine's weights, gathered, are compared with the export)
    ),
    "kl_batch_epochs_cp2_pp2": (
        *GRPO, *FIXED, *CONFIGS["kl_batch_epochs"], "--training.local_batch_size", "8", *CP2, *PP2,
    ),
    "kl_batch_epochs_tp2_pp2": (
        *GRPO, *FIXED, *CONFIGS["kl_batch_epochs"], "--training.local_batch_size", "8", *TP2, *PP2,
    ),
}  # fmt: skip
EIGHT_PROCESS = {  # all three at once, the engine split over the tp ranks (a launch of its own: 50 s here)
    "sequence_masked_lag_cp2_tp2_pp2": (
        *GRPO, *FIXED, *CONFIGS["sequence_masked_lag"], "--training.local_batch_size", "8", *CP2, *TP2, *PP2,
        *SPLIT_ENGINE,
    ),
}  # fmt: skip


PPO = (
    "--training.objective", "ppo",
    "--data.kind", "chat", "--data.path", "assets/tasks/arithmetic/train.jsonl",
    "--chat.chat_template", "llama3", "--data.shards", "2",
    "--rl.max_new_tokens", "8", "--rl.max_prompt_len", "40", "--rl.temperature", "0.7",
    "--rl.rewards", "tests.objectives.fixed_rollouts:characters", "--ppo.kl_coef", "0.1", "--ppo.ppo_epochs", "2",
    "--ppo.epsilon", "0.01", "--ppo.value_clip", "0.05",  # (tight clips, so tokens get clipped)
    "--training.global_batch_size", "16", "--training.local_batch_size", "8",
    "--optimizer.lr", "3e-4", "--ppo.value_lr", "1e-3",
)  # fmt: skip


def reward_model_jobs(reward: str) -> dict[str, tuple[int, tuple[str, ...]]]:
    """name -> (processes, job): GRPO with a reward model (the folder ``reward``) beside the characters reward,
    held whole by one process, and sharded under FSDP 2 and under TP 2 (``--rl.reward_model_layout sharded``)."""
    job = (
        *GRPO,
        *CONFIGS["sequence_masked_lag"],
        "--rl.rewards",
        FIXED[1],
        reward,
        "--rl.reward_weights",
        "1",
        "3",
    )
    sharded = ("--rl.reward_model_layout", "sharded")
    return {
        "rm_single": (1, (*job, *LAYOUTS["single"][1])),
        "rm_fsdp2": (2, (*job, *LAYOUTS["fsdp2"][1], *sharded)),
        "rm_tp2": (2, (*job, *LAYOUTS["tp2"][1], *sharded)),
    }


def ppo_jobs(tmp: Path) -> dict[str, tuple[int, tuple[str, ...]]]:
    """name -> (processes, what the job adds): one process; FSDP 2; CP 2; TP 2 and PP 2, each saving at step 3 (in
    the rollout batch of steps 3-4, after its first epoch); each again, resuming the same run folder from that
    checkpoint (its own TensorBoard folder): it runs steps 4 and 5."""
    saving = ("--checkpoint.enable", "--checkpoint.interval", "3")
    layouts = {"tp2": ("--parallelism.tensor_parallel_degree", "2", *saving), "pp2": (*PP2, *saving)}
    jobs = {
        "ppo_single": (1, ()),
        "ppo_fsdp2": (2, ("--training.local_batch_size", "4")),
        "ppo_cp2": (2, ("--parallelism.context_parallel_degree", "2")),
    }
    for layout, extra in layouts.items():
        resume = ("--job.dump_folder", str(tmp / f"ppo_{layout}"), "--checkpoint.load_step", "3")
        tb = ("--metrics.save_tb_folder", str(tmp / f"ppo_{layout}_resumed/tb"))
        jobs[f"ppo_{layout}"] = (2, extra)
        jobs[f"ppo_{layout}_resumed"] = (2, (*extra, *resume, *tb))
    return jobs


PPO_METRICS = ("ppo/score", "ppo/reward", "ppo/kl", "ppo/value_loss", "ppo/policy_loss", "ppo/clip_frac")
PPO_METRICS += ("ppo/value_clip_frac", "ppo/approx_kl", "ppo/entropy")


def four_process_jobs(reward: str) -> dict[str, tuple[str, ...]]:
    """The 4-process jobs (conftest.py's shared launch): GRPO's (``FOUR_PROCESS``) and PPO under CP 2 x PP 2 with
    the reward model in ``reward``."""
    ppo = (*PPO, "--ppo.reward_model_path", reward)
    return {**FOUR_PROCESS, "ppo_cp2_pp2": (*ppo, *CP2, *PP2), "ppo_tp2_pp2": (*ppo, *TP2, *PP2)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, scalar_model_folder) -> dict[str, tuple[Run, dict[str, dict[int, float]]]]:
    """``config_layout`` -> ((losses, grad norms), {metric: by step}) of every job, one launch per process count;
    the PPO jobs (``ppo_<layout>``) ride in the same launches."""
    out, reward = {}, scalar_model_folder
    for nproc in (1, 2):
        tmp = tmp_path_factory.mktemp(f"grpo_{nproc}")
        jobs = {
            f"{config}_{layout}": (*GRPO, *FIXED, *CONFIGS[config], *extra)
            for config in CONFIGS
            for layout, (n, extra) in LAYOUTS.items()
            if n == nproc
        }
        for name, (n, extra) in ppo_jobs(tmp).items():
            if n == nproc:
                jobs[name] = (*PPO, "--ppo.reward_model_path", reward, *extra)
        jobs.update({name: job for name, (n, job) in reward_model_jobs(reward).items() if n == nproc})
        done = layout_runs(tmp, nproc, jobs, data=(), module="tests.objectives.fixed_rollouts")
        out.update({name: (run, job_metrics(tmp / name)) for name, run in done.items()})
    return out


def job_metrics(folder: Path) -> dict[str, dict[int, float]]:
    """The metrics a job in ``folder`` is checked on, by step (its name tells GRPO's configuration or PPO)."""
    name = folder.name
    tags = METRICS + (("grpo/kl",) if name.startswith("kl_") else ("grpo/logprob_mismatch_max",))
    tags = PPO_METRICS if name.startswith("ppo_") else tags
    if name.startswith("rm_"):  # (and each reward function's own: grpo/reward/<its name>, the folder's path)
        tags += tuple(t for t in scalar_tags(folder / "tb") if t.startswith("grpo/reward/"))
    return {tag: scalars(folder / "tb", tag) for tag in tags}


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "pp2", "cp2"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_grpo_step_equals_one_process(runs, config, layout) -> None:
    assert_grpo_matches(*runs[f"{config}_{layout}"], *runs[f"{config}_single"], config)


@pytest.mark.parametrize("layout", ["fsdp2", "tp2"])
def test_grpo_with_a_sharded_reward_model_equals_one_process_with_it_whole(runs, layout) -> None:
    """A reward model built under the training plan (FSDP 2, TP 2) and scored on the loop's thread gives one
    process's rewards (its unsharded copy scoring where responses are made), so the same losses, grad norms and
    metrics; the reward model's own metric is compared too, and it moves the total."""
    run, metrics = runs[f"rm_{layout}"]
    assert_grpo_matches(run, metrics, *runs["rm_single"], "sequence_masked_lag")  # (every metric: grpo/reward/*)
    (model,) = [
        tag for tag in metrics if tag.startswith("grpo/reward/") and tag != "grpo/reward/" + FIXED[1].rpartition(":")[2]
    ]
    assert len(set(metrics[model].values())) > 1 and max(abs(v) for v in metrics[model].values()) > 1e-3


@pytest.mark.parametrize("name", sorted(FOUR_PROCESS))
def test_grpo_under_two_parallelisms_at_once(runs, four_process_runs, name) -> None:
    """Context parallelism over 2 ranks with tensor parallelism over 2 (the loss's vocabulary-sharded logits
    picked at this rank's response positions on each shard) or with a 2-stage pipeline, and tensor parallelism over
    2 with a 2-stage pipeline: one process's losses, grad norms and metrics. Under cp2 x tp2 every rank's engine,
    synced from the trained layout, also holds the run's Hugging Face export bitwise after the last step."""
    (run, folder), config = four_process_runs[name], name.rsplit("_", 2)[0]
    assert_grpo_matches(run, job_metrics(folder), *runs[f"{config}_single"], config)
    if "--checkpoint.last_save_in_hf" in FOUR_PROCESS[name]:
        assert_engines_hold_the_export(folder, 4, version=STEPS)


def test_grpo_under_context_tensor_and_pipeline_parallelism_at_once(runs, tmp_path) -> None:
    """8 processes, CP 2 x TP 2 x PP 2 (the engine split over the tp ranks): one process's losses, grad norms and
    metrics."""
    ((name, run),) = layout_runs(tmp_path, 8, EIGHT_PROCESS, data=(), module="tests.objectives.fixed_rollouts").items()
    config = name.rsplit("_", 3)[0]
    assert_grpo_matches(run, job_metrics(tmp_path / name), *runs[f"{config}_single"], config)


def assert_grpo_matches(run: Run, metrics: dict, ref_run: Run, ref_metrics: dict, config: str) -> None:
    """A layout's GRPO job against one process's: losses and grad norms (parity.py), the metrics (1e-5, or 1e-7
    absolute), the engine/trainer gap (recomputed), and that it trains."""
    assert_matches(run, ref_run)
    for tag, values in metrics.items():
        if tag == "grpo/logprob_mismatch_max":  # of the batches first used (steps 1, 3, 5); recomputed then, so
            assert sorted(values) == [1, 3, 5] and values[1] < 1e-4, values  # only the first is on the same weights
            assert min(values[3], values[5]) > 1e-3, values  # (the others: one update later than the engine's)
            continue
        assert sorted(values) == list(range(1, STEPS + 1)), tag
        for step, value in values.items():
            assert value == pytest.approx(ref_metrics[tag][step], rel=1e-5, abs=1e-7), (tag, step, values)
    if config == "kl_batch_epochs":
        assert max(metrics["grpo/clip_frac"].values()) > 0 and max(metrics["grpo/kl"].values()) > 0
    else:
        assert metrics["grpo/policy_lag"][3] == 1  # the batch made at step 2 is first trained on at step 3
    losses = run[0]
    assert len(set(losses.values())) == STEPS  # it trains (each step a different loss)


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "cp2", "pp2", "cp2_pp2", "tp2_pp2"])
def test_ppo_step_equals_one_process(runs, four_process_runs, layout) -> None:
    """PPO on fixed responses with a reward model (which also starts the value model) under FSDP, TP, CP or PP over 2
    processes, and CP 2 x PP 2 and TP 2 x PP 2 over 4: the policy, the reference, the reward model and the value
    model each under the plan (under TP the one-output heads kept whole; under CP each rank's part of every row:
    log-probs and values completed over the group, each score added from the rank holding the last token; under PP
    the value model trained through a pipeline schedule of its own, the last stage's log-probs, values and scores
    shared). Losses, the policy's grad norms and every PPO metric (scores, KL, the value loss: the value model
    trains alike; clip fractions) equal one process's at every step (1e-5 / 2e-4; pp2 measured 3e-7 relative on
    the losses)."""
    if layout.endswith("_pp2"):  # (4 processes)
        run, folder = four_process_runs[f"ppo_{layout}"]
        metrics = job_metrics(folder)
    else:
        run, metrics = runs[f"ppo_{layout}"]
    ref_run, ref_metrics = runs["ppo_single"]
    assert_matches(run, ref_run)
    for tag, values in metrics.items():
        assert sorted(values) == list(range(1, STEPS + 1)), tag
        for step, value in values.items():
            assert value == pytest.approx(ref_metrics[tag][step], rel=1e-5, abs=1e-5), (tag, step, values)
    assert len(set(run[0].values())) == STEPS and min(metrics["ppo/kl"].values()) < 0
    assert max(metrics["ppo/clip_frac"].values()) > 0 and max(metrics["ppo/value_clip_frac"].values()) > 0


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_ppo_resumes_exactly(runs, layout) -> None:
    """The TP 2 or PP 2 job started from the other's step-3 checkpoint (the policy, the value model and both
    optimizers sharded as they train) logs its steps 4 (the in-flight batch's second epoch, from the saved rows) and
    5 (a new batch) bitwise as the job that went straight through."""
    (run, metrics), (straight, straight_metrics) = runs[f"ppo_{layout}_resumed"], runs[f"ppo_{layout}"]
    assert run[0] == {step: straight[0][step] for step in (4, 5)}
    for tag, values in metrics.items():
        assert values == {step: straight_metrics[tag][step] for step in (4, 5)}, tag


def test_engine_follows_the_sharded_policy_through_the_loop(tmp_path) -> None:
    """Real sampling under FSDP by the titanium engine: each rank generates its own prompts alone from its synced
    copy, a batch per step, at a large learning rate (Adam, 1e-2: one step moves log-probs by far more than 1e-4).
    The trained policy's recomputed log-probs of every batch equal the engine's: the loop's after-optimizer-step
    hook synced the engine (without it steps 2 and 3 would sample from stale weights), and the step-time
    breakdown is logged."""
    out = tmp_path / "sampled"
    args = tiny_args(
        out, *GRPO, "--training.steps", "3", "--training.local_batch_size", "4", "--grpo.minibatches", "1",
        "--training.global_batch_size", "8", "--optimizer.lr", "1e-2", "--grpo.old_logprobs", "recompute",
        "--rl.rewards", "tests.objectives.fixed_rollouts:characters",
    )  # fmt: skip
    run_train(args, nproc=2)
    lengths = scalars(out / "tb", "grpo/response_len")
    assert sorted(lengths) == [1, 2, 3] and all(0 < n <= 8 for n in lengths.values())
    assert scalars(out / "tb", "grpo/gen_tokens_per_s")[1] > 0
    mismatch = scalars(out / "tb", "grpo/logprob_mismatch_max")
    assert sorted(mismatch) == [1, 2, 3] and max(mismatch.values()) < 1e-4, mismatch
    for part in ("generate", "old_logprobs", "sync", "train"):
        assert scalars(out / "tb", f"grpo/time/{part}")[2] > 0, part
