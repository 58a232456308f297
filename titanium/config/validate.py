"""Range and consistency checks on a parsed JobConfig.

Each problem is one sentence naming the flag to change and what would be valid. Checks that need the
world size or the model (e.g. degrees multiply to the world size) happen where those are known.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

from titanium.config.components import DPO_LOSSES, ENGINES, OBJECTIVES, JobConfig
from titanium.config.lm_eval_section import check_lm_eval
from titanium.config.sections import GRPOSection, RLSection, RolloutSection
from titanium.config.validate_ft import validate_fault_tolerance
from titanium.config.validate_objectives import (
    validate_kd,
    validate_kto,
    validate_online_dpo,
    validate_ppo,
    validate_reward,
)

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


OBJECTIVE_DATA = {
    "dpo": (("preference",), "needs preference pairs: --data.kind preference"),
    "reward": (("preference",), "needs preference pairs: --data.kind preference"),
    "kto": (("unpaired",), "needs completions labelled true/false: --data.kind unpaired"),
    "grpo": (("chat", "instruct", "text"), "reads prompts: --data.kind chat, instruct or text"),
    "ppo": (("chat", "instruct", "text"), "reads prompts: --data.kind chat, instruct or text"),
    "online_dpo": (("chat", "instruct", "text"), "reads prompts: --data.kind chat, instruct or text"),
}
"""What each objective reads: ([data] kinds, what it needs)."""


def _validate_objective_data(cfg: JobConfig) -> Iterator[str]:
    """The data the chosen objective reads, named before any other problem of the pair: the user picked the
    objective, so the data kind is what to fix (not the objective a data kind would suit)."""
    objective, kind = cfg.training.objective, cfg.data.kind
    if objective in OBJECTIVE_DATA and kind != "auto" and kind not in OBJECTIVE_DATA[objective][0]:
        yield f"--training.objective {objective} {OBJECTIVE_DATA[objective][1]}, not {kind}"


def validate(cfg: JobConfig) -> Iterator[str]:
    yield from _validate_objective_data(cfg)
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
            "(run from the repository root, or point it at a Llama 3 tokenizer.model / .tiktoken file)"
        )
    if cfg.tokenizer.kind == "hf" and not Path(cfg.tokenizer.path).exists():
        yield (
            f"--tokenizer.path: not found: {cfg.tokenizer.path} (with --tokenizer.kind hf, a Hugging Face tokenizer "
            "folder or its tokenizer.json)"
        )
    if cfg.data.kind in ("auto", "text", "chat", "instruct", "preference", "unpaired") and looks_local(cfg.data.path):
        if not any(True for _ in _glob(cfg.data.path)):
            yield f"--data.path: no file matches {cfg.data.path} (run from the repository root, or fix the path)"
    yield from _validate_post_training(cfg)
    yield from _validate_dpo(cfg)
    yield from validate_reward(cfg)
    yield from validate_kd(cfg)
    yield from validate_kto(cfg)
    yield from validate_ppo(cfg)
    yield from validate_online_dpo(cfg, _compares_to_reference)
    yield from _validate_debugging(cfg)
    yield from _validate_guards_and_validation(cfg)
    yield from check_lm_eval(cfg.lm_eval)
    yield from _validate_rl(cfg.rl)
    yield from _validate_grpo(cfg.grpo)
    yield from _validate_rollout(cfg)
    yield from _validate_quantization_and_loss(cfg)
    yield from validate_fault_tolerance(cfg)
    if _reads_rollouts(cfg.training.objective):
        yield from _validate_rl_job(cfg)
    if cfg.training.objective == "grpo":
        yield from _validate_grpo_job(cfg)


def _validate_post_training(cfg: JobConfig) -> Iterator[str]:
    """SFT data, LoRA and evaluation: the combinations that cannot work, named before anything starts."""
    objective, kind, par = cfg.training.objective, cfg.data.kind, cfg.parallelism
    if not OBJECTIVES.known(objective):
        yield (
            f"--training.objective {objective!r} is not an objective; valid: {', '.join(OBJECTIVES.names())}, "
            "or your own as 'package.module:ClassName'"
        )
    if kind in ("chat", "instruct") and objective not in ("sft", "kd") and not _reads_rollouts(objective):
        yield (
            f"--data.kind {kind} needs --training.objective sft, kd, grpo, ppo or online_dpo (pretraining reads text "
            "windows)"
        )
    if objective in ("sft", "kd") and kind == "synthetic":
        yield f"--training.objective {objective} needs real samples: --data.kind chat, instruct or text (not synthetic)"
    if cfg.sft.pack_buffer < 1:
        yield f"--sft.pack_buffer must be >= 1, got {cfg.sft.pack_buffer}"
    for flag, value in (
        ("--sft.max_prompt_length", cfg.sft.max_prompt_length),
        ("--dpo.max_prompt_length", cfg.dpo.max_prompt_length),
    ):
        if value < 0:
            yield f"{flag} must be >= 0 (0: no limit), got {value}"
    for name, section in (("sft", cfg.sft), ("dpo", cfg.dpo), ("rl", cfg.rl)):
        if section.pad_multiple < 1:
            yield f"--{name}.pad_multiple must be >= 1 (8 suits tensor cores), got {section.pad_multiple}"
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
            yield f"--eval.path: no file matches {ev.path} (run from the repository root, or fix the path)"


PREFERENCE_OBJECTIVES = ("dpo", "reward")
"""Objectives trained on chosen/rejected pairs ([data] kind preference)."""


def _validate_dpo(cfg: JobConfig) -> Iterator[str]:
    """Preference data and the [dpo] ranges."""
    objective = cfg.training.objective
    if cfg.data.kind == "preference" and objective not in (*PREFERENCE_OBJECTIVES, "kto"):  # (kto: its own message)
        yield "--data.kind preference (chosen/rejected pairs) needs --training.objective dpo or reward"
    if cfg.training.objective == "dpo" and cfg.training.loss_chunk_size:
        yield (
            "--training.loss_chunk_size applies to token cross-entropy (pretrain, sft), not to --training.objective "
            "dpo, whose log-probs come from the full logits; set it to 0"
        )
    d = cfg.dpo
    if not DPO_LOSSES.known(d.loss_type):
        yield (
            f"--dpo.loss_type {d.loss_type!r} is not a DPO loss; valid: {', '.join(DPO_LOSSES.names())}, or your "
            "own as 'package.module:function'"
        )
    if d.beta <= 0:
        yield f"--dpo.beta must be > 0, got {d.beta}"
    if not 0 <= d.label_smoothing < 0.5:
        yield f"--dpo.label_smoothing must be in [0, 0.5), got {d.label_smoothing}"
    elif d.label_smoothing > 0 and d.loss_type not in ("sigmoid", "robust", "simpo"):
        yield f"--dpo.label_smoothing applies to --dpo.loss_type sigmoid, robust or simpo; set 0 for {d.loss_type}"
    for name, value in (("rpo_alpha", d.rpo_alpha), ("cpo_alpha", d.cpo_alpha)):
        if value < 0:
            yield f"--dpo.{name} must be >= 0 (0 turns the NLL term off), got {value}"
    if d.cpo_alpha > 0 and d.loss_type != "simpo":
        yield f"--dpo.cpo_alpha applies to --dpo.loss_type simpo (CPO-SimPO); set it to 0 for {d.loss_type}"
    if d.loss_type in ("simpo", "orpo"):
        if d.precompute_reference:
            yield f"--dpo.loss_type {d.loss_type} needs no reference model: set --dpo.precompute_reference false"
        if d.length_normalize:
            yield f"--dpo.loss_type {d.loss_type} always averages log-probs: set --dpo.length_normalize false"


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
        yield f"--validation.path: no file matches {v.path} (run from the repository root, or fix the path)"


def _validate_rl(r: RLSection) -> Iterator[str]:
    """[rl] ranges; the reward names are resolved by titanium.rl.rewards when the source is built."""
    if r.temperature <= 0:
        yield f"--rl.temperature must be > 0 (at 0 every response to a prompt is the same), got {r.temperature}"
    if not 0 < r.top_p <= 1:
        yield f"--rl.top_p must be in (0, 1] (1 turns it off), got {r.top_p}"
    for name, value, low in [
        ("top_k", r.top_k, 0),
        ("max_new_tokens", r.max_new_tokens, 1),
        ("max_prompt_len", r.max_prompt_len, 1),
        ("max_policy_lag", r.max_policy_lag, 0),
        ("dynamic_sampling_max_rounds", r.dynamic_sampling_max_rounds, 1),
        ("overlong_buffer", r.overlong_buffer, 0),
        ("log_completions", r.log_completions, 0),
        ("log_completions_count", r.log_completions_count, 1),
    ]:
        if value < low:
            yield f"--rl.{name} must be >= {low}, got {value}"
    if not r.rewards:
        yield "--rl.rewards is empty; name at least one reward function (e.g. exact_match) or reward model folder"
    if r.reward_weights and len(r.reward_weights) != len(r.rewards):
        yield (
            f"--rl.reward_weights has {len(r.reward_weights)} weights for {len(r.rewards)} reward functions "
            f"({', '.join(r.rewards)}); give one per function, or none for all 1"
        )
    if r.reward_model_layout == "sharded":
        yield from _validate_sharded_reward_model(r)
    if "overlong" in r.rewards and not 0 < r.overlong_buffer <= r.max_new_tokens:
        yield (
            f"--rl.rewards overlong punishes the last --rl.overlong_buffer tokens before --rl.max_new_tokens "
            f"{r.max_new_tokens}: set overlong_buffer in 1..{r.max_new_tokens}, got {r.overlong_buffer}"
        )
    if r.overlong_buffer and "overlong" not in r.rewards:
        yield (
            f"--rl.overlong_buffer {r.overlong_buffer} is only read by the overlong reward: add overlong to "
            "--rl.rewards (and its weight to --rl.reward_weights), or set overlong_buffer 0"
        )


def _validate_grpo(g: GRPOSection) -> Iterator[str]:
    """[grpo] ranges."""
    if g.group_size < 2:
        yield f"--grpo.group_size must be >= 2 (advantages compare the responses to one prompt), got {g.group_size}"
    for name, value, low in [("ppo_epochs", g.ppo_epochs, 1), ("minibatches", g.minibatches, 1)]:
        if value < low:
            yield f"--grpo.{name} must be >= {low}, got {value}"
    if not 0 <= g.epsilon_low < 1:
        yield f"--grpo.epsilon_low must be in [0, 1), got {g.epsilon_low}"
    for name, value in [("epsilon_high", g.epsilon_high), ("beta", g.beta)]:
        if value < 0:
            yield f"--grpo.{name} must be >= 0, got {value}"
    if g.delta is not None and g.loss_type == "cispo":
        yield "--grpo.delta caps the clipped objective's ratio; --grpo.loss_type cispo has none (use --grpo.cispo_cap)"
    elif g.delta is not None and g.delta <= 1:
        yield (
            f"--grpo.delta must be > 1 (TRL recommends > 1 + epsilon_high), got {g.delta}: a cap at or below 1 "
            "takes the gradient from on-policy tokens with a negative advantage"
        )
    if g.cispo_cap <= 0:
        yield f"--grpo.cispo_cap must be > 0 (it caps the importance weight), got {g.cispo_cap}"
    if g.is_correction != "none" and g.old_logprobs != "recompute":
        yield (
            f"--grpo.is_correction {g.is_correction} weighs by exp(recomputed - engine log-prob): it needs "
            "--grpo.old_logprobs recompute (with the engine's own log-probs as the old ones every weight is 1)"
        )
    if g.is_cap <= 0 or (g.is_cap_min is not None and not 0 <= g.is_cap_min < g.is_cap):
        yield f"--grpo.is_cap_min {g.is_cap_min} / --grpo.is_cap {g.is_cap}: need 0 <= is_cap_min < is_cap"


def _validate_rollout(cfg: JobConfig) -> Iterator[str]:
    """[rollout] ranges, and what the engines cannot do with the objective's sampling settings."""
    r, rl = cfg.rollout, cfg.rl
    if not ENGINES.known(r.engine):
        yield (
            f"--rollout.engine {r.engine!r} is not a rollout engine; valid: {', '.join(ENGINES.names())}, or your own "
            "EngineKind as 'package.module:NAME'"
        )
    if r.tensor_parallel_size < 1:
        yield f"--rollout.tensor_parallel_size must be >= 1, got {r.tensor_parallel_size}"
    if not 0 < r.gpu_memory_utilization <= 1:
        yield f"--rollout.gpu_memory_utilization must be in (0, 1], got {r.gpu_memory_utilization}"
    if r.max_num_batched_tokens < 1:
        yield f"--rollout.max_num_batched_tokens must be >= 1, got {r.max_num_batched_tokens}"
    if r.cpu_kv_cache_gib <= 0:
        yield f"--rollout.cpu_kv_cache_gib must be > 0, got {r.cpu_kv_cache_gib}"
    if r.mode == "server" and r.engine != "vllm":
        yield "--rollout.mode server starts vLLM in processes of its own: set --rollout.engine vllm (or mode colocated)"
    if r.mode == "server" and r.tensor_parallel_size > 1:
        yield (
            f"--rollout.tensor_parallel_size {r.tensor_parallel_size} with --rollout.mode server: an engine process "
            "is one process (not split); split vLLM over the training ranks with --rollout.mode colocated, or set 1"
        )
    if r.server_per != "rank" and r.mode != "server":
        yield f"--rollout.server_per {r.server_per} places the engine processes of --rollout.mode server; set that mode"
    objective = cfg.training.objective
    changed = [f.name for f in dataclasses.fields(r) if getattr(r, f.name) != getattr(RolloutSection(), f.name)]
    if changed and not _reads_rollouts(objective) and ":" not in objective:  # (your own objective may read it)
        yield f"--rollout.{changed[0]}: [rollout] is read by the RL objectives (grpo, ppo, online_dpo), not {objective}"
    tp = cfg.parallelism.tensor_parallel_degree
    if r.engine == "titanium" and r.tensor_parallel_size not in (1, tp):
        yield (
            f"--rollout.tensor_parallel_size {r.tensor_parallel_size}: the titanium engine splits its copy over the "
            f"training's tensor-parallel ranks (whose rows are the same): set it to 1 (a whole copy per rank) or {tp} "
            "(--parallelism.tensor_parallel_degree)"
        )
    if not _reads_rollouts(objective):
        return
    if r.engine == "vllm" and r.tensor_parallel_size > 1 and rl.dynamic_sampling:
        yield (
            "--rl.dynamic_sampling: each rank refills its own batch for as many rounds as it needs, but the ranks "
            f"of one vLLM engine (--rollout.tensor_parallel_size {r.tensor_parallel_size}) generate together; set "
            "tensor_parallel_size 1"
        )
    if r.server_per != "rank" and rl.dynamic_sampling:
        yield (
            "--rl.dynamic_sampling: each rank refills its own batch for as many rounds as it needs, but "
            f"--rollout.server_per {r.server_per} generates its ranks' prompts together; use --rollout.server_per rank"
        )
    if r.engine == "vllm" and r.compile:
        yield "--rollout.compile compiles the titanium engine's decode step; vLLM compiles its own: leave it off"
    if (
        r.engine == "vllm"
        and (rl.top_k > 0 or rl.top_p < 1)
        and objective == "grpo"
        and cfg.grpo.old_logprobs != "recompute"
    ):
        yield (
            f"--rollout.engine vllm with --rl.top_k {rl.top_k} / --rl.top_p {rl.top_p}: vLLM reports the log-probs "
            "of the truncated distribution it sampled from, not the full-vocabulary ones the loss uses; set "
            "--grpo.old_logprobs recompute (or turn top_k / top_p off)"
        )


