"""An image-text model under FSDP over 2 gloo processes trains to one process's numbers: 5 SFT steps, 5 DPO steps
(the reference model sharded too) and 5 KD steps (from a wider tiny Gemma 3 teacher, sharded too), of a tiny Gemma 3
(SigLIP tower, bidirectional image blocks) on rows with images, losses equal to 1e-5 relative (fp32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_train, scalars
from tests.objectives.tiny_vlm import random_image, vlm_folder

pytest.importorskip("transformers")


def write_rows(folder: Path, objective: str) -> Path:
    """Ten rows with an image each (SFT conversations, or DPO pairs sharing their image) as a JSON array: row i goes
    to rank i % 2, as one process batches them (a JSON-lines file is split into byte ranges, which would batch other
    rows together)."""
    rows = []
    for i in range(10):
        random_image(i, 28 * (1 + i % 2), 28).save(folder / f"image{i}.png")
        user = [{"type": "image"}, {"type": "text", "text": f"w{3 + i % 5} w4" + " w8" * (i % 3)}]
        answer = {"role": "assistant", "content": f"w{5 + i % 3} w6 w7"}
        if objective in ("sft", "kd"):
            rows.append({"messages": [{"role": "user", "content": user}, answer], "images": [f"image{i}.png"]})
        else:
            worse = {"role": "assistant", "content": f"w{9 + i % 2} w6"}
            question = {"role": "user", "content": user[1]["text"]}  # (the image placed before it, as TRL places it)
            pair = {"prompt": [question], "chosen": [answer], "rejected": [worse]}
            rows.append({**pair, "images": [f"image{i}.png"]})
    (folder / "rows.json").write_text(json.dumps(rows))
    return folder / "rows.json"


OWN_FLAGS = {
    "sft": ["--sft.no_packing"],
    "dpo": ["--dpo.no_share_prompt"],
    "kd": ["--kd.no_packing", "--kd.teacher_path"],  # (the teacher's folder follows)
}


@pytest.mark.parametrize(("objective", "kind"), [("sft", "chat"), ("dpo", "preference"), ("kd", "chat")])
def test_fsdp2_equals_one_process(objective: str, kind: str, tmp_path: Path) -> None:
    folder = vlm_folder("gemma3", tmp_path / "model", seed=1)
    data = write_rows(tmp_path, objective)
    common = ["--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf"]
    common += ["--data.path", str(data), "--data.kind", kind, "--training.objective", objective]
    common += ["--checkpoint.no_enable", *OWN_FLAGS[objective]]
    if objective == "kd":
        common.append(str(vlm_folder("gemma3", tmp_path / "teacher", seed=2, hidden_size=48, intermediate_size=96)))
    common += ["--training.steps", "5", "--training.seq_len", "64", "--optimizer.lr", "1e-2"]
    common += ["--training.mixed_precision_param", "float32", "--metrics.log_freq", "1", "--job.no_print_config"]
    layouts = {
        "one": ("--training.local_batch_size", "2"),
        "fsdp2": ("--training.local_batch_size", "1", "--parallelism.data_parallel_shard_degree", "2"),
    }
    losses = {}
    for name, extra in layouts.items():
        run_train([*common, *extra, "--job.dump_folder", str(tmp_path / name)], nproc=2 if name == "fsdp2" else 1)
        losses[name] = scalars(tmp_path / name / "tb")
    print(objective, losses)  # (the docs' numbers)
    assert sorted(losses["one"]) == [1, 2, 3, 4, 5]
    for step, loss in losses["one"].items():
        assert losses["fsdp2"][step] == pytest.approx(loss, rel=1e-5), (step, losses)
