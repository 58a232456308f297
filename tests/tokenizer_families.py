"""Tiny tokenizer folders shaped as each family's published ``tokenizer.json`` / ``tokenizer_config.json`` are, built
offline: the same model type, normalizer, pre-tokenizer, decoder, special tokens, digit splitting and tokenizer
class, with a vocabulary trained here on a few sentences (so the files are small and the tests need no hub).

- llama3: byte-level BPE behind Llama 3's split regex (digits in groups of 1-3), ``<|begin_of_text|>`` added by the
  post-processor, ``PreTrainedTokenizerFast``.
- qwen2, qwen3, qwen3_moe: byte-level BPE behind Qwen's regex (single digits) and NFC, ``Qwen2Tokenizer``; and
  ``qwen2_plain``: what a user makes with ``tokenizers`` and saves with transformers (GPT-2's ByteLevel
  pre-tokenizer, digit runs whole) in a qwen2 folder, the case of issue 42.
- mistral: SentencePiece-converted BPE with byte fallback behind ``Metaspace`` (digits split), ``LlamaTokenizer``.
- phi3: Llama 2-style SentencePiece conversion (``Prepend`` + ``Replace`` normalizer), ``LlamaTokenizer``.
- gemma2: byte-fallback BPE with ``Replace(" ", "▁")``, ``GemmaTokenizer``.

The chat templates are short versions of each family's published one (the parts a plain conversation uses).
"""

from __future__ import annotations

import json
from pathlib import Path

from titanium.data.tokenizer import LLAMA3_PAT_STR

CORPUS = [
    "the quick brown fox jumps over the lazy dog; 19 foxes, 2024 dogs and 123456 cats",
    "Hello world! Hello, tokenizer: numbers 0 1 2 3 4 5 6 7 8 9 10 19 99 100 999 1999",
    "naïve café déjà vu 中文 字符 🚀 emoji ümlaut Straße",
    "    indented\tcode = {'a': [1, 2, 3]}\n\n\nnew lines\r\n and   spaces",
    "You are a helpful assistant. What is 12 + 7? The answer is 19.",
] * 30

LLAMA3_REGEX = LLAMA3_PAT_STR  # (the same split as titanium's tiktoken tokenizer)
QWEN_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN3_TEMPLATE = (
    "{%- for message in messages %}{%- if message.role == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' + message.content.lstrip('\n') + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' }}{%- endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] "
    "| trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

FAMILIES = ("llama3", "qwen2", "qwen2_plain", "qwen3", "qwen3_moe", "mistral", "phi3", "gemma2")
MODEL_TYPES = {"qwen2_plain": "qwen2", "llama3": "llama"}


def _byte_level_bpe(regex: str | None, normalizer: bool, specials: list[str], vocab_size: int = 700) -> dict:
    """A trained byte-level BPE as tokenizer.json data, with ``regex`` split before ByteLevel (None: GPT-2's)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    if normalizer:
        tok.normalizer = normalizers.NFC()
    if regex is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        split = pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=specials
    )
    tok.train_from_iterator(CORPUS, trainer)
    return json.loads(tok.to_str())


def _sentencepiece_bpe(specials: list[str], *, prepend: bool, vocab_size: int = 700) -> dict:
    """A SentencePiece-style BPE (``▁`` for spaces, single digits, ``<0xNN>`` byte fallback) as tokenizer.json
    data: ids 0.. are ``specials``, then the 256 byte tokens, then the trained pieces."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Sequence(  # (SentencePiece: words, single digits, newline runs apart)
        [
            pre_tokenizers.Split("▁", behavior="merged_with_next"),
            pre_tokenizers.Split(Regex("\n+"), behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True),
        ]
    )
    lines = ["▁" + line if prepend else line for line in CORPUS]
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=vocab_size))
    trained = json.loads(tok.to_str())["model"]
    pieces = [*specials, *(f"<0x{b:02X}>" for b in range(256))]
    pieces += [p for p, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]) if p not in pieces]
    return {
        "type": "BPE",
        "dropout": None,
        "unk_token": "<unk>",
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": True,
        "byte_fallback": True,
        "ignore_merges": False,
        "vocab": {p: i for i, p in enumerate(pieces)},
        "merges": trained["merges"],
    }


