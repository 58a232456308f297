"""Rollouts for on-policy RL: prompts -> ``group_size`` sampled responses each -> rewards -> a training batch.

The batch keeps generation's layout: each row is its prompt, left-padded to the batch's widest, then
its response, with the positions and document ids generation used. A training forward over
``model_inputs()`` therefore computes the very logits the tokens were sampled from (padding is a
document of its own; tokens after a row's end are padding, outside ``response_mask``), and
``response_logprobs`` of that forward equals ``old_logprobs`` until the policy changes.

A forward over some of the rows needs only the columns they use (``narrow``): from the first column holding a prompt
token of any of them to the last holding a response token of any of them, rounded up to a bucket. The columns cut
are left padding (a document of its own, which no real token sees) and steps after every response's end (which
causal attention hides from the tokens before them), so every kept log-prob is the same.

Prompts with images (an image-text model's): each row carries its prompt's image fields as loader-row entries
(``titanium.data.vision.image_rows``: ``image.<name>``, and ``image_count.<name>`` for fields not per token), the
per-token ones (Gemma 3's ``token_type_ids``) laid out like the tokens (left padding and the response hold 0; Llama 3.2
Vision's cross-attention mask continues over the response as the engine's decoding reads it: ``CONTINUED_FIELDS``), so
the engine's prefill and every forward over the rows read the same pixel values, image blocks and image masks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titanium.batch import Batch, Fields, ImageInputs, Placement, per_token
from titanium.data.packing import bucket_width
from titanium.data.prompts import PromptSample
from titanium.data.tokenizer import Tokenizer, decode_sampled
from titanium.data.vision import COUNT, FIELD, ProcessorLayout, image_rows, images_of
from titanium.generation.generate import PROMPT_DOCUMENT, Generation, generate, left_pad
from titanium.generation.sampling import SamplingParams, token_logprobs
from titanium.models.common.kv_cache import PAD_DOCUMENT
from titanium.rl.rewards.functions import Rewards, RewardSet

MODEL_INPUTS = ("tokens", "positions", "document_ids")
"""The keys of a rollout's model inputs (``Rollout.model_inputs``)."""


@dataclass(frozen=True)
class Rollout:
    """B = prompts x group_size responses; the responses to one prompt are contiguous rows."""

    tokens: torch.Tensor
    """``[B, P + T]`` prompt (left-padded to width P) then response (``pad_id`` after its end)."""
    positions: torch.Tensor
    """``[B, P + T]`` RoPE positions: 0 at each prompt's first token, continuing into the response."""
    document_ids: torch.Tensor
    """``[B, P + T]`` 0 on left padding, 1 on the prompt and the response."""
    prompt_width: int
    """P: where the responses start."""
    response_mask: torch.Tensor
    """``[B, T]`` True on generated tokens (a final stop id included): the tokens that carry loss. In a multi-turn
    episode the environment's tokens between the policy's turns are False (holes in the mask)."""
    finished: torch.Tensor
    """``[B]`` True where the response ended with a stop id; False: truncated at max_new_tokens."""
    old_logprobs: torch.Tensor
    """``[B, T]`` log-probs of the response tokens under the policy that sampled them (0 outside the mask)."""
    rewards: Rewards
    completions: list[str]
    """The decoded responses, without their stop id (of a multi-turn episode: its last policy turn, the answer)."""
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-response ``[B]`` numbers of multi-turn episodes (turns, tool calls...: ``titanium.rl.episodes``)."""
    transcripts: list[str] | None = None
    """Multi-turn episodes: each whole episode after its prompt, decoded (policy and environment turns), for logs."""
    images: dict[str, torch.Tensor] = field(default_factory=dict)
    """The prompts' image fields as loader-row entries (module docstring); empty for text prompts."""

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The model's inputs over prompt + response as rows: tokens, positions, document ids and image entries."""
        return {**dict(zip(MODEL_INPUTS, (self.tokens, self.positions, self.document_ids))), **self.images}


