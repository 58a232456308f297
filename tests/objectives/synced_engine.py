"""``python -m tests.objectives.synced_engine <titanium.train args>``: training with a titanium rollout engine that
gets the trained weights after every optimizer step, as the loop's after-step hook will hand them over.

Each rank keeps its own engine (an unsharded copy of the policy), synced from the training model in whatever layout
it trains (``RolloutEngine.sync_from``: block by block, LoRA merged, converters undone). At the end every rank writes
its engine's weights to ``<dump_folder>/engine/rank<r>.safetensors``, next to the trainer's own Hugging Face export
(``--checkpoint.last_save_in_hf``), and the engine's log-probs of fixed sequences to ``rank<r>_logprobs.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from titanium.generation.titanium_engine import TitaniumEngine
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
    folder = Path(self.cfg.job.dump_folder) / "engine"
    folder.mkdir(exist_ok=True)
    engine, rank = _engine(self), torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    state = {k: v.detach().cpu().contiguous() for k, v in engine.model.state_dict().items()}
    save_file(state, str(folder / f"rank{rank}.safetensors"), metadata={"version": str(engine.version)})
    tokens = torch.randint(1, self.model_args.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = engine.model(tokens.to(self.device))
    torch.save(torch.log_softmax(logits.float(), dim=-1).cpu(), folder / f"rank{rank}_logprobs.pt")


if __name__ == "__main__":
    from titanium.train import main

    Trainer.train_step, Trainer._export = train_step_then_sync, export_with_engine
    sys.exit(main())
