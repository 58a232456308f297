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


def test_qat_under_fsdp_matches_one_process_and_exports_the_same_model(tmp_path):
    """With lr 0 the weights stay the (layout-independent) initial ones, so both exports must be identical:
    FSDP's gather puts every shard back in place before the quantization (trained weights would not do here:
    AdamW turns float32-rounding differences of near-zero gradients into lr-sized steps)."""
    flags = ("--qat.enable", "--optimizer.lr", "0")
    (losses, norms) = layout_run(tmp_path, "qat_fsdp2", 2, "--training.local_batch_size", "2", *flags)
    (ref_losses, ref_norms) = layout_run(tmp_path, "qat_single", 1, "--training.local_batch_size", "4", *flags)
    assert sorted(losses) == sorted(ref_losses)
    for step in losses:
        assert losses[step] == pytest.approx(ref_losses[step], rel=1e-4), (step, losses, ref_losses)
        assert norms[step] == pytest.approx(ref_norms[step], rel=1e-3), (step, norms, ref_norms)
    one = load_file(str(tmp_path / "qat_single/quantized/model.safetensors"))
    two = load_file(str(tmp_path / "qat_fsdp2/quantized/model.safetensors"))
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
