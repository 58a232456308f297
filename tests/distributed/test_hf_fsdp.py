"""A Hugging Face checkpoint goes through FSDP unchanged: load into 2 shards, export, same bytes.

With lr 0 the weights never move, so the export of a 2-process FSDP run (sharded load through
rank 0's broadcast, full-state gather on save) must equal the source files bit for bit, in the
source's shard layout and index. The export carries the tokenizer the run trained with (here the debug
tiktoken ranks, converted), not the source folder's tokenizer_config.json.
"""

from __future__ import annotations

import pytest

from tests.e2e.test_hf_train import make_hf_debug_checkpoint
from tests.helpers import run_train, tiny_args

pytest.importorskip("transformers")


def test_fsdp_load_and_export_is_bitwise(tmp_path) -> None:
    source = tmp_path / "source"
    make_hf_debug_checkpoint(source, "llama3")
    out = tmp_path / "run"
    args = tiny_args(
        out, "--data.kind", "synthetic", "--training.steps", "1", "--training.local_batch_size", "2",
        "--optimizer.lr", "0", "--checkpoint.initial_load_path", str(source), "--checkpoint.initial_load_in_hf",
        "--checkpoint.last_save_in_hf",
    )  # fmt: skip
    run_train(args, nproc=2)
    files = sorted(p.name for p in source.glob("*.safetensors"))
    assert len(files) >= 2 and sorted(p.name for p in (out / "hf").glob("*.safetensors")) == files
    for name in [*files, "model.safetensors.index.json", "generation_config.json"]:
        assert (out / "hf" / name).read_bytes() == (source / name).read_bytes(), name
    assert (out / "hf" / "tokenizer.json").is_file()  # (the run's tokenizer, which the source folder lacks)
