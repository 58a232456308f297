"""ParallelDims: the parallel degrees, checked against the world size, and the DeviceMesh they make."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanium.config.loader import ConfigError
from titanium.config.sections import ParallelismSection


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    world_size: int

    @classmethod
    def from_config(cls, cfg: ParallelismSection, world_size: int) -> ParallelDims:
        """Resolve -1 degrees and check that the degrees multiply to the world size."""
        replicate, shard = cfg.data_parallel_replicate_degree, cfg.data_parallel_shard_degree
        if shard == -1:
            if world_size % replicate:
                raise ConfigError(
                    f"--parallelism.data_parallel_replicate_degree={replicate} must divide the world size {world_size}"
                )
            shard = world_size // replicate
        if replicate * shard != world_size:
            raise ConfigError(
                f"data_parallel_replicate_degree ({replicate}) x data_parallel_shard_degree ({shard}) = "
                f"{replicate * shard}, but the world size is {world_size}; set "
                "--parallelism.data_parallel_shard_degree -1 to use the rest of the world"
            )
        return cls(dp_replicate=replicate, dp_shard=shard, world_size=world_size)

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_degree > 1

    def build_meshes(self, device_type: str) -> Meshes:
        """One mesh with named dims ("dp_replicate", "dp_shard"), and views of it for each use."""
        world = init_device_mesh(
            device_type, (self.dp_replicate, self.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard")
        )
        return Meshes(
            world=world,
            dp=world["dp_replicate", "dp_shard"]._flatten("dp"),
            fsdp=world["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else world["dp_shard"],
        )


@dataclass(frozen=True)
class Meshes:
    """The job's DeviceMesh and the views the plan uses (kept, since slicing flattened dims is deprecated)."""

    world: DeviceMesh
    dp: DeviceMesh
    """All data-parallel ranks, flattened: data sharding and the global loss-unit count use it."""
    fsdp: DeviceMesh
    """What FSDP shards over: 1-D dp_shard, or 2-D (dp_replicate, dp_shard) for HSDP."""
