"""The KTO objective in one process: its loss, metrics and gradients on real models against TRL 1.16's KTOTrainer
on the same two models and the same batch (fp32, 1e-6 relative); TRL's unpaired rows, string and conversational,
read into the same tokens as a preference pair's side; bad labels skipped and counted with their row; the
mismatched rows; bad configs (exit-2 messages)."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import REPO, LocalModels
from tests.objectives.tiny_hf import tiny_llama, word_tokenizer
from titanium.config import JobConfig
from titanium.config.loader import ConfigError
from titanium.config.sections import DataSection, KTOSection
from titanium.config.validate import validate
from titanium.data.chat import build_chat_template
from titanium.data.preference import PreferenceDataset
from titanium.data.text import DataError
from titanium.data.tokenizer import TiktokenTokenizer
from titanium.data.unpaired import UnpairedDataset, UnpairedExample, mismatched, unpaired_batch
from titanium.objectives.base import ModelOutput, ObjectiveContext
from titanium.objectives.kto import KTOObjective, kto_microbatch

TOKENIZER = TiktokenTokenizer(str(REPO / "assets/tokenizer/titanium_debug.tiktoken"))
DATA = DataSection(kind="unpaired", path=str(REPO / "assets/tasks/arithmetic/unpaired_test.jsonl"))
TOL = {"rtol": 1e-6, "atol": 1e-6}


class Logits(torch.nn.Module):
    """A Hugging Face causal LM answering titanium's forward (``tokens``) with its logits."""

    def __init__(self, hf: torch.nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, tokens: torch.Tensor, **_: Any) -> torch.Tensor:
        return self.hf(input_ids=tokens).logits.float()


def objective(cfg: KTOSection, policy: torch.nn.Module, reference: torch.nn.Module, batch: int) -> KTOObjective:
    ctx = ObjectiveContext(
        tokenizer=TOKENIZER,
        model_name="llama3",
        chat_format="llama3",
        vocab_size=TOKENIZER.vocab_size,
        seq_len=32,
        local_batch_size=batch,
        dp_rank=0,
        dp_world=1,
        seed=0,
        models=LocalModels(reference=lambda: reference, policy=policy),
    )
    return KTOObjective(ctx, DATA, cfg)


# Prompts and completions as word-tokenizer ids (t5..t47), of varied lengths; the labels mix both kinds.
PROMPTS = [[1, 5, 6], [1, 7], [1, 8, 9, 10], [1, 11, 12], [1, 13], [1, 14, 15]]
COMPLETIONS = [[20, 21, 2], [22, 2], [23, 24, 25, 2], [26, 2], [27, 28, 2], [29, 30, 31, 32, 2]]

# (labels, TRL options = [kto] keys, policy and reference seeds): with policy 1 / reference 0 the mismatched
# pairs' mean log-ratio is +0.21 (z0 > 0), with 0 / 1 it is -0.21 (clamped to 0).
KTO_CASES = {
    "trl_defaults": ([True, False, True, True, False, False], {}, (1, 0)),
    "weighted": ([True, False, False, False, True, False], {"beta": 0.5, "desirable_weight": 1.33}, (1, 0)),
    "negative_kl_clamped": ([True, False, True, False, True, True], {}, (0, 1)),
    "only_desirable": ([True] * 6, {"beta": 2.0, "undesirable_weight": 0.7}, (1, 0)),
    "apo_zero_unpaired": (
        [True, False, True, False, False, True],
        {"loss_type": "apo_zero_unpaired", "beta": 0.3},
        (1, 0),
    ),
}


def examples(labels: list[bool]) -> list[UnpairedExample]:
    return [
        UnpairedExample(p, (c, [True] * len(c)), label, 0, i)
        for i, (p, c, label) in enumerate(zip(PROMPTS, COMPLETIONS, labels))
    ]


