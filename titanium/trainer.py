"""THE training loop. Setup is one short named step each (mesh, model, optimizer, objective, checkpoints, metrics);
everything else plugs in.

Loss rule: each microbatch contributes sum(per-unit loss) / (loss units of the whole step, over all data- and
context-parallel ranks). The count is all-reduced once per step before the forward, so gradient accumulation and
any DP degree give exactly the full-batch mean gradient (FSDP sums, never averages).

The loop names no objective, converter, evaluation or parallel layout: objectives, converters and evaluations come
from registries with their own config sections (titanium/config/components.py), a step executor runs the step
however the model is laid out (titanium/executors/), and features hook in at fixed points (titanium/hooks.py).
docs/extending.md lists what the loop does still name, and why.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import tomli_w
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from titanium.batch import Batch
from titanium.checkpoint import CheckpointManager, OptimizerState, RNGState, TrainState
from titanium.checkpoint.hf import export_final_hf
from titanium.checkpoint.hub import upload
from titanium.checkpoint.manager import complete_steps
from titanium.config import ConfigError, JobConfig, to_toml_dict
from titanium.config.components import EVALUATIONS, OBJECTIVES, TRAINING_HOOKS
from titanium.config.resumed import warn_if_changed
from titanium.config.sections import DataSection
from titanium.data.export import save_tokenizer
from titanium.data.tokenizer import build_tokenizer, tokenizer_origin
from titanium.debug.profiling import Profiler
from titanium.evaluation.periodic import EvaluationContext, Periodic
from titanium.executors import ExecutorOptions, PreparedStep, StepResult, build_executor
from titanium.fault_tolerance import build_fault_tolerance
from titanium.guards import StepGuard
from titanium.hooks import HookContext, TrainingHooks
from titanium.metrics import MemoryMonitor, MetricsLogger, ThroughputTracker, format_log_line, get_peak_flops
from titanium.model_builder import ModelBuilder, ModelSource
from titanium.model_handles import ModelHandles
from titanium.model_setup import StartingWeights, job_converters, job_plan, job_processor
from titanium.models.converter import ExportContext
from titanium.objectives import Objective, ObjectiveContext, build_objective
from titanium.optim import build_lr_scheduler, build_optimizer
from titanium.parallel.context import sequence_placement
from titanium.parallel.dims import ParallelDims
from titanium.parallel.distributed import init_distributed, set_collective_timeout, set_train_timeout

logger = logging.getLogger("titanium")


class Trainer:
    def __init__(self, cfg: JobConfig, dims: ParallelDims) -> None:
        self.cfg, self.dims = cfg, dims
        self.env = init_distributed(cfg.comm)
        self.device = self.env.device
        self.meshes = dims.build_meshes(self.device.type)
        set_collective_timeout(cfg.comm.init_timeout_seconds)  # torch gives the mesh's groups its own default
        self.dp_group = self.meshes.dp.get_group()
        self.dp_rank = self.meshes.dp.get_local_rank()
        self.loss_group = self.meshes.loss.get_group()  # dp x cp: the ranks whose loss units add up
        self.fault_tolerance = build_fault_tolerance(cfg.fault_tolerance, self.device)  # (off: a no-op hook)
        self.data_rank, self.data_world = self.fault_tolerance.data_shard(self.dp_rank, dims.dp_degree)
        t = cfg.training
        self.grad_accum_steps = dims.grad_accum_steps(t.local_batch_size, t.global_batch_size)
        self._set_determinism()
        self._save_config()
        self.tokenizer = build_tokenizer(cfg.tokenizer)
        self._build_model()
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self._register_hooks()
        self._build_objective()
        self.optimizers = [self.optimizer, *(model.optimizer for model in self.models.trained)]
        self._other_norms: list[torch.Tensor] = []  # (the gradient norms of the models trained beside the policy)
        self.guard = StepGuard(cfg.guards, self.optimizers, self.device, loss_spikes=self.objective.loss_spikes)
        self._build_evaluations()
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
        """Print (rank 0) and save the resolved config next to the outputs, so a run can be repeated; resuming a
        run configured otherwise, name the keys that differ."""
        if self.env.rank != 0:
            return
        text = tomli_w.dumps(to_toml_dict(self.cfg))
        folder = Path(self.cfg.job.dump_folder)
        if self.cfg.checkpoint.enable and complete_steps(folder / self.cfg.checkpoint.folder):
            warn_if_changed(folder / "config.toml", to_toml_dict(self.cfg))  # (before it is written over)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.toml").write_text(text)
        level = logging.INFO if self.cfg.job.print_config else logging.DEBUG
        logger.log(level, "resolved config (saved to %s):\n%s", folder / "config.toml", text)
        if level != logging.INFO:
            logger.info("resolved config saved to %s", folder / "config.toml")

    def _build_model(self) -> None:
        """Through the one builder: meta model -> converters -> PP split -> plan -> weights; the
        policy's hooks on the loop, and handles on the models objectives may ask for."""
        cfg, t = self.cfg, self.cfg.training
        self.builder = ModelBuilder(
            self.device,
            cfg.debug.seed,
            self.dims,
            self.meshes,
            job_plan(cfg, self.dims, self.device.type, announce=self.env.rank == 0),
            attention=cfg.model.attention,
        )
        self.model_spec, self.model_args = self.builder.resolve(
            cfg.model,
            seq_len=t.seq_len,
            vocab_size=self.tokenizer.vocab_size,
            checkpoint=cfg.checkpoint,
            tokenizer_origin=tokenizer_origin(cfg.tokenizer),
        )
        hf_start = cfg.checkpoint.initial_load_path if cfg.checkpoint.initial_load_in_hf else None
        self.model_spec = OBJECTIVES.load(t.objective).policy_spec(self.model_spec, self.tokenizer, hf_start)
        converters = job_converters(cfg, self.dims, self.device.type)
        weights = StartingWeights(cfg.checkpoint, cfg.job.dump_folder)
        self.built = self.builder.build(
            self.model_spec, self.model_args, converters=converters, weights=weights.policy(converters)
        )
        self.model = self.built.model
        self.hooks = TrainingHooks()
        self.builder.register_hooks(self.built, self.hooks)
        start = ModelSource(self.model_spec, self.model_args, weights.start())
        self.models = ModelHandles(self.builder, self.built, start, self.hooks, batch_size=t.local_batch_size)
        self.placement = sequence_placement(self.device, self.meshes.cp if self.dims.cp > 1 else None)
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)  # (global, DTensors too)
        total = sum(p.numel() for p in self.model.parameters())
        if trainable < total:
            logger.info(
                "%s: %.3fM of %.2fM parameters train (%.2f%%)",
                ", ".join(c.describe() for c in converters),
                trainable / 1e6,
                total / 1e6,
                100 * trainable / total,
            )

    def _register_hooks(self) -> None:
        """Every registered feature that hooks into the loop, from its own section (e.g. a load-balancing loss)."""
        ctx = HookContext(self.built, self.grad_accum_steps, self.loss_group, self.cfg.checkpoint.last_save_in_hf)
        for component in TRAINING_HOOKS:
            assert component.section is not None, f"training hook {component.name} has no config section"
            TRAINING_HOOKS.load(component.name)(getattr(self.cfg, component.section.name), ctx, self.hooks)

    def _build_objective(self) -> None:
        """The configured objective with its own config section, and the executor that runs its steps."""
        t = self.cfg.training
        self._objective_ctx = ObjectiveContext(
            tokenizer=self.tokenizer,
            model_name=self.model_spec.name,
            chat_format=self.model_spec.chat_template or "",
            vocab_size=self.model_args.vocab_size,
            seq_len=t.seq_len,
            local_batch_size=t.local_batch_size,
            dp_rank=self.data_rank,
            dp_world=self.data_world,
            seed=self.cfg.debug.seed,
            loss_chunk_size=t.loss_chunk_size,
            models=self.models,
            device=self.device,
            placement=self.placement,
            chat=self.cfg.chat,
            dump_folder=self.cfg.job.dump_folder,
            fixed_shapes=self.dims.pp > 1,
            sequence_multiple=self.dims.sequence_multiple,
            ranks_per_row=self.dims.devices_sharing_batch,
            sum_over_data=lambda total: funcol.all_reduce(total, "sum", self.dp_group),
            step_units=self._step_units,
            total_steps=t.steps,
            processor=job_processor(self.cfg, self.model_args),
        )
        self.objective = self._new_objective(self.cfg.data)
        options = ExecutorOptions(
            self.cfg.parallelism, t.local_batch_size, self.dims.loss_parallel_enabled, self.device, self.hooks.loss_term
        )
        self.executor = build_executor(self.objective, self.built, options)

    def _new_objective(self, data: DataSection, seed_offset: int = 0) -> Objective:
        """An instance of the training objective reading ``data`` (another seed: other synthetic windows)."""
        ctx = dataclasses.replace(self._objective_ctx, seed=self._objective_ctx.seed + seed_offset)
        return build_objective(self.cfg.training.objective, ctx, data, self.cfg)

    def _build_evaluations(self) -> None:
        """Every registered evaluation its own section turns on (held-out loss, exact match, ...)."""
        ctx = EvaluationContext(
            data=self.cfg.data,
            chat=self.cfg.chat,
            tokenizer=self.tokenizer,
            model_name=self.model_spec.name,
            chat_format=self.model_spec.chat_template or "",
            objective=self._new_objective,
            loss_sums=self._held_out_loss,
            policy=self.models.policy(),
            dp_rank=self.dp_rank,
            dp_world=self.dims.dp_degree,
            dp_group=self.dp_group,
            device=self.device,
            processor=self._objective_ctx.processor,
        )
        self.evaluations: list[Periodic] = []
        for component in EVALUATIONS:
            assert component.section is not None, f"evaluation {component.name} has no config section"
            task = EVALUATIONS.load(component.name)(getattr(self.cfg, component.section.name), ctx)
            if task is not None:
                self.evaluations.append(task)

    def _build_checkpointer(self) -> None:
        self.train_state = TrainState()
        model_state, base = self.built.checkpoint_states()
        states = {
            "model": model_state,
            "optimizer": OptimizerState(self.model, self.optimizer),
            "lr_scheduler": self.lr_scheduler,
            "train_state": self.train_state,
            # Per-rank state needs per-rank keys: DCP keeps one copy of identically named values.
            f"data_dp{self.data_rank}": self.objective,
            f"rng_rank{self.env.rank}": RNGState(),
        }
        for model in self.models.trained:  # (a PPO value model and its optimizer)
            extra = model.checkpoint_states()
            assert not extra.keys() & states.keys(), f"checkpoint keys {sorted(extra)} clash with the loop's"
            states.update(extra)
        self.checkpointer = CheckpointManager(
            self.fault_tolerance.checkpoint_section(self.cfg.checkpoint),
            self.cfg.job.dump_folder,
            states,
            self.env.rank,
            base_model=base,
        )
        if self.cfg.checkpoint.create_seed_checkpoint:
            return  # a seed checkpoint is made from fresh weights, never from a resumed run
        resumed = self.checkpointer.load()
        if resumed:
            logger.info("resuming at step %d (%d tokens seen)", resumed, self.train_state.tokens_seen)
        self.hooks.after_load(resumed)
        shared = ("model", "optimizer", "lr_scheduler", "train_state")  # what a rejoining replica group copies
        self.fault_tolerance.share_state({k: states[k] for k in shared}, self.train_state, self._healed)

    def _healed(self, steps_skipped: int, step: int) -> None:
        """This replica group took a live peer's state at ``step``: its own data moves forward as many steps, and
        whoever follows the policy's weights (a rollout engine) gets the new ones, as after a load."""
        self.objective.skip_ahead(steps_skipped, step, self.grad_accum_steps)
        self.hooks.after_load(step)

    def _build_metrics(self) -> None:
        self.metrics = MetricsLogger(
            self.cfg.metrics,
            self.cfg.job.dump_folder,
            self.env.rank,
            run_config=asdict(self.cfg),
            aliases=self.objective.trl_metric_names,  # (logged under TRL's names too)
        )
        self.memory = MemoryMonitor(self.device)
        self.throughput = ThroughputTracker(
            flops_per_token=self.model_spec.flops_per_token(self.model_args, self.cfg.training.seq_len),
            peak_flops=get_peak_flops(self.device),
            devices_sharing_batch=self.dims.devices_sharing_batch,
        )

    # ----- the loop -----

    def train_step(self) -> tuple[StepResult, torch.Tensor, int]:
        """One optimizer step: its result (the loss sum over all ranks), the gradient norm, and its tokens."""
        self.fault_tolerance.start_step()  # (a replica group that rejoins takes a live peer's state and step here)
        data_start = time.perf_counter()
        microbatches = [self.objective.next_microbatch() for _ in range(self.grad_accum_steps)]
        self.throughput.add_data_time(time.perf_counter() - data_start)
        step = self.prepare_step(microbatches)
        result = self._committed_forward_backward(step)
        grad_norm = self._clip_grad_norm()
        other_norms = self._other_norms = [model.clip_grad_norm() for model in self.models.trained]
        result = dataclasses.replace(result, loss_sum=self._global_loss_sum(result.loss_sum))
        loss = result.loss_sum / result.units.clamp(min=1)
        self.guard.before_optimizer_step(self.train_state.step + 1, loss, grad_norm, other_norms)
        self.lr_used = self.lr_scheduler.get_last_lr()[0]  # (a copy: a tensor LR changes in place)
        self.checkpointer.maybe_wait_for_staging()
        self.guard.optimizer_step()  # (none applied if the step's loss or a gradient norm is not finite)
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        self.hooks.after_optimizer_step(self.train_state.step + 1)
        return result, grad_norm, step.tokens

    def prepare_step(self, microbatches: list[Batch]) -> PreparedStep:
        """The step's microbatches placed (CP: this rank's part of each sequence) on the device, through the
        objective's no-grad prepare phase, with the step's global unit count: all-reduced once, before the
        forward, without a host sync."""
        placed = [self.placement.place(mb) for mb in microbatches]
        prepare_start = time.perf_counter()
        with torch.no_grad():
            prepared = self.objective.prepare(placed)
        self.throughput.add_prepare_time(time.perf_counter() - prepare_start)
        batches = prepared.batches
        tokens = sum(mb.tokens.numel() for mb in batches) * self.dims.cp  # (whole sequences)
        return PreparedStep(batches, self._step_units(batches), prepared.metrics, tokens)

    def _step_units(self, batches: list[Batch]) -> torch.Tensor:
        """The loss units of a step's placed microbatches over the data- and context-parallel ranks: the loop's
        divisor of the step's loss sum (``ObjectiveContext.step_units``)."""
        local_units = torch.stack([mb.units() for mb in batches]).sum().to(self.device)
        return funcol.all_reduce(local_units, "sum", self.loss_group)

    def _committed_forward_backward(self, step: PreparedStep) -> StepResult:
        """The step's forward and backward, with gradients averaged over the live replica groups under fault
        tolerance. A step the groups do not commit (one died mid-step) is run again on the same prepared
        microbatches (prepare is not repeated: rollouts and reference log-probs stay), so no data is lost."""
        while True:
            result = self.executor.run(step)
            if self.fault_tolerance.commit_gradients(self.model):
                return result
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
            self.fault_tolerance.start_step()  # a new quorum, without the group that failed

    def forward_backward(self, microbatches: list[Batch], backward: bool = True) -> StepResult:
        """Prepare and run ``microbatches`` as one step (no optimizer step); ``backward=False``: the losses only."""
        return self.executor.run(self.prepare_step(microbatches), backward=backward)

    def _global_loss_sum(self, local: torch.Tensor) -> torch.Tensor:
        """The loss sum over all ranks, in one all-reduce and without a host sync: tensor-parallel ranks hold
        copies of one value (only tp rank 0 adds it); ranks that computed no loss hold zeros."""
        if self.meshes.tp.get_local_rank() != 0:
            local = torch.zeros_like(local)
        return funcol.all_reduce(local, "sum", dist.group.WORLD)

    @torch.no_grad()
    def _held_out_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Global (loss sum, count, metric sums and counts) of one held-out microbatch: the training forward under
        the same plan."""
        result = self.forward_backward([batch], backward=False)
        return self._global_loss_sum(result.loss_sum), result.units, self._global_metric_sums(result.metrics)

    def _clip_grad_norm(self) -> torch.Tensor:
        return self.executor.clip_grad_norm(self.cfg.training.max_norm)

    def train(self) -> None:
        t = self.cfg.training
        step = self.train_state.step
        if self.cfg.checkpoint.create_seed_checkpoint:
            self.checkpointer.save(0, final=True, model_only=True)
            logger.info("seed checkpoint written; train from it with the same --job.dump_folder at any layout")
            return
        if t.steps == 0:
            self.evaluate_only(step)
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
        if step == 0:  # the starting point, to compare with
            for task in self.evaluations:
                if task.at_start:
                    self.metrics.log(0, task.run(0))
        gc.disable()
        gc.collect()
        self.memory.reset_peak()
        profiler = Profiler(self.cfg.profiling, self.cfg.job.dump_folder, self.env.rank, start_step=step).start()
        while step < t.steps:
            self.throughput.start_step()
            result, grad_norm, tokens = self.train_step()
            step = self.train_state.step + 1  # (not step + 1: a replica group that rejoins takes its peer's step)
            self.throughput.end_step(tokens)
            self.train_state.step = step
            self.train_state.tokens_seen += tokens * self.dims.dp_degree
            if step == 1:
                set_train_timeout(self.cfg.comm)
            if step == 1 or step % self.cfg.metrics.log_freq == 0 or step == t.steps:
                self._log(step, result, grad_norm)
            if self.env.rank == 0 or self.metrics.active:  # (the ranks that print or write them)
                for name, table in self.objective.tables(step).items():
                    self.metrics.log_table(step, name, table)
                    if self.env.rank == 0:
                        logger.info("%s at step %d:\n%s", name, step, table.text())
            for task in self.evaluations:
                if task.due(step, t.steps):
                    self.metrics.log(step, task.run(step))
            if self.checkpointer.should_save(step, t.steps):
                self.guard.check(step)  # never save a state that follows a non-finite step it must stop on
                self.checkpointer.save(step, final=step == t.steps)
                if self.checkpointer.cfg.export_at_saves and step < t.steps:
                    self._export(step)
            self.checkpointer.poll()
            if step % t.gc_freq == 0:
                gc.collect(1)
            profiler.step(step)
        profiler.stop()
        gc.enable()
        logger.info("training done: %d steps, %d tokens", step, self.train_state.tokens_seen)
        self._export()

    def evaluate_only(self, step: int) -> None:
        """``--training.steps 0``: run every evaluation the config turns on, once, on the weights as loaded (the
        run's checkpoint, ``initial_load_path``, or a Hugging Face folder), log the numbers at ``step``, and
        stop: no optimizer step, no checkpoint, no export."""
        if not self.evaluations:
            raise ConfigError(
                "--training.steps 0 evaluates only, and no evaluation is on: set --validation.interval 1 (held-out "
                "loss of the objective) or --eval.interval 1 (exact match of generated answers)"
            )
        for task in self.evaluations:
            numbers = task.run(step)
            self.metrics.log(step, numbers)
            if self.env.rank == 0:
                logger.info("evaluation at step %d: %s", step, "  ".join(f"{k} {v:.4g}" for k, v in numbers.items()))

    def _export(self, step: int | None = None) -> None:
        """End of training (``step`` None): what the export hooks write (e.g. a converter's own artifacts), then the
        HF export and its upload. At a checkpoint save (``[checkpoint] export_at_saves``, ``step``): the same
        exports, each to its folder with ``-step-N`` added, and no upload."""
        ck = self.checkpointer.cfg  # (under fault tolerance only replica group 0 exports)
        ctx = ExportContext(
            spec=self.model_spec,
            args=self.model_args,
            dump_folder=Path(self.cfg.job.dump_folder),
            base_model_name_or_path=ck.initial_load_path if ck.initial_load_in_hf else None,
            pp_group=self.built.pp_group,
            step=step,
            save_tokenizer=self._save_tokenizer,
        )
        self.hooks.export(ctx)
        if not ck.last_save_in_hf:
            return
        path = export_final_hf(
            self.model,
            self.model_spec,
            self.model_args,
            ck if step is None else dataclasses.replace(ck, hf_folder=ctx.folder(ck.hf_folder)),
            dump_folder=self.cfg.job.dump_folder,
            flavor=self.cfg.model.flavor,
            pp_group=self.built.pp_group,
        )
        if path is not None:
            self._save_tokenizer(path)
        if step is None and ck.push_to_hub and path is not None:
            upload(path, ck.push_to_hub)

    def _save_tokenizer(self, folder: Path) -> None:
        """The run's tokenizer and chat template into an export folder, loadable by transformers' AutoTokenizer."""
        family_format = self.model_spec.chat_template or ""
        written = save_tokenizer(folder, self.tokenizer, self.cfg.chat.chat_template, family_format)
        if written:
            logger.info("wrote %s to %s", ", ".join(written), folder)

    def _log(self, step: int, result: StepResult, grad_norm: torch.Tensor) -> None:
        """The one place the loop syncs with the device: turn this step's tensors into numbers."""
        guard_scalars = self.guard.check(step)  # (stops the run here after a non-finite step, if configured)
        loss = (result.loss_sum / result.units.clamp(min=1)).item()
        objective_metrics = self._reduce_metrics(result.metrics)
        counters = self.objective.log_metrics()  # (host-side: skipped rows, long prompts, stale rollouts, ...)
        scalars = {
            "loss": loss,
            **guard_scalars,
            "grad_norm": grad_norm.item(),
            **{f"{m.name}/grad_norm": n.item() for m, n in zip(self.models.trained, self._other_norms)},
            "lr": float(self.lr_used),
            "tokens_seen": float(self.train_state.tokens_seen),
            **self.memory.stats(),
            **self.throughput.summary(step, self.cfg.training.steps),
            **objective_metrics,
            **counters,
            **self.fault_tolerance.metrics(),
            **{k: v for numbers in self.hooks.metrics(step) for k, v in numbers.items()},
        }
        self.memory.reset_peak()
        self.metrics.log(step, scalars)
        if self.env.rank == 0:
            color = not self.cfg.metrics.disable_color_printing and sys.stderr.isatty()
            names = (*self.executor.metrics.names, *counters)
            logger.info(format_log_line(step, self.cfg.training.steps, scalars, color, names))

    def _reduce_metrics(self, sums: torch.Tensor) -> dict[str, float]:
        """The objective's metrics of this step: sums and counts added over ranks, then divided."""
        names = self.executor.metrics.names
        if not names:
            return {}
        values = self._global_metric_sums(sums).view(-1, 2).tolist()
        return {name: total / count for name, (total, count) in zip(names, values) if count}

    def _global_metric_sums(self, sums: torch.Tensor) -> torch.Tensor:
        """The objective's ``[sum, count, ...]`` metric vector added over the ranks that computed parts of it (no
        host sync)."""
        for group in self.executor.metric_groups(self.loss_group):
            sums = funcol.all_reduce(sums, "sum", group)
        return sums

    def close(self) -> None:
        self.checkpointer.close()
        self.fault_tolerance.close()
        self.metrics.close()
        self.objective.close()  # last: a vLLM engine's teardown destroys the default process group
