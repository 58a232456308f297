"""DPO training speed and memory beside TRL's DPOTrainer: same model, same pairs, same batches, equal loss.

    python benchmarks/dpo_speed.py                                   # the table, about 8 minutes on 2 shared cores
    python benchmarks/dpo_speed.py --batches 4 --repeats 1 --out ""  # a quick look, no file written

The model is the debug model's shape (llama3 ``debugmodel`` with the bundled tokenizer's vocabulary), made
with ``transformers`` (seeded ``LlamaForCausalLM``, saved as safetensors) and loaded into titanium through its
Hugging Face loader; the reference is a second such model of another seed, so the DPO loss is not the
trivial log 2 of a policy equal to its reference. The pairs are the first ``--batches x --pairs-per-batch``
of the bundled preference set, tokenized once by titanium (llama3 chat template, ``--seq-len``) and handed to
both sides as the same token ids: TRL gets them as ``prompt_ids``/``chosen_ids``/``rejected_ids`` through its
own ``DataCollatorForPreference`` (right padding to the batch's longest sequence), titanium through its
``PreferenceBatchLoader`` with the rows and widths the objective resolves from ``[dpo]``: one row per sequence
padded to seq_len (``pad_to="seq_len"``, ``share_prompt=false``), one row per sequence trimmed to the longest row
rounded up to a bucket (``pad_to="auto"``), and as configured by default (``share_prompt=true``: one row per
pair, its prompt once and both responses after it, trimmed the same way). Two more rows have the reference's
log-probs
precomputed on both sides (titanium ``precompute_reference``, TRL ``precompute_ref_log_probs``; the values
come from one titanium pass over the reference and go into both sides' batches), so no reference forward.

One step is what each library does per microbatch, on the same batch of pairs, without the optimizer step
(the same on both sides):

- titanium: ``DPOObjective.prepare`` (the reference forward and its token log-probs, as in training), the
  policy forward on the batch's ``model_inputs`` (to its final hidden states, as the loop runs it for the
  objective's ``loss_input``), ``DPOObjective.loss`` (the output projection at the labelled positions) and the
  backward of loss_sum / pairs;
- TRL: ``DPOTrainer.training_step`` (its ``compute_loss``: policy and reference forwards through TRL's fused
  log-prob head, the sigmoid loss; then the backward).

Both run fp32 on the CPU, beta 0.1, sigmoid loss, ``--threads`` torch threads (default 1: on a shared 2-core
machine two threads per process measure the machine's load more than the code). The batches are built
before the timing (collation is not timed on either side). Timing runs every variant in one process, batch
by batch in turn (the order reversed every other batch), after a warm-up pass; pairs/s is the pairs over the
median pass's seconds (a pass: every batch once), and the speed ratio is the median of the per-batch time
ratios against the row named. Peak memory comes from a separate process per variant that only sets up and
runs two passes: the kernel's peak resident set size (VmHWM, reset through /proc/self/clear_refs before the
steps) during the steps, and that peak minus the resident size just before them (what the steps themselves
hold; the imports differ: TRL's process carries transformers, accelerate, datasets and TRL). Loss equality:
every batch's loss against the TRL row named before anything is timed, and the gradients of the first batch
mapped to Hugging Face names by titanium's adapter.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]  # this checkout's titanium, then the shared helpers
from bench_common import command_line, device_name, python_path, write  # noqa: E402

from titanium.batch import Batch  # noqa: E402
from titanium.config.sections import ChatSection, DataSection, DPOSection  # noqa: E402
from titanium.data.preference import PreferencePair  # noqa: E402
from titanium.data.preference_batch import PreferenceBatchLoader  # noqa: E402
from titanium.data.sft import IGNORE_INDEX  # noqa: E402
from titanium.data.tokenizer import TiktokenTokenizer  # noqa: E402

TOKENIZER = REPO / "assets/tokenizer/titanium_debug.tiktoken"
PAIRS = REPO / "assets/tasks/arithmetic/preference_train.jsonl"
BETA = 0.1


@dataclasses.dataclass(frozen=True)
class Variant:
    library: str  # "titanium" or "trl"
    pad_to: str = "auto"  # --dpo.pad_to (auto, the default: the longest row; TRL always pads to the longest)
    cached: bool = False  # reference log-probs precomputed (titanium precompute_reference, TRL's
    # precompute_ref_log_probs): the step has no reference forward
    baseline: str = "TRL DPOTrainer"  # the row its ratio is taken against
    share_prompt: bool = True  # --dpo.share_prompt (the default): a pair's prompt once, both responses after it


VARIANTS = {
    "titanium, a row per sequence, padded to seq_len": Variant("titanium", "seq_len", share_prompt=False),
    "titanium, a row per sequence, trimmed to the longest": Variant("titanium", share_prompt=False),
    "titanium, default (a row per pair: shared prompt, trimmed)": Variant("titanium"),
    "TRL DPOTrainer": Variant("trl"),
    "titanium, default, reference cached": Variant("titanium", cached=True, baseline="TRL, reference precomputed"),
    "TRL, reference precomputed": Variant("trl", cached=True, baseline="TRL, reference precomputed"),
}

Step = Callable[[dict[str, Any]], torch.Tensor]
"""One training step on a prepared batch; returns the batch's mean loss (detached)."""


