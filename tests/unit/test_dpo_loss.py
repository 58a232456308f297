"""DPO math: each loss against hand formulas, then loss, rewards and gradients on a tiny Hugging Face Llama
against log-probs from transformers' own loss and against TRL's DPOTrainer (when trl is installed)."""

from __future__ import annotations

import math
import tempfile

import pytest
import torch
import torch.nn.functional as F

from tests.objectives.tiny_hf import BOS, tiny_llama, word_tokenizer
from titanium.config.dpo_losses import SigmoidKnobs
from titanium.config.sections import DPOSection
from titanium.data.preference import PreferencePair, pair_sample
from titanium.data.preference_batch import PreferenceBatchLoader
from titanium.data.sft import IGNORE_INDEX
from titanium.objectives.dpo import METRICS, response_sums, token_logps
from titanium.objectives.losses.dpo import dpo_loss

# Four pairs of fixed summed log-probs (policy / reference, chosen / rejected) and response lengths.
PC, PR = [-4.0, -10.0, -2.5, -7.0], [-5.5, -9.0, -9.0, -7.0]  # pair 2: beta h > 1 (hinge inactive)
RC, RR = [-4.5, -9.5, -3.0, -6.0], [-5.0, -9.5, -5.0, -8.0]
LC, LR = [4, 10, 2, 7], [5, 8, 6, 7]


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def hand(cfg: DPOSection) -> list[float]:
    """The per-pair losses of the module docstring's formulas, in plain Python floats."""
    out = []
    for pc, pr, rc, rr, lc, lr in zip(PC, PR, RC, RR, LC, LR):
        nll = -pc / lc
        if cfg.length_normalize:
            pc, rc, pr, rr = pc / lc, rc / lc, pr / lr, rr / lr
        h = (pc - rc) - (pr - rr)
        b, e = cfg.beta, cfg.sigmoid.label_smoothing
        loss = {
            "sigmoid": -(1 - e) * log_sigmoid(b * h) - e * log_sigmoid(-b * h),
            "ipo": (h - 1 / (2 * b)) ** 2,
            "hinge": max(0.0, 1 - b * h),
        }[cfg.loss_type]
        out.append(loss + cfg.rpo_alpha * nll)
    return out


def run(cfg: DPOSection, requires_grad: bool = False):
    pc, pr, rc, rr = (torch.tensor(v, requires_grad=requires_grad) for v in (PC, PR, RC, RR))
    out = dpo_loss(pc, pr, rc, rr, cfg, torch.tensor(LC), torch.tensor(LR))
    return out, (pc, pr, rc, rr)


