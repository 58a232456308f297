"""titanium beside what users pick instead, on one GPU: torchtitan (pretraining), torchtune (SFT), TRL (GRPO, DPO).

    python benchmarks/peers.py --work pretrain --out benchmarks/results/peers_h100.md   # part "peers" of gpu_suite.sh
    python benchmarks/peers.py --work sft grpo dpo --out benchmarks/results/peers_h100.md
    python benchmarks/peers.py --device cpu --smoke --work sft grpo dpo --out /tmp/peers_cpu.md   # the CPU check

Each work runs titanium and its peer one after the other on the same card (per variant, titanium first), each a
fresh process as its users start it, on the same shapes, token ids, dtype and activation checkpointing:

- pretrain: Llama 3 8B-shaped (every dimension of Llama 3.1 8B, ``--layers`` of its 32 blocks for both), 2 x 8192
  tokens a step, bf16 autocast on float32 weights, per-op selective AC, fused AdamW at lr 3e-4 after 2 warmup
  steps; eager, compiled and compiled + float8 tensorwise (output layer in bf16): titanium's trainer against
  torchtitan 0.2.2's (``benchmarks/peer_torchtitan.py``: its Llama 3 spec, fed titanium's synthetic windows). Each
  library's own tokens/s, MFU and peak memory as it logs them. Both start from their own random weights (the
  losses agree to the extent that both start near ln(vocabulary) and fall alike on random tokens).
- sft: Qwen3-0.6B-shaped with random weights (one Hugging Face folder both load), the bundled arithmetic chats
  in titanium's chat format, packed into rows of 2048 tokens with the prompt masked, compiled, no AC:
  titanium against torchtune 0.6.1's ``full_finetune_single_device`` recipe fed the very rows titanium's packer
  made (``benchmarks/peer_torchtune.py``). torchtune trains bf16 weights (its only way on one GPU), titanium
  float32 weights under bf16 autocast.
- grpo: the same Qwen3-0.6B folder, 8 prompts x 8 responses of up to 256 new tokens a step, temperature 1, KL
  reference (beta 0.04), DAPO loss, no reward signal on either side (a random policy solves none of titanium's
  arithmetic prompts; TRL gets a zero reward): titanium with its compiled decode step against TRL 1.16's
  ``GRPOTrainer`` generating with transformers ``generate`` (``benchmarks/peer_trl.py``; vLLM cannot be carried).
- dpo: the same folder, the bundled preference pairs as titanium tokenizes them, 16 pairs a step, sigmoid loss
  (beta 0.1) against the starting weights: titanium against TRL's ``DPOTrainer``.

SFT and DPO use one optimizer on both sides (AdamW, constant lr, no weight decay, clipping at 1), so their first
losses are the same work's: equal at step 1 up to bf16 rounding, and close after. Ratios are titanium's
throughput over the peer's (above 1: titanium is faster). Steps after the first (compilation, warm-up) count.
The raw numbers of every work go to ``<out>.json``; the table (``--out``) is rebuilt from it after each run,
so a run stopped by a time limit keeps what finished and the works can run as separate steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import REPO, command_line, environment, number, python_path, vocab_tokenizer, write  # noqa: E402

WORKS = ("pretrain", "sft", "grpo", "dpo")
VARIANTS = {"eager": (), "compile": ("compile",), "float8 tensorwise": ("compile", "float8")}
QWEN3_VOCAB = 151936
LOSS_STEPS = 3
"""Losses shown per run (steps 1..LOSS_STEPS)."""


# ---------------------------------------------------------------------------------------------- running a side


def launch(cmd: list[str], folder: Path, timeout: float, cpu: bool) -> str | None:
    """Run one side in its own process (its log beside its results); None, or why it gave no numbers."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": python_path(), **({"CUDA_VISIBLE_DEVICES": ""} if cpu else {})}
    print("+", " ".join(cmd), flush=True)
    try:
        subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    except subprocess.CalledProcessError as e:
        return f"failed (exit {e.returncode}; its log is above)"
    return None