class ListStream:
    """A fixed list of pairs as the loader's pair stream."""

    def __init__(self, pairs: list[PreferencePair]) -> None:
        self.pairs = pairs

    def __iter__(self):
        return iter(self.pairs)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise AssertionError("not resumed")


# ------------------------------------------------------------------------------------------ the setup


def make_models(folder: Path) -> None:
    """Policy (seed 0) and reference (seed 1) Hugging Face checkpoints of the debug model's shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from titanium.models import build_model_args, get_model_spec

    spec = get_model_spec("llama3")
    vocab = TiktokenTokenizer(str(TOKENIZER)).vocab_size
    args = build_model_args(spec, "debugmodel", vocab_size=vocab)
    config = LlamaConfig(**spec.hf_adapter.to_hf_config(args))
    for name, seed in (("policy", 0), ("reference", 1)):
        torch.manual_seed(seed)
        LlamaForCausalLM(config).float().save_pretrained(folder / name)


def load_pairs(n: int, seq_len: int) -> list[PreferencePair]:
    """The first ``n`` pairs of the bundled preference set, as titanium tokenizes them for training."""
    from titanium.data.chat import build_chat_template
    from titanium.data.preference import PreferenceDataset

    tokenizer = TiktokenTokenizer(str(TOKENIZER))
    template = build_chat_template("llama3", tokenizer, "llama3")
    data = DataSection(kind="preference", path=str(PAIRS))
    stream = iter(PreferenceDataset(data, template, seq_len, tokenizer.bos_id))
    return [next(stream) for _ in range(n)]


def trl_example(pair: PreferencePair) -> dict[str, list[int]]:
    """The pair in TRL's tokenized form: the shared prompt and each response (all of whose tokens learn)."""
    out = {}
    for key, side in (("chosen_ids", pair.chosen), ("rejected_ids", pair.rejected)):
        labels = side["labels"]
        start = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX) + 1
        assert all(label != IGNORE_INDEX for label in labels[start - 1 : -1]) and labels[-1] == IGNORE_INDEX
        prompt = side["tokens"][:start]
        assert out.setdefault("prompt_ids", prompt) == prompt, "the two sides share the prompt"
        out[key] = side["tokens"][start:]
    return out


def with_reference(folder: Path, pairs: list[PreferencePair], args: argparse.Namespace) -> list[PreferencePair]:
    """The pairs carrying the reference's summed log-probs, as titanium's precompute pass caches them."""
    from titanium.model_builder import ModelBuilder
    from titanium.models import get_model_spec
    from titanium.objectives.dpo import response_sums, token_logps

    reference = ModelBuilder(torch.device("cpu")).load_hf(get_model_spec("llama3"), folder / "reference").model
    out = []
    for batch in PreferenceBatchLoader(ListStream(pairs), len(pairs), args.seq_len, 0, False, "longest"):
        with torch.no_grad():
            logits = reference(batch["input"], positions=batch["positions"], document_ids=batch["document_ids"])
        sums = response_sums(token_logps(logits, batch["label"]), batch["response_ids"], 1)
        out += [dataclasses.replace(pair, reference=tuple(sums[k].tolist())) for k, pair in enumerate(pairs)]
    return out


