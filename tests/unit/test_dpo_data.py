"""Preference data: row shapes, response-only labels, truncation, bad rows, batching layouts, resume, bundled pairs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import REPO
from titanium.config import JobConfig
from titanium.config.sections import DataSection
from titanium.config.validate import validate
from titanium.data.chat import ChatTemplateError, Llama3Template, Message
from titanium.data.lines import row_number
from titanium.data.preference import PreferenceDataset, PreferencePair, fit_pair, pair_sample
from titanium.data.preference_batch import PreferenceBatchLoader
from titanium.data.sft import IGNORE_INDEX
from titanium.data.text import DataError
from titanium.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
TEMPLATE = Llama3Template(TOK)
EOT = TOK.special_tokens["<|eot_id|>"]


def jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def dataset(path: str, seq_len: int = 256, **options: Any) -> PreferenceDataset:
    data_keys = set(DataSection.__dataclass_fields__)
    data = DataSection(kind="preference", path=path, **{k: v for k, v in options.items() if k in data_keys})
    rest = {k: v for k, v in options.items() if k not in data_keys}
    return PreferenceDataset(data, TEMPLATE, seq_len, TOK.bos_id, **rest)


def take(iterable, n: int) -> list:
    it = iter(iterable)
    return [next(it) for _ in range(n)]


def targets(sample: dict) -> str:
    """The learned tokens of a sample as text (byte tokenizer), end of turn as '|'."""
    return "".join("|" if t == EOT else chr(t) for t in sample["labels"] if t != IGNORE_INDEX)


def expected_pair(prompt: list[Message], chosen: str, rejected: str) -> tuple[dict, dict]:
    """The two samples a pair must become: the chat template's rendering, learned only after the prompt."""
    prompt_ids = TEMPLATE.prompt(prompt)
    sides = []
    for answer in (chosen, rejected):
        tokens, _ = TEMPLATE.tokenize([*prompt, Message("assistant", answer)], train_on_input=False)
        n = len(prompt_ids)
        labels = [IGNORE_INDEX] * (n - 1) + tokens[n:] + [IGNORE_INDEX]
        sides.append({"tokens": tokens, "labels": labels})
    return sides[0], sides[1]


def test_every_row_shape_gives_the_same_pair(tmp_path):
    """Strings, a prompt message list, whole conversations with a prompt (UltraFeedback) or without (HH)."""
    system = {"role": "system", "content": "Be brief."}
    shapes = {
        "strings": {"prompt": "2+2?", "chosen": "4", "rejected": "5"},
        "prompt_messages": {"prompt": [user("2+2?")], "chosen": [assistant("4")], "rejected": "5"},
        "ultrafeedback": {
            "prompt": "2+2?",
            "chosen": [user("2+2?"), assistant("4")],
            "rejected": [user("2+2?"), assistant("5")],
        },
        "hh_implicit_prompt": {"chosen": [user("2+2?"), assistant("4")], "rejected": [user("2+2?"), assistant("5")]},
        "column_map": {"q": "2+2?", "good": "4", "bad": "5"},
    }
    expected = expected_pair([Message("user", "2+2?")], "4", "5")
    for name, row in shapes.items():
        options = dict(prompt_column="q", chosen_column="good", rejected_column="bad") if name == "column_map" else {}
        pair = take(dataset(jsonl(tmp_path / f"{name}.jsonl", [row]), **options), 1)[0]
        assert (pair.chosen, pair.rejected) == expected, name
        assert (targets(pair.chosen), targets(pair.rejected)) == ("4|", "5|"), name
    # A system message in the shared prefix stays prompt; --chat.system_prompt style replacement applies to it.
    row = {"chosen": [system, user("2+2?"), assistant("4")], "rejected": [system, user("2+2?"), assistant("5")]}
    pair = take(dataset(jsonl(tmp_path / "sys.jsonl", [row]), system_prompt="Be exact."), 1)[0]
    assert (pair.chosen, pair.rejected) == expected_pair(
        [Message("system", "Be exact."), Message("user", "2+2?")], "4", "5"
    )


