"""GRPO (and online DPO) on image questions (issue 41, item 5): ``titanium.train`` (one process, fp32) from a tiny Gemma
3 folder with prompt rows that carry images. titanium's engine samples the responses with each prompt's pixels in its
prefill; the trainer's recomputed log-probs of those responses (``--grpo.old_logprobs recompute``: the policy's
forward over the rollout rows, left-padded prompts of two lengths with their image fields) equal the engine's
sampling log-probs (1e-5), and the reference (the starting weights) gives the same at the first step (KL 0): the
images reached all three. Another picture for a prompt moves those log-probs. The loss is finite over the steps run.
What cannot be exact yet is refused before start-up."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import scalars
from tests.objectives.tiny_processors import use_tiny_processors
from tests.objectives.tiny_vlm import random_image, tiny_processor, tiny_vlm, vlm_folder
from titanium.models.common.kv_cache import PAD_DOCUMENT

pytest.importorskip("transformers")

PROMPTS = [("w5 w6", "w7"), ("w1 w2 w3 w4", "w8")]
"""(question, answer): prompts of two lengths, so one is left-padded."""
IMAGE_SIZES = {"mllama": [(56, 28), (84, 28)]}
"""Each prompt's image (width, height) by architecture, else ``[(56, 56), (84, 28)]``: Qwen-VL's 2x2 and 1x3 merged
grids, the first moving the M-RoPE positions after it (by -2: decoding must add its row's offset), the second not.
Llama 3.2 Vision's: 1x2 and 1x3 tiles (its tiny model's tile embeddings know the ids of 1xN tiles, not 2x2's)."""


def model_folder(folder: Path, model_type: str = "gemma3") -> Path:
    """The tiny ``model_type`` folder, its vocabulary the tokenizer's ids (the tiny model's is wider: sampled ids the
    tokenizer lacks could not be decoded for the rewards)."""
    return vlm_folder(model_type, folder, seed=1, vocab_size=len(tiny_processor(model_type).tokenizer))


def tiny_model(model_type: str) -> Any:
    """The weights ``model_folder`` saves, as ``transformers``' model."""
    return tiny_vlm(model_type, seed=1, vocab_size=len(tiny_processor(model_type).tokenizer))


def write_prompts(folder: Path, model_type: str = "gemma3") -> Path:
    rows = []
    sizes = IMAGE_SIZES.get(model_type, [(56, 56), (84, 28)])
    for i, ((question, answer), size) in enumerate(zip(PROMPTS, sizes)):
        random_image(i, *size).save(folder / f"image{i}.png")
        prompt = [{"role": "user", "content": question}] if i == 0 else question  # (conversational, then plain)
        rows.append({"prompt": prompt, "answer": answer, "image": f"image{i}.png"})
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def rl_args(objective: str, folder: Path, prompts: Path, run: Path, *more: str) -> list[str]:
    args = ["--job.dump_folder", str(run), "--job.no_print_config", "--metrics.log_freq", "1", "--checkpoint.no_enable"]
    args += ["--training.seq_len", "64", "--training.mixed_precision_param", "float32"]
    args += ["--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf"]
    args += ["--data.path", str(prompts), "--data.kind", "chat", "--training.objective", objective]
    args += ["--training.local_batch_size", "4", "--rl.max_new_tokens", "4"]
    args += ["--rl.rewards", "exact_match", "--rl.answer_column", "answer", "--rl.max_prompt_len", "40"]
    return [*args, *more]


def grpo_args(folder: Path, prompts: Path, run: Path, *more: str) -> list[str]:
    return rl_args("grpo", folder, prompts, run, "--grpo.group_size", "2", *more)


def test_grpo_on_images_trainer_logprobs_equal_the_engines(make_trainer, tmp_path: Path) -> None:
    folder = model_folder(tmp_path / "model")
    prompts, run = write_prompts(tmp_path), tmp_path / "run"
    more = ["--grpo.old_logprobs", "recompute", "--grpo.beta", "0.1", "--training.steps", "3", "--optimizer.lr", "1e-2"]
    trainer = make_trainer(*grpo_args(folder, prompts, run, *more))
    trainer.train()
    losses = scalars(run / "tb")
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(v) for v in losses.values())
    mismatch = scalars(run / "tb", "grpo/logprob_mismatch_max")
    assert mismatch and all(v <= 1e-5 for v in mismatch.values()), mismatch  # (each step makes a batch)
    assert abs(scalars(run / "tb", "grpo/kl")[1]) <= 1e-6  # (the reference read the same pixels at step 1)

    source = trainer.objective.source
    rows = source.current.rows
    assert rows["image.pixel_values"].shape[0] == 4 and "image.token_type_ids" in rows
    assert bool((rows["document_ids"][:2] == PAD_DOCUMENT).any()) != bool(
        (rows["document_ids"][2:] == PAD_DOCUMENT).any()
    )  # (padded)
    mask = rows["response_mask"]
    now = source.policy_logprobs(rows)
    swapped = {**rows, "image.pixel_values": rows["image.pixel_values"].flip(0)}  # (each prompt the other's picture)
    moved = (source.policy_logprobs(swapped) - now).abs()[mask]
    assert float(moved.max()) > 1e-3
    assert torch.equal(source.policy_logprobs(rows), now)