def tb_scalars(logdir: Path, tags: dict[str, str]) -> dict[str, dict[int, float]]:
    """key -> {step: value} of each TensorBoard tag found under ``logdir`` (any subfolder)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {key: {} for key in tags}
    for events in sorted({p.parent for p in logdir.rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for key, tag in tags.items():
            if tag in acc.Tags()["scalars"]:
                out[key].update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def jsonl(path: Path) -> dict[int, dict[str, float]]:
    """step -> the numbers a peer's step log wrote for it (later lines of one step add to earlier ones)."""
    rows: dict[int, dict[str, float]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows.setdefault(int(row["step"]), {}).update(row)
    return rows


def after_first(series: dict[int, float]) -> float:
    """Mean over the steps after the first (compilation and warm-up left out); NaN when nothing was logged."""
    values = [v for step, v in sorted(series.items()) if step > 1] or list(series.values())
    return statistics.mean(values) if values else float("nan")


def summary(series: dict[str, dict[int, float]]) -> dict:
    """A side's numbers: the means after step 1 and the first losses."""
    out = {key: after_first(values) for key, values in series.items() if key != "loss"}
    out["losses"] = [series["loss"][s] for s in sorted(series.get("loss", {}))[:LOSS_STEPS]]
    return out


def titanium(flags: list[str], folder: Path, opts: argparse.Namespace, tags: dict[str, str], layers=None):
    """titanium's trainer (``python -m titanium.train``, or a cut flavor through bench_common) and its numbers."""
    cut = [str(REPO / "benchmarks/bench_common.py"), "--layers", str(layers), "--"]
    entry = ["-m", "titanium.train"] if layers is None else cut
    cmd = [sys.executable, *entry, *flags, "--job.dump_folder", str(folder), "--job.no_print_config",
           "--metrics.enable_tensorboard", "--metrics.log_freq", "1"]  # fmt: skip
    failed = launch(cmd, folder, opts.run_timeout, opts.device == "cpu")
    return failed or summary(tb_scalars(folder / "tb", {"loss": "loss_metrics/global_avg_loss", **tags}))


# ---------------------------------------------------------------------------------------------- shared inputs


def hf_model(folder: Path, flavor: str, vocab: int) -> Path:
    """A Qwen3 Hugging Face folder of titanium's ``flavor`` shape, seeded random weights (both sides load it)."""
    path = folder / f"qwen3_{flavor}"
    if (path / "config.json").exists():
        return path
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from titanium.models import build_model_args, get_model_spec

    spec = get_model_spec("qwen3")
    config = Qwen3Config(**spec.hf_adapter.to_hf_config(build_model_args(spec, flavor, vocab_size=vocab)))
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).float().save_pretrained(path)
    return path


def qwen3_setup(opts: argparse.Namespace, folder: Path) -> tuple[str, Path, Path]:
    """(flavor, tokenizer file, HF folder): Qwen3 0.6B with a tokenizer of its vocabulary, or the debug flavor."""
    flavor, vocab = ("debugmodel", 2256) if opts.smoke else ("0.6B", QWEN3_VOCAB)
    tokenizer = vocab_tokenizer(folder, vocab)
    return flavor, tokenizer, hf_model(folder, flavor, vocab)


def titanium_job(flags: list[str]):
    """The job config and tokenizer titanium builds from ``flags`` (to hand a peer the same token ids)."""
    from titanium.config import load_config
    from titanium.data.chat import build_optional_chat_template
    from titanium.data.tokenizer import build_tokenizer
    from titanium.models import default_chat_format

    cfg = load_config(flags)
    tokenizer = build_tokenizer(cfg.tokenizer)
    template = build_optional_chat_template(cfg.chat.chat_template, tokenizer, default_chat_format(cfg.model.name))
    return cfg, tokenizer, template


