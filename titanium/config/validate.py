"""Range and consistency checks on a parsed JobConfig.

Each problem is one sentence naming the flag to change and what would be valid. Checks that need the
world size or the model (e.g. degrees multiply to the world size) happen where those are known.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

from titanium.config.components import CONVERTERS, EVALUATIONS, OBJECTIVES, TRAINING_HOOKS, JobConfig, unread_sections
from titanium.config.registry import DATA_KINDS, SectionSpec
from titanium.config.validate_ft import validate_fault_tolerance

PIPELINE_SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
"""torch's schedule names (torch.distributed.pipelining.schedules.get_schedule_class)."""

_LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet", ".txt", ".gz", ".zst")


def looks_local(path: str) -> bool:
    """A data path that names a local file, folder or glob rather than a hub dataset id."""
    return (
        path.startswith(("/", "./", "../", "~"))
        or path.endswith(_LOCAL_SUFFIXES)
        or any(c in path for c in "*?[")
        or Path(path).exists()
    )


def validate(cfg: JobConfig) -> Iterator[str]:
    yield from _validate_objective(cfg)
    t, o, s = cfg.training, cfg.optimizer, cfg.lr_scheduler
    if t.steps < 0:
        yield f"--training.steps must be >= 0 (0: evaluate only, no training), got {t.steps}"
    for name, value in [
        ("training.local_batch_size", t.local_batch_size),
        ("training.seq_len", t.seq_len),
        ("training.gc_freq", t.gc_freq),
        ("metrics.log_freq", cfg.metrics.log_freq),
        ("checkpoint.interval", cfg.checkpoint.interval),
        ("comm.init_timeout_seconds", cfg.comm.init_timeout_seconds),
        ("comm.train_timeout_seconds", cfg.comm.train_timeout_seconds),
        ("parallelism.data_parallel_replicate_degree", cfg.parallelism.data_parallel_replicate_degree),
        ("parallelism.tensor_parallel_degree", cfg.parallelism.tensor_parallel_degree),
        ("parallelism.pipeline_parallel_degree", cfg.parallelism.pipeline_parallel_degree),
        ("parallelism.context_parallel_degree", cfg.parallelism.context_parallel_degree),
        ("parallelism.expert_parallel_degree", cfg.parallelism.expert_parallel_degree),
    ]:
        if value < 1:
            yield f"--{name} must be >= 1, got {value}"
    for name, value in [("data.shards", cfg.data.shards), ("data.prefetch_batches", cfg.data.prefetch_batches)]:
        if value < 0:
            yield f"--{name} must be >= 0, got {value}"
    if t.global_batch_size != -1 and t.global_batch_size < 1:
        yield f"--training.global_batch_size must be -1 (derived) or >= 1, got {t.global_batch_size}"
    if cfg.moe.aux_loss_coef is not None and cfg.moe.aux_loss_coef < 0:
        yield f"--moe.aux_loss_coef must be >= 0 (or unset: the model's own), got {cfg.moe.aux_loss_coef}"
    if cfg.moe.bias_update_rate < 0:
        yield f"--moe.bias_update_rate must be >= 0, got {cfg.moe.bias_update_rate}"
    if t.max_norm < 0:
        yield f"--training.max_norm must be >= 0 (0 disables clipping), got {t.max_norm}"
    if o.lr < 0:
        yield f"--optimizer.lr must be >= 0, got {o.lr}"
    for name, value in [("optimizer.beta1", o.beta1), ("optimizer.beta2", o.beta2)]:
        if not 0 <= value < 1:
            yield f"--{name} must be in [0, 1), got {value}"
    if o.eps <= 0:
        yield f"--optimizer.eps must be > 0, got {o.eps}"
    if o.weight_decay < 0:
        yield f"--optimizer.weight_decay must be >= 0, got {o.weight_decay}"
    if s.warmup_steps < 0:
        yield f"--lr_scheduler.warmup_steps must be >= 0, got {s.warmup_steps}"
    if s.decay_ratio is not None and not 0 < s.decay_ratio <= 1:
        yield f"--lr_scheduler.decay_ratio must be in (0, 1] (or unset), got {s.decay_ratio}"
    if not 0 <= s.min_lr_factor <= 1:
        yield f"--lr_scheduler.min_lr_factor must be in [0, 1], got {s.min_lr_factor}"
    if cfg.checkpoint.keep_latest_k < 0:
        yield f"--checkpoint.keep_latest_k must be >= 0 (0 keeps all), got {cfg.checkpoint.keep_latest_k}"
    if cfg.checkpoint.create_seed_checkpoint and not cfg.checkpoint.enable:
        yield "--checkpoint.create_seed_checkpoint needs --checkpoint.enable"
    ck = cfg.checkpoint
    if ck.initial_load_in_hf and not ck.initial_load_path:
        yield "--checkpoint.initial_load_in_hf needs --checkpoint.initial_load_path (a Hugging Face folder)"
    if ck.initial_load_path and not Path(ck.initial_load_path).exists():
        yield (
            f"--checkpoint.initial_load_path: not found: {ck.initial_load_path} (fix the path, or first run the "
            "job that writes it; e.g. train_configs/debug_sft.toml starts from ./run_train.sh's last checkpoint)"
        )
    elif ck.initial_load_in_hf and ck.initial_load_path and not (Path(ck.initial_load_path) / "config.json").is_file():
        yield (
            f"--checkpoint.initial_load_path: {ck.initial_load_path} has no config.json; with "
            "--checkpoint.initial_load_in_hf it must be a Hugging Face checkpoint folder"
        )
    if ck.push_to_hub and not ck.last_save_in_hf:
        yield (
            f"--checkpoint.push_to_hub {ck.push_to_hub}: uploads the Hugging Face export; set "
            "--checkpoint.last_save_in_hf (a LoRA adapter: python -m titanium.tools.convert to-peft ... --push-to-hub)"
        )
    if ck.export_at_saves and not ck.enable:
        yield "--checkpoint.export_at_saves writes the exports at each checkpoint save; set --checkpoint.enable"
    kinds = {"model", "optimizer", "lr_scheduler", "train_state", "data", "rng", "value_model", "value_optimizer"}
    for kind in cfg.checkpoint.exclude_from_loading:
        if kind not in kinds:
            yield f"--checkpoint.exclude_from_loading: unknown part {kind!r}; valid: {', '.join(sorted(kinds))}"
    shard = cfg.parallelism.data_parallel_shard_degree
    if shard != -1 and shard < 1:
        yield f"--parallelism.data_parallel_shard_degree must be -1 (the rest) or >= 1, got {shard}"
    par = cfg.parallelism
    if par.pipeline_parallel_schedule not in PIPELINE_SCHEDULES:
        yield (
            f"--parallelism.pipeline_parallel_schedule {par.pipeline_parallel_schedule!r} is not a schedule; "
            f"valid: {', '.join(PIPELINE_SCHEDULES)}"
        )
    split_backward = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
    if (
        par.pipeline_parallel_degree > 1
        and par.tensor_parallel_degree > 1
        and par.pipeline_parallel_schedule in split_backward
    ):
        yield (
            f"--parallelism.pipeline_parallel_schedule {par.pipeline_parallel_schedule} (split input/weight backward) "
            "does not work with --parallelism.tensor_parallel_degree > 1 (torch fails to detach the DTensor "
            "gradients); use GPipe, 1F1B, Interleaved1F1B or LoopedBFS"
        )
    if (mbs := par.pipeline_parallel_microbatch_size) < 1:
        yield f"--parallelism.pipeline_parallel_microbatch_size must be >= 1, got {mbs}"
    if par.pipeline_parallel_layers_per_stage != -1 and par.pipeline_parallel_layers_per_stage < 1:
        yield (
            "--parallelism.pipeline_parallel_layers_per_stage must be -1 (derived) or >= 1, got "
            f"{par.pipeline_parallel_layers_per_stage}"
        )
    sac = cfg.activation_checkpoint.selective_ac_option
    if sac != "op" and not (sac.isdigit() and int(sac) >= 1):
        yield f"--activation_checkpoint.selective_ac_option must be 'op' or a positive integer N, got {sac!r}"
    if cfg.compile.enable_async_tensor_parallel and not cfg.compile.enable:
        yield "--compile.enable_async_tensor_parallel needs --compile.enable (the overlap is done by inductor)"
    if cfg.compile.enable_async_tensor_parallel and cfg.parallelism.tensor_parallel_degree < 2:
        yield "--compile.enable_async_tensor_parallel needs --parallelism.tensor_parallel_degree >= 2"
    if cfg.tokenizer.kind == "tiktoken" and not Path(cfg.tokenizer.path).is_file():
        yield (
            f"--tokenizer.path: file not found: {cfg.tokenizer.path} "
            "(fix the path, relative to the current directory, or point it at a Llama 3 tokenizer.model / "
            ".tiktoken file)"
        )
    if cfg.tokenizer.kind == "hf" and not Path(cfg.tokenizer.path).exists():
        yield (
            f"--tokenizer.path: not found: {cfg.tokenizer.path} (with --tokenizer.kind hf, a Hugging Face tokenizer "
            "folder or its tokenizer.json)"
        )
    if cfg.data.kind in ("auto", "text", "chat", "instruct", "preference", "unpaired") and looks_local(cfg.data.path):
        if not any(True for _ in _glob(cfg.data.path)):
            yield f"--data.path: no file matches {cfg.data.path} (fix the path, relative to the current directory)"
    yield from _validate_post_training(cfg)
    yield from _validate_debugging(cfg)
    yield from _validate_guards_and_validation(cfg)
    yield from _validate_quantization_and_loss(cfg)
    yield from validate_fault_tolerance(cfg)


