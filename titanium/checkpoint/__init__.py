"""Training-state checkpoints (DCP), resume, and (later) Hugging Face import/export."""

from titanium.checkpoint.manager import CheckpointManager
from titanium.checkpoint.states import ModelState, OptimizerState, RNGState, TrainState

__all__ = ["CheckpointManager", "ModelState", "OptimizerState", "RNGState", "TrainState"]
