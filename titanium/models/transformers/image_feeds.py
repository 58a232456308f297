"""How each image-text architecture reads a batch's images (``titanium.batch.ImageInputs``) into its language model.

The ``transformers`` model computes every image-side tensor (the vision tower, the projector, the rotary index);
a feed only hands them to the language model as the model's own forward would:

- ``EarlyFusion`` (Gemma 3, Llama 4): the image features (``get_image_features``) replace the embeddings of the
  image placeholder tokens; Gemma 3's ``token_type_ids`` make each image's tokens a block that attends both ways.
- ``QwenFeed`` (Qwen2-VL, Qwen2.5-VL) and ``Qwen3Feed`` (with DeepStack: features of early vision layers added to
  the first language layers' outputs): early fusion with 3-D M-RoPE positions from ``get_rope_index``, computed per
  packed document (restarting where titanium's positions restart) and continued from the prompt in a shared-prompt
  row; when decoding after an image, the rotary position is the token's position plus its row's offset, kept in
  the KV cache.
- ``CrossAttentionFeed`` (Llama 3.2 Vision): the token embeddings stay; the vision tower's projected states and the
  processor's cross-attention mask go to the cross-attention layers (kept in the KV cache for decoding).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch import nn

from titanium.models.common.kv_cache import PAD_DOCUMENT
from titanium.models.hf_adapter import HFConfigError


@dataclasses.dataclass
class FedInputs:
    """What the language model's forward gets besides titanium's positions and documents."""

    embeddings: torch.Tensor | None
    """The token embeddings with the images in them (None on a pipeline stage without the embedding)."""
    rope: torch.Tensor | None = None
    """Rotary positions where they are not titanium's (``[3, B, S]`` M-RoPE)."""
    blocks: torch.Tensor | None = None
    """``[B, S]`` spans attending both ways (``AttentionContext.blocks``)."""
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """More keyword arguments of the language model's forward (cross-attention states, DeepStack features)."""


def _holder(hf: nn.Module, method: str) -> str:
    """The path from ``hf`` to the first module of it defining ``method`` ("" for ``hf`` itself)."""
    for name, module in hf.named_modules():
        if callable(getattr(type(module), method, None)):
            return name
    raise HFConfigError(f"transformers' {type(hf).__name__} has no {method}")


def _module(hf: nn.Module, path: str) -> nn.Module:
    """``hf``'s module at ``path`` through attributes (``_modules`` of the containers are emptied: ``vision.py``)."""
    module = hf
    for part in filter(None, path.split(".")):
        module = getattr(module, part)
    return module


class EarlyFusion:
    """Image features in place of the placeholder tokens' embeddings (module docstring)."""

    KEPT_STATE = ()

    def __init__(self, hf: nn.Module) -> None:
        config = hf.config
        self.image_token_id = int(getattr(config, "image_token_id", None) or config.image_token_index)
        self.features_path = _holder(hf, "get_image_features")
        holder = type(_module(hf, self.features_path))
        self.feature_inputs = tuple(inspect.signature(holder.get_image_features).parameters)[1:]
        """The parameters of ``get_image_features`` (``pixel_values``, Qwen's ``image_grid_thw``): the image fields
        it reads, each the whole batch's real entries in row order, as the processor gives them for a batch."""

    def remembers(self, kv_cache: Any) -> bool:
        """Whether ``kv_cache`` holds what this feed kept of an image prefill (a decoding step needs it)."""
        return kv_cache is not None and any(hasattr(kv_cache, name) for name in self.KEPT_STATE)

    def image_outputs(self, model: nn.Module, images: Any) -> Any:
        """``get_image_features``' output on the batch's images (a ``BaseModelOutputWithPooling``)."""
        holder = _module(model._hf, self.features_path)
        inputs = {name: images.whole(name) for name in self.feature_inputs if name in images.fields}
        return holder.get_image_features(**inputs, return_dict=True)

    def placeholders(self, tokens: torch.Tensor, images: Any) -> torch.Tensor:
        """``[B, S]`` where the image features go: the image tokens the processor marked as image
        (``token_type_ids`` / ``mm_token_type_ids`` 1), else every image token. A response that sampled the image token
        (GRPO) holds it unmarked: there it stays a plain token, as the engine's decoding step read it."""
        found = tokens == self.image_token_id
        for name in ("mm_token_type_ids", "token_type_ids"):
            if name in images.fields and images.fields[name].shape == tokens.shape:
                return found & (images.fields[name] == 1)
        return found

    def embeddings(
        self, model: nn.Module, tokens: torch.Tensor, images: Any, outputs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The token embeddings with the image features (``outputs.pooler_output``: one tensor, or one per image)
        in place of the placeholders (``placeholders``), and where the placeholders are (``[B, S]``)."""
        placeholders = self.placeholders(tokens, images)
        embeds = model.tok_embeddings(tokens.masked_fill(placeholders, 0))  # (the id may lie outside the table)
        pooled = outputs.pooler_output
        features = torch.cat(pooled) if isinstance(pooled, (list, tuple)) else pooled.reshape(-1, pooled.shape[-1])
        if features.shape[0] != int(placeholders.sum()):
            raise ValueError(f"{features.shape[0]} image features for {int(placeholders.sum())} image tokens")
        return embeds.masked_scatter(placeholders.unsqueeze(-1), features.to(embeds.dtype)), placeholders

    def prepare(
        self,
        model: nn.Module,
        tokens: torch.Tensor | None,
        positions: torch.Tensor,
        document_ids: torch.Tensor | None,
        parent_ids: torch.Tensor | None,
        images: Any,
        kv_cache: Any,
    ) -> FedInputs:
        """The language model's inputs for ``tokens`` (None: a later pipeline stage) and ``images`` (None: a decoding
        step after an image prefill)."""
        embeds = None
        if tokens is not None:
            if images is None:
                embeds = model.tok_embeddings(tokens)
            else:
                embeds, _ = self.embeddings(model, tokens, images, self.image_outputs(model, images))
        return FedInputs(embeds, blocks=image_blocks(images))


def image_blocks(images: Any) -> torch.Tensor | None:
    """Gemma 3's bidirectional spans: each run of image tokens (``token_type_ids == 1``) a block of its own, as
    ``transformers``' ``get_block_sequence_ids_for_mask`` numbers them; None without ``token_type_ids``."""
    if images is None or "token_type_ids" not in images.fields:
        return None
    image = images.fields["token_type_ids"] == 1
    starts = image & ~torch.nn.functional.pad(image, (1, 0))[:, :-1]
    return torch.where(image, starts.cumsum(dim=1) - 1, -1)