class FrozenReference:
    """The objective's model handles (``ctx.models``): the reference model as its frozen handle."""

    def __init__(self, reference: torch.nn.Module | None) -> None:
        self.reference, self.id = reference, "reference"

    def frozen(self, *, keep=(), source=None) -> FrozenReference:
        return self

    @torch.no_grad()
    def __call__(self, batch: Batch, **kwargs: Any) -> torch.Tensor:
        assert self.reference is not None
        return self.reference(**batch.model_inputs(), **kwargs)

    def hidden(self, batch: Batch) -> torch.Tensor:
        return self(batch, project=False)

    def projection(self) -> tuple[torch.Tensor, None]:
        assert self.reference is not None
        return self.reference.output.weight.detach(), None

    def release(self) -> None:
        self.reference = None


def titanium_side(folder: Path, pairs: list[PreferencePair], args: argparse.Namespace, variant: Variant):
    """(step, batches, policy, its HF gradients) for titanium's DPO objective."""
    from titanium.model_builder import ModelBuilder
    from titanium.models import get_model_spec
    from titanium.objectives.base import ModelOutput, ObjectiveContext
    from titanium.objectives.dpo import DPOObjective, pair_batch

    spec = get_model_spec("llama3")
    builder = ModelBuilder(torch.device("cpu"))
    built = builder.load_hf(spec, folder / "policy", max_seq_len=args.seq_len)
    policy = built.model.train()
    reference = None if variant.cached else builder.load_hf(spec, folder / "reference").model
    if reference is not None:
        for p in reference.parameters():
            p.requires_grad_(False)
    tokenizer = TiktokenTokenizer(str(TOKENIZER))
    ctx = ObjectiveContext(
        tokenizer=tokenizer,
        model_name="llama3",
        chat_format="llama3",
        vocab_size=tokenizer.vocab_size,
        seq_len=args.seq_len,
        local_batch_size=args.pairs_per_batch,
        dp_rank=0,
        dp_world=1,
        seed=0,
        models=FrozenReference(reference),
        chat=ChatSection("llama3"),
    )
    dpo = DPOSection(
        beta=BETA, precompute_reference=variant.cached, pad_to=variant.pad_to, share_prompt=variant.share_prompt
    )
    objective = DPOObjective(ctx, DataSection(kind="preference", path=str(PAIRS)), dpo)
    stream = ListStream(with_reference(folder, pairs, args) if variant.cached else pairs)
    # The objective's own rows and widths (share_prompt, pad_to, pad_multiple as the config resolves them).
    loader = PreferenceBatchLoader(
        stream,
        args.pairs_per_batch,
        args.seq_len,
        tokenizer.pad_id,
        False,
        objective.pad_to,
        objective.pad_multiple,
        shared=objective.shared,
    )
    batches = list(loader)

    def step(rows: dict[str, Any]) -> torch.Tensor:
        mb = objective.prepare([pair_batch(rows)]).batches[0]
        if objective.loss_input == "hidden":  # (as titanium/executors/plain.py runs the forward)
            output = ModelOutput(hidden=policy(**mb.model_inputs(), project=False), projection=policy.output)
        else:
            output = ModelOutput(logits=policy(**mb.model_inputs()))
        result = objective.loss(output, mb)
        loss = result.loss_sum / mb.units()
        loss.backward()
        return loss.detach()

    def hf_grads() -> dict[str, torch.Tensor]:
        grads = {name: p.grad for name, p in policy.named_parameters(remove_duplicate=False)}
        return spec.hf_adapter.to_hf(grads, built.args)

    return step, batches, policy, hf_grads