def _validate_objective(cfg: JobConfig) -> Iterator[str]:
    """What the chosen objective needs of the job, as its registry entry declares it (``Needs``), then the checks
    of each section it reads (their ``problems``). The data kind comes first: the user picked the objective, so
    the data is what to fix."""
    objective, kind, t = cfg.training.objective, cfg.data.kind, cfg.training
    if not OBJECTIVES.known(objective):
        yield (
            f"--training.objective {objective!r} is not an objective; valid: {', '.join(OBJECTIVES.names())}, "
            "or your own as 'package.module:ClassName'"
        )
        return
    needs = OBJECTIVES.needs(objective)
    if kind in DATA_KINDS and kind not in needs.data_kinds:
        readers = [name for name in OBJECTIVES.names() if kind in OBJECTIVES.needs(name).data_kinds]
        yield f"--training.objective {objective} {needs.data_what}, not {kind} (read by {', '.join(readers)})"
    if t.loss_chunk_size and not needs.token_loss:
        token = [name for name in OBJECTIVES.names() if OBJECTIVES.needs(name).token_loss]
        yield (
            f"--training.loss_chunk_size applies to token cross-entropy ({', '.join(token)}), not to "
            f"--training.objective {objective}, whose log-probs come from the full logits; set it to 0"
        )
    if cfg.validation.interval > 0 and not needs.held_out_loss:
        yield (
            f"--validation.interval: held-out loss has no meaning for --training.objective {objective} (its loss "
            "needs rollouts); set it to 0 and measure held-out accuracy with --eval.interval"
        )
    for spec in (OBJECTIVES.section(objective), *OBJECTIVES.more_sections(objective), *_always_read()):
        if spec is not None and hasattr(section := getattr(cfg, spec.name), "problems"):
            yield from section.problems(cfg)