def test_multi_turn_prompt_learns_only_the_responses(tmp_path):
    """Earlier assistant turns are context: only the final answers carry labels; the prompt tokens are shared."""
    history = [user("hi"), assistant("hello"), user("2+2?")]
    row = {"chosen": [*history, assistant("four")], "rejected": [*history, assistant("five")]}
    pair = take(dataset(jsonl(tmp_path / "m.jsonl", [row])), 1)[0]
    assert (targets(pair.chosen), targets(pair.rejected)) == ("four|", "five|")
    prompt = TEMPLATE.prompt([Message(m["role"], m["content"]) for m in history])
    assert pair.chosen["tokens"][: len(prompt)] == pair.rejected["tokens"][: len(prompt)] == prompt
    # A response of several turns: its assistant turns are learned, its user turn is not.
    row = {"prompt": "a?", "chosen": [assistant("x"), user("sure?"), assistant("yes")], "rejected": "y"}
    pair = take(dataset(jsonl(tmp_path / "t.jsonl", [row])), 1)[0]
    assert targets(pair.chosen) == "x|yes|"


BAD_ROWS = [
    ({"prompt": "q", "rejected": "b"}, "no 'chosen' column"),
    ({"prompt": "q", "chosen": 3, "rejected": "b"}, "'chosen': 'chosen' is int"),
    ({"prompt": "q", "chosen": "a", "rejected": "  "}, "'rejected' is empty"),
    ({"prompt": "q", "chosen": "same", "rejected": "same"}, "the same response"),
    ({"chosen": [user("q"), assistant("a")], "rejected": [user("q"), assistant("a")]}, "the same conversation"),
    ({"chosen": [user("q"), assistant("a")], "rejected": [user("r"), assistant("b")]}, "do not start with the same"),
    ({"chosen": [user("q"), assistant("a")], "rejected": [user("q")]}, "'rejected' has no response"),
    ({"prompt": "q", "chosen": [user("other"), assistant("a")], "rejected": "b"}, "with a user message"),
    ({"prompt": [user("q"), {"role": "robot", "content": "x"}], "chosen": "a", "rejected": "b"}, "unknown role"),
    ({"prompt": "q", "chosen": [assistant("a"), user("more?")], "rejected": "b"}, "ends with a user message"),
]


def test_bad_rows_are_skipped_and_counted(tmp_path):
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    paths = [jsonl(tmp_path / f"{k}.jsonl", [row, good]) for k, (row, _) in enumerate(BAD_ROWS)]
    for path in paths:
        ds = dataset(path)
        assert targets(take(ds, 1)[0].chosen) == "a|"
        assert ds.bad_rows == 1


@pytest.mark.parametrize("row,message", BAD_ROWS)
def test_bad_rows_fail_with_file_row_and_reason(tmp_path, row, message):
    path = jsonl(tmp_path / "bad.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}, row])
    with pytest.raises(DataError, match=r"bad\.jsonl: row 1: .*" + message.replace("?", r"\?")):
        take(dataset(path, on_bad_row="fail"), 2)


def test_a_template_whose_prompt_is_not_a_prefix_is_refused(tmp_path):
    class Drifting(Llama3Template):
        def prompt(self, messages, tools=None):
            return [*super().prompt(messages, tools), ord("!")]

    path = jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}])
    data = DataSection(kind="preference", path=path)
    with pytest.raises(ChatTemplateError, match="renders a prompt differently"):
        take(PreferenceDataset(data, Drifting(TOK), 64, TOK.bos_id), 1)


