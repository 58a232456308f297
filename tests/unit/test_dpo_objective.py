"""The DPO objective in one process: loss and metrics against each sequence run alone, padded and packed
microbatches alike, for every loss type (reference-free ones build no reference); cached reference log-probs
equal online ones; what the cache is keyed by; bad loss settings; row widths under each layout."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers import REPO, LocalModels
from titanium.batch import Batch
from titanium.config import JobConfig
from titanium.config.dpo_losses import RobustKnobs, SimPOKnobs
from titanium.config.sections import ChatSection, DataSection, DPOSection
from titanium.config.validate import validate
from titanium.data.chat import build_chat_template
from titanium.data.preference import PreferenceDataset, PreferencePair
from titanium.data.sft import IGNORE_INDEX
from titanium.data.text import DataError
from titanium.data.tokenizer import ByteTokenizer, TiktokenTokenizer
from titanium.model_builder import WeightSource
from titanium.models import build_model_args, get_model_spec
from titanium.objectives.base import ModelOutput, ObjectiveContext
from titanium.objectives.dpo import (
    METRICS,
    DPOObjective,
    PreferenceFields,
    policy_projection,
    projected_logps,
    response_sums,
    token_logps,
)
from titanium.objectives.dpo_reference import ReferenceCache
from titanium.objectives.losses.preference import bco_pair_loss, orpo_loss, robust_dpo_loss, simpo_loss, token_mean_nll
from titanium.parallel.dims import ParallelDims
from titanium.tools import eval_preference

TOKENIZER = TiktokenTokenizer(str(REPO / "assets/tokenizer/titanium_debug.tiktoken"))
SEQ_LEN = 64
PAIRS = 4  # per microbatch


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    """The cache agrees on hit or miss and gathers results over the default group: one process here."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


def debug_model(seed: int) -> torch.nn.Module:
    spec = get_model_spec("llama3")
    model = spec.model_cls(build_model_args(spec, "debugmodel", vocab_size=TOKENIZER.vocab_size, max_seq_len=SEQ_LEN))
    model.init_weights(seed=seed)
    return model.eval()


POLICY, REFERENCE = debug_model(0), debug_model(1)


def frozen(model: torch.nn.Module):
    """What the loop's frozen model does: the model's logits for a microbatch, without gradients."""

    @torch.no_grad()
    def run(batch: Batch) -> torch.Tensor:
        return model(**batch.model_inputs())

    return run


def policy_output(obj: DPOObjective, batch: Batch, model: torch.nn.Module = POLICY) -> ModelOutput:
    """What the loop hands the loss (titanium/executors/plain.py): the final hidden states and the output layer."""
    assert obj.loss_input == "hidden"
    return ModelOutput(hidden=model(**batch.model_inputs(), project=False), projection=model.output)


def never_built():
    raise AssertionError("the reference model must not be built when the cache has the log-probs")


def local_models(reference=lambda: REFERENCE, identity: str = "reference A") -> LocalModels:
    return LocalModels(reference, identity=identity)


@pytest.fixture
def pairs_file(tmp_path: Path) -> Path:
    lines = (REPO / "assets/tasks/arithmetic/preference_train.jsonl").read_text().splitlines(keepends=True)
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(lines[:24]))
    return path


def objective(tmp_path: Path, path: Path, cfg: DPOSection, models=None, **ctx) -> DPOObjective:
    context = dict(
        tokenizer=TOKENIZER,
        model_name="llama3",
        chat_format="llama3",
        vocab_size=TOKENIZER.vocab_size,
        seq_len=SEQ_LEN,
        local_batch_size=PAIRS,
        dp_rank=0,
        dp_world=1,
        seed=0,
        models=models or local_models(),
        chat=ChatSection("llama3"),
        dump_folder=str(tmp_path / "run"),
    )
    context.update(ctx)
    data = DataSection(kind="preference", path=str(path))
    return DPOObjective(ObjectiveContext(**context), data, cfg)


