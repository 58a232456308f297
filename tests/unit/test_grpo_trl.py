"""Every GRPO loss variant against a real ``trl.GRPOTrainer`` on identical rollouts: loss and gradients.

Both sides score the same fixed rollouts (prompts left-padded, responses of different lengths, three of them
truncated) with twin tiny Hugging Face Llamas: TRL through ``GRPOTrainer.compute_loss``, titanium through
``token_logprobs`` of the model's logits and ``grpo_loss``, divided the loop's way (the step's loss sums over the
step's units). Old and reference log-probs are the policy's own perturbed by fixed noise, so ratios spread over
roughly [0.4, 2.5] and every clip, cap and delta bites.

Layouts: one process and one micro-batch; and 2 data-parallel ranks x 2 accumulation steps, where TRL's step loss is
the mean over ranks (what DDP's gradient average does) of each rank's micro-batch losses, with
``current_gradient_accumulation_steps`` = 2 and ``num_processes`` = 2 as its training loop would set them, and
titanium's is the sum of the four micro-batches' loss sums over the sum of their units.

``python -m tests.unit.test_grpo_trl`` prints the equality table of docs/post_training.md.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.objectives.tiny_hf import BOS, EOS, tiny_llama, word_tokenizer
from titanium.config.sections import GRPOSection
from titanium.generation.sampling import token_logprobs
from titanium.objectives.grpo import group_advantages
from titanium.objectives.grpo_correction import importance_weights, mismatch_metrics
from titanium.objectives.losses.grpo import grpo_loss, loss_mask

GROUP, WIDTH, TEMPERATURE = 4, 6, 0.7
PROMPTS = [[BOS, 5, 6, 7], [BOS, 11, 12]]
LENGTHS = [6, 3, 6, 2, 6, 5, 1, 4]  # the three of WIDTH tokens have no EOS: truncated
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 0.25]
EPS_LOW, EPS_HIGH, BETA = 0.2, 0.28, 0.04
TOLERANCE = 1e-6

# name -> (titanium [grpo] options, TRL GRPOConfig options)
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "dapo": ({"loss_type": "dapo"}, {"loss_type": "dapo"}),
    "grpo": ({"loss_type": "grpo"}, {"loss_type": "grpo"}),
    "dr_grpo": ({"loss_type": "dr_grpo"}, {"loss_type": "dr_grpo"}),
    "bnpo": ({"loss_type": "bnpo"}, {"loss_type": "bnpo"}),
    "gspo": ({"loss_type": "gspo"}, {"loss_type": "grpo", "importance_sampling_level": "sequence"}),
    "cispo": ({"loss_type": "cispo", "cispo_cap": 1.5}, {"loss_type": "cispo", "epsilon_high": 1.5}),
    "grpo_delta": ({"loss_type": "grpo", "delta": 1.5}, {"loss_type": "grpo", "delta": 1.5}),
    "dapo_delta": ({"loss_type": "dapo", "delta": 1.5}, {"loss_type": "dapo", "delta": 1.5}),
}
# case -> (beta, mask_truncated, titanium options, TRL options)
CASES: dict[str, tuple[float, bool, dict[str, Any], dict[str, Any]]] = {
    "plain": (0.0, False, {}, {}),
    "kl_masked": (BETA, True, {"kl_bias_correction": False}, {"use_bias_correction_kl": False}),
    "kl_corrected": (BETA, False, {"kl_bias_correction": True}, {"use_bias_correction_kl": True}),
}
LAYOUTS = {"1x1": (1, 1), "dp2_accum2": (2, 2)}  # (data-parallel ranks, accumulation steps)


def rollouts() -> dict[str, torch.Tensor]:
    """TRL's batch layout: ``prompt_ids`` left-padded with ``prompt_mask``, ``completion_ids`` right-padded with
    ``completion_mask``; ``finished`` says which responses ended with EOS."""
    g = torch.Generator().manual_seed(0)
    width = max(map(len, PROMPTS))
    prompt_ids, prompt_mask, completions, completion_mask = [], [], [], []
    for row, length in enumerate(LENGTHS):
        prompt = PROMPTS[row // GROUP]
        prompt_ids.append([0] * (width - len(prompt)) + prompt)
        prompt_mask.append([0] * (width - len(prompt)) + [1] * len(prompt))
        tokens = torch.randint(3, 48, (WIDTH,), generator=g).tolist()
        if length < WIDTH:
            tokens[length - 1] = EOS
            tokens[length:] = [0] * (WIDTH - length)
        completions.append(tokens)
        completion_mask.append([1] * length + [0] * (WIDTH - length))
    return {
        "prompt_ids": torch.tensor(prompt_ids),
        "prompt_mask": torch.tensor(prompt_mask),
        "completion_ids": torch.tensor(completions),
        "completion_mask": torch.tensor(completion_mask),
        "finished": torch.tensor([n < WIDTH for n in LENGTHS]),
        "advantages": group_advantages(torch.tensor(REWARDS), GROUP),
    }


def forward_logprobs(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """titanium's convention on the model's logits: ``log_softmax(logits / T)`` at the response tokens."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logits = model(input_ids=ids, attention_mask=attention).logits
    return token_logprobs(logits[:, -WIDTH - 1 : -1], batch["completion_ids"], TEMPERATURE)


