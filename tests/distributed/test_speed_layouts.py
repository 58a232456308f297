"""QAT and the chunked cross-entropy under FSDP and TP on gloo, against one process.

Neither changes the math across layouts. The chunked cross-entropy equals the full one (under TP it is
vocabulary-parallel), so losses agree to float32 rounding as in parity.py: 1e-5 relative, grad norms 2e-4.
QAT fake-quantizes each token's activations and each FSDP-gathered weight as one process does, but a one-ulp
difference in a reduction can move a value across an int4/int8 rounding boundary, so its runs agree to 1e-4
(losses; measured 1.7e-5) and 1e-3 (grad norms; measured 6e-5).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.parity import Run, assert_matches, layout_runs

QWEN = ("--model.name", "qwen3", "--tokenizer.kind", "byte")  # tied embeddings: the FSDP root holds the projection


QAT = ("--qat.enable", "--optimizer.lr", "0")
PP2 = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B")


QAT_LAYOUTS = {"fsdp2": ("--training.local_batch_size", "2"), "pp2": ("--training.local_batch_size", "4", *PP2)}
"""name: flags of each QAT layout (2 processes)."""
CHUNKED = {  # name: (processes, flags) of each layout with the chunked cross-entropy
    "chunked_fsdp2_tp2": (4, ("--training.local_batch_size", "2", "--parallelism.tensor_parallel_degree", "2")),
    "chunked_tied_fsdp2": (2, ("--training.local_batch_size", "2", *QWEN)),
}
SINGLE = ("--training.local_batch_size", "4")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, Run]]:
    """The folder and (losses, grad norms) of every layout here and of the one-process references of QAT and of the
    tied model: one launch per process count (one torchrun start for the lot)."""
    folder = tmp_path_factory.mktemp("speed")
    chunked = {name: (nproc, ("--training.loss_chunk_size", "48", *extra)) for name, (nproc, extra) in CHUNKED.items()}
    jobs = {
        "qat_single": (1, (*SINGLE, *QAT)),
        "tied_single": (1, (*SINGLE, *QWEN)),
        **{f"qat_{name}": (2, (*extra, *QAT)) for name, extra in QAT_LAYOUTS.items()},
        **chunked,
    }
    runs = {}
    for nproc in sorted({nproc for nproc, _ in jobs.values()}):
        runs |= layout_runs(folder, nproc, {name: extra for name, (n, extra) in jobs.items() if n == nproc})
    return folder, runs


@pytest.mark.parametrize("name", list(QAT_LAYOUTS))
def test_qat_layouts_match_one_process_and_export_the_same_model(runs, name):
    """With lr 0 the weights stay the (layout-independent) initial ones, so the exports must be identical:
    FSDP's gather puts every shard back in place and PP's stages are collected before the quantization
    (trained weights would not do here: AdamW turns float32-rounding differences of near-zero gradients
    into lr-sized steps)."""
    folder, runs = runs
    (losses, norms), (ref_losses, ref_norms) = runs[f"qat_{name}"], runs["qat_single"]
    assert sorted(losses) == sorted(ref_losses)
    for step in losses:
        assert losses[step] == pytest.approx(ref_losses[step], rel=1e-4), (step, losses, ref_losses)
        assert norms[step] == pytest.approx(ref_norms[step], rel=1e-3), (step, norms, ref_norms)
    one = load_file(str(folder / "qat_single/quantized/model.safetensors"))
    two = load_file(str(folder / f"qat_{name}/quantized/model.safetensors"))
    assert one.keys() == two.keys() and any(key.endswith("._weight_qdata") for key in one)
    for key, value in one.items():
        assert torch.equal(value, two[key]), key


@pytest.mark.parametrize("name", list(CHUNKED))
def test_chunked_cross_entropy_matches_the_full_loss_on_one_process(runs, single_process_reference, name):
    _, runs = runs
    assert_matches(runs[name], runs["tied_single"] if "qwen3" in CHUNKED[name][1] else single_process_reference)
