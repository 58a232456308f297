"""GRPO on tool-calling episodes against a real ``trl.GRPOTrainer(tools=[calculate])``: the batch and the loss.

Both sides play the same scripted policy (tests/objectives/scripted_engine.py: each episode's next turn depends
only on its tokens so far) through their own tool loops: TRL's ``_tool_call_loop`` (its ``_generate_single_turn``
replaced by the script) and titanium's episode runner with its sandboxed tools. The tokenizer is byte-level with
Qwen's specials and TRL's bundled Qwen 2.5 chat template (tools rendered in the system prompt, calls as
``<tool_call>`` JSON, results as ``<tool_response>`` blocks in a user turn), so both render the same text to the same
ids and TRL parses the calls with its own response schema.

Checked: TRL's batch (prompt ids, completion ids with the tool results, completion_mask x tool_mask, the engine's
log-probs with 0 on tool tokens, advantages) equals titanium's rollout rows (prompt + episode, ``response_mask``,
``old_logprobs``); then every loss type's loss and gradients on that batch (old and reference log-probs fixed with
noise, so clips bite), titanium's ``grpo_loss`` with the holey mask against TRL's ``compute_loss``, <= 1e-6.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.objectives.scripted_engine import ScriptedEngine, made_up_logprob
from tests.unit.test_grpo_trl import TOLERANCE, VARIANTS
from titanium.config.sections import EnvironmentSection, GRPOSection
from titanium.data.chat import Message, build_chat_template
from titanium.data.prompts import PromptSample
from titanium.data.tokenizer import HFTokenizer
from titanium.generation.sampling import SamplingParams, token_logprobs
from titanium.models.common.kv_cache import PAD_DOCUMENT
from titanium.objectives.grpo import group_advantages
from titanium.objectives.losses.grpo import grpo_loss
from titanium.rl.env.registry import environment_spec
from titanium.rl.episodes import EpisodeRunner
from titanium.rl.rewards.functions import RewardSet
from titanium.rl.tools.calculator import calculate

trl = pytest.importorskip("trl", reason="pip install 'trl>=1.16,<2' (in the dev extra) to compare with TRL")

GROUP, BUDGET, TEMPERATURE, EPS_LOW, EPS_HIGH, BETA = 2, 300, 0.7, 0.2, 0.28, 0.04
QUESTIONS = [("What is 47 * 38?", "1786"), ("What is 347 + 589?", "936")]
CALL = '<tool_call>\n{{"name": "calculate", "arguments": {{"expression": "{}"}}}}\n</tool_call>'
SCRIPT = [  # per episode (2 per question), its turns; "{result}" is the last tool result read
    [CALL.format("47 * 38"), "{result}"],  # calls the tool, answers with its result
    ["1000"],  # answers at once, wrongly
    [CALL.format("347 + 589") + "\n" + CALL.format("589 + 347"), "{result}"],  # two calls in one turn
    ["Let me check.\n" + CALL.format("300 + 600"), CALL.format("347 + 589"), "{result}"],
]  # (the last: its second tool result does not fit the budget, so the episode ends after its second turn)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@functools.cache
def tokenizer_folder() -> Path:
    """A byte-level BPE tokenizer (256 byte tokens, no merges: any text round-trips) with Qwen's special tokens and
    TRL's Qwen 2.5 chat template, as a Hugging Face folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {char: i for i, char in enumerate(sorted(alphabet))}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(SPECIALS)
    folder = Path(tempfile.mkdtemp())
    bpe.save(str(folder / "tokenizer.json"))
    template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def tiny_qwen_sized_llama(vocab: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.parity.harness import randomize_

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=vocab - 3, eos_token_id=vocab - 1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    randomize_(model, 0)
    return model


class Policy:
    """The scripted policy over ids: which episode an input belongs to, from its prompt (the n-th time a bare
    prompt is seen, the n-th episode of its group) and its first turn; the turn from its assistant turns so far."""

    def __init__(self, tokenizer: Any, prompts: list[list[int]]) -> None:
        self.tokenizer, self.prompts, self.seen = tokenizer, prompts, [0] * len(prompts)
        self.end = tokenizer.encode("<|im_end|>", add_special_tokens=False)

    def __call__(self, ids: list[int]) -> list[int]:
        question = next(q for q, p in enumerate(self.prompts) if ids[: len(p)] == p)
        after = self.tokenizer.decode(ids[len(self.prompts[question]) :])
        if not after:
            episode = question * GROUP + self.seen[question]
            self.seen[question] += 1
        else:
            episode = next(e for e in (question * GROUP + j for j in range(GROUP)) if after.startswith(SCRIPT[e][0]))
        turn = SCRIPT[episode][after.count("<|im_start|>assistant")]
        result = after.rsplit("<tool_response>\n", 1)[-1].split("\n", 1)[0]
        return self.tokenizer.encode(turn.replace("{result}", result) + "<|im_end|>", add_special_tokens=False)


@functools.cache
def episodes() -> tuple[dict[str, torch.Tensor], Any]:
    """TRL's batch (from ``_generate_and_score_completions``) and titanium's rollout of the same episodes."""
    from transformers import PreTrainedTokenizerFast

    folder = tokenizer_folder()
    hf = PreTrainedTokenizerFast.from_pretrained(str(folder))
    trainer = trl_trainer({"loss_type": "dapo"})
    conversations = [[{"role": "user", "content": q}] for q, _ in QUESTIONS]
    prompts = [
        hf.apply_chat_template(c, tools=[calculate], add_generation_prompt=True, tokenize=True, return_dict=False)
        for c in conversations
    ]
    policy = Policy(hf, prompts)

    def generate(prompt_ids: list[list[int]], *_: Any, **__: Any) -> tuple[list[list[int]], list[list[float]]]:
        outs = [policy(list(p)) for p in prompt_ids]
        return outs, [[made_up_logprob(len(p) + i, t) for i, t in enumerate(o)] for p, o in zip(prompt_ids, outs)]

    trainer._generate_single_turn = generate
    rows = [{"prompt": c, "answer": a} for c, (_, a) in zip(conversations, QUESTIONS) for _ in range(GROUP)]
    batch = trainer._generate_and_score_completions(rows)

    tokenizer = HFTokenizer(str(folder / "tokenizer.json"))
    template = build_chat_template("tokenizer", tokenizer, "llama3")
    cfg = EnvironmentSection(tools=["titanium.rl.tools.calculator:calculate"], tool_parser="hermes")
    spec = environment_spec(cfg)
    assert spec is not None
    runner = EpisodeRunner(spec, cfg, template, tokenizer, BUDGET, max_prompt_len=2048)
    samples = []
    for q, a in QUESTIONS:
        messages = (Message("user", q),)
        samples += [
            PromptSample(runner.prompt_template.prompt(list(messages)), a, {"answer": a}, messages=messages)
        ] * GROUP
    assert [s.prompt for s in samples[::GROUP]] == prompts  # (the same tools rendered the same way)
    engine = ScriptedEngine(Policy(hf, prompts), template.stop_ids, tokenizer.pad_id)
    try:
        played, _ = runner.run(engine, samples, SamplingParams(BUDGET, TEMPERATURE), seed=0)
        rollout = runner.rollout(played, RewardSet(["exact_match"]))
    finally:
        runner.close()
    return batch, rollout


def trl_trainer(options: dict[str, Any]) -> Any:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    def answered(completions: list[list[dict[str, Any]]], answer: list[str], **_: Any) -> list[float]:
        return [float(c[-1]["content"].strip() == a) for c, a in zip(completions, answer)]

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True, bf16=False, num_generations=GROUP,
        per_device_train_batch_size=GROUP * len(QUESTIONS), max_completion_length=BUDGET, temperature=TEMPERATURE,
        beta=0.0, **{"epsilon": EPS_LOW, "epsilon_high": EPS_HIGH, **options},
    )  # fmt: skip
    hf = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_folder()))
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": "x"}]] * GROUP, "answer": ["1"] * GROUP})
    trainer = GRPOTrainer(
        model=tiny_qwen_sized_llama(len(hf)), reward_funcs=answered, args=args, train_dataset=data,
        processing_class=hf, tools=[calculate],
    )  # fmt: skip
    trainer.model.train()
    return trainer