def alone_logp(model: torch.nn.Module, sample: dict) -> torch.Tensor:
    """Summed log-prob of a sample's labels, the sequence run by itself, unpadded."""
    log_probs = F.log_softmax(model(torch.tensor([sample["tokens"]])).float(), dim=-1)[0]
    return sum(log_probs[i, t] for i, t in enumerate(sample["labels"]) if t != IGNORE_INDEX)


def first_pairs(path: Path, n: int) -> list[PreferencePair]:
    template = build_chat_template("llama3", TOKENIZER, "llama3")
    it = iter(PreferenceDataset(DataSection(kind="preference", path=str(path)), template, SEQ_LEN, TOKENIZER.bos_id))
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("packing", [False, True])
@torch.no_grad()
def test_loss_and_metrics_equal_each_sequence_run_alone(tmp_path, pairs_file, packing):
    beta = 0.5
    obj = objective(tmp_path, pairs_file, DPOSection(beta=beta, packing=packing))
    [batch] = obj.prepare([obj.next_microbatch()]).batches
    n = int(batch.units())
    assert n == PAIRS if not packing else n > PAIRS  # packed row pairs hold more pairs
    result = obj.loss(policy_output(obj, batch), batch)

    losses, metrics = [], {name: [] for name in METRICS}
    for pair in first_pairs(pairs_file, n):
        pc, pr = alone_logp(POLICY, pair.chosen), alone_logp(POLICY, pair.rejected)
        rc, rr = alone_logp(REFERENCE, pair.chosen), alone_logp(REFERENCE, pair.rejected)
        chosen, rejected = beta * (pc - rc), beta * (pr - rr)
        losses.append(-F.logsigmoid(chosen - rejected))
        for name, value in zip(METRICS, (chosen, rejected, chosen - rejected, float(chosen > rejected), pc, pr)):
            metrics[name].append(value)
    torch.testing.assert_close(result.loss_sum, torch.stack(losses).sum(), rtol=1e-5, atol=1e-5)
    assert result.metrics.keys() == {f"dpo/{name}" for name in METRICS} == set(obj.metric_names)
    for name in METRICS:
        total, count = result.metrics[f"dpo/{name}"]
        assert int(count) == n
        expected = torch.tensor([float(v) for v in metrics[name]]).sum()
        torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-4, msg=name)


def reference_sums(obj: DPOObjective, batch: Batch[PreferenceFields]) -> torch.Tensor:
    """The reference's (chosen, rejected) sums of every pair slot: cached, or from ``obj``'s online reference."""
    fields = obj.prepare([batch]).batches[0].fields
    return response_sums(fields.reference_logps, fields.response_ids, obj.slots, obj.group)


@pytest.mark.parametrize("packing", [False, True])
def test_cached_reference_logps_equal_online_ones(tmp_path, pairs_file, packing):
    cfg = DPOSection(packing=packing, precompute_reference=True)
    cached = objective(tmp_path, pairs_file, cfg)
    online = objective(tmp_path, pairs_file, DPOSection(packing=packing))
    for _ in range(4):  # past the end of the 24 pairs: the second epoch reads the cache too
        a, b = cached.next_microbatch(), online.next_microbatch()
        same = [(a.tokens, b.tokens), (a.positions, b.positions), (a.fields.labels, b.fields.labels)]
        assert all(torch.equal(x, y) for x, y in same)  # the same rows
        assert b.fields.reference_logps is None and a.fields.reference_logps is not None  # cached: already there
        assert cached.prepare([a]).batches[0] is a and cached.reference is None  # nothing to run: the model is gone
        expected = reference_sums(online, b)
        torch.testing.assert_close(reference_sums(cached, a), expected, rtol=1e-5, atol=1e-5)
        assert (expected != 0).any()


def cache_files(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "run/reference_logps").glob("*.safetensors"))