def _always_read() -> list[SectionSpec | None]:
    """The sections every job reads besides its objective's: the converters', evaluations' and hooks' (each off at
    its defaults)."""
    return [c.section for registry in (CONVERTERS, EVALUATIONS, TRAINING_HOOKS) for c in registry]


def unread_settings(cfg: JobConfig) -> Iterator[str]:
    """Settings changed in sections only other objectives read: the job runs without them (a warning: a config
    file shared by several jobs may hold them; the saved config.toml leaves those sections out)."""
    objective = cfg.training.objective
    if not OBJECTIVES.known(objective):
        return
    for name in unread_sections(objective):
        section, default = getattr(cfg, name), type(getattr(cfg, name))()
        changed = [f.name for f in dataclasses.fields(section) if getattr(section, f.name) != getattr(default, f.name)]
        if changed:
            readers = ", ".join(c.name for c in OBJECTIVES if OBJECTIVES.reads(c.name, name))
            yield (
                f"--{name}.{changed[0]} is not read: [{name}] is read by --training.objective {readers}, not "
                f"{objective}"
            )


def _validate_post_training(cfg: JobConfig) -> Iterator[str]:
    """LoRA and evaluation: the combinations that cannot work, named before anything starts."""
    par = cfg.parallelism
    lora = cfg.lora  # (the target names are checked by titanium.peft, before any process group)
    if lora.rank > 0 and par.tensor_parallel_degree > 1:
        yield (
            "--lora.rank > 0 does not compose with --parallelism.tensor_parallel_degree > 1 yet; "
            "LoRA trains few parameters, so use data parallelism (FSDP) instead"
        )
    if lora.quantize_base == "nf4":
        if par.pipeline_parallel_degree > 1:
            yield "--lora.quantize_base nf4 (QLoRA) does not compose with --parallelism.pipeline_parallel_degree > 1"
        if cfg.checkpoint.initial_load_path and not cfg.checkpoint.initial_load_in_hf:
            yield (
                "--lora.quantize_base nf4 (QLoRA) starts from a Hugging Face folder (--checkpoint.initial_load_in_hf) "
                "or fresh weights, not a titanium checkpoint; export that one with python -m titanium.tools.convert"
            )
    ev = cfg.eval
    if ev.interval < 0:
        yield f"--eval.interval must be >= 0 (0 turns evaluation off), got {ev.interval}"
    for name, value in [
        ("eval.max_samples", ev.max_samples),
        ("eval.max_new_tokens", ev.max_new_tokens),
        ("eval.batch_size", ev.batch_size),
        ("eval.samples_per_prompt", ev.samples_per_prompt),
    ]:
        if value < 1:
            yield f"--{name} must be >= 1, got {value}"
    if ev.temperature < 0:
        yield f"--eval.temperature must be >= 0 (0: greedy), got {ev.temperature}"
    elif ev.temperature == 0 and ev.samples_per_prompt > 1:
        yield "--eval.samples_per_prompt > 1 needs --eval.temperature > 0 (greedy answers are all the same)"
    if ev.interval > 0:
        if max(par.tensor_parallel_degree, par.pipeline_parallel_degree, par.context_parallel_degree) > 1:
            yield (
                "--eval.interval > 0 (generation) runs under data parallelism only; set it to 0 with tensor, "
                "pipeline or context parallelism"
            )
        if looks_local(ev.path) and not any(True for _ in _glob(ev.path)):
            yield f"--eval.path: no file matches {ev.path} (fix the path, relative to the current directory)"