def _validate_sharded_reward_model(g: RLSection) -> Iterator[str]:
    """What --rl.reward_model_layout sharded cannot do: it scores on the loop's thread, once per rollout batch,
    in the training's precision, from the policy's tokens. (That rewards names a folder is checked where the names
    are resolved: titanium/rl/source.py's sharded_reward_models.)"""
    if g.dynamic_sampling:
        yield (
            "--rl.reward_model_layout sharded with --rl.dynamic_sampling: each generation round needs its "
            "rewards at once, on the generation side, but a sharded reward model scores on the loop's thread with "
            "every rank; use reward_model_layout whole"
        )
    if g.reward_model_tokenizer != "policy":
        yield (
            "--rl.reward_model_layout sharded reads the policy's token ids; --rl.reward_model_tokenizer "
            f"{g.reward_model_tokenizer} needs reward_model_layout whole"
        )
    if g.reward_model_dtype != "float32":
        yield (
            f"--rl.reward_model_dtype {g.reward_model_dtype} is for whole reward models; a sharded one runs in the "
            "training's precision (--training.mixed_precision_param)"
        )


def _compares_to_reference(loss_type: str) -> bool:
    """Whether the DPO loss ``loss_type`` (a registered name or import path) is one on log-ratios to a reference."""
    return DPO_LOSSES.known(loss_type) and getattr(DPO_LOSSES.load(loss_type), "reference", True)


