"""Choosing the next token from logits: temperature, top-k, top-p, and the log-prob convention.

The log-prob convention (what GRPO's importance ratio compares): a token's log-prob is its log-prob
under the temperature-scaled distribution over the *whole* vocabulary, ``log_softmax(logits / T)``,
whatever top-k / top-p did. The training forward can compute exactly that from its own logits
(``token_logprobs``), so at the first update the ratio of new to old policy is 1 up to rounding, as
the algorithm assumes; the filters only decide which tokens may be drawn (TRL and verl do the same).
Greedy decoding (``temperature == 0``) reports ``log_softmax(logits)``, i.e. temperature 1.

Sampling draws with the exponential race (``argmax(p / E)`` with ``E ~ Exp(1)``), which picks token
``i`` with probability ``p_i`` without a device sync, and takes one ``[B, V]`` draw per step from the
given ``torch.Generator``: the same seed gives the same tokens, with or without a KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens: ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` are off."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0 or self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"invalid sampling parameters: {self}")


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row (ties with the k-th are kept too), the rest -> -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities add up to at least ``p``.

    A token is dropped when the tokens strictly more likely than it already reach ``p``; the most
    likely token always stays.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above each one
    drop_sorted = before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / T)`` at ``tokens`` (shape of ``tokens``), in float32; T == 0 counts as 1.

    Gathers one logit and subtracts the log-sum-exp, so no second ``[..., V]`` tensor is kept.
    """
    scaled = logits.float()
    if temperature > 0 and temperature != 1.0:
        scaled = scaled / temperature
    picked = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy ``[...]`` of the temperature-scaled next-token distributions of ``logits`` ``[..., V]`` (a metric:
    call it under ``no_grad``; it holds one more ``[..., V]`` float32 tensor)."""
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    logp = torch.log_softmax(scaled, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def masked_entropy_sum(logits: torch.Tensor, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """Sum of ``token_entropy`` over the masked positions of ``logits`` ``[B, T, V]``, one row at a time (a
    metric: it never holds more than one row's ``[T, V]`` temporaries)."""
    total = torch.zeros((), device=logits.device)
    for row in range(logits.shape[0]):
        total += (token_entropy(logits[row], temperature) * mask[row]).sum()
    return total


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, logprobs)``, each ``[B]``, for next-token logits ``[B, V]``."""
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(dim=-1)
    else:
        scaled = logits / params.temperature
        probs = torch.softmax(filter_top_p(filter_top_k(scaled, params.top_k), params.top_p), dim=-1)
        race = torch.empty_like(probs).exponential_(1.0, generator=generator)
        # A draw of exactly 0 would make a filtered token's 0 / 0 a NaN, which argmax would pick.
        tokens = (probs / race.clamp_min_(torch.finfo(race.dtype).tiny)).argmax(dim=-1)
    return tokens, token_logprobs(logits, tokens, params.temperature)