def test_the_cache_is_read_back_and_keyed_by_what_the_values_depend_on(tmp_path, pairs_file):
    cfg = DPOSection(precompute_reference=True)
    next(objective(tmp_path, pairs_file, cfg).loader)
    [first] = cache_files(tmp_path)
    assert (tmp_path / "run/reference_logps" / first).with_suffix(".json").is_file()  # what the key hashed
    models = local_models(never_built)
    next(objective(tmp_path, pairs_file, cfg, models=models).loader)  # read, nothing built
    assert cache_files(tmp_path) == [first] and models.released == 1  # the handle was let go at once

    changes = [
        {"models": local_models(identity="reference B")},  # other weights, precision, ...
        {"seq_len": 48},
        {"chat": ChatSection("llama3", system_prompt="Be brief.")},
        {"tokenizer": ByteTokenizer()},
    ]
    for n, change in enumerate(changes, start=2):
        next(objective(tmp_path, pairs_file, cfg, **change).loader)
        assert len(cache_files(tmp_path)) == n, change
    count = len(cache_files(tmp_path))
    pairs_file.write_text(pairs_file.read_text().replace('"rejected":"', '"rejected":"0', 1))  # the content
    next(objective(tmp_path, pairs_file, cfg).loader)
    assert len(cache_files(tmp_path)) == count + 1


def test_a_pair_missing_from_the_cache_is_an_error_naming_it(tmp_path, pairs_file):
    pair = first_pairs(pairs_file, 1)[0]
    cache = ReferenceCache({}, tmp_path / "cache.safetensors")
    with pytest.raises(DataError, match=r"pairs.jsonl: row 0: this pair is not in the reference log-prob cache"):
        cache.lookup(pair, f"--data.path {pairs_file}: row 0")


