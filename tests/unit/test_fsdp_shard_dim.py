"""Where FSDP splits each parameter (``titanium.parallel.fsdp.shard_dim``): a parameter with fewer rows than FSDP's
shards is split along its largest dimension instead, judged by the rows this rank holds. An expert-parallel DTensor
holds ``num_experts / ep`` of the experts: Llama 4 Scout's 16 over EP 8 leave 2 a rank, which FSDP's 8-way row split
would give to 2 of the 8 ranks (the dry run measured 6.2B parameters a rank instead of 1.7B on 64 ranks). The
layout's numbers are tested in tests/distributed/test_moe_layouts.py (``ep2_fsdp2_one_expert``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from titanium.parallel.fsdp import shard_dim


def test_rows_fewer_than_shards_split_the_largest_dimension_of_the_local_part():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert shard_dim(nn.Parameter(torch.empty(16, 8, 4, device="meta")), 8) is None  # (FSDP's default: rows)
    assert shard_dim(nn.Parameter(torch.empty(4, 8, 32, device="meta")), 8) == Shard(2)
    assert shard_dim(nn.Parameter(torch.empty(4, 2, 3, device="meta")), 8) is None  # (no dimension has 8 rows)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        mesh = init_device_mesh("cpu", (8,))
        local = torch.empty(2, 64, 16, device="meta")  # (16 experts over EP 8: 2 here)
        experts = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))
        assert experts.shape[0] == 16 and shard_dim(experts, 8) == Shard(1)
    finally:
        dist.destroy_process_group()
