"""A LoRA run's DCP checkpoints through ``python -m titanium.tools.convert``: ``to-peft`` gives the adapter that the run
itself writes (mid-run with ``--checkpoint.export_at_saves``, and at its end), which ``peft`` loads onto the
``transformers`` base to compute the titanium model's logits (max abs diff <= 1e-5); ``to-hf`` gives the run's merged
Hugging Face export, tensor for tensor."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import REPO, tiny_args
from titanium.checkpoint.hf import save_hf_weights
from titanium.data.tokenizer import DEFAULT_TOKENIZER_PATH, TiktokenTokenizer
from titanium.models.llama3 import LLAMA3_FLAVORS, Transformer
from titanium.models.llama3.hf import LLAMA3_HF_ADAPTER
from titanium.parallel.distributed import shutdown_distributed
from titanium.peft.export import WEIGHTS_FILE
from titanium.tools.convert import main

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ATOL = 1e-5
LORA_SFT = (
    "--training.objective", "sft",
    "--data.kind", "chat",
    "--data.path", "assets/tasks/arithmetic/train.jsonl",
    "--chat.chat_template", "llama3",
    "--optimizer.lr", "3e-3",
    "--lora.rank", "4",
    "--lora.alpha", "8",
    "--lora.target_modules", "attention", "w2",
    "--training.steps", "4",
    "--checkpoint.enable",
    "--checkpoint.interval", "2",
    "--checkpoint.export_at_saves",
    "--checkpoint.last_save_in_hf",
    "--checkpoint.initial_load_in_hf",
)  # fmt: skip


def _hf_base(folder: Path) -> Path:
    """A small random Llama in Hugging Face format with the debug tokenizer's vocabulary."""
    vocab = TiktokenTokenizer(str(REPO / DEFAULT_TOKENIZER_PATH)).vocab_size
    args = dataclasses.replace(
        LLAMA3_FLAVORS["debugmodel"], n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=vocab, max_seq_len=64
    )
    model = Transformer(args)
    torch.manual_seed(0)
    model.init_weights()
    return save_hf_weights(model.state_dict(), folder, LLAMA3_HF_ADAPTER, args)


def _same_files(a: Path, b: Path) -> None:
    """The same tensors (bitwise) in each folder's safetensors files, and the same adapter config."""
    for name in sorted(p.name for p in a.glob("*.safetensors")):
        ours, theirs = load_file(str(a / name)), load_file(str(b / name))
        assert ours.keys() == theirs.keys(), name
        for key in ours:
            assert torch.equal(ours[key], theirs[key]), f"{name}: {key}"
    assert (a / "adapter_config.json").is_file() == (b / "adapter_config.json").is_file()
    if (a / "adapter_config.json").is_file():
        assert json.loads((a / "adapter_config.json").read_text()) == json.loads(
            (b / "adapter_config.json").read_text()
        )