def word_tokenizer(vocab: int, pad_id: int):
    """A tokenizer whose words t0.. are the ids: TRL's trainer wants one, though it gets token ids here."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token=f"t{pad_id}", eos_token="t1")


def trl_side(folder: Path, pairs: list[PreferencePair], args: argparse.Namespace, variant: Variant):
    """(step, batches, policy, its gradients) for TRL's DPOTrainer with the same pairs, batch by batch."""
    from datasets import Dataset
    from transformers import LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    tokenizer = TiktokenTokenizer(str(TOKENIZER))
    policy = LlamaForCausalLM.from_pretrained(folder / "policy", dtype=torch.float32)
    reference = LlamaForCausalLM.from_pretrained(folder / "reference", dtype=torch.float32)
    config = DPOConfig(
        output_dir=tempfile.mkdtemp(),
        report_to=[],
        use_cpu=True,
        bf16=False,
        beta=BETA,
        loss_type=["sigmoid"],
        per_device_train_batch_size=args.pairs_per_batch,
        max_length=args.seq_len,
    )
    placeholder = Dataset.from_dict({"prompt": ["t5"], "chosen": ["t6"], "rejected": ["t7"]})
    trainer = DPOTrainer(
        model=policy,
        ref_model=reference,
        args=config,
        train_dataset=placeholder,
        processing_class=word_tokenizer(tokenizer.vocab_size, tokenizer.pad_id),
    )
    collate = DataCollatorForPreference(pad_token_id=tokenizer.pad_id, max_length=args.seq_len)
    examples = [trl_example(pair) for pair in pairs]
    if variant.cached:  # what precompute_ref_log_probs puts in the dataset, from titanium's pass
        trainer.precompute_ref_logps = True
        for example, pair in zip(examples, with_reference(folder, pairs, args)):
            assert pair.reference is not None
            example["ref_chosen_logps"], example["ref_rejected_logps"] = pair.reference
    n = args.pairs_per_batch
    batches = [collate(examples[i : i + n]) for i in range(0, len(examples), n)]
    model = trainer.model
    trainer.current_gradient_accumulation_steps = 1  # (train() sets it; no accumulation here)

    def step(batch: dict[str, Any]) -> torch.Tensor:
        return trainer.training_step(model, dict(batch))

    def grads() -> dict[str, torch.Tensor]:
        return {name: p.grad for name, p in model.named_parameters()}

    return step, batches, model, grads


def build(folder: Path, pairs: list[PreferencePair], args: argparse.Namespace, variant: Variant):
    side = titanium_side if variant.library == "titanium" else trl_side
    return side(folder, pairs, args, variant)


# ------------------------------------------------------------------------------------------ measuring


def timed_step(step: Step, batch: dict[str, Any], model: torch.nn.Module) -> tuple[float, float]:
    """(seconds, loss) of one step; the gradients are dropped after it."""
    start = time.perf_counter()
    loss = float(step(batch))
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start, loss


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def memory_child(args: argparse.Namespace) -> None:
    """One variant alone in this process: its RSS before the steps and the peak during them (JSON on stdout)."""
    torch.manual_seed(0)
    folder, pairs = Path(args.folder), load_pairs(args.batches * args.pairs_per_batch, args.seq_len)
    step, batches, model, _ = build(folder, pairs, args, VARIANTS[args.variant])
    before = rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current size
    for _ in range(2):
        for batch in batches:
            timed_step(step, batch, model)
    print(json.dumps({"before_kib": before, "peak_kib": rss_kib("VmHWM")}))


