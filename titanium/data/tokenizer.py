"""Tokenizers: the Llama 3 tiktoken format, Hugging Face tokenizer.json, and a byte tokenizer for tests.

Why three: real runs use a BPE ranks file in the Llama 3 format (Meta's
``tokenizer.model`` or our small ``assets/tokenizer/titanium_debug.tiktoken``), while
tests want something with no file at all. Both expose the same special tokens in the
same order, so chat templates and padding code work with either. Models published on
the Hugging Face hub (Qwen) ship a ``tokenizer.json`` with their own specials instead.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from titanium.errors import UserError

if TYPE_CHECKING:
    from titanium.config.sections import TokenizerSection

# Llama 3's pre-tokenizer: contractions, letter runs (with one leading non-letter),
# 1-3 digit groups, punctuation runs, newlines and other whitespace.
LLAMA3_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class TokenizerError(UserError, ValueError):
    """A tokenizer file that is missing or malformed; the message names the file and line."""


NUM_SPECIAL_TOKENS = 256
_NAMED_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
)
# Llama 3.1 order: the named tokens, then reserved ones numbered on from 2, 256 in all.
LLAMA3_SPECIAL_TOKENS: tuple[str, ...] = _NAMED_SPECIAL_TOKENS + tuple(
    f"<|reserved_special_token_{2 + i}|>" for i in range(NUM_SPECIAL_TOKENS - len(_NAMED_SPECIAL_TOKENS))
)
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|finetune_right_pad_id|>"

DEFAULT_TOKENIZER_PATH = "assets/tokenizer/titanium_debug.tiktoken"

# tiktoken's regex engine can be slow or overflow on huge inputs or on very long runs of
# whitespace / non-whitespace, so long texts are encoded in pieces (see _pieces).
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000


@runtime_checkable
class Tokenizer(Protocol):
    """What the rest of titanium relies on: ids, specials and text <-> ids."""

    vocab_size: int
    """Total number of ids, special tokens included (the model's embedding rows)."""
    bos_id: int | None
    """None for models trained without a BOS token (Qwen); ``encode(bos=True)`` then adds nothing."""
    eos_id: int
    pad_id: int
    """A special id that never occurs in encoded text; padding (loss masks it elsewhere)."""
    special_tokens: dict[str, int]
    """Special token string -> id, e.g. for chat templates (``<|start_header_id|>``...)."""

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def decode_sampled(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """The text of ids a model sampled, leaving out ids the tokenizer has no token for, as transformers' tokenizers
    do: many published models' output layers are wider than their tokenizers (Qwen2.5: 151,936 rows, 151,665 ids),
    and an untrained row can still be sampled. ``Tokenizer.decode`` itself refuses such ids (in data, they are bugs)."""
    ids = ids.tolist() if hasattr(ids, "tolist") else ids
    return tokenizer.decode([i for i in ids if 0 <= i < tokenizer.vocab_size])


def _tokenizer_hint(path: str) -> str:
    """Tell the user how to get a usable file, which depends on which file it was."""
    if Path(path).name == Path(DEFAULT_TOKENIZER_PATH).name:
        return (
            "regenerate the bundled debug tokenizer with `python scripts/train_tokenizer.py` "
            "(run from the repository root)"
        )
    return (
        "point [tokenizer] path at a BPE ranks file in the Llama 3 format "
        "(e.g. Meta's original/tokenizer.model), or use "
        f"{DEFAULT_TOKENIZER_PATH} (made by scripts/train_tokenizer.py)"
    )


def load_bpe_ranks(path: str) -> dict[bytes, int]:
    """Read a Llama 3 / tiktoken BPE file: one ``base64(token) rank`` per line.

    Why not ``tiktoken.load.load_tiktoken_bpe``: it caches files by *path* in a temp
    folder, so a regenerated file at the same path would be silently ignored, and its
    errors carry no line number. The format is the same.
    """
    p = Path(path)
    if not p.is_file():
        raise TokenizerError(f"tokenizer file not found: {path!r}; {_tokenizer_hint(path)}")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise TokenizerError(f"cannot read tokenizer file {path!r} ({e}); {_tokenizer_hint(path)}") from e

    ranks: dict[bytes, int] = {}
    seen_ranks: set[int] = set()
    for lineno, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise TokenizerError("expected 2 fields")
            token = base64.b64decode(parts[0], validate=True)
            rank = int(parts[1])
            if rank < 0:
                raise TokenizerError("negative rank")
        except (ValueError, binascii.Error) as e:
            shown = line[:80].decode("utf-8", errors="replace")
            raise TokenizerError(
                f"{path}:{lineno}: not a 'base64_token rank' line: {shown!r} ({e}); "
                f"the file is not in the Llama 3 tiktoken format or is corrupt; {_tokenizer_hint(path)}"
            ) from None
        if token in ranks or rank in seen_ranks:
            raise TokenizerError(f"{path}:{lineno}: duplicate token or rank {rank}; the file is corrupt")
        ranks[token] = rank
        seen_ranks.add(rank)

    if not ranks:
        raise TokenizerError(f"tokenizer file {path!r} is empty; {_tokenizer_hint(path)}")
    if seen_ranks != set(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks are not 0..{len(ranks) - 1} without gaps; the file is corrupt")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(
            f"{path}: {len(missing)} single-byte tokens missing (e.g. byte {missing[0]}); "
            "byte-level BPE needs all 256 to encode arbitrary text"
        )
    return ranks


_LONG_RUN = re.compile(rf"\s{{{_MAX_RUN_CHARS + 1},}}|\S{{{_MAX_RUN_CHARS + 1},}}")


def _pieces(text: str) -> Iterator[str]:
    """Split text so no piece exceeds tiktoken's comfortable limits.

    Splitting only happens for inputs > 400k chars or runs > 25k chars of only
    whitespace / only non-whitespace, where token boundaries barely matter.
    """
    for start in range(0, len(text), _MAX_ENCODE_CHARS):
        chunk = text[start : start + _MAX_ENCODE_CHARS]
        pos = 0
        for m in _LONG_RUN.finditer(chunk):
            if m.start() > pos:
                yield chunk[pos : m.start()]
            for i in range(m.start(), m.end(), _MAX_RUN_CHARS):
                yield chunk[i : min(i + _MAX_RUN_CHARS, m.end())]
            pos = m.end()
        if pos < len(chunk):
            yield chunk[pos:]


class TiktokenTokenizer:
    """Byte-level BPE from a Llama 3-format ranks file, run by tiktoken (fast, Rust).

    Special tokens get the ids right after the BPE ranks, in Llama 3 order, so
    Meta's own file gives Meta's ids (bos 128000) and ours gives bos 2000.
    """

    chat_template: str | None = None  # no Jinja template: chat formats are chosen by name (titanium.data.chat)

    def __init__(self, path: str) -> None:
        import tiktoken  # imported here so `byte` runs and config tooling need no tiktoken

        self.path = str(path)
        ranks = load_bpe_ranks(self.path)
        n_ranks = len(ranks)
        self.special_tokens: dict[str, int] = {tok: n_ranks + i for i, tok in enumerate(LLAMA3_SPECIAL_TOKENS)}
        self._encoding = tiktoken.Encoding(
            name=Path(self.path).name,
            pat_str=LLAMA3_PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.n_words = self.vocab_size = n_ranks + NUM_SPECIAL_TOKENS
        self.bos_id = self.special_tokens[BOS_TOKEN]
        self.eos_id = self.special_tokens[EOS_TOKEN]
        self.pad_id = self.special_tokens[PAD_TOKEN]

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        """Text -> ids. Special-token strings in ``text`` are encoded as ordinary text,
        so user data can never inject control tokens; add them by id instead."""
        ids: list[int] = [self.bos_id] if bos else []
        if len(text) <= _MAX_RUN_CHARS:
            ids.extend(self._encoding.encode_ordinary(text))
        else:
            for piece in _pieces(text):
                ids.extend(self._encoding.encode_ordinary(piece))
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text; special ids become their strings, invalid UTF-8 becomes U+FFFD."""
        try:
            # tolist() turns tensors/arrays into the plain ints tiktoken needs.
            return self._encoding.decode(ids.tolist() if hasattr(ids, "tolist") else list(ids))
        except KeyError as e:
            raise ValueError(f"token id {e.args[0]} is out of range [0, {self.vocab_size})") from None

    def save_pretrained(self, out: Path) -> list[str]:
        """The ranks as a Hugging Face tokenizer.json (byte-level BPE behind Llama 3's split, the specials after the
        ranks: the same ids) and a tokenizer_config.json, converted by transformers' own tiktoken converter; nothing
        (and a warning) without transformers."""
        try:
            from transformers.convert_slow_tokenizer import TikTokenConverter
        except ImportError:
            logging.getLogger("titanium").warning("not writing the tokenizer to %s: transformers is not installed", out)
            return []
        converted = TikTokenConverter(self.path, LLAMA3_PAT_STR, extra_special_tokens=LLAMA3_SPECIAL_TOKENS).converted()
        converted.save(str(out / TOKENIZER_FILE))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "model_max_length": 1_000_000,
            "clean_up_tokenization_spaces": False,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return [TOKENIZER_FILE, "tokenizer_config.json"]

    def __repr__(self) -> str:
        return f"TiktokenTokenizer(path={self.path!r}, vocab_size={self.vocab_size})"


class ByteTokenizer:
    """256 byte ids followed by the Llama 3 special tokens: no file, exact round trip.

    Why: unit tests and smoke runs should not depend on an asset or on tiktoken.
    """

    chat_template: str | None = None

    def __init__(self) -> None:
        self.special_tokens: dict[str, int] = {tok: 256 + i for i, tok in enumerate(LLAMA3_SPECIAL_TOKENS)}
        self._special_by_id = {i: tok for tok, i in self.special_tokens.items()}
        self.n_words = self.vocab_size = 256 + NUM_SPECIAL_TOKENS
        self.bos_id = self.special_tokens[BOS_TOKEN]
        self.eos_id = self.special_tokens[EOS_TOKEN]
        self.pad_id = self.special_tokens[PAD_TOKEN]

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        """UTF-8 bytes of ``text``, optionally wrapped in BOS/EOS."""
        ids = list(text.encode("utf-8"))
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes -> text (invalid UTF-8 becomes U+FFFD); special ids become their strings."""
        out: list[str] = []
        buf = bytearray()
        for i in ids.tolist() if hasattr(ids, "tolist") else ids:
            i = int(i)
            if 0 <= i < 256:
                buf.append(i)
            elif i in self._special_by_id:
                out.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
                out.append(self._special_by_id[i])
            else:
                raise ValueError(f"token id {i} is out of range [0, {self.vocab_size})")
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")


class HFTokenizer:
    """A Hugging Face tokenizer (byte-level BPE as Qwen and Llama 3 ship it, SentencePiece-style BPE as Mistral, Phi-3
    and Gemma do), run by ``tokenizers`` exactly as transformers' ``AutoTokenizer`` builds it for its folder.

    Why not just ``tokenizer.json``: transformers 5 rebuilds the normalizer and pre-tokenizer of many classes itself
    and takes only the vocabulary and merges from the file (``Qwen2Tokenizer`` splits digits one by one whatever the
    file's pre-tokenizer says, and a qwen2/qwen3 folder gets that class from its config.json even when
    tokenizer_config.json names ``TokenizersBackend``). A model trained on other ids than the ones transformers and
    vLLM serve it with is silently wrong, so titanium runs the Rust tokenizer AutoTokenizer built. Without
    transformers installed, a tokenizer.json alone (no config.json, no model-specific class) is run as it is, and a
    model folder's is refused: which pipeline AutoTokenizer would build cannot be told without it.

    ``path`` is a folder or the tokenizer.json in one. BOS, EOS and PAD are read from the ``tokenizer_config.json``
    beside it (``bos_token``, ``eos_token``, ``pad_token``) and otherwise recognised by their usual names; PAD falls
    back to EOS. ``bos_id`` is None when the model has no BOS (Qwen's config says ``"bos_token": null``), and
    ``encode(bos=True)`` then adds nothing: documents are only separated by EOS. The post-processor (which may add
    BOS itself) is not used, so BOS/EOS appear exactly when asked for; and as with the tiktoken loader,
    special-token strings inside text are encoded as plain text (transformers' ``split_special_tokens=True``).
    ``special_tokens`` lists every added token (``<|im_start|>``, ``<think>``...).
    """

    def __init__(self, path: str) -> None:
        given = Path(path)
        self.folder = given if given.is_dir() else given.parent
        file = given / TOKENIZER_FILE if given.is_dir() else given
        self.path = str(file)
        self._tok = _ecosystem_backend(self.folder, file)
        self._tok.encode_special_tokens = True
        self._rendered: Any = None  # (built on first use: _rendering)
        added = self._tok.get_added_tokens_decoder()
        self.special_tokens: dict[str, int] = {tok.content: i for i, tok in sorted(added.items())}
        self.n_words = self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
        config = self._read_config()
        self.bos_id = self._special_id(config, "bos_token", _BOS_NAMES, required=False)
        eos_id = self._special_id(config, "eos_token", _EOS_NAMES, required=True)
        assert eos_id is not None
        self.eos_id = eos_id
        pad_id = self._special_id(config, "pad_token", (), required=False)
        self.pad_id = self.eos_id if pad_id is None else pad_id
        self.chat_template = self._read_chat_template(config)

    def _read_config(self) -> dict | None:
        path = self.folder / "tokenizer_config.json"
        if not path.is_file():
            return None
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise TokenizerError(f"{path}: cannot read ({e})") from None
        return config if isinstance(config, dict) else None

    def _read_chat_template(self, config: dict | None) -> str | None:
        """The model's Jinja chat template: chat_template.jinja, as newer exports write it (it wins, as in
        transformers), or tokenizer_config.json's ``chat_template`` (a string, or a list of named templates of
        which "default" is used)."""
        path = self.folder / "chat_template.jinja"
        if path.is_file():
            return path.read_text()
        value = config.get("chat_template") if config is not None else None
        if isinstance(value, list):
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            value = named.get("default")
        return value if isinstance(value, str) else None

    def _special_id(self, config: dict | None, field: str, names: Sequence[str], *, required: bool) -> int | None:
        if config is not None and field in config:
            value = config[field]
            content = value.get("content") if isinstance(value, dict) else value
            if content is None:
                if required:
                    raise TokenizerError(f"{self.path}: tokenizer_config.json sets no {field}, which is required")
                return None
            token_id = self._tok.token_to_id(content)
            if token_id is None:
                raise TokenizerError(f"{self.path}: {field} {content!r} of tokenizer_config.json is not in the vocab")
            return token_id
        for name in names:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        if required:
            raise TokenizerError(
                f"{self.path}: cannot tell the {field} (none of {', '.join(names)}); put a tokenizer_config.json "
                f'with "{field}" next to it'
            )
        return None

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        """Text -> ids; BOS (if the model has one) and EOS only when asked for."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def encode_rendered(self, text: str, *, at_start: bool) -> list[int]:
        """Text a chat template rendered -> ids as transformers' ``apply_chat_template`` makes them: special-token
        strings become their ids. A piece that does not start the conversation (``at_start`` False) is encoded as
        the text after a special token is, so a SentencePiece-style tokenizer does not prepend its space marker
        (``▁``) to it as it does at the start of a text."""
        anchor = "" if at_start else self.decode([self.eos_id])
        ids = self._rendering().encode(anchor + text, add_special_tokens=False).ids
        if not at_start:
            assert ids[:1] == [self.eos_id], f"{self!r}: the EOS string does not encode to its id"
            ids = ids[1:]
        return ids

    def encode_rendered_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """As ``encode_rendered`` for a whole conversation, with each id's (start, end) character offsets in
        ``text`` (untrimmed: a token's own spaces count), so the ids can be cut where the messages meet."""
        encoding = self._rendering().encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def _rendering(self) -> Any:
        """A copy of the tokenizer that turns special-token strings into their ids, without the post-processor
        (which only adds specials this never asks for and trims offsets); built on first use."""
        if self._rendered is None:
            from tokenizers import Tokenizer as _Tokenizer

            data = json.loads(self._tok.to_str())
            data["post_processor"] = None
            self._rendered = _Tokenizer.from_str(json.dumps(data))
            self._rendered.encode_special_tokens = False
        return self._rendered

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text, special tokens included as their strings."""
        ids = ids.tolist() if hasattr(ids, "tolist") else [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range [0, {self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=False)

    def save_pretrained(self, out: Path) -> list[str]:
        """Copy the tokenizer's files (tokenizer.json, tokenizer_config.json, its chat template...) into ``out``."""
        copied = []
        for name in HF_TOKENIZER_FILES:
            source = Path(self.path) if name == TOKENIZER_FILE else self.folder / name
            if source.is_file() and source.resolve() != (out / name).resolve():
                shutil.copyfile(source, out / name)
                copied.append(name)
        return copied

    def __repr__(self) -> str:
        return f"HFTokenizer(path={self.path!r}, vocab_size={self.vocab_size})"


TOKENIZER_FILE = "tokenizer.json"
HF_TOKENIZER_FILES = (
    TOKENIZER_FILE,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
"""The files of a Hugging Face tokenizer folder (an export carries them)."""
GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
"""tokenizer_config.json classes whose transformers tokenizer runs tokenizer.json as it is."""


def _ecosystem_backend(folder: Path, file: Path) -> Any:
    """The ``tokenizers.Tokenizer`` that transformers' AutoTokenizer builds for ``folder`` (``file`` as it is when
    its name is not tokenizer.json: nothing else would read it)."""
    from tokenizers import Tokenizer as _Tokenizer  # imported here: only hf runs need it

    if file.name != TOKENIZER_FILE or not _needs_transformers(folder):
        if not file.is_file():
            raise TokenizerError(f"tokenizer file not found: {str(file)!r} (a Hugging Face tokenizer.json)")
        try:
            return _Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises a plain Exception for malformed files
            raise TokenizerError(f"{file}: not a Hugging Face tokenizer.json ({e})") from None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TokenizerError(
            f"{folder}: transformers is not installed, and it decides how this model folder is tokenized: "
            "AutoTokenizer may build the tokenizer class of the folder's model type with a pipeline of its own "
            "rather than tokenizer.json's (Qwen2Tokenizer splits digits one by one whatever the file says), and "
            "titanium must produce the ids transformers and vLLM will serve the model with; install transformers "
            "(pip install transformers)"
        ) from None
    try:
        auto = quietly(lambda: AutoTokenizer.from_pretrained(str(folder)))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TokenizerError(f"{folder}: transformers' AutoTokenizer cannot load this tokenizer ({e})") from None
    backend = getattr(auto, "backend_tokenizer", None)
    if not isinstance(backend, _Tokenizer):
        raise TokenizerError(
            f"{folder}: AutoTokenizer builds a {type(auto).__name__} for it, which has no `tokenizers` pipeline "
            "titanium can run; save a tokenizer.json with AutoTokenizer.from_pretrained(...).save_pretrained(...) "
            "in a folder of its own and point --tokenizer.path there"
        )
    return backend


def _needs_transformers(folder: Path) -> bool:
    """Whether AutoTokenizer may build something else than tokenizer.json as it is: a model folder (its model type
    picks a tokenizer class) or a tokenizer_config.json naming a class of its own."""
    if (folder / "config.json").is_file():
        return True
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return False
    try:
        name = json.loads(config.read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return False  # (reported where it is read)
    return name is not None and name.removesuffix("Fast") not in [c.removesuffix("Fast") for c in GENERIC_CLASSES]


def quietly(load: Any) -> Any:
    """``load()`` with transformers' logging held to errors: its notes on how a tokenizer was assembled (or a model
    built only to be checked) tell a titanium user nothing."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return load()
    finally:
        hf_logging.set_verbosity(level)


def build_tokenizer(cfg: TokenizerSection) -> Tokenizer:
    """Make the tokenizer the [tokenizer] config section asks for."""
    if cfg.kind == "tiktoken":
        return TiktokenTokenizer(cfg.path)
    if cfg.kind == "hf":
        return HFTokenizer(cfg.path)
    if cfg.kind == "byte":
        return ByteTokenizer()
    raise ValueError(f"unknown tokenizer kind {cfg.kind!r}; expected 'tiktoken', 'hf' or 'byte'")


TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""Files that give a Hugging Face folder a tokenizer of its own (a tokenizer_config.json alone is no vocabulary)."""


def has_tokenizer(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` carries its own tokenizer."""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_VOCAB_FILES)


def tokenizer_origin(cfg: TokenizerSection) -> str:
    """Where the [tokenizer] section's tokenizer comes from, for messages and for telling a folder's own."""
    return "byte" if cfg.kind == "byte" else cfg.path
