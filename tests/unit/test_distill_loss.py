"""The chunked knowledge-distillation loss against unchunked references on identical logits.

References: TRL's ``GKDTrainer.generalized_jsd_loss`` (the divergence, beta 0 / 0.5 / 1, several temperatures),
torchtune's ``ForwardKLLoss`` definition (written out below: ``-sum_v p_teacher * log p_student`` averaged over
labelled tokens; torchtune is not a dependency), and plain autograd through the full logits for the gradients
w.r.t. the student's hidden states and output weight. float64 throughout, so every comparison holds to 1e-6
with room to spare. Chunk sizes 1, 7 (not dividing the 37 tokens) and one larger than the token count.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from titanium.objectives.base import IGNORE_INDEX
from titanium.objectives.losses.distill import TeacherTopK, distillation_sum, linear_distillation_sum

TOL = {"rtol": 1e-6, "atol": 1e-6}
N, D_STUDENT, D_TEACHER, VOCAB = 37, 8, 12, 29
CHUNKS = (1, 7, 64)


def make_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """Student and teacher final hidden states and projections for N tokens; a third of the labels ignored."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, VOCAB, (N,), generator=g)
    labels[torch.rand(N, generator=g) < 0.33] = IGNORE_INDEX
    return {
        "hidden": torch.randn(N, D_STUDENT, generator=g, dtype=torch.float64),
        "weight": torch.randn(VOCAB, D_STUDENT, generator=g, dtype=torch.float64),
        "t_hidden": torch.randn(N, D_TEACHER, generator=g, dtype=torch.float64),
        "t_weight": 1.5 * torch.randn(VOCAB, D_TEACHER, generator=g, dtype=torch.float64),
        "labels": labels,
    }


def chunked(x: dict[str, torch.Tensor], teacher=None, **options):
    """titanium's loss with gradients on fresh leaves: (sums, grad hidden, grad weight)."""
    hidden, weight = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    teacher = (x["t_hidden"], x["t_weight"]) if teacher is None else teacher
    sums = linear_distillation_sum(hidden, weight, x["labels"], teacher, **options)
    sums.loss.backward()
    return sums, hidden.grad, weight.grad


def unchunked_grads(x: dict[str, torch.Tensor], loss_of_logits):
    """The loss of the full student logits (a function of them) and its gradients, by autograd."""
    hidden, weight = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    loss = loss_of_logits(hidden @ weight.t())
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


def teacher_logits(x: dict[str, torch.Tensor]) -> torch.Tensor:
    return x["t_hidden"] @ x["t_weight"].t()


def ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def assert_close_all(actual, expected) -> None:
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, **TOL)


@pytest.fixture(scope="module")
def trl_jsd():
    pytest.importorskip("trl", reason="pip install 'trl>=1.16,<2' (in the dev extra) to compare with TRL")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    return GKDTrainer.generalized_jsd_loss


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("temperature", (0.7, 1.0, 2.5))
@pytest.mark.parametrize("beta", (0.0, 0.5, 1.0))
def test_divergence_equals_trl_generalized_jsd(trl_jsd, beta: float, temperature: float, chunk_size: int) -> None:
    """alpha 1: D summed over labelled tokens / their count == TRL's batchmean; loss == T^2 * D; gradients of
    ``T^2 * TRL sum`` through the full logits."""
    x = make_inputs()
    sums, g_hidden, g_weight = chunked(x, alpha=1.0, temperature=temperature, beta=beta, chunk_size=chunk_size)
    labels, t_logits = x["labels"], teacher_logits(x)
    batchmean = trl_jsd(
        (x["hidden"] @ x["weight"].t())[None], t_logits[None], labels[None], beta=beta, temperature=temperature
    )
    torch.testing.assert_close(sums.divergence / sums.tokens, batchmean, **TOL)
    assert sums.tokens == (labels != IGNORE_INDEX).sum()

    def trl_sum(logits):
        jsd = trl_jsd(logits[None], t_logits[None], labels[None], beta=beta, temperature=temperature, reduction="sum")
        return temperature**2 * jsd

    assert_close_all((sums.loss.detach(), g_hidden, g_weight), unchunked_grads(x, trl_sum))


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_forward_kl_equals_torchtune_definition(chunk_size: int) -> None:
    """torchtune's ForwardKLLoss is the teacher-student cross-entropy: the forward KL plus the teacher's entropy (a
    constant of the student). The same value once that entropy is added to ours, and the same gradients (T = 1:
    torchtune has no temperature)."""
    x = make_inputs(1)
    sums, g_hidden, g_weight = chunked(x, alpha=1.0, temperature=1.0, beta=0.0, chunk_size=chunk_size)
    mask = x["labels"] != IGNORE_INDEX
    t_prob = torch.softmax(teacher_logits(x), dim=-1)

    def torchtune_forward_kl(logits):  # -sum_t m_t sum_v p_T log p_S / sum_t m_t
        per_token = (t_prob * torch.log_softmax(logits, dim=-1)).sum(-1)
        return -(per_token * mask).sum() / mask.sum()

    loss, ref_hidden, ref_weight = unchunked_grads(x, lambda z: mask.sum() * torchtune_forward_kl(z))
    neg_entropy = ((t_prob * t_prob.log()).sum(-1) * mask).sum()
    torch.testing.assert_close(sums.divergence - neg_entropy, loss, **TOL)
    assert_close_all((g_hidden, g_weight), (ref_hidden, ref_weight))