def test_truncation_cuts_the_prompt_first_keeping_bos_and_its_end():
    prompt, chosen, rejected = list(range(1000, 1030)), ([1, 2, 3], [True] * 3), ([4, 5], [True] * 2)
    prompt[0] = TOK.bos_id
    # Prompt 30 + longest response 3 = 33 > 20: the prompt keeps BOS and its last 16 tokens.
    p, c, r = fit_pair(prompt, chosen, rejected, seq_len=20, bos_id=TOK.bos_id)
    assert p == [TOK.bos_id, *prompt[-16:]] and (c, r) == (chosen, rejected)
    # Long responses: the prompt keeps half of seq_len, both responses are cut to the same room.
    chosen, rejected = (list(range(30)), [True] * 30), (list(range(50, 62)), [True] * 12)
    p, c, r = fit_pair(prompt, chosen, rejected, seq_len=20, bos_id=TOK.bos_id)
    assert p == [TOK.bos_id, *prompt[-9:]]
    assert c == (chosen[0][:10], [True] * 10) and r == (rejected[0][:10], [True] * 10)
    # Fitting pairs are left alone.
    assert fit_pair(prompt, chosen, rejected, seq_len=60, bos_id=TOK.bos_id) == (prompt, chosen, rejected)


def test_long_pairs_are_truncated_dropped_and_counted(tmp_path):
    question = "What is the sum of all the numbers from one to ten, counted carefully?"
    rows = [
        {"prompt": question, "chosen": "fifty-five", "rejected": "fifty"},
        {"prompt": "q", "chosen": "abcdefghij" * 10, "rejected": "abcdefghij" * 10 + "!"},  # same after the cut
        {"prompt": "q", "chosen": "a", "rejected": "b"},
    ]
    path = jsonl(tmp_path / "long.jsonl", rows)
    ds = dataset(path, seq_len=48)
    first, last = take(ds, 2)
    assert ds.truncated == 1 and ds.dropped == 1
    for side, answer in ((first.chosen, "fifty-five|"), (first.rejected, "fifty|")):
        assert len(side["tokens"]) <= 48 and targets(side) == answer
        assert side["tokens"][0] == TOK.bos_id
    assert first.chosen["tokens"][: -len("fifty-five") - 1] == first.rejected["tokens"][: -len("fifty") - 1]
    assert targets(last.chosen) == "a|"
    ds = dataset(path, seq_len=48, on_long_pair="drop")
    assert targets(take(ds, 1)[0].chosen) == "a|" and ds.dropped == 2 and ds.truncated == 0


def test_dp_ranks_split_rows_and_resume_exactly(tmp_path):
    rows = [{"prompt": f"q{i}", "chosen": f"a{i}", "rejected": f"b{i}"} for i in range(7)]
    path = jsonl(tmp_path / "p.jsonl", rows)
    rank_rows = [
        [row_number(Path(path), p.row) for p in take(dataset(path, dp_rank=r, dp_world=2), 5)] for r in range(2)
    ]
    assert rank_rows == [[0, 1, 2, 3, 0], [4, 5, 6, 4, 5]]  # each rank: half the bytes (a pair's row: its offset)
    ds = dataset(path)
    take(ds, 3)
    state = json.loads(json.dumps(ds.state_dict()))
    expected = take(ds, 6)
    resumed = dataset(path)
    resumed.load_state_dict(state)
    assert take(resumed, 6) == expected


