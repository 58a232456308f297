"""A tiny random Hugging Face Llama and a word-level tokenizer over its ids: what the TRL comparisons (DPO,
GRPO) wrap in a real TRL trainer. Token ``i`` is the word ``t{i}``; 0 is padding, 1 BOS, 2 EOS. And the seeded
debug model exported as a Hugging Face folder (a reward or value model for PPO runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.parity.harness import randomize_

VOCAB = 48
BOS, EOS, PAD = 1, 2, 0


def tiny_llama(seed: int) -> Any:
    """A float32 ``LlamaForCausalLM`` (2 layers, dim 32) with every weight random (``randomize_``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    randomize_(model, seed)
    return model


def word_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` whose words ``t0 .. t47`` are the model's ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t3"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t2", bos_token="t1")


def debug_model_hf(folder: Path, scalar: bool) -> str:
    """The debug model (llama3 debugmodel, the bundled tokenizer), seeded, in Hugging Face format in ``folder``: a
    one-label sequence classifier (``scalar``) or a causal LM."""
    from tests.helpers import REPO
    from titanium.checkpoint.hf import export_hf
    from titanium.data.tokenizer import DEFAULT_TOKENIZER_PATH, TiktokenTokenizer
    from titanium.model_builder import ModelBuilder
    from titanium.models import build_model_args, get_model_spec
    from titanium.models.reward import reward_spec

    tokenizer = TiktokenTokenizer(str(REPO / DEFAULT_TOKENIZER_PATH))
    spec = get_model_spec("llama3")
    if scalar:
        spec = reward_spec(spec, pad_token_id=tokenizer.pad_id)
    args = build_model_args(spec, "debugmodel", max_seq_len=64, vocab_size=tokenizer.vocab_size)
    export_hf(ModelBuilder(torch.device("cpu"), seed=7).build(spec, args).model, folder, spec.hf_adapter, args)
    return str(folder)