class QwenFeed(EarlyFusion):
    """Early fusion with Qwen's 3-D M-RoPE positions (module docstring)."""

    KEPT_STATE = ("rope_delta",)

    def __init__(self, hf: nn.Module) -> None:
        super().__init__(hf)
        self.rope_path = _holder(hf, "get_rope_index")

    def prepare(self, model, tokens, positions, document_ids, parent_ids, images, kv_cache) -> FedInputs:
        fed = super().prepare(model, tokens, positions, document_ids, parent_ids, images, kv_cache)
        if images is None:  # a decoding step: the position plus its row's offset from the prompt's image
            fed.rope = (positions + kv_cache.rope_delta[:, None]).unsqueeze(0).expand(3, -1, -1)
            return fed
        fed.rope, delta = self.rope_positions(model, positions, document_ids, parent_ids, images)
        if kv_cache is not None:
            kv_cache.rope_delta = delta
        return fed

    def rope_positions(
        self,
        model: nn.Module,
        positions: torch.Tensor,
        document_ids: torch.Tensor | None,
        parent_ids: torch.Tensor | None,
        images: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[3, B, S]`` M-RoPE positions: each document's from ``get_rope_index`` (its tokens' types and its images'
        grids), titanium's positions where a document has no image, and a response sharing a prompt continued from
        the prompt's; with each row's offset of the next position after its last token (for decoding)."""
        types = images.fields["mm_token_type_ids"]
        grids = images.whole("image_grid_thw")
        get_rope_index = _module(model._hf, self.rope_path).get_rope_index
        rope = positions.unsqueeze(0).expand(3, -1, -1).clone()
        deltas = torch.zeros(positions.shape[0], dtype=positions.dtype, device=positions.device)
        used = 0
        for row in range(positions.shape[0]):
            offsets: dict[int, torch.Tensor] = {}
            for doc, start, end in _documents(document_ids, row, positions.shape[1]):
                kinds = types[row, start:end]
                count = int(((kinds == 1) & ~torch.nn.functional.pad(kinds == 1, (1, 0))[:-1]).sum())
                if count:
                    found, delta = get_rope_index(
                        kinds[None].long(), kinds[None], image_grid_thw=grids[used : used + count]
                    )
                    rope[:, row, start:end] = found[:, 0] + positions[row, start]
                    offsets[doc] = delta.reshape(())
                    used += count
                parent = int(parent_ids[row, start]) if parent_ids is not None else doc
                if parent != doc and parent in offsets:
                    rope[:, row, start:end] += offsets[parent]
                    offsets[doc] = offsets[parent]
                deltas[row] = offsets.get(doc, deltas.new_zeros(()))
        return rope, deltas


def _documents(document_ids: torch.Tensor | None, row: int, width: int) -> list[tuple[int, int, int]]:
    """The documents of a row as (document id, start, end), in order (one of the whole row without ids)."""
    if document_ids is None:
        return [(0, 0, width)]
    ids = document_ids[row].tolist()
    spans, start = [], 0
    for i in range(1, width + 1):
        if i == width or ids[i] != ids[start]:
            spans.append((ids[start], start, i))
            start = i
    return spans


class Qwen3Feed(QwenFeed):
    """``QwenFeed`` with DeepStack: the features of early vision layers, added to the first language layers'
    outputs at the image tokens (``visual_pos_masks``, ``deepstack_visual_embeds``)."""

    def prepare(self, model, tokens, positions, document_ids, parent_ids, images, kv_cache) -> FedInputs:
        if tokens is None or images is None:
            return super().prepare(model, tokens, positions, document_ids, parent_ids, images, kv_cache)
        outputs = self.image_outputs(model, images)
        embeds, placeholders = self.embeddings(model, tokens, images, outputs)
        fed = FedInputs(embeds)
        fed.rope, delta = self.rope_positions(model, positions, document_ids, parent_ids, images)
        if kv_cache is not None:
            kv_cache.rope_delta = delta
        deepstack = [torch.cat(features).to(embeds.dtype) for features in outputs.deepstack_features]
        fed.kwargs = {"visual_pos_masks": placeholders, "deepstack_visual_embeds": deepstack}
        return fed


class CrossAttentionFeed:
    """Llama 3.2 Vision: the vision tower's states reach the text through its cross-attention layers."""

    def __init__(self, hf: nn.Module) -> None:
        self.hidden = int(hf.config.get_text_config().hidden_size)

    def remembers(self, kv_cache: Any) -> bool:
        return kv_cache is not None and hasattr(kv_cache, "cross_attention")

    def prepare(self, model, tokens, positions, document_ids, parent_ids, images, kv_cache) -> FedInputs:
        from transformers.models.mllama.modeling_mllama import _prepare_cross_attention_mask

        embeds = model.tok_embeddings(tokens) if tokens is not None else None
        if images is None:  # decoding: the image states of the prefill, each new token seeing its row's last image
            states, last = kv_cache.cross_attention
            mask = last[:, None].expand(-1, positions.shape[1], -1, -1)
        else:
            vision = model.vision_model
            outputs = vision(
                pixel_values=images.fields["pixel_values"],
                aspect_ratio_ids=images.fields["aspect_ratio_ids"],
                aspect_ratio_mask=images.fields["aspect_ratio_mask"],
            ).last_hidden_state
            states = model.multi_modal_projector(outputs).reshape(-1, outputs.shape[-2], self.hidden)
            mask = images.fields["cross_attention_mask"]
            if kv_cache is not None:
                kv_cache.cross_attention = (states, _last_token_mask(mask, document_ids))
        dtype = embeds.dtype if embeds is not None else states.dtype
        mask, full_rows = _prepare_cross_attention_mask(
            mask, num_vision_tokens=model.vision_model.num_patches, dtype=dtype
        )
        kwargs = {
            "cross_attention_states": states,
            "cross_attention_mask": mask,
            "full_text_row_masked_out_mask": full_rows,
        }
        return FedInputs(embeds, kwargs=kwargs)


