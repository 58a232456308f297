"""Handles on the models an objective uses besides the one it trains, each with a lifetime its owner controls.

- A **frozen** handle: a model run without gradients (a DPO/GRPO reference, a distillation teacher), built by the
  job's one ``ModelBuilder`` under the same parallel plan as the policy, when it first runs, and freed when every
  owner has released it (``release``). It declares which of the policy's converters it keeps (``keep``, by
  converter name; the rest are dropped). When it is the policy as it started (``source`` left out), a converter
  froze the policy's base (LoRA) and every dropped converter can be switched off in place, it *is* the policy
  with those switched off: no second copy. Otherwise (a converter that cannot be switched off, such as float8;
  another model) it is a separate copy built with the kept converters only.
- The **policy** handle: the live model being trained, lent for generation, run forward-only (recomputed
  log-probs), and followed by a rollout engine's copy of its weights (``on_update``).
- A **trainable** model: another model trained beside the policy (a PPO value model), built by the same builder
  and plan, with an AdamW of its own that the loop steps, clips, skips and checkpoints with the policy's.

Objectives get a ``ModelHandles`` in their context (``ctx.models``) and never reach the trainer.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titanium.batch import Batch
from titanium.checkpoint.states import ModelState, OptimizerState
from titanium.hooks import TrainingHooks
from titanium.model_builder import BuiltModel, FrozenModel, ModelBuilder, ModelSource
from titanium.models.converter import can_switch_off
from titanium.models.spec import ModelSpec
from titanium.parallel.grad_norm import clip_grad_norm
from titanium.precision import dtype_name


def is_the_policy(policy: BuiltModel, start: ModelSource, keep: Collection[str], source: ModelSource) -> bool:
    """Whether a frozen model of ``source`` keeping the converters named in ``keep`` is ``policy`` itself with the
    others switched off (no copy): ``source`` is the policy as it started (``start``), a dropped converter froze the
    base (LoRA), and every dropped one can be switched off."""
    dropped = [c for c in policy.converters if c.name not in keep]
    return source == start and any(c.freezes_base for c in dropped) and can_switch_off(dropped, policy.model)


@dataclass
class _Shared:
    """One frozen model, what it is built from, and how many live handles hold it."""

    source: ModelSource
    holders: int = 0
    model: FrozenModel | None = None


class FrozenHandle:
    """A frozen model for one owner: call it on a microbatch (as ``prepare`` gets it) for its logits ``[rows,
    seq, vocab]`` (float32, full vocabulary; None on pipeline ranks without the last stage)."""

    def __init__(self, handles: ModelHandles, key: tuple, identity: str) -> None:
        self._handles, self._key = handles, key
        self.id = identity
        """What the model's outputs depend on (family, args, weights and their files, converters, precision), for
        an owner that caches them: a different id means stale outputs."""
        self.released = False

    @torch.no_grad()
    def __call__(self, batch: Batch) -> torch.Tensor | None:
        assert not self.released, "a released model handle was run"
        return self._handles._model(self._key)(batch.model_inputs())

    @torch.no_grad()
    def hidden(self, batch: Batch) -> torch.Tensor:
        """Its final hidden states ``[rows, seq, dim]`` for a microbatch, unprojected (not under pipeline
        parallelism); project them with ``projection()``."""
        assert not self.released, "a released model handle was run"
        return self._handles._model(self._key).hidden(batch.model_inputs())

    def projection(self) -> tuple[torch.Tensor, float | None]:
        """Its output projection's whole weight ``[vocab, dim]`` (a copy under FSDP) and final logit soft-cap."""
        assert not self.released, "a released model handle was run"
        return self._handles._model(self._key).projection()

    def release(self) -> None:
        """This owner is done: the model is freed once no other handle holds it (built again if asked later)."""
        if not self.released:
            self.released = True
            self._handles._release(self._key)