@functools.cache
def with_old_and_ref(mask_truncated: bool) -> dict[str, torch.Tensor]:
    """The rollouts with its loss mask (truncated responses out if asked, as TRL zeroes their completion mask) and
    fixed old / reference log-probs: the policy's own plus noise."""
    batch = rollouts()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        logprobs = forward_logprobs(tiny_llama(0), batch)
    mask = loss_mask(batch["completion_mask"].bool(), batch["finished"], mask_truncated)
    return {
        **batch,
        "completion_mask": mask.long(),
        "old_per_token_logps": logprobs + 0.3 * torch.randn(logprobs.shape, generator=g),
        "ref_per_token_logps": logprobs + 0.1 * torch.randn(logprobs.shape, generator=g),
        "num_items_in_batch": mask.sum(),
    }


def chunks(batch: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """``parts`` equal micro-batches of rows (the scalar ``num_items_in_batch`` stays the whole batch's)."""
    rows = len(LENGTHS) // parts
    return [{k: v if v.dim() == 0 else v[i * rows : (i + 1) * rows] for k, v in batch.items()} for i in range(parts)]


def titanium_step(cfg: GRPOSection, batch: dict[str, torch.Tensor], parts: int) -> tuple[float, dict, dict]:
    """The loop's rule: sum of the micro-batches' loss sums / sum of their units; then one backward."""
    model = tiny_llama(0)
    sums, units, metrics = [], [], []
    for part in chunks(batch, parts):
        logprobs = forward_logprobs(model, part)
        mask = part["completion_mask"].bool()
        loss_sum, n, m = grpo_loss(
            logprobs,
            part["old_per_token_logps"],
            part["advantages"],
            mask,
            cfg,
            part["ref_per_token_logps"],
            max_new_tokens=WIDTH,
        )
        sums.append(loss_sum)
        units.append(n)
        metrics.append(m)
    loss = torch.stack(sums).sum() / torch.stack(units).sum()
    loss.backward()
    totals = {k: sum(m[k] for m in metrics).item() for k in metrics[0]}
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, totals


@contextlib.contextmanager
def trl_processes(trainer: Any, n: int) -> Iterator[None]:
    """Make ``trainer`` believe it is one of ``n`` data-parallel processes (only its loss normalizers read it)."""
    accelerator = type(trainer.accelerator)
    original = accelerator.num_processes
    accelerator.num_processes = property(lambda self: n)
    try:
        yield
    finally:
        accelerator.num_processes = original


def trl_trainer(options: dict[str, Any], ranks: int = 1, accumulation: int = 1, reward: Any = None) -> Any:
    """A real ``GRPOTrainer`` around the tiny Llama (its dataset is never read: no generation runs)."""
    pytest.importorskip("trl", reason="pip install 'trl>=1.16,<2' (in the dev extra) to compare with TRL")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    config = {"epsilon": EPS_LOW, "epsilon_high": EPS_HIGH, **options}
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        report_to=[],
        use_cpu=True,
        bf16=False,
        num_generations=GROUP,
        per_device_train_batch_size=len(LENGTHS) // (ranks * accumulation),
        gradient_accumulation_steps=accumulation,
        max_completion_length=WIDTH,
        temperature=TEMPERATURE,
        beta=0.0,  # > 0 would load a reference model by name; the reference log-probs are inputs here
        **config,
    )
    data = Dataset.from_dict({"prompt": ["t5 t6"] * GROUP})
    reward = reward or (lambda completions, **_: [0.0] * len(completions))
    trainer = GRPOTrainer(
        model=tiny_llama(0), reward_funcs=reward, args=args, train_dataset=data, processing_class=word_tokenizer()
    )
    trainer.current_gradient_accumulation_steps = accumulation  # (set by the training loop)
    trainer.model.train()
    return trainer


