"""Batched greedy decoding with a KV cache.

The prompts are left-padded into one ``[B, L]`` batch so that every row's next token sits in the last
column: one prefill call fills the cache, then each step feeds one token per row. The padding is a
document of its own (id 0) and the prompt with its answer is document 1, with positions starting at
0 at the first real token, so the document-causal mask keeps padding invisible and every row is
computed exactly as if it were alone (see ``titanium.models.common.kv_cache``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from titanium.models.common.kv_cache import KVCache

PAD_DOCUMENT, PROMPT_DOCUMENT = 0, 1


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens, positions, document_ids)``, each ``[B, L]``, for prompts right-aligned on ``L``.

    Padding gets position 0 and document 0; a prompt's tokens get positions ``0..n-1`` and document 1.
    """
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    positions = torch.zeros_like(tokens)
    document_ids = torch.full_like(tokens, PAD_DOCUMENT)
    for row, prompt in enumerate(prompts):
        n = len(prompt)
        tokens[row, width - n :] = torch.tensor(list(prompt), dtype=torch.long)
        positions[row, width - n :] = torch.arange(n)
        document_ids[row, width - n :] = PROMPT_DOCUMENT
    return tokens.to(device), positions.to(device), document_ids.to(device)


def check_room(model: nn.Module, longest_prompt: int, max_new_tokens: int) -> None:
    """Raise if a prompt plus its answer would run past the model's RoPE positions (``args.max_seq_len``)."""
    max_seq_len = getattr(getattr(model, "args", None), "max_seq_len", None)
    needed = longest_prompt + max_new_tokens - 1  # the last new token is never fed back
    if max_seq_len is not None and needed > max_seq_len:
        raise ValueError(
            f"a {longest_prompt}-token prompt plus {max_new_tokens} new tokens needs {needed} positions; "
            f"the model has {max_seq_len}"
        )


def _cut_at_stop(ids: list[int], stop_ids: set[int]) -> list[int]:
    for i, token in enumerate(ids):
        if token in stop_ids:
            return ids[:i]
    return ids


@torch.no_grad()
def greedy_generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_ids: set[int],
    pad_id: int,
    *,
    device: torch.device | str | None = None,
    all_done: Callable[[bool], bool] | None = None,
) -> list[list[int]]:
    """Greedy continuations of ``prompts``: the generated ids only, cut before the first stop id.

    One prefill call, then one call per further token: at most ``max_new_tokens`` forwards. Decoding
    ends early once every row has produced a stop id, if ``all_done`` agrees: it turns this rank's
    "all my rows stopped" into the decision to stop. Under FSDP every forward is a collective, so the
    ranks must decide together (all-reduce the flag; see ``ExactMatchEvaluator``); the default trusts
    the local rows, and ``all_done=lambda _: False`` always runs ``max_new_tokens`` steps.

    ``device`` defaults to the device of the model's first parameter. The caller sets ``eval()``.
    """
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("greedy_generate needs non-empty prompts (at least a BOS or header token)")
    if max_new_tokens <= 0:
        return [[] for _ in prompts]
    if device is None:
        device = next(model.parameters()).device
    decide = all_done if all_done is not None else (lambda done: done)

    check_room(model, max(len(p) for p in prompts), max_new_tokens)
    tokens, positions, document_ids = left_pad(prompts, pad_id, device)
    cache = KVCache(model.layers.keys(), tokens.shape[1] + max_new_tokens - 1)
    logits = model(tokens, positions=positions, document_ids=document_ids, kv_cache=cache)
    next_positions = positions[:, -1:] + 1
    stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    finished = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    steps: list[torch.Tensor] = []
    for step in range(max_new_tokens):
        token = logits[:, -1].argmax(dim=-1, keepdim=True)
        steps.append(token)
        finished |= torch.isin(token[:, 0], stop)
        if step == max_new_tokens - 1 or decide(bool(finished.all())):
            break
        doc = torch.full_like(token, PROMPT_DOCUMENT)
        logits = model(token, positions=next_positions, document_ids=doc, kv_cache=cache)
        next_positions = next_positions + 1
    generated = torch.cat(steps, dim=1).tolist()
    return [_cut_at_stop(row, stop_ids) for row in generated]
