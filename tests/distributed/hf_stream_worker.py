"""Load Hugging Face folders into several parallel layouts in one launch, and record what each rank read.

Run as ``python -m tests.distributed.hf_stream_worker OUT FOLDER...`` under torchrun with 4 processes. For every
folder (built by the native family that reads it, else the transformers backend) and every layout of ``LAYOUTS``
that fits its model and that its spec does not refuse, each rank builds the model sharded by that layout,
loads the folder, gathers every weight and compares it with the whole-checkpoint reference (``from_hf`` of
every tensor, the loader before per-rank streaming) and with a one-process load. It writes
``OUT/rank{r}.json``: per folder and layout, the names that differ (none expected) and the bytes this rank read.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import titanium.checkpoint.hf as hf
from titanium.checkpoint.hf import HFCheckpoint, hf_model_args
from titanium.config.sections import ActivationCheckpointSection, CompileSection, ModelSection, ParallelismSection
from titanium.model_builder import ModelBuilder, WeightSource, resolve_spec
from titanium.models.spec import ModelUse
from titanium.parallel.dims import ParallelDims
from titanium.parallel.parallelize import PlanConfig

LAYOUTS = {  # name -> ([parallelism] settings, needs experts); the shard counts are 1, 2 and 4
    "replicate4": ({"data_parallel_replicate_degree": 4}, False),
    "hsdp2x2": ({"data_parallel_replicate_degree": 2}, False),
    "fsdp4": ({}, False),
    "tp2_fsdp2": ({"tensor_parallel_degree": 2}, False),
    "ep2_fsdp2": ({"expert_parallel_degree": 2}, True),
    "ep4": ({"expert_parallel_degree": 4}, True),
}


class CountingReader(hf.SliceReader):
    """The loader's reader, adding up the bytes this rank reads from the files."""

    total = 0

    def __exit__(self, *exc_info) -> None:  # type: ignore[no-untyped-def]
        CountingReader.total += self.bytes_read
        super().__exit__(*exc_info)


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}


def differences(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> list[str]:
    return [key for key, value in reference.items() if not torch.equal(state[key], value)]


def main() -> None:
    out, folders = Path(sys.argv[1]), [Path(f) for f in sys.argv[2:]]
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    hf.SliceReader = CountingReader  # (the loader looks the class up at call time)
    cpu = torch.device("cpu")
    results: dict[str, dict[str, dict]] = {}
    for folder in folders:
        spec = resolve_spec(ModelSection(), folder)[0]
        args = hf_model_args(spec, folder)
        ckpt = HFCheckpoint.open(folder)
        whole = {k: v.float() for k, v in spec.hf_adapter.from_hf(ckpt.read(), args).items()}
        CountingReader.total = 0
        state = full_state(ModelBuilder(cpu).load_hf(spec, folder).model)
        results[folder.name] = {"one_process": {"differ": differences(state, whole), "bytes": CountingReader.total}}
        experts = hasattr(args, "num_experts")
        for name, (settings, needs_experts) in LAYOUTS.items():
            parallelism = ParallelismSection(**settings)
            use = ModelUse(parallelism.tensor_parallel_degree, expert_parallel=parallelism.expert_parallel_degree)
            if (needs_experts and not experts) or (spec.refusals is not None and spec.refusals(args, use)):
                continue
            dims = ParallelDims.from_config(parallelism, world)
            plan = PlanConfig(parallelism, ActivationCheckpointSection(), CompileSection(), param_dtype=torch.float32)
            builder = ModelBuilder(cpu, 0, dims, dims.build_meshes("cpu"), plan)
            CountingReader.total = 0
            model = builder.build(spec, args, weights=WeightSource(hf_folder=str(folder))).model
            read = CountingReader.total
            results[folder.name][name] = {"differ": differences(full_state(model), state), "bytes": read}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