def test_online_dpo_on_images_starts_at_log_2_with_the_reference_on_the_same_pixels(make_trainer, tmp_path) -> None:
    """Online DPO (two sampled responses per image prompt, the chosen one by the reward): at the first step the policy
    and the reference are the same weights, so each pair's loss is log 2 and the KL 0 only if both read each row's
    pixels (the reference's log-probs are computed apart, before the step); another picture moves the reference's
    log-probs of the same responses."""
    folder = model_folder(tmp_path / "model")
    run = tmp_path / "run"
    more = ("--training.steps", "2", "--optimizer.lr", "1e-2")
    trainer = make_trainer(*rl_args("online_dpo", folder, write_prompts(tmp_path), run, *more))
    trainer.train()
    losses = scalars(run / "tb")
    assert sorted(losses) == [1, 2] and abs(losses[1] - math.log(2)) <= 1e-6 and math.isfinite(losses[2]), losses
    assert abs(scalars(run / "tb", "online_dpo/kl")[1]) <= 1e-6
    source = trainer.objective.source
    rows = source.current.rows
    assert rows["image.pixel_values"].shape[0] == 4
    swapped = {**rows, "image.pixel_values": rows["image.pixel_values"].flip(0)}
    moved = (source.reference_logprobs(swapped) - source.reference_logprobs(rows)).abs()[rows["response_mask"]]
    assert float(moved.max()) > 1e-3


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--rollout.engine", "vllm"], "--rollout.engine vllm"),
        (["--rl.dynamic_sampling"], "--rl.dynamic_sampling"),
        (["--environment.name", "tools"], "[environment]"),
    ],
)
def test_what_grpo_cannot_do_with_images_is_refused_before_start_up(tmp_path: Path, flags, named) -> None:
    from titanium.config.errors import ConfigError
    from titanium.inputs import load_job
    from titanium.preflight import check_job

    folder = vlm_folder("gemma3", tmp_path / "model", seed=1)
    args = grpo_args(folder, write_prompts(tmp_path), tmp_path / "run", "--training.steps", "1", *flags)
    with pytest.raises(ConfigError, match=re.escape(named)):
        check_job(load_job(args), 1, "cpu")