def test_weight_fingerprint_changes_with_the_files(tmp_path):
    folder = tmp_path / "step-10"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"weights")
    source = WeightSource(dcp_folder=str(folder))
    before = source.fingerprint()
    assert before == source.fingerprint() and WeightSource().fingerprint() == ""
    (folder / "__0_0.distcp").write_bytes(b"weights!")
    assert source.fingerprint() != before
    stat = os.stat(folder / "__0_0.distcp")
    os.utime(folder / "__0_0.distcp", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert len({before, source.fingerprint()}) == 2


def test_dpo_needs_preference_data():
    cfg = JobConfig()
    cfg.training.objective, cfg.data.kind = "dpo", "text"  # (auto, the default, decides from the rows)
    assert list(validate(cfg))[0] == (
        "--training.objective dpo needs preference pairs: --data.kind preference, not text (read by pretrain, sft, "
        "grpo, online_dpo, kd, ppo)"
    )
    cfg.data.kind, cfg.training.loss_chunk_size = "preference", 1024
    assert any("--training.loss_chunk_size applies to token cross-entropy" in p for p in validate(cfg))


def test_eval_preference_refuses_a_folder_without_weights(tmp_path, capsys):
    code = eval_preference.main(
        [str(tmp_path), str(tmp_path), "--data", "assets/tasks/arithmetic/preference_test.jsonl"]
    )
    assert code == 2
    assert "neither a titanium checkpoint (step-N with .metadata) nor a Hugging Face folder" in capsys.readouterr().err


def test_eval_preference_reads_paths_from_where_the_user_stands(tmp_path, monkeypatch, capsys):
    """Run from a directory outside the repository: --data names a file as the user typed it (from the current
    directory), a bundled path (assets/..., and the job's default tokenizer and a train_configs/ file) is the
    repository's unless the user has a file of that name, and a path that names nothing is one message naming --data
    (exit 2)."""
    from tests.objectives.tiny_hf import debug_model_hf

    monkeypatch.chdir(tmp_path)
    debug_model_hf(tmp_path / "hf", scalar=False)  # (no tokenizer files: the job's default tokenizer is used)
    bundled = "assets/tasks/arithmetic/preference_test.jsonl"
    rows = (REPO / bundled).read_text().splitlines(keepends=True)
    Path("mine.jsonl").write_text("".join(rows[:3]))
    common = ["hf", "hf", "--device", "cpu", "--training.seq_len", "64", "--max-pairs", "5"]

    def pairs(*args: str) -> int:
        assert eval_preference.main([*common, *args]) == 0
        return json.loads(capsys.readouterr().out)["pairs"]

    assert pairs("--data", "mine.jsonl") == 3
    assert pairs("--data", bundled) == 5
    config = ("--job.config_file", "train_configs/debug_dpo.toml", "--checkpoint.initial_load_path", "")
    assert pairs("--data", "./mine.jsonl", *config) == 3
    Path(bundled).parent.mkdir(parents=True)
    Path(bundled).write_text(rows[0])
    assert pairs("--data", bundled) == 1  # (the user's own file of that name)
    assert eval_preference.main([*common, "--data", "nope.jsonl"]) == 2
    err = capsys.readouterr().err
    assert (
        err == "titanium.tools.eval_preference: error: --data nope.jsonl: no .json/.jsonl/.parquet/.txt files found\n"
    )


def alone_sequence_logp(model: torch.nn.Module, sample: dict) -> tuple[torch.Tensor, int]:
    """Summed log-prob of every token of a sequence after its first (prompt and response: ORPO's NLL) and their
    count, the sequence run by itself."""
    tokens = sample["tokens"]
    log_probs = F.log_softmax(model(torch.tensor([tokens])).float(), dim=-1)[0]
    return sum(log_probs[i, t] for i, t in enumerate(tokens[1:])), len(tokens) - 1


def labels_of(sample: dict) -> int:
    return sum(t != IGNORE_INDEX for t in sample["labels"])


# Each new loss type with non-default settings, and its pure function (titanium/objectives/losses/preference.py,
# equal to TRL's) on the per-sequence log-probs: (config, fn(pc, pr, rc, rr, lc, lr) -> per-pair losses, SFT
# term: None, "response" or "sequence", its weight).
LOSS_TYPES = {
    "robust": (
        DPOSection(loss_type="robust", beta=0.5, robust=RobustKnobs(label_smoothing=0.2)),
        lambda pc, pr, rc, rr, lc, lr: robust_dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.2),
        None,
    ),
    "bco_pair": (
        DPOSection(loss_type="bco_pair", beta=0.7),
        lambda pc, pr, rc, rr, lc, lr: bco_pair_loss(pc, pr, rc, rr, beta=0.7),
        None,
    ),
    "simpo": (
        DPOSection(loss_type="simpo", beta=2.0, simpo=SimPOKnobs(gamma=1.0, label_smoothing=0.1)),
        lambda pc, pr, rc, rr, lc, lr: simpo_loss(pc, pr, lc, lr, beta=2.0, gamma=1.0, label_smoothing=0.1),
        None,
    ),
    "cpo_simpo": (
        DPOSection(loss_type="simpo", simpo=SimPOKnobs(cpo_alpha=1.0)),
        lambda pc, pr, rc, rr, lc, lr: simpo_loss(pc, pr, lc, lr),
        "response",
    ),
    "orpo": (
        DPOSection(loss_type="orpo", beta=0.3),
        lambda pc, pr, rc, rr, lc, lr: orpo_loss(pc, pr, lc, lr, beta=0.3),
        "sequence",
    ),
}