def _last_token_mask(mask: torch.Tensor, document_ids: torch.Tensor | None) -> torch.Tensor:
    """``[B, images, tiles]``: the cross-attention mask of each row's last token that is not padding (what the tokens
    it generates see, as ``transformers``' generation extends the mask): the last column of left-padded prompts
    (``titanium.generation.generate.left_pad``), the last prompt token of a right-padded row."""
    if document_ids is None:
        return mask[:, -1]
    real = (document_ids != PAD_DOCUMENT).int()
    last = real.shape[1] - 1 - real.flip(1).argmax(dim=1)
    return mask[torch.arange(mask.shape[0], device=mask.device), last]


FEEDS = {
    "qwen2_vl": QwenFeed,
    "qwen2_5_vl": QwenFeed,
    "qwen3_vl": Qwen3Feed,
    "gemma3": EarlyFusion,
    "llama4": EarlyFusion,
    "mllama": CrossAttentionFeed,
}
"""The image-text architectures titanium feeds images to, by ``model_type``."""


def image_feed(model_type: str, hf: nn.Module) -> Any:
    """The feed of ``model_type``'s images; ``HFConfigError`` for an architecture without one."""
    if model_type not in FEEDS:
        raise HFConfigError(
            f"image-text model_type {model_type!r}: titanium feeds the images of {', '.join(sorted(FEEDS))} only"
        )
    return FEEDS[model_type](hf)
