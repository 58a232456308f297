"""A trained reward model as a GRPO reward: its scores against ``transformers``' AutoModelForSequenceClassification
on the same token sequences, its weighted sum with rule rewards, bad folders refused, and a short GRPO run with
it (plus the overlong reward and dynamic sampling) on the debug task."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch
import transformers

from tests.helpers import REPO, scalars, tiny_args
from tests.parity.harness import randomize_
from titanium.config.loader import ConfigError
from titanium.config.sections import RLSection
from titanium.data.tokenizer import DEFAULT_TOKENIZER_PATH, TiktokenTokenizer
from titanium.errors import UserError
from titanium.rl.rewards.functions import RewardSet, reward_labels
from titanium.rl.rewards.model_scorer import RewardModelScorer

SCORE_ATOL = 1e-5


@pytest.fixture(scope="module")
def tokenizer() -> TiktokenTokenizer:
    return TiktokenTokenizer(str(REPO / DEFAULT_TOKENIZER_PATH))


def _config(tokenizer: TiktokenTokenizer) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=tokenizer.vocab_size,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=tokenizer.pad_id,
    )


@pytest.fixture(scope="module")
def reward_folder(tokenizer, tmp_path_factory) -> Path:
    """A random LlamaForSequenceClassification (one label) on the debug tokenizer's ids, saved in HF format."""
    folder = tmp_path_factory.mktemp("reward_model")
    model = transformers.LlamaForSequenceClassification(_config(tokenizer)).float()
    randomize_(model, seed=3)
    model.save_pretrained(folder)
    return folder