def qwen3_flags(opts: argparse.Namespace, config: str, tokenizer: Path, hf: Path, flavor: str) -> list[str]:
    """What titanium's post-training sides share: the model from the HF folder, its tokenizer, the optimizer."""
    precision = "float32" if opts.device == "cpu" else "bfloat16"
    return [
        "--job.config_file", config, "--model.name", "qwen3", "--model.flavor", flavor,
        "--tokenizer.kind", "tiktoken", "--tokenizer.path", str(tokenizer), "--chat.chat_template", "llama3",
        "--checkpoint.no_enable", "--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf",
        "--eval.interval", "0", "--debug.seed", "0",
        "--training.mixed_precision_param", precision, "--training.steps", str(opts.steps),
        "--training.max_norm", "1.0",
        "--optimizer.lr", str(opts.lr), "--optimizer.beta2", "0.999", "--optimizer.weight_decay", "0",
        "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.min_lr_factor", "1.0",
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------- the works


def pretrain(opts: argparse.Namespace, folder: Path) -> dict:
    """Per variant: titanium, then torchtitan, on the same cut 8B and the same synthetic windows."""
    flavor, layers = ("debugmodel", 2) if opts.smoke else ("8B", opts.layers)
    seq, batch = (64, 2) if opts.smoke else (8192, 2)
    tokenizer = vocab_tokenizer(folder, 2256 if opts.smoke else 128256)
    shared_tt = shared_pretrain_flags(seq, batch, opts.steps)
    results = {}
    for variant in opts.variants:
        parts = VARIANTS[variant]
        ti = [
            "--job.config_file", "train_configs/debug_model.toml", "--data.kind", "synthetic", "--checkpoint.no_enable",
            "--model.name", "llama3", "--model.flavor", flavor, "--tokenizer.path", str(tokenizer),
            "--training.mixed_precision_param", "bfloat16", "--debug.seed", "0", *shared_tt,
            *(["--compile.enable"] if "compile" in parts else []),
            *(["--float8.enable", "--float8.recipe", "tensorwise"] if "float8" in parts else []),
        ]  # fmt: skip
        tags = {"tps": "throughput/tps", "mfu": "throughput/mfu_pct", "memory": "memory/peak_gib"}
        row = {"titanium": titanium(ti, folder / variant / "titanium", opts, tags, layers=layers)}
        tt_folder = folder / variant / "torchtitan"
        if opts.device == "cpu":
            row["torchtitan"] = "not run: torchtitan 0.2.2 trains on CUDA only"
        else:
            argv = torchtitan_argv(flavor if opts.smoke else f"{flavor}-{layers}L", parts, shared_tt, tt_folder)
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
            failed = launch([*torchrun, "-m", "torchtitan.train", *argv],
                            tt_folder, opts.run_timeout, cpu=False)  # fmt: skip
            row["torchtitan"] = failed or summary(tb_scalars(tt_folder, TORCHTITAN_TAGS))
        results[variant] = row
        yield results


def shared_pretrain_flags(seq: int, batch: int, steps: int) -> list[str]:
    """The flags titanium's and torchtitan's pretraining runs share (the same names in both)."""
    return [
        "--training.seq_len", str(seq), "--training.local_batch_size", str(batch), "--training.steps", str(steps),
        "--optimizer.lr", "3e-4", "--lr_scheduler.warmup_steps", "2", "--activation_checkpoint.mode", "selective",
        "--activation_checkpoint.selective_ac_option", "op",
    ]  # fmt: skip


TORCHTITAN_TAGS = {"loss": "loss_metrics/global_avg_loss", "tps": "throughput(tps)", "mfu": "mfu(%)",
                   "memory": "memory/max_active(GiB)"}  # fmt: skip


def torchtitan_argv(flavor: str, parts: tuple[str, ...], shared: list[str], folder: Path) -> list[str]:
    """torchtitan.train's flags for a variant: its Llama 3 spec on titanium's tokens, the same batch, sequence,
    optimizer, AC, compile (model and loss) and float8 (tensorwise, titanium's filter) as titanium's run."""
    from titanium.config.sections import Float8Section

    return [
        "--experimental.custom_import", "benchmarks.peer_torchtitan", "--model.name", "llama3_titanium_tokens",
        "--model.flavor", flavor, "--job.dump_folder", str(folder), "--training.mixed_precision_param", "bfloat16",
        "--debug.seed", "0", *shared, "--metrics.enable_tensorboard", "--metrics.log_freq", "1",
        *(["--compile.enable", "--compile.components", "model,loss"] if "compile" in parts else []),
        *(["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name", "tensorwise",
           "--quantize.linear.float8.filter_fqns", ",".join(Float8Section().filter_fqns)] if "float8" in parts else []),
    ]  # fmt: skip


def sft_rows(flags: list[str], count: int) -> list[dict[str, torch.Tensor]]:
    """The first ``count`` packed rows titanium's SFT objective trains on for ``flags`` (its own packer)."""
    from titanium.data.packing import PackedDataset
    from titanium.data.sft import SFTDataset

    cfg, tokenizer, template = titanium_job(flags)
    t = cfg.training
    samples = SFTDataset(cfg.data, cfg.sft, tokenizer, template, t.seq_len, 0, 1, cfg.chat.system_prompt)
    rows = iter(PackedDataset(samples, t.seq_len, tokenizer.pad_id, cfg.sft.pack_buffer))
    return [next(rows) for _ in range(count)]


def sft(opts: argparse.Namespace, folder: Path) -> dict:
    flavor, tokenizer, hf = qwen3_setup(opts, folder)
    seq = 128 if opts.smoke else 2048
    batch = opts.sft_batch
    flags = [
        *qwen3_flags(opts, "train_configs/debug_sft.toml", tokenizer, hf, flavor), "--sft.packing",
        "--data.kind", "chat", "--data.path", "assets/tasks/arithmetic/train.jsonl", "--training.seq_len", str(seq),
        "--training.local_batch_size", str(batch), "--training.global_batch_size", str(batch),
        *([] if opts.smoke else ["--compile.enable"]),
    ]  # fmt: skip
    tags = {
        "tps": "throughput/tps",
        "padding": "data/padding_pct",
        "step_s": "time/step_s",
        "memory": "memory/peak_gib",
    }
    ti = titanium(flags, folder / "titanium", opts, tags)
    if isinstance(ti, dict):  # (tokens with a label: what torchtune's tokens/s counts)
        ti["label_tps"] = label_tokens_per_s(flags, batch, ti["step_s"], opts.steps)
    rows_file = folder / "rows.pt"
    torch.save(sft_rows(flags, batch * opts.steps), rows_file)
    cfg, tokenizer_obj, _ = titanium_job(flags)
    yaml = folder / "torchtune.yaml"  # (JSON is YAML)
    yaml.write_text(json.dumps(torchtune_config(opts, cfg, tokenizer_obj.pad_id, hf, rows_file, folder)))
    failed = launch([sys.executable, str(REPO / "benchmarks/peer_torchtune.py"), "--config", str(yaml)],
                    folder / "torchtune", opts.run_timeout, opts.device == "cpu")  # fmt: skip
    tt = failed or torchtune_summary(jsonl(folder / "torchtune" / "steps.jsonl"))
    yield {"Qwen3 0.6B-shaped": {"titanium": ti, "torchtune": tt}}


def label_tokens_per_s(flags: list[str], batch: int, step_s: float, steps: int) -> float:
    """Tokens with a label per second of titanium's step (the rows after the first step's)."""
    rows = sft_rows(flags, batch * steps)[batch:]
    labelled = sum(int((r["label"] != -100).sum()) for r in rows)
    return labelled / max(steps - 1, 1) / step_s


def torchtune_config(opts, cfg, pad_id: int, hf: Path, rows: Path, folder: Path) -> dict:
    """The recipe's config: the same model (from the HF folder), rows, batch, steps and optimizer as titanium's."""
    from titanium.models import build_model_args, get_model_spec

    args = build_model_args(get_model_spec("qwen3"), cfg.model.flavor)
    hf_config = json.loads((hf / "config.json").read_text())
    model = {
        "_component_": "benchmarks.peer_torchtune.qwen3", "vocab_size": hf_config["vocab_size"],
        "num_layers": args.n_layers, "num_heads": args.n_heads, "num_kv_heads": args.n_kv_heads, "embed_dim": args.dim,
        "intermediate_dim": hf_config["intermediate_size"], "head_dim": hf_config["head_dim"],
        "max_seq_len": cfg.training.seq_len, "rope_base": hf_config["rope_theta"] if "rope_theta" in hf_config
        else hf_config["rope_parameters"]["rope_theta"], "norm_eps": hf_config["rms_norm_eps"],
        "tie_word_embeddings": hf_config["tie_word_embeddings"],
    }  # fmt: skip
    cpu = opts.device == "cpu"
    return {
        "output_dir": str(folder / "torchtune"), "model": model, "seed": 0, "shuffle": False,
        "tokenizer": {"_component_": "benchmarks.peer_torchtune.RowsTokenizer", "pad_id": pad_id,
                      "max_seq_len": cfg.training.seq_len},
        "checkpointer": {"_component_": "benchmarks.peer_torchtune.HFFolderCheckpointer", "folder": str(hf),
                         "tie_word_embeddings": model["tie_word_embeddings"]},
        "resume_from_checkpoint": False,
        "dataset": {"_component_": "benchmarks.peer_torchtune.titanium_rows", "path": str(rows), "packed": True},
        "batch_size": cfg.training.local_batch_size, "epochs": 1, "max_steps_per_epoch": opts.steps,
        "gradient_accumulation_steps": 1, "optimizer_in_bwd": False, "clip_grad_norm": 1.0,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": opts.lr, "weight_decay": 0.0, "fused": not cpu,
                      "betas": [0.9, 0.999]},
        "loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
        "compile": not opts.smoke, "device": "cpu" if cpu else "cuda", "dtype": "fp32" if cpu else "bf16",
        "enable_activation_checkpointing": False, "enable_activation_offloading": False,
        "metric_logger": {"_component_": "benchmarks.peer_torchtune.JsonlLogger",
                          "path": str(folder / "torchtune" / "steps.jsonl")},
        "log_every_n_steps": 1, "log_peak_memory_stats": not cpu,
        "profiler": {"_component_": "torchtune.training.setup_torch_profiler", "enabled": False},
    }  # fmt: skip


