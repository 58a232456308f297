"""Tiny random image-text models made with ``transformers`` (no hub), with word-level tokenizers and processors
built here: what the vision tests train, compare with ``transformers`` and feed through TRL's collators.

Each model is its real architecture at toy size (2-3 language layers of width 32, a vision tower of width 16 on
28-pixel images): Qwen2.5-VL (M-RoPE, window attention, patch merger), Qwen3-VL (DeepStack), Llama 3.2 Vision
(``mllama``: cross-attention layers, tiles), Gemma 3 (SigLIP, bidirectional image blocks, tied embeddings) and
Llama 4 (MoE, pixel shuffle). Words ``w0`` ... are the ids after the specials; text is split on spaces.

Processors: Mllama's and Gemma 3's are ``transformers``' own with their PIL image processors, loadable with
``AutoProcessor`` from the folder. Qwen's processor needs torchvision for its video processor, which does not import
beside torch 2.13 CPU here: ``qwen_processor`` builds ``Qwen2_5_VLProcessor`` with the PIL image processor and no
video processor (``ImagesOnlyQwenProcessor`` skips the video processor's class check); Llama 4's image processor
needs torchvision too, so its tests feed preprocessed pixel values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.parity.harness import randomize_

VOCAB = 64
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
SPECIALS = {
    "qwen2_5_vl": [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ],
    "qwen3_vl": [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ],
    "mllama": [
        "<|finetune_right_pad_id|>",
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|python_tag|>",
        "<|image|>",
    ],
    "gemma3": [
        "<pad>",
        "<bos>",
        "<eos>",
        "<start_of_turn>",
        "<end_of_turn>",
        "<start_of_image>",
        "<end_of_image>",
        "<image_soft_token>",
    ],
    "llama4": [
        "<|finetune_right_pad|>",
        "<|begin_of_text|>",
        "<|eot|>",
        "<|header_start|>",
        "<|header_end|>",
        "<|image_start|>",
        "<|image_end|>",
        "<|image|>",
        "<|patch|>",
    ],
}
"""Special tokens per architecture, ids 0, 1, 2 ... (pad, bos, eos first); words follow."""
WORDS = ["user", "assistant", "system"] + [f"w{i}" for i in range(40)]


def token_id(model_type: str, token: str) -> int:
    return (SPECIALS[model_type] + WORDS).index(token)


def _configs() -> dict[str, dict[str, Any]]:
    qwen_vision = dict(
        depth=2,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=32,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    mrope = {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0}

    def qwen(t: str) -> dict[str, int]:
        return dict(
            image_token_id=token_id(t, "<|image_pad|>"),
            video_token_id=token_id(t, "<|video_pad|>"),
            vision_start_token_id=token_id(t, "<|vision_start|>"),
            vision_end_token_id=token_id(t, "<|vision_end|>"),
        )

    return {
        "qwen2_5_vl": dict(
            text_config=dict(TEXT, rope_parameters=mrope),
            vision_config=dict(qwen_vision, window_size=28, fullatt_block_indexes=[1]),
            **qwen("qwen2_5_vl"),
        ),
        "qwen3_vl": dict(
            text_config=dict(TEXT, head_dim=8, rope_parameters=dict(mrope, mrope_interleaved=True)),
            vision_config=dict(qwen_vision, patch_size=14, num_position_embeddings=16, deepstack_visual_indexes=[0]),
            **qwen("qwen3_vl"),
        ),
        "mllama": dict(
            text_config=dict(TEXT, num_hidden_layers=3, cross_attention_layers=[1], rope_scaling=None),
            vision_config=dict(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_global_layers=1,
                attention_heads=2,
                image_size=28,
                patch_size=14,
                max_num_tiles=4,
                intermediate_layers_indices=[0],
                vision_output_dim=32,
                supported_aspect_ratios=[[1, 1], [1, 2], [2, 1], [2, 2]],
            ),
            image_token_index=token_id("mllama", "<|image|>"),
        ),
        "gemma3": dict(
            text_config=dict(TEXT, head_dim=8, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
            vision_config=dict(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=7,
            ),
            mm_tokens_per_image=4,
            image_token_index=token_id("gemma3", "<image_soft_token>"),
            boi_token_index=token_id("gemma3", "<start_of_image>"),
            eoi_token_index=token_id("gemma3", "<end_of_image>"),
        ),
        "llama4": dict(
            text_config=dict(
                TEXT,
                intermediate_size_mlp=64,
                head_dim=8,
                num_local_experts=2,
                interleave_moe_layer_step=2,
                attention_chunk_size=512,
            ),
            vision_config=dict(
                hidden_size=16,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
                vision_output_dim=32,
                projector_input_dim=32,
                projector_output_dim=32,
                pixel_shuffle_ratio=0.5,
            ),
            image_token_index=token_id("llama4", "<|patch|>"),
            boi_token_index=token_id("llama4", "<|image_start|>"),
            eoi_token_index=token_id("llama4", "<|image_end|>"),
        ),
    }


def tiny_config(model_type: str, **text: Any) -> Any:
    """The ``transformers`` config of the tiny ``model_type`` model; ``text``: its language model's settings changed
    (another width for a distillation teacher)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = dict(_configs()[model_type])
    config["text_config"] = {**config["text_config"], **text}
    return CONFIG_MAPPING[model_type](**config)