def _added(specials: list[str], first_id: int = 0, special: bool = True) -> list[dict]:
    return [
        {"id": first_id + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": not special, "special": special}
        for i, s in enumerate(specials)
    ]  # fmt: skip


def _write(folder: Path, tokenizer: dict, config: dict, model_type: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return folder


def family_tokenizer(family: str, folder: Path) -> Path:
    """Write ``family``'s tokenizer folder (tokenizer.json, tokenizer_config.json, a config.json naming its model
    type) to ``folder``."""
    model_type = MODEL_TYPES.get(family, family)
    if family == "llama3":
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
                    "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]  # fmt: skip
        data = _byte_level_bpe(LLAMA3_REGEX, normalizer=False, specials=[])
        data["model"]["ignore_merges"] = True
        data["added_tokens"] = _added(specials, len(data["model"]["vocab"]))
        bos = {"id": data["added_tokens"][0]["id"], "type_id": 0}
        data["post_processor"] = {
            "type": "Sequence",
            "processors": [
                {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
                {
                    "type": "TemplateProcessing",
                    "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                               {"Sequence": {"id": "A", "type_id": 0}}],
                    "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                             {"Sequence": {"id": "A", "type_id": 0}},
                             {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
                             {"Sequence": {"id": "B", "type_id": 1}}],
                    "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [bos["id"]],
                                                              "tokens": ["<|begin_of_text|>"]}},
                },
            ],
        }  # fmt: skip
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "chat_template": LLAMA3_TEMPLATE,
            "clean_up_tokenization_spaces": True,
        }
        return _write(folder, data, config, model_type)
    if family in ("qwen2", "qwen3", "qwen3_moe", "qwen2_plain"):
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        plain = family == "qwen2_plain"
        data = _byte_level_bpe(None if plain else QWEN_REGEX, normalizer=not plain, specials=[])
        data["added_tokens"] = _added(specials, len(data["model"]["vocab"]))
        data["added_tokens"] += _added(["<think>", "</think>"], len(data["model"]["vocab"]) + 3, special=False)
        config = {
            "tokenizer_class": "TokenizersBackend" if plain else "Qwen2Tokenizer",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "chat_template": QWEN3_TEMPLATE if family.startswith("qwen3") else QWEN2_TEMPLATE,
            "clean_up_tokenization_spaces": False,
        }
        return _write(folder, data, config, model_type)
    if family in ("mistral", "phi3"):
        specials = ["<unk>", "<s>", "</s>"]
        extra = ["[INST]", "[/INST]"] if family == "mistral" else ["<|assistant|>", "<|end|>", "<|system|>", "<|user|>"]
        model = _sentencepiece_bpe([*specials, *extra] if family == "mistral" else specials, prepend=True)
        added = _added([*specials, *extra]) if family == "mistral" else _added(specials)
        if family == "phi3":
            added += _added(extra, len(model["vocab"]))
        decoder = {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        }
        if family == "mistral":  # (v0.3: Metaspace, prepending only at the start)
            normalizer = None
            pre = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
        else:
            normalizer = {
                "type": "Sequence",
                "normalizers": [
                    {"type": "Prepend", "prepend": "▁"},
                    {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
                ],
            }
            pre = None
        data = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": normalizer,
            "pre_tokenizer": pre,
            "post_processor": None,
            "decoder": decoder,
            "model": model,
        }
        config = {
            "tokenizer_class": "LlamaTokenizer",
            "bos_token": "<s>",
            "eos_token": "<|end|>" if family == "phi3" else "</s>",
            "unk_token": "<unk>",
            "add_bos_token": True,
            "add_eos_token": False,
            "legacy": False,
            "chat_template": PHI3_TEMPLATE if family == "phi3" else MISTRAL_TEMPLATE,
        }
        return _write(folder, data, config, model_type)
    if family == "gemma2":
        specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
        model = _sentencepiece_bpe(specials, prepend=False)
        data = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": _added(specials),
            "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
            "pre_tokenizer": {
                "type": "Split",
                "pattern": {"String": " "},
                "behavior": "MergedWithPrevious",
                "invert": False,
            },
            "post_processor": None,
            "decoder": {
                "type": "Sequence",
                "decoders": [
                    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                    {"type": "ByteFallback"},
                    {"type": "Fuse"},
                ],
            },
            "model": model,
        }
        config = {
            "tokenizer_class": "GemmaTokenizer",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "add_bos_token": True,
            "add_eos_token": False,
            "chat_template": GEMMA_TEMPLATE,
        }
        return _write(folder, data, config, model_type)
    raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
