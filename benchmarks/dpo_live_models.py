"""Full models still alive when a run ends: ``python benchmarks/dpo_live_models.py <titanium.train args>``.

Runs ``titanium.train`` in this process and, just before the end-of-training export, counts the live decoder
models that hold weights (``gc``), sums the storage of every live CPU tensor and reads the peak RSS. Used for the
``precompute_reference`` table in docs/post_training.md (a DPO run whose reference must be freed once its cache
exists); run it with ``PYTHONPATH`` at the checkout to measure.
"""

from __future__ import annotations

import gc
import resource
import sys

import torch
from torch import nn

import titanium.train
from titanium.trainer import Trainer


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        try:
            storage = t.untyped_storage()
            key = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # (tensors without real storage)
            continue
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def report(trainer: Trainer) -> None:
    gc.collect()
    objects = gc.get_objects()
    models = [o for o in objects if isinstance(o, nn.Module) and hasattr(o, "tok_embeddings") and hasattr(o, "layers")]
    sizes = [_storage_bytes(p for p in m.parameters() if p.device.type != "meta") for m in models]
    sizes = [s for s in sizes if s]
    live = _storage_bytes(o for o in objects if isinstance(o, torch.Tensor) and o.device.type == "cpu")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"models with weights: {len(sizes)} {sizes}; live tensor storage {live}; peak RSS {peak:.3f} GiB")


if __name__ == "__main__":
    export = Trainer._export

    def _export(self: Trainer) -> None:
        report(self)
        export(self)

    Trainer._export = _export  # type: ignore[method-assign]
    sys.exit(titanium.train.main(sys.argv[1:]))