def measure_memory(args: argparse.Namespace, label: str) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--variant", label, "--folder", args.folder, "--seq-len", str(args.seq_len)]
    cmd += ["--batches", str(args.batches), "--pairs-per-batch", str(args.pairs_per_batch)]
    cmd += ["--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": python_path(), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return {"peak": result["peak_kib"] / 1024, "held": (result["peak_kib"] - result["before_kib"]) / 1024}


def check_equal(runners: dict[str, tuple]) -> dict[str, tuple[float, float]]:
    """Per titanium variant: max |loss difference| over the batches and max |gradient difference| on the first
    batch (mapped to Hugging Face names), against its TRL baseline, before anything is timed."""
    losses, grads = {}, {}
    for label, (step, batches, model, named_grads) in runners.items():
        losses[label] = [timed_step(step, batch, model)[1] for batch in batches]
        step(batches[0])
        grads[label] = {k: g.clone() for k, g in named_grads().items()}
        model.zero_grad(set_to_none=True)
    out = {}
    for label, variant in VARIANTS.items():
        if variant.library == "titanium":
            expected, expected_grads = losses[variant.baseline], grads[variant.baseline]
            loss_diff = max(abs(a - b) for a, b in zip(losses[label], expected, strict=True))
            grad_diff = max((grads[label][k] - g).abs().max().item() for k, g in expected_grads.items())
            out[label] = (loss_diff, grad_diff)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=64, help="training.seq_len (debug_dpo.toml's)")
    parser.add_argument("--pairs-per-batch", type=int, default=16, help="pairs per microbatch (debug_dpo.toml's)")
    parser.add_argument("--batches", type=int, default=15, help="batches per pass")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per variant")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: stable timings on a shared CPU)")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/dpo_speed_cpu.md"), help="'' for none")
    parser.add_argument("--variant", default="", help=argparse.SUPPRESS)  # (a memory child process)
    parser.add_argument("--folder", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.variant:
        memory_child(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        args.folder = tmp
        make_models(Path(tmp))
        report(args)


def report(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    folder = Path(args.folder)
    pairs = load_pairs(args.batches * args.pairs_per_batch, args.seq_len)
    runners = {label: build(folder, pairs, args, variant) for label, variant in VARIANTS.items()}
    equal = check_equal(runners)
    # Timing: batch by batch, every variant in turn (the order reversed every other batch), so a change in the
    # machine's load hits all variants alike; the first pass is a warm-up.
    seconds: dict[str, list[float]] = {label: [] for label in runners}
    order = list(runners)
    for r in range(args.repeats + 1):
        for i in range(args.batches):
            for label in order if (r * args.batches + i) % 2 == 0 else reversed(order):
                step, batches, model, _ = runners[label]
                elapsed, _ = timed_step(step, batches[i], model)
                if r:
                    seconds[label].append(elapsed)
    memory = {label: measure_memory(args, label) for label in runners}
    per_pass = {
        label: [sum(t[k : k + args.batches]) for k in range(0, len(t), args.batches)] for label, t in seconds.items()
    }
    shapes = {
        label: sorted({"x".join(map(str, b["input" if "input" in b else "input_ids"].shape)) for b in r[1]})
        for label, r in runners.items()
    }
    n_pairs = len(pairs)
    lines = [
        "# DPO speed beside TRL (CPU)",
        "",
        f"Device: {device_name(torch.device('cpu'))}; torch {torch.__version__}, {args.threads} thread(s) per "
        f"process; {versions()}.",
        "",
        f"Command: `{command_line()}`",
        "",
        f"{n_pairs} pairs of `{PAIRS.relative_to(REPO)}` in {args.batches} batches of {args.pairs_per_batch}, "
        f"seq_len {args.seq_len}; llama3 `debugmodel` shape (Hugging Face Llama made with transformers, loaded into "
        f"titanium through its HF loader), fp32, beta {BETA}, sigmoid loss. pairs/s: pairs over the median pass "
        f"of {args.repeats} timed passes; vs: the median per-batch time ratio against the row named. Loss diff: "
        "max over every batch; grad diff: max over every parameter on the first batch. See the script's docstring "
        "for what a step is and how memory is read.",
        "",
        "| variant | rows x width | pairs/s | speed | loss diff | grad diff | step peak RSS | held by the steps |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for label, variant in VARIANTS.items():
        base = seconds[variant.baseline]
        ratio = statistics.median(b / t for t, b in zip(seconds[label], base))
        loss_diff, grad_diff = (f"{v:.1e}" for v in equal[label]) if label in equal else ("", "")
        speed = "1.00x (baseline)" if label == variant.baseline else f"{ratio:.2f}x {variant.baseline}"
        lines.append(
            f"| {label} | {', '.join(shapes[label])} | {n_pairs / statistics.median(per_pass[label]):.1f} "
            f"| {speed} | {loss_diff} | {grad_diff} | {memory[label]['peak']:.0f} MiB "
            f"| {memory[label]['held']:.0f} MiB |"
        )
    write("\n".join(lines) + "\n", Path(args.out) if args.out else None)


def versions() -> str:
    import transformers
    import trl

    return f"transformers {transformers.__version__}, trl {trl.__version__}"


if __name__ == "__main__":
    main()