def test_trl_builds_the_batch_titanium_builds() -> None:
    batch, out = episodes()
    width = out.prompt_width
    assert torch.equal(batch["prompt_ids"], out.tokens[:, :width])
    assert torch.equal(batch["prompt_mask"].bool(), out.document_ids[:, :width] != PAD_DOCUMENT)
    assert torch.equal(batch["completion_ids"], out.tokens[:, width:])
    assert torch.equal((batch["completion_mask"] * batch["tool_mask"]).bool(), out.response_mask)
    assert torch.equal(batch["sampling_per_token_logps"], out.old_logprobs)
    assert torch.equal(batch["advantages"], group_advantages(out.rewards.total, GROUP))
    tool_tokens = (batch["completion_mask"] * (1 - batch["tool_mask"])).sum(dim=1)
    assert tool_tokens.tolist() == out.stats["env_tokens"].tolist() and tool_tokens[1] == 0 and tool_tokens.min() == 0
    stats = {name: out.stats[name].tolist() for name in ("turns", "tool_calls", "tool_ok", "overflow")}
    assert stats == {
        "turns": [2, 1, 2, 2],
        "tool_calls": [1, 0, 2, 2],
        "tool_ok": [1, 0, 2, 2],
        "overflow": [0, 0, 0, 1],
    }
    assert out.rewards.total.tolist() == [1.0, 0.0, 1.0, 0.0] and out.finished.all()