def _reads_rollouts(objective: str) -> bool:
    """Whether a registered objective draws from the rollout source (its registry entry reads [rl])."""
    return objective in OBJECTIVES and any(spec.name == "rl" for spec in OBJECTIVES.more_sections(objective))


def _validate_rl_job(cfg: JobConfig) -> Iterator[str]:
    """What an objective drawing from the rollout source needs of the rest of the config: prompts, room for prompt +
    response, and no fault tolerance with dynamic sampling."""
    rl, t, objective = cfg.rl, cfg.training, cfg.training.objective
    if cfg.data.kind not in ("auto", "chat", "instruct", "text"):
        yield f"--training.objective {objective} reads prompts: --data.kind chat, instruct or text, not {cfg.data.kind}"
    if rl.max_prompt_len + rl.max_new_tokens > t.seq_len:
        yield (
            f"--rl.max_prompt_len {rl.max_prompt_len} + --rl.max_new_tokens {rl.max_new_tokens} must fit in "
            f"--training.seq_len {t.seq_len} (the model's positions); lower them or raise seq_len"
        )
    if cfg.fault_tolerance.enable and rl.dynamic_sampling:
        yield (
            "--fault_tolerance.enable with --rl.dynamic_sampling: a replica group that rejoins skips its prompts "
            "forward by whole rollout batches, but with dynamic sampling a batch takes as many prompts as its "
            "rewards ask for; turn one of them off"
        )


def _validate_grpo_job(cfg: JobConfig) -> Iterator[str]:
    """What a GRPO job needs of the rest of the config: whole groups per microbatch."""
    g, t = cfg.grpo, cfg.training
    if t.local_batch_size % g.group_size:
        yield (
            f"--training.local_batch_size {t.local_batch_size} (responses per microbatch) must be a multiple of "
            f"--grpo.group_size {g.group_size}, so that each group of responses stays in one microbatch"
        )
    if t.loss_chunk_size:
        yield (
            "--training.loss_chunk_size applies to token cross-entropy (pretrain, sft), not to --training.objective "
            "grpo, whose log-probs come from the full logits; set it to 0"
        )
    if cfg.validation.interval > 0:
        yield (
            "--validation.interval: held-out loss has no meaning for --training.objective grpo (its loss needs "
            "rollouts); set it to 0 and measure held-out accuracy with --eval.interval"
        )
    if cfg.lora.rank > 0 and cfg.lora.dropout > 0:
        yield (
            f"--lora.dropout {cfg.lora.dropout}: --training.objective grpo compares the training forward with the "
            "forward that gave the old log-probs (rollouts run without dropout), so dropout would move every ratio "
            "away from 1 by noise; set --lora.dropout 0"
        )


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