def trl_step(options: dict[str, Any], beta: float, batch: dict[str, torch.Tensor], ranks: int, accumulation: int):
    """TRL's step loss and gradient: the mean over ranks of each rank's summed micro-batch losses (DDP's average)."""
    trainer = trl_trainer(options, ranks, accumulation)
    trainer.beta = beta
    with trl_processes(trainer, ranks):
        losses = [trainer.compute_loss(trainer.model, part) for part in chunks(batch, ranks * accumulation)]
    loss = torch.stack(losses).sum() / ranks
    loss.backward()
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.item(), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}, logged


def compare(variant: str, case: str, layout: str) -> tuple[float, float, float]:
    """(titanium's loss, |loss difference|, largest |gradient difference|) after checking the metrics."""
    ours, options = VARIANTS[variant]
    beta, mask_truncated, ours_kl, trl_kl = CASES[case]
    ranks, accumulation = LAYOUTS[layout]
    cfg = GRPOSection(
        epsilon_low=EPS_LOW,
        epsilon_high=EPS_HIGH,
        beta=beta,
        **ours,
        **ours_kl,
    )
    batch = with_old_and_ref(mask_truncated)
    loss, grads, sums = titanium_step(cfg, batch, ranks * accumulation)
    trl_loss, trl_grads, logged = trl_step({**options, **trl_kl}, beta, batch, ranks, accumulation)
    if layout == "1x1" and variant != "gspo":  # (TRL counts gspo's clips per response, titanium per token)
        clip = "cispo_clip_ratio" if variant == "cispo" else "clip_ratio/region_mean"
        assert (sums["clipped_low"] + sums["clipped_high"]) / sums["tokens"] == pytest.approx(logged[clip], abs=1e-6)
        if beta > 0 and not cfg.kl_bias_correction:  # (TRL then logs the ratio-weighted KL)
            assert sums["kl"] / sums["tokens"] == pytest.approx(logged["kl"], rel=1e-5)
    grad_diff = max((grads[n] - trl_grads[n]).abs().max().item() for n in grads)
    assert any(g.abs().max() > 1e-3 for g in grads.values())  # a real gradient, not a vacuous match
    return loss, abs(loss - trl_loss), grad_diff


TESTED = [(case, "1x1") for case in CASES] + [("kl_masked", "dp2_accum2")]  # main() prints every combination


@pytest.mark.parametrize("case, layout", TESTED, ids=[f"{case}-{layout}" for case, layout in TESTED])
@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_and_gradients_equal_trl(variant: str, case: str, layout: str) -> None:
    _, loss_diff, grad_diff = compare(variant, case, layout)
    assert loss_diff <= TOLERANCE and grad_diff <= TOLERANCE, (loss_diff, grad_diff)


def test_the_clips_are_exercised() -> None:
    """The fixed noise moves ratios outside [1 - eps_low, 1 + eps_high] and above the caps (1.5)."""
    batch = with_old_and_ref(mask_truncated=False)
    with torch.no_grad():
        ratio = torch.exp(forward_logprobs(tiny_llama(0), batch) - batch["old_per_token_logps"])
    live = ratio[batch["completion_mask"].bool()]
    assert (live < 1 - EPS_LOW).any() and (live > 1.5).any() and ((live > 1) & (live < 1 + EPS_HIGH)).any()


# ------------------------------------------------------------------- the engine/trainer mismatch correction

IS_CASES = {  # name -> (mode, cap_max, cap_min)
    "token_truncate": ("token_truncate", 1.5, None),
    "token_mask": ("token_mask", 1.5, 0.6),
    "sequence_truncate": ("sequence_truncate", 3.0, 0.5),
    "sequence_mask": ("sequence_mask", 3.0, 0.5),
}


def characters(completions: list[str], **_: Any) -> list[float]:
    return [float(len(c)) for c in completions]


def engine_rollouts() -> dict[str, torch.Tensor]:
    """The rollouts with an engine's log-probs of them: the policy's own with noise (an engine that rounds
    differently, or lags), so ratios spread over about 0.4-2.5 per token and further per response."""
    batch = rollouts()
    with torch.no_grad():
        logprobs = forward_logprobs(tiny_llama(0), batch)
    noise = 0.3 * torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(3))
    return {**batch, "sampling": (logprobs + noise) * batch["completion_mask"]}


