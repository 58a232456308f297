"""Image-text rows: TRL's vision formats -> tokens, loss masks and the processor's image tensors.

Rows hold messages (``{"type": "image"}`` parts, or string contents with the images placed before the first user
message's text, as TRL's ``prepare_multimodal_messages`` places them), prompt/completion or preference columns,
plus the row's images (``[vision] images_column``, or one ``image``). The model's own processor
(``AutoProcessor``) renders the conversation with its chat template and makes the model's inputs: the image
placeholder tokens expanded to the number of image features, ``pixel_values`` and what the model reads beside them
(Qwen's ``image_grid_thw`` and ``mm_token_type_ids``, Llama 3.2 Vision's aspect ratios and cross-attention mask,
Gemma 3's ``token_type_ids``). The whole conversation goes through the processor in one call (its ids and tensors
are TRL's); which tokens are prompt and which answer comes from processing the pieces of the rendering between the
cuts titanium's chat templates make (before and after each answer), and a row whose pieces do not add up to the
whole (a token across a cut) is skipped and counted. The image placeholder tokens carry no loss unless
``[vision] image_token_loss`` keeps them (TRL 1.16 does).

A sample's image tensors are kept per row: a field the processor gives per token (``token_type_ids``,
``cross_attention_mask``) as ``[tokens, ...]``, one it gives per row (``aspect_ratio_ids``) without the batch
dimension, one it gives for the whole batch's images (Qwen's ``pixel_values`` patches) as the row's entries; which
is which is probed once per processor (``ProcessorLayout``). Collation pads them to the microbatch's largest row
(``titanium.batch.ImageInputs``).

Bad rows (a missing or unreadable image, more image placeholders than images, a sample too long to keep its image
tokens) are skipped and counted like other bad rows.
"""

from __future__ import annotations

import base64
import io
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from titanium.batch import ImageInputs
from titanium.config.sections import DataSection
from titanium.config.vision_section import VisionSection
from titanium.data.chat import ROLE_ALIASES, RowError
from titanium.data.loader import collate
from titanium.data.packing import make_row
from titanium.data.text import DataError

logger = logging.getLogger(__name__)

FIELD, COUNT = "image.", "image_count."
"""Prefixes of a loader row's image fields and their counts (``image_rows``, ``images_of``)."""
Kind = str  # "prompt" or "output"


class ProcessorMissing(DataError):
    """A model that reads images started from a folder whose processor ``AutoProcessor`` cannot load."""


