"""THE training loop. Setup follows DESIGN.md section 2, one short named step each; objectives plug in.

Loss rule: each microbatch contributes sum(per-token loss) / (valid tokens of the whole step, over all
data-parallel ranks). The count is all-reduced once per step before the forward, so gradient
accumulation and any DP degree give exactly the full-batch mean gradient (FSDP sums, never averages).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import tomli_w
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from titanium.checkpoint import CheckpointManager, ModelState, OptimizerState, RNGState, TrainState
from titanium.checkpoint.hf import export_final_hf, hf_model_args, load_hf_weights
from titanium.checkpoint.manager import complete_steps
from titanium.config import JobConfig, to_toml_dict
from titanium.data.chat import build_chat_template
from titanium.data.tokenizer import build_tokenizer
from titanium.generation.evaluate import ExactMatchEvaluator
from titanium.metrics import MemoryMonitor, MetricsLogger, ThroughputTracker, format_log_line, get_peak_flops
from titanium.models import build_model_args, get_model_spec
from titanium.optim import build_lr_scheduler, build_optimizer
from titanium.parallel.context import shard_batch
from titanium.parallel.dims import ParallelDims
from titanium.parallel.distributed import init_distributed, set_train_timeout
from titanium.parallel.parallelize import PlanConfig, parallelize_decoder
from titanium.parallel.pipeline import Pipeline, build_pipeline, clip_grad_norm_pipelined
from titanium.peft import apply_lora, export_peft_adapter, freeze_base, init_lora, quantize_lora_base_nf4
from titanium.trainers import ObjectiveContext, build_objective

logger = logging.getLogger("titanium")

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class Trainer:
    def __init__(self, cfg: JobConfig, dims: ParallelDims) -> None:
        self.cfg, self.dims = cfg, dims
        self.env = init_distributed(cfg.comm)
        self.device = self.env.device
        self.meshes = dims.build_meshes(self.device.type)
        self.dp_group = self.meshes.dp.get_group()
        self.dp_rank = self.meshes.dp.get_local_rank()
        self.loss_group = self.meshes.loss.get_group()  # dp x cp: the ranks whose loss units add up
        self._set_determinism()
        self._save_config()
        self.tokenizer = build_tokenizer(cfg.tokenizer)
        self._build_model()
        if self.cfg.lora.quantize_base == "nf4":
            self._materialize_quantized_base()
        self._parallelize()
        self._materialize()
        self._freeze_base()
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self._build_objective()
        self._build_evaluator()
        self._build_checkpointer()
        self._build_metrics()

    # ----- setup steps -----

    def _set_determinism(self) -> None:
        seed, deterministic = self.cfg.debug.seed, self.cfg.debug.deterministic
        torch.manual_seed(seed)
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False

    def _save_config(self) -> None:
        """Print (rank 0) and save the resolved config next to the outputs, so a run can be repeated."""
        if self.env.rank != 0:
            return
        text = tomli_w.dumps(to_toml_dict(self.cfg))
        folder = Path(self.cfg.job.dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.toml").write_text(text)
        if self.cfg.job.print_config:
            logger.info("resolved config (saved to %s):\n%s", folder / "config.toml", text)

    def _build_model(self) -> None:
        """Build on the meta device: nothing is allocated until the plan is applied."""
        cfg = self.cfg
        self.model_spec = get_model_spec(cfg.model.name)
        self.model_args = build_model_args(
            self.model_spec,
            cfg.model.flavor,
            vocab_size=self.tokenizer.vocab_size,
            max_seq_len=cfg.training.seq_len,
        )
        self.model_args = hf_model_args(
            self.model_spec,
            self.model_args,
            cfg.checkpoint,
            flavor=cfg.model.flavor,
            tokenizer_vocab=self.tokenizer.vocab_size,
        )
        model_name = f"{cfg.model.name} {cfg.model.flavor}"
        self.dims.check_model(self.model_args, model=model_name, seq_len=cfg.training.seq_len)
        with torch.device("meta"):
            self.model = self.model_spec.model_cls(self.model_args)
        n_params = sum(p.numel() for p in self.model.parameters())
        logger.info("model %s %s: %.2fM parameters", cfg.model.name, cfg.model.flavor, n_params / 1e6)
        self.lora = cfg.lora.rank > 0
        if self.lora:
            adapted = apply_lora(self.model, cfg.lora)
            logger.info(
                "LoRA rank %d on %d layers (%s)", cfg.lora.rank, len(adapted), ", ".join(cfg.lora.target_modules)
            )

    def _parallelize(self) -> None:
        """Apply the model family's plan (PP split, then per stage TP -> CP -> AC -> compile -> FSDP);
        families without a parallelize_fn get the generic plan, which has everything but TP."""
        t = self.cfg.training
        plan = PlanConfig(
            parallelism=self.cfg.parallelism,
            activation_checkpoint=self.cfg.activation_checkpoint,
            compile=self.cfg.compile,
            param_dtype=_DTYPES[t.mixed_precision_param],
            reduce_dtype=_DTYPES[t.mixed_precision_reduce],
            pipeline=self.dims.pp > 1,
        )
        parallelize = self.model_spec.parallelize_fn or parallelize_decoder
        self.pipeline: Pipeline | None = None
        self.model_parts = [self.model]
        if self.dims.pp > 1:
            # Stages are parallelized one by one; self.model becomes the container of this rank's stages.
            self.pipeline = build_pipeline(
                self.model,
                self.meshes.pp,
                self.cfg.parallelism,
                lambda part: parallelize(part, self.dims, self.meshes, plan),
            )
            self.model_parts = self.pipeline.parts
        else:
            parallelize(self.model, self.dims, self.meshes, plan)

    def _materialize(self) -> None:
        """Allocate and initialize the weights, deterministically from debug.seed.

        On CPU, DTensor random init gives every shard the same values, so a sharded model is
        initialized in full on rank 0 and broadcast into the shards. Either way every layout starts
        from exactly the weights a single process would have.
        """
        if self.cfg.lora.quantize_base == "nf4":  # done before sharding, see _materialize_quantized_base
            self.model.train()
            return
        self._init_weights()
        if self.dims.pp > 1 and self.device.type == "cpu":
            self._load_reference_weights_into_stages()
        elif self.dims.params_sharded and self.device.type == "cpu":
            full_state = self._reference_state_dict() if self.env.rank == 0 else {}
            # (strict=False: the reference has no LoRA adapters; init_lora fills them below)
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=not self.lora)
            set_model_state_dict(self.model, full_state, options=options)
        if self.lora:
            init_lora(self.model, seed=self.cfg.debug.seed)
        if self.cfg.checkpoint.initial_load_in_hf:
            self._load_hf_weights()
        self.model.train()

    def _init_weights(self) -> None:
        torch.manual_seed(self.cfg.debug.seed)
        for part in self.model_parts:  # (pipeline stages: each parameter is in exactly one part)
            part.to_empty(device=self.device)
            with torch.no_grad():
                part.init_weights(buffer_device=self.device)

    def _materialize_quantized_base(self) -> None:
        """QLoRA: allocate, initialize, load and NF4-quantize the whole base before sharding.

        NF4 keeps one scale per block of each full tensor, so each FSDP shard cannot be quantized on its
        own; the dense model is briefly held in full on every rank instead (set QLoRA up on a node with
        the memory for that, or convert on one machine first).
        """
        self.model_parts = [self.model]
        self._init_weights()
        init_lora(self.model, seed=self.cfg.debug.seed)
        if self.cfg.checkpoint.initial_load_in_hf:
            self._load_hf_weights()
        count = quantize_lora_base_nf4(self.model, shard_degree=self.dims.dp_shard * self.dims.cp)
        logger.info("QLoRA: %d base weights stored as NF4", count)

    def _load_hf_weights(self) -> None:
        """Start from a Hugging Face checkpoint, unless this run resumes its own (loaded later, it wins).

        With LoRA the run's own checkpoints hold only the adapters, so the base is loaded on every start.
        """
        ck = self.cfg.checkpoint
        if not self.lora and ck.enable and complete_steps(Path(self.cfg.job.dump_folder) / ck.folder):
            logger.info("not loading %s: this run resumes from its own checkpoint", ck.initial_load_path)
            return
        load_hf_weights(self.model, ck.initial_load_path, self.model_spec.hf_adapter, self.model_args)

    def _freeze_base(self) -> None:
        """LoRA: only the adapters train (the optimizer takes parameters that require grad)."""
        if not self.lora:
            return
        freeze_base(self.model)
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)  # (global, DTensors too)
        total = sum(p.numel() for p in self.model.parameters())
        logger.info(
            "LoRA: %.3fM of %.2fM parameters train (%.2f%%)", trainable / 1e6, total / 1e6, 100 * trainable / total
        )

    def _load_reference_weights_into_stages(self) -> None:
        """Pipeline ranks hold different parameters, so no rank can broadcast the full model to the others:
        each builds the single-process weights (CPU only, i.e. small models) and keeps its stages' part."""
        wanted = self.model.state_dict().keys()
        full_state = {k: v for k, v in self._reference_state_dict().items() if k in wanted}
        options = StateDictOptions(full_state_dict=True, strict=not self.lora)
        set_model_state_dict(self.model, full_state, options=options)

    def _reference_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights one process would initialize from debug.seed (a full, unsharded CPU model)."""
        reference = self.model_spec.model_cls(self.model_args)
        torch.manual_seed(self.cfg.debug.seed)
        with torch.no_grad():
            reference.init_weights()
        return reference.state_dict()

    def _build_objective(self) -> None:
        t = self.cfg.training
        per_step = t.local_batch_size * self.dims.dp_degree
        global_batch = per_step if t.global_batch_size == -1 else t.global_batch_size
        if global_batch % per_step:
            raise ValueError(
                f"--training.global_batch_size {global_batch} must be a multiple of local_batch_size x "
                f"data-parallel degree = {t.local_batch_size} x {self.dims.dp_degree} = {per_step}"
            )
        self.grad_accum_steps = global_batch // per_step
        ctx = ObjectiveContext(
            tokenizer=self.tokenizer,
            model_name=self.cfg.model.name,
            vocab_size=self.model_args.vocab_size,
            seq_len=t.seq_len,
            local_batch_size=t.local_batch_size,
            dp_rank=self.dp_rank,
            dp_world=self.dims.dp_degree,
            seed=self.cfg.debug.seed,
        )
        self.objective = build_objective(t.objective, ctx, self.cfg.data, self.cfg.sft)
        if self.pipeline is not None:
            self.pipeline.build_schedule(
                self.cfg.parallelism,
                t.local_batch_size,
                self.device,
                loss_sum=lambda logits, labels: self.objective.loss_sum(logits, {"label": labels}),
            )

    def _build_evaluator(self) -> None:
        """Held-out exact match of greedy answers (eval.interval > 0), on every data-parallel rank."""
        self.evaluator: ExactMatchEvaluator | None = None
        if self.cfg.eval.interval == 0:
            return
        template = build_chat_template(self.cfg.sft.chat_template, self.tokenizer, self.cfg.model.name)
        self.evaluator = ExactMatchEvaluator(
            self.cfg.eval,
            self.cfg.data,
            template,
            self.tokenizer,
            dp_rank=self.dp_rank,
            dp_world=self.dims.dp_degree,
            group=self.dp_group,
            device=self.device,
        )

    def _evaluate(self, step: int) -> None:
        if self.evaluator is None:
            return
        start = time.perf_counter()
        scalars = self.evaluator(self.model)
        self.metrics.log(step, scalars)
        if self.env.rank == 0:
            logger.info(
                "eval step %d: exact match %.1f%% of %d held-out samples (%.1fs)",
                step,
                100 * scalars["eval/exact_match"],
                scalars["eval/samples"],
                time.perf_counter() - start,
            )

    def _build_checkpointer(self) -> None:
        self.train_state = TrainState()
        states = {
            "model": ModelState(self.model, part="trainable" if self.lora else "all"),
            "optimizer": OptimizerState(self.model, self.optimizer),
            "lr_scheduler": self.lr_scheduler,
            "train_state": self.train_state,
            # Per-rank state needs per-rank keys: DCP keeps one copy of identically named values.
            f"data_dp{self.dp_rank}": self.objective,
            f"rng_rank{self.env.rank}": RNGState(),
        }
        base = ModelState(self.model, part="base") if self.lora else None
        self.checkpointer = CheckpointManager(
            self.cfg.checkpoint, self.cfg.job.dump_folder, states, self.env.rank, base_model=base
        )
        if self.cfg.checkpoint.create_seed_checkpoint:
            return  # a seed checkpoint is made from fresh weights, never from a resumed run
        resumed = self.checkpointer.load()
        if resumed:
            logger.info("resuming at step %d (%d tokens seen)", resumed, self.train_state.tokens_seen)

    def _build_metrics(self) -> None:
        self.metrics = MetricsLogger(
            self.cfg.metrics, self.cfg.job.dump_folder, self.env.rank, run_config=asdict(self.cfg)
        )
        self.memory = MemoryMonitor(self.device)
        self.throughput = ThroughputTracker(
            flops_per_token=self.model_spec.flops_per_token(self.model_args, self.cfg.training.seq_len),
            peak_flops=get_peak_flops(self.device),
            devices_sharing_batch=self.dims.devices_sharing_batch,
        )

    # ----- the loop -----

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """One optimizer step. Returns (loss sum, global count, grad norm) as device tensors, and tokens."""
        data_start = time.perf_counter()
        microbatches = [self.objective.next_microbatch() for _ in range(self.grad_accum_steps)]
        self.throughput.add_data_time(time.perf_counter() - data_start)
        loss_total, global_count, tokens = self.forward_backward(microbatches)
        grad_norm = self._clip_grad_norm()
        self.lr_used = self.lr_scheduler.get_last_lr()[0]  # (a copy: a tensor LR changes in place)
        self.checkpointer.maybe_wait_for_staging()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        return loss_total, global_count, grad_norm, tokens

    def forward_backward(self, microbatches: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Accumulate gradients of sum(loss) / global count over the step's microbatches (no host sync)."""
        tokens = sum(self.objective.tokens(mb) for mb in microbatches)  # whole sequences, before any CP split
        if self.dims.cp > 1:  # this rank's part of each sequence, with its global positions
            microbatches = [shard_batch(mb, self.meshes.cp) for mb in microbatches]
        local_count = torch.stack([self.objective.count(mb) for mb in microbatches]).sum().to(self.device)
        global_count = funcol.all_reduce(local_count, "sum", self.loss_group)
        divisor = global_count.clamp(min=1).float()
        loss_total = torch.zeros((), device=self.device)
        # With loss parallel the logits are vocab-sharded DTensors; the context makes cross-entropy
        # (forward and backward) work on the shards.
        sharded_loss = loss_parallel if self.dims.loss_parallel_enabled else contextlib.nullcontext
        for mb in microbatches:
            mb = {k: v.to(self.device, non_blocking=True) for k, v in mb.items()}
            inputs = self.objective.model_inputs(mb)
            if "positions" in mb:
                inputs["positions"] = mb["positions"]
            if self.pipeline is not None:  # the schedule runs forward and backward of all its microbatches
                with sharded_loss():
                    loss_total += self.pipeline.step(inputs, mb["label"], divisor)
                continue
            with sharded_loss():
                logits = self.model(**inputs)
                loss_sum = self.objective.loss_sum(logits, mb)
                if isinstance(loss_sum, DTensor):
                    loss_sum = loss_sum.full_tensor()
                (loss_sum / divisor).backward()
            loss_total += loss_sum.detach()
            del logits, loss_sum
        return loss_total, global_count, tokens

    def _clip_grad_norm(self) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.training.max_norm
        if self.pipeline is not None:
            return clip_grad_norm_pipelined(params, max_norm, self.pipeline.pp_group)
        if max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def train(self) -> None:
        t = self.cfg.training
        step = self.train_state.step
        if self.cfg.checkpoint.create_seed_checkpoint:
            self.checkpointer.save(0, final=True, model_only=True)
            logger.info("seed checkpoint written; train from it with the same --job.dump_folder at any layout")
            return
        if step >= t.steps:
            logger.info("checkpoint is at step %d >= training.steps %d; nothing to do", step, t.steps)
            return
        logger.info(
            "training %d steps from step %d: %d x %d tokens per microbatch, %d microbatch(es) per step, "
            "data-parallel degree %d, device %s",
            t.steps,
            step,
            t.local_batch_size,
            t.seq_len,
            self.grad_accum_steps,
            self.dims.dp_degree,
            self.device,
        )
        if step == 0:
            self._evaluate(0)  # the starting point, to compare with
        gc.disable()
        gc.collect()
        self.memory.reset_peak()
        while step < t.steps:
            step += 1
            self.throughput.start_step()
            loss_total, global_count, grad_norm, tokens = self.train_step()
            self.throughput.end_step(tokens)
            self.train_state.step = step
            self.train_state.tokens_seen += tokens * self.dims.dp_degree
            if step == 1:
                set_train_timeout(self.cfg.comm)
            if step == 1 or step % self.cfg.metrics.log_freq == 0 or step == t.steps:
                self._log(step, loss_total, global_count, grad_norm)
            if self.cfg.eval.interval and (step % self.cfg.eval.interval == 0 or step == t.steps):
                self._evaluate(step)
            if self.checkpointer.should_save(step, t.steps):
                self.checkpointer.save(step, final=step == t.steps)
            self.checkpointer.poll()
            if step % t.gc_freq == 0:
                gc.collect(1)
        gc.enable()
        logger.info("training done: %d steps, %d tokens", step, self.train_state.tokens_seen)
        if self.lora and self.cfg.lora.save_adapter:
            self._export_adapter()
        if self.cfg.checkpoint.last_save_in_hf:
            export_final_hf(
                self.model,
                self.model_spec,
                self.model_args,
                self.cfg.checkpoint,
                dump_folder=self.cfg.job.dump_folder,
                flavor=self.cfg.model.flavor,
            )

    def _export_adapter(self) -> None:
        """The adapters alone in PEFT layout (peft.PeftModel.from_pretrained on the base model loads them)."""
        ck, lora = self.cfg.checkpoint, self.cfg.lora
        if self.model_spec.hf_adapter is None:
            logger.warning("not saving the LoRA adapter: model %s has no Hugging Face adapter", self.cfg.model.name)
            return
        export_peft_adapter(
            self.model,
            self.model_spec.hf_adapter,
            self.model_args,
            lora,
            Path(self.cfg.job.dump_folder) / lora.adapter_folder,
            base_model_name_or_path=ck.initial_load_path if ck.initial_load_in_hf else None,
            pp_group=self.pipeline.pp_group if self.pipeline is not None else None,
        )

    def _log(self, step: int, loss_total: torch.Tensor, global_count: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """The one place the loop syncs with the device: turn this step's tensors into numbers."""
        dist.all_reduce(loss_total, group=self.loss_group)
        if self.pipeline is not None:  # only the last stage has the loss
            dist.all_reduce(loss_total, group=self.pipeline.pp_group)
        loss = (loss_total / global_count.clamp(min=1)).item()
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"loss is {loss} at step {step}; lower --optimizer.lr, raise --lr_scheduler.warmup_steps, "
                "or check the data"
            )
        scalars = {
            "loss": loss,
            "grad_norm": grad_norm.item(),
            "lr": float(self.lr_used),
            "tokens_seen": float(self.train_state.tokens_seen),
            **self.memory.stats(),
            **self.throughput.summary(step, self.cfg.training.steps),
            **self.objective.log_metrics(),
        }
        self.memory.reset_peak()
        self.metrics.log(step, scalars)
        if self.env.rank == 0:
            color = not self.cfg.metrics.disable_color_printing and sys.stderr.isatty()
            logger.info(format_log_line(step, self.cfg.training.steps, scalars, color))

    def close(self) -> None:
        self.checkpointer.close()
        self.metrics.close()