class PolicyHandle:
    """The live policy (the model being trained, sharded as it trains): lent for generation, run forward-only
    (log-probs of rollouts under the weights as they train), and followed by whoever keeps a copy of its weights."""

    def __init__(
        self,
        built: BuiltModel,
        hooks: TrainingHooks,
        forward: Callable[[], FrozenModel],
        param_dtype: torch.dtype,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        self._built, self._hooks, self._make_forward = built, hooks, forward
        self._forward: FrozenModel | None = None
        self.param_dtype = param_dtype
        """The training forward's parameter precision (what a copy for generation computes in by default)."""
        self.tp_group = tp_group
        """The policy's tensor-parallel group (None without tensor parallelism): its ranks hold the same rows."""

    def on_update(self, function: Callable[[int], None]) -> None:
        """Call ``function(step)`` whenever the policy's weights change: once they are in place at the start
        (loaded or initialized; step 0 or the resumed step) and after every optimizer step, e.g. to sync a rollout
        engine's weights. Under FSDP every rank calls it: gather the weights together."""
        self._hooks.after_load.register(function)
        self._hooks.after_optimizer_step.register(function)

    @property
    def spec(self) -> ModelSpec:
        """The policy's family (its Hugging Face adapter names the weights for an engine)."""
        return self._built.spec

    @property
    def args(self) -> Any:
        """The policy's model args (its flavor), for building an unsharded copy."""
        return self._built.args

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The pipeline group when the policy's stages are spread over ranks (weights gather over it), else None."""
        return self._built.pp_group

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The live policy's logits (float32, full vocabulary) on model inputs, without gradients, under the training
        forward's precision, through its pipeline when it has one (None on ranks without the last stage). Every rank
        of the model's layout calls it together."""
        if self._forward is None:
            self._forward = self._make_forward()
        return self._forward(inputs)

    @property
    def model(self) -> nn.Module:
        """The live model itself, as it trains (for tools that manage its mode themselves)."""
        return self._built.model

    @contextlib.contextmanager
    def lend(self) -> Iterator[nn.Module]:
        """The policy in eval mode, without gradients, under the training forward's mixed precision; in train mode
        again afterwards. Under FSDP every forward is a collective: all data-parallel ranks generate together."""
        model = self._built.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), self._built.autocast():
                yield model
        finally:
            model.train(was_training)