def _validate_debugging(cfg: JobConfig) -> Iterator[str]:
    """Flight Recorder and profiler settings."""
    if cfg.comm.trace_buf_size < 0:
        yield f"--comm.trace_buf_size must be >= 0 (0 turns the Flight Recorder off), got {cfg.comm.trace_buf_size}"
    prof = cfg.profiling
    for name, value, low in [
        ("profiling.profile_freq", prof.profile_freq, 1),
        ("profiling.profiler_active", prof.profiler_active, 1),
        ("profiling.profiler_warmup", prof.profiler_warmup, 0),
    ]:
        if value < low:
            yield f"--{name} must be >= {low}, got {value}"
    if prof.profiler_warmup + prof.profiler_active > prof.profile_freq:
        yield (
            f"--profiling.profiler_warmup ({prof.profiler_warmup}) + --profiling.profiler_active "
            f"({prof.profiler_active}) must fit in --profiling.profile_freq ({prof.profile_freq})"
        )
    for name, folder in [
        ("comm.save_traces_folder", cfg.comm.save_traces_folder),
        ("profiling.save_traces_folder", prof.save_traces_folder),
        ("profiling.save_memory_snapshot_folder", prof.save_memory_snapshot_folder),
    ]:
        if not folder.strip():
            yield f"--{name} must name a folder (relative to --job.dump_folder), got an empty string"