def torchtune_summary(steps: dict[int, dict[str, float]]) -> dict:
    """The recipe's step log (its steps count from 1): label tokens/s, step seconds from the log's times, memory."""
    times = [steps[s]["time"] for s in sorted(steps)]
    seconds = {s: b - a for s, a, b in zip(sorted(steps)[1:], times, times[1:])}
    series = {
        "label_tps": {s: r["tokens_per_second_per_gpu"] for s, r in steps.items()},
        "step_s": seconds,
        "memory": {s: r.get("peak_memory_alloc", float("nan")) for s, r in steps.items()},
        "loss": {s: r["loss"] for s, r in steps.items()},
    }
    return summary(series)


def trl_summary(steps: dict[int, dict[str, float]], extra: dict[str, str]) -> dict:
    series = {"step_s": {s: r["seconds"] for s, r in steps.items() if "seconds" in r},
              "memory": {s: r["peak_gib"] for s, r in steps.items() if "peak_gib" in r},
              "loss": {s: r["loss"] for s, r in steps.items() if "loss" in r},
              **{k: {s: r[v] for s, r in steps.items() if v in r} for k, v in extra.items()}}  # fmt: skip
    return summary(series)


def grpo(opts: argparse.Namespace, folder: Path) -> dict:
    from titanium.data.prompts import PromptDataset

    flavor, tokenizer, hf = qwen3_setup(opts, folder)
    new, seq, prompts = (8, 64, 1) if opts.smoke else (opts.max_new_tokens, 512, 8)
    flags = [
        *qwen3_flags(opts, "train_configs/debug_grpo.toml", tokenizer, hf, flavor),
        "--training.local_batch_size", str(8 * prompts if opts.smoke else 8), "--training.global_batch_size",
        str(8 * prompts), "--training.seq_len", str(seq), "--rl.max_new_tokens", str(new),
        "--rl.max_prompt_len", str(seq - new), "--rl.temperature", "1.0", "--rl.log_completions", "0",
        "--grpo.beta", "0.04", "--grpo.loss_type", "dapo", "--rollout.engine", "titanium",
        *([] if opts.smoke else ["--rollout.compile"]),
    ]  # fmt: skip
    tags = {"step_s": "time/step_s", "gen_tps": "grpo/gen_tokens_per_s", "length": "grpo/response_len",
            "memory": "memory/peak_gib"}  # fmt: skip
    ti = titanium(flags, folder / "titanium", opts, tags)
    cfg, tok, template = titanium_job(flags)
    stream = iter(PromptDataset(cfg.data, cfg.rl, tok, template, cfg.chat.system_prompt))
    data = folder / "prompts.json"
    data.write_text(json.dumps([next(stream).prompt for _ in range(prompts * opts.steps)]))
    cmd = [
        sys.executable, str(REPO / "benchmarks/peer_trl.py"), "grpo", "--model", str(hf), "--data", str(data),
        "--out", str(folder / "trl" / "steps.jsonl"), "--pad-id", str(tok.pad_id), "--eos-id", str(tok.eos_id),
        "--steps", str(opts.steps), "--batch", str(8 * prompts if opts.smoke else 8),
        "--accumulation", str(1 if opts.smoke else prompts), "--lr", str(opts.lr), "--max-new-tokens", str(new),
        "--beta", "0.04",
    ]  # fmt: skip
    failed = launch(cmd, folder / "trl", opts.run_timeout, opts.device == "cpu")
    trl = failed or trl_summary(jsonl(folder / "trl" / "steps.jsonl"), {"length": "completions/mean_length"})
    for side in (ti, trl):  # generated tokens per second of step (TRL logs no generation time of its own)
        if isinstance(side, dict):
            side["step_tps"] = side["length"] * 8 * prompts / side["step_s"]
    yield {"Qwen3 0.6B-shaped": {"titanium": ti, "TRL": trl}}