def _pairs(n: int, seq_len: int = 64) -> list[PreferencePair]:
    """Pairs of varied lengths built straight from token ids (prompt 3-8 tokens, responses 1-9)."""
    g = torch.Generator().manual_seed(0)
    pairs = []
    for k in range(n):
        lengths = torch.randint(1, 10, (3,), generator=g).tolist()
        prompt = torch.randint(1, 200, (lengths[0] // 2 + 3,), generator=g).tolist()
        sides = [torch.randint(1, 200, (m,), generator=g).tolist() for m in lengths[1:]]
        chosen, rejected = ((s, [True] * len(s)) for s in sides)
        pairs.append(PreferencePair(pair_sample(prompt, chosen), pair_sample(prompt, rejected), 0, k))
    return pairs


class _ListStream:
    """A resumable in-memory pair stream (the loader's contract, without files)."""

    def __init__(self, pairs: list[PreferencePair]) -> None:
        self.pairs, self.next = pairs, 0

    def __iter__(self):
        while self.next < len(self.pairs):
            self.next += 1
            yield self.pairs[self.next - 1]

    def state_dict(self) -> dict[str, Any]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next = state["next"]


def _responses(batch: dict, slots: int) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(pair slot, side) -> that response's (token, label) pairs in order, found through response_ids."""
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for r, (row_tokens, row_labels, row_ids) in enumerate(zip(batch["input"], batch["label"], batch["response_ids"])):
        for t, label, rid in zip(row_tokens.tolist(), row_labels.tolist(), row_ids.tolist()):
            if rid >= 0:
                out.setdefault((r // 2 * slots + rid // 2, rid % 2), []).append((t, label))
    return out


def _learned(sample: dict) -> list[tuple[int, int]]:
    return [(t, label) for t, label in zip(sample["tokens"], sample["labels"]) if label != IGNORE_INDEX]


def test_padded_batch_puts_each_pair_in_a_row_pair():
    pairs = _pairs(3)
    loader = PreferenceBatchLoader(_ListStream(pairs), 4, 32, TOK.pad_id, packing=False)
    batch, placements = loader.next_placed()
    assert batch["input"].shape == (8, 32)  # 4 row pairs; the stream ends after 3 pairs: the last is padding
    assert [(g, m) for _, g, m in placements] == [(0, 0), (1, 0), (2, 0)]
    for j, pair in enumerate(pairs):
        for row, side in ((2 * j, pair.chosen), (2 * j + 1, pair.rejected)):
            n = len(side["tokens"])
            assert batch["input"][row, :n].tolist() == side["tokens"]
            assert batch["label"][row].tolist() == side["labels"] + [IGNORE_INDEX] * (32 - n)
            ids, side_id = batch["response_ids"][row], row % 2
            assert ((ids == side_id) == (batch["label"][row] != IGNORE_INDEX)).all() and (
                ids[ids != side_id] == -1
            ).all()
    assert (batch["response_ids"][6:] == -1).all() and (batch["label"][6:] == IGNORE_INDEX).all()
    assert batch["pairs_per_row"].tolist() == [1, 0, 1, 0, 1, 0, 0, 0]
    assert "reference_logps" not in batch


def test_packed_batches_hold_whole_pairs_in_row_pairs_with_per_sequence_documents():
    pairs = _pairs(40)
    loader = PreferenceBatchLoader(_ListStream(pairs), 2, 48, TOK.pad_id, packing=True)
    assert loader.slots == 24
    seen = 0
    for batch in loader:
        n = int(batch["pairs_per_row"].sum())
        assert batch["input"].shape == (4, 48) and n >= 2  # a row pair always takes one more pair
        responses = _responses(batch, loader.slots)
        expected = [(_learned(p.chosen), _learned(p.rejected)) for p in pairs[seen : seen + n]]
        found = sorted((slot, side) for slot, side in responses)
        assert len(found) == 2 * n
        got = [(responses[(slot, 0)], responses[(slot, 1)]) for slot in sorted({slot for slot, _ in found})]
        assert sorted(got) == sorted(expected)  # every pair whole, each once, its sides paired in one row pair
        for row in range(4):  # positions restart per document: each sequence starts at 0
            docs, pos = batch["document_ids"][row], batch["positions"][row]
            starts = torch.cat([torch.tensor([True]), docs[1:] != docs[:-1]])
            assert (pos[starts] == 0).all()
        seen += n
    assert seen == 40
    padded_batches = -(-40 // 2)
    assert sum(1 for _ in PreferenceBatchLoader(_ListStream(pairs), 2, 48, TOK.pad_id, packing=True)) < padded_batches


@pytest.mark.parametrize("packing", [False, True])
def test_shared_prompt_batches_hold_each_pair_in_one_row_learning_what_its_sequences_learn(packing):
    """A row per pair (or several, packed): through ``label_sources`` every label is learned from the very token
    that predicts it in the pair's own sequence, so each response's (token, label) list equals the sequence's."""
    pairs, seq_len = _pairs(40), 48
    loader = PreferenceBatchLoader(_ListStream(pairs), 2, seq_len, TOK.pad_id, packing=packing, shared=True)
    assert loader.slots == (2 * seq_len // 3 if packing else 1)
    seen = 0
    for batch in loader:
        n = int(batch["pairs_per_row"].sum())
        assert batch["input"].shape == (2, 2 * seq_len) and (n >= 2 if packing else n == 2)
        assert batch["positions"].max() < seq_len  # (the model's positions), padding included
        responses: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for r in range(2):
            tokens, labels, sources, ids = (
                batch[k][r].tolist() for k in ("input", "label", "label_sources", "response_ids")
            )
            for label, source, rid in zip(labels, sources, ids):
                if rid >= 0:
                    responses.setdefault((r * loader.slots + rid // 2, rid % 2), []).append((tokens[source], label))
        got = sorted((responses[(slot, 0)], responses[(slot, 1)]) for slot in {slot for slot, _ in responses})
        assert got == sorted((_learned(p.chosen), _learned(p.rejected)) for p in pairs[seen : seen + n])
        seen += n
    assert seen == 40


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_batches_resume_identically(tmp_path, packing, shared):
    rows = [{"prompt": f"question {i}" * (1 + i % 3), "chosen": f"a{i}", "rejected": "no" * (i % 4)} for i in range(9)]
    path = jsonl(tmp_path / "p.jsonl", rows)

    def loader() -> PreferenceBatchLoader:
        return PreferenceBatchLoader(dataset(path, seq_len=96), 2, 96, TOK.pad_id, packing=packing, shared=shared)

    first = loader()
    take(first, 3)
    state = json.loads(json.dumps(first.state_dict()))
    expected = take(first, 5)
    resumed = loader()
    resumed.load_state_dict(state)
    for a, b in zip(take(resumed, 5), expected):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_concatenated_forward_equals_separate_forwards():
    """Per-response log-probs of one chosen+rejected batch (padded or packed) = each sequence run alone (fp32)."""
    from titanium.models import build_model_args, get_model_spec
    from titanium.objectives.dpo import response_sums, token_logps

    seq_len, pairs = 48, _pairs(6)
    spec = get_model_spec("llama3")
    torch.manual_seed(0)
    model = spec.model_cls(build_model_args(spec, "debugmodel", vocab_size=TOK.vocab_size, max_seq_len=seq_len))
    model.init_weights()

    def together(packing: bool) -> torch.Tensor:
        loader = PreferenceBatchLoader(_ListStream(pairs), 6, seq_len, TOK.pad_id, packing)
        batch, placements = loader.next_placed()
        assert batch["input"].shape[0] == 12 and len(placements) == 6
        logits = model(batch["input"], positions=batch["positions"], document_ids=batch["document_ids"])
        sums = response_sums(token_logps(logits, batch["label"]), batch["response_ids"], loader.slots)
        slots = [g * loader.slots + m for _, g, m in placements]
        return torch.cat([sums[slots, 0], sums[slots, 1]])

    def alone(side: dict) -> torch.Tensor:
        """Sum of log_softmax at each label, the sequence forwarded by itself, unpadded."""
        log_probs = torch.log_softmax(model(torch.tensor([side["tokens"]])).float(), dim=-1)[0]
        return sum(log_probs[i, t] for i, t in enumerate(side["labels"]) if t != IGNORE_INDEX)

    with torch.no_grad():
        expected = torch.stack([alone(p.chosen) for p in pairs] + [alone(p.rejected) for p in pairs])
        torch.testing.assert_close(together(packing=False), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(together(packing=True), expected, rtol=1e-5, atol=1e-5)


def test_bundled_preference_pairs_are_the_scripts_output_and_held_out(tmp_path):
    script = [sys.executable, "scripts/make_preference_data.py", "--out", str(tmp_path)]
    subprocess.run(script, cwd=REPO, check=True, capture_output=True)
    folder = REPO / "assets/tasks/arithmetic"
    for split in ("train", "test"):
        shipped = (folder / f"preference_{split}.jsonl").read_bytes()
        assert (tmp_path / f"preference_{split}.jsonl").read_bytes() == shipped, "run scripts/make_preference_data.py"
    train = [json.loads(line) for line in (folder / "preference_train.jsonl").read_text().splitlines()]
    test = [json.loads(line) for line in (folder / "preference_test.jsonl").read_text().splitlines()]
    assert (len(train), len(test)) == (15000, 500)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    answers = {json.loads(line)["messages"][0]["content"]: json.loads(line)["answer"] for line in
               (folder / "test.jsonl").read_text().splitlines()}  # fmt: skip
    assert all(r["chosen"] == answers[r["prompt"]] != r["rejected"] for r in test)


def test_preference_config_checks():
    cfg = JobConfig()
    cfg.data.kind, cfg.data.path = "preference", "assets/tasks/arithmetic/preference_train.jsonl"
    cfg.dpo.beta, cfg.dpo.sigmoid.label_smoothing, cfg.dpo.rpo_alpha = 0.0, 0.5, -1.0
    problems = list(validate(cfg))
    assert problems == [
        "--training.objective pretrain reads text windows: --data.kind text or synthetic, not preference (read by "
        "dpo, reward)"
    ]  # ([dpo] is checked in a job that reads it)
    cfg.training.objective = "dpo"
    problems = list(validate(cfg))
    assert "--dpo.beta must be > 0, got 0.0" in problems
    assert "--dpo.sigmoid.label_smoothing must be in [0, 0.5), got 0.5" in problems
    assert "--dpo.rpo_alpha must be >= 0 (0 turns the NLL term off), got -1.0" in problems
    cfg = JobConfig()
    cfg.training.objective, cfg.data.kind = "dpo", "preference"
    cfg.dpo.loss_type, cfg.dpo.sigmoid.label_smoothing = "ipo", 0.1
    expected = (
        "--dpo.sigmoid.label_smoothing is read by --dpo.loss_type sigmoid only, and this job's loss is ipo: leave it "
        "out (or set --dpo.loss_type sigmoid)"
    )
    assert list(validate(cfg)) == [expected]


def test_a_pass_with_every_pair_dropped_says_why(tmp_path):
    """Every pair too long with on_long_pair drop (and one bad row): the error counts each cause and names the
    options to change, not only the bad rows."""
    long = {"prompt": "q" * 80, "chosen": "a", "rejected": "b"}
    path = jsonl(tmp_path / "long.jsonl", [long, long, {"prompt": "q"}, long])
    with pytest.raises(DataError) as error:
        take(dataset(path, seq_len=32, on_long_pair="drop"), 1)
    message = str(error.value)
    assert "nothing to train on (1 bad rows skipped: check the file's columns" in message
    assert "3 pairs longer than --training.seq_len 32 dropped: raise it, or set --dpo.on_long_pair truncate" in message
    mixed = jsonl(tmp_path / "ok.jsonl", [long, {"prompt": "q", "chosen": "a", "rejected": "b"}])
    ds = dataset(mixed, seq_len=32, on_long_pair="drop")
    take(ds, 1)
    restored = dataset(mixed, seq_len=32)
    restored.load_state_dict(ds.state_dict())
    assert (restored.dropped, restored.long_dropped) == (1, 1)
