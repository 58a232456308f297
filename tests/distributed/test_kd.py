"""The kd objective on the bundled chat task: alpha = 0 is SFT, a teacher from a Hugging Face folder or a titanium
checkpoint, and FSDP trains like one process (fp32, gloo, 5 steps, 4 padded samples of 64 tokens per step).

Teachers: the debug model from another seed, exported to HF format in the test (``hf_teacher``); the SFT run's
own step-5 checkpoint (a titanium checkpoint, shape from --kd.teacher_flavor). One launch per process count:

- ``sft`` (full logits) and ``kd_alpha0`` (chunked distillation loss, alpha 0): the same losses to 1e-5 and grad
  norms to 2e-4, with kd/divergence logged but not trained on;
- ``kd_dcp``: forward KL from the SFT checkpoint, alpha 0.5 (a teacher trained on the same task);
- ``kd_jsd`` against ``fsdp2_kd_jsd``, ``tp2_kd_jsd``, ``pp2_kd_jsd`` and ``cp2_kd_jsd``: the generalized JSD
  (beta 0.5, T 2) from the HF teacher, one process against FSDP over 2 ranks (each reading half the rows), tensor
  parallelism over 2 ranks (the student's projection vocabulary-sharded and its hidden states sequence-parallel,
  gathered for the loss), a 2-stage 1F1B pipeline (4 one-row pipeline microbatches; the loss from the last
  stage's logits and the teacher pipeline's) and context parallelism over 2 ranks (each projecting its part of
  every sequence); each time the teacher is built under the same plan as the student. Losses 1e-5, grad norms
  2e-4, the two metrics 1e-5. All 2-process layouts run in one launch.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.parity import STEPS, assert_matches, layout_runs
from tests.helpers import scalars
from titanium.checkpoint.hf import export_hf
from titanium.model_builder import ModelBuilder
from titanium.models import build_model_args, get_model_spec

SFT = (
    "--data.kind", "chat", "--data.path", "assets/tasks/arithmetic/train.jsonl", "--chat.chat_template", "llama3",
    "--optimizer.lr", "1e-3", "--data.shards", "2", "--sft.no_packing", "--kd.no_packing",
)  # fmt: skip
VOCAB = 2256  # (the debug tokenizer's)
METRICS = ("kd/ce", "kd/divergence")
PP2 = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B")
LAYOUTS = ("fsdp2_kd_jsd", "tp2_kd_jsd", "pp2_kd_jsd", "cp2_kd_jsd")


def kd(teacher: str, *extra: str) -> tuple[str, ...]:
    return ("--training.objective", "kd", "--kd.teacher_path", teacher, "--kd.chunk_size", "48", *extra)


def test_kd_is_sft_at_alpha_0_and_fsdp_tp_pp_cp_match_one_process(tmp_path):
    spec = get_model_spec("llama3")
    args = build_model_args(spec, "debugmodel", max_seq_len=64, vocab_size=VOCAB)
    teacher = ModelBuilder(torch.device("cpu"), seed=1).build(spec, args)
    export_hf(teacher.model, tmp_path / "hf_teacher", spec.hf_adapter, args)
    hf_teacher, dcp_teacher = str(tmp_path / "hf_teacher"), str(tmp_path / "sft/checkpoint" / f"step-{STEPS}")
    jsd = ("--kd.alpha", "0.5", "--kd.divergence", "jsd", "--kd.beta", "0.5", "--kd.temperature", "2")
    jobs = {
        1: {
            "sft": ("--training.objective", "sft", "--checkpoint.enable", "--checkpoint.interval", str(STEPS)),
            "kd_alpha0": kd(hf_teacher, "--kd.alpha", "0"),
            "kd_dcp": kd(dcp_teacher, "--kd.teacher_flavor", "debugmodel", "--kd.alpha", "0.5"),
            "kd_jsd": kd(hf_teacher, *jsd),
        },
        2: {
            "fsdp2_kd_jsd": kd(hf_teacher, *jsd, "--training.local_batch_size", "2"),
            "tp2_kd_jsd": kd(hf_teacher, *jsd, "--parallelism.tensor_parallel_degree", "2"),
            "pp2_kd_jsd": kd(hf_teacher, *jsd, *PP2),
            "cp2_kd_jsd": kd(hf_teacher, *jsd, "--parallelism.context_parallel_degree", "2"),
        },
    }
    runs = {
        name: run for nproc, named in jobs.items() for name, run in layout_runs(tmp_path, nproc, named, *SFT).items()
    }
    metrics = {
        name: {m: scalars(tmp_path / name / "tb", m) for m in METRICS}
        for name in ("kd_alpha0", "kd_dcp", "kd_jsd", *LAYOUTS)
    }

    assert_matches(runs["kd_alpha0"], runs["sft"])  # alpha 0: SFT's losses and gradients
    assert metrics["kd_alpha0"]["kd/ce"][1] == pytest.approx(runs["sft"][0][1], rel=1e-5)
    assert all(d > 0.01 for d in metrics["kd_alpha0"]["kd/divergence"].values())  # measured, not trained on

    dcp_divergence = metrics["kd_dcp"]["kd/divergence"]
    hf_divergence = metrics["kd_jsd"]["kd/divergence"]
    assert dcp_divergence[1] < metrics["kd_alpha0"]["kd/divergence"][1]  # the SFT teacher is nearer the student
    assert hf_divergence[STEPS] < hf_divergence[1], hf_divergence  # the student moves towards its teacher

    for layout in LAYOUTS:
        assert_matches(runs[layout], runs["kd_jsd"])
        for metric in METRICS:
            assert sorted(metrics[layout][metric]) == list(range(1, STEPS + 1)), (layout, metric)
            for step, value in metrics[layout][metric].items():
                expected = metrics["kd_jsd"][metric][step]
                assert value == pytest.approx(expected, rel=1e-5, abs=1e-6), (layout, metric, step)