def trl_rows(prefix: str, prompts: list[list[int]], completions: list[list[int]]) -> dict[str, torch.Tensor]:
    """TRL's collated rows: prompt + completion right-padded with 0, completion_mask on the completion."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    ids, attention, completion = [], [], []
    for p, c in zip(prompts, completions):
        pad = width - len(p) - len(c)
        ids.append(p + c + [0] * pad)
        attention.append([1] * (len(p) + len(c)) + [0] * pad)
        completion.append([0] * len(p) + [1] * len(c) + [0] * pad)
    names = ("input_ids", "attention_mask", "completion_mask")
    return {prefix + k: torch.tensor(v) for k, v in zip(names, (ids, attention, completion))}


def trl_step(
    labels: list[bool], options: dict, seeds: tuple[int, int]
) -> tuple[torch.Tensor, dict[str, float], dict[str, torch.Tensor]]:
    """TRL's KTOTrainer loss on the batch (its own forward of both models), its metrics and the gradients."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    data = Dataset.from_dict({"prompt": ["t5 ", "t6 "], "completion": ["t7", "t8"], "label": [True, False]})
    args = KTOConfig(
        output_dir=tempfile.mkdtemp(),
        report_to=[],
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=len(labels),
        **options,
    )
    trainer = KTOTrainer(
        model=tiny_llama(seeds[0]),
        ref_model=tiny_llama(seeds[1]),
        args=args,
        train_dataset=data,
        processing_class=word_tokenizer(),
    )
    model = trainer.model
    model.train()
    model.zero_grad()
    rotated = [COMPLETIONS[-1], *COMPLETIONS[:-1]]  # TRL's KL completions: [y_n] + y[:-1]
    inputs = {
        **trl_rows("", PROMPTS, COMPLETIONS),
        **trl_rows("KL_", PROMPTS, rotated),
        "label": torch.tensor(labels),
    }
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return loss.detach(), metrics, {n: p.grad.clone() for n, p in model.named_parameters()}


def titanium_step(
    labels: list[bool], cfg: KTOSection, seeds: tuple[int, int]
) -> tuple[torch.Tensor, dict[str, float], dict]:
    policy, reference = Logits(tiny_llama(seeds[0])), Logits(tiny_llama(seeds[1]))
    obj = objective(cfg, policy, reference, len(labels))
    rows = unpaired_batch(examples(labels), 32, 0, "longest")
    (batch,) = obj.prepare([kto_microbatch(rows)]).batches
    out = obj.loss(ModelOutput(logits=policy(batch.tokens)), batch)
    units = batch.units()
    loss = out.loss_sum / units
    loss.backward()
    metrics = {name: (value / count).item() for name, (value, count) in out.metrics.items() if count > 0}
    return loss.detach(), metrics, {n: p.grad.clone() for n, p in policy.hf.named_parameters()}