def _sequences(tokenizer: TiktokenTokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts (llama3 chat format) and responses of several lengths, one truncated (no end of turn)."""
    eot = tokenizer.special_tokens["<|eot_id|>"]
    header = [tokenizer.bos_id, *tokenizer.encode("user: what is 2 + 3?", bos=False, eos=False)]
    prompts = [header, header[:5], header + [17, 18, 19], header]
    responses = [
        tokenizer.encode("5", bos=False, eos=False) + [eot],
        tokenizer.encode("the answer is 5", bos=False, eos=False) + [eot],
        tokenizer.encode("six", bos=False, eos=False),
        [eot],
    ]
    return prompts, responses


def test_scores_equal_transformers_sequence_classification(tokenizer, reward_folder: Path) -> None:
    """Rows of different lengths scored in one right-padded batch (and with batch_size 1) against transformers on
    each sequence alone and on the same padded batch with its attention mask."""
    prompts, responses = _sequences(tokenizer)
    sequences = [p + r for p, r in zip(prompts, responses)]
    scorer = RewardModelScorer.load(
        str(reward_folder),
        device=torch.device("cpu"),
        pad_id=tokenizer.pad_id,
        vocab_size=tokenizer.vocab_size,
        max_seq_len=64,
    )
    ours = torch.tensor(scorer(["?"] * len(sequences), completion_ids=responses, prompt_ids=prompts))
    scorer.batch_size = 1
    assert torch.allclose(scorer.score(sequences), ours, atol=SCORE_ATOL, rtol=0)

    hf = transformers.AutoModelForSequenceClassification.from_pretrained(reward_folder, attn_implementation="eager")
    hf = hf.float().eval()
    with torch.no_grad():
        alone = torch.stack([hf(input_ids=torch.tensor([s])).logits[0, 0] for s in sequences])
        width = max(len(s) for s in sequences)
        padded = torch.tensor([s + [tokenizer.pad_id] * (width - len(s)) for s in sequences])
        batched = hf(input_ids=padded, attention_mask=padded != tokenizer.pad_id).logits[:, 0]
    assert alone.abs().max() > 0.1 and alone.std() > 0.01  # (scores that tell the rows apart)
    for expected in (alone, batched):
        gap = (ours - expected).abs().max().item()
        assert gap <= SCORE_ATOL, f"reward model scores differ from transformers' by {gap:.2e}"


def test_reward_model_weighted_with_rule_rewards(tokenizer, reward_folder: Path) -> None:
    """``--rl.rewards FOLDER exact_match overlong`` with weights: the total is the weighted sum, each function's
    values kept under its name (the folder's for the reward model)."""
    cfg = RLSection(
        rewards=[str(reward_folder), "exact_match", "overlong"],
        reward_weights=[0.5, 2.0, 1.0],
        max_new_tokens=4,
        overlong_buffer=2,
    )
    rewards = RewardSet.from_config(cfg, pad_id=tokenizer.pad_id, vocab_size=tokenizer.vocab_size)
    prompts, responses = _sequences(tokenizer)
    eot = tokenizer.special_tokens["<|eot_id|>"]
    completions = [tokenizer.decode([t for t in r if t != eot]) for r in responses]
    out = rewards.with_tokens(prompts, responses)(completions, ["5"] * 4, [{}] * 4)
    model = out.per_function[str(reward_folder)]
    scorer = rewards.functions[str(reward_folder)]
    assert torch.allclose(model, scorer.score([p + r for p, r in zip(prompts, responses)]))
    assert out.per_function["exact_match"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert out.per_function["overlong"].tolist() == [0.0, -1.0, 0.0, 0.0]  # lengths 2, 5 (> 4), 1, 1
    assert torch.allclose(out.total, 0.5 * model + 2.0 * out.per_function["exact_match"] + out.per_function["overlong"])


def test_bad_reward_model_folders_are_refused(tokenizer, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config.json is missing"):
        RewardSet.from_config(RLSection(rewards=[str(tmp_path / "nothing/")]), pad_id=tokenizer.pad_id)
    causal = tmp_path / "causal"
    transformers.LlamaForCausalLM(_config(tokenizer)).save_pretrained(causal)
    with pytest.raises(UserError, match="is not a one-label sequence classifier"):
        RewardSet.from_config(RLSection(rewards=[str(causal)]), pad_id=tokenizer.pad_id)
    with pytest.raises(UserError, match="pad_token_id"):
        RewardSet.from_config(RLSection(rewards=[str(_other_pad(tokenizer, tmp_path))]), pad_id=tokenizer.pad_id)


def _other_pad(tokenizer: TiktokenTokenizer, tmp_path: Path) -> Path:
    config = _config(tokenizer)
    config.pad_token_id = 0
    folder = tmp_path / "other_pad"
    transformers.LlamaForSequenceClassification(config).save_pretrained(folder)
    return folder


def test_grpo_trains_with_a_reward_model(make_trainer, tmp_path: Path, reward_folder: Path) -> None:
    """2 GRPO steps of the debug model on the bundled tasks, rewarded by the reward model and the overlong
    punishment, with dynamic sampling: the logged reward is their weighted sum, and the model's scores spread."""
    name = str(reward_folder)
    args = tiny_args(
        tmp_path,
        *("--training.objective", "grpo", "--training.steps", "2", "--training.local_batch_size", "8"),
        *("--data.kind", "chat", "--data.path", str(REPO / "assets/tasks/arithmetic/train.jsonl")),
        *("--chat.chat_template", "llama3", "--grpo.group_size", "4", "--rl.max_new_tokens", "6"),
        *("--rl.max_prompt_len", "40", "--rl.rewards", name, "overlong", "--rl.reward_weights", "1.0", "0.5"),
        *("--rl.overlong_buffer", "3", "--rl.dynamic_sampling", "--rl.answer_column", ""),
        *("--optimizer.lr", "1e-4", "--metrics.enable_tensorboard"),
    )
    make_trainer(*args).train()
    label = reward_labels([name])[name]
    total, model = scalars(tmp_path / "tb", "grpo/reward"), scalars(tmp_path / "tb", f"grpo/reward/{label}")
    overlong, rounds = (
        scalars(tmp_path / "tb", "grpo/reward/overlong"),
        scalars(tmp_path / "tb", "grpo/generation_rounds"),
    )
    assert sorted(total) == [1, 2] and sorted(rounds) == [1, 2]
    for step in total:
        assert total[step] == pytest.approx(model[step] + 0.5 * overlong[step], abs=1e-5)
    assert statistics.pstdev(model.values()) > 0 and all(r >= 1 for r in rounds.values())


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = ["what is 2 + 3? the answer is 5", "hello world, hello tokenizer", "the quick brown fox jumps", "naïve café"]


@pytest.fixture(scope="module")
def own_tokenizer_folder(tmp_path_factory) -> Path:
    """A random LlamaForSequenceClassification with a tokenizer of its own, unlike the policy's (a small byte-level
    BPE with ChatML's specials and template), both saved as transformers saves them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("own_tokenizer_reward_model")
    words = Tokenizer(models.BPE())
    words.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    words.train_from_iterator(CORPUS * 10, trainer)
    words.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    fast.save_pretrained(folder)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=len(fast), max_position_embeddings=256, num_labels=1, pad_token_id=fast.pad_token_id,
    )  # fmt: skip
    model = transformers.LlamaForSequenceClassification(config).float()
    randomize_(model, seed=5)
    model.save_pretrained(folder)
    return folder


def test_a_reward_model_with_its_own_tokenizer_reads_what_trl_would_feed_it(tokenizer, own_tokenizer_folder) -> None:
    """--rl.reward_model_tokenizer own: conversations (the response as the assistant's turn) rendered with the
    reward model's own chat template, and a text prompt followed by the response, give exactly the ids TRL's
    GRPOTrainer feeds it (apply_chat_template, then the tokenizer without added special tokens), and the scores of
    AutoModelForSequenceClassification on that right-padded batch. The policy's ids play no part."""
    folder = str(own_tokenizer_folder)
    scorer = RewardModelScorer.load(
        folder, device=torch.device("cpu"), pad_id=tokenizer.pad_id, vocab_size=tokenizer.vocab_size,
        max_seq_len=128, tokenizer="own",
    )  # fmt: skip
    prompts = [
        [{"role": "user", "content": "what is 2 + 3?"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}],
        "the quick brown fox",
        [{"role": "user", "content": "naïve café"}],
    ]
    completions = ["5", "hello tokenizer, the answer is 5", " jumps", ""]
    ours = torch.tensor(scorer(completions, completion_ids=[[7]] * 4, prompt_ids=[[7]] * 4, prompts=prompts))

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    texts = [
        hf_tokenizer.apply_chat_template([*p, {"role": "assistant", "content": c}], tokenize=False)
        if isinstance(p, list)
        else p + c
        for p, c in zip(prompts, completions)
    ]
    for p, c, text in zip(prompts, completions, texts):
        assert scorer.reader(p, c) == hf_tokenizer(text, add_special_tokens=False)["input_ids"], text
    inputs = hf_tokenizer(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(folder, attn_implementation="eager")
    with torch.no_grad():
        expected = hf.float().eval()(**inputs).logits[:, 0]
    assert expected.std() > 0.01  # (scores that tell the rows apart)
    gap = (ours - expected).abs().max().item()
    assert gap <= SCORE_ATOL, f"reward model scores differ from transformers' by {gap:.2e}"


def test_grpo_trains_with_a_reward_model_of_another_tokenizer(make_trainer, tmp_path, own_tokenizer_folder) -> None:
    """2 GRPO steps of the debug model (tiktoken vocabulary) rewarded by a reward model with its own BPE vocabulary
    and chat template: its scores are logged and spread."""
    name = str(own_tokenizer_folder)
    args = tiny_args(
        tmp_path,
        *("--training.objective", "grpo", "--training.steps", "2", "--training.local_batch_size", "8"),
        *("--data.kind", "chat", "--data.path", str(REPO / "assets/tasks/arithmetic/train.jsonl")),
        *("--chat.chat_template", "llama3", "--grpo.group_size", "4", "--rl.max_new_tokens", "6"),
        *("--rl.max_prompt_len", "40", "--rl.rewards", name, "--rl.reward_model_tokenizer", "own"),
        *("--rl.answer_column", "", "--optimizer.lr", "1e-4", "--metrics.enable_tensorboard"),
    )
    make_trainer(*args).train()
    model = scalars(tmp_path / "tb", f"grpo/reward/{reward_labels([name])[name]}")
    assert sorted(model) == [1, 2] and statistics.pstdev(model.values()) > 0