def test_prompts_with_images_are_the_processors_and_bad_rows_are_skipped_and_counted(tmp_path: Path) -> None:
    """A prompt row's ids and image fields are the processor's on its chat template's generation prompt with the
    row's image (a string prompt: one user message, the image before its text, as TRL places it); a row whose image
    is missing, or with more image parts than images, is skipped and counted."""
    from PIL import Image

    from titanium.config.rl_sections import RLSection
    from titanium.config.sections import DataSection, TokenizerSection
    from titanium.config.vision_section import VisionSection
    from titanium.data.prompts import PromptDataset
    from titanium.data.tokenizer import build_tokenizer
    from titanium.data.vision import ImageData

    folder = vlm_folder("gemma3", tmp_path / "model", seed=1)
    path = write_prompts(tmp_path)
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "w1"}]}]
    bad = [{"prompt": "w2", "image": "nowhere.png"}, {"prompt": two, "image": "image0.png"}]
    path.write_text(path.read_text() + "".join(json.dumps({**row, "answer": "w3"}) + "\n" for row in bad))
    processor = ImageData(tiny_processor("gemma3"), VisionSection())
    data = DataSection(path=str(path), kind="chat")
    tokenizer = build_tokenizer(TokenizerSection(kind="hf", path=str(folder)))
    prompts = PromptDataset(data, RLSection(answer_column="answer"), tokenizer, None, processor=processor)
    stream = iter(prompts)
    samples = [next(stream) for _ in range(3)]  # (the stream goes round again after the bad rows)
    assert prompts.bad_rows == 2
    for i, (sample, (question, answer)) in enumerate(zip(samples, PROMPTS)):
        image = Image.open(tmp_path / f"image{i}.png").convert("RGB")
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = processor.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        expected = processor.processor(text=[text], images=[[image]], return_tensors="pt", add_special_tokens=False)
        assert sample.prompt == expected["input_ids"][0].tolist() and sample.answer == answer
        assert torch.equal(sample.images["pixel_values"], expected["pixel_values"])
        assert torch.equal(sample.images["token_type_ids"], expected["token_type_ids"][0])