CONTINUED_FIELDS = frozenset({"cross_attention_mask"})
"""Per-token image fields whose value at a prompt's last token carries on over the tokens generated after it: Llama
3.2 Vision's cross-attention mask (the processor runs the last image's span to the end of the text, and
``transformers``' generation repeats the mask's last row), so a response token sees the images the prompt's last
token sees, in the engine's decoding and in every forward over the rollout rows. The other per-token fields (Gemma 3's
``token_type_ids``, Qwen's ``mm_token_type_ids``) mark the prompt's image tokens and are 0 after the prompt."""


def prompt_image_rows(
    samples: Sequence[PromptSample], group_size: int, width: int, layout: ProcessorLayout | None
) -> dict[str, torch.Tensor]:
    """The image entries of ``group_size`` rows per sample whose prompts are left-padded as ``left_pad`` pads them
    (to the longest prompt) and then run to ``width`` columns: per-token fields shifted right by each prompt's
    padding, 0 on the padding and after the prompt (``CONTINUED_FIELDS``: the prompt's last value after it). Empty
    without a ``layout`` or without images."""
    if layout is None or all(s.images is None for s in samples):
        return {}
    longest = max(len(s.prompt) for s in samples)
    shifted = []
    for sample in samples:
        pad, fields = longest - len(sample.prompt), dict(sample.images or {})
        for name in layout.token & fields.keys():
            value = fields[name]
            after = value[-1:].expand(width - longest if name in CONTINUED_FIELDS else 0, *value.shape[1:])
            fields[name] = torch.cat([value.new_zeros((pad, *value.shape[1:])), value, after])
        shifted += [{"images": fields}] * group_size
    return image_rows(shifted, width, layout)


def rollout_images(rows: Mapping[str, torch.Tensor]) -> ImageInputs | None:
    """The ``ImageInputs`` of some rows of a rollout (their image entries), or None for text rows."""
    return images_of(rows) if any(key.startswith(FIELD) for key in rows) else None


def image_inputs(rows: Mapping[str, torch.Tensor]) -> dict[str, ImageInputs]:
    """``{"images": ...}``, the keyword a forward or the engine's prefill over some rows of a rollout takes their
    images by (``rollout_images``), or nothing for text rows: a text model's forward takes no ``images``."""
    images = rollout_images(rows)
    return {"images": images} if images is not None else {}


def response_logprobs(logits: torch.Tensor, tokens: torch.Tensor, width: int, temperature: float) -> torch.Tensor:
    """``[B, T]`` log-probs of the last ``width`` (T) tokens of ``tokens`` ``[B, P + T]`` (the responses of a
    rollout) from the logits ``[B, P + T, V]`` of a forward over them (the logits at i predict token i + 1)."""
    return token_logprobs(logits[:, -width - 1 : -1], tokens[:, -width:], temperature)


WHOLE_ROWS = Placement()
"""Every rank holds whole rows (no context parallelism): nothing to place or complete."""


@dataclass
class ResponseTargets(Fields):
    """What a rank holding only its part of each row (context parallelism) needs to find its response log-probs:
    per position, the token that follows it and the response slot that token fills (-1: none)."""

    targets: torch.Tensor = per_token()
    slots: torch.Tensor = per_token()


def split_ready(rows: dict[str, torch.Tensor], width: int, multiple: int, pad_id: int) -> dict[str, torch.Tensor]:
    """``rows`` of a rollout batch made ready for a split over context-parallel ranks: the prompts left-padded
    further (padding is a document of its own, as in ``left_pad``) so the width divides by ``multiple``, and the
    ``ResponseTargets`` of the last ``width`` tokens added as ``targets`` and ``slots``."""
    tokens = rows["tokens"]
    pad = -tokens.shape[1] % multiple
    if pad:
        fill = {"tokens": pad_id, "positions": 0, "document_ids": PAD_DOCUMENT}
        rows = {**rows, **{k: F.pad(rows[k], (pad, 0), value=v) for k, v in fill.items()}}
        tokens = rows["tokens"]
    seq = tokens.shape[1]
    slots = torch.full_like(tokens, -1)
    slots[:, seq - width - 1 : seq - 1] = torch.arange(width, device=tokens.device)
    return {**rows, "targets": F.pad(tokens[:, 1:], (0, 1), value=pad_id), "slots": slots}