def trl_with_engine(mode: str, cap_max: float, cap_min: float | None, batch: dict[str, torch.Tensor]) -> Any:
    """TRL's generation step as with vLLM (its ``_generate`` replaced by the fixed rollouts and their engine
    log-probs): it recomputes the old log-probs with the model, computes rewards, advantages and the importance
    weights; returns (its training inputs, the trainer)."""
    options = {
        "vllm_importance_sampling_correction": True,
        "vllm_importance_sampling_mode": mode,
        "vllm_importance_sampling_clip_max": cap_max,
        "vllm_importance_sampling_clip_min": cap_min,
    }
    trainer = trl_trainer(options, reward=characters)
    tokenizer = word_tokenizer()
    prompts = [[t for t, m in zip(p, pm) if m] for p, pm in zip(batch["prompt_ids"].tolist(), batch["prompt_mask"])]
    completions = [c[:n] for c, n in zip(batch["completion_ids"].tolist(), LENGTHS)]
    sampling = [row[:n] for row, n in zip(batch["sampling"].tolist(), LENGTHS)]
    texts = [tokenizer.decode(c) for c in completions]
    trainer.use_vllm = True  # (what its vLLM set-up would set)
    trainer._generate = lambda _: (prompts, completions, None, texts, sampling, {}, None, None)
    inputs = trainer._generate_and_score_completions([{"prompt": ""}] * len(LENGTHS))
    return inputs, trainer


@pytest.mark.parametrize("case", IS_CASES)
def test_importance_correction_equals_trl(case: str) -> None:
    """Recomputed old log-probs, advantages, importance weights, mismatch metrics, and the corrected loss and its
    gradients, against TRL's GRPOTrainer with vLLM's importance-sampling correction."""
    mode, cap_max, cap_min = IS_CASES[case]
    batch = engine_rollouts()
    inputs, trainer = trl_with_engine(mode, cap_max, cap_min, batch)
    mask = batch["completion_mask"].bool()
    model = tiny_llama(0)
    with torch.no_grad():
        old = forward_logprobs(model, batch)  # old_logprobs = "recompute": the trainer's forward, no gradient
    torch.testing.assert_close(old * mask, inputs["old_per_token_logps"] * mask, rtol=0, atol=1e-6)
    texts = [word_tokenizer().decode(c[:n]) for c, n in zip(batch["completion_ids"].tolist(), LENGTHS)]
    advantages = group_advantages(torch.tensor(characters(texts)), GROUP)
    torch.testing.assert_close(advantages, inputs["advantages"], rtol=0, atol=1e-6)

    weights = importance_weights(old, batch["sampling"], mask, mode, cap_max, cap_min)
    torch.testing.assert_close(weights, inputs["importance_sampling_ratio"], rtol=0, atol=1e-6)
    changed = weights != importance_weights(old, batch["sampling"], mask, mode, float("inf"), None)
    assert changed.any() and not changed.all(), "degenerate test: the caps should bite on some, not all"

    means, maxima, minima = mismatch_metrics(old, batch["sampling"], mask, weights)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    mean = {k: (total / count).item() for k, (total, count) in means.items()}
    assert mean["grpo/logprob_mismatch"] == pytest.approx(logged["sampling/sampling_logp_difference/mean"], abs=1e-6)
    assert maxima["grpo/logprob_mismatch_max"].item() == pytest.approx(
        logged["sampling/sampling_logp_difference/max"], abs=1e-6
    )
    assert mean["grpo/is_weight"] == pytest.approx(logged["sampling/importance_sampling_ratio/mean"], abs=1e-6)
    assert maxima["grpo/is_weight_max"].item() == pytest.approx(logged["sampling/importance_sampling_ratio/max"])
    assert minima["grpo/is_weight_min"].item() == pytest.approx(logged["sampling/importance_sampling_ratio/min"])
    units = mask if mode.startswith("token") else mask.any(dim=1, keepdim=True)
    assert mean["grpo/is_changed"] == pytest.approx(((changed & units).sum() / units.sum()).item())

    cfg = GRPOSection(epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH)
    logprobs = forward_logprobs(model, batch)
    loss_sum, units, _ = grpo_loss(logprobs, old, advantages, mask, cfg, is_weights=weights, max_new_tokens=WIDTH)
    (loss_sum / units).backward()
    trl_loss = trainer.compute_loss(trainer.model, inputs)
    trl_loss.backward()
    assert (loss_sum / units).item() == pytest.approx(trl_loss.item(), abs=TOLERANCE)
    trl_grads = dict(trainer.model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, trl_grads[name].grad, rtol=0, atol=TOLERANCE, msg=name)


def main() -> None:
    """The equality table: every variant x case x layout."""
    print("| variant | case | layout | loss | abs loss diff | max abs grad diff |")
    print("|---|---|---|---:|---:|---:|")
    for variant in VARIANTS:
        for case in CASES:
            for layout in LAYOUTS:
                loss, loss_diff, grad_diff = compare(variant, case, layout)
                print(f"| {variant} | {case} | {layout} | {loss:.6f} | {loss_diff:.1e} | {grad_diff:.1e} |")


if __name__ == "__main__":
    main()
