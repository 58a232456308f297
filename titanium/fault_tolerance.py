"""Fault tolerance across replica groups with torchft: the trainer's hook object.

Each replica group is its own torchrun job with its own mesh (FSDP/TP inside it). A torchft lighthouse forms a
quorum of the live groups every step; a ``torchft.Manager`` owns the process group that joins the same rank of
every live group. Per step: ``start_step`` joins the quorum (a group that is behind, e.g. restarted, first copies
the model, optimizer, LR schedule and step from a live peer), the trainer runs forward and backward as usual,
``commit_gradients`` averages each rank's local gradient shards over the live groups and votes; a step no group
could finish (a peer died mid-step) is not applied, and the trainer repeats it on the same microbatches (prepared
once: the same rollouts, for GRPO).

Data is sharded over every group: a group's data rank is ``replica_id * dp + dp_rank`` of ``group_size * dp``; a
group that heals skips its own shard ahead to the step it joins at, and whoever follows the policy's weights (a
rollout engine) gets the healed ones (the trainer's ``healed`` callback). Only group 0 writes checkpoints; the
others are rebuilt from a live peer when they restart.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from titanium.checkpoint.states import TrainState
from titanium.config.sections import CheckpointSection, FaultToleranceSection
from titanium.errors import UserError

logger = logging.getLogger("titanium")


class NoFaultTolerance:
    """The hook when [fault_tolerance] is off: one group, every step commits, nothing to share."""

    def data_shard(self, dp_rank: int, dp_world: int) -> tuple[int, int]:
        return dp_rank, dp_world

    def checkpoint_section(self, cfg: CheckpointSection) -> CheckpointSection:
        return cfg

    def share_state(self, states: dict[str, Any], train_state: TrainState, healed: Callable[[int, int], None]) -> None:
        pass

    def start_step(self) -> None:
        pass

    def commit_gradients(self, model: nn.Module) -> bool:
        return True

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class FaultTolerance(NoFaultTolerance):
    """One replica group's link to the others, through a torchft Manager (see the module docstring)."""

    def __init__(self, cfg: FaultToleranceSection, device: torch.device) -> None:
        if "MASTER_PORT" not in os.environ:
            raise UserError(
                "--fault_tolerance.enable: launch each replica group with torchrun (its store, at MASTER_ADDR:"
                "MASTER_PORT, is where the group's torchft manager is found); see docs/fault_tolerance.md"
            )
        import torchft  # (the `ft` extra; the config check made sure it is installed)

        for name in ("torchft.manager", "torchft_quorums", "torchft_commits"):  # a record per step: keep warnings
            logging.getLogger(name).setLevel(logging.WARNING)
        self.cfg = cfg
        self._states: dict[str, Any] = {}
        self._participants = 0
        self._retried = 0
        self._local_sgd: Any = None  # (torchft.local_sgd.LocalSGD, once share_state knows the optimizer)
        timeout = timedelta(seconds=cfg.timeout_seconds)
        pg = torchft.ProcessGroupNCCL(timeout) if device.type == "cuda" else torchft.ProcessGroupGloo(timeout)
        self.manager = torchft.Manager(
            pg=pg,
            load_state_dict=self._load_peer_state,
            state_dict=self._state_for_peer,
            min_replica_size=cfg.min_replica_size,
            use_async_quorum=False,  # a rejoining group heals before its forward, then takes full part in the step
            init_sync=cfg.semi_sync_method == "none",  # (local_sgd: the first sync must average, not copy group 0)
            timeout=timeout,
            quorum_timeout=timedelta(seconds=cfg.quorum_timeout_seconds),
            connect_timeout=timeout,
            lighthouse_addr=cfg.lighthouse or None,  # (None: TORCHFT_LIGHTHOUSE)
            replica_id=f"titanium_rg{cfg.replica_id}",
            **({"hostname": cfg.hostname} if cfg.hostname else {}),
        )

    def data_shard(self, dp_rank: int, dp_world: int) -> tuple[int, int]:
        """This rank's data shard among every rank of every group: groups never read the same samples."""
        return self.cfg.replica_id * dp_world + dp_rank, self.cfg.group_size * dp_world

    def checkpoint_section(self, cfg: CheckpointSection) -> CheckpointSection:
        """Group 0 checkpoints as configured; the others write nothing (a restarted one heals from a peer)."""
        if self.cfg.replica_id == 0:
            return cfg
        if cfg.enable or cfg.last_save_in_hf:
            logger.info("replica group %d writes no checkpoints: group 0 does", self.cfg.replica_id)
        return dataclasses.replace(cfg, enable=False, last_save_in_hf=False)

    def share_state(self, states: dict[str, Any], train_state: TrainState, healed: Callable[[int, int], None]) -> None:
        """What a healing group copies from a live peer (Stateful objects by name, ``train_state`` among them).
        Its data position is not copied (the peer reads another shard): once the peer's state is in place,
        ``healed(steps_skipped, step)`` moves this group's own shard forward to the peer's step."""
        self._states, self._train_state, self._healed = states, train_state, healed
        # The manager counts commits (local_sgd: syncs); a group that counts fewer than a peer heals from it.
        local_sgd = self.cfg.semi_sync_method == "local_sgd"
        commits = train_state.step // self.cfg.sync_steps if local_sgd else train_state.step
        self.manager.load_state_dict({"step": commits, "batches_committed": 0})
        if local_sgd:
            from torchft.local_sgd import LocalSGD

            optimizer = states["optimizer"]  # (an OptimizerState: the model and its optimizer)
            self._local_sgd = LocalSGD(self.manager, optimizer.model, optimizer.optimizer, self.cfg.sync_steps)
            self._local_sgd.__enter__()  # optimizer hooks: average the weights every sync_steps steps

    def start_step(self) -> None:
        """Join this step's quorum; a group behind the others loads a live peer's state here."""
        if self._local_sgd is None:  # (local_sgd: the quorum is formed at each sync, inside the optimizer step)
            self.manager.start_quorum()

    def commit_gradients(self, model: nn.Module) -> bool:
        """Average the gradients over the live groups, then vote: True if the optimizer may step.

        Each rank all-reduces its local gradient shards with the same rank of the other groups (the groups have
        the same layout, so they hold the same shards). False: a group failed mid-step; the grads are garbage.
        With local_sgd every step commits: the groups' weights are averaged after some optimizer steps instead.
        """
        if self._local_sgd is not None:
            return True
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in model.parameters():
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(_local(p.grad))
        for grads in by_dtype.values():  # one all-reduce per dtype: one message to send, one error to report
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.manager.allreduce(flat).wait()  # (the average over the live groups)
            for grad, averaged in zip(grads, flat.split([g.numel() for g in grads])):
                grad.copy_(averaged.view_as(grad))
        committed = self.manager.should_commit()
        participants = self.manager.num_participants()
        if participants != self._participants:
            logger.info("fault tolerance: %d replica group(s) in step %d", participants, self.manager.current_step())
            self._participants = participants
        self._retried += not committed
        return committed

    def metrics(self) -> dict[str, float]:
        return {
            "fault_tolerance/replica_groups": float(
                self.manager.num_participants() if self._local_sgd is not None else self._participants
            ),
            "fault_tolerance/retried_steps": float(self._retried),
        }

    def close(self) -> None:
        if self._local_sgd is not None:
            self._local_sgd.__exit__(None, None, None)
        self.manager.shutdown(wait=False)

    # ----- what travels between groups when one heals -----

    def _state_for_peer(self) -> dict[str, Any]:
        """Sharded tensors travel as their local shards: rank r of the healing group gets rank r's shards."""
        return {name: tree_map_only(DTensor, _local, state.state_dict()) for name, state in self._states.items()}

    def _load_peer_state(self, received: dict[str, Any]) -> None:
        own_step = self._train_state.step
        specs = {k: v for k, v in self._states["model"].state_dict().items() if isinstance(v, DTensor)}
        for name, state in self._states.items():
            state.load_state_dict({k: _as_sharded(k, v, specs) for k, v in received[name].items()})
        step = self._train_state.step
        logger.info("fault tolerance: healed from a live replica group at step %d", step)
        self._healed(max(0, step - own_step), step)  # (a peer behind this group heals from it: nothing to skip)


def build_fault_tolerance(cfg: FaultToleranceSection, device: torch.device) -> NoFaultTolerance:
    return FaultTolerance(cfg, device) if cfg.enable else NoFaultTolerance()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _as_sharded(key: str, value: Any, specs: dict[str, DTensor]) -> Any:
    """A received local shard back as a DTensor shaped like this rank's parameter of that name: model keys are
    parameter names, flattened optimizer keys ``state.<name>.<moment>`` (scalars such as ``step`` stay plain)."""
    name = key.removeprefix("state.").rsplit(".", 1)[0] if key.startswith("state.") else key
    spec = specs.get(name)
    if spec is None or not isinstance(value, torch.Tensor) or value.dim() != spec.dim() or value.dim() == 0:
        return value
    local = value.to(spec.to_local().device)  # (torchft's transfer lands on the CPU)
    return DTensor.from_local(local, spec.device_mesh, spec.placements, shape=spec.shape, stride=spec.stride())
