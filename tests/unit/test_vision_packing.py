"""SFT packing with images (``titanium.data.vision.packed_image_row``): several samples in a row, each with its own
images, positions restarting per sample, attention masked per document (Gemma 3's image blocks inside). For the
architectures that pack (Gemma 3, Qwen2.5-VL, Qwen3-VL; tiny random models, fp32) the packed rows' summed loss and
every gradient equal one sample a row's (1e-5 relative), another image for the second sample of a packed row changes
that sample's logits and no other token's (bit for bit), and the packing buffer's images survive a resume. Llama 3.2
Vision and Llama 4 are refused before start-up, naming the flag. (The whole loop with a bad row in a packed stream:
``tests/unit/test_vision_train.py``.)"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.objectives.tiny_vlm import random_image, tiny_config, tiny_processor, vlm_folder
from tests.unit.test_vision_models import load
from titanium.config.vision_section import VisionSection
from titanium.data.packing import PackedDataset, padded_rows
from titanium.data.sft import shifted_labels
from titanium.data.vision import (
    ImageData,
    collate_image_rows,
    images_of,
    packed_image_row,
    padded_image_rows,
    place_images,
)

pytest.importorskip("transformers")

PACKED = ["gemma3", "qwen2_5_vl", "qwen3_vl"]
SAMPLES = [
    ([28, 56], "w5 w6", "w7 w8 w9"),
    ([56], "w1", "w2 w3 w4 w5 w6"),
    ([], "w3 w4", "w9 w8"),
    ([28], "w2 w7", "w1"),
]
"""(image widths, question, answer): two images, one, none (a text sample among image ones), one."""


def samples(data: ImageData, other_image_of: int | None = None) -> list[dict[str, Any]]:
    """The samples as titanium's SFT data makes them (every token but the images learned); ``other_image_of``: that
    sample's images drawn from other seeds (the same sizes)."""
    out = []
    for i, (widths, question, answer) in enumerate(SAMPLES):
        seed = 10 * i + (100 if i == other_image_of else 0)
        pictures = [random_image(seed + k, width, 28) for k, width in enumerate(widths)]
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        ids, kinds, fields = data.tokens(data.pieces(place_images(messages, len(pictures))), pictures)
        out.append({"tokens": ids, "labels": shifted_labels(ids, data.learned(kinds, True)), "images": fields})
    return out