def tiny_vlm(model_type: str, seed: int = 0, **text: Any) -> Any:
    """A float32 ``*ForConditionalGeneration`` of ``model_type`` with every weight random (``randomize_``); the
    cross-attention gates of Llama 3.2 Vision random too (zero, the images would not reach the text). ``text`` as
    ``tiny_config``'s."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(tiny_config(model_type, **text), dtype=torch.float32)
    randomize_(model, seed)
    return model.eval()


def word_tokenizer(model_type: str) -> Any:
    """A ``PreTrainedTokenizerFast`` of ``SPECIALS[model_type]`` then ``WORDS``, split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = SPECIALS[model_type]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(specials)
    extra = {}
    if model_type == "gemma3":
        extra = dict(boi_token="<start_of_image>", eoi_token="<end_of_image>", image_token="<image_soft_token>")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=specials[0],
        bos_token=specials[1],
        eos_token=specials[2],
        extra_special_tokens=extra,
    )


CHAT_TEMPLATES = {
    "qwen": (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|>"
        "<|vision_end|> {% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endif %} <|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    ),
    "mllama": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|> {{ m['role'] }} <|end_header_id|> "
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
        "{% if c['type'] == 'image' %}<|image|> {% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endif %}"
        " <|eot_id|> {% endfor %}{% if add_generation_prompt %}<|start_header_id|> assistant <|end_header_id|> "
        "{% endif %}"
    ),
    "llama4": (
        "{{ bos_token }}{% for m in messages %}<|header_start|> {{ m['role'] }} <|header_end|> "
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
        "{% if c['type'] == 'image' %}<|image|> {% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endif %}"
        " <|eot|> {% endfor %}{% if add_generation_prompt %}<|header_start|> assistant <|header_end|> {% endif %}"
    ),
    "gemma3": (
        "{{ bos_token }}{% for m in messages %}<start_of_turn> {{ m['role'] }} {% if m['content'] is string %}"
        "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<start_of_image> "
        "{% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endif %} <end_of_turn> {% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn> assistant {% endif %}"
    ),
}
"""Chat templates of the processors here, each the published template's structure in word-level tokens."""


def _images_only(cls: type) -> type:
    class ImagesOnly(cls):  # type: ignore[misc,valid-type]
        """The processor without a video processor (torchvision-free), which the class check would refuse."""

        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    ImagesOnly.__name__ = cls.__name__
    return ImagesOnly


def llama4_image_processor() -> Any:
    """Llama 4's image processing for the tiny model without torchvision (its own image processor needs it): each
    image resized to one 28-pixel tile (aspect ratio 1 x 1, so no tile separators), scaled to [-1, 1] as its mean and
    standard deviation of 0.5 scale it."""
    import numpy as np
    from transformers.image_processing_utils import BaseImageProcessor, BatchFeature
    from transformers.image_utils import make_flat_list_of_images

    class TinyLlama4ImageProcessor(BaseImageProcessor):
        model_input_names = ["pixel_values"]

        def preprocess(self, images: Any, return_tensors: Any = None, **kwargs: Any) -> Any:
            tiles = [
                torch.from_numpy(np.asarray(image.convert("RGB").resize((28, 28)), dtype=np.float32)) / 127.5 - 1
                for image in make_flat_list_of_images(images)
            ]
            fields = {"pixel_values": torch.stack(tiles).permute(0, 3, 1, 2), "aspect_ratios": [[1, 1]] * len(tiles)}
            return BatchFeature(fields, tensor_type=return_tensors)

    return TinyLlama4ImageProcessor()


