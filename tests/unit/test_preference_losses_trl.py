"""SimPO, ORPO, KTO and the robust / BCO variants of DPO against TRL's own trainer code on the same log-probs.

Each case builds a real TRL trainer (CPOTrainer for SimPO, ORPOTrainer, KTOTrainer, DPOTrainer) around a tiny
model, then feeds its loss code per-sequence log-probs instead of a forward pass: CPO and ORPO get them through
``concatenated_forward`` (the method that returns log-probs and the NLL), KTO and DPO through a stand-in model
whose fused-LM-head output puts each row's log-prob sum in its per-token log-probs, with the reference
log-probs given as precomputed. The loss, the reward metrics and the gradients w.r.t. the policy log-probs
must equal titanium's to 1e-6 over a few random batches.
"""

from __future__ import annotations

import tempfile
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from titanium.objectives.losses.preference import (
    bco_pair_loss,
    kto_kl_estimate,
    kto_loss,
    orpo_loss,
    robust_dpo_loss,
    simpo_loss,
    token_mean_nll,
)

pytest.importorskip("trl", reason="pip install 'trl>=1.16,<2' (in the dev extra) to compare with TRL")

TOL = {"rtol": 1e-6, "atol": 1e-6}
SEEDS = (0, 1, 2)


def trl_trainer(kind: str, **options: Any) -> Any:
    """A real TRL trainer of ``kind`` around a tiny Llama (its dataset is never trained on)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    from tests.objectives.tiny_hf import tiny_llama, word_tokenizer

    pairs = {"prompt": ["t5 t6 "], "chosen": ["t7"], "rejected": ["t8"]}
    unpaired = {"prompt": ["t5 ", "t6 "], "completion": ["t7", "t8"], "label": [True, False]}
    config_cls, trainer_cls, data, extra = {
        "cpo": (CPOConfig, CPOTrainer, pairs, {}),
        "orpo": (ORPOConfig, ORPOTrainer, pairs, {}),
        "dpo": (DPOConfig, DPOTrainer, pairs, {"ref_model": tiny_llama(1)}),
        "kto": (KTOConfig, KTOTrainer, unpaired, {"ref_model": tiny_llama(1)}),
    }[kind]
    args = config_cls(output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True, bf16=False, **options)
    trainer = trainer_cls(
        model=tiny_llama(0),
        args=args,
        train_dataset=Dataset.from_dict(data),
        processing_class=word_tokenizer(),
        **extra,
    )
    trainer.model.train()
    return trainer


def leaf(values: torch.Tensor, grad: bool = True) -> torch.Tensor:
    return values.detach().clone().requires_grad_(grad)


def random_responses(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of ``n`` responses (mean per token in [-3, -0.05]) and their token counts (1..12)."""
    lengths = torch.randint(1, 13, (n,), generator=g)
    per_token = -0.05 - 2.95 * torch.rand(n, generator=g)
    return per_token * lengths, lengths


