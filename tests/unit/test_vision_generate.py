"""Generation with images (titanium's engine, as held-out exact match runs it on an image-text model): the prompt's
images read by the prefill, the answer decoded from the KV cache after it, gives ``transformers``' own greedy
``generate`` tokens on the same image and text (tiny random Gemma 3: early fusion, bidirectional image blocks;
Llama 3.2 Vision: cross-attention states kept in the cache); and ``[eval]``'s exact match on held-out rows with
images scores those answers (a row whose image is missing skipped)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.objectives.tiny_vlm import random_image, tiny_processor, tiny_vlm, vlm_folder
from titanium.config.sections import DataSection, EvalSection, ModelSection, TokenizerSection
from titanium.config.vision_section import VisionSection
from titanium.data.chat import build_chat_template
from titanium.data.tokenizer import build_tokenizer
from titanium.data.vision import ImageData, image_rows, images_of, place_images
from titanium.evaluation.exact_match import ExactMatchEvaluator
from titanium.generation.generate import generate
from titanium.generation.sampling import SamplingParams
from titanium.model_builder import ModelBuilder, resolve_spec

pytest.importorskip("transformers")
NEW_TOKENS = 6


@pytest.mark.parametrize("model_type", ["gemma3", "mllama"])
def test_greedy_answer_with_an_image_equals_transformers(model_type: str, tmp_path: Path) -> None:
    folder = vlm_folder(model_type, tmp_path, seed=7)
    spec, _ = resolve_spec(ModelSection(), str(folder))
    model = ModelBuilder(torch.device("cpu")).load_hf(spec, folder, max_seq_len=128).model.eval()
    data = ImageData(tiny_processor(model_type), VisionSection())
    pictures = [random_image(3, 56, 28)]
    text = data.render(place_images([{"role": "user", "content": "w5 w6 w7"}], 1), generation=True)
    ids, _, fields = data.tokens([(text, "prompt")], pictures)
    images = images_of(image_rows([{"images": fields}], len(ids), data.layout))
    eos = data.tokenizer.eos_token_id
    with torch.no_grad():
        ours = generate(model, [ids], SamplingParams(NEW_TOKENS, temperature=0.0), {eos}, 0, images=images)
    inputs = data.processor(text=[text], images=[pictures], return_tensors="pt", add_special_tokens=False)
    assert inputs["input_ids"][0].tolist() == ids
    theirs = tiny_vlm(model_type, seed=7).generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    theirs = theirs[0, len(ids) :].tolist()
    assert ours.token_lists(keep_stop=True)[0] == theirs[: theirs.index(eos) + 1 if eos in theirs else None]


def test_exact_match_reads_held_out_images(tmp_path: Path) -> None:
    """Three held-out rows, one whose image file is missing (skipped): the first row's reference is ``transformers``'
    greedy answer to its picture, the second's another text, so the score is exactly 1/2. (Seed 11: a model whose
    greedy answer stays within the tokenizer's 51 ids; the tiny model's output layer has 64, and an id without text
    cannot be decoded.)"""
    import json

    folder = vlm_folder("gemma3", tmp_path / "model", seed=11)
    spec, _ = resolve_spec(ModelSection(), str(folder))
    model = ModelBuilder(torch.device("cpu")).load_hf(spec, folder, max_seq_len=128).model.eval()
    processor = ImageData(tiny_processor("gemma3"), VisionSection())
    tokenizer = build_tokenizer(TokenizerSection(kind="hf", path=str(folder)))
    template = build_chat_template("auto", tokenizer, "")
    question = "w5 w6 w7"
    random_image(3, 56, 28).save(tmp_path / "a.png")
    text = processor.render(place_images([{"role": "user", "content": question}], 1), generation=True)
    inputs = processor.processor(text=[text], images=[[random_image(3, 56, 28)]], return_tensors="pt")
    answer = tiny_vlm("gemma3", seed=11).generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    answer = answer[0, inputs["input_ids"].shape[1] :].tolist()
    stop = next((i for i, t in enumerate(answer) if t in template.stop_ids), len(answer))
    reference = tokenizer.decode(answer[:stop])
    rows = [(reference, "a.png"), ("w1 w2", "a.png"), (reference, "missing.png")]
    lines = [
        {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": ref}], "images": [image]}
        for ref, image in rows
    ]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    cfg = EvalSection(interval=1, path=str(tmp_path / "test.jsonl"), max_new_tokens=NEW_TOKENS)
    evaluator = ExactMatchEvaluator(cfg, DataSection(kind="chat"), template, tokenizer, processor=processor)
    assert evaluator.total == 2
    assert evaluator(model) == {"eval/exact_match": 0.5, "eval/samples": 2}
