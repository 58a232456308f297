"""SFT with LoRA, DPO and GRPO (titanium's engine) end to end on tiny models of architectures titanium has no native
family for, built by the transformers backend from their Hugging Face folders (``--model.name`` left to auto), and
their exports loaded back by ``transformers``' own classes (and ``peft``) with the trained model's logits.

- SFT + LoRA on Gemma 3, packed rows (sliding window 8, shorter than the packed samples): the merged export and
  the base with the PEFT adapter give the trained model's logits (fp32 1e-5);
- DPO on OLMo 2 (shared-prompt rows: parent-document masks): the first step's loss is log 2 (the policy is its
  own reference: the reference forward equals the policy's), and the export loads with the trained logits;
- a Gemma 3 resumed from its DCP checkpoint continues bitwise as the uninterrupted run;
- GRPO on Granite (logit scaling) with titanium's engine (a copy of the backend model decoding with titanium's
  KV cache, synced by the training model's names): the first step's rollouts' log-probs equal the policy's own
  recomputed ones (``grpo/logprob_mismatch`` <= 1e-5; measured 1.0e-7), and the export loads with the trained logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import scalars, tiny_args
from tests.objectives.tiny_backend import VOCAB, save_tiny_hf

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
        exported = hf_cls.from_pretrained(folder, dtype=torch.float32).eval()
        torch.testing.assert_close(exported(input_ids=x).logits, ours, **TOL)
    return x


def test_sft_with_lora_on_packed_gemma3(make_trainer, tmp_path: Path) -> None:
    hf = save_tiny_hf(tmp_path / "gemma3", "gemma3_text")
    run = tmp_path / "sft"
    trainer = make_trainer(
        *tiny_args(run, "--training.steps", "4", "--optimizer.lr", "1e-2"),
        *("--training.objective", "sft", "--data.kind", "chat", "--data.path", str(TASKS / "train.jsonl")),
        *("--chat.chat_template", "llama3", "--lora.rank", "4", "--lora.target_modules", "attention", "mlp"),
        *start_from(tmp_path / "gemma3"),
        "--checkpoint.last_save_in_hf",
    )  # fmt: skip
    assert trainer.model_spec.name == "transformers"
    trainer.train()
    losses = scalars(run / "tb")
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1], losses
    x = trained_logits_load_back(trainer, run / "hf", type(hf))
    from peft import PeftModel

    base = type(hf).from_pretrained(tmp_path / "gemma3", dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, run / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=x).logits, trainer.model(x), **TOL)


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
