"""Make the bundled image-text task and the tiny image-text model it trains (issue 41, item 7).

    python scripts/make_vlm_task.py     # writes assets/tasks/shapes/ and assets/hf_configs/tiny-gemma3-vlm/

The task: 28x28 pictures of one shape (circle, square, triangle) in one colour (red, green, blue, yellow) on white,
drawn with Pillow at a random size and place, each with one question, "what colour is the shape ?" or "what shape
is it ?", answered in one word. Rows are TRL's vision format: ``{"messages": [user, assistant], "images": [path]}``
(the image goes before the question's text, as TRL's ``prepare_multimodal_messages`` places it), the paths
relative to the jsonl file, with the answer again as ``answer`` (GRPO's exact-match reference). Train has 192 rows
(16 per shape and colour), test 48 (4 each, other drawings), the questions alternating so that any first N test rows
are balanced. Deterministic for a given --seed.

The model: a Gemma 3 image-text architecture at toy size (a 2-layer SigLIP tower of width 32 on 7-pixel patches
pooled to 4 image tokens, a 2-layer language model of width 64), as files only: config.json, a word-level
tokenizer of the task's words, the processor (Gemma 3's, with its PIL image processor) and a chat template with
Gemma's turn structure. No weights: titanium initializes them from the run's seed (``--model.hf_config``), so
nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 60, 220), "yellow": (230, 200, 20)}
SHAPES = ("circle", "square", "triangle")
QUESTIONS = {"colour": "what colour is the shape ?", "shape": "what shape is it ?"}
SIZE = 28

SPECIALS = [
    "<pad>",
    "<bos>",
    "<eos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
"""Gemma 3's special tokens, added to the tokenizer after its words: outside the word vocabulary, so that text in a
row cannot spell them (titanium's chat templates then tell them from text: <end_of_turn> ends an answer)."""
WORDS = sorted({"user", "assistant", "system", *COLOURS, *SHAPES, *" ".join(QUESTIONS.values()).split()})
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn> {{ m['role'] }} {% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<start_of_image> "
    "{% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endif %} <end_of_turn> {% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn> assistant {% endif %}"
)
"""Gemma 3's template's turn structure in whitespace-separated tokens (the word-level tokenizer splits on spaces)."""


def draw(shape: str, colour: str, rng: random.Random):
    """One picture: ``shape`` in ``colour``, 12-22 pixels wide, somewhere inside the 28x28 white square."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    side = rng.randint(12, 22)
    x, y = rng.randint(1, SIZE - side - 1), rng.randint(1, SIZE - side - 1)
    box = (x, y, x + side, y + side)
    pen = ImageDraw.Draw(image)
    if shape == "circle":
        pen.ellipse(box, fill=COLOURS[colour])
    elif shape == "square":
        pen.rectangle(box, fill=COLOURS[colour])
    else:
        pen.polygon([(x + side / 2, y), (x, y + side), (x + side, y + side)], fill=COLOURS[colour])
    return image


def write_split(folder: Path, split: str, per_kind: int, rng: random.Random) -> None:
    """``per_kind`` pictures of every shape and colour, shuffled, as ``folder/{split}.jsonl`` rows."""
    kinds = [(shape, colour) for shape in SHAPES for colour in COLOURS for _ in range(per_kind)]
    rng.shuffle(kinds)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (shape, colour) in enumerate(kinds):
        path = f"images/{split}_{i:03d}.png"
        draw(shape, colour, rng).save(folder / path, optimize=True)
        asked = "colour" if i % 2 == 0 else "shape"
        answer = colour if asked == "colour" else shape
        messages = [{"role": "user", "content": QUESTIONS[asked]}, {"role": "assistant", "content": answer}]
        rows.append({"messages": messages, "images": [path], "answer": answer})  # (the answer: GRPO's reward)
    (folder / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def write_model(folder: Path) -> None:
    """The tiny Gemma 3's config.json, tokenizer and processor files (module docstring); no weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Gemma3Config, Gemma3Processor, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", *WORDS])}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.add_special_tokens(SPECIALS)
    vocab = words.get_vocab(with_added_tokens=True)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        extra_special_tokens=dict(
            boi_token="<start_of_image>", eoi_token="<end_of_image>", image_token="<image_soft_token>"
        ),
    )
    images = Gemma3ImageProcessorPil(size={"height": SIZE, "width": SIZE})
    processor = Gemma3Processor(images, tokenizer, chat_template=CHAT_TEMPLATE, image_seq_length=4)
    processor.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE  # (titanium's tokenizer reads the template from here)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    text = dict(
        vocab_size=len(vocab),  # (no ids the tokenizer cannot decode: exact match decodes what is generated)
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=64,
        layer_types=["full_attention", "full_attention"],
        bos_token_id=vocab["<bos>"],
        eos_token_id=vocab["<eos>"],
        pad_token_id=vocab["<pad>"],
    )
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=SIZE, patch_size=7
    )
    Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=vocab["<image_soft_token>"],
        boi_token_index=vocab["<start_of_image>"],
        eoi_token_index=vocab["<end_of_image>"],
        architectures=["Gemma3ForConditionalGeneration"],
    ).save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", type=Path, default=Path("assets/tasks/shapes"))
    parser.add_argument("--model", type=Path, default=Path("assets/hf_configs/tiny-gemma3-vlm"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per_kind", type=int, default=16, help="training pictures per shape and colour")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    write_split(args.task, "train", args.per_kind, rng)
    write_split(args.task, "test", 4, rng)
    write_model(args.model)
    print(f"wrote {args.task}/{{train,test}}.jsonl with their images, and {args.model}")


if __name__ == "__main__":
    main()