@pytest.mark.parametrize(
    ("case", "packing"), [(case, False) for case in LOSS_TYPES] + [("simpo", True), ("orpo", True)]
)
@torch.no_grad()
def test_each_loss_type_equals_its_function_on_each_sequence_run_alone(tmp_path, pairs_file, case, packing):
    cfg, fn, sft = LOSS_TYPES[case]
    cfg = dataclasses.replace(cfg, packing=packing)
    reference_free = cfg.loss_type in ("simpo", "orpo")
    models = local_models(never_built if reference_free else lambda: REFERENCE)
    obj = objective(tmp_path, pairs_file, cfg, models=models)
    [batch] = obj.prepare([obj.next_microbatch()]).batches
    assert (obj.reference is None) == reference_free and (batch.fields.reference_logps is None) == reference_free
    result = obj.loss(policy_output(obj, batch), batch)

    n = int(batch.units())
    pairs = first_pairs(pairs_file, n)
    pc, pr, rc, rr = (
        torch.stack([alone_logp(model, getattr(pair, side)) for pair in pairs])
        for model, side in [(POLICY, "chosen"), (POLICY, "rejected"), (REFERENCE, "chosen"), (REFERENCE, "rejected")]
    )
    lc, lr = (
        torch.tensor([float(labels_of(getattr(pair, side))) for pair in pairs]) for side in ("chosen", "rejected")
    )
    expected = fn(pc, pr, rc, rr, lc, lr)
    total = expected.losses.sum()
    if sft == "response":
        total = total + cfg.simpo.cpo_alpha * token_mean_nll(pc, lc) * n
    elif sft == "sequence":
        logp, count = zip(*(alone_sequence_logp(POLICY, pair.chosen) for pair in pairs))
        total = total + token_mean_nll(torch.stack(logp), torch.tensor(count, dtype=torch.float)) * n
    torch.testing.assert_close(result.loss_sum, total, rtol=1e-5, atol=1e-5)
    assert set(result.metrics) == set(obj.metric_names)
    reward, count = result.metrics["dpo/reward_chosen"]
    assert int(count) == n
    torch.testing.assert_close(reward, expected.chosen_rewards.sum(), rtol=1e-5, atol=1e-5)
    for name, values in expected.extra.items():
        torch.testing.assert_close(result.metrics[f"dpo/{name}"][0], values.sum(), rtol=1e-5, atol=1e-5)
    assert ("dpo/nll_loss" in result.metrics) == (sft is not None)


def test_bad_loss_settings_are_refused_one_message_each():
    def problems(**dpo) -> list[str]:
        cfg = JobConfig()
        cfg.training.objective, cfg.data.kind = "dpo", "preference"
        for key, value in dpo.items():
            section, _, knob = key.rpartition("__")  # (simpo__gamma: [dpo.simpo] gamma)
            setattr(getattr(cfg.dpo, section) if section else cfg.dpo, knob, value)
        return list(validate(cfg))

    assert problems(loss_type="simpo", simpo__cpo_alpha=1.0, simpo__gamma=2.0, simpo__label_smoothing=0.2) == []
    assert problems(loss_type="orpo", precompute_reference=True) == [
        "--dpo.loss_type orpo needs no reference model: set --dpo.precompute_reference false"
    ]
    assert problems(loss_type="simpo", length_normalize=True) == [
        "--dpo.loss_type simpo always averages log-probs: set --dpo.length_normalize false"
    ]
    assert problems(simpo__cpo_alpha=1.0) == [
        "--dpo.simpo.cpo_alpha is read by --dpo.loss_type simpo only, and this job's loss is sigmoid: leave it out "
        "(or set --dpo.loss_type simpo)"
    ]
    assert problems(loss_type="simpo", simpo__cpo_alpha=-1.0) == [
        "--dpo.simpo.cpo_alpha must be >= 0 (0 turns the NLL term off), got -1.0"
    ]
    assert problems(loss_type="bco_pair", robust__label_smoothing=0.1) == [
        "--dpo.robust.label_smoothing is read by --dpo.loss_type robust only, and this job's loss is bco_pair: leave "
        "it out (or set --dpo.loss_type robust)"
    ]
    assert problems(loss_type="robust", robust__label_smoothing=0.5) == [
        "--dpo.robust.label_smoothing must be in [0, 0.5), got 0.5"
    ]
    assert problems(pad_multiple=0) == ["--dpo.pad_multiple must be >= 1 (8 suits tensor cores), got 0"]


