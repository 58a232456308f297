"""SFT with LoRA, DPO and GRPO (titanium's engine) end to end on tiny models of architectures titanium has no native
family for, built by the transformers backend from their Hugging Face folders (``--model.name`` left to auto), and
their exports loaded back by ``transformers``' own classes (and ``peft``) with the trained model's logits.

- Gemma 3, Qwen3.5, GPT-OSS and DeepSeek-V3 (``FOUR``) x SFT + LoRA, DPO and GRPO (``OBJECTIVES``), 2 steps each:
  finite losses, weights that moved, and the export (LoRA merged) loaded with the trained model's logits (fp32 1e-5;
  the PEFT adapter too, where ``peft`` can load it); GRPO's engine decodes what the policy computes
  (``grpo/logprob_mismatch`` <= 1e-5), on the two models that run their own attention with transformers' own cache,
  whose compiled decode step the preflight refuses (docs/models.md has the measured table);
  Gemma 3's SFT packs rows (sliding window 8, shorter than the packed samples);
- DPO on OLMo 2 (shared-prompt rows: parent-document masks): the first step's loss is log 2 (the policy is its
  own reference: the reference forward equals the policy's), and the export loads with the trained logits;
- a Gemma 3 resumed from its DCP checkpoint continues bitwise as the uninterrupted run;
- GRPO on Granite (logit scaling) with titanium's engine (a copy of the backend model decoding with titanium's
  KV cache, synced by the training model's names): the first step's rollouts' log-probs equal the policy's own
  recomputed ones (``grpo/logprob_mismatch`` <= 1e-5; measured 1.0e-7), and the export loads with the trained logits;
- pretraining on Qwen2-MoE, whose MoE blocks run as transformers wrote them, from its per-expert checkpoint: the
  export holds the checkpoint's tensor names and loads with the trained logits.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.helpers import scalars, tiny_args
from tests.objectives.tiny_backend import VOCAB, save_tiny_hf
from titanium.rl.rewards.functions import register_reward

transformers = pytest.importorskip("transformers")

TASKS = Path("assets/tasks/arithmetic")
TOL = dict(atol=1e-5, rtol=1e-5)


def start_from(folder: Path) -> tuple[str, ...]:
    return ("--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf")


def trained_logits_load_back(trainer, folder: Path, hf_cls: type) -> torch.Tensor:
    """The trained model's logits on random tokens equal those of its export in ``folder``, loaded by
    ``hf_cls``; returns the tokens."""
    x = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = trainer.model.eval()(x)
        theirs = hf_cls.from_pretrained(folder, dtype=torch.float32).eval()(input_ids=x).logits
        print(f"{hf_cls.__name__} export vs titanium: max |logit difference| {(theirs - ours).abs().max():.1e}")
        torch.testing.assert_close(theirs, ours, **TOL)
    return x


FOUR = {
    # model_type: (the trained model's class, what the architecture asks of the job)
    "gemma3_text": ("Gemma3ForCausalLM", ()),
    "qwen3_5_text": ("Qwen3_5ForCausalLM", ("--sft.no_packing", "--dpo.no_share_prompt")),
    "gpt_oss": ("GptOssForCausalLM", ("--moe.load_balance", "none")),
    "deepseek_v3": ("DeepseekV3ForCausalLM", ("--moe.load_balance", "bias")),
}
"""The four architectures of the must-show matrix: sliding windows, soft-capping and tied embeddings (Gemma 3);
linear-attention layers, its own attention (Qwen3.5: no packing, no shared prompts); attention sinks and its own MoE
blocks (GPT-OSS: no load balancing); latent attention and titanium's MoE in place of its blocks, read and exported
per expert (DeepSeek-V3)."""
OWN_ATTENTION = {
    "qwen3_5_text": "qwen3_5_text runs its own attention (it has linear_attention layers, which are not attention)",
    "gpt_oss": "gpt_oss runs its own attention (its attention has sinks)",
}
"""The models that run their own attention: titanium's engine decodes them with transformers' own cache
(``own_cache.py``), which a compiled decode step cannot take (refused, with this message)."""
LORA_TARGETS = {"gpt_oss": ("attention",)}
"""LoRA's targets where not the attention and MLP projections: GPT-OSS's MLPs are its own MoE blocks (stacked expert
parameters, no linear layers), which titanium's LoRA does not adapt."""
NO_PEFT_LOAD = {"deepseek_v3"}
"""peft converts a DeepSeek-V3 adapter's target names from the transformers-4 layout when it loads it and ends with
LoRA weights missing (measured: the stacked experts' ``mlp.experts.lora_A/B``, logits off by 2.1), so only the merged
export is checked (docs/models.md)."""
OBJECTIVES = {
    "sft_lora": (
        *("--training.objective", "sft", "--data.kind", "chat", "--data.path", str(TASKS / "train.jsonl")),
        *("--lora.rank", "4", "--optimizer.lr", "1e-2"),
    ),
    "dpo": (
        *("--training.objective", "dpo", "--data.kind", "preference"),
        *("--data.path", str(TASKS / "preference_train.jsonl"), "--optimizer.lr", "1e-3"),
    ),
    "grpo": (
        *("--training.objective", "grpo", "--data.kind", "chat", "--data.path", str(TASKS / "train.jsonl")),
        *("--training.local_batch_size", "8", "--grpo.group_size", "4", "--rl.max_new_tokens", "8"),
        *("--rl.max_prompt_len", "48", "--rl.rewards", "characters", "--grpo.old_logprobs", "recompute"),
        *("--rollout.engine", "titanium", "--optimizer.lr", "1e-3"),
    ),
}


