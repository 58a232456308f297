"""GRPO math on fixed tensors against values computed independently, scalar by scalar in plain Python;
and the [grpo] config checks."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from tests.helpers import REPO
from titanium.config import ConfigError, load_config
from titanium.config.sections import GRPOSection, RLSection
from titanium.generation.sampling import token_entropy
from titanium.objectives.grpo import group_advantages
from titanium.objectives.grpo_correction import importance_weights, mismatch_metrics
from titanium.objectives.losses.grpo import (
    aggregate,
    cispo_policy_loss,
    clipped_policy_loss,
    grpo_loss,
    importance_ratio,
    k3_kl,
    loss_mask,
)

REWARDS = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 2.0, 0.0, 1.0, 0.0]  # 3 groups of 4; the middle one all equal


def _expected_advantages(scale: str) -> list[float]:
    out = []
    batch_std = statistics.stdev(REWARDS)
    for g in range(0, len(REWARDS), 4):
        group = REWARDS[g : g + 4]
        mean, std = statistics.fmean(group), statistics.stdev(group)
        divisor = {"group": std + 1e-4, "batch": batch_std + 1e-4, "none": 1.0}[scale]
        out += [(r - mean) / divisor for r in group]
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages(scale: str) -> None:
    got = group_advantages(torch.tensor(REWARDS), 4, scale)
    assert got.tolist() == pytest.approx(_expected_advantages(scale), rel=1e-6, abs=1e-7)
    assert got[4:8].tolist() == [0.0] * 4  # a group of equal rewards teaches nothing


# Two responses of 3 tokens; ratios chosen inside, below and above the clip range of (0.8, 1.28).
RATIOS = [[1.1, 0.5, 1.5], [0.7, 1.3, 1.0]]
ADVANTAGES = [2.0, -1.0]
EPS_LOW, EPS_HIGH = 0.2, 0.28


def _fixed() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.2, -1.5]], dtype=torch.float64)
    return old + torch.tensor(RATIOS, dtype=torch.float64).log(), old, torch.tensor(ADVANTAGES, dtype=torch.float64)


def test_clipped_ratio_values_clip_flags_and_gradients() -> None:
    logprobs, old, adv = _fixed()
    logprobs.requires_grad_(True)
    ratio = importance_ratio(logprobs, old, torch.ones_like(old, dtype=torch.bool), "token")
    loss, low, high = clipped_policy_loss(ratio, adv, EPS_LOW, EPS_HIGH)
    expected, grads = [], []
    for row, a in zip(RATIOS, ADVANTAGES):
        for r in row:
            clipped = min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH)
            expected.append(-min(r * a, clipped * a))
            # d(-r a)/d logprob = -r a where the unclipped term is the minimum; the clipped term is constant.
            grads.append(-r * a if r * a <= clipped * a else 0.0)
    assert loss.flatten().tolist() == pytest.approx(expected, rel=1e-12)
    # Row 0 (A = 2 > 0): 1.5 is above 1.28 -> clipped high; 0.5 below 0.8 is *not* clipped (min picks r A).
    # Row 1 (A = -1 < 0): 0.7 below 0.8 -> clipped low; 1.3 above is not.
    assert high.tolist() == [[False, False, True], [False, False, False]]
    assert low.tolist() == [[False, False, False], [True, False, False]]
    loss.sum().backward()
    assert logprobs.grad.flatten().tolist() == pytest.approx(grads, rel=1e-12)


def test_k3_kl() -> None:
    logprobs = torch.tensor([-1.0, -2.0, -0.3, -4.0], dtype=torch.float64)
    ref = torch.tensor([-1.0, -1.5, -0.9, -6.0], dtype=torch.float64)
    expected = [math.exp(r - p) - (r - p) - 1 for p, r in zip(logprobs.tolist(), ref.tolist())]
    got = k3_kl(logprobs, ref)
    assert got.tolist() == pytest.approx(expected, rel=1e-12) and got[0] == 0 and (got >= 0).all()


PER_TOKEN = [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0], [7.0, 0.0, 0.0, 0.0]]
MASK = [[True, True, True, True], [True, True, False, False], [False, False, False, False]]


def test_aggregation_by_loss_type() -> None:
    per_token, mask = torch.tensor(PER_TOKEN), torch.tensor(MASK)
    tokens = 1 + 2 + 3 + 4 + 5 + 6
    expected = {  # loss type -> (loss sum, units); 3 responses of width 4, max_new_tokens 5
        "dapo": (tokens, 6),
        "cispo": (tokens, 6),
        "grpo": ((1 + 2 + 3 + 4) / 4 + (5 + 6) / 2, 3),  # the fully masked response counts (TRL's mean over rows)
        "gspo": ((1 + 2 + 3 + 4) / 4 + (5 + 6) / 2, 3),
        "dr_grpo": (tokens, 3 * 5),
        "bnpo": (tokens / 6, 1),  # the microbatch's token mean, one unit
    }
    for loss_type, (loss_sum, units) in expected.items():
        got_sum, got_units = aggregate(per_token, mask, loss_type, 5)
        assert (got_sum.item(), got_units.item()) == (pytest.approx(loss_sum), units), loss_type


def test_aggregation_over_microbatches_gives_the_whole_batch_value() -> None:
    """The loop divides summed losses by summed units: for the global normalizers (dapo, grpo, dr_grpo) any split
    of the responses gives the whole batch's loss; bnpo is the mean of the microbatches' token means."""
    g = torch.Generator().manual_seed(0)
    per_token = torch.rand(6, 5, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.3
    splits = (slice(0, 1), slice(1, 4), slice(4, 6))
    for loss_type in ("dapo", "grpo", "dr_grpo"):
        whole = aggregate(per_token, mask, loss_type, 7)
        parts = [aggregate(per_token[s], mask[s], loss_type, 7) for s in splits]
        split = sum(p[0] for p in parts) / sum(p[1] for p in parts)
        assert split.item() == pytest.approx((whole[0] / whole[1]).item(), rel=1e-6), loss_type
    rows = [[v for v, m in zip(pr, mr) if m] for pr, mr in zip(per_token.tolist(), mask.tolist())]
    token_mean = sum(map(sum, rows)) / sum(map(len, rows))
    sequence_mean = statistics.fmean(statistics.fmean(r) if r else 0.0 for r in rows)
    loss_sum, units = aggregate(per_token, mask, "dapo", 7)
    assert (loss_sum / units).item() == pytest.approx(token_mean, rel=1e-6)
    loss_sum, units = aggregate(per_token, mask, "grpo", 7)
    assert (loss_sum / units).item() == pytest.approx(sequence_mean, rel=1e-6)
    parts = [aggregate(per_token[s], mask[s], "bnpo", 7) for s in splits]
    means = [sum(v for r in rows[s] for v in r) / max(sum(len(r) for r in rows[s]), 1) for s in splits]
    bnpo = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    assert bnpo.item() == pytest.approx(statistics.fmean(means), rel=1e-6)


def test_sequence_ratio_is_the_geometric_mean_of_the_masked_token_ratios() -> None:
    logprobs, old, _ = _fixed()
    mask = torch.tensor([[True, True, True], [True, False, False]])
    ratio = importance_ratio(logprobs, old, mask, "sequence")
    expected = [math.prod(RATIOS[0]) ** (1 / 3), RATIOS[1][0]]
    assert ratio.shape == (2, 1) and ratio.flatten().tolist() == pytest.approx(expected, rel=1e-12)


def test_two_sided_clipping_bounds_the_push_on_negative_advantages() -> None:
    """delta caps the unclipped term: for A < 0 and a ratio above delta the loss is -A delta, constant in the ratio."""
    ratio = torch.tensor([[3.0, 1.1, 3.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([-1.0], dtype=torch.float64)
    loss, _, _ = clipped_policy_loss(ratio, adv, EPS_LOW, EPS_HIGH, delta=2.0)
    assert loss.flatten().tolist() == pytest.approx([2.0, 1.1, 2.0])
    loss.sum().backward()
    assert ratio.grad.flatten().tolist() == pytest.approx([0.0, 1.0, 0.0])
    plain, _, _ = clipped_policy_loss(ratio.detach(), adv, EPS_LOW, EPS_HIGH)
    assert plain.flatten().tolist() == pytest.approx([3.0, 1.1, 3.0])


def test_cispo_caps_the_weight_without_cutting_the_gradient() -> None:
    logprobs, old, adv = _fixed()
    logprobs.requires_grad_(True)
    ratio = importance_ratio(logprobs, old, torch.ones_like(old, dtype=torch.bool), "token")
    loss, capped = cispo_policy_loss(ratio, logprobs, adv, cap=1.2)
    weights = [[min(r, 1.2) for r in row] for row in RATIOS]
    expected = [
        -w * a * lp for row_w, a, row_lp in zip(weights, ADVANTAGES, logprobs.tolist()) for w, lp in zip(row_w, row_lp)
    ]
    assert loss.flatten().tolist() == pytest.approx(expected, rel=1e-12)
    assert capped.tolist() == [[False, False, True], [False, False, False]]  # r > 1.2 with A > 0 (row 1 has A < 0)
    loss.sum().backward()  # d/d logprob = -min(r, cap) A: the weight is a constant, every token keeps a gradient
    grads = [-w * a for row_w, a in zip(weights, ADVANTAGES) for w in row_w]
    assert logprobs.grad.flatten().tolist() == pytest.approx(grads, rel=1e-12)


def test_truncated_responses_masked_only_when_asked() -> None:
    generated = torch.tensor([[True, True, False], [True, True, True]])
    finished = torch.tensor([True, False])
    assert torch.equal(loss_mask(generated, finished, mask_truncated=False), generated)
    assert loss_mask(generated, finished, mask_truncated=True).tolist() == [[True, True, False], [False] * 3]


def test_grpo_loss_combines_policy_loss_kl_and_metrics() -> None:
    logprobs, old, adv = _fixed()
    ref = old - 0.1
    mask = torch.tensor([[True, True, True], [True, True, False]])
    cfg = GRPOSection(epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, beta=0.04, loss_type="grpo")
    loss_sum, units, metrics = grpo_loss(logprobs, old, adv, mask, cfg, ref)
    per_token, _, _ = clipped_policy_loss(torch.exp(logprobs - old), adv, EPS_LOW, EPS_HIGH)
    kl = [[math.exp(r - p) - (r - p) - 1 for p, r in zip(pr, rr)] for pr, rr in zip(logprobs.tolist(), ref.tolist())]
    rows = [[per_token[i, t].item() + 0.04 * kl[i][t] for t in range(3) if mask[i, t]] for i in range(2)]
    assert loss_sum.item() == pytest.approx(sum(statistics.fmean(r) for r in rows), rel=1e-12)
    assert units.item() == 2
    assert {k: v.item() for k, v in metrics.items()} == pytest.approx(
        {"tokens": 5, "clipped_low": 1, "clipped_high": 1, "kl": sum(kl[0]) + kl[1][0] + kl[1][1]}
    )
    with pytest.raises(ValueError, match="reference"):
        grpo_loss(logprobs, old, adv, mask, cfg)
    _, _, no_kl = grpo_loss(logprobs, old, adv, mask, GRPOSection())
    assert "kl" not in no_kl


def test_token_entropy() -> None:
    probs = [[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]]
    logits = torch.tensor(probs).log() * 2.0  # temperature 2 undoes the factor
    expected = [-sum(p * math.log(p) for p in row) for row in probs]
    assert token_entropy(logits, temperature=2.0).tolist() == pytest.approx(expected, rel=1e-6)


GRPO_JOB = [
    "--training.objective", "grpo",
    "--data.kind", "chat", "--data.path", "assets/tasks/arithmetic/train.jsonl",
    "--training.local_batch_size", "16", "--rl.max_prompt_len", "64",
]  # fmt: skip

CP2, TP2 = ("--parallelism.context_parallel_degree", "2"), ("--parallelism.tensor_parallel_degree", "2")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--grpo.group_size", "1"], "--grpo.group_size must be >= 2"),
        (["--rl.temperature", "0"], "--rl.temperature must be > 0"),
        (["--rl.top_p", "0"], "--rl.top_p must be in (0, 1]"),
        (["--rl.top_k", "-1"], "--rl.top_k must be >= 0"),
        (["--grpo.epsilon_low", "1"], "--grpo.epsilon_low must be in [0, 1)"),
        (["--grpo.beta", "-0.1"], "--grpo.beta must be >= 0"),
        (["--grpo.delta", "1"], "--grpo.delta must be > 1"),
        (["--grpo.delta", "2", "--grpo.loss_type", "cispo"], "--grpo.loss_type cispo has none"),
        (["--grpo.cispo_cap", "0"], "--grpo.cispo_cap must be > 0"),
        (["--grpo.is_correction", "token_mask"], "it needs --grpo.old_logprobs recompute"),
        (["--grpo.is_cap_min", "3"], "need 0 <= is_cap_min < is_cap"),
        ([*GRPO_JOB, "--rollout.engine", "vllm", "--rl.top_k", "20"], "set --grpo.old_logprobs recompute"),
        ([*GRPO_JOB, "--rollout.engine", "vllm", "--rl.top_p", "0.9"], "set --grpo.old_logprobs recompute"),
        ([*GRPO_JOB, "--rollout.engine", "vllm", "--rollout.compile"], "vLLM compiles its own"),
        ([*GRPO_JOB, "--rollout.tensor_parallel_size", "2"], "set it to 1 (a whole copy per rank) or 1"),
        ([*GRPO_JOB, "--rollout.mode", "server"], "--rollout.mode server starts vLLM in processes of its own"),
        (["--rollout.gpu_memory_utilization", "0"], "--rollout.gpu_memory_utilization must be in (0, 1]"),
        ([*GRPO_JOB, "--lora.rank", "4", "--lora.dropout", "0.1"], "set --lora.dropout 0"),
        (["--grpo.ppo_epochs", "0"], "--grpo.ppo_epochs must be >= 1"),
        (["--rl.max_policy_lag", "-1"], "--rl.max_policy_lag must be >= 0"),
        (["--rl.reward_weights", "1", "2"], "has 2 weights for 1 reward functions"),
        (["--rl.dynamic_sampling_max_rounds", "0"], "--rl.dynamic_sampling_max_rounds must be >= 1"),
        (["--rl.rewards", "overlong"], "set overlong_buffer in 1..256, got 0"),
        (["--rl.rewards", "overlong", "--rl.overlong_buffer", "300"], "set overlong_buffer in 1..256, got 300"),
        (["--rl.overlong_buffer", "16"], "add overlong to --rl.rewards"),
        (["--rl.log_completions", "-1"], "--rl.log_completions must be >= 0"),
        (
            ["--rl.rewards", "assets/rm", "--rl.reward_model_layout", "sharded", "--rl.dynamic_sampling"],
            "use reward_model_layout whole",
        ),
        (
            [
                "--rl.rewards",
                "assets/rm",
                "--rl.reward_model_layout",
                "sharded",
                "--rl.reward_model_tokenizer",
                "own",
            ],
            "--rl.reward_model_tokenizer own needs reward_model_layout whole",
        ),
        (
            [
                "--rl.rewards",
                "assets/rm",
                "--rl.reward_model_layout",
                "sharded",
                "--rl.reward_model_dtype",
                "bfloat16",
            ],
            "a sharded one runs in the training's precision",
        ),
        (["--rl.log_completions_count", "0"], "--rl.log_completions_count must be >= 1"),
        ([*GRPO_JOB, "--data.kind", "synthetic"], "--training.objective grpo reads prompts"),
        ([*GRPO_JOB, "--training.local_batch_size", "12"], "must be a multiple of --grpo.group_size 8"),
        ([*GRPO_JOB, "--rl.max_new_tokens", "200", "--training.seq_len", "256"], "must fit in --training.seq_len"),
        (
            [
                *GRPO_JOB,
                "--rl.dynamic_sampling",
                "--fault_tolerance.enable",
                "--fault_tolerance.lighthouse",
                "http://h:1",
            ],
            "--fault_tolerance.enable with --rl.dynamic_sampling",
        ),
        ([*GRPO_JOB, "--training.loss_chunk_size", "1024"], "not to --training.objective grpo"),
        ([*GRPO_JOB, "--validation.interval", "10"], "held-out loss has no meaning for --training.objective grpo"),
    ],
)
def test_bad_grpo_config_is_reported(args: list[str], message: str, monkeypatch) -> None:
    """[grpo], [rl] and [rollout] are checked in a job that reads them (a GRPO job)."""
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError) as err:
        load_config(args if "--training.objective" in args else [*GRPO_JOB, *args])
    assert message in str(err.value)


def test_settings_no_part_of_the_job_reads_are_named(monkeypatch, caplog) -> None:
    """A pretraining job with [rollout] / [grpo] settings runs without them: a warning names the first of each, and
    the saved config.toml leaves the sections of other objectives out."""
    from titanium.config import to_toml_dict

    monkeypatch.chdir(REPO)
    cfg = load_config(["--rollout.engine", "vllm", "--grpo.group_size", "1", "--dpo.beta", "0"])
    assert "--rollout.engine is not read: [rollout] is read by --training.objective grpo, online_dpo" in caplog.text
    assert "--grpo.group_size is not read" in caplog.text and "--dpo.beta is not read" in caplog.text
    saved = to_toml_dict(cfg)
    assert not {"rollout", "grpo", "dpo", "rl", "sft", "ppo"} & set(saved) and {"training", "lora"} <= set(saved)
    assert {"grpo", "rl", "rollout", "environment"} <= set(to_toml_dict(load_config(GRPO_JOB)))


def test_sharding_reward_models_needs_one_named() -> None:
    from titanium.rl.source import sharded_reward_models

    assert sharded_reward_models(RLSection(rewards=["exact_match"]), None, 0, 64, 64) == {}  # (layout whole)
    with pytest.raises(ConfigError, match="--rl.rewards names no reward model folder to shard"):
        sharded_reward_models(RLSection(rewards=["exact_match"], reward_model_layout="sharded"), None, 0, 64, 64)


def test_grpo_runs_under_context_parallelism_with_tensor_and_pipeline_parallelism(monkeypatch) -> None:
    """Each, and all three at once, is checked against one process (tests/distributed/test_grpo_fsdp.py)."""
    monkeypatch.chdir(REPO)
    pp2 = ("--parallelism.pipeline_parallel_degree", "2")
    for layout in (TP2, pp2, (*TP2, *pp2)):
        cfg = load_config([*GRPO_JOB, *CP2, *layout])
        assert cfg.parallelism.context_parallel_degree == 2


def test_grpo_defaults_follow_the_papers_and_trl() -> None:
    g = GRPOSection()
    assert (g.group_size, RLSection().temperature, g.epsilon_low, g.epsilon_high, g.beta) == (8, 1.0, 0.2, 0.2, 0.0)
    assert (g.scale_rewards, g.loss_type, g.ppo_epochs, g.mask_truncated, g.delta) == ("group", "dapo", 1, False, None)


def test_importance_weights_by_hand_and_unscored_tokens() -> None:
    """exp(old - sampling) per token, or its product over a response; a NaN engine log-prob counts as no gap."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.2, -1.5]], dtype=torch.float64)
    sampling = old - torch.tensor([[0.5, -0.5, float("nan")], [1.5, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    token = importance_weights(old, sampling, mask, "token_truncate", cap_max=2.0, cap_min=0.7)
    expected = [[min(math.exp(0.5), 2.0), max(math.exp(-0.5), 0.7), 1.0], [2.0, 1.0, 1.0]]
    torch.testing.assert_close(token, torch.tensor(expected, dtype=torch.float64))
    masked = importance_weights(old, sampling, mask, "token_mask", cap_max=2.0, cap_min=0.7)
    torch.testing.assert_close(masked, torch.tensor([[math.exp(0.5), 0.0, 1.0], [0.0, 1.0, 1.0]], dtype=torch.float64))
    sequence = importance_weights(old, sampling, mask, "sequence_truncate", cap_max=10.0)
    torch.testing.assert_close(sequence, torch.tensor([[1.0], [math.exp(1.5)]], dtype=torch.float64))
    assert importance_weights(old, sampling, mask, "sequence_mask", cap_max=4.0).tolist() == [[1.0], [0.0]]
    means, maxima, minima = mismatch_metrics(old, sampling, mask, token)
    assert means["grpo/logprob_mismatch"][0].item() == pytest.approx(0.5 + 0.5 + 1.5)
    assert means["grpo/logprob_mismatch"][1].item() == 5
    assert maxima["grpo/logprob_mismatch_max"].item() == 1.5 and minima["grpo/is_weight_min"].item() == 0.7
    assert means["grpo/is_changed"][0].item() == 2  # the 0.61 raised to 0.7 and the 4.48 cut to 2