def random_pairs(seed: int, n: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    chosen, chosen_len = random_responses(g, n)
    rejected, rejected_len = random_responses(g, n)
    prompt, prompt_len = random_responses(g, n)
    shift = 0.5 * torch.randn(2, n, generator=g)  # reference = policy + noise
    return {
        "chosen": chosen,
        "rejected": rejected,
        "chosen_len": chosen_len,
        "rejected_len": rejected_len,
        "prompt": prompt,
        "prompt_len": prompt_len,
        "ref_chosen": chosen + shift[0],
        "ref_rejected": rejected + shift[1],
    }


def assert_grad(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.grad is not None and theirs.grad is not None
    torch.testing.assert_close(ours.grad, theirs.grad, **TOL)
    assert ours.grad.abs().max() > 1e-4  # a real gradient, not a vacuous match


# ------------------------------------------------------------------------------ SimPO (CPO) and ORPO


def trl_concatenated(trainer: Any, chosen: torch.Tensor, rejected: torch.Tensor, nll: torch.Tensor) -> tuple:
    """Run TRL's ``get_batch_loss_metrics`` with ``concatenated_forward`` answering the given log-probs."""
    logits = torch.zeros(len(chosen), 3, 5)
    trainer.concatenated_forward = lambda model, batch: (chosen, rejected, logits, logits, nll)
    return trainer.get_batch_loss_metrics(trainer.model, {})


SIMPO_CASES = {
    "trl_defaults": {},  # beta 0.1, simpo_gamma 0.5, cpo_alpha 1.0 (CPO-SimPO)
    "paper": {"beta": 2.0, "simpo_gamma": 1.0, "cpo_alpha": 0.0},
    "smoothed": {"beta": 2.5, "simpo_gamma": 1.2, "cpo_alpha": 0.3, "label_smoothing": 0.2},
}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", SIMPO_CASES)
def test_simpo_equals_trl_cpo_trainer(case, seed):
    trainer = trl_trainer("cpo", loss_type="simpo", **SIMPO_CASES[case])
    args = trainer.args
    b = random_pairs(seed)
    chosen, rejected = leaf(b["chosen"]), leaf(b["rejected"])
    out = simpo_loss(
        chosen, rejected, b["chosen_len"], b["rejected_len"], args.beta, args.simpo_gamma, args.label_smoothing
    )
    loss = out.losses.mean() + args.cpo_alpha * token_mean_nll(chosen, b["chosen_len"])
    loss.backward()

    # TRL: average log-probs (get_batch_logps with average_log_prob for simpo); NLL over the chosen responses.
    t_chosen, t_rejected = leaf(b["chosen"]), leaf(b["rejected"])
    nll = -t_chosen.sum() / b["chosen_len"].sum()
    trl_loss, metrics = trl_concatenated(
        trainer, t_chosen / b["chosen_len"], t_rejected / b["rejected_len"], nll if args.cpo_alpha else nll * 0
    )
    trl_loss.backward()
    torch.testing.assert_close(loss, trl_loss, **TOL)
    assert out.chosen_rewards.mean().item() == pytest.approx(metrics["rewards/chosen"], abs=1e-6)
    assert out.rejected_rewards.mean().item() == pytest.approx(metrics["rewards/rejected"], abs=1e-6)
    assert_grad(chosen, t_chosen)
    assert_grad(rejected, t_rejected)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta", [0.1, 0.5])  # 0.1: TRL's default
def test_orpo_equals_trl_orpo_trainer(beta, seed):
    trainer = trl_trainer("orpo", beta=beta)
    assert trainer.beta == beta
    b = random_pairs(seed)
    chosen, rejected, prompt = leaf(b["chosen"]), leaf(b["rejected"]), leaf(b["prompt"])
    out = orpo_loss(chosen, rejected, b["chosen_len"], b["rejected_len"], beta)
    # ORPO's NLL covers the chosen sequence's prompt and response tokens.
    loss = out.losses.mean() + token_mean_nll(prompt + chosen, b["prompt_len"] + b["chosen_len"])
    loss.backward()

    t_chosen, t_rejected, t_prompt = leaf(b["chosen"]), leaf(b["rejected"]), leaf(b["prompt"])
    nll = -(t_prompt + t_chosen).sum() / (b["prompt_len"] + b["chosen_len"]).sum()
    trl_loss, metrics = trl_concatenated(trainer, t_chosen / b["chosen_len"], t_rejected / b["rejected_len"], nll)
    trl_loss.backward()
    torch.testing.assert_close(loss, trl_loss, **TOL)
    for name, value in (
        ("rewards/chosen", out.chosen_rewards),
        ("rewards/rejected", out.rejected_rewards),
        ("log_odds_ratio", out.extra["log_odds_ratio"]),
        ("log_odds_chosen", out.extra["log_odds_chosen"]),
    ):
        assert value.mean().item() == pytest.approx(metrics[name], abs=1e-6), name
    for ours, theirs in ((chosen, t_chosen), (rejected, t_rejected), (prompt, t_prompt)):
        assert_grad(ours, theirs)


def test_orpo_is_accurate_for_log_probs_near_zero_and_far_below():
    """log(1 - exp m) at m = -1e-6 (p almost 1) and m = -40 (p almost 0) stays finite, with finite gradients."""
    chosen, rejected = torch.tensor([-1e-6, -40.0], requires_grad=True), torch.tensor([-40.0, -1e-6])
    out = orpo_loss(chosen, rejected, torch.ones(2), torch.ones(2))
    out.losses.sum().backward()
    assert torch.isfinite(out.losses).all() and torch.isfinite(chosen.grad).all()
    # log odds(p = 1 - 1e-6) = log((1 - 1e-6) / 1e-6) ~ 13.8155; log odds(e^-40) ~ -40
    assert out.extra["log_odds_chosen"][0].item() == pytest.approx(13.8155 + 40.0, abs=1e-3)


# ------------------------------------------------------------------------- DPO variants: robust, bco_pair


class LogProbTable:
    """Stands in for a causal LM under TRL's fused LM head: the row whose first input id is r gets per-token
    log-probs that sum to ``table[r]`` (all of it on the last position), so TRL's sums are the table's."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    def __call__(self, input_ids: torch.Tensor, **kwargs: Any) -> SimpleNamespace:
        rows, width = input_ids[:, 0], input_ids.shape[1] - 1
        values = self.table[rows]
        log_probs = torch.cat([values.new_zeros(len(rows), width - 1), values[:, None]], dim=1)
        zeros = torch.zeros(len(rows), width)
        return SimpleNamespace(log_probs=log_probs, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())


def rows(first: int, n: int, width: int = 4) -> dict[str, torch.Tensor]:
    """Input rows whose first id names the table entry; completion on every position after the first."""
    ids = torch.zeros(n, width, dtype=torch.long)
    ids[:, 0] = torch.arange(first, first + n)
    completion = torch.ones(n, width, dtype=torch.long)
    completion[:, 0] = 0
    return {"input_ids": ids, "attention_mask": torch.ones(n, width, dtype=torch.long), "completion_mask": completion}


DPO_CASES = {
    "robust_plain": (robust_dpo_loss, {"loss_type": ["robust"]}),  # label_smoothing 0: DPO
    "robust_0.1": (robust_dpo_loss, {"loss_type": ["robust"], "beta": 0.5, "label_smoothing": 0.1}),
    "robust_0.3": (robust_dpo_loss, {"loss_type": ["robust"], "beta": 0.3, "label_smoothing": 0.3}),
    "bco_pair": (bco_pair_loss, {"loss_type": ["bco_pair"]}),
    "bco_pair_0.7": (bco_pair_loss, {"loss_type": ["bco_pair"], "beta": 0.7}),
}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", DPO_CASES)
def test_dpo_variant_equals_trl_dpo_trainer(case, seed):
    fn, options = DPO_CASES[case]
    trainer = trl_trainer("dpo", **options)
    trainer.precompute_ref_logps = True  # reference log-probs come with the batch
    b = random_pairs(seed)
    n = len(b["chosen"])
    chosen, rejected = leaf(b["chosen"]), leaf(b["rejected"])
    ref_chosen, ref_rejected = leaf(b["ref_chosen"]), leaf(b["ref_rejected"])
    kwargs = {"label_smoothing": trainer.label_smoothing} if fn is robust_dpo_loss else {}
    out = fn(chosen, rejected, ref_chosen, ref_rejected, trainer.beta, **kwargs)
    loss = out.losses.mean()
    loss.backward()
    assert ref_chosen.grad is None and ref_rejected.grad is None

    t_chosen, t_rejected = leaf(b["chosen"]), leaf(b["rejected"])
    model = LogProbTable(torch.cat([t_chosen, t_rejected]))  # TRL's batch is [chosen..., rejected...]
    inputs = {**rows(0, 2 * n), "ref_chosen_logps": b["ref_chosen"], "ref_rejected_logps": b["ref_rejected"]}
    trl_loss = trainer.compute_loss(model, inputs)
    trl_loss.backward()
    torch.testing.assert_close(loss, trl_loss, **TOL)
    logged = trainer._metrics["train"]
    assert out.chosen_rewards.mean().item() == pytest.approx(logged["rewards/chosen"][-1], abs=1e-6)
    assert out.rejected_rewards.mean().item() == pytest.approx(logged["rewards/rejected"][-1], abs=1e-6)
    assert_grad(chosen, t_chosen)
    assert_grad(rejected, t_rejected)


def test_robust_refuses_label_smoothing_of_one_half():
    t = torch.zeros(2)
    with pytest.raises(ValueError, match=r"\[0, 0.5\)"):
        robust_dpo_loss(t, t, t, t, label_smoothing=0.5)


# ---------------------------------------------------------------------------------------------- KTO

# (desirable labels, shift of the mismatched pairs' policy log-probs from the reference's, TRL options)
KTO_CASES = {
    "mixed": ([True, False, True, True, False, False], 0.8, {}),
    "weighted": ([True, False, False, False, True, False], 0.8, {"desirable_weight": 1.33, "undesirable_weight": 0.7}),
    "only_desirable": ([True] * 4, 0.8, {"beta": 0.5}),
    "only_undesirable": ([False] * 4, 0.8, {"beta": 0.5, "undesirable_weight": 1.2}),
    "negative_kl_clamped": ([True, False, True, False], -0.8, {}),
    "apo_zero_unpaired": ([True, False, True, False, False], 0.8, {"loss_type": "apo_zero_unpaired"}),
}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", KTO_CASES)
def test_kto_equals_trl_kto_trainer(case, seed):
    labels, kl_shift, options = KTO_CASES[case]
    trainer = trl_trainer("kto", **options)
    trainer.precompute_ref_logps = True  # reference log-probs (and the mismatched pairs') come with the batch
    n = len(labels)
    g = torch.Generator().manual_seed(seed)
    policy_values, _ = random_responses(g, n)
    ref_values = policy_values + 0.5 * torch.randn(n, generator=g)
    ref_kl_values, _ = random_responses(g, n)
    kl_values = ref_kl_values + kl_shift + 0.3 * torch.randn(n, generator=g)
    desirable = torch.tensor(labels)

    policy, policy_kl = leaf(policy_values), leaf(kl_values)
    kl = kto_kl_estimate(policy_kl, ref_kl_values) if trainer.calculate_KL else None
    out = kto_loss(
        policy,
        ref_values,
        desirable,
        kl,
        trainer.beta,
        trainer.desirable_weight,
        trainer.undesirable_weight,
        trainer.loss_type,
    )
    loss = out.losses.mean()
    loss.backward()
    assert policy_kl.grad is None  # the KL estimate is a constant

    t_policy, t_policy_kl = leaf(policy_values), leaf(kl_values)
    model = LogProbTable(torch.cat([t_policy, t_policy_kl]))  # entries n.. are the mismatched pairs
    kl_rows = {f"KL_{k}": v for k, v in rows(n, n).items()}
    inputs = {**rows(0, n), **kl_rows, "label": desirable, "ref_logps": ref_values, "ref_KL_logps": ref_kl_values}
    trl_loss = trainer.compute_loss(model, inputs)
    trl_loss.backward()
    torch.testing.assert_close(loss, trl_loss, **TOL)
    assert t_policy_kl.grad is None or not t_policy_kl.grad.any()  # TRL runs the mismatched pairs without grad

    logged = trainer._metrics["train"]
    expected_kl = 0.0 if kl is None else kl.clamp(min=0).item()
    assert logged["kl"][-1] == pytest.approx(expected_kl, abs=1e-6)
    if kl_shift < 0:
        assert expected_kl == 0.0  # the estimate was negative and is clamped, as TRL does
    for name, mask in (("rewards/chosen", desirable), ("rewards/rejected", ~desirable)):
        if mask.any():
            assert out.rewards[mask].mean().item() == pytest.approx(logged[name][-1], abs=1e-6)
        else:
            assert name not in logged
    assert_grad(policy, t_policy)


def test_kto_needs_the_kl_estimate_and_a_known_loss_type():
    t = torch.zeros(2)
    with pytest.raises(ValueError, match="KL estimate"):
        kto_loss(t, t, torch.tensor([True, False]), None)
    with pytest.raises(ValueError, match="apo_zero_unpaired"):
        kto_loss(t, t, torch.tensor([True, False]), t.sum(), loss_type="bco")
