"""The knowledge-distillation loss ``(1 - alpha) * CE + alpha * T^2 * D``, chunk by chunk from hidden states.

For each labelled token, CE is the student's cross-entropy against the label (at temperature 1) and D a
divergence between the teacher's and the student's next-token distributions, both softened by the temperature
``T`` (``softmax(logits / T)``). ``T^2`` keeps D's gradient on the scale of CE's as T grows (Hinton et al.).

D follows the generalized Jensen-Shannon divergence of GKD (Agarwal et al., eq. 1) with TRL's conventions
(``GKDTrainer.generalized_jsd_loss``): with ``M = beta * P_teacher + (1 - beta) * P_student``,
``D = beta * KL(P_teacher || M) + (1 - beta) * KL(P_student || M)`` for ``0 < beta < 1``; ``beta = 0`` is
the forward KL ``KL(P_teacher || P_student)`` and ``beta = 1`` the reverse KL ``KL(P_student || P_teacher)``
(the two ends TRL special-cases: the formula itself would give 0 there). torchtune's ``ForwardKLLoss`` is the
cross-entropy ``-sum P_teacher log P_student``: the forward KL plus the teacher's entropy, a constant of the student
(the same gradients; its value larger by that entropy).

Like the chunked cross-entropy (``cross_entropy.py``), the two ``[tokens, vocab]`` logit matrices never exist
whole: the student's and the teacher's final hidden states are projected ``chunk_size`` tokens at a time, and
the backward recomputes each chunk's logits (one student and one teacher matmul more) instead of keeping them;
only one chunk's logits are alive at any moment. The gradients are written out by hand in the backward.

With precomputed teacher top-k log-probs (``TeacherTopK``) there is no teacher projection: D is taken between
the teacher and the student each restricted to the teacher's k most likely tokens and renormalized there (TRL's
server-distillation sparse path without its tail bucket). What that approximates: the teacher's mass outside
its top k is dropped and the rest rescaled, and the student's mass outside those k tokens is invisible to D
(it neither pays nor gains; CE still sees it when ``alpha < 1``). With k equal to the vocabulary size it is
exact. Temperature needs no second cache: the k log-probs at temperature 1, divided by T and renormalized over
the k tokens, are exactly the tempered teacher restricted to the same k tokens (top-k order does not change
with T).

Under pipeline parallelism the last stage hands the loss whole logits (its output projection runs inside the
stage), and the teacher's pipeline gives its logits there too: ``distillation_sum`` takes the same loss from the
two logit tensors, by autograd, with the same divergences.

The result is a sum over labelled tokens, as every titanium loss: the loop divides by the global count.
Rows whose label is ``IGNORE_INDEX`` count zero; callers should still drop them before the call, as the
chunked cross-entropy does (``LABEL_INDEX``), so they never reach the projections.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor

from titanium.objectives.base import IGNORE_INDEX


class TeacherTopK(NamedTuple):
    """A teacher's k most likely next tokens per row, precomputed: ``ids [N, k]`` and their log-probs at
    temperature 1 (``log_softmax`` over the full vocabulary), ``logprobs [N, k]``, every entry finite."""

    ids: torch.Tensor
    logprobs: torch.Tensor


class DistillSums(NamedTuple):
    """The loss summed over the labelled tokens (differentiable), its two parts' sums for metrics (no
    gradient), and the number of labelled tokens."""

    loss: torch.Tensor
    cross_entropy: torch.Tensor
    divergence: torch.Tensor
    tokens: torch.Tensor


class _Terms(NamedTuple):
    """Per-chunk quantities shared by the forward and the backward (all in the compute dtype)."""

    logits: torch.Tensor  # [c, V] student logits after any soft-cap, temperature 1
    tanh: torch.Tensor | None  # [c, V] tanh(z / cap) of the student's soft-cap, for its derivative
    student: torch.Tensor  # [c, S] student log-probs at temperature T on the support (S = V, or k)
    teacher: torch.Tensor  # [c, S] teacher log-probs at temperature T on the same support


def _project(hidden: torch.Tensor, weight: torch.Tensor, softcap: float | None, dtype: torch.dtype):
    """``hidden @ weight.T`` in ``dtype`` (float32 at least), soft-capped as the model's forward would: the capped
    logits and the ``tanh`` behind the cap (None without one)."""
    logits = (hidden @ weight.t()).to(dtype)
    if softcap is None:
        return logits, None
    tanh = torch.tanh(logits / softcap)
    return tanh * softcap, tanh


def _terms(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    softcap: float | None,
    teacher: TeacherTopK | tuple[torch.Tensor, torch.Tensor, float | None],
    temperature: float,
    dtype: torch.dtype,
) -> _Terms:
    """The student's logits and both tempered log-prob rows for one chunk. ``teacher`` is ``(hidden, weight,
    softcap)`` of the teacher's projection, or a ``TeacherTopK`` slice."""
    logits, tanh = _project(hidden, weight, softcap, dtype)
    if isinstance(teacher, TeacherTopK):
        student = torch.log_softmax(logits.gather(1, teacher.ids) / temperature, dim=-1)
        teacher_lp = torch.log_softmax(teacher.logprobs.to(dtype) / temperature, dim=-1)
    else:
        student = torch.log_softmax(logits / temperature, dim=-1)
        teacher_logits, _ = _project(*teacher, dtype)
        teacher_lp = torch.log_softmax(teacher_logits / temperature, dim=-1)
    return _Terms(logits, tanh, student, teacher_lp)