class TrainableModel:
    """A model trained beside the policy, named ``name``: its AdamW (``lr``, no weight decay, a constant rate) is
    stepped by the loop after the same backward as the policy's, its gradients clipped to ``max_norm`` apart from
    the policy's, the step skipped with the policy's under the guard, and both saved in checkpoints as
    ``<name>_model`` and ``<name>_optimizer``.

    Without pipeline stages the owner runs ``model`` under ``autocast()`` inside the policy's loss, so the loop's
    backward fills its gradients. With stages no single rank runs it whole: ``train_step`` runs forward and backward
    of one microbatch through a schedule of its own (every rank of the pipeline together), the owner's loss on its
    last stage. ``forward`` runs it without gradients either way."""

    def __init__(
        self, built: BuiltModel, builder: ModelBuilder, batch_size: int, *, name: str, lr: float, max_norm: float
    ) -> None:
        self.built, self.model, self.autocast = built, built.model, built.autocast
        self.name, self.max_norm = name, max_norm
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0, fused=True)  # (skips on device)
        self.pipelined = built.pipeline is not None
        self._no_grad = FrozenModel(builder.scheduled(built, batch_size), contextlib.nullcontext)
        self._training = builder.scheduled(built, batch_size, loss_fn=lambda out, rows: self._loss(out, rows))
        self._loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _no_loss

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The pipeline group when its stages are spread over ranks (its gradient norm adds up over it)."""
        return self.built.pp_group

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Its output on model inputs without gradients, under the training precision (None on pipeline ranks
        without the last stage)."""
        return self._no_grad(inputs)

    def clip_grad_norm(self) -> torch.Tensor:
        """The norm of its gradients over every rank (0 without any), which are scaled down to ``max_norm`` first if
        larger (0: no clip)."""
        return clip_grad_norm(self.params, self.max_norm, self.pp_group, device=self.params[0].device)

    def checkpoint_states(self) -> dict[str, Any]:
        """Its weights and its optimizer's moments (sharded as they train; DCP reshards on load), by checkpoint key."""
        return {
            f"{self.name}_model": ModelState(self.model),
            f"{self.name}_optimizer": OptimizerState(self.model, self.optimizer),
        }

    def train_step(
        self, inputs: dict[str, torch.Tensor], loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> None:
        """Forward and backward of one microbatch through its pipeline: ``loss(last stage output, rows)`` gets the
        indices of the rows each pipeline microbatch holds and returns what to backpropagate."""
        assert self._training.pipeline is not None, "train_step is for a pipelined model (else run it in the loss)"
        self._loss = loss
        try:
            with torch.enable_grad(), self.autocast():
                self._training.pipeline.step(inputs)
        finally:
            self._loss = _no_loss


def _no_loss(output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    raise AssertionError("a trainable model's pipeline ran outside train_step")


class ModelHandles:
    """The models of a job an objective may ask for (``ctx.models``): frozen ones and the live policy.

    ``start`` is the policy as it started (its family, args and starting weights), ``batch_size`` the rows a
    frozen model's pipeline schedule takes at once (the microbatch size).
    """

    def __init__(
        self, builder: ModelBuilder, policy: BuiltModel, start: ModelSource, hooks: TrainingHooks, *, batch_size: int
    ) -> None:
        self.builder, self.built, self.start, self.batch_size = builder, policy, start, batch_size
        self.hooks = hooks
        self._shared: dict[tuple, _Shared] = {}
        self.trained: list[TrainableModel] = []
        """The models trained beside the policy, in the order asked for: the loop steps their optimizers."""

    def frozen(self, *, keep: Collection[str] = (), source: ModelSource | None = None) -> FrozenHandle:
        """A handle on a frozen model: ``source`` (default: the policy as it started) with the policy's converters
        named in ``keep`` (default: none). Nothing is built until it first runs."""
        source = source or self.start
        identity = self._identity(frozenset(keep), source)
        key = (frozenset(keep), identity)
        self._shared.setdefault(key, _Shared(source)).holders += 1
        return FrozenHandle(self, key, identity)

    def trainable(self, source: ModelSource, *, name: str, lr: float, max_norm: float) -> TrainableModel:
        """Another model trained beside the policy (a PPO value model): built now from ``source`` by the job's
        builder under the same parallel plan, without converters, in train mode; the loop steps its AdamW (``lr``)
        with the policy's optimizer, clipping its gradients to ``max_norm``, and checkpoints both under ``name``."""
        assert all(t.name != name for t in self.trained), f"a trainable model named {name!r} exists"
        built = self.builder.build(source.spec, source.args, weights=source.weights)
        model = TrainableModel(built, self.builder, self.batch_size, name=name, lr=lr, max_norm=max_norm)
        self.trained.append(model)
        return model

    def policy(self) -> PolicyHandle:
        plan, dims, meshes = self.builder.plan, self.builder.dims, self.builder.meshes
        return PolicyHandle(
            self.built,
            self.hooks,
            lambda: self.builder.switched_off(self.built, [], batch_size=self.batch_size),
            plan.param_dtype if plan is not None else torch.float32,
            tp_group=meshes.tp.get_group() if dims is not None and dims.tp > 1 and meshes is not None else None,
        )

    # ----- one built model per (keep, source), shared by the handles that hold it -----

    def _in_place(self, keep: frozenset[str], source: ModelSource) -> bool:
        return is_the_policy(self.built, self.start, keep, source)

    def _identity(self, keep: frozenset[str], source: ModelSource) -> str:
        converters = self.built.converters
        if not self._in_place(keep, source):
            converters = [c for c in converters if c.name in keep]
        precision = dtype_name(self.builder.plan.param_dtype if self.builder.plan is not None else torch.float32)
        weights = source.weights.fingerprint() or f"initialized with seed {self.builder.seed}"
        parts = [source.spec.name, repr(source.args), weights, *(c.describe() for c in converters), precision]
        return "\n".join(parts)

    def _model(self, key: tuple) -> FrozenModel:
        shared = self._shared[key]
        if shared.model is None:
            keep, source = key[0], shared.source
            if self._in_place(keep, source):
                dropped = [c for c in self.built.converters if c.name not in keep]
                shared.model = self.builder.switched_off(self.built, dropped, batch_size=self.batch_size)
            else:
                kept = [c for c in self.built.converters if c.name in keep]
                shared.model = self.builder.frozen_copy(
                    source.spec, source.args, source.weights, converters=kept, batch_size=self.batch_size
                )
        return shared.model

    def _release(self, key: tuple) -> None:
        shared = self._shared[key]
        shared.holders -= 1
        if shared.holders == 0:
            built = shared.model is not None
            del self._shared[key]
            if built:
                gc.collect()  # (cycles in the modules: free the memory now, not at the next collection)