@pytest.mark.parametrize("case", KTO_CASES)
def test_kto_objective_equals_trl_kto_trainer_on_the_same_models_and_batch(case):
    pytest.importorskip("trl", reason="pip install 'trl>=1.16,<2' (in the dev extra) to compare with TRL")
    labels, options, seeds = KTO_CASES[case]
    cfg = KTOSection(**options)
    loss, metrics, grads = titanium_step(labels, cfg, seeds)
    trl_loss, trl_metrics, trl_grads = trl_step(labels, options, seeds)

    torch.testing.assert_close(loss, trl_loss, **TOL)
    assert set(grads) == set(trl_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, trl_grads[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")
    assert max(g.abs().max() for g in grads.values()) > 1e-4  # a real gradient, not a vacuous match
    names = {
        "kto/reward_chosen": "rewards/chosen",
        "kto/reward_rejected": "rewards/rejected",
        "kto/logp_chosen": "logps/chosen",
        "kto/logp_rejected": "logps/rejected",
        "kto/kl": "kl",
    }
    for ours, theirs in names.items():
        assert (ours in metrics) == (theirs in trl_metrics), ours
        if ours in metrics:
            assert metrics[ours] == pytest.approx(trl_metrics[theirs], rel=1e-5, abs=1e-6), ours
    if cfg.loss_type == "kto":  # z0 > 0 (it moves the loss) or clamped, as the seeds say
        assert (trl_metrics["kl"] > 0.1) == (seeds == (1, 0))


def test_mismatched_rows_pair_each_prompt_with_the_previous_completion_and_keep_their_start():
    ex = examples([True] * 3)
    samples = mismatched(ex, seq_len=6)
    assert samples[0]["tokens"] == PROMPTS[0] + COMPLETIONS[2][:3]  # 3 + 4 > 6: the completion's end is cut
    assert samples[1]["tokens"] == PROMPTS[1] + COMPLETIONS[0]
    assert samples[2]["tokens"] == PROMPTS[2] + COMPLETIONS[1]
    rows = unpaired_batch(ex, 8, 0, "seq_len")
    assert rows["input"].shape == rows["kl_input"].shape == (3, 8)
    assert rows["desirable"].tolist() == [True] * 3


# ------------------------------------------------------------------------------------------------- data


def write(tmp_path: Path, rows: list[Any]) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def read(path: str, n: int, **data: Any) -> tuple[UnpairedDataset, list[UnpairedExample]]:
    template = build_chat_template("llama3", TOKENIZER, "llama3")
    ds = UnpairedDataset(DataSection(kind="unpaired", path=path, **data), template, 64, TOKENIZER.bos_id)
    stream = iter(ds)
    return ds, [next(stream) for _ in range(n)]


def test_string_and_conversational_rows_tokenize_as_a_preference_pair_side(tmp_path):
    rows = [
        {"prompt": "Which is larger: 4 or 7?", "completion": "7", "label": True},
        {
            "prompt": [{"role": "user", "content": "Which is larger: 4 or 7?"}],
            "completion": [{"role": "assistant", "content": "4"}],
            "label": False,
        },
    ]
    _, (a, b) = read(write(tmp_path, rows), 2)
    assert (a.desirable, b.desirable) == (True, False)
    pair_path = tmp_path / "pair.jsonl"
    pair_path.write_text(json.dumps({"prompt": "Which is larger: 4 or 7?", "chosen": "7", "rejected": "4"}) + "\n")
    template = build_chat_template("llama3", TOKENIZER, "llama3")
    pair = next(iter(PreferenceDataset(DataSection(kind="preference", path=str(pair_path)), template, 64, 1)))
    for example, side in ((a, pair.chosen), (b, pair.rejected)):
        assert example.prompt + example.completion[0] == side["tokens"]


def test_missing_or_invalid_labels_are_skipped_and_counted_with_their_row(tmp_path, caplog):
    good = {"prompt": "What number comes after 4?", "completion": "5", "label": True}
    rows = [
        good,
        {"prompt": "What number comes after 5?", "completion": "6"},
        {**good, "label": "yes"},
        {**good, "label": None},
        {**good, "label": 1},
        {**good, "label": False},
    ]
    path = write(tmp_path, rows)
    with caplog.at_level(logging.WARNING):
        ds, examples_read = read(path, 2)
    assert [e.desirable for e in examples_read] == [True, False] and ds.bad_rows == 4
    log = caplog.text  # (rows are numbered from 0, as every titanium data message numbers them)
    assert f"{path}: row 1: no 'label' column" in log
    assert f"{path}: row 2: 'label' is str 'yes', not true or false" in log
    assert f"{path}: row 3: 'label' is null" in log
    assert f"{path}: row 4: 'label' is int 1" in log


def test_a_bad_label_stops_the_run_with_on_bad_row_fail(tmp_path):
    path = write(tmp_path, [{"prompt": "p", "completion": "c", "label": "no"}])
    with pytest.raises(DataError, match=r"rows.jsonl: row 0") as error:
        read(path, 1, on_bad_row="fail")
    assert "'label' is str 'no'" in str(error.value) and "--data.label_column" in str(error.value)


# ----------------------------------------------------------------------------------------------- config


def messages(**sections: dict[str, Any]) -> list[str]:
    cfg = JobConfig()
    cfg.data.path = DATA.path
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    return list(validate(cfg))


def test_config_checks_name_the_key_and_the_fix():
    kto = {"objective": "kto", "local_batch_size": 4}
    assert not messages(training=kto, data={"kind": "unpaired"})
    assert messages(training=kto, data={"kind": "preference"})[0] == (
        "--training.objective kto needs completions labelled true/false: --data.kind unpaired, not preference"
    )
    (other,) = messages(data={"kind": "unpaired"})
    assert other == "--data.kind unpaired (labelled completions) needs --training.objective kto, not pretrain"
    (one,) = messages(training={**kto, "local_batch_size": 1}, data={"kind": "unpaired"})
    assert "--training.local_batch_size 1" in one and "at least 2" in one
    assert not messages(
        training={**kto, "local_batch_size": 1}, data={"kind": "unpaired"}, kto={"loss_type": "apo_zero_unpaired"}
    )
    bad = messages(training=kto, data={"kind": "unpaired"}, kto={"beta": 0.0, "undesirable_weight": -1.0})
    assert any("--kto.beta must be > 0" in m for m in bad) and any("--kto.undesirable_weight" in m for m in bad)
    assert not messages(training=kto, data={"kind": "unpaired"}, parallelism={"context_parallel_degree": 2})


def test_kto_without_a_reference_model_is_a_config_error():
    ctx = ObjectiveContext(TOKENIZER, "llama3", "llama3", TOKENIZER.vocab_size, 32, 2, 0, 1, 0, models=None)
    with pytest.raises(ConfigError, match="needs a frozen reference model"):
        KTOObjective(ctx, DATA, KTOSection())