def reference_kd(x, alpha: float, temperature: float, beta: float, softcap=None, teacher_softcap=None):
    """The whole loss written out on full logits (independent of TRL): (1-a) CE + a T^2 sum_t D_t."""
    mask = x["labels"] != IGNORE_INDEX

    def cap(z, c):
        return z if c is None else c * torch.tanh(z / c)

    t_log = torch.log_softmax(cap(teacher_logits(x), teacher_softcap) / temperature, dim=-1)

    def loss(logits):
        logits = cap(logits, softcap)
        s_log = torch.log_softmax(logits / temperature, dim=-1)
        p_s, p_t = s_log.exp(), t_log.exp()
        m = beta * p_t + (1 - beta) * p_s
        if beta == 0:
            d = (p_t * (t_log - s_log)).sum(-1)
        elif beta == 1:
            d = (p_s * (s_log - t_log)).sum(-1)
        else:
            d = (beta * p_t * (t_log - m.log()) + (1 - beta) * p_s * (s_log - m.log())).sum(-1)
        return (1 - alpha) * ce_sum(logits, x["labels"]) + alpha * temperature**2 * (d * mask).sum()

    return loss


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("beta", (0.0, 0.3, 1.0))
def test_mixed_loss_and_gradients_equal_unchunked(beta: float, chunk_size: int) -> None:
    """alpha 0.3, T 2: loss and gradients w.r.t. the student's hidden states and output weight."""
    x = make_inputs(2)
    sums, g_hidden, g_weight = chunked(x, alpha=0.3, temperature=2.0, beta=beta, chunk_size=chunk_size)
    expected = unchunked_grads(x, reference_kd(x, alpha=0.3, temperature=2.0, beta=beta))
    assert_close_all((sums.loss.detach(), g_hidden, g_weight), expected)
    torch.testing.assert_close(sums.cross_entropy, ce_sum(x["hidden"] @ x["weight"].t(), x["labels"]), **TOL)


@pytest.mark.parametrize("beta", (0.0, 0.3, 1.0))
def test_the_loss_from_whole_logits_equals_the_chunked_one(beta: float) -> None:
    """The pipeline path (``distillation_sum``: both models' logits whole, [rows, seq, V], gradient by autograd)
    gives the chunked loss, its two parts and its gradients."""
    x = make_inputs(4)
    options = {"alpha": 0.3, "temperature": 2.0, "beta": beta}
    sums, g_hidden, g_weight = chunked(x, chunk_size=7, **options)
    hidden, weight = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    rows = (hidden @ weight.t()).view(1, N, VOCAB), teacher_logits(x).view(1, N, VOCAB)
    whole = distillation_sum(*rows, x["labels"].view(1, N), **options)
    whole.loss.backward()
    assert_close_all(
        (whole.loss.detach(), whole.cross_entropy, whole.divergence, hidden.grad, weight.grad),
        (sums.loss.detach(), sums.cross_entropy, sums.divergence, g_hidden, g_weight),
    )
    assert whole.tokens == sums.tokens


def test_soft_capped_logits() -> None:
    """Both models' final logit soft-cap (Gemma 2) is applied before the temperature; the gradient goes
    through the student's cap."""
    x = make_inputs(3)
    options = {"alpha": 0.6, "temperature": 1.5, "beta": 0.5, "softcap": 3.0, "teacher_softcap": 4.0}
    sums, g_hidden, g_weight = chunked(x, chunk_size=7, **options)
    expected = unchunked_grads(x, reference_kd(x, **options))
    assert_close_all((sums.loss.detach(), g_hidden, g_weight), expected)


def test_alpha_ends() -> None:
    """alpha 0 is plain cross-entropy (any teacher); alpha 1 is T^2 * D alone."""
    x = make_inputs(4)
    sums, g_hidden, g_weight = chunked(x, alpha=0.0, temperature=3.0, beta=0.5, chunk_size=7)
    assert_close_all((sums.loss.detach(), g_hidden, g_weight), unchunked_grads(x, lambda z: ce_sum(z, x["labels"])))
    sums, g_hidden, g_weight = chunked(x, alpha=1.0, temperature=3.0, beta=0.5, chunk_size=7)
    torch.testing.assert_close(sums.loss.detach(), 9.0 * sums.divergence, **TOL)
    expected = unchunked_grads(x, reference_kd(x, alpha=1.0, temperature=3.0, beta=0.5))
    assert_close_all((sums.loss.detach(), g_hidden, g_weight), expected)


