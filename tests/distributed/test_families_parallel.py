"""Every family on the shared decoder trains under FSDP + TP (dp_shard 2 x tp 2, gloo) like one process; Gemma 2
also under CP + TP (cp 2 x tp 2) and PP + TP (pp 2 x tp 2).

Each family's debug shape, saved by ``transformers`` with random weights and a sliding window shorter than the
rows (Mistral, Phi-3, Gemma 2), trains 3 steps on synthetic data from that folder, once in one process and
once on 4 ranks, and exports back to HF: the losses agree to 1e-5 relative, the grad norms to 2e-4 (the layout
tests' tolerances, tests/distributed/parity.py), and every exported weight to 1e-6 (measured: 1.2e-7; every
tensor moved by 1.9e-5 or more). This checks each family's TP plan: Qwen2's biases sharded with their
projections, Phi-3's fused tensors split from and fused back into a sharded model, Gemma 2's post-norms
(sequence parallel), its soft-capped logits under loss parallelism and, with ``loss_chunk_size``, in the
chunked vocabulary-parallel loss, its soft-capped, windowed attention over the keys context parallelism gathers, and
pipeline stages holding only windowed or only global layers (the first scales the embeddings, the last caps the
logits).

All jobs of a layout run in one launch (tests/distributed/jobs_worker.py): one torchrun start for the lot.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import run_jobs, scalars, tiny_args
from tests.parity.harness import randomize_
from titanium.checkpoint.hf import HFCheckpoint
from titanium.models import get_model_spec

transformers = pytest.importorskip("transformers")

STEPS = 3
HF_CLASSES = {
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
}
OPTIMIZER = ["--optimizer.eps", "0.1"]
"""Adam with a large epsilon: an update is proportional to its gradient wherever the gradient is small, so
rounding-level gradient differences (on entries whose gradient is zero in exact arithmetic, such as the key
bias, which shifts every score of a query alike) stay rounding-level, instead of becoming lr-sized steps of
either sign as they do with eps 1e-8."""
FSDP_TP = ("--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "2")
"""dp_shard 2 x tp 2: the same global batch as one process (2 data-parallel ranks of 2 rows against 4 rows)."""
CP_TP = ("--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2")
"""cp 2 x tp 2: each sequence split over 2 ranks, the same 4 rows."""
PP_TP = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2")
"""pp 2 x tp 2: one block per stage (Gemma 2's windowed layer 0, its global layer 1), the same 4 rows."""
CHUNKED = ("--training.loss_chunk_size", "48")
GEMMA2 = {"layer_types": ["sliding_attention", "full_attention"], "attn_logit_softcapping": 5.0}
SOURCES = {  # name: (family, config.json changes to the debugmodel shape with 2 layers)
    "qwen2": ("qwen2", {}),  # (its window stays off, as in its checkpoints)
    "mistral": ("mistral", {"sliding_window": 16}),
    "phi3": ("phi3", {"sliding_window": 16}),
    "gemma2": ("gemma2", {**GEMMA2, "sliding_window": 16}),
    # Pipeline stages cannot share a tied embedding (refused for every family), so this Gemma 2 is untied.
    "gemma2-untied": ("gemma2", {**GEMMA2, "sliding_window": 16, "tie_word_embeddings": False}),
}
JOBS = {  # name: (source, arguments in one process, arguments on 4 ranks)
    **{family: (family, (), FSDP_TP) for family in ("qwen2", "mistral", "phi3", "gemma2")},
    "gemma2-chunked": ("gemma2", CHUNKED, CHUNKED + FSDP_TP),
    "gemma2-cp": ("gemma2", (), CP_TP),  # (the window of 16 masks within each rank's gathered keys)
    "gemma2-pp": ("gemma2-untied", (), PP_TP),
}


def make_source(folder: Path, source: str) -> None:
    """A source of SOURCES as transformers saves it, every weight random."""
    family, changes = SOURCES[source]
    spec = get_model_spec(family)
    config = spec.hf_adapter.to_hf_config(spec.flavors["debugmodel"])
    config.update(num_hidden_layers=2, max_position_embeddings=4096, **changes)
    hf_cls = getattr(transformers, HF_CLASSES[family])
    model = hf_cls(hf_cls.config_class(**config))
    randomize_(model, seed=0)
    model.save_pretrained(folder, max_shard_size="2MB")


def run_layout(tmp_path: Path, layout: str, nproc: int, sources: dict[str, Path]) -> None:
    """Every job of JOBS in one launch of ``nproc`` processes (1 or 4), into ``tmp_path / layout / <job>``."""
    common = ["--data.kind", "synthetic", "--training.steps", str(STEPS), "--checkpoint.last_save_in_hf"]
    common += OPTIMIZER
    jobs = [
        tiny_args(
            tmp_path / layout / name,
            *common,
            *("--model.name", SOURCES[source][0]),
            *("--checkpoint.initial_load_path", str(sources[source]), "--checkpoint.initial_load_in_hf"),
            *(single if nproc == 1 else parallel),
        )
        for name, (source, single, parallel) in JOBS.items()
    ]
    run_jobs(jobs, nproc, tmp_path / f"{layout}.json")


def test_parallel_layouts_match_one_process_for_every_family(tmp_path: Path) -> None:
    sources = {source: tmp_path / f"source-{source}" for source, _, _ in JOBS.values()}
    for source, folder in sources.items():
        make_source(folder, source)
    run_layout(tmp_path, "single", 1, sources)
    run_layout(tmp_path, "parallel", 4, sources)
    for name in JOBS:
        ref, run = tmp_path / "single" / name, tmp_path / "parallel" / name
        losses, ref_losses = scalars(run / "tb"), scalars(ref / "tb")
        norms, ref_norms = scalars(run / "tb", "optim/grad_norm"), scalars(ref / "tb", "optim/grad_norm")
        assert sorted(losses) == list(range(1, STEPS + 1)), name
        for step in losses:
            assert losses[step] == pytest.approx(ref_losses[step], rel=1e-5), (name, step, losses, ref_losses)
            assert norms[step] == pytest.approx(ref_norms[step], rel=2e-4), (name, step, norms, ref_norms)
        weights, ref_weights = HFCheckpoint.open(run / "hf").read(), HFCheckpoint.open(ref / "hf").read()
        start = HFCheckpoint.open(sources[JOBS[name][0]]).read()
        assert set(weights) == set(ref_weights) == set(start), name
        for key, value in ref_weights.items():
            torch.testing.assert_close(weights[key], value, atol=1e-6, rtol=0, msg=f"{name}: {key}")
            assert (value - start[key]).abs().max() > 1e-5, f"{name}: {key} did not move 10x the tolerance"
    # The chunked loss is the same loss: the same numbers as the full logits, in either layout.
    for layout in ("single", "parallel"):
        full, chunked = (scalars(tmp_path / layout / name / "tb") for name in ("gemma2", "gemma2-chunked"))
        assert full == pytest.approx(chunked, rel=1e-5), layout
