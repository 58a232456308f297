"""Train the small debug BPE tokenizer: assets/tokenizer/titanium_debug.tiktoken.

Why: debug runs need a real (byte-level BPE, Llama 3-style) tokenizer that ships with
the repo, is small enough to review, and matches the bundled corpus. Meta's 128k
tokenizer is gated and far too large for a tiny model.

    python scripts/train_tokenizer.py            # from the repository root

It trains with HF `tokenizers` (a dev dependency; titanium itself never imports it)
using Llama 3's pre-tokenizer regex, converts the byte-level vocab/merges to tiktoken
ranks (256 single bytes first, then tokens in merge order) and writes the Llama 3
file format (`base64(token) rank` per line). It then checks that tiktoken, via
titanium's TiktokenTokenizer, encodes held-out text to the same tokens as the trained
`tokenizers` model and round-trips it. Deterministic: same corpus, same file.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from titanium.data.tokenizer import LLAMA3_PAT_STR, TiktokenTokenizer  # noqa: E402

NUM_RANKS = 2000  # BPE ranks incl. the 256 single bytes; vocab_size = 2000 + 256 specials


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-char table that byte-level BPE vocabularies are written in.

    Printable Latin-1 bytes map to themselves; the other 68 bytes map to U+0100 upwards.
    """
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def read_texts(path: Path) -> Iterator[str]:
    """Yield the "text" field of each JSONL line."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def train(texts: list[str], num_ranks: int):  # -> tokenizers.Tokenizer
    """Train a byte-level BPE with Llama 3 pre-tokenisation."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=num_ranks,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def to_ranks(tok) -> dict[bytes, int]:  # tok: tokenizers.Tokenizer
    """Byte-level vocab + merges -> tiktoken ranks.

    tiktoken merges the adjacent pair whose *concatenation* has the lowest rank, which
    equals BPE's merge-priority order when every token's rank is its merge's index.
    """
    decode = {c: b for b, c in byte_to_unicode().items()}

    def as_bytes(s: str) -> bytes:
        return bytes(decode[c] for c in s)

    ranks = {bytes([b]): b for b in range(256)}
    merges = json.loads(tok.to_str())["model"]["merges"]
    for merge in merges:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        a, b = as_bytes(left), as_bytes(right)
        if a not in ranks or b not in ranks:
            raise RuntimeError(f"merge {merge!r} uses a token not made by an earlier merge")
        ranks.setdefault(a + b, len(ranks))  # the same token from a second merge keeps its rank
    vocab = {as_bytes(s) for s in tok.get_vocab()}
    if vocab != set(ranks):
        raise RuntimeError("merges do not reproduce the trained vocabulary")
    return ranks


def check_merge_rule(ranks: dict[bytes, int]) -> None:
    """Every multi-byte token must be reachable from two lower-ranked tokens."""
    for token, rank in ranks.items():
        if len(token) == 1:
            continue
        if not any(
            ranks.get(token[:i], rank) < rank and ranks.get(token[i:], rank) < rank for i in range(1, len(token))
        ):
            raise RuntimeError(f"token {token!r} (rank {rank}) has no lower-ranked split")


def write_ranks(ranks: dict[bytes, int], path: Path) -> None:
    """Write the Llama 3 / tiktoken file: `base64(token) rank` per line, by rank."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(t).decode('ascii')} {r}" for t, r in sorted(ranks.items(), key=lambda x: x[1])]
    path.write_text("\n".join(lines) + "\n", encoding="ascii", newline="\n")


def verify(tok, path: Path, texts: list[str]) -> tuple[int, int, int]:
    """Compare tiktoken (via TiktokenTokenizer) with the trained model on texts.

    Returns (texts whose tokens differ, tokens, bytes). Round trip must be exact.
    """
    tt = TiktokenTokenizer(str(path))
    decode = {c: b for b, c in byte_to_unicode().items()}
    ranks = {base64.b64decode(line.split()[0]): int(line.split()[1]) for line in path.read_text().splitlines()}
    differ = n_tokens = n_bytes = 0
    for text in texts:
        ids = tt.encode(text, bos=False, eos=False)
        if tt.decode(ids) != text:
            raise RuntimeError(f"round trip failed on {text[:80]!r}")
        hf_ids = [ranks[bytes(decode[c] for c in t)] for t in tok.encode(text).tokens]
        differ += hf_ids != ids
        n_tokens += len(ids)
        n_bytes += len(text.encode("utf-8"))
    return differ, n_tokens, n_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", type=Path, default=REPO / "assets/corpus/train.jsonl")
    parser.add_argument("--validation", type=Path, default=REPO / "assets/corpus/validation.jsonl")
    parser.add_argument("--out", type=Path, default=REPO / "assets/tokenizer/titanium_debug.tiktoken")
    parser.add_argument("--num-ranks", type=int, default=NUM_RANKS)
    args = parser.parse_args()

    texts = list(read_texts(args.corpus))
    tok = train(texts, args.num_ranks)
    ranks = to_ranks(tok)
    if len(ranks) != args.num_ranks:
        raise RuntimeError(f"trained {len(ranks)} ranks, wanted {args.num_ranks}")
    check_merge_rule(ranks)
    write_ranks(ranks, args.out)

    extra = ["Hello, world! 🚀 naïve café  \t\n\n  x", "  leading and trailing  ", "12345 67.89 $1,000"]
    val = list(read_texts(args.validation)) + extra
    differ, n_tokens, n_bytes = verify(tok, args.out, val)
    if differ:
        raise RuntimeError(f"tiktoken and tokenizers disagree on {differ}/{len(val)} texts")
    digest = hashlib.sha256(args.out.read_bytes()).hexdigest()[:16]
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes, {len(ranks)} ranks, sha256 {digest}...)")
    print(
        f"validation: {n_tokens} tokens / {n_bytes} bytes = {n_tokens / n_bytes:.3f} tokens per byte; "
        f"identical to tokenizers on {len(val)}/{len(val)} texts, round trip exact"
    )


if __name__ == "__main__":
    main()