def dpo(opts: argparse.Namespace, folder: Path) -> dict:
    from titanium.data.preference import PreferenceDataset

    flavor, tokenizer, hf = qwen3_setup(opts, folder)
    pairs_per_step = 4 if opts.smoke else opts.dpo_pairs
    flags = [
        *qwen3_flags(opts, "train_configs/debug_dpo.toml", tokenizer, hf, flavor), "--dpo.rpo_alpha", "0",
        "--training.local_batch_size", str(pairs_per_step), "--training.global_batch_size", str(pairs_per_step),
        "--training.seq_len", "128",
    ]  # fmt: skip
    tags = {"step_s": "time/step_s", "memory": "memory/peak_gib"}
    ti = titanium(flags, folder / "titanium", opts, tags)
    cfg, tok, template = titanium_job(flags)
    stream = iter(PreferenceDataset(cfg.data, template, cfg.training.seq_len, tok.bos_id))
    from dpo_speed import trl_example

    pairs = [trl_example(next(stream)) for _ in range(pairs_per_step * opts.steps)]
    eos = {p[k][-1] for p in pairs for k in ("chosen_ids", "rejected_ids")}
    assert len(eos) == 1, f"responses end in different tokens {eos}: TRL would append its EOS to some"
    data = folder / "pairs.json"
    data.write_text(json.dumps([{"prompt": p["prompt_ids"], "chosen": p["chosen_ids"], "rejected": p["rejected_ids"]}
                                for p in pairs]))  # fmt: skip
    cmd = [
        sys.executable, str(REPO / "benchmarks/peer_trl.py"), "dpo", "--model", str(hf), "--data", str(data),
        "--out", str(folder / "trl" / "steps.jsonl"), "--pad-id", str(tok.pad_id), "--eos-id", str(eos.pop()),
        "--steps", str(opts.steps), "--batch", str(pairs_per_step), "--lr", str(opts.lr), "--max-length", "128",
    ]  # fmt: skip
    failed = launch(cmd, folder / "trl", opts.run_timeout, opts.device == "cpu")
    trl = failed or trl_summary(jsonl(folder / "trl" / "steps.jsonl"), {})
    for side in (ti, trl):
        if isinstance(side, dict):
            side["pairs_s"] = pairs_per_step / side["step_s"]
    yield {"Qwen3 0.6B-shaped": {"titanium": ti, "TRL": trl}}