CONFIGS = {
    "dpo": DPOSection(),
    "dpo_beta_0.5": DPOSection(beta=0.5),
    "cdpo": DPOSection(sigmoid=SigmoidKnobs(label_smoothing=0.2)),
    "ipo": DPOSection(loss_type="ipo", beta=0.3),
    "hinge": DPOSection(loss_type="hinge", beta=0.5),
    "dpo_normalized": DPOSection(length_normalize=True, beta=2.0),
    "ipo_normalized": DPOSection(loss_type="ipo", length_normalize=True),
    "rpo": DPOSection(rpo_alpha=0.7),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_losses_equal_hand_formulas(name):
    cfg = CONFIGS[name]
    out, _ = run(cfg)
    torch.testing.assert_close(out.losses, torch.tensor(hand(cfg)), rtol=1e-6, atol=1e-6)


def test_rewards_margin_accuracy_are_sums_over_pairs():
    out, _ = run(DPOSection(beta=0.5))
    chosen = [0.5 * (pc - rc) for pc, rc in zip(PC, RC)]  # 0.25, -0.25, 0.25, -0.5
    rejected = [0.5 * (pr - rr) for pr, rr in zip(PR, RR)]  # -0.25, 0.25, -2.0, 0.5
    expected = {
        "reward_chosen": sum(chosen),
        "reward_rejected": sum(rejected),
        "margin": sum(c - r for c, r in zip(chosen, rejected)),
        "accuracy": 2.0,  # pairs 0 and 2
        "logp_chosen": sum(PC),
        "logp_rejected": sum(PR),
    }
    assert tuple(out.metrics) == METRICS == tuple(expected)
    for key, value in expected.items():
        assert not out.metrics[key].requires_grad
        torch.testing.assert_close(out.metrics[key], torch.tensor(value), rtol=1e-6, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", ["dpo", "cdpo", "ipo", "hinge"])
def test_gradients_equal_the_derivative_of_the_formula(name):
    """d loss / d policy log-prob: sigmoid -beta((1-e) sigmoid(-beta h) - e sigmoid(beta h)), ipo 2(h - 1/2beta),
    hinge -beta where 1 - beta h > 0; the rejected side gets the opposite sign; the reference gets none."""
    cfg = CONFIGS[name]
    out, (pc, pr, rc, rr) = run(cfg, requires_grad=True)
    out.losses.sum().backward()
    assert rc.grad is None and rr.grad is None
    b, e = cfg.beta, cfg.sigmoid.label_smoothing
    for k in range(len(PC)):
        h = (PC[k] - RC[k]) - (PR[k] - RR[k])
        sig = 1 / (1 + math.exp(-b * h))
        dh = {
            "sigmoid": -b * ((1 - e) * (1 - sig) - e * sig),
            "ipo": 2 * (h - 1 / (2 * b)),
            "hinge": -b if 1 - b * h > 0 else 0.0,
        }[cfg.loss_type]
        assert pc.grad[k].item() == pytest.approx(dh, abs=1e-6)
        assert pr.grad[k].item() == pytest.approx(-dh, abs=1e-6)


def test_lengths_are_required_where_they_matter():
    t = torch.tensor(PC)
    with pytest.raises(ValueError, match="response lengths"):
        dpo_loss(t, t, t, t, DPOSection(rpo_alpha=1.0))


def test_masked_entries_are_no_pairs():
    """Entries outside ``mask`` (empty slots of a batch layout) add nothing to losses or metrics."""
    cfg = DPOSection(beta=0.5, rpo_alpha=0.3)
    pad = torch.zeros(2)
    full = [torch.tensor([*v, 0.0, 0.0]) for v in (PC, PR, RC, RR)]
    lengths = torch.tensor([3.0, 1.0, 2.0, 4.0, 0.0, 0.0])
    mask = torch.tensor([True] * len(PC) + [False, False])
    masked = dpo_loss(*full, cfg, lengths, lengths, mask=mask)
    alone = dpo_loss(*(torch.tensor(v) for v in (PC, PR, RC, RR)), cfg, lengths[:4], lengths[:4])
    torch.testing.assert_close(masked.losses, torch.cat([alone.losses, pad]))
    for name in METRICS:
        torch.testing.assert_close(masked.metrics[name], alone.metrics[name], msg=name)


def test_response_sums_equal_a_loop_over_tokens():
    """Row pairs (0, 1) and (2, 3), 3 pair slots each; a label's id 2m + side names slot m and its side."""
    g = torch.Generator().manual_seed(0)
    rows, seq, slots = 4, 9, 3
    logits = torch.randn(rows, seq, 13, generator=g, dtype=torch.float64).to(torch.bfloat16)
    labels = torch.randint(0, 13, (rows, seq), generator=g)
    ids = torch.randint(-1, 2 * slots, (rows, seq), generator=g)
    labels[ids < 0] = IGNORE_INDEX
    logps = token_logps(logits, labels)
    out = response_sums(logps, ids, slots)
    assert out.dtype == torch.float32 and out.shape == (rows // 2 * slots, 2)
    expected = torch.zeros(rows // 2 * slots, 2, dtype=torch.float64)
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    for r in range(rows):
        for s in range(seq):
            if ids[r, s] >= 0:
                expected[r // 2 * slots + ids[r, s] // 2, ids[r, s] % 2] += log_probs[r, s, labels[r, s]]
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-5)
    stacked = response_sums(torch.stack([logps, 2 * logps]), ids, slots)  # several values at once
    torch.testing.assert_close(stacked, torch.stack([out, 2 * out]))


# ------------------------------------------------------------------------ a tiny Hugging Face Llama

# (prompt, chosen, rejected) token ids: different lengths, a shared and a diverging response prefix.
PAIRS = [
    ([BOS, 5, 6, 7], [8, 9, 2], [10, 2]),
    ([BOS, 11, 12], [13, 14, 15, 16, 2], [13, 17, 2]),
    ([BOS, 20, 21, 22, 23, 24], [25, 2], [26, 27, 28, 2]),
]


def ours(policy, reference, cfg: DPOSection) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """titanium's per-pair losses and metric sums on one concatenated padded batch, and the gradients of the
    pair-mean loss (sum / pair count, the loop's rule)."""
    pairs = []
    for k, (prompt, chosen, rejected) in enumerate(PAIRS):
        sides = [pair_sample(prompt, (ids, [True] * len(ids))) for ids in (chosen, rejected)]
        pairs.append(PreferencePair(sides[0], sides[1], 0, k))
    batch = next(PreferenceBatchLoader(iter(pairs), len(pairs), 16, 0, packing=False))  # type: ignore[arg-type]
    n = len(pairs)

    def logps(model) -> torch.Tensor:
        logits = model(input_ids=batch["input"]).logits
        return response_sums(token_logps(logits, batch["label"]), batch["response_ids"], 1)

    with torch.no_grad():
        ref = logps(reference)
    pol = logps(policy)
    lengths = response_sums((batch["response_ids"] >= 0).float(), batch["response_ids"], 1)
    out = dpo_loss(*pol.unbind(1), *ref.unbind(1), cfg, *lengths.unbind(1))
    policy.zero_grad()
    (out.losses.sum() / n).backward()
    grads = {name: p.grad.clone() for name, p in policy.named_parameters()}
    return out.losses.detach(), out.metrics, grads


def transformers_logp(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Summed log-prob of `response` after `prompt` from transformers' own causal-LM loss (a token mean)."""
    tokens = torch.tensor([prompt + response])
    labels = tokens.clone()
    labels[0, : len(prompt)] = -100
    return -model(input_ids=tokens, labels=labels).loss * len(response)


def paper(policy, reference, cfg: DPOSection) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The papers' formulas on transformers log-probs, each sequence run alone and unpadded."""
    rows = []
    for prompt, chosen, rejected in PAIRS:
        with torch.no_grad():
            rc, rr = (transformers_logp(reference, prompt, r) for r in (chosen, rejected))
        pc, pr = (transformers_logp(policy, prompt, r) for r in (chosen, rejected))
        nll = -pc / len(chosen)
        if cfg.length_normalize:
            pc, rc, pr, rr = pc / len(chosen), rc / len(chosen), pr / len(rejected), rr / len(rejected)
        h, b = (pc - rc) - (pr - rr), cfg.beta
        if cfg.loss_type == "sigmoid":
            e = cfg.sigmoid.label_smoothing
            loss = -(1 - e) * F.logsigmoid(b * h) - e * F.logsigmoid(-b * h)
        elif cfg.loss_type == "ipo":
            loss = (h - 1 / (2 * b)) ** 2
        else:
            loss = torch.relu(1 - b * h)
        rows.append((loss + cfg.rpo_alpha * nll, b * (pc - rc).detach(), b * (pr - rr).detach()))
    losses = torch.stack([r[0] for r in rows])
    chosen, rejected = torch.stack([r[1] for r in rows]), torch.stack([r[2] for r in rows])
    policy.zero_grad()
    losses.mean().backward()
    metrics = {
        "reward_chosen": chosen.sum(),
        "reward_rejected": rejected.sum(),
        "margin": (chosen - rejected).sum(),
        "accuracy": (chosen > rejected).float().sum(),
    }
    return losses.detach(), metrics, {name: p.grad.clone() for name, p in policy.named_parameters()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-5, msg=lambda m, key=key: f"{what} {key}: {m}")


@pytest.mark.parametrize("name", CONFIGS)
def test_matches_the_formulas_on_transformers_log_probs(name):
    cfg = CONFIGS[name]
    policy, reference = tiny_llama(0), tiny_llama(1)
    losses, metrics, grads = ours(policy, reference, cfg)
    expected_losses, expected_metrics, expected_grads = paper(policy, reference, cfg)
    torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-5)
    assert_same(metrics, expected_metrics, "metric")
    assert_same(grads, expected_grads, "gradient")
    assert any(g.abs().max() > 1e-3 for g in grads.values())  # a real gradient, not a vacuous match


# ---------------------------------------------------------------------------------------------- TRL

# titanium option -> TRL DPOConfig. TRL's ipo averages over the completion (= our length_normalize), its
# sigmoid_norm is sigmoid on averaged log-probs, and loss_type [sigmoid, sft] with weights [1, alpha] adds
# alpha x the chosen token-mean NLL (per pair here, since TRL gets one pair per call). TRL reports rewards
# from summed log-probs, so they are compared only where nothing is normalized.
TRL_CASES: dict[str, tuple[DPOSection, dict, bool]] = {
    "sigmoid": (DPOSection(beta=0.5), {"loss_type": ["sigmoid"], "beta": 0.5}, True),
    "hinge": (DPOSection(loss_type="hinge", beta=0.3), {"loss_type": ["hinge"], "beta": 0.3}, True),
    "ipo": (DPOSection(loss_type="ipo", beta=0.3, length_normalize=True), {"loss_type": ["ipo"], "beta": 0.3}, False),
    "sigmoid_norm": (
        DPOSection(beta=2.0, length_normalize=True),
        {"loss_type": ["sigmoid_norm"], "beta": 2.0},
        False,
    ),
    "rpo": (
        DPOSection(beta=0.5, rpo_alpha=0.7),
        {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.7], "beta": 0.5},
        True,
    ),
}


def trl_trainer(policy, reference, options: dict):
    """A real trl.DPOTrainer around our two tiny models (its dataset is never trained on)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    tokenizer = word_tokenizer()
    data = Dataset.from_dict({"prompt": ["t5 t6"], "chosen": ["t7"], "rejected": ["t8"]})
    args = DPOConfig(output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True, bf16=False, **options)
    return DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=data, processing_class=tokenizer)


def trl_inputs(pair: tuple[list[int], list[int], list[int]]) -> dict[str, torch.Tensor]:
    """TRL's collated form of one pair: [chosen, rejected] right-padded, completion_mask on response tokens."""
    prompt, chosen, rejected = pair
    width = len(prompt) + max(len(chosen), len(rejected))
    ids, attention, completion = [], [], []
    for response in (chosen, rejected):
        pad = width - len(prompt) - len(response)
        ids.append(prompt + response + [0] * pad)
        attention.append([1] * (len(prompt) + len(response)) + [0] * pad)
        completion.append([0] * len(prompt) + [1] * len(response) + [0] * pad)
    return {
        k: torch.tensor(v)
        for k, v in zip(("input_ids", "attention_mask", "completion_mask"), (ids, attention, completion))
    }


def trl_run(policy, reference, options: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """TRL's loss per pair (one pair per call), its reward metrics, and the gradient of the pair mean."""
    trainer = trl_trainer(policy, reference, options)
    model = trainer.model
    model.train()
    model.zero_grad()
    losses, chosen, rejected, accuracy = [], [], [], []
    for pair in PAIRS:
        trainer._metrics["train"].clear()
        loss = trainer.compute_loss(model, trl_inputs(pair))
        (loss / len(PAIRS)).backward()
        losses.append(loss.detach())
        logged = trainer._metrics["train"]
        chosen.append(logged["rewards/chosen"][-1])
        rejected.append(logged["rewards/rejected"][-1])
        accuracy.append(logged["rewards/accuracies"][-1])
    metrics = {
        "reward_chosen": torch.tensor(sum(chosen)),
        "reward_rejected": torch.tensor(sum(rejected)),
        "margin": torch.tensor(sum(chosen) - sum(rejected)),
        "accuracy": torch.tensor(sum(accuracy)),
    }
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return torch.stack(losses), metrics, grads


@pytest.mark.parametrize("name", TRL_CASES)
def test_matches_trl_dpo_trainer(name):
    pytest.importorskip("trl", reason="pip install 'trl>=1.16,<2' (in the dev extra) to compare with TRL")
    cfg, options, compare_rewards = TRL_CASES[name]
    policy, reference = tiny_llama(0), tiny_llama(1)
    losses, metrics, grads = ours(policy, reference, cfg)
    trl_policy, trl_reference = tiny_llama(0), tiny_llama(1)
    expected_losses, expected_metrics, expected_grads = trl_run(trl_policy, trl_reference, options)
    torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-5)
    if compare_rewards:
        assert_same(metrics, expected_metrics, "metric")
    assert_same(grads, expected_grads, "gradient")
    assert any(g.abs().max() > 1e-3 for g in grads.values())


@pytest.mark.cuda
def test_cuda_response_sums_match_cpu_and_repeat_bitwise_in_deterministic_mode():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 64, 1000, generator=g).to(torch.bfloat16)
    labels = torch.randint(0, 1000, (4, 64), generator=g)
    ids = torch.randint(-1, 8, (4, 64), generator=g)
    labels[ids < 0] = IGNORE_INDEX

    def sums(logits: torch.Tensor, labels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return response_sums(token_logps(logits, labels), ids, 4)

    expected = sums(logits, labels, ids)
    cuda = [t.cuda() for t in (logits, labels, ids)]
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first, second = (sums(*cuda) for _ in range(2))
    finally:
        torch.use_deterministic_algorithms(previous)
    assert torch.equal(first, second)
    torch.testing.assert_close(first.cpu(), expected, rtol=1e-5, atol=1e-4)
