"""QAT and the chunked cross-entropy under FSDP and TP on gloo, against one process.

Neither changes the math across layouts. The chunked cross-entropy equals the full one (under TP it is
vocabulary-parallel), so losses agree to float32 rounding as in parity.py: 1e-5 relative, grad norms 2e-4.
QAT fake-quantizes each token's activations and each FSDP-gathered weight as one process does, but a one-ulp
difference in a reduction can move a value across an int4/int8 rounding boundary, so its runs agree to 1e-4
(losses; measured 1.7e-5) and 1e-3 (grad norms; measured 6e-5).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.parity import assert_matches, layout_run

QWEN = ("--model.name", "qwen3", "--tokenizer.kind", "byte")  # tied embeddings: the FSDP root holds the projection


QAT = ("--qat.enable", "--optimizer.lr", "0")
PP2 = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B")


@pytest.fixture(scope="module")
def qat_single(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qat")
    return layout_run(folder, "single", 1, "--training.local_batch_size", "4", *QAT), folder / "single"


@pytest.mark.parametrize(
    "name, extra",
    [("fsdp2", ("--training.local_batch_size", "2")), ("pp2", ("--training.local_batch_size", "4", *PP2))],
)
def test_qat_layouts_match_one_process_and_export_the_same_model(tmp_path, qat_single, name, extra):
    """With lr 0 the weights stay the (layout-independent) initial ones, so the exports must be identical:
    FSDP's gather puts every shard back in place and PP's stages are collected before the quantization
    (trained weights would not do here: AdamW turns float32-rounding differences of near-zero gradients
    into lr-sized steps)."""
    (losses, norms) = layout_run(tmp_path, name, 2, *extra, *QAT)
    (ref_losses, ref_norms), ref_folder = qat_single
    assert sorted(losses) == sorted(ref_losses)
    for step in losses:
        assert losses[step] == pytest.approx(ref_losses[step], rel=1e-4), (step, losses, ref_losses)
        assert norms[step] == pytest.approx(ref_norms[step], rel=1e-3), (step, norms, ref_norms)
    one = load_file(str(ref_folder / "quantized/model.safetensors"))
    two = load_file(str(tmp_path / name / "quantized/model.safetensors"))
    assert one.keys() == two.keys() and any(key.endswith("._weight_qdata") for key in one)
    for key, value in one.items():
        assert torch.equal(value, two[key]), key


@pytest.mark.parametrize(
    "name, nproc, extra",
    [
        ("chunked_fsdp2_tp2", 4, ("--training.local_batch_size", "2", "--parallelism.tensor_parallel_degree", "2")),
        ("chunked_tied_fsdp2", 2, ("--training.local_batch_size", "2", *QWEN)),
    ],
)
def test_chunked_cross_entropy_matches_the_full_loss_on_one_process(
    tmp_path, single_process_reference, name, nproc, extra
):
    chunked = layout_run(tmp_path, name, nproc, "--training.loss_chunk_size", "48", *extra)
    if "qwen3" in extra:
        assert_matches(chunked, layout_run(tmp_path, "tied_single", 1, "--training.local_batch_size", "4", *QWEN))
    else:
        assert_matches(chunked, single_process_reference)