def tiny_processor(model_type: str) -> Any:
    """The tiny model's processor: its image processor at the tiny image size, the word tokenizer and the chat
    template."""
    tokenizer = word_tokenizer(model_type)
    if model_type in ("qwen2_5_vl", "qwen3_vl"):
        from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

        if model_type == "qwen2_5_vl":
            from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor as cls
        else:
            from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor as cls
        images = Qwen2VLImageProcessorPil(
            min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, temporal_patch_size=2, merge_size=2
        )
        tokenizer.image_token, tokenizer.video_token = "<|image_pad|>", "<|video_pad|>"
        return _images_only(cls)(images, tokenizer, None, chat_template=CHAT_TEMPLATES["qwen"])
    if model_type == "mllama":
        from transformers import MllamaProcessor
        from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

        images = MllamaImageProcessorPil(size={"height": 28, "width": 28}, max_image_tiles=4)
        return MllamaProcessor(images, tokenizer, chat_template=CHAT_TEMPLATES["mllama"])
    if model_type == "gemma3":
        from transformers import Gemma3Processor
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        images = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
        return Gemma3Processor(images, tokenizer, chat_template=CHAT_TEMPLATES["gemma3"], image_seq_length=4)
    if model_type == "llama4":
        from transformers import Llama4Processor

        return Llama4Processor(llama4_image_processor(), tokenizer, chat_template=CHAT_TEMPLATES["llama4"])
    raise ValueError(f"no tiny processor for {model_type}")


def vlm_folder(model_type: str, folder: Path, seed: int = 0, **text: Any) -> Path:
    """A Hugging Face folder of the tiny ``model_type`` model: weights (sharded), config, tokenizer and, where
    ``AutoProcessor`` can load it here, the processor. ``text`` as ``tiny_config``'s."""
    model = tiny_vlm(model_type, seed, **text)
    model.save_pretrained(folder, max_shard_size="200KB")
    processor = tiny_processor(model_type)
    if model_type in ("mllama", "gemma3"):
        processor.save_pretrained(folder)
    else:
        processor.tokenizer.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.setdefault("chat_template", processor.chat_template)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def random_image(seed: int, width: int = 28, height: int = 28) -> Any:
    """A PIL RGB image of random pixels."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))


def assert_image_fields_equal(
    images: Any, theirs: dict[str, Any], layout: Any, real: torch.Tensor, width: int, text_keys: set[str]
) -> None:
    """titanium's image fields of a batch equal those of a peer's batch ``theirs`` (every key but ``text_keys``):
    per-token fields on the real tokens (``real``: the peer's attention mask; padding is not the processor's to
    compare), per-row fields as the processor pads them, the rest as every image of the batch concatenated."""
    assert images is not None
    image_fields = set(theirs) - text_keys
    assert set(images.fields) == image_fields
    for name in image_fields:
        if name in layout.token:
            assert torch.equal(images.fields[name][:, :width][real], theirs[name][real]), name
        elif name in layout.batched:
            assert torch.equal(images.fields[name], theirs[name]), name
        else:
            assert torch.equal(images.whole(name), theirs[name]), name


def with_reference(trainer: Any, folder: Path) -> Any:
    """A ``titanium.trainer.Trainer`` of DPO or KTO with its objective's reference built from the Hugging Face
    ``folder`` (the policy's architecture, other weights), so that the reference is not the policy's start."""
    import dataclasses

    from titanium.model_builder import WeightSource

    objective = trainer.objective
    objective.reference.release()
    models = objective.ctx.models
    source = dataclasses.replace(models.start, weights=WeightSource(hf_folder=str(folder)))
    objective.reference = models.frozen(source=source)
    return trainer
