"""ParallelDims: the parallel degrees, checked against the world size and the model, and the DeviceMesh.

One mesh with named dims ``(pp, dp_replicate, dp_shard, cp, tp)``, outermost first: tensor parallelism
talks the most, so its ranks are adjacent (same node); pipeline parallelism talks the least. Size-1
dims are kept so every view exists in every layout.

Expert parallelism borrows its ranks from ``dp_shard x cp`` (as torchtitan does): with it a second mesh over the
same ranks, ``(pp, dp_replicate, efsdp, ep, tp)`` with ``efsdp x ep = dp_shard x cp``, places the experts, so the
``ep`` ranks of one group are neighbours in the data-parallel order.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from titanium.config.loader import ConfigError
from titanium.config.sections import ParallelismSection
from titanium.models.common.decoder import DecoderArgs
from titanium.models.common.moe import MoEArgs

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    """Expert parallel degree, carved out of dp_shard x cp."""
    loss_parallel: bool = True
    """Wanted by the config; in effect only with tp > 1 (see loss_parallel_enabled)."""

    @classmethod
    def from_config(cls, cfg: ParallelismSection, world_size: int) -> ParallelDims:
        """Resolve data_parallel_shard_degree = -1 and check that the degrees multiply to the world size.

        Runs before any process group exists, so a wrong layout costs nothing.
        """
        replicate, shard = cfg.data_parallel_replicate_degree, cfg.data_parallel_shard_degree
        tp, pp, cp = cfg.tensor_parallel_degree, cfg.pipeline_parallel_degree, cfg.context_parallel_degree
        others = replicate * tp * pp * cp
        named = (
            f"data_parallel_replicate_degree ({replicate}) x tensor_parallel_degree ({tp}) x "
            f"pipeline_parallel_degree ({pp}) x context_parallel_degree ({cp})"
        )
        if shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"{named} = {others} must divide the world size {world_size}; "
                    f"products that divide it: {_divisors(world_size)}"
                )
            shard = world_size // others
        if others * shard != world_size:
            raise ConfigError(
                f"{named} x data_parallel_shard_degree ({shard}) = {others * shard}, but the world size is "
                f"{world_size}; set --parallelism.data_parallel_shard_degree -1 to use the rest of the world"
            )
        ep = cfg.expert_parallel_degree
        if (shard * cp) % ep:
            raise ConfigError(
                f"--parallelism.expert_parallel_degree {ep} must divide data_parallel_shard_degree x "
                f"context_parallel_degree = {shard} x {cp} = {shard * cp} (expert parallelism borrows those ranks); "
                f"valid degrees: {_divisors(shard * cp)}"
            )
        return cls(
            dp_replicate=replicate,
            dp_shard=shard,
            world_size=world_size,
            tp=tp,
            pp=pp,
            cp=cp,
            ep=ep,
            loss_parallel=cfg.enable_loss_parallel,
        )

    def check_model(self, args: DecoderArgs, *, model: str, seq_len: int) -> None:
        """Model-aware checks, once the model's args are known (before anything is allocated)."""
        n_heads, n_layers, vocab_size, n_kv_heads = args.n_heads, args.n_layers, args.vocab_size, args.n_kv_heads
        tp_flag = f"--parallelism.tensor_parallel_degree {self.tp}"
        if self.tp > 1:
            for what, n in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("vocab_size", vocab_size)):
                if n % self.tp:
                    raise ConfigError(f"{tp_flag} must divide {what}={n} of {model}; valid degrees: {_divisors(n)}")
            if seq_len % self.tp:
                raise ConfigError(
                    f"{tp_flag} must divide --training.seq_len {seq_len} (sequence parallelism splits the "
                    f"sequence between the norms); valid degrees: {_divisors(seq_len)}"
                )
        if self.cp > 1:
            cp_flag = f"--parallelism.context_parallel_degree {self.cp}"
            if seq_len % (2 * self.cp):
                raise ConfigError(
                    f"--training.seq_len {seq_len} must be divisible by 2 x {cp_flag} (each rank keeps one chunk "
                    f"from the head and one from the tail of every sequence); valid degrees: "
                    + ", ".join(str(c) for c in range(1, seq_len // 2 + 1) if seq_len % (2 * c) == 0)
                )
            if (seq_len // self.cp) % self.tp:
                raise ConfigError(
                    f"--parallelism.tensor_parallel_degree {self.tp} must divide the per-rank sequence "
                    f"seq_len / context_parallel_degree = {seq_len // self.cp}"
                )
        self.check_experts(args.moe, model=model)
        if self.pp > n_layers:
            raise ConfigError(
                f"--parallelism.pipeline_parallel_degree {self.pp} is more than the {n_layers} layers of {model}"
            )

    def check_experts(self, moe: MoEArgs | None, *, model: str) -> None:
        """Expert parallelism needs experts, as many as a multiple of its degree (also a preflight check)."""
        if self.ep == 1:
            return
        ep_flag = f"--parallelism.expert_parallel_degree {self.ep}"
        if moe is None:
            raise ConfigError(f"{ep_flag}: {model} is a dense model, it has no experts to divide; use 1")
        experts = moe.num_experts
        if experts % self.ep:
            valid = [d for d in range(1, experts + 1) if experts % d == 0 and (self.dp_shard * self.cp) % d == 0]
            raise ConfigError(
                f"{ep_flag} must divide the {experts} experts of {model}; valid degrees with this layout: "
                + ", ".join(map(str, valid))
            )

    def grad_accum_steps(self, local_batch_size: int, global_batch_size: int) -> int:
        """Microbatches per optimizer step: global / (local x data-parallel degree); -1 global means one.

        A config check (it runs before any process group exists): a global batch that the data-parallel
        ranks cannot split evenly into whole microbatches is refused, with the sizes that would work.
        """
        per_step = local_batch_size * self.dp_degree
        if global_batch_size == -1:
            return 1
        if global_batch_size % per_step:
            valid = ", ".join(str(per_step * k) for k in range(1, 4))
            raise ConfigError(
                f"--training.global_batch_size {global_batch_size} must be a multiple of --training.local_batch_size "
                f"x data-parallel degree = {local_batch_size} x {self.dp_degree} = {per_step} (e.g. {valid}, ...), "
                "or -1 for one microbatch per step"
            )
        return global_batch_size // per_step

    @property
    def dp_degree(self) -> int:
        """Data-parallel ranks: each reads different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_degree * self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def loss_parallel_enabled(self) -> bool:
        return self.tp > 1 and self.loss_parallel

    @property
    def params_sharded(self) -> bool:
        """Whether parameters become DTensors (sharded or replicated over some mesh)."""
        return self.fsdp_enabled or self.tp_enabled

    @property
    def sequence_multiple(self) -> int:
        """What every sequence width must be a multiple of (``check_model`` checks seq_len): 2 x cp (each context
        rank keeps a chunk from the head and one from the tail) and cp x tp (sequence parallelism splits each
        context rank's part over the tensor ranks)."""
        return math.lcm(2 * self.cp if self.cp > 1 else 1, self.cp * self.tp)

    @property
    def devices_sharing_batch(self) -> int:
        """Ranks that work on the same tokens (for tokens/s per device)."""
        return self.tp * self.cp * self.pp

    def build_meshes(self, device_type: str) -> Meshes:
        """One mesh with all five named dims, the views the plan uses, and the experts' mesh under EP."""
        from torch.distributed.device_mesh import init_device_mesh

        world = init_device_mesh(
            device_type, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp), mesh_dim_names=MESH_DIMS
        )
        dp = world["dp_replicate", "dp_shard"]._flatten("dp")
        if self.cp == 1:
            shard_cp = world["dp_shard"]
            loss = dp
            hsdp = world["dp_replicate", "dp_shard"]
        else:
            shard_cp = world["dp_shard", "cp"]._flatten("dp_shard_cp")
            loss = world["dp_replicate", "dp_shard", "cp"]._flatten("loss")
            with warnings.catch_warnings():  # slicing a flattened dim: deprecated, no replacement yet
                warnings.simplefilter("ignore")
                hsdp = world["dp_replicate", "dp_shard_cp"]
        ep = expert_fsdp = None
        if self.ep > 1:
            efsdp = self.dp_shard * self.cp // self.ep
            sparse = init_device_mesh(
                device_type,
                (self.pp, self.dp_replicate, efsdp, self.ep, self.tp),
                mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep", "tp"),
            )
            ep = sparse["ep"]
            expert_fsdp = sparse["dp_replicate", "efsdp"] if self.dp_replicate > 1 else sparse["efsdp"]
        return Meshes(
            world=world,
            dp=dp,
            fsdp=hsdp if self.dp_replicate > 1 else shard_cp,
            loss=loss,
            tp=world["tp"],
            cp=world["cp"],
            pp=world["pp"],
            ep=ep,
            expert_fsdp=expert_fsdp,
        )


@dataclass(frozen=True)
class Meshes:
    """The job's DeviceMesh and the views the plan uses (kept, since slicing flattened dims is deprecated)."""

    world: DeviceMesh
    dp: DeviceMesh
    """All data-parallel ranks, flattened (dp_replicate x dp_shard): data sharding uses it."""
    fsdp: DeviceMesh
    """What FSDP shards over: 1-D dp_shard_cp, or 2-D (dp_replicate, dp_shard_cp) for HSDP."""
    loss: DeviceMesh
    """Ranks whose loss units add up to the step's global count: dp x cp."""
    tp: DeviceMesh
    cp: DeviceMesh
    pp: DeviceMesh
    ep: DeviceMesh | None = None
    """The experts' ranks under expert parallelism (None without)."""
    expert_fsdp: DeviceMesh | None = None
    """What FSDP shards the experts over under expert parallelism: efsdp, or (dp_replicate, efsdp) for HSDP."""