def test_rows_are_trimmed_by_default_and_as_wide_as_the_layout_needs(tmp_path, pairs_file, caplog):
    def width(cfg: DPOSection, **ctx) -> int:
        return objective(tmp_path, pairs_file, cfg, **ctx).next_microbatch().tokens.shape[1]

    trimmed = width(DPOSection())  # auto: the longest row, in buckets of 8
    assert trimmed < SEQ_LEN and trimmed % 8 == 0
    assert width(DPOSection(pad_to="seq_len")) == 2 * SEQ_LEN  # a shared-prompt row holds a row pair's tokens
    assert width(DPOSection(pad_to="seq_len", share_prompt=False)) == SEQ_LEN
    assert width(DPOSection(), sequence_multiple=12) % 24 == 0  # lcm(pad_multiple 8, 2 x cp, cp x tp)
    assert width(DPOSection(), fixed_shapes=True) == SEQ_LEN and not caplog.records  # pipeline: auto says nothing
    assert width(DPOSection(pad_to="longest"), fixed_shapes=True) == SEQ_LEN
    assert "pipeline parallelism needs fixed shapes" in caplog.text
    dims = [ParallelDims(1, 1, 8, tp=2), ParallelDims(1, 1, 8, cp=2), ParallelDims(1, 1, 8, cp=2, tp=4)]
    assert [d.sequence_multiple for d in dims] == [2, 4, 8]


class PlainLinearSubclass(torch.nn.Linear):
    """An output layer that is not a plain ``nn.Linear`` (as LoRA, float8 or QAT make it): called as a module."""


def output_variant(model: torch.nn.Module, variant: str) -> torch.nn.Module:
    """A copy of ``model`` whose output layer is soft-capped (Gemma 2's final cap) or not a plain linear map."""
    model = __import__("copy").deepcopy(model)
    if variant == "softcap":
        model.args = dataclasses.replace(model.args, final_logit_softcap=3.0)
        model.output.logit_softcap = 3.0
    elif variant == "module":
        layer = PlainLinearSubclass(model.output.in_features, model.output.out_features, bias=False)
        layer.weight = model.output.weight
        model.output = layer
    return model


@pytest.mark.parametrize("variant", ["plain", "softcap", "module"])
@pytest.mark.parametrize("packing", [False, True])
def test_projecting_only_the_labels_equals_the_full_logits(tmp_path, pairs_file, variant, packing):
    """The normal path projects the hidden states at the responses' positions only (policy and reference): its
    loss, metrics, gradients and reference log-probs equal those from the whole ``[rows, seq, vocab]`` logits
    (the pipeline path, whose rows hold one sequence each) to 1e-6 relative (gradients: see assert_grads_close)."""
    policy, reference = output_variant(POLICY, variant).train(), output_variant(REFERENCE, variant)
    cfg = DPOSection(beta=0.5, packing=packing, share_prompt=False)
    obj = objective(tmp_path, pairs_file, cfg, models=local_models(lambda: reference))
    [batch] = obj.prepare([obj.next_microbatch()]).batches
    fields = batch.fields
    labelled = fields.labels != IGNORE_INDEX
    assert fields.label_index is not None and len(fields.label_index) == int(labelled.sum()) < labelled.numel() // 4
    with torch.no_grad():
        full_reference = token_logps(reference(**batch.model_inputs()), fields.labels)
    torch.testing.assert_close(fields.reference_logps, full_reference, rtol=1e-6, atol=1e-6)

    results, grads = [], []
    for output in (
        lambda: policy_output(obj, batch, policy),
        lambda: ModelOutput(logits=policy(**batch.model_inputs())),
    ):
        result = obj.loss(output(), batch)
        result.loss_sum.backward()
        results.append(result)
        grads.append({name: p.grad.clone() for name, p in policy.named_parameters()})
        policy.zero_grad(set_to_none=True)
    (gathered, full), (gathered_grads, full_grads) = results, grads
    torch.testing.assert_close(gathered.loss_sum, full.loss_sum, rtol=1e-6, atol=0)
    for name, (value, count) in full.metrics.items():
        torch.testing.assert_close(gathered.metrics[name][0], value, rtol=1e-6, atol=1e-6, msg=name)
        assert torch.equal(gathered.metrics[name][1], count)
    assert_grads_close(gathered_grads, full_grads, of_largest=1e-6)