def forward_logprobs(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logits = model(input_ids=ids, attention_mask=attention).logits
    width = batch["completion_ids"].shape[1]
    return token_logprobs(logits[:, -width - 1 : -1], batch["completion_ids"], TEMPERATURE)


@functools.cache
def with_old_and_ref() -> tuple[dict[str, torch.Tensor], Any]:
    batch, out = episodes()
    with torch.no_grad():
        logprobs = forward_logprobs(tiny_qwen_sized_llama(len(SPECIALS) + 256), batch)
    g = torch.Generator().manual_seed(1)
    batch = {
        **batch,
        "old_per_token_logps": logprobs + 0.3 * torch.randn(logprobs.shape, generator=g),
        "ref_per_token_logps": logprobs + 0.1 * torch.randn(logprobs.shape, generator=g),
    }
    return batch, out


@pytest.mark.parametrize("variant", [v for v in VARIANTS if "delta" not in v])  # (every normalization of the mask)
def test_loss_and_gradients_on_tool_episodes_equal_trl(variant: str) -> None:
    ours, options = VARIANTS[variant]
    batch, out = with_old_and_ref()
    cfg = GRPOSection(epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, beta=BETA, kl_bias_correction=False, **ours)
    model = tiny_qwen_sized_llama(len(SPECIALS) + 256)
    rows = {  # (titanium's rows, in TRL's naming for the shared forward)
        "prompt_ids": out.tokens[:, : out.prompt_width],
        "prompt_mask": (out.document_ids[:, : out.prompt_width] != PAD_DOCUMENT).long(),
        "completion_ids": out.tokens[:, out.prompt_width :],
        "completion_mask": batch["completion_mask"],
    }
    logprobs = forward_logprobs(model, rows)
    advantages = group_advantages(out.rewards.total, GROUP)
    loss_sum, units, _ = grpo_loss(
        logprobs, batch["old_per_token_logps"], advantages, out.response_mask, cfg, batch["ref_per_token_logps"],
        max_new_tokens=BUDGET,
    )  # fmt: skip
    loss = loss_sum / units
    loss.backward()
    trainer = trl_trainer({**options, "use_bias_correction_kl": False})
    trainer.beta = BETA
    trainer.current_gradient_accumulation_steps = 1
    trl_loss = trainer.compute_loss(trainer.model, batch)
    trl_loss.backward()
    assert abs(loss.item() - trl_loss.item()) <= TOLERANCE, (loss.item(), trl_loss.item())
    trl_grads = dict(trainer.model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, trl_grads[name].grad, rtol=0, atol=TOLERANCE, msg=name)
    assert any(p.grad.abs().max() > 1e-3 for p in model.parameters())  # (a real gradient)