def local_responses(
    logits: torch.Tensor, tokens: torch.Tensor, width: int, parts: ResponseTargets | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(logits [B, n, V], next tokens [B, n], slots [n] or None)``: the positions of this rank's logits that
    predict response tokens. Whole rows (``parts`` None): the last ``width`` positions before the end, a view.
    This rank's part of each row (``split_ready``): the positions whose slot is set (the same for every row, as
    all rows share one width), and the slots they fill."""
    if parts is None:
        return logits[:, -width - 1 : -1], tokens[:, -width:], None
    columns = (parts.slots[0] >= 0).nonzero().squeeze(1)
    return _columns(logits, columns), parts.targets[:, columns], parts.slots[0, columns]


def _columns(logits: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``logits[:, columns]``, differentiably; vocabulary-sharded logits (tensor parallelism's loss parallel, a
    DTensor: advanced indexing is not one of its operators) picked on each rank's shard, sharded as before."""
    if not isinstance(logits, DTensor):
        return logits[:, columns]
    assert all(not p.is_shard(1) for p in logits.placements), "the sequence dim is whole on every rank"
    local = logits.to_local()[:, columns]
    shape = (logits.shape[0], len(columns), logits.shape[2])
    return DTensor.from_local(
        local, logits.device_mesh, logits.placements, shape=shape, stride=torch.empty(shape, device="meta").stride()
    )


def whole_responses(values: torch.Tensor, slots: torch.Tensor | None, width: int, placement: Placement) -> torch.Tensor:
    """``[B, T]`` per-token ``values`` ``[B, n]`` of ``local_responses`` in place in every response, completed from
    every rank's part (differentiably: ``Placement.add_parts``); whole rows as they are."""
    if slots is None:
        return values
    return placement.add_parts(values.new_zeros(values.shape[0], width).index_copy(1, slots, values))


def response_parts(fields: object) -> ResponseTargets | None:
    """A microbatch's ``ResponseTargets`` under context parallelism (its fields' ``targets`` and ``slots``), else
    None (whole rows)."""
    targets, slots = getattr(fields, "targets", None), getattr(fields, "slots", None)
    return None if targets is None or slots is None else ResponseTargets(targets, slots)


def trained_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    width: int,
    parts: ResponseTargets | None,
    placement: Placement,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(local logits [B, n, V], log-probs [B, T], slots)`` of a training forward's ``logits`` over a rollout
    microbatch: the response tokens' logits (at i predict token i + 1) of this rank's part under context
    parallelism (``local_responses``), made whole if vocabulary-sharded (loss parallel), and their tokens'
    log-probs completed over the cp group (``whole_responses``). The local logits and slots serve per-token
    metrics on this rank's part (entropy)."""
    local, next_tokens, slots = local_responses(logits, tokens, width, parts)
    if isinstance(local, DTensor):
        local = local.full_tensor()
    return local, whole_responses(token_logprobs(local, next_tokens, temperature), slots, width, placement), slots


def narrow(rows: Mapping[str, torch.Tensor], mask: torch.Tensor, pad_multiple: int) -> dict[str, torch.Tensor]:
    """``rows`` of a rollout (``MODEL_INPUTS`` ``[B, P + T]``, response-aligned ``[B, T]`` tensors, any others)
    with only the columns they use (the module docstring): the model inputs keep columns ``[s, e)``, the
    response-aligned tensors their first ``e - P``, where ``mask`` ``[B, T]`` marks the response tokens needed. The
    width ``e - s`` is the used span rounded up by ``bucket_width`` (a multiple of ``pad_multiple``), or the full
    width. One host sync."""
    full, width = rows["tokens"].shape[1], mask.shape[1]
    prompt_width = full - width
    columns = (rows["document_ids"] != PAD_DOCUMENT).any(0).int().argmax()  # (every row has a prompt token)
    steps = mask.any(0).flip(0).int().argmax()
    first, unused_steps, masked = torch.stack([columns, steps, mask.any().int()]).tolist()
    end = prompt_width + (width - unused_steps if masked else 1)
    kept = bucket_width(end - first, full, pad_multiple)
    end = max(end, kept)  # (a bucket wider than the columns before the end takes columns after it)
    start, response = end - kept, end - prompt_width
    out = {}
    for key, value in rows.items():
        if key in MODEL_INPUTS or _per_token_image_field(key, rows):
            out[key] = value[:, start:end]
        elif value.dim() == 2 and value.shape[1] == width:
            out[key] = value[:, :response]
        else:
            out[key] = value
    return out


