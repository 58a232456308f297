"""Precomputed reference log-probs for DPO: one pass of the frozen reference over the data, cached on disk.

The reference policy never changes, so its summed log-probs of every pair's two responses can be computed
once, before training, and read back instead of running (and holding) the reference model every step.

The cache is one file per key in ``[dpo] reference_cache_folder``: the key hashes everything the values
depend on (the reference model's id from the loop: family, args, weight files, precision; the data
files' content and columns; the tokenizer files; the chat template and system prompt; seq_len and the
long-pair policy), so changing any of them computes a new cache. Inside, pairs are found by a digest of
their tokens and labels, so a pair the key did not foresee (a hub dataset that changed) is an error, never
a wrong value.

The pass is split over data-parallel ranks by microbatch (every rank reads all pairs; rank r runs the
microbatches r, r + dp, ...); ranks left without one in the last round run a copy, so every rank makes the
same number of forwards, which FSDP, TP, CP and PP need. The results are gathered on every rank, and rank 0
writes the file.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from titanium.config.sections import DataSection
from titanium.data.preference import OnePass, PreferenceDataset, PreferencePair
from titanium.data.preference_batch import PairStream, PreferenceBatchLoader
from titanium.data.text import DataError, resolve_sources

logger = logging.getLogger(__name__)

FORMAT = 1
"""Changes when the cache's layout or the way values are computed changes."""


def pair_digest(pair: PreferencePair) -> bytes:
    """16 bytes naming a pair's tokens and labels (both sides): equal digests, equal reference values."""
    h = hashlib.blake2b(digest_size=16)
    for sample in (pair.chosen, pair.rejected):
        for ids in (sample["tokens"], sample["labels"]):
            h.update(len(ids).to_bytes(4, "little"))
            h.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
    return h.digest()


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def data_identity(data: DataSection) -> dict[str, Any]:
    """The data's content (local files by SHA-256; a hub dataset by name, config and split) and options."""
    sources = [
        file_sha256(s.data_files) if s.data_files is not None else f"{s.builder} {s.hub_config} {s.split}"
        for s in resolve_sources(data)
    ]
    return {"sources": sources, "options": {k: v for k, v in asdict(data).items() if k != "path"}}


def tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer's kind and special ids, and the content of its files (a HF tokenizer's config too)."""
    path = getattr(tokenizer, "path", None)
    files = [Path(path), Path(path).with_name("tokenizer_config.json")] if path else []
    return {
        "repr": f"{type(tokenizer).__name__} {tokenizer.vocab_size} {tokenizer.bos_id} {tokenizer.eos_id}",
        "files": [file_sha256(f) for f in files if f.is_file()],
        "chat_template": getattr(tokenizer, "chat_template", None),
    }


def cache_key(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps({"format": FORMAT, **identity}, sort_keys=True).encode()).hexdigest()[:20]


class ReferenceCache:
    """Reference log-probs (chosen, rejected) by pair digest, read from or written to ``folder/<key>``."""

    def __init__(self, values: dict[bytes, tuple[float, float]], path: Path) -> None:
        self.values, self.path = values, path

    @staticmethod
    def load(path: Path) -> ReferenceCache:
        tensors = load_file(str(path))
        digests = [bytes(row) for row in tensors["digests"].numpy()]
        logps = [(chosen, rejected) for chosen, rejected in tensors["logps"].tolist()]
        return ReferenceCache(dict(zip(digests, logps)), path)

    def save(self, identity: dict[str, Any]) -> None:
        """Write atomically (a crash leaves no file that looks complete), with the key's parts beside it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        digests = torch.frombuffer(bytearray(b"".join(self.values)), dtype=torch.uint8).view(-1, 16)
        logps = torch.tensor(list(self.values.values()), dtype=torch.float32).view(-1, 2)
        partial = self.path.with_suffix(".partial")
        save_file({"digests": digests, "logps": logps}, str(partial))
        os.replace(partial, self.path)
        self.path.with_suffix(".json").write_text(json.dumps(identity, indent=1, sort_keys=True) + "\n")

    def lookup(self, pair: PreferencePair, where: str) -> tuple[float, float]:
        value = self.values.get(pair_digest(pair))
        if value is None:
            raise DataError(
                f"{where}: this pair is not in the reference log-prob cache {self.path} (the data, tokenizer or "
                f"chat template changed in a way its key does not see); delete {self.path} to compute it again"
            )
        return value


class CachedReferencePairs:
    """A pair stream whose pairs carry their cached reference log-probs (a PairStream: same state).

    ``cache()`` is called when the pairs are first read, not before.
    """

    def __init__(self, pairs: PreferenceDataset, cache: Callable[[], ReferenceCache]) -> None:
        self.pairs, self._get_cache = pairs, cache
        self._cache: ReferenceCache | None = None

    def __iter__(self) -> Iterator[PreferencePair]:
        if self._cache is None:
            self._cache = self._get_cache()
        for pair in self.pairs:
            where = self.pairs.sources[pair.source].where(pair.row)
            reference = self._cache.lookup(pair, where)
            yield PreferencePair(pair.chosen, pair.rejected, pair.source, pair.row, reference)

    def state_dict(self) -> dict[str, Any]:
        return self.pairs.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pairs.load_state_dict(state)


def precompute(
    all_pairs: PreferenceDataset,
    make_loader: Callable[[PairStream], PreferenceBatchLoader],
    reference_sums: Callable[[dict[str, torch.Tensor]], torch.Tensor | None],
    dp_rank: int,
    dp_world: int,
) -> dict[bytes, tuple[float, float]]:
    """Reference log-probs of every pair of ``all_pairs`` (one pass), gathered on every rank.

    ``reference_sums(batch)`` gives the batch's per-slot (chosen, rejected) sums [slots, 2], or None on
    ranks that do not compute them (pipeline stages before the last).
    """
    loader = make_loader(OnePass(all_pairs))
    batches = iter(loader.next_placed, None)
    values: dict[bytes, tuple[float, float]] = {}
    for rounds in itertools.count(1):
        round_ = list(itertools.islice(batches, dp_world))
        if not round_:
            break
        batch, placements = round_[dp_rank] if dp_rank < len(round_) else (round_[0][0], [])
        sums = reference_sums(batch)
        if sums is not None:
            sums = sums.cpu()
            for pair, g, m in placements:
                chosen, rejected = sums[g * loader.slots + m].tolist()
                values[pair_digest(pair)] = (chosen, rejected)
        if rounds % 100 == 0:
            logger.info("reference log-probs: %d microbatches done", rounds * dp_world)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    for part in gathered:
        values.update(part)
    return values


def load_or_compute(
    folder: Path,
    identity: dict[str, Any],
    compute: Callable[[], dict[bytes, tuple[float, float]]],
) -> ReferenceCache:
    """The cache for ``identity``: read from ``folder`` if every rank finds it, else computed and written."""
    path = folder / f"{cache_key(identity)}.safetensors"
    found = torch.tensor([int(path.is_file())])
    dist.all_reduce(found, op=dist.ReduceOp.MIN)  # (CPU tensor: gloo) all ranks take the same branch
    if found.item():
        cache = ReferenceCache.load(path)
        logger.info("reference log-probs: %d pairs read from %s", len(cache.values), path)
        return cache
    logger.info("reference log-probs: computing them once over the data (to %s)", path)
    cache = ReferenceCache(compute(), path)
    if dist.get_rank() == 0:
        cache.save(identity)
    logger.info("reference log-probs: %d pairs cached", len(cache.values))
    return cache
