"""``benchmarks/peers.py`` (part "peers" of the GPU suite) checked on a CPU, so that its GPU run cannot fail for an
argument, an import path, a missing file or the results table: each peer's command runs at the debug size where the
peer runs on a CPU (torchtune, TRL), torchtitan's (which trains on CUDA only) is parsed by torchtitan and builds the
model titanium trains, and the runs are shown to do the same work (equal losses).

The tests marked ``peers`` need the peers, which CI does not install; a virtualenv over the main one holds them:

    /work/main/.venv/bin/python -m venv .venvs/peers    # then a .pth naming the main venv's site-packages in it
    bash scripts/gpu_wheels.sh && .venvs/peers/bin/pip install --no-deps .gpu_wheels/{torchtitan,torchdata,\\
        torchtune,omegaconf,blobfile,pycryptodomex,kagglehub,kagglesdk}-*.whl && .venvs/peers/bin/pip install \\
        sentencepiece triton   # (the GPU image has both; torchtitan imports triton)
    PYTHONPATH=$PWD .venvs/peers/bin/python -m pytest tests/peers -m peers
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, env, load_script

sys.path.insert(0, str(REPO / "benchmarks"))  # (peers.py and its launchers import their neighbours by name)


def smoke(tmp_path: Path, *works: str) -> dict:
    """``peers.py --device cpu --smoke --work <works>``: its results (the JSON beside the table it wrote)."""
    out = tmp_path / "peers_cpu.md"
    cmd = [sys.executable, "benchmarks/peers.py", "--device", "cpu", "--smoke", "--work", *works, "--out", str(out)]
    result = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = out.read_text()
    for work in works:
        assert load_script("benchmarks/peers.py").TITLES[work] in text
    return json.loads(out.with_suffix(".json").read_text())


@pytest.mark.peers
def test_torchtune_recipe_on_titanium_rows_gives_titanium_losses(tmp_path):
    """torchtune's full fine-tune recipe, fed the rows titanium's packer made and the same weights, loses what
    titanium loses at every step (float32 on a CPU); both give a throughput."""
    (row,) = smoke(tmp_path, "sft")["sft"]["rows"].values()
    titanium, torchtune = row["titanium"], row["torchtune"]
    assert isinstance(titanium, dict) and isinstance(torchtune, dict), row
    assert len(titanium["losses"]) == 3
    assert torchtune["losses"] == pytest.approx(titanium["losses"], abs=1e-4)
    assert titanium["label_tps"] > 0 and torchtune["label_tps"] > 0


@pytest.mark.peers
def test_trl_dpo_and_grpo_run_the_same_work(tmp_path):
    """TRL's DPOTrainer on titanium's pairs and weights: ln 2 at step 1 as titanium (policy = reference), and close
    after (3e-4 apart at steps 2-3 on a CPU, where 1 step moves the loss by 6e-4: not yet equal, see
    docs/performance.md). GRPOTrainer: both sides generate the same number of tokens a step and give every number."""
    results = smoke(tmp_path, "dpo", "grpo")
    (dpo,) = results["dpo"]["rows"].values()
    assert dpo["TRL"]["losses"][0] == dpo["titanium"]["losses"][0] == pytest.approx(0.693147, abs=1e-5)
    assert dpo["TRL"]["losses"] == pytest.approx(dpo["titanium"]["losses"], abs=1e-3)
    (grpo,) = results["grpo"]["rows"].values()
    for side in grpo.values():
        assert isinstance(side, dict) and side["step_s"] > 0 and side["length"] == 8, grpo


@pytest.mark.peers
def test_torchtitan_parses_each_variant_and_builds_the_same_model():
    """Each pretraining variant's torchtitan flags parse (torchtitan's own config manager) to what titanium's run
    does, and its ``8B-6L`` flavor has exactly the parameters of titanium's 8B cut to 6 blocks."""
    peers = load_script("benchmarks/peers.py")
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    from titanium.models import build_model_args, get_model_spec

    for variant, parts in peers.VARIANTS.items():
        argv = peers.torchtitan_argv("8B-6L", parts, peers.shared_pretrain_flags(8192, 2, 6), Path("/tmp/unused"))
        cfg = ConfigManager().parse_args(argv)
        assert (cfg.training.seq_len, cfg.training.local_batch_size, cfg.optimizer.lr) == (8192, 2, 3e-4)
        assert cfg.compile.enable == ("compile" in parts), variant
        float8 = "float8" in parts
        assert (cfg.model.converters == ["quantize.linear.float8"]) == float8, variant
        assert cfg.quantize.linear.float8.filter_fqns == (["output"] if float8 else []), variant
        assert cfg.activation_checkpoint.mode == "selective" and cfg.activation_checkpoint.selective_ac_option == "op"
    __import__(cfg.experimental.custom_import)
    spec = get_train_spec(cfg.model.name)
    titanium_spec = get_model_spec("llama3")
    cut = dataclasses.replace(build_model_args(titanium_spec, "8B", vocab_size=128256), n_layers=6)
    with torch.device("meta"):
        theirs = spec.model_cls(spec.model_args["8B-6L"])
        ours = titanium_spec.model_cls(cut)
    count = lambda model: sum(p.numel() for p in model.parameters())  # noqa: E731
    assert count(theirs) == count(ours) == 2_359_349_248


def test_torchtune_names_and_rows():
    """Every weight of a Hugging Face Qwen3 (tied and untied) has a torchtune name, no two the same; a packed row
    becomes torchtune's sample: labels unshifted by one, documents' lengths from the document ids."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tune = load_script("benchmarks/peer_torchtune.py")
    for tied in (True, False):
        config = Qwen3Config(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, tie_word_embeddings=tied,
        )  # fmt: skip
        keys = [k for k in Qwen3ForCausalLM(config).state_dict() if not (tied and k == "lm_head.weight")]
        names = [tune.tune_key(k) for k in keys]
        assert len(set(names)) == len(keys) == 3 + 11 * 2 - tied
    row = {
        "input": torch.tensor([5, 6, 7, 8, 9, 0]),
        "label": torch.tensor([-100, 7, 8, -100, -100, -100]),
        "positions": torch.tensor([0, 1, 2, 0, 1, 0]),
        "document_ids": torch.tensor([0, 0, 0, 1, 1, 2]),
    }
    sample = tune.tune_row(row)
    assert sample["labels"].tolist() == [-100, -100, 7, 8, -100, -100]
    assert sample["seq_lens"].tolist() == [3, 2, 1] and sample["input_pos"].tolist() == [0, 1, 2, 0, 1, 0]