def _per_token_image_field(key: str, rows: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``key`` is a per-token image field (laid out like the tokens: the only image entries without a
    count)."""
    return key.startswith(FIELD) and COUNT + key.removeprefix(FIELD) not in rows


@torch.no_grad()
def batch_logprobs(
    forward: Callable[[dict[str, torch.Tensor]], torch.Tensor | None],
    rows: Mapping[str, torch.Tensor],
    width: int,
    temperature: float,
    batch_size: int,
    placement: Placement = WHOLE_ROWS,
    mask: torch.Tensor | None = None,
    pad_multiple: int = 8,
) -> torch.Tensor | None:
    """``[B, T]`` log-probs of the responses (the last ``width`` tokens) of a rollout batch's ``rows`` under
    ``forward`` (model inputs -> logits: a frozen reference, or the trained policy recomputing the old log-probs),
    ``batch_size`` rows per forward; None where ``forward`` gives no logits (pipeline ranks without the last
    stage). With a ``placement`` that splits rows (context parallelism; ``rows`` made ``split_ready``) each forward
    runs on this rank's part of the rows and the log-probs are completed from every rank's. Else, with ``mask``
    ``[B, T]`` each forward runs on the columns its rows use (``narrow`` by their ``mask`` rows, ``pad_multiple``);
    the log-probs past its last masked column are 0."""
    assert mask is None or not placement.split, "rows split over context-parallel ranks keep their whole width"
    parts = []
    for start in range(0, rows["tokens"].shape[0], batch_size):  # (every forward runs: a pipeline's are collective)
        part, response = {k: v[start : start + batch_size] for k, v in rows.items()}, width
        if mask is not None:
            rows_mask = mask[start : start + batch_size]
            part = narrow({**part, "mask": rows_mask}, rows_mask, pad_multiple)
            response = part.pop("mask").shape[1]
        fields = ResponseTargets(part["targets"], part["slots"]) if placement.split else Fields()
        batch = Batch(part["tokens"], fields, part["positions"], part["document_ids"], images=rollout_images(part))
        if placement.split:
            batch = placement.place(batch)
        logits = forward(batch.model_inputs())
        if logits is not None:
            parts_of_rows = batch.fields if isinstance(batch.fields, ResponseTargets) else None
            local, next_tokens, slots = local_responses(logits, batch.tokens, response, parts_of_rows)
            logprobs = whole_responses(token_logprobs(local, next_tokens, temperature), slots, response, placement)
            parts.append(F.pad(logprobs, (0, width - response)))
    return torch.cat(parts) if parts else None


def from_last_stage(
    out: torch.Tensor | None, shape: Sequence[int], group: dist.ProcessGroup | None, device: torch.device
) -> torch.Tensor:
    """A float32 result of ``shape`` that only a pipeline's last stage computed (``out`` there, None on the other
    ranks of the pipeline ``group``), the same on every rank of it: the others add zeros (one all-reduce). Without a
    group, ``out`` itself."""
    if group is None:
        assert out is not None, "no pipeline group, so this rank runs the last stage"
        return out
    whole = out if out is not None else torch.zeros(tuple(shape), dtype=torch.float32, device=device)
    dist.all_reduce(whole, group=group)
    return whole


@torch.no_grad()
def rollout(
    model: nn.Module,
    samples: Sequence[PromptSample],
    group_size: int,
    params: SamplingParams,
    rewards: RewardSet,
    tokenizer: Tokenizer,
    stop_ids: set[int],
    *,
    generator: torch.Generator | None = None,
    all_done: Callable[[bool], bool] | None = None,
    device: torch.device | str | None = None,
    compile: bool = False,
) -> Rollout:
    """Sample ``group_size`` responses to each prompt in one batch (eval mode), decode and score them.

    Under data parallelism every rank must call this with the same number of prompts and pass an
    ``all_done`` that agrees across ranks (``all_ranks_done``): generation is a collective under FSDP.
    """
    prompts = [s.prompt for s in samples for _ in range(group_size)]
    was_training = model.training
    model.eval()
    try:
        out = generate(
            model,
            prompts,
            params,
            stop_ids,
            tokenizer.pad_id,
            generator=generator,
            all_done=all_done,
            device=device,
            compile=compile,
        )
    finally:
        model.train(was_training)
    return to_rollout(samples, group_size, out, rewards, tokenizer)


def to_rollout(
    samples: Sequence[PromptSample],
    group_size: int,
    out: Generation,
    rewards: RewardSet,
    tokenizer: Tokenizer,
    layout: ProcessorLayout | None = None,
) -> Rollout:
    """The training batch of ``group_size`` generated responses per prompt (rows in ``rollout``'s order),
    decoded and scored; with an image-text model's processor ``layout``, each row with its prompt's images."""
    prompts = [s.prompt for s in samples for _ in range(group_size)]
    completions = [decode_sampled(tokenizer, ids) for ids in out.token_lists()]
    answers = [s.answer for s in samples for _ in range(group_size)]
    rows = [s.row for s in samples for _ in range(group_size)]
    prompt_tokens, prompt_positions, prompt_documents = left_pad(prompts, tokenizer.pad_id, out.tokens.device)
    steps = torch.arange(1, out.tokens.shape[1] + 1, device=out.tokens.device)
    return Rollout(
        tokens=torch.cat([prompt_tokens, out.tokens], dim=1),
        positions=torch.cat([prompt_positions, prompt_positions[:, -1:] + steps], dim=1),
        document_ids=torch.cat([prompt_documents, torch.full_like(out.tokens, PROMPT_DOCUMENT)], dim=1),
        prompt_width=prompt_tokens.shape[1],
        response_mask=out.mask(),
        finished=out.finished,
        old_logprobs=out.logprobs,
        rewards=rewards(completions, answers, rows),
        completions=completions,
        images=prompt_image_rows(samples, group_size, prompt_tokens.shape[1] + out.tokens.shape[1], layout),
    )


def check_peers_agree(tokens: torch.Tensor, data_rank: int) -> None:
    """Raise if ranks of one data-parallel rank (its tensor-, pipeline- and context-parallel peers, which generate
    from the same prompts, seed and weights) hold different rollout ``tokens``: under weights they keep identical
    they would train on different rows, silently. By construction they do not (deterministic kernels, or one set of
    logits gathered by a split engine); this checks it at run time. One all-gather of two numbers per rank (every
    rank of the job together; call it only when ranks share rows)."""
    flat = tokens.flatten().long()
    fingerprint = (flat * torch.arange(1, flat.numel() + 1, device=flat.device)).sum()  # (wraps around: fine)
    mine = torch.stack([torch.tensor(data_rank, device=flat.device), fingerprint])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    prints: dict[int, dict[int, list[int]]] = {}
    for rank, (shard, value) in enumerate(t.tolist() for t in everyone):
        prints.setdefault(shard, {}).setdefault(value, []).append(rank)
    for shard, ranks in prints.items():
        if len(ranks) > 1:
            raise RuntimeError(
                f"the ranks of data-parallel rank {shard} generated different rollouts (ranks grouped by what they "
                f"hold: {sorted(ranks.values())}); they must make the same rows from the same prompts, seed and "
                "weights. A nondeterministic kernel in the rollout engine (CUDA atomics) would do this: try "
                "--rollout.tensor_parallel_size equal to the tensor-parallel degree (one set of logits) or "
                "--debug.deterministic"
            )
