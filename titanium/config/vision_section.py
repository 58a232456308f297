"""The ``[vision]`` section: image-text models' image data and which of their vision parts train (its own file, light
enough to read before anything heavy is imported, like every section)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class VisionSection:
    """Image-text models (Qwen2.5-VL, Qwen3-VL, Llama 3.2 Vision, Gemma 3, Llama 4 through the transformers
    backend): where a row's images are, whether their placeholder tokens carry loss, and which vision parts train."""

    images_column: str = "images"
    """The column holding a row's images, as TRL reads it: a list whose items are file paths (relative to the data
    file's folder, else to the working directory), bytes, {"bytes": ..., "path": ...} objects (a `datasets` Image
    column as stored) or decoded images; a column named "image" holding one image is read too. Rows without the
    column are text only."""
    image_token_loss: bool = False
    """Keep the image placeholder tokens (the processor's image tokens, which the model fills with image features)
    in the labels wherever the prompt is learned (--sft.train_on_input): TRL 1.16's collators do. Off: they carry no
    loss, as the model cannot predict image features."""
    freeze_vision_tower: bool = False
    """Train the vision tower (the image encoder) or keep it frozen."""
    freeze_projector: bool = False
    """Train the projector (the layers mapping image features to the language model's width: multi_modal_projector,
    Qwen's patch merger) or keep it frozen."""
