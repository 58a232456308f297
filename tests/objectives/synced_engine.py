"""``python -m tests.objectives.synced_engine <titanium.train args>``: training with a titanium rollout engine that
gets the trained weights after every optimizer step, as the loop's after-step hook will hand them over.

Each rank keeps its own engine (an unsharded copy of the policy), synced from the training model in whatever layout
it trains (``RolloutEngine.sync_from``: block by block, LoRA merged, converters undone). At the end every rank writes
its engine's weights to ``<dump_folder>/engine/rank<r>.safetensors``, next to the trainer's own Hugging Face export
(``--checkpoint.last_save_in_hf``), and the engine's log-probs of fixed sequences to ``rank<r>_logprobs.pt``;
``assert_engines_hold_the_export`` reads them back and compares.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from titanium.checkpoint.hf import HFCheckpoint
from titanium.generation.titanium_engine import TitaniumEngine
from titanium.models import get_model_spec
from titanium.trainer import Trainer

_train_step, _export = Trainer.train_step, Trainer._export


def _engine(trainer: Trainer) -> TitaniumEngine:
    if not hasattr(trainer, "engine"):
        trainer.engine = TitaniumEngine(
            trainer.model_spec, trainer.model_args, stop_ids={0}, pad_id=0, device=trainer.device
        )
    return trainer.engine


def train_step_then_sync(self: Trainer):
    out = _train_step(self)
    _engine(self).sync_from(self.model, self.train_state.step + 1, self.built.pp_group)
    return out


def export_with_engine(self: Trainer) -> None:
    _export(self)
    write_engine(self, _engine(self))


def write_engine(trainer: Trainer, engine: TitaniumEngine) -> None:
    """This rank's ``engine``'s weights and its log-probs of fixed sequences, in ``<dump_folder>/engine``."""
    folder = Path(trainer.cfg.job.dump_folder) / "engine"
    folder.mkdir(exist_ok=True)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    state = {k: _whole(v).detach().cpu().contiguous() for k, v in engine.model.state_dict().items()}
    save_file(state, str(folder / f"rank{rank}.safetensors"), metadata={"version": str(engine.version)})
    tokens = torch.randint(1, trainer.model_args.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = engine.model(tokens.to(trainer.device))
    torch.save(torch.log_softmax(logits.float(), dim=-1).cpu(), folder / f"rank{rank}_logprobs.pt")


def _whole(value: torch.Tensor) -> torch.Tensor:
    """A weight of an engine split over tensor-parallel ranks, gathered (every rank of its group together)."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def engine_weights(folder: Path, rank: int) -> tuple[dict[str, torch.Tensor], int]:
    """Rank ``rank``'s engine weights written by ``write_engine`` under the run folder ``folder``, and its version."""
    with safe_open(str(folder / "engine" / f"rank{rank}.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, int(f.metadata()["version"])


def assert_engines_hold_the_export(out: Path, nproc: int, version: int) -> None:
    """Every rank's engine (``tests.objectives.synced_engine.write_engine``) of the run in ``out`` holds the run's
    Hugging Face export bitwise, synced after step ``version``, and gives the same log-probs on every rank."""
    spec = get_model_spec("llama3")
    exported = HFCheckpoint.open(out / "hf").read()
    args = type("Args", (), {"tie_word_embeddings": False, "head_dim": 16})()  # (what from_hf reads)
    expected = spec.hf_adapter.from_hf(exported, args)
    first = None
    for rank in range(nproc):
        weights, synced = engine_weights(out, rank)
        assert synced == version, (rank, synced)  # synced after the last step
        assert sorted(weights) == sorted(expected), rank
        for key, value in expected.items():
            assert torch.equal(weights[key], value), (rank, key, (weights[key] - value).abs().max())
        logprobs = torch.load(out / "engine" / f"rank{rank}_logprobs.pt")
        first = logprobs if first is None else first
        assert torch.equal(logprobs, first), rank  # every rank generates from the same policy


if __name__ == "__main__":
    from titanium.train import main

    Trainer.train_step, Trainer._export = train_step_then_sync, export_with_engine
    sys.exit(main())
