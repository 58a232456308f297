"""Guards in one process: a NaN/inf step is skipped (weights and optimizer state exactly as if that update never
happened) or stops the run naming the step, with no checkpoint after it; a loss spike is logged with its step.

The faulty objectives (tests/objectives/faults.py) poison step 3 with a NaN loss and finite gradients (only the
loss check can see it) or a finite loss and NaN gradients (only the gradient-norm check can).
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers import scalars, tiny_args
from titanium.checkpoint.manager import complete_steps
from titanium.config.sections import GuardsSection
from titanium.guards import NonFiniteError, StepGuard
from titanium.parallel.distributed import shutdown_distributed


def _args(tmp_path, objective: str, *extra: str) -> list[str]:
    return tiny_args(
        tmp_path, "--data.kind", "synthetic", "--training.objective", f"tests.objectives.faults:{objective}", *extra
    )


@pytest.mark.parametrize("objective", ["NanLoss", "NanGrad"])
def test_skip_equals_a_run_that_never_applied_that_step(make_trainer, tmp_path, objective):
    guarded = make_trainer(
        *_args(tmp_path / "guarded", objective, "--training.steps", "5", "--guards.on_nonfinite", "skip")
    )
    guarded.train()
    guarded.metrics.close()  # (flushes the TensorBoard events)
    assert scalars(tmp_path / "guarded/tb", "guards/skipped_steps") == {3: 1.0, 4: 1.0, 5: 1.0}
    shutdown_distributed()

    # The reference drives the same pieces by hand and simply leaves step 3's update out (no guard involved):
    # its data is drawn and its learning-rate step taken, as the skipping run does.
    ref = make_trainer(*_args(tmp_path / "ref", objective, "--training.steps", "5"))
    for step in range(1, 6):
        microbatches = [ref.objective.next_microbatch()]
        if step != 3:
            ref.forward_backward(microbatches)
            ref._clip_grad_norm()
            ref.optimizer.step()
            ref.optimizer.zero_grad(set_to_none=True)
        ref.lr_scheduler.step()
    for (name, p), q in zip(guarded.model.named_parameters(), ref.model.parameters()):
        assert torch.equal(p, q), name
        state, ref_state = guarded.optimizer.state[p], ref.optimizer.state[q]
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], ref_state[key]), (name, key)


def test_stop_names_the_step_holds_the_weights_and_saves_nothing_after_it(make_trainer, tmp_path):
    trainer = make_trainer(
        *_args(
            tmp_path, "NanGrad", "--training.steps", "8", "--metrics.log_freq", "10",
            "--checkpoint.enable", "--checkpoint.interval", "2",
        )
    )  # fmt: skip
    saved = {}
    save = trainer.checkpointer.save

    def save_and_remember(step: int, **kwargs) -> None:
        saved[step] = [p.detach().clone() for p in trainer.model.parameters()]
        save(step, **kwargs)

    trainer.checkpointer.save = save_and_remember
    with pytest.raises(NonFiniteError) as error:
        trainer.train()
    message = str(error.value)
    assert message.startswith("step 3: the loss is ") and "gradient norm nan" in message
    assert "Stopped at step 4" in message and "no checkpoint was written after step 2" in message
    assert complete_steps(tmp_path / "checkpoint") == [2] and list(saved) == [2]
    for p, p2 in zip(trainer.model.parameters(), saved[2]):
        assert torch.equal(p, p2)  # steps 3 and 4 were held: the weights are step 2's


def test_too_many_skipped_steps_stop_the_run(make_trainer, tmp_path):
    args = ("--training.steps", "4", "--guards.on_nonfinite", "skip")
    make_trainer(*_args(tmp_path / "a", "NanLoss", *args, "--guards.max_skipped_steps", "0")).train()  # no limit
    shutdown_distributed()
    strict = make_trainer(*_args(tmp_path / "b", "NanLoss", *args, "--guards.max_skipped_steps", "1"))
    strict.guard._skipped += 1  # as if a step had been skipped before step 3's
    with pytest.raises(NonFiniteError, match=r"^2 steps skipped \(more than --guards.max_skipped_steps 1\)"):
        strict.train()


def test_a_loss_spike_is_logged_with_its_step(make_trainer, tmp_path, caplog):
    trainer = make_trainer(*_args(tmp_path, "LossSpike", "--training.steps", "5", "--metrics.log_freq", "5"))
    with caplog.at_level(logging.WARNING, logger="titanium"):
        trainer.train()
    spikes = [r.getMessage() for r in caplog.records if "loss spike" in r.getMessage()]
    assert len(spikes) == 1 and spikes[0].startswith("loss spike at step 3: "), spikes
    ratio = float(spikes[0].split(" is ")[1].split("x")[0])
    assert 15 < ratio < 25  # the loss was multiplied by 20 (the running mean is of nearby losses)


def test_no_spike_is_logged_for_an_objective_whose_loss_sits_near_zero(make_trainer, tmp_path, caplog):
    """GRPO's loss sits near 0 with either sign: its ratio to the running mean is noise (on real GRPO runs the
    warning fired on 6 of 10 steps). The objective says so (``loss_spikes = False``), and the guard, which the loop
    builds with that declaration, tracks no spikes; a positive mean near 0 fires without it."""
    from titanium.objectives.grpo import GRPOObjective

    assert GRPOObjective.loss_spikes is False
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    losses = [0.002, -0.01, 0.004, 0.03, -0.002, 0.02]  # (a GRPO-like series, positive mean)
    for declared, warnings in ((True, 1), (False, 0)):
        guard = StepGuard(GuardsSection(), [optimizer], torch.device("cpu"), loss_spikes=declared)
        for step, loss in enumerate(losses, start=1):
            guard.before_optimizer_step(step, torch.tensor(loss), torch.tensor(1.0))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="titanium"):
            guard.check(6)
        assert len([r for r in caplog.records if "loss spike" in r.getMessage()]) == warnings, declared
    trainer = make_trainer(*_args(tmp_path, "UnscaledLossSpike", "--training.steps", "5", "--metrics.log_freq", "5"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="titanium"):
        trainer.train()
    assert not [r for r in caplog.records if "loss spike" in r.getMessage()]
