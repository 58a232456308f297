"""Optimizers: optimizer-in-backward equals the ordinary step bitwise (LR schedule included) and resumes
exactly; a tensor LR equals a float LR bitwise; torchao's low-bit AdamW trains; refused combinations exit 2."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from tests.helpers import scalars, tiny_args, train_until_first_save
from titanium.config.sections import LRSchedulerSection, OptimizerSection
from titanium.optim import OptimizerInBackward, build_lr_scheduler, build_optimizer
from titanium.parallel.distributed import shutdown_distributed
from titanium.train import main

STEPS = 6
CUDA = pytest.mark.cuda
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
SCHEDULE = LRSchedulerSection(warmup_steps=2, decay_type="cosine", min_lr_factor=0.1)


class TiedNet(nn.Module):
    """Embedding tied to the output projection (its gradient arrives from two uses), a norm and biases
    (the no-decay group), a residual: the shapes of a decoder without the model code."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.up = nn.Linear(32, 96)
        self.norm = nn.LayerNorm(96)
        self.down = nn.Linear(96, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.down(torch.relu(self.norm(self.up(h))))
        return h @ self.embed.weight.T


def train_tied_net(
    cfg: OptimizerSection, steps: int = STEPS, device: str = "cpu"
) -> tuple[nn.Module, torch.optim.Optimizer, list]:
    """The trainer's order of calls: backward, step, zero_grad, schedule. Returns model, optimizer, LRs used."""
    torch.manual_seed(0)
    model = TiedNet().to(device)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_lr_scheduler(optimizer, SCHEDULE, steps)
    data = torch.Generator().manual_seed(1)
    lrs = []
    for _ in range(steps):
        tokens = torch.randint(0, 50, (4, 16), generator=data).to(device)
        logits = model(torch.roll(tokens, 1, dims=1))
        nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        if cfg.early_step_in_backward:  # stepped and freed inside backward
            assert all(p.grad is None for p in model.parameters())
        lrs.append(float(scheduler.get_last_lr()[0]))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    return model, optimizer, lrs


def assert_same_training(a: tuple, b: tuple) -> None:
    (model_a, opt_a, lrs_a), (model_b, opt_b, lrs_b) = a, b
    assert lrs_a == lrs_b and len(set(lrs_a)) == STEPS  # warmup and decay: a new LR every step
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        assert torch.equal(p, q), name
    state_a, state_b = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for index, moments in state_a.items():
        for key, value in moments.items():
            assert torch.equal(value, state_b[index][key]), (index, key)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("implementation", ["fused", "foreach", "for-loop"])
def test_in_backward_equals_optimizer_step_bitwise(implementation, device):
    reference = train_tied_net(OptimizerSection(lr=1e-2, implementation=implementation), device=device)
    in_backward = train_tied_net(
        OptimizerSection(lr=1e-2, implementation=implementation, early_step_in_backward=True), device=device
    )
    assert isinstance(in_backward[1], OptimizerInBackward)
    assert_same_training(reference, in_backward)


def test_tensor_lr_equals_float_lr_bitwise():
    """CPU fused AdamW with the LR in a float64 tensor (updated in place by the schedule), also in backward."""
    reference = train_tied_net(OptimizerSection(lr=1e-2))
    tensor_lr = train_tied_net(OptimizerSection(lr=1e-2, tensor_lr=True))
    assert isinstance(tensor_lr[1].param_groups[0]["lr"], torch.Tensor)
    assert_same_training(reference, tensor_lr)
    assert_same_training(
        reference, train_tied_net(OptimizerSection(lr=1e-2, tensor_lr=True, early_step_in_backward=True))
    )


def test_tensor_lr_falls_back_to_float_where_torch_cannot(caplog):
    """foreach takes a tensor LR only when capturable, which torch supports on CUDA alone."""
    with caplog.at_level(logging.WARNING, logger="titanium"):
        optimizer = build_optimizer(TiedNet(), OptimizerSection(implementation="foreach", tensor_lr=True))
    assert isinstance(optimizer.param_groups[0]["lr"], float)
    assert "tensor_lr" in caplog.text and "float" in caplog.text


@CUDA
@pytest.mark.parametrize("implementation", ["fused", "foreach", "for-loop"])
def test_tensor_lr_on_cuda_matches_float_lr_without_host_syncs(implementation):
    """On CUDA the LR is a float32 tensor (what the fused kernels read), so updates match a float LR to float32
    rounding; the step and the schedule's in-place LR update never wait for the GPU."""
    reference = train_tied_net(OptimizerSection(lr=1e-2, implementation=implementation), device="cuda")
    tensor_lr = train_tied_net(OptimizerSection(lr=1e-2, implementation=implementation, tensor_lr=True), device="cuda")
    for p, q in zip(reference[0].parameters(), tensor_lr[0].parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7)
    model, optimizer = tensor_lr[0], tensor_lr[1]
    scheduler = build_lr_scheduler(optimizer, SCHEDULE, STEPS)
    tokens = torch.arange(32, device="cuda").reshape(2, 16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            model(tokens).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_in_backward_state_round_trips_through_dcp_helpers():
    """DCP's optimizer state-dict helpers (what checkpoints use) read the in-backward moments by parameter
    name; loaded into a fresh in-backward optimizer, or an ordinary one (same keys: a run may switch either
    way across a resume), training goes on exactly as in the original."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    cfg = OptimizerSection(lr=1e-2, early_step_in_backward=True)
    model, optimizer, _ = train_tied_net(cfg, steps=3)
    saved = get_optimizer_state_dict(model, optimizer, options=options)
    assert torch.equal(saved["state.up.weight.exp_avg"], optimizer.state[model.up.weight]["exp_avg"])
    resumed = []
    for in_backward in (True, False):
        fresh_model = copy.deepcopy(model)
        fresh = build_optimizer(fresh_model, OptimizerSection(lr=1e-2, early_step_in_backward=in_backward))
        # (deepcopy: the saved tensors are the live moments of `optimizer`, which steps on below)
        set_optimizer_state_dict(fresh_model, fresh, copy.deepcopy(saved), options=options)
        resumed.append((fresh_model, fresh))
    for model_, optimizer_ in [(model, optimizer), *resumed]:
        model_(torch.arange(32).reshape(2, 16)).square().mean().backward()
        optimizer_.step()  # (a no-op for the in-backward ones)
    for fresh_model, _ in resumed:
        for p, q in zip(model.parameters(), fresh_model.parameters(), strict=True):
            assert torch.equal(p, q)


def test_in_backward_resume_equals_uninterrupted_run(make_trainer, tmp_path):
    """Debug model, 6 steps with a checkpoint at 3: resuming from it logs the uninterrupted run's losses."""
    common = (
        "--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "3", "--debug.deterministic",
        "--optimizer.early_step_in_backward", "--training.max_norm", "0",
    )  # fmt: skip
    straight = make_trainer(*tiny_args(tmp_path / "straight", *common))
    assert isinstance(straight.optimizer, OptimizerInBackward)
    straight.train()
    straight.close()  # (flushes the TensorBoard events; closing twice is safe)
    expected = scalars(tmp_path / "straight/tb")
    shutdown_distributed()

    train_until_first_save(make_trainer, *tiny_args(tmp_path / "resumed", *common))  # dies after its step-3 checkpoint
    resumed = make_trainer(*tiny_args(tmp_path / "resumed", *common))
    assert resumed.train_state.step == 3
    resumed.train()
    resumed.close()
    got = scalars(tmp_path / "resumed/tb")
    assert [got[s] for s in (4, 5, 6)] == [expected[s] for s in (4, 5, 6)]


def test_in_backward_step_reports_its_grad_norm_on_the_training_device(make_trainer, tmp_path):
    """No gradient is left after an in-backward step, so there is no norm to measure; the placeholder must still
    live on the training device, where the step guard stacks it with the loss (on the H200 it was made on the
    CPU and the guard failed). A CPU-only check: the step executor told its device is ``meta`` answers on ``meta``."""
    trainer = make_trainer(*tiny_args(tmp_path, "--optimizer.early_step_in_backward", "--training.max_norm", "0"))
    assert all(p.grad is None for p in trainer.model.parameters())
    trainer.executor.device = torch.device("meta")
    assert trainer._clip_grad_norm().device == torch.device("meta")


@pytest.mark.parametrize(
    "world_size, extra, message",
    [
        (1, ("--training.max_norm", "0", "--training.global_batch_size", "8"), "asks for gradient accumulation"),
        (2, ("--training.max_norm", "0", "--training.global_batch_size", "16"), "asks for gradient accumulation"),
        (1, ("--training.max_norm", "1.0"), "set --training.max_norm 0"),
        (2, ("--training.max_norm", "0", "--parallelism.pipeline_parallel_degree", "2"), "pipeline_parallel_degree 2"),
    ],
)
def test_in_backward_refusals_exit_2(tmp_path, monkeypatch, capsys, world_size, extra, message):
    """Checked before any process group exists: exit code 2, one message naming the flag, no traceback."""
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    assert main(tiny_args(tmp_path, "--optimizer.early_step_in_backward", *extra)) == 2
    err = capsys.readouterr().err
    assert "--optimizer.early_step_in_backward" in err and message in err and "Traceback" not in err


def test_in_backward_accepts_one_microbatch_per_step_given_explicitly():
    from titanium.config.sections import TrainingSection
    from titanium.optim import check_in_backward

    training = TrainingSection(local_batch_size=4, global_batch_size=8, max_norm=0.0)
    check_in_backward(OptimizerSection(early_step_in_backward=True), training, dp_degree=2, pp_degree=1)


def debug_model_losses(make_trainer, folder, *extra: str) -> tuple[list[float], torch.optim.Optimizer]:
    """Per-step losses of 6 steps of the debug model on the bundled text (warmup 2, cosine decay)."""
    trainer = make_trainer(*tiny_args(folder, "--training.steps", "6", "--lr_scheduler.warmup_steps", "2", *extra))
    trainer.train()
    trainer.close()  # (flushes the TensorBoard events; closing twice is safe)
    shutdown_distributed()
    losses = scalars(folder / "tb")
    return [losses[s] for s in range(1, 7)], trainer.optimizer


def test_low_bit_adamw_trains_like_adamw(make_trainer, tmp_path):
    """torchao's quantized-state AdamW on the debug model: the loss falls (by > 0.5 in 6 steps) and stays within
    1% of AdamW's at every step (measured: 8-bit and FP8 within 0.01%, 4-bit within 0.7%).

    Eager on CPU: torchao compiles its step once per parameter shape, 7 inductor graphs per optimizer that take
    ~60 s to build on a 2-core CPU. With a GPU the same test runs the compiled step.
    """
    reference, _ = debug_model_losses(make_trainer, tmp_path / "adamw")
    stance = "default" if torch.cuda.is_available() else "force_eager"
    for name in ("AdamW8bit", "AdamW4bit", "AdamWFp8"):
        with torch.compiler.set_stance(stance):
            losses, optimizer = debug_model_losses(make_trainer, tmp_path / name, "--optimizer.name", name)
        assert losses[-1] < losses[0] - 0.5, name
        assert losses == pytest.approx(reference, rel=1e-2), name
        wq_state = optimizer.state[optimizer.param_groups[0]["params"][0]]  # layers.0.attention.wq: 256 x 256
        assert type(wq_state["exp_avg"]).__name__.startswith("OptimState"), name  # quantized, not a plain tensor


def test_logged_lr_is_the_lr_of_its_step_with_a_tensor_lr(make_trainer, tmp_path):
    """A tensor LR changes in place when the schedule steps; the log must show the LR the step used."""
    from titanium.optim import lr_factor

    trainer = make_trainer(
        *tiny_args(tmp_path, "--training.steps", "3", "--lr_scheduler.warmup_steps", "1", "--optimizer.tensor_lr")
    )
    trainer.train()
    trainer.close()  # (flushes the TensorBoard events; closing twice is safe)
    logged = scalars(tmp_path / "tb", "optim/lr")
    peak, schedule = trainer.cfg.optimizer.lr, trainer.cfg.lr_scheduler
    assert len(set(logged.values())) == 3
    assert logged == pytest.approx({s: peak * lr_factor(s, 3, schedule) for s in (1, 2, 3)}, rel=1e-6)
