"""Image-text models under FSDP 2, TP 2 and (4 processes) FSDP 2 x TP 2 on gloo train to one process's numbers over 5
steps (fp32; losses to 1e-5 relative, grad norms to 2e-4; gradients clipped at 1.0 every step, so a vision gradient
missed or counted twice would move the losses): a tiny Gemma 3 (SigLIP tower, bidirectional image blocks) in SFT, DPO
(the reference model laid out the same), GRPO and online DPO (under FSDP 2; GRPO under TP 2 too) and KD (from a wider
tiny Gemma 3 teacher, under FSDP), and a tiny Qwen2.5-VL (window-attention tower, patch merger, M-RoPE) in SFT, on rows
with images; a tiny Llama 4 (early fusion, its MoE block on titanium's MoE: 2 experts, top-1 sigmoid routing, a shared
expert, the auxiliary loss) in SFT under expert parallelism 2 (one expert a rank, FSDP 2 over the rest). Under TP the
language model is split by its plan and the vision tower and projector are computed whole on every rank. GRPO's and
online DPO's responses are fixed in advance (tests/objectives/fixed_rollouts.py: under FSDP each rank samples its own
prompts' responses with its own generator), with their prompts' images; the rest is the real objective on images: the
engine synced from the laid-out policy, whose forward over the rows with their pixels gives the old log-probs, the
reference and the loss.

The jobs of each process count run in one launch (``python -m tests.objectives.fixed_rollouts``, which also gives
Qwen2.5-VL and Llama 4 the tiny processors of ``tiny_processors``: theirs need torchvision); the 4-process jobs ride in
the launch the layout tests share (conftest.py's ``four_process_runs``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.parity import assert_matches, assert_metrics_match, layout_runs
from tests.helpers import scalars
from tests.objectives.tiny_vlm import random_image, vlm_folder

pytest.importorskip("transformers")

OBJECTIVES = {
    "sft": ("--data.kind", "chat", "--training.objective", "sft", "--sft.no_packing"),
    "dpo": ("--data.kind", "preference", "--training.objective", "dpo", "--dpo.no_share_prompt"),
    "grpo": ("--data.kind", "chat", "--training.objective", "grpo", "--grpo.group_size", "2", "--grpo.beta", "0.1")
    + ("--grpo.old_logprobs", "recompute"),  # (the engine's log-probs beside the laid-out policy's: MISMATCH)
    "online_dpo": ("--data.kind", "chat", "--training.objective", "online_dpo"),
    "kd": ("--data.kind", "chat", "--training.objective", "kd", "--kd.no_packing"),  # (its teacher: vision_jobs)
}
ROLLOUTS = ("--rl.max_new_tokens", "4", "--rl.max_prompt_len", "40")
ROLLOUTS += ("--rl.rewards", "tests.objectives.fixed_rollouts:characters")  # (a reward telling the responses apart)
ROLLOUTS += ("--training.local_batch_size", "2", "--training.global_batch_size", "4")
"""What GRPO and online DPO add in every layout: a microbatch holds one prompt's 2 responses (whole groups), so a step
of 2 prompts is 2 microbatches of one process or of TP 2 and one a rank under FSDP 2 (after the layout's batch size,
which it overrides)."""
FSDP2 = ("--parallelism.data_parallel_shard_degree", "2")
TP2 = ("--parallelism.tensor_parallel_degree", "2")
EP2 = ("--parallelism.expert_parallel_degree", "2")
LAYOUTS = {  # name -> (processes, arguments); every layout batches the same 2 rows a step
    "one": (1, ("--training.local_batch_size", "2")),
    "fsdp2": (2, ("--training.local_batch_size", "1", *FSDP2)),
    "tp2": (2, ("--training.local_batch_size", "2", *TP2)),
    "fsdp2_tp2": (4, ("--training.local_batch_size", "1", *FSDP2, *TP2)),
    "ep2": (2, ("--training.local_batch_size", "1", *FSDP2, *EP2)),
}
CASES = {  # (model, objective) -> the layouts compared with one process
    ("gemma3", "sft"): ("fsdp2", "tp2", "fsdp2_tp2"),
    ("gemma3", "dpo"): ("fsdp2", "tp2", "fsdp2_tp2"),
    ("gemma3", "grpo"): ("fsdp2", "tp2"),
    ("gemma3", "online_dpo"): ("fsdp2",),
    ("gemma3", "kd"): ("fsdp2",),
    ("qwen2_5_vl", "sft"): ("fsdp2", "tp2"),
    ("llama4", "sft"): ("ep2",),
}
ROLLOUT_METRICS = {
    "grpo": ("loss_metrics/global_avg_loss", "optim/grad_norm", "grpo/reward", "grpo/kl"),
    "online_dpo": ("loss_metrics/global_avg_loss", "optim/grad_norm", "online_dpo/score", "online_dpo/kl")
    + ("online_dpo/rewards/chosen", "online_dpo/rewards/rejected"),
}
"""GRPO's losses pass through 0 (advantages centred), so these are compared to 1e-5 relative or absolute."""
MISMATCH = 1e-5
"""The most a response token's log-prob under the rollout engine (synced from the laid-out policy; its forward over
the rows with their images gives the fixed responses' log-probs) differs from the trained policy's at any step
(``grpo/logprob_mismatch_max``): an engine reading no images, or other pixels, would differ by far more."""


