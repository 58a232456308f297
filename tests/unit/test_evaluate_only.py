"""``--training.steps 0`` evaluates the weights as loaded and stops (it used to be refused)."""

from __future__ import annotations

import pytest

from tests.helpers import scalars, tiny_args
from titanium.config import ConfigError
from titanium.parallel.distributed import shutdown_distributed


def test_steps_0_evaluates_a_checkpoint_as_training_did(make_trainer, tmp_path):
    """The held-out loss of the run's last checkpoint, evaluated alone, equals what the run logged after its last
    step; nothing is trained or saved."""
    common = (
        "--data.kind",
        "synthetic",
        "--checkpoint.enable",
        "--validation.interval",
        "2",
        "--validation.steps",
        "2",
    )
    make_trainer(*tiny_args(tmp_path, *common, "--training.steps", "2")).train()
    shutdown_distributed()
    trained = scalars(tmp_path / "tb", "validation/loss")
    only = make_trainer(*tiny_args(tmp_path, *common, "--training.steps", "0", "--metrics.save_tb_folder", "tb_eval"))
    weights = {k: v.clone() for k, v in only.model.state_dict().items()}
    only.train()
    assert scalars(tmp_path / "tb_eval", "validation/loss") == {2: pytest.approx(trained[2], rel=1e-6)}
    assert all(v.equal(weights[k]) for k, v in only.model.state_dict().items())
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-2"]


def test_steps_0_without_an_evaluation_is_refused(make_trainer, tmp_path):
    trainer = make_trainer(*tiny_args(tmp_path, "--data.kind", "synthetic", "--training.steps", "0"))
    with pytest.raises(ConfigError, match=r"--training.steps 0 evaluates only, and no evaluation is on: set "):
        trainer.train()