def _mixture(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """log M for M = beta * P_teacher + (1 - beta) * P_student (0 < beta < 1)."""
    return torch.logaddexp(student + math.log1p(-beta), teacher + math.log(beta))


def _divergence(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """D per row (see the module docstring) from log-probs on a common support."""
    if beta == 0:
        return (teacher.exp() * (teacher - student)).sum(-1)
    if beta == 1:
        return (student.exp() * (student - teacher)).sum(-1)
    log_m = _mixture(student, teacher, beta)
    return (beta * teacher.exp() * (teacher - log_m) + (1 - beta) * student.exp() * (student - log_m)).sum(-1)


def _divergence_grad(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """dD/ds for the student's tempered logits s (``student = log_softmax(s)``).

    Through the softmax, ``dD/ds = p * (g - sum(p * g))`` with ``p = P_student`` and ``g = dD/dp``:
    ``g = -P_teacher / p`` (forward KL, which leaves ``p - P_teacher``), ``g = log p - log P_teacher + 1``
    (reverse KL; the constant cancels) and ``g = (1 - beta) * (log p - log M)`` for the JSD (the terms from
    M's dependence on p sum to a constant, which cancels).
    """
    p = student.exp()
    if beta == 0:
        return p - teacher.exp()
    g = student - teacher if beta == 1 else (1 - beta) * (student - _mixture(student, teacher, beta))
    return p * (g - (p * g).sum(-1, keepdim=True))


class _LinearDistillation(torch.autograd.Function):
    """The summed KD loss over tokens, chunk by chunk; logits recomputed in the backward (module docstring).

    ``teacher_a, teacher_b`` are the teacher's hidden states and output weight, or (``topk``) its top-k ids and
    log-probs. Saved for backward: the inputs only. Gradients flow to the student's hidden states and output
    weight; the teacher's inputs get none.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, teacher_a, teacher_b, topk, teacher_softcap, settings, softcap):
        alpha, temperature, beta, chunk_size = settings
        teacher = TeacherTopK(teacher_a, teacher_b) if topk else (teacher_a, teacher_b, teacher_softcap)
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        ce_total = torch.zeros((), device=hidden.device, dtype=dtype)
        d_total = torch.zeros((), device=hidden.device, dtype=dtype)
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            t = _terms(hidden[start:end], weight, softcap, _rows(teacher, start, end), temperature, dtype)
            labels = targets[start:end]
            mask = labels != IGNORE_INDEX
            target_logits = t.logits.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
            ce_total += ((torch.logsumexp(t.logits, dim=-1) - target_logits) * mask).sum()
            d_total += (_divergence(t.student, t.teacher, beta) * mask).sum()
            del t
        ctx.save_for_backward(hidden, weight, targets, teacher_a, teacher_b)
        ctx.topk, ctx.teacher_softcap, ctx.settings, ctx.softcap = topk, teacher_softcap, settings, softcap
        ctx.mark_non_differentiable(ce_total, d_total)
        loss = (1 - alpha) * ce_total + alpha * temperature**2 * d_total
        return loss, ce_total, d_total

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_d):
        hidden, weight, targets, teacher_a, teacher_b = ctx.saved_tensors
        teacher = TeacherTopK(teacher_a, teacher_b) if ctx.topk else (teacher_a, teacher_b, ctx.teacher_softcap)
        alpha, temperature, beta, chunk_size = ctx.settings
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            chunk, part = hidden[start:end], _rows(teacher, start, end)
            t = _terms(chunk, weight, ctx.softcap, part, temperature, dtype)
            labels = targets[start:end]
            # CE: (softmax(z) - onehot(label)) * (1 - alpha)
            grad_logits = torch.softmax(t.logits, dim=-1).mul_(1 - alpha)
            rows = torch.arange(chunk.shape[0], device=chunk.device)
            grad_logits[rows, labels.clamp(min=0)] -= 1 - alpha
            # alpha * T^2 * dD/dz, where dD/dz = dD/ds / T for the tempered logits s = z / T
            grad_d = _divergence_grad(t.student, t.teacher, beta).mul_(alpha * temperature)
            if ctx.topk:
                grad_logits.scatter_add_(1, part.ids, grad_d)
            else:
                grad_logits += grad_d
            if t.tanh is not None:  # d (c tanh(z / c)) / dz = 1 - tanh(z / c)^2
                grad_logits.mul_(1 - t.tanh.square())
            del t, grad_d
            mask = (labels != IGNORE_INDEX).to(dtype)[:, None]
            grad_logits = grad_logits.mul_(mask * grad_loss).to(hidden.dtype)
            if need_hidden:
                grad_hidden[start:end] = grad_logits @ weight
            if need_weight:
                grad_weight.addmm_(grad_logits.t(), chunk)
            del grad_logits
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def _rows(teacher, start: int, end: int):
    """Rows ``start:end`` of the teacher's input (``(hidden, weight, softcap)`` or ``TeacherTopK``)."""
    if isinstance(teacher, TeacherTopK):
        return TeacherTopK(teacher.ids[start:end], teacher.logprobs[start:end])
    hidden, weight, softcap = teacher
    return hidden[start:end], weight, softcap


def linear_distillation_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    teacher: TeacherTopK | tuple[torch.Tensor, torch.Tensor],
    *,
    alpha: float,
    temperature: float,
    beta: float,
    chunk_size: int,
    softcap: float | None = None,
    teacher_softcap: float | None = None,
) -> DistillSums:
    """Summed ``(1 - alpha) * CE + alpha * T^2 * D`` over the tokens of ``hidden [N, d_s]`` (student, projected
    by ``weight [V, d_s]``) whose ``targets [N]`` are not IGNORE_INDEX, ``chunk_size`` tokens at a time.

    ``teacher`` is ``(hidden [N, d_t], weight [V, d_t])`` of the teacher's final projection (same rows as the
    student's), or precomputed ``TeacherTopK`` rows. ``beta``: 0 forward KL, 1 reverse KL, in between the
    generalized JSD (module docstring). ``softcap``/``teacher_softcap``: each model's final logit soft-cap
    (Gemma 2), if any. Under autocast the matmuls run in the autocast dtype, otherwise in each weight's; the
    softmax terms in float32 (float64 inputs stay float64). Raises ValueError when the two vocabularies differ.
    """
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0 <= beta <= 1:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if isinstance(weight, DTensor) or (not isinstance(teacher, TeacherTopK) and isinstance(teacher[1], DTensor)):
        raise ValueError("the distillation loss takes whole (not vocabulary-sharded) output projections")
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        weight, hidden = weight.to(dtype), hidden.to(dtype)
    else:
        hidden = hidden.to(weight.dtype)
    if isinstance(teacher, TeacherTopK):
        if teacher.ids.shape != teacher.logprobs.shape or teacher.ids.shape[0] != hidden.shape[0]:
            raise ValueError(
                f"teacher top-k ids {tuple(teacher.ids.shape)} and log-probs {tuple(teacher.logprobs.shape)} "
                f"must both be [{hidden.shape[0]}, k]"
            )
        if teacher.ids.shape[1] > weight.shape[0]:
            raise ValueError(f"teacher top-k k={teacher.ids.shape[1]} exceeds the vocabulary size {weight.shape[0]}")
    else:
        t_hidden, t_weight = teacher
        if t_weight.shape[0] != weight.shape[0]:
            raise ValueError(
                f"the teacher's vocabulary ({t_weight.shape[0]} output rows) differs from the student's "
                f"({weight.shape[0]}); distillation needs the same tokenizer and vocabulary size"
            )
        if t_hidden.shape[0] != hidden.shape[0]:
            raise ValueError(f"teacher rows {t_hidden.shape[0]} != student rows {hidden.shape[0]}")
        t_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else t_weight.dtype
        teacher = (t_hidden.detach().to(t_dtype), t_weight.detach().to(t_dtype))
    topk = isinstance(teacher, TeacherTopK)
    with torch.autocast(device, enabled=False):
        loss, ce, d = _LinearDistillation.apply(
            hidden, weight, targets, *teacher, topk, teacher_softcap, (alpha, temperature, beta, chunk_size), softcap
        )
    return DistillSums(loss, ce, d, (targets != IGNORE_INDEX).sum())


def distillation_sum(
    logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    alpha: float,
    temperature: float,
    beta: float,
) -> DistillSums:
    """``linear_distillation_sum``'s loss from logits that exist whole: the student's ``[..., V]`` (after any
    soft-cap, with gradient) and the teacher's ``[..., V]`` (constants), over the positions whose ``targets [...]``
    are not IGNORE_INDEX. In float32 (float64 stays float64); the gradient comes from autograd."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logits, teacher_logits = logits.flatten(0, -2).to(dtype), teacher_logits.detach().flatten(0, -2).to(dtype)
    targets = targets.flatten()
    mask = (targets != IGNORE_INDEX).to(dtype)
    target_logits = logits.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    ce = ((torch.logsumexp(logits, dim=-1) - target_logits) * mask).sum()
    student = torch.log_softmax(logits / temperature, dim=-1)
    teacher = torch.log_softmax(teacher_logits / temperature, dim=-1)
    d = (_divergence(student, teacher, beta) * mask).sum()
    loss = (1 - alpha) * ce + alpha * temperature**2 * d
    return DistillSums(loss, ce.detach(), d.detach(), (targets != IGNORE_INDEX).sum())