@register_reward("characters")
def characters(completion: str, answer: str | None, row: object) -> float:
    """The response's length in characters: a reward that differs within a group of a random model's responses
    (exact_match gives them all 0, hence no advantage and no update)."""
    return float(len(completion))


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("model_type", FOUR)
def test_each_objective_on_four_architectures(
    make_trainer, tmp_path: Path, capsys, monkeypatch, model_type: str, objective: str
) -> None:
    """2 steps of ``objective`` from the tiny random ``model_type``'s Hugging Face folder: finite losses, weights
    that moved, and the export (LoRA merged) loaded by ``transformers``' own class with the trained model's logits
    (fp32, 1e-5); where titanium refuses the combination, its one message."""
    hf = save_tiny_hf(tmp_path / model_type, model_type)
    hf_cls, asks = FOUR[model_type]
    assert type(hf).__name__ == hf_cls
    run = tmp_path / objective
    args = tiny_args(
        run, "--training.steps", "2", *OBJECTIVES[objective], *asks, "--chat.chat_template", "llama3",
        *start_from(tmp_path / model_type), "--checkpoint.last_save_in_hf",
    )  # fmt: skip
    if objective == "sft_lora":
        args += ["--lora.target_modules", *LORA_TARGETS.get(model_type, ("attention", "mlp"))]
    if objective == "grpo" and model_type in OWN_ATTENTION:  # (its engine decodes with transformers' cache)
        from titanium.preflight import main as preflight

        monkeypatch.setenv("WORLD_SIZE", "1")
        assert preflight([*args, "--rollout.compile"]) == 2
        err = capsys.readouterr().err
        assert f"--rollout.compile: {OWN_ATTENTION[model_type]}" in err and "Traceback" not in err, err
    trainer = make_trainer(*args)
    assert trainer.model_spec.name == "transformers"
    trainer.train()
    losses = scalars(run / "tb")
    assert sorted(losses) == [1, 2] and all(math.isfinite(v) for v in losses.values()), losses
    if objective == "dpo":  # (the policy is its own reference at step 1)
        assert losses[1] == pytest.approx(math.log(2), abs=1e-5), losses
    if objective == "grpo":
        mismatch = scalars(run / "tb", "grpo/logprob_mismatch")
        assert mismatch[1] <= 1e-5, mismatch  # the engine's copy decodes what the policy computes
        print(f"{model_type} grpo: engine log-prob mismatch {mismatch[1]:.1e}")
    x = trained_logits_load_back(trainer, run / "hf", type(hf))
    with torch.no_grad():
        moved = (trainer.model(x) - hf(input_ids=x).logits).abs().max().item()
    assert moved > 1e-4, moved  # it trained
    if objective == "sft_lora" and model_type not in NO_PEFT_LOAD:
        from peft import PeftModel

        base = type(hf).from_pretrained(tmp_path / model_type, dtype=torch.float32)
        adapted = PeftModel.from_pretrained(base, run / "adapter").eval()
        with torch.no_grad():
            torch.testing.assert_close(adapted(input_ids=x).logits, trainer.model(x), **TOL)
    print(f"{model_type} {objective}: losses {losses}, logits moved {moved:.2e}")


def test_dpo_on_olmo2(make_trainer, tmp_path: Path) -> None:
    hf = save_tiny_hf(tmp_path / "olmo2", "olmo2")
    run = tmp_path / "dpo"
    trainer = make_trainer(
        *tiny_args(run, "--training.steps", "3", "--optimizer.lr", "1e-3"),
        *("--training.objective", "dpo", "--data.kind", "preference"),
        *("--data.path", str(TASKS / "preference_train.jsonl"), "--chat.chat_template", "llama3"),
        *start_from(tmp_path / "olmo2"),
        "--checkpoint.last_save_in_hf",
    )  # fmt: skip
    trainer.train()
    losses = scalars(run / "tb")
    assert losses[1] == pytest.approx(torch.log(torch.tensor(2.0)).item(), abs=1e-5), losses
    x = trained_logits_load_back(trainer, run / "hf", type(hf))
    with torch.no_grad():
        assert (trainer.model(x) - hf(input_ids=x).logits).abs().max() > 1e-3  # it trained