def write_rows(folder: Path, objective: str) -> Path:
    """Ten rows with an image each (SFT conversations, DPO pairs sharing their image, GRPO prompts) as a JSON array:
    row i goes to rank i % 2, as one process batches them (a JSON-lines file is split into byte ranges, which would
    batch other rows together)."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(10):
        random_image(i, 28 * (1 + i % 2), 28).save(folder / f"image{i}.png")
        text = f"w{3 + i % 5} w4" + " w8" * (i % 3)
        user = [{"type": "image"}, {"type": "text", "text": text}]
        answer = {"role": "assistant", "content": f"w{5 + i % 3} w6 w7"}
        question = {"role": "user", "content": text}  # (the image placed before it, as TRL places it)
        if objective in ("sft", "kd"):
            rows.append({"messages": [{"role": "user", "content": user}, answer], "images": [f"image{i}.png"]})
        elif objective == "dpo":
            worse = {"role": "assistant", "content": f"w{9 + i % 2} w6"}
            pair = {"prompt": [question], "chosen": [answer], "rejected": [worse]}
            rows.append({**pair, "images": [f"image{i}.png"]})
        else:
            rows.append({"prompt": [question], "answer": f"w{5 + i % 3}", "images": [f"image{i}.png"]})
    (folder / "rows.json").write_text(json.dumps(rows))
    return folder / "rows.json"


def vision_jobs(folder: Path, nproc: int) -> dict[str, tuple[str, ...]]:
    """``{model}_{objective}_{layout}`` -> the arguments (after ``parity.tiny_args``) of each case (``CASES``) in
    each of its layouts of ``nproc`` processes (one process: every case), on the tiny models and rows made in
    ``folder`` (the same files wherever they are made)."""
    rows = {objective: write_rows(folder / objective, objective) for objective in OBJECTIVES}
    models: dict[str, Path] = {}
    jobs: dict[str, tuple[str, ...]] = {}
    for (model_type, objective), layouts in CASES.items():
        layouts = tuple(name for name in ("one", *layouts) if LAYOUTS[name][0] == nproc)
        if not layouts:
            continue
        if model_type not in models:
            models[model_type] = vlm_folder(model_type, folder / model_type, seed=1)
        model = str(models[model_type])
        common = ("--checkpoint.initial_load_path", model, "--checkpoint.initial_load_in_hf")
        common += ("--tokenizer.kind", "hf", "--tokenizer.path", model, "--data.path", str(rows[objective]))
        common += (*OBJECTIVES[objective], "--optimizer.lr", "1e-2")
        rollouts = ROLLOUTS if objective in ROLLOUT_METRICS else ()
        if objective == "kd":  # (a wider tiny Gemma 3 teacher with the same processor, laid out as the student)
            teacher = vlm_folder("gemma3", folder / "teacher", seed=2, hidden_size=48, intermediate_size=96)
            common += ("--kd.teacher_path", str(teacher))
        jobs.update({f"{model_type}_{objective}_{name}": (*common, *LAYOUTS[name][1], *rollouts) for name in layouts})
    return jobs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """``{model}_{objective}_{layout}`` -> the folder of every 1- and 2-process job, one launch per count."""
    out = {}
    for nproc in (1, 2):
        tmp = tmp_path_factory.mktemp(f"vision_{nproc}")
        jobs = vision_jobs(tmp, nproc)
        layout_runs(tmp, nproc, jobs, data=(), module="tests.objectives.fixed_rollouts")
        out.update({name: tmp / name for name in jobs})
    return out


def assert_equal_runs(folder: Path, reference: Path, objective: str) -> None:
    """The run in ``folder`` trained as the one in ``reference`` (``parity.assert_matches``; GRPO and online DPO:
    ``ROLLOUT_METRICS``)."""
    if objective in ROLLOUT_METRICS:
        assert_metrics_match(folder, ROLLOUT_METRICS[objective], reference)
    else:
        runs = [(scalars(f / "tb"), scalars(f / "tb", "optim/grad_norm")) for f in (folder, reference)]
        assert_matches(*runs)


@pytest.mark.parametrize(
    ("model", "objective", "layout"),
    [(*case, layout) for case, layouts in CASES.items() for layout in layouts if LAYOUTS[layout][0] == 2],
)
def test_layout_equals_one_process(runs, model: str, objective: str, layout: str) -> None:
    folder, reference = runs[f"{model}_{objective}_{layout}"], runs[f"{model}_{objective}_one"]
    assert_equal_runs(folder, reference, objective)
    if objective == "grpo":
        for run in (folder, reference):
            mismatch = scalars(run / "tb", "grpo/logprob_mismatch_max")
            assert all(value <= MISMATCH for value in mismatch.values()), (run.name, mismatch)
    if layout == "ep2":  # (routing is discontinuous: a wrong gate or exchange shows in the loads first)
        assert_metrics_match(folder, ("moe/max_load", "moe/aux_loss"), reference)


@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_fsdp2_tp2_equals_one_process(four_process_runs, runs, objective: str) -> None:
    folder = four_process_runs[f"gemma3_{objective}_fsdp2_tp2"][1]
    assert_equal_runs(folder, runs[f"gemma3_{objective}_one"], objective)