def _validate_guards_and_validation(cfg: JobConfig) -> Iterator[str]:
    """[guards] and [validation] ranges, and the validation data."""
    g, v = cfg.guards, cfg.validation
    if g.max_skipped_steps < 0:
        yield f"--guards.max_skipped_steps must be >= 0 (0 sets no limit), got {g.max_skipped_steps}"
    if g.loss_spike_ratio != 0 and g.loss_spike_ratio <= 1:
        yield f"--guards.loss_spike_ratio must be > 1 (or 0 to turn spike logging off), got {g.loss_spike_ratio}"
    if g.loss_spike_window < 1:
        yield f"--guards.loss_spike_window must be >= 1, got {g.loss_spike_window}"
    if g.on_nonfinite == "skip" and cfg.optimizer.early_step_in_backward:
        yield (
            "--guards.on_nonfinite skip cannot undo --optimizer.early_step_in_backward: its steps run inside the "
            "backward, before the loss and gradient norm are known; use --guards.on_nonfinite stop"
        )
    if v.interval < 0:
        yield f"--validation.interval must be >= 0 (0 turns validation off), got {v.interval}"
    if v.steps < 1:
        yield f"--validation.steps must be >= 1, got {v.steps}"
    if v.interval > 0 and cfg.data.kind != "synthetic" and looks_local(v.path) and not any(True for _ in _glob(v.path)):
        yield f"--validation.path: no file matches {v.path} (fix the path, relative to the current directory)"


def _validate_quantization_and_loss(cfg: JobConfig) -> Iterator[str]:
    """[float8], [qat] and the chunked cross-entropy: combinations that cannot work."""
    f8, qat, par = cfg.float8, cfg.qat, cfg.parallelism
    for name, value in [
        ("float8.enable_fsdp_float8_all_gather", f8.enable_fsdp_float8_all_gather),
        ("float8.precompute_float8_dynamic_scale_for_fsdp", f8.precompute_float8_dynamic_scale_for_fsdp),
        ("float8.auto_filter_small_kn", f8.auto_filter_small_kn),
        ("float8.emulate", f8.emulate),
    ]:
        if value and not f8.enable:
            yield f"--{name} needs --float8.enable"
    if f8.enable_fsdp_float8_all_gather and f8.recipe != "tensorwise":
        yield (
            f"--float8.enable_fsdp_float8_all_gather needs --float8.recipe tensorwise (one scale per weight); "
            f"{f8.recipe} scales each row: turn the all-gather off"
        )
    if f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
        yield "--float8.precompute_float8_dynamic_scale_for_fsdp needs --float8.enable_fsdp_float8_all_gather"
    if f8.auto_filter_small_kn and f8.recipe == "rowwise_with_gw_hp":
        yield (
            "--float8.auto_filter_small_kn has no size table for --float8.recipe rowwise_with_gw_hp; name the layers "
            "to keep in high precision in --float8.filter_fqns instead"
        )
    if f8.enable and qat.enable:
        yield "--float8.enable and --qat.enable both convert the linear layers; turn one of them off"
    if qat.group_size < 1:
        yield f"--qat.group_size must be >= 1, got {qat.group_size}"
    if qat.enable and par.tensor_parallel_degree > 1:
        yield (
            "--qat.enable does not compose with --parallelism.tensor_parallel_degree > 1 (a layer's quantization "
            "groups and per-token activation scales span the split); use FSDP"
        )
    if qat.enable and qat.save_quantized and not qat.quantized_folder.strip():
        yield "--qat.quantized_folder must name a folder (relative to --job.dump_folder), got an empty string"
    chunk = cfg.training.loss_chunk_size
    if chunk < 0:
        yield f"--training.loss_chunk_size must be >= 0 (0: full logits), got {chunk}"
    elif chunk > 0 and par.pipeline_parallel_degree > 1:
        yield (
            "--training.loss_chunk_size does not work with --parallelism.pipeline_parallel_degree > 1 (the last "
            "stage computes the full logits); set it to 0"
        )


def _glob(path: str) -> Iterator[Path]:
    p = Path(path).expanduser()
    if p.exists():
        yield p
        return
    anchor = Path(p.anchor) if p.is_absolute() else Path(".")
    pattern = str(p.relative_to(p.anchor)) if p.is_absolute() else str(p)
    yield from anchor.glob(pattern)