def test_grpo_sampling_logprobs_on_images_equal_transformers(make_trainer, tmp_path: Path) -> None:
    """The engine's sampling log-probs of the first batch equal ``transformers``' Gemma 3 on each row alone (its
    prompt without the left padding, the response, the row's pixel values and ``token_type_ids``; fp32, 1e-5): the
    left-padded prefill with image fields is the model's own computation. Rows whose response sampled the image token
    are left out (``transformers`` would take it for a placeholder)."""
    folder = model_folder(tmp_path / "model")
    run = tmp_path / "run"
    trainer = make_trainer(*grpo_args(folder, write_prompts(tmp_path), run, "--training.steps", "1"))
    trainer.train()
    rows = trainer.objective.source.current.rows
    model = tiny_model("gemma3")
    width, compared = rows["response_mask"].shape[1], set()
    for row in range(rows["tokens"].shape[0]):
        keep = rows["document_ids"][row] != PAD_DOCUMENT
        ids = rows["tokens"][row][keep]
        if bool((ids[-width:] == model.config.image_token_id).any()):
            continue
        count = int(rows["image_count.pixel_values"][row])
        inputs = {"pixel_values": rows["image.pixel_values"][row, :count]}
        inputs["token_type_ids"] = rows["image.token_type_ids"][row][keep][None]
        with torch.no_grad():
            logits = model(input_ids=ids[None], **inputs).logits[0].float()
        expected = torch.log_softmax(logits[-width - 1 : -1], -1).gather(1, ids[-width:, None])[:, 0]
        mask = rows["response_mask"][row]
        torch.testing.assert_close(rows["old_logprobs"][row][mask], expected[mask], rtol=0, atol=1e-5)
        compared.add(row // 2)  # (its prompt)
    assert compared == {0, 1}, compared  # (the left-padded prompt and the other)


def reference_logprobs(model: Any, model_type: str, rows: dict[str, torch.Tensor], row: int) -> torch.Tensor | None:
    """``transformers``' log-probs of row ``row``'s response (its last ``response_mask`` width tokens) on the row alone:
    its prompt without the left padding, the row's real image entries, per-token fields over the same tokens.
    Llama 3.2 Vision's ``cross_attention_mask`` over the response is the last prompt token's, as ``transformers``'
    generation extends it. None where the response sampled an image placeholder of an early-fusion model (there
    ``transformers`` would look for image features)."""
    width = rows["response_mask"].shape[1]
    keep = rows["document_ids"][row] != PAD_DOCUMENT
    ids = rows["tokens"][row][keep]
    placeholder = getattr(model.config, "image_token_id", None)
    if model_type != "mllama" and bool((ids[-width:] == placeholder).any()):
        return None
    inputs = {}
    for key, value in rows.items():
        if not key.startswith("image."):
            continue
        name = key.removeprefix("image.")
        if f"image_count.{name}" in rows:
            value = value[row, : int(rows[f"image_count.{name}"][row])]
            inputs[name] = value[None] if model_type == "mllama" else value  # (Mllama's are per row)
        else:
            inputs[name] = value[row][keep][None]
    if model_type == "mllama":
        images = inputs["pixel_values"].shape[1]
        mask = inputs["cross_attention_mask"][:, :, :images]
        prompt = mask[:, :-width]
        inputs["cross_attention_mask"] = torch.cat([prompt, prompt[:, -1:].expand(-1, width, -1, -1)], 1)
    with torch.no_grad():
        logits = model(input_ids=ids[None], **inputs).logits[0].float()
    return torch.log_softmax(logits[-width - 1 : -1], -1).gather(1, ids[-width:, None])[:, 0]


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl", "mllama"])
def test_grpo_on_images_of_each_architecture_equals_transformers(make_trainer, monkeypatch, tmp_path, model_type):
    """Qwen2.5-VL and Qwen3-VL (M-RoPE positions continued past left padding and into the decoded tokens) and Llama
    3.2 Vision (the cross-attention mask left-padded with the prompt and extended over the response): the engine's
    sampling log-probs of the first batch equal ``transformers``' on each row alone (``reference_logprobs``; fp32,
    1e-5), the left-padded prompt's rows among them, and the trainer's recomputed log-probs equal the engine's at
    each of 2 steps (``grpo/logprob_mismatch_max`` <= 1e-5)."""
    from titanium.rl.source import RolloutSource

    use_tiny_processors(monkeypatch)
    folder = model_folder(tmp_path / "model", model_type)
    run = tmp_path / "run"
    first, recompute = [], RolloutSource.policy_logprobs

    def keep_first(self, rows):  # (the first batch's rows, the engine's log-probs still in them)
        if not first:
            first.append({k: v.clone() for k, v in rows.items()})
        return recompute(self, rows)

    monkeypatch.setattr(RolloutSource, "policy_logprobs", keep_first)
    more = ["--grpo.old_logprobs", "recompute", "--training.steps", "2", "--optimizer.lr", "1e-2"]
    more += ["--rl.rewards", "tests.objectives.fixed_rollouts:characters"]  # (rewards that differ: the policy moves)
    trainer = make_trainer(*grpo_args(folder, write_prompts(tmp_path, model_type), run, *more))
    trainer.train()

    rows, model = first[0], tiny_model(model_type)
    padded = [bool((rows["document_ids"][row] == PAD_DOCUMENT).any()) for row in range(rows["tokens"].shape[0])]
    assert any(padded) and not all(padded)
    compared = set()
    for row in range(rows["tokens"].shape[0]):
        expected = reference_logprobs(model, model_type, rows, row)
        if expected is None:
            continue
        mask = rows["response_mask"][row]
        torch.testing.assert_close(rows["old_logprobs"][row][mask], expected[mask], rtol=0, atol=1e-5)
        compared.add(padded[row])
    assert compared == {True, False}, compared  # (a left-padded prompt's rows and the other's)
    mismatch = scalars(run / "tb", "grpo/logprob_mismatch_max")
    assert sorted(mismatch) == [1, 2] and all(v <= 1e-5 for v in mismatch.values()), mismatch
    assert scalars(run / "tb", "optim/grad_norm")[1] > 1e-3  # (step 2's responses were sampled by changed weights)
