"""One rank of tests/distributed/test_data_pipeline.py (run under torchrun, gloo): reads its share of the
data through the real text pipeline and writes what it parsed and what it produced to a JSON report.

Every line the rank parses is recorded by wrapping titanium.data.shares.parse_line (the one place a line of
a .jsonl/.txt file is decoded), so the test sees exactly which rows each rank read.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import titanium.data.shares as shares
from titanium.config.sections import DataSection
from titanium.data.loader import BatchLoader
from titanium.data.text import TextDataset
from titanium.data.tokenizer import ByteTokenizer

PARSED: list[str] = []
_parse_line = shares.parse_line


def _recording_parse_line(raw: bytes, is_text: bool):
    PARSED.append(raw.decode("utf-8", errors="replace").strip())
    return _parse_line(raw, is_text)


shares.parse_line = _recording_parse_line


def take(loader: BatchLoader, n: int) -> list[list[list[int]]]:
    return [next(loader)["input"].tolist() for _ in range(n)]


def main() -> None:
    data_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = DataSection(path=str(data_dir))
    tok = ByteTokenizer()

    def loader(prefetch: int) -> BatchLoader:
        return BatchLoader(TextDataset(cfg, tok, seq_len=16, dp_rank=rank, dp_world=world), 3, prefetch=prefetch)

    report: dict = {}
    # 1. One pass: which lines this rank parsed, and which rows it handed on.
    one_pass = TextDataset(cfg, tok, seq_len=16, dp_rank=rank, dp_world=world)
    documents = one_pass._documents()
    PARSED.clear()
    handed: list[str] = []
    while True:
        text = next(documents)
        if one_pass.epoch:
            break
        handed.append(text)
    report["pass_parsed"] = PARSED[:-1]  # (the last one opened the next epoch)
    report["pass_rows"] = handed
    report["bad_rows"] = one_pass.bad_rows

    # 2. Prefetch off and on: the same batches, and after each batch the same saved state.
    inline, ahead = loader(0), loader(4)
    same_batches, same_states = True, True
    for _ in range(100):  # 4800 tokens: crosses files, bad lines and an epoch boundary (~3000 tokens a rank)
        same_batches &= torch.equal(next(inline)["input"], next(ahead)["input"])
        same_states &= json.dumps(inline.state_dict()) == json.dumps(ahead.state_dict())
    ahead.close()
    report["epochs_crossed"] = inline.dataset.epoch
    report["prefetch_same_batches"], report["prefetch_same_states"] = same_batches, same_states

    # 3. Resume mid-run (the state saved by a prefetching loader) = the uninterrupted run, reading no earlier row.
    reference = loader(0)
    PARSED.clear()
    take(reference, 7)
    state = json.loads(json.dumps(loader_state := reference.state_dict()))
    report["parsed_before_state"] = list(PARSED)
    PARSED.clear()
    expected = take(reference, 9)
    report["parsed_after_state"] = list(PARSED)
    prefetching = loader(3)
    take(prefetching, 7)
    report["prefetch_state_is_handed_out_state"] = json.dumps(prefetching.state_dict()) == json.dumps(loader_state)
    prefetching.close()
    resumed = loader(0)
    resumed.load_state_dict(state)
    PARSED.clear()
    report["resumed_same_batches"] = take(resumed, 9) == expected
    report["parsed_when_resumed"] = list(PARSED)

    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
