"""A tiny random Hugging Face Llama with a byte-level BPE tokenizer trained on the bundled arithmetic questions: BOS
added by the tokenizer (as Llama's), ``<|im_end|>`` the end of text and of a turn, a ChatML template that opens
with BOS. Both lm-eval's own ``HFLM`` and titanium read this folder."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers import REPO
from tests.parity.harness import randomize_

SPECIALS = ["<|begin_of_text|>", "<|im_end|>", "<|im_start|>", "<|pad|>"]
CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus() -> list[str]:
    rows = [json.loads(line) for line in (REPO / "assets/tasks/arithmetic/train.jsonl").read_text().splitlines()]
    return [f"{m['content']}\n" for row in rows[:2000] for m in row["messages"]]


def make_tiny_hf(folder: Path, seed: int = 0, hidden_size: int = 32, layers: int = 2) -> Path:
    """Write the model (fp32 safetensors) and its tokenizer files to ``folder`` (``hidden_size`` and ``layers``: a
    larger model for benchmarks/lm_eval_speed.py)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_special_tokens(SPECIALS)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[("<|begin_of_text|>", bos)]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|im_end|>", pad_token="<|pad|>"
    )
    hf_tok.chat_template = CHATML
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=bos,
        eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|pad|>"),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    randomize_(model, seed)
    model.save_pretrained(folder)
    hf_tok.save_pretrained(folder)
    return folder
