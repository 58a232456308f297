"""A tiny random Hugging Face Llama and a word-level tokenizer over its ids: what the TRL comparisons (DPO,
GRPO) wrap in a real TRL trainer. Token ``i`` is the word ``t{i}``; 0 is padding, 1 BOS, 2 EOS."""

from __future__ import annotations

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
