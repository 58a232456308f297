"""Batched generation with a KV cache: sampling or greedy, stop ids, per-row finish, per-token log-probs.

The prompts are left-padded into one ``[B, L]`` batch so that every row's next token sits in the last
column: one prefill call fills the cache, then each step feeds one token per row. The padding is a
document of its own (``PAD_DOCUMENT``, -1) and the prompt with its answer is document 1, with positions starting at
0 at the first real token, so the document-causal mask keeps padding invisible and every row is
computed exactly as if it were alone (see ``titanium.models.common.kv_cache``).

Under FSDP every forward is a collective, so all ranks must run the same number of forwards: a rank
whose rows are done keeps stepping until every rank agrees to stop (``all_ranks_done``). Each block's
weights are gathered only while it runs, as in training; the whole model is never gathered.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from titanium.batch import ImageInputs
from titanium.generation.sampling import SamplingParams, sample
from titanium.generation.static_cache import StaticKVCache
from titanium.models.common.kv_cache import PAD_DOCUMENT, KVCache

PROMPT_DOCUMENT = 1


@dataclass(frozen=True)
class Generation:
    """What ``generate`` produced for a batch of B prompts, after T decoding steps."""

    tokens: torch.Tensor
    """``[B, T]`` generated ids (T <= max_new_tokens: the steps run); ``pad_id`` after a row's end."""
    logprobs: torch.Tensor
    """``[B, T]`` float32 log-prob of each generated token (convention in ``sampling``); 0 after a row's end."""
    lengths: torch.Tensor
    """``[B]`` tokens generated per row, its stop id included."""
    finished: torch.Tensor
    """``[B]`` True where the row ended with a stop id; False where max_new_tokens cut it (truncated)."""

    def mask(self) -> torch.Tensor:
        """``[B, T]`` True on each row's generated tokens (stop id included)."""
        steps = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        return steps[None, :] < self.lengths[:, None]

    def token_lists(self, keep_stop: bool = False) -> list[list[int]]:
        """Each row's generated ids (a host copy), without the final stop id unless ``keep_stop``."""
        ends = (self.lengths - (self.finished & (not keep_stop)).long()).tolist()
        return [row[:end] for row, end in zip(self.tokens.tolist(), ends)]


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


def all_ranks_done(group: dist.ProcessGroup | None, device: torch.device | str) -> Callable[[bool], bool]:
    """An ``all_done`` for ``generate`` under data parallelism: stop only when every rank of ``group`` is done."""

    def decide(done: bool) -> bool:
        flag = torch.tensor([0 if done else 1], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return not bool(flag.item())

    return decide


@contextmanager
def _last_position_logits(model: nn.Module) -> Iterator[None]:
    """During prefill only the last position's logits are needed: hand only it to the final norm.

    The norm and the output projection work position by position, so the result is unchanged, and
    the prefill never holds a ``[B, L, vocab]`` float32 tensor (20 GB for 64 prompts of 512 tokens
    with a 150k vocabulary). Models without a final ``norm`` (test stubs) compute every position.
    """
    norm = getattr(model, "norm", None)
    if not isinstance(norm, nn.Module):
        yield
        return
    handle = norm.register_forward_pre_hook(lambda _, args: (args[0][:, -1:], *args[1:]))
    try:
        yield
    finally:
        handle.remove()


def _decode_step(
    model: nn.Module, token: torch.Tensor, positions: torch.Tensor, document_ids: torch.Tensor, cache: KVCache
) -> torch.Tensor:
    """Next-token logits ``[B, V]`` after feeding one token per row."""
    return model(token, positions=positions, document_ids=document_ids, kv_cache=cache)[:, -1]


@functools.cache
def _compiled_decode_step() -> Callable[..., torch.Tensor]:
    # One graph for every step (static cache shapes); a new model only adds a guard, not a step-wise recompile.
    return torch.compile(_decode_step, dynamic=False)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    stop_ids: set[int],
    pad_id: int,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    all_done: Callable[[bool], bool] | None = None,
    compile: bool = False,
    also_stop: Callable[[torch.Tensor], torch.Tensor] | None = None,
    images: ImageInputs | None = None,
) -> Generation:
    """Continue every prompt by up to ``params.max_new_tokens`` tokens, each row until its first stop id.

    One prefill call, then one call per further token: at most ``max_new_tokens`` forwards. Decoding
    ends early once every row has produced a stop id, if ``all_done`` agrees: it turns this rank's
    "all my rows stopped" into the decision to stop (``all_ranks_done`` under data parallelism; the
    default trusts the local rows; ``lambda _: False`` always runs ``max_new_tokens`` steps).
    ``generator`` (on ``device``) makes sampling reproducible. ``compile`` runs the decode step through
    ``torch.compile`` with a static cache (meant for GPUs; the prefill stays eager). ``also_stop`` ends rows on
    more than stop ids: given each step's ``[B]`` tokens it returns the ``[B]`` rows that end with them (a stop
    string completed); such a row counts as finished (``token_lists(keep_stop=True)`` keeps the token that ended it).
    ``images``: the prompts' images (``titanium.batch.ImageInputs``, an image-text model's), read by the prefill; their
    per-token fields laid out like the left-padded prompts (``titanium.rl.rollout.prompt_image_rows``).

    ``device`` defaults to the device of the model's first parameter. The caller sets ``eval()``.
    """
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs non-empty prompts (at least a BOS or header token)")
    if device is None:
        device = next(model.parameters()).device
    batch, max_new = len(prompts), params.max_new_tokens
    if batch == 0 or max_new == 0:
        empty = torch.zeros(batch, 0, dtype=torch.long, device=device)
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        return Generation(empty, empty.float(), zeros, zeros.bool())
    decide = all_done if all_done is not None else (lambda done: done)

    check_room(model, max(len(p) for p in prompts), max_new)
    tokens, positions, document_ids = left_pad(prompts, pad_id, device)
    if images is not None and any(images.fields[k].shape[1] != tokens.shape[1] for k in images.per_token()):
        raise ValueError("generate's per-token image fields must be as wide as the left-padded prompts")
    cache = (StaticKVCache if compile else KVCache)(model.layers.keys(), tokens.shape[1] + max_new - 1)
    with _last_position_logits(model):
        seen = {} if images is None else {"images": images.map(lambda t: t.to(device))}
        logits = model(tokens, positions=positions, document_ids=document_ids, kv_cache=cache, **seen)[:, -1]
    step_fn = _compiled_decode_step() if compile else _decode_step
    next_positions = positions[:, -1:] + 1
    next_documents = torch.full_like(next_positions, PROMPT_DOCUMENT)
    stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    out_tokens: list[torch.Tensor] = []
    out_logprobs: list[torch.Tensor] = []
    for step in range(max_new):
        token, logprob = sample(logits, params, generator)
        token, logprob = token.masked_fill(done, pad_id), logprob.masked_fill(done, 0.0)
        out_tokens.append(token)
        out_logprobs.append(logprob)
        lengths += ~done
        done |= torch.isin(token, stop)
        if also_stop is not None:
            done |= also_stop(token)
        if step == max_new - 1 or decide(bool(done.all())):
            break
        logits = step_fn(model, token[:, None], next_positions, next_documents, cache)
        next_positions = next_positions + 1
    return Generation(torch.stack(out_tokens, 1), torch.stack(out_logprobs, 1), lengths, done)