def test_all_labels_ignored_gives_zero() -> None:
    x = make_inputs(5)
    x["labels"] = torch.full((N,), IGNORE_INDEX)
    sums, g_hidden, g_weight = chunked(x, alpha=0.5, temperature=1.0, beta=0.5, chunk_size=7)
    assert sums.loss == 0 and sums.tokens == 0
    assert not g_hidden.any() and not g_weight.any()


def top_k(x: dict[str, torch.Tensor], k: int) -> TeacherTopK:
    """What a teacher cache holds: the k largest log-probs at temperature 1 and their token ids."""
    logprobs, ids = torch.log_softmax(teacher_logits(x), dim=-1).topk(k, dim=-1)
    return TeacherTopK(ids, logprobs)


@pytest.mark.parametrize("beta", (0.0, 0.5, 1.0))
def test_top_k_with_the_whole_vocabulary_is_exact(beta: float) -> None:
    x = make_inputs(6)
    options = {"alpha": 0.4, "temperature": 1.7, "beta": beta, "chunk_size": 7}
    full = chunked(x, **options)
    assert_close_all(chunked(x, teacher=top_k(x, VOCAB), **options), full)


@pytest.mark.parametrize("beta", (0.0, 0.5, 1.0))
def test_top_k_is_the_renormalized_restriction(beta: float) -> None:
    """k < V: D between teacher and student each restricted to the teacher's top k and renormalized."""
    x = make_inputs(7)
    alpha, temperature, k = 0.4, 1.7, 5
    cache = top_k(x, k)
    mask = x["labels"] != IGNORE_INDEX
    t_log = torch.log_softmax(cache.logprobs / temperature, dim=-1)

    def loss(logits):
        s_log = torch.log_softmax(logits.gather(1, cache.ids) / temperature, dim=-1)
        p_s, p_t = s_log.exp(), t_log.exp()
        log_m = (beta * p_t + (1 - beta) * p_s).log()
        d = {
            0.0: (p_t * (t_log - s_log)).sum(-1),
            1.0: (p_s * (s_log - t_log)).sum(-1),
        }.get(beta, (beta * p_t * (t_log - log_m) + (1 - beta) * p_s * (s_log - log_m)).sum(-1))
        return (1 - alpha) * ce_sum(logits, x["labels"]) + alpha * temperature**2 * (d * mask).sum()

    sums, g_hidden, g_weight = chunked(x, teacher=cache, alpha=alpha, temperature=temperature, beta=beta, chunk_size=7)
    assert_close_all((sums.loss.detach(), g_hidden, g_weight), unchunked_grads(x, loss))


def test_float32_under_autocast_matches_float64() -> None:
    """Under CPU autocast (bfloat16 matmuls) the result stays near the exact float64 one."""
    x = make_inputs(8)
    options = {"alpha": 0.5, "temperature": 2.0, "beta": 0.5, "chunk_size": 7}
    exact = chunked(x, **options)
    low = {key: (v.float() if v.is_floating_point() else v) for key, v in x.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        approx = chunked(low, **options)
    assert approx[1].dtype == torch.float32 and approx[2].dtype == torch.float32
    torch.testing.assert_close(approx[0].loss.double(), exact[0].loss, rtol=2e-2, atol=0)
    torch.testing.assert_close(approx[1].double(), exact[1], rtol=0.1, atol=0.1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"alpha": 1.5}, "alpha must be in"),
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"beta": -0.1}, "beta must be in"),
        ({"chunk_size": 0}, "chunk_size must be >= 1"),
    ],
)
def test_bad_settings_are_refused(change: dict, message: str) -> None:
    x = make_inputs()
    options = {"alpha": 0.5, "temperature": 1.0, "beta": 0.5, "chunk_size": 7} | change
    with pytest.raises(ValueError, match=message):
        linear_distillation_sum(x["hidden"], x["weight"], x["labels"], (x["t_hidden"], x["t_weight"]), **options)


def test_teacher_with_another_vocabulary_is_refused() -> None:
    x = make_inputs()
    with pytest.raises(ValueError, match=r"teacher's vocabulary \(30 output rows\) differs from the student's \(29\)"):
        linear_distillation_sum(
            x["hidden"],
            x["weight"],
            x["labels"],
            (x["t_hidden"], torch.randn(VOCAB + 1, D_TEACHER, dtype=torch.float64)),
            alpha=0.5,
            temperature=1.0,
            beta=0.5,
            chunk_size=7,
        )
