"""LR schedule values: warmup, stable (WSD), decay shapes, minimum, and the LambdaLR wiring."""

from __future__ import annotations

import math

import pytest
import torch

from titanium.config.sections import LRSchedulerSection
from titanium.optim import build_lr_scheduler, lr_factor


def test_warmup_then_linear_decay_to_min():
    cfg = LRSchedulerSection(warmup_steps=4, decay_type="linear", min_lr_factor=0.1)
    values = [lr_factor(s, 14, cfg) for s in range(1, 15)]
    assert values[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])  # step / (warmup + 1): never zero
    assert values[4] == pytest.approx(0.1 + 0.9 * (1 - 1 / 10))  # first decay step
    assert values[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[4:], values[5:]))


def test_wsd_keeps_peak_until_decay():
    cfg = LRSchedulerSection(warmup_steps=2, decay_ratio=0.25, decay_type="linear")
    values = [lr_factor(s, 20, cfg) for s in range(1, 21)]
    assert values[2:15] == [1.0] * 13  # stable phase: steps 3..15
    assert values[15] == pytest.approx(1 - 1 / 5)  # decay over the last 5 steps
    assert values[-1] == pytest.approx(0.0)


@pytest.mark.parametrize(
    "decay_type, expected", [("cosine", 0.5 * (1 + math.cos(math.pi * 0.5))), ("sqrt", 1 - math.sqrt(0.5))]
)
def test_decay_shapes_at_midpoint(decay_type, expected):
    cfg = LRSchedulerSection(warmup_steps=0, decay_type=decay_type)
    assert lr_factor(5, 10, cfg) == pytest.approx(expected)


def test_scheduler_applies_factor_for_each_optimizer_step():
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=2.0)
    cfg = LRSchedulerSection(warmup_steps=2, decay_type="linear")
    sched = build_lr_scheduler(opt, cfg, total_steps=6)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2.0 * lr_factor(s, 6, cfg) for s in range(1, 7)])


@pytest.mark.parametrize("decay_type", ["linear", "cosine", "sqrt"])
def test_every_schedule_holds_its_minimum_past_the_end(decay_type):
    cfg = LRSchedulerSection(warmup_steps=1, decay_type=decay_type, min_lr_factor=0.1)
    assert [lr_factor(s, 4, cfg) for s in (4, 5, 9)] == pytest.approx([0.1, 0.1, 0.1])


@pytest.mark.parametrize("decay_type", ["linear", "cosine", "sqrt"])
def test_resume_with_more_steps_takes_the_lr_from_the_new_schedule(decay_type, caplog):
    """A finished 4-step run resumed with 6 steps: the optimizer's saved LR (the old schedule's, 0 at its end) and
    the saved peak are ignored; step 5 trains at the new schedule's LR for step 5, with one warning."""
    cfg = LRSchedulerSection(warmup_steps=1, decay_type=decay_type)
    param = torch.nn.Parameter(torch.zeros(2))
    old_opt = torch.optim.SGD([param], lr=1.0)
    old = build_lr_scheduler(old_opt, cfg, total_steps=4)
    for _ in range(4):
        old_opt.step()
        old.step()
    new_opt = torch.optim.SGD([param], lr=2.0)  # (and a new peak LR)
    new = build_lr_scheduler(new_opt, cfg, total_steps=6)
    new_opt.load_state_dict(old_opt.state_dict())  # the checkpoint's order: optimizer, then the schedule
    with caplog.at_level("WARNING"):
        new.load_state_dict(old.state_dict())
    want = 2.0 * lr_factor(5, 6, cfg)
    assert new_opt.param_groups[0]["lr"] == pytest.approx(want) and new.get_last_lr() == pytest.approx([want])
    assert want > 0 and "had finished its 4-step LR schedule" in caplog.text
    new_opt.step()
    new.step()
    assert new_opt.param_groups[0]["lr"] == pytest.approx(2.0 * lr_factor(6, 6, cfg))


def test_an_unchanged_resume_is_exact_and_silent(caplog):
    cfg = LRSchedulerSection(warmup_steps=2, decay_type="cosine", min_lr_factor=0.1)
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=0.3)
    sched = build_lr_scheduler(opt, cfg, total_steps=8)
    for _ in range(3):
        opt.step()
        sched.step()
    again_opt = torch.optim.SGD([param], lr=0.3)
    again = build_lr_scheduler(again_opt, cfg, total_steps=8)
    again_opt.load_state_dict(opt.state_dict())
    with caplog.at_level("WARNING"):
        again.load_state_dict(sched.state_dict())
    assert again_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"] and not caplog.text