def test_lora_checkpoints_convert_to_the_runs_own_exports(make_trainer, tmp_path: Path, capsys) -> None:
    base = _hf_base(tmp_path / "base")
    run = tmp_path / "run"
    trainer = make_trainer(*tiny_args(run, *LORA_SFT, "--checkpoint.initial_load_path", str(base)))
    trainer.train()
    # Mid-run exports at the step-2 save; the last save (step 4) exports only as the end of training does.
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(("adapter", "hf"))) == [
        "adapter",
        "adapter-step-2",
        "hf",
        "hf-step-2",
    ]

    mid, last = load_file(str(run / "adapter-step-2" / WEIGHTS_FILE)), load_file(str(run / "adapter" / WEIGHTS_FILE))
    assert all(not torch.equal(mid[key], last[key]) for key in mid if ".lora_B." in key)  # (the run moved on)
    for step, adapter, merged in ((2, "adapter-step-2", "hf-step-2"), (4, "adapter", "hf")):
        checkpoint = run / f"checkpoint/step-{step}"
        assert main(["to-peft", str(checkpoint), str(tmp_path / f"peft-{step}")]) == 0
        _same_files(tmp_path / f"peft-{step}", run / adapter)
        to_hf = ["to-hf", str(checkpoint), str(tmp_path / f"hf-{step}"), "--model", "llama3", "--dtype", "float32"]
        assert main(to_hf) == 0
        _same_files(tmp_path / f"hf-{step}", run / merged)
    assert capsys.readouterr().out.count("wrote ") == 4

    # peft on the transformers base computes what titanium's model computes after the run.
    tokens = torch.randint(0, trainer.model_args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = trainer.model.eval()(tokens)
        hf_base = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager").eval()
        plain = hf_base(input_ids=tokens).logits
        assert (plain - ours).abs().max() > 1e-3  # the adapters matter
        with_adapter = peft.PeftModel.from_pretrained(hf_base, tmp_path / "peft-4").eval()
        assert (with_adapter(input_ids=tokens).logits - ours).abs().max() <= ATOL
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf-4", attn_implementation="eager")
        assert (merged.eval()(input_ids=tokens).logits - ours).abs().max() <= ATOL
    config = json.loads((tmp_path / "peft-4/adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base) and config["r"] == 4 and config["lora_alpha"] == 8


def test_lora_run_from_a_titanium_checkpoint_converts(make_trainer, tmp_path: Path) -> None:
    """A LoRA run whose base is a titanium checkpoint (another seed than the run's, so a base rebuilt from the
    seed instead would differ): to-peft and to-hf give its end-of-run adapter and merged export."""
    seed_run = ("--checkpoint.enable", "--checkpoint.create_seed_checkpoint", "--debug.seed", "5")
    seed = make_trainer(*tiny_args(tmp_path / "seed", *seed_run))
    seed.train()
    seed.close()
    shutdown_distributed()
    base = tmp_path / "seed/checkpoint/step-0"
    run = tmp_path / "run"
    lora = [arg for arg in LORA_SFT if arg not in ("--checkpoint.export_at_saves", "--checkpoint.initial_load_in_hf")]
    make_trainer(*tiny_args(run, *lora, "--training.steps", "2", "--checkpoint.initial_load_path", str(base))).train()
    assert main(["to-peft", str(run / "checkpoint/step-2"), str(tmp_path / "peft")]) == 0
    _same_files(tmp_path / "peft", run / "adapter")
    argv = ["to-hf", str(run / "checkpoint/step-2"), str(tmp_path / "hf"), "--model", "llama3", "--dtype", "float32"]
    assert main(argv) == 0
    _same_files(tmp_path / "hf", run / "hf")


def test_lora_checkpoint_errors_are_one_line(tmp_path: Path, capsys) -> None:
    """Without the run's config.toml, with --flavor, or to-peft on a full checkpoint: one message, exit code 2."""
    import torch.distributed.checkpoint as dcp

    step = tmp_path / "run/checkpoint/step-5"
    adapters = {f"layers.0.attention.wq.lora_{side}.weight": torch.zeros(2, 2) for side in "ab"}
    dcp.save({"model": adapters}, checkpoint_id=str(step), no_dist=True)
    full = tmp_path / "full/step-1"
    dcp.save({"model": {"tok_embeddings.weight": torch.zeros(2, 2)}}, checkpoint_id=str(full), no_dist=True)
    cases = [
        (["to-peft", str(step), str(tmp_path / "a")], f"which is not at {tmp_path}/run/config.toml"),
        (["to-hf", str(step), str(tmp_path / "b"), "--model", "llama3"], "pass --config"),
        (["to-hf", str(step), str(tmp_path / "c"), "--model", "llama3", "--flavor", "debugmodel"], "drop --flavor"),
        (["to-peft", str(full), str(tmp_path / "d")], "holds no LoRA adapters (not a LoRA run's"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_dora_checkpoint_with_a_config_without_use_dora_is_refused(tmp_path: Path, capsys) -> None:
    """A DoRA run's adapters read with a run config that lacks use_dora: the magnitudes have no place in the model
    so built, and were dropped silently (a wrong export, exit 0); now one message naming them and the fix."""
    import tomli_w
    import torch.distributed.checkpoint as dcp

    from titanium.config import load_config, to_toml_dict
    from titanium.model_setup import job_converters
    from titanium.models import build_model_args, get_model_spec
    from titanium.models.converter import apply_converters
    from titanium.parallel.dims import ParallelDims
    from titanium.peft.lora import is_lora_param

    lora = ["--lora.rank", "4", "--lora.target_modules", "wq", "wv"]
    dora = load_config([*lora, "--lora.use_dora"])
    spec = get_model_spec("llama3")
    with torch.device("meta"):
        model = spec.model_cls(build_model_args(spec, "debugmodel"))
    apply_converters(job_converters(dora, ParallelDims(dp_replicate=1, dp_shard=1, world_size=1), None), model)
    adapters = {k: torch.zeros(v.shape) for k, v in model.state_dict().items() if is_lora_param(k)}
    assert any(k.endswith("lora_magnitude") for k in adapters)
    step = tmp_path / "run/checkpoint/step-2"
    dcp.save({"model": adapters}, checkpoint_id=str(step), no_dist=True)
    plain = load_config(tiny_args(tmp_path / "run", *lora))  # (the run's config, with use_dora lost)
    (tmp_path / "run/config.toml").write_text(tomli_w.dumps(to_toml_dict(plain)))
    assert main(["to-peft", str(step), str(tmp_path / "adapter")]) == 2
    err = capsys.readouterr().err
    assert "tensors the model has no place for: layers.0.attention.wq.lora_magnitude" in err, err
    assert "[lora] rank, target_modules and use_dora give the adapters" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "adapter").exists()