def load_processor(folder: str | Path, option: str) -> Any:
    """``AutoProcessor.from_pretrained(folder)``: the image processor, tokenizer and chat template of an image-text
    model. ``ProcessorMissing`` (naming ``option``, the setting that pointed at the folder) when it cannot load."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(str(folder))
    except Exception as e:  # transformers raises OSError, ValueError, AttributeError... for a folder without one
        raise ProcessorMissing(
            f"{option} {folder}: the model reads images, and transformers' AutoProcessor cannot load its processor "
            f"from the folder ({type(e).__name__}: {e}); copy the model's preprocessor_config.json (and "
            "processor_config.json, chat template, tokenizer files) into it"
        ) from None
    if not hasattr(processor, "image_processor") or getattr(processor, "tokenizer", None) is None:
        raise ProcessorMissing(
            f"{option} {folder}: AutoProcessor loads a {type(processor).__name__}, not an image-text processor (an "
            "image processor and a tokenizer); copy the model's preprocessor_config.json into the folder"
        )
    return processor


# ----- rows -----


def row_images(row: Mapping[str, Any], column: str, folder: Path | None) -> list[Any]:
    """The row's images as RGB PIL images: ``column`` (a list), else ``image`` (one), else none. Items: decoded
    images, file paths (relative to ``folder``, the data file's, else to the working directory), bytes (or base64
    text) and ``{"bytes", "path"}`` objects. ``RowError`` for one that is missing or cannot be read."""
    value = row.get(column)
    if value is None and row.get("image") is not None:
        value = [row["image"]]
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise RowError(f"'{column}' is {type(value).__name__}, not a list of images")
    return [_open_image(item, folder, f"'{column}' item {i}") for i, item in enumerate(value)]


def _open_image(item: Any, folder: Path | None, what: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    if isinstance(item, Image.Image):
        return item.convert("RGB")
    data, path = None, None
    if isinstance(item, Mapping):
        data, path = item.get("bytes"), item.get("path")
    elif isinstance(item, (bytes, bytearray)):
        data = item
    elif isinstance(item, str):
        path = item
    else:
        raise RowError(f"{what} is {type(item).__name__}, not an image, a path, bytes or a {{bytes, path}} object")
    try:
        if data is not None:
            raw = base64.b64decode(data) if isinstance(data, str) else bytes(data)
            return Image.open(io.BytesIO(raw)).convert("RGB")
        if path is None:
            raise RowError(f"{what} has neither bytes nor a path")
        file = Path(path).expanduser()
        if not file.is_absolute() and folder is not None and (folder / file).exists():
            file = folder / file
        with Image.open(file) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        raise RowError(f"{what}: no image file {path}") from None
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise RowError(f"{what} cannot be read as an image ({e})") from None


def _content(value: Any, what: str) -> str | list[dict[str, Any]]:
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not all(isinstance(p, Mapping) and "type" in p for p in value):
        raise RowError(f"{what} is {type(value).__name__}, not a string or a list of {{'type': ...}} parts")
    parts = []
    for part in value:
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise RowError(f"{what} has a text part without a string 'text'")
        if part["type"] not in ("text", "image"):
            raise RowError(f"{what} has a part of type {part['type']!r} (text and image parts are read)")
        parts.append({k: v for k, v in part.items() if k != "image"} if part["type"] == "image" else dict(part))
    return parts


def messages_with_images(raw: Any, what: str, cfg: DataSection) -> list[dict[str, Any]]:
    """A list of messages (``--data.role_key`` / ``--data.content_key``), each content a string or a list of
    text and image parts, as role/content dicts."""
    if not isinstance(raw, list) or not raw:
        raise RowError(
            f"{what} is {type(raw).__name__ if not isinstance(raw, list) else 'empty'}, not a list of messages"
        )
    messages = []
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping):
            raise RowError(f"{what} message {i} is {type(item).__name__}, not an object")
        role = ROLE_ALIASES.get(str(item.get(cfg.role_key, item.get("from"))))
        if role is None:
            raise RowError(f"{what} message {i} has role {item.get(cfg.role_key)!r} (system, user, assistant, tool)")
        content = item.get(cfg.content_key, item.get("value"))
        if content is None:
            raise RowError(f"{what} message {i} has no '{cfg.content_key}'")
        messages.append({"role": role, "content": _content(content, f"{what} message {i}")})
    return messages


def place_images(messages: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """TRL's ``prepare_multimodal_messages``: string contents become text parts, and where no message has image
    parts, ``count`` image parts go before the first user message's text. ``RowError`` unless the image parts and
    the images are as many."""
    out, placed = [], False
    has_parts = any(p["type"] == "image" for m in messages if isinstance(m["content"], list) for p in m["content"])
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
            if message["role"] == "user" and not placed and not has_parts:
                content = [{"type": "image"} for _ in range(count)] + content
                placed = True
        out.append({**message, "content": content})
    found = sum(p["type"] == "image" for m in out for p in m["content"])
    if found != count:
        raise RowError(f"{found} image placeholders in the messages and {count} images in the row")
    return out


# ----- the processor's layout -----


@dataclass(frozen=True)
class ProcessorLayout:
    """How a processor lays out its tensors for a batch: ``token`` fields per token (``[rows, seq, ...]``),
    ``batched`` fields per row (``[rows, images, ...]``, a row with fewer images padded with ``pads``' entry: Llama
    3.2 Vision marks a missing image's first tile valid); the rest hold every image's entries of the batch,
    concatenated."""

    token: frozenset[str]
    batched: frozenset[str]
    pads: Mapping[str, torch.Tensor] = field(default_factory=dict, compare=False)

    @classmethod
    def probe(cls, processor: Any) -> ProcessorLayout:
        """Process a batch of two small conversations, with two images and one: a field whose first dimension is the
        batch's 2 is per row (per token where its second is the tokens'; the second row's padding entry is its
        ``pads`` entry), one with more entries holds the images' entries."""
        from PIL import Image

        images = [[Image.new("RGB", (28, 28), (200, 30, 30)), Image.new("RGB", (56, 28), (30, 200, 30))]]
        images.append([Image.new("RGB", (28, 56), (30, 30, 200))])
        texts = [
            processor.apply_chat_template(
                place_images([{"role": "user", "content": "probe"}], len(row)), tokenize=False
            )
            for row in images
        ]
        outputs = processor(text=texts, images=images, return_tensors="pt", padding=True, add_special_tokens=False)
        width = outputs["input_ids"].shape[1]
        token, batched, pads = set(), set(), {}
        for name, value in outputs.items():
            if not isinstance(value, torch.Tensor) or name in ("input_ids", "attention_mask") or value.shape[0] != 2:
                continue
            if value.dim() >= 2 and value.shape[1] == width:
                token.add(name)
            else:
                batched.add(name)
                pads[name] = value[1, 1]
        return cls(frozenset(token), frozenset(batched), pads)

    def row(self, outputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The image fields of one row's processor outputs (a batch of one), per row."""
        fields = {}
        for name, value in outputs.items():
            if not isinstance(value, torch.Tensor) or name in ("input_ids", "attention_mask"):
                continue
            fields[name] = value[0] if name in self.token or name in self.batched else value
        return fields


# ----- processing -----


class ImageData:
    """An image-text model's processor and ``[vision]`` options: rows with images -> tokens, masks and image
    tensors (module docstring)."""

    def __init__(self, processor: Any, vision: VisionSection) -> None:
        self.processor, self.vision = processor, vision
        self.tokenizer = processor.tokenizer
        self.layout = ProcessorLayout.probe(processor)
        self.image_token = getattr(processor, "image_token", None)
        """The placeholder the chat template writes per image (expanded by the processor)."""
        ids = {getattr(processor, "image_token_id", None)}
        if self.image_token is not None:
            ids.add(self.tokenizer.convert_tokens_to_ids(self.image_token))
        self.image_token_ids = {int(i) for i in ids if i is not None}

    def render(self, messages: list[dict[str, Any]], generation: bool = False) -> str:
        """The conversation as the processor's chat template writes it."""
        try:
            return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
        except Exception as e:  # jinja2's TemplateError, a template's raise_exception
            raise RowError(f"the processor's chat template rejected it: {e}") from None

    def process(self, text: str, images: Sequence[Any]) -> dict[str, Any]:
        """``text`` and its ``images`` through the processor (a batch of one row, no special tokens added)."""
        try:
            outputs = self.processor(
                text=[text], images=[list(images)] if images else None, return_tensors="pt", add_special_tokens=False
            )
        except (ValueError, TypeError, RuntimeError) as e:
            raise RowError(f"the processor refused it: {e}") from None
        return dict(outputs)

    def pieces(self, messages: list[dict[str, Any]]) -> list[tuple[str, Kind]]:
        """The rendered conversation cut where the loss mask changes: each assistant message's header (prompt) and
        answer (output), the text between answers (prompt), as titanium's chat templates cut it."""
        pieces: list[tuple[str, Kind]] = []
        text = ""

        def extend(upto: str, kind: Kind) -> None:
            nonlocal text
            if not upto.startswith(text):
                raise RowError(
                    "the processor's chat template renders earlier messages differently as the conversation grows, so "
                    "its answers cannot be told from its prompts"
                )
            if upto != text:
                pieces.append((upto[len(text) :], kind))
            text = upto

        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                if i:
                    extend(self.render(messages[:i]), "prompt")
                extend(self.render(messages[:i], generation=True), "prompt")
                extend(self.render(messages[: i + 1]), "output")
        extend(self.render(messages), "prompt")
        return pieces

    def tokens(
        self, pieces: list[tuple[str, Kind]], images: Sequence[Any]
    ) -> tuple[list[int], list[Kind], dict[str, torch.Tensor]]:
        """The pieces' ids (the whole text processed once, with its images), each token's kind (its piece's; "image"
        for the image placeholders) and the row's image fields. ``RowError`` where the pieces, processed one by one,
        do not make the same ids (a token across a cut)."""
        text = "".join(piece for piece, _ in pieces)
        if self.image_token is not None and text.count(self.image_token) != len(images):
            raise RowError(f"{text.count(self.image_token)} image placeholders for {len(images)} images")
        whole = self.process(text, images)
        ids = whole["input_ids"][0].tolist()
        kinds: list[Kind] = []
        used = 0
        for piece, kind in pieces:
            count = piece.count(self.image_token) if self.image_token is not None else 0
            part = self.piece_ids(piece, images[used : used + count])
            used += count
            if ids[len(kinds) : len(kinds) + len(part)] != part:
                raise RowError("a token of the rendered conversation spans a prompt/answer boundary")
            kinds += [kind] * len(part)
        if len(kinds) != len(ids):
            raise RowError("the rendered conversation's pieces do not add up to its tokens")
        fields = self.layout.row(whole)
        for i in self.image_positions(ids, fields):
            kinds[i] = "image"
        return ids, kinds, fields

    def piece_ids(self, piece: str, images: Sequence[Any]) -> list[int]:
        """A piece's ids: the tokenizer's, or with images the processor's (which expands their placeholders), without
        the BOS a processor puts before text that lacks one (Llama 3.2 Vision's)."""
        if not images:
            return self.tokenizer(piece, add_special_tokens=False)["input_ids"]
        ids = self.process(piece, images)["input_ids"][0].tolist()
        bos, bos_id = self.tokenizer.bos_token, self.tokenizer.bos_token_id
        if bos is not None and ids[:1] == [bos_id] and not piece.startswith(bos):
            ids = ids[1:]
        return ids

    def image_positions(self, ids: list[int], fields: Mapping[str, torch.Tensor]) -> list[int]:
        """Where the image placeholder tokens are: the tokens the processor marks as image (``mm_token_type_ids``,
        ``token_type_ids``), else its image token's."""
        for name in ("mm_token_type_ids", "token_type_ids"):
            if name in fields:
                return torch.nonzero(fields[name] != 0).flatten().tolist()
        return [i for i, t in enumerate(ids) if t in self.image_token_ids]

    def learned(self, kinds: list[Kind], train_on_input: bool) -> list[bool]:
        """Which tokens carry loss: answers; the prompt too with ``train_on_input``; the image placeholders only
        with ``[vision] image_token_loss`` as well."""
        learn = {"output": True, "prompt": train_on_input, "image": train_on_input and self.vision.image_token_loss}
        return [learn[kind] for kind in kinds]


def cut_fields(fields: Mapping[str, torch.Tensor], keep: int, layout: ProcessorLayout) -> dict[str, torch.Tensor]:
    """A row's image fields for its first ``keep`` tokens (per-token fields cut; the images' are whole)."""
    return {name: value[:keep] if name in layout.token else value for name, value in fields.items()}


def with_text_after(
    fields: Mapping[str, torch.Tensor], prompt: int, length: int, layout: ProcessorLayout
) -> dict[str, torch.Tensor]:
    """A row's image fields for its first ``prompt`` tokens followed by text to ``length`` tokens: each per-token
    field carries the prompt's last entry over that text, as the processors give it to text after a prompt that ends
    in text (0 in Gemma 3's ``token_type_ids`` and Qwen's ``mm_token_type_ids``; in Llama 3.2 Vision's
    ``cross_attention_mask`` the images the prompt's end attends to)."""
    out = dict(fields)
    for name in layout.token & fields.keys():
        head = fields[name][:prompt]
        out[name] = torch.cat([head, head[-1:].expand(length - prompt, *head.shape[1:])])
    return out


# ----- collation -----


def _padded(values: list[torch.Tensor], first: int | None = None, entry: torch.Tensor | None = None) -> torch.Tensor:
    """``values`` stacked, each padded to the largest along every dimension (the first to ``first``): with zeros, or
    along the first with copies of ``entry``."""
    shape = [max(v.shape[d] for v in values) for d in range(values[0].dim())]
    if first is not None:
        shape[0] = first
    out = values[0].new_zeros((len(values), *shape))
    if entry is not None and tuple(entry.shape) == tuple(shape[1:]):
        out[:] = entry.to(out.dtype)
    for i, value in enumerate(values):
        out[(i, *(slice(0, n) for n in value.shape))] = value
    return out


def image_rows(samples: Sequence[Mapping[str, Any]], width: int, layout: ProcessorLayout) -> dict[str, torch.Tensor]:
    """The loader-row entries of ``samples``' image fields (each sample's ``images``), padded: per-token fields to
    ``width`` tokens, the others to the largest sample (a per-row field with the processor's padding entry), with
    each sample's count of real entries. Samples without images (text rows among image rows) get padding."""
    names = sorted({name for s in samples for name in (s.get("images") or {})})
    rows: dict[str, torch.Tensor] = {}
    for name in names:
        present = [s["images"][name] for s in samples if name in (s.get("images") or {})]
        empty = present[0].new_zeros((0, *present[0].shape[1:]))
        values = [(s.get("images") or {}).get(name, empty) for s in samples]
        rows[FIELD + name] = _padded(values, width if name in layout.token else None, layout.pads.get(name))
        if name not in layout.token:
            rows[COUNT + name] = torch.tensor([v.shape[0] for v in values])
    return rows


def padded_image_rows(
    pad: Callable[[list[Any]], dict[str, torch.Tensor]], samples: list[Any], layout: ProcessorLayout
) -> dict[str, torch.Tensor]:
    """``pad``'s rows of ``samples`` (``titanium.data.packing.padded_rows``, one sample per row) with their images."""
    rows = pad(samples)
    return {**rows, **image_rows(samples, rows["input"].shape[1], layout)}


def packed_image_row(
    samples: Sequence[Mapping[str, Any]], seq_len: int, pad_id: int, layout: ProcessorLayout
) -> dict[str, Any]:
    """``make_row`` of packed ``samples`` with their images as ``images``: a per-token field the samples' entries one
    after the other (zeros over a sample without it and over the padding), any other field every sample's entries
    (images, tiles, patches) in the samples' order, which is the order of their placeholders in the row."""
    row: dict[str, Any] = make_row(samples, seq_len, pad_id)
    fields: dict[str, torch.Tensor] = {}
    for name in sorted({name for s in samples for name in (s.get("images") or {})}):
        present = [s["images"][name] for s in samples if name in (s.get("images") or {})]
        if name in layout.token:
            values = [
                (s.get("images") or {}).get(name, present[0].new_zeros((len(s["tokens"]), *present[0].shape[1:])))
                for s in samples
            ]
            value = torch.cat(values)
            fields[name] = torch.cat([value, value.new_zeros((seq_len - value.shape[0], *value.shape[1:]))])
        else:
            fields[name] = torch.cat(present)
    row["images"] = fields
    return row


def collate_image_rows(rows: list[Mapping[str, Any]], layout: ProcessorLayout) -> dict[str, torch.Tensor]:
    """Packed rows (``packed_image_row``) stacked, their images padded to the largest row (``image_rows``)."""
    text = collate([{k: v for k, v in row.items() if k != "images"} for row in rows])
    return {**text, **image_rows(rows, text["input"].shape[1], layout)}


def images_of(rows: Mapping[str, torch.Tensor]) -> ImageInputs | None:
    """The ``ImageInputs`` of a loader batch (``image_rows``' entries), or None for a batch without images: no image
    entries at all, or only per-token fields the processor gives text rows too (Gemma 3's ``token_type_ids``, all 0),
    beside which the model would look for pixel values."""
    fields = {k.removeprefix(FIELD): v for k, v in rows.items() if k.startswith(FIELD)}
    counts = {k.removeprefix(COUNT): v for k, v in rows.items() if k.startswith(COUNT)}
    if not counts or not any(int(c.sum()) for c in counts.values()):
        return None
    return ImageInputs(fields, counts)