def assert_grads_close(actual: dict, expected: dict, of_largest: float) -> None:
    """Gradients to 1e-5 relative plus ``of_largest`` times each parameter's largest gradient: other matmul shapes
    sum in another order, and torch 2.11's CPU kernels are a few ulps of the largest element off (measured)."""
    for name, grad in expected.items():
        atol = of_largest * float(grad.abs().max())
        torch.testing.assert_close(actual[name], grad, rtol=1e-5, atol=atol, msg=name)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize(("loss_type", "reference_kernel"), [("sigmoid", "sdpa"), ("sigmoid", "flex"), ("orpo", "")])
def test_shared_prompt_rows_equal_separate_rows(tmp_path, pairs_file, loss_type, reference_kernel):
    """The same pairs as shared-prompt rows (one a pair) and as separate rows (one a sequence): each response's
    policy and reference log-prob sums, the loss and its metrics agree to 1e-5 relative (fp32), the policy's
    gradients to 1e-5 relative plus 5e-6 of each parameter's largest gradient (torch 2.11 measured 1.2e-6). ORPO
    learns the chosen prompts too (prompt labels); the reference of the shared rows runs on FlexAttention in one
    case (CPU has its forward only, so the policy keeps SDPA)."""
    reference = __import__("copy").deepcopy(REFERENCE)
    reference.attention_backend = reference_kernel or "sdpa"
    sums, results, grads = [], [], []
    for shared in (True, False):
        models = local_models(lambda model=reference if shared else REFERENCE: model)
        obj = objective(tmp_path, pairs_file, DPOSection(beta=0.5, loss_type=loss_type, share_prompt=shared), models)
        [batch] = obj.prepare([obj.next_microbatch()]).batches
        fields = batch.fields
        assert batch.rows == PAIRS * (1 if shared else 2) and (fields.label_sources is not None) == shared
        policy = __import__("copy").deepcopy(POLICY).train()
        output = policy_output(obj, batch, policy)
        logps = projected_logps(*policy_projection(output), fields.learned(), fields.label_index, fields.source_index)
        per_token = [logps] + ([] if fields.reference_logps is None else [fields.reference_logps])
        sums.append(response_sums(torch.stack(per_token), fields.response_ids, obj.slots, obj.group))
        result = obj.loss(output, batch)
        result.loss_sum.backward()
        results.append(result)
        grads.append({name: p.grad for name, p in policy.named_parameters()})
    torch.testing.assert_close(sums[0], sums[1], rtol=1e-5, atol=1e-5)
    assert sums[0].shape == (1 + (loss_type != "orpo"), PAIRS, 2) and (sums[0] != 0).all()
    (shared_result, separate), (shared_grads, separate_grads) = results, grads
    torch.testing.assert_close(shared_result.loss_sum, separate.loss_sum, rtol=1e-5, atol=1e-6)
    for name, (value, count) in separate.metrics.items():
        torch.testing.assert_close(shared_result.metrics[name][0], value, rtol=1e-5, atol=1e-5, msg=name)
        assert torch.equal(shared_result.metrics[name][1], count)
    assert_grads_close(shared_grads, separate_grads, of_largest=5e-6)