def packed(data: ImageData, rows_of: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The samples packed two a row (seq_len: the longer pair), as ``--sft.packing`` packs them."""
    lengths = [len(s["tokens"]) for s in rows_of]
    seq_len = max(lengths[0] + lengths[3], lengths[1] + lengths[2])
    rows = list(PackedDataset(rows_of, seq_len, 0, 8, partial(packed_image_row, layout=data.layout)))
    return collate_image_rows(rows, data.layout)


def forward(model, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(rows["input"], rows["positions"], rows["document_ids"], images=images_of(rows))


def loss_and_grads(model, rows: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits = forward(model, rows).flatten(0, 1)
    loss = torch.nn.functional.cross_entropy(logits, rows["label"].flatten(), ignore_index=-100, reduction="sum")
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", PACKED)
def test_packed_rows_give_the_loss_and_gradients_of_one_sample_a_row(model_type: str, tmp_path: Path) -> None:
    data = ImageData(tiny_processor(model_type), VisionSection())
    model = load(vlm_folder(model_type, tmp_path, seed=3))[1].model
    rows = samples(data)
    together = packed(data, rows)
    documents = together["document_ids"]
    assert together["input"].shape[0] == 2 and int((documents[:, -1] == 1).sum()) >= 1  # (two samples in a row)
    assert int(together["image_count.pixel_values"].min()) > 0  # (images from samples of both rows)
    apart = padded_image_rows(
        partial(padded_rows, seq_len=256, pad_id=0, pad_to="longest", pad_multiple=1), rows, data.layout
    )
    packed_loss, packed_grads = loss_and_grads(model, together)
    loss, grads = loss_and_grads(model, apart)
    assert packed_loss == pytest.approx(loss, rel=1e-5)
    assert set(packed_grads) == set(grads)
    largest = max(g.norm() for g in grads.values())
    for name, grad in grads.items():  # (a gradient that is rounding alone, as a key bias's: within 1e-9 of the largest)
        assert (packed_grads[name] - grad).norm() <= 1e-5 * grad.norm() + 1e-9 * largest, name


@pytest.mark.parametrize("model_type", PACKED)
def test_an_image_changes_the_logits_of_its_own_sample_only(model_type: str, tmp_path: Path) -> None:
    """The last sample is the second of the first packed row: other images for it move its tokens' logits after its
    first image token and leave every other token's (its row's first sample, the other row) bit for bit."""
    data = ImageData(tiny_processor(model_type), VisionSection())
    model = load(vlm_folder(model_type, tmp_path, seed=3))[1].model
    before, after = packed(data, samples(data)), packed(data, samples(data, other_image_of=3))
    assert torch.equal(before["input"], after["input"]) and torch.equal(before["document_ids"], after["document_ids"])
    assert not torch.equal(before["image.pixel_values"], after["image.pixel_values"])
    with torch.no_grad():
        moved = (forward(model, before) - forward(model, after)).abs().amax(dim=-1)
    second = before["document_ids"] == 1
    second[1] = False  # (the first row's second sample: the last one)
    assert int(second.sum()) == len(samples(data)[3]["tokens"])
    assert torch.equal(moved[~second], torch.zeros_like(moved[~second]))
    assert moved[second].max() > 1e-3


class Stream:
    """A resumable stream of samples (a list and a position)."""

    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items, self.position = items, 0

    def __iter__(self):
        while self.position < len(self.items):
            self.position += 1
            yield self.items[self.position - 1]

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def test_the_buffered_samples_keep_their_images_over_a_resume() -> None:
    """A packing buffer saved mid-stream (samples waiting with their images) and loaded into a new dataset makes the
    very rows, images included, that the first dataset goes on to make."""
    data = ImageData(tiny_processor("gemma3"), VisionSection())
    items = samples(data) * 2
    seq_len = max(len(s["tokens"]) for s in items) + 12
    row_of = partial(packed_image_row, layout=data.layout)
    first = PackedDataset(Stream(items), seq_len, 0, 4, row_of)
    stream = iter(first)
    next(stream)
    state = first.state_dict()
    assert "images" in state["buffer"]
    rest = list(stream)
    again = PackedDataset(Stream(items), seq_len, 0, 4, row_of)
    again.load_state_dict(state)
    resumed = list(again)
    assert len(resumed) == len(rest) > 0
    for ours, theirs in zip(resumed, rest, strict=True):
        assert ours.keys() == theirs.keys() and ours["images"].keys() == theirs["images"].keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours if k != "images")
        assert all(torch.equal(ours["images"][k], theirs["images"][k]) for k in ours["images"])


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl", "mllama", "gemma3", "llama4"])
def test_packing_is_refused_where_it_is_not_made_exact(model_type: str) -> None:
    """``--sft.packing`` passes the preflight checks for the architectures above; Llama 3.2 Vision (cross-attention
    over each sample's tiles) and Llama 4 (not checked) are refused naming the flag and its off switch, and so is
    packing with images for any other objective (``--dpo.packing``)."""
    from titanium.models.spec import ModelUse
    from titanium.models.transformers.args import TransformersArgs
    from titanium.models.transformers.checks import backend_refusals

    args = TransformersArgs.from_config(tiny_config(model_type).to_dict())
    problems = backend_refusals(args, ModelUse(packing="--sft.packing"))
    if model_type in PACKED:
        assert problems == []
    else:  # (Llama 4 also for its chunked attention layers, which run as transformers' own and would mix samples)
        assert problems and all(p.startswith("--sft.packing: ") and "set --sft.no_packing" in p for p in problems)
    problems = backend_refusals(args, ModelUse(packing="--dpo.packing"))
    assert problems and all(p.startswith("--dpo.packing: ") and "set --dpo.no_packing" in p for p in problems)


def test_packing_llama_3_2_vision_stops_the_job_before_start_up(tmp_path: Path, capsys, monkeypatch) -> None:
    """The refusal is ``titanium.train``'s preflight checks': exit 2 and one line naming the flag, before any process
    group or model exists."""
    import json

    from tests.helpers import REPO
    from titanium.train import main

    monkeypatch.chdir(REPO)
    folder = vlm_folder("mllama", tmp_path / "model")
    (tmp_path / "rows.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "w1"}]}) + "\n")
    args = ["--job.dump_folder", str(tmp_path / "run"), "--checkpoint.initial_load_path", str(folder)]
    args += ["--checkpoint.initial_load_in_hf", "--data.path", str(tmp_path / "rows.jsonl"), "--data.kind", "chat"]
    args += ["--training.objective", "sft", "--training.seq_len", "64", "--sft.packing"]
    assert main(args) == 2
    error = capsys.readouterr().err
    assert "--sft.packing: Llama 3.2 Vision's text reads the images through cross-attention" in error
    assert "set --sft.no_packing" in error and "Traceback" not in error