def test_grpo_with_the_titanium_engine_on_granite(make_trainer, tmp_path: Path) -> None:
    hf = save_tiny_hf(tmp_path / "granite", "granite")
    run = tmp_path / "grpo"
    trainer = make_trainer(
        *tiny_args(run, "--training.steps", "2", "--optimizer.lr", "1e-3", "--training.local_batch_size", "8"),
        *("--training.objective", "grpo", "--data.kind", "chat", "--data.path", str(TASKS / "train.jsonl")),
        *("--chat.chat_template", "llama3", "--grpo.group_size", "4", "--rl.max_new_tokens", "8"),
        *("--rl.max_prompt_len", "48", "--rl.rewards", "exact_match", "--rl.answer_column", "answer"),
        *("--grpo.old_logprobs", "recompute"),  # (a forward of the policy over the rollouts: the mismatch metric)
        *start_from(tmp_path / "granite"),
        "--checkpoint.last_save_in_hf",
    )  # fmt: skip
    trainer.train()
    mismatch = scalars(run / "tb", "grpo/logprob_mismatch")
    assert mismatch[1] <= 1e-5, mismatch  # the engine's copy decodes what the policy computes
    assert scalars(run / "tb", "grpo/response_len")[1] > 0
    assert sorted(scalars(run / "tb")) == [1, 2]
    trained_logits_load_back(trainer, run / "hf", type(hf))


def test_dcp_resume_is_exact(make_trainer, tmp_path: Path) -> None:
    """Gemma 3 pretraining, 6 steps with a checkpoint at 3: the resumed run logs the uninterrupted run's losses and
    ends with its weights, bitwise."""
    from tests.helpers import train_until_first_save
    from titanium.parallel.distributed import shutdown_distributed

    save_tiny_hf(tmp_path / "gemma3", "gemma3_text")
    common = (
        *("--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "3", "--debug.deterministic"),
        *start_from(tmp_path / "gemma3"),
    )
    straight = make_trainer(*tiny_args(tmp_path / "straight", *common))
    straight.train()
    straight.close()
    expected, weights = scalars(tmp_path / "straight/tb"), straight.model.state_dict()
    shutdown_distributed()
    train_until_first_save(make_trainer, *tiny_args(tmp_path / "resumed", *common))
    resumed = make_trainer(*tiny_args(tmp_path / "resumed", *common))
    assert resumed.train_state.step == 3
    resumed.train()
    resumed.close()
    got = scalars(tmp_path / "resumed/tb")
    assert [got[s] for s in (4, 5, 6)] == [expected[s] for s in (4, 5, 6)]
    for key, value in resumed.model.state_dict().items():
        assert torch.equal(value, weights[key]), key


def test_own_moe_blocks_train_from_and_export_to_their_per_expert_checkpoint(make_trainer, tmp_path: Path) -> None:
    """Qwen2-MoE, whose MoE blocks run as transformers wrote them (stacked ``gate_up_proj`` / ``down_proj``, shared
    experts): 2 pretraining steps from its Hugging Face folder, which keeps one tensor per expert and projection; the
    export holds exactly the folder's tensor names and loads in ``Qwen2MoeForCausalLM`` with the trained logits."""
    from transformers import AutoModelForCausalLM

    from tests.backend_matrix.configs import tiny_config
    from tests.parity.harness import randomize_
    from titanium.checkpoint.hf import HFCheckpoint

    source = tmp_path / "qwen2_moe"
    hf = AutoModelForCausalLM.from_config(tiny_config("qwen2_moe"), dtype=torch.float32)
    randomize_(hf, 0)
    hf.eval().save_pretrained(source)
    (source / "tokenizer_config.json").write_text('{"eos_token": "<|end_of_text|>"}')
    run = tmp_path / "pretrain"
    trainer = make_trainer(
        *tiny_args(run, "--training.steps", "2", "--data.kind", "synthetic", "--optimizer.lr", "1e-3"),
        *("--moe.load_balance", "none", *start_from(source), "--checkpoint.last_save_in_hf"),
    )
    assert trainer.model.own_moe_blocks
    trainer.train()
    assert sorted(scalars(run / "tb")) == [1, 2]
    x = trained_logits_load_back(trainer, run / "hf", type(hf))
    with torch.no_grad():
        assert (trainer.model(x) - hf(input_ids=x).logits).abs().max() > 1e-4  # it trained

    def names(folder: Path) -> set[str]:
        return set(HFCheckpoint.open(folder).shapes)

    assert "model.layers.1.mlp.experts.7.up_proj.weight" in names(source)
    assert names(run / "hf") == names(source)