# ---------------------------------------------------------------------------------------------- the table

COLUMNS = {  # work -> (peer, throughput key, its name, other (key, name, format) cells)
    "pretrain": ("torchtitan", "tps", "tokens/s", [("mfu", "MFU %", ".1f"), ("memory", "peak GiB", ".1f")]),
    "sft": ("torchtune", "label_tps", "trained tokens/s", [("step_s", "step s", ".3f"), ("memory", "peak GiB", ".1f")]),
    "grpo": (
        "TRL",
        "step_tps",
        "generated tokens/s of step",
        [("step_s", "step s", ".2f"), ("length", "mean length", ".0f"), ("memory", "peak GiB", ".1f")],
    ),
    "dpo": ("TRL", "pairs_s", "pairs/s", [("step_s", "step s", ".3f"), ("memory", "peak GiB", ".1f")]),
}
TITLES = {
    "pretrain": "Pretraining: titanium vs torchtitan 0.2.2 (Llama 3 8B-shaped, seq 8192, bf16, selective AC)",
    "sft": "SFT: titanium vs torchtune 0.6.1 full_finetune_single_device (packed, prompt-masked, compiled)",
    "grpo": "GRPO: titanium (compiled decode) vs TRL 1.16 GRPOTrainer (transformers generate; no vLLM on the machine)",
    "dpo": "DPO: titanium vs TRL 1.16 DPOTrainer (same pairs)",
}


def losses(side) -> str:
    return ", ".join(f"{v:.4f}" for v in side["losses"]) if isinstance(side, dict) else ""


def table(work: str, ran: dict) -> list[str]:
    """A work's section: the command that ran it and one row per run, titanium beside the peer."""
    peer, key, name, others = COLUMNS[work]
    rows = ran["rows"]
    head = [f"titanium {name}", f"{peer} {name}", "ratio"]
    for _, label, _ in others:
        head += [f"titanium {label}", f"{peer} {label}"]
    head += [f"titanium losses 1-{LOSS_STEPS}", f"{peer} losses 1-{LOSS_STEPS}"]
    lines = [f"## {TITLES[work]}", "", f"Command: `{ran['command']}`.", ""]
    lines += ["| run | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for run, sides in rows.items():
        ti, pe = sides["titanium"], sides[peer]
        cell = lambda s, k, f: s if isinstance(s, str) else number(s.get(k, float("nan")), f)  # noqa: E731
        ratio = f"{ti[key] / pe[key]:.2f}x" if isinstance(ti, dict) and isinstance(pe, dict) else ""
        cells = [cell(ti, key, ",.0f"), cell(pe, key, ",.0f"), ratio]
        for k, _, f in others:
            cells += [cell(ti, k, f), cell(pe, k, f)]
        lines.append(f"| {run} | " + " | ".join(cells + [losses(ti), losses(pe)]) + " |")
    return [*lines, ""]


def render(results: dict, opts: argparse.Namespace) -> str:
    lines = [
        "# titanium beside torchtitan, torchtune and TRL on one device" + (" (smoke run)" * opts.smoke),
        "",
        environment(torch.device(opts.device)),
        "",
        "Ratio: titanium's throughput over the peer's (above 1: titanium is faster). Means of the steps after "
        "the first. What each work runs and how the two sides are kept alike: `benchmarks/peers.py`'s docstring.",
        "",
    ]
    for work in WORKS:
        if work in results:
            lines += table(work, results[work])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", nargs="+", default=list(WORKS), choices=WORKS)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--smoke", action="store_true", help="debug flavors, a few short steps, no compile (CPU)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--layers", type=int, default=6, help="pretraining: blocks of the 8B-shaped model (of 32)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-6, help="post-training learning rate (both sides)")
    parser.add_argument("--sft-batch", type=int, default=8, help="SFT: packed rows of 2048 per step")
    parser.add_argument("--dpo-pairs", type=int, default=16, help="DPO: pairs per step")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--run-timeout", type=float, default=150, help="seconds per side before it is given up")
    parser.add_argument("--out", type=Path, required=True, help="the table (markdown); the numbers go beside it")
    opts = parser.parse_args(argv)
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here; --device cpu --smoke runs the CPU check")
    if opts.smoke:
        opts.steps, opts.sft_batch = 3, 2
    store = opts.out.with_suffix(".json")
    results = json.loads(store.read_text()) if store.exists() else {}
    works = {"pretrain": pretrain, "sft": sft, "grpo": grpo, "dpo": dpo}
    with tempfile.TemporaryDirectory() as tmp:
        for work in opts.work:
            for partial in works[work](opts, Path(tmp) / work):
                results[work] = {"command": command_line(), "rows": partial}
                write(json.dumps(results, indent=1), store, echo=False)
                write(render(results, opts), opts.out, echo=False)
    print(render(results, opts))


if __name__ == "__main__":
    main()
