"""Guards against bad steps: a NaN/inf loss or gradient norm, found without a per-step host sync; loss spikes.

Every step the loop hands the guard the step's global mean loss and gradient norms (the policy's, and those of any
model trained beside it) as device tensors. All are reduced over all ranks before they get here, so every rank takes
the same decision. The guard folds them into a few device tensors (is this step bad, how many were skipped, the
first bad step, the worst loss spike since the last look) and never reads them itself. Every optimizer of the step
receives the decision as its ``found_inf`` tensor: the flag torch's fused Adam/AdamW kernels (and GradScaler) use
to leave the weights and the optimizer state, step count included, untouched for that step. The host reads the
tensors only where the loop syncs anyway, at log and checkpoint steps (``check``), and stops the run there if it
must.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from titanium.config.sections import GuardsSection
from titanium.errors import UserError

logger = logging.getLogger("titanium")


class NonFiniteError(UserError, FloatingPointError):
    """Training stopped on a NaN/inf loss or gradient norm; the message names the first bad step."""

    label = "stopped"


class StepGuard:
    """Skips (or holds, in stop mode) optimizer steps whose loss or gradient norm is not finite; logs loss spikes."""

    def __init__(
        self,
        cfg: GuardsSection,
        optimizers: Sequence[torch.optim.Optimizer],
        device: torch.device,
        loss_spikes: bool = True,
    ) -> None:
        """``optimizers``: the policy's, then those of the models trained beside it, all stepped (or all skipped)
        together. ``loss_spikes``: whether the objective's loss spikes mean something (``Objective.loss_spikes``);
        when not, spikes are not tracked whatever ``loss_spike_ratio`` says."""
        self.cfg, self.optimizers = cfg, list(optimizers)
        self.track_spikes = loss_spikes and cfg.loss_spike_ratio > 0
        # Optimizers that GradScaler can drive read `found_inf` in their step (torch's fused Adam/AdamW).
        self.in_kernel = all(getattr(o, "_step_supports_amp_scaling", False) for o in self.optimizers)
        if not self.in_kernel and cfg.on_nonfinite == "skip":
            logger.warning(
                "guards: %s cannot skip a step on the device; with --guards.on_nonfinite skip the non-finite flag "
                "is read on the host every step (one device sync per step; AdamW/Adam with "
                "--optimizer.implementation fused avoid it)",
                ", ".join(type(o).__name__ for o in self.optimizers),
            )
        self._skip = torch.zeros((), dtype=torch.bool, device=device)
        self._held = torch.zeros((), dtype=torch.bool, device=device)  # stop mode: a bad step was seen
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)
        self._first_bad_step = torch.zeros((), dtype=torch.int64, device=device)  # 0: none yet
        self._first_bad = torch.zeros(2, device=device)  # (loss, grad norm) at the first bad step
        self._ema = torch.zeros((), device=device)  # running mean of the loss = _ema / _ema_weight
        self._ema_weight = torch.zeros((), device=device)
        self._spikes = torch.zeros((), dtype=torch.int64, device=device)  # since the last check
        self._worst = torch.zeros(4, device=device)  # (ratio, step, loss, running mean) of the worst spike

    def before_optimizer_step(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, other_norms: Sequence[torch.Tensor] = ()
    ) -> None:
        """Decide, on the device, whether ``optimizer_step`` may apply step ``step`` (``loss``: its global mean;
        ``grad_norm``: the policy's gradient norm; ``other_norms``: those of the models trained beside it)."""
        loss, grad_norm = loss.detach().float(), grad_norm.detach().float()
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        for norm in other_norms:
            bad = bad | ~torch.isfinite(norm.detach().float())
        first = bad & (self._first_bad_step == 0)
        self._first_bad_step = torch.where(first, step, self._first_bad_step)
        self._first_bad = torch.where(first, torch.stack([loss, grad_norm]), self._first_bad)
        if self.cfg.on_nonfinite == "stop":
            self._held = self._held | bad
            self._skip = self._held
        else:
            self._skip = bad
        self._skipped = self._skipped + self._skip
        if self.track_spikes:
            self._track_spikes(step, loss, bad)

    def _track_spikes(self, step: int, loss: torch.Tensor, bad: torch.Tensor) -> None:
        mean = self._ema / self._ema_weight.clamp(min=1e-12)  # bias-corrected, as Adam's moments
        ratio = loss / mean
        # (a ratio to the running mean only means something for a positive mean: GRPO's loss hovers around 0)
        spike = ~bad & (self._ema_weight > 0) & (mean > 0) & (loss > self.cfg.loss_spike_ratio * mean)
        worse = spike & (ratio > self._worst[0])
        self._worst = torch.where(worse, torch.stack([ratio, torch.full_like(loss, step), loss, mean]), self._worst)
        self._spikes = self._spikes + spike
        decay = 1.0 - 1.0 / self.cfg.loss_spike_window
        self._ema = torch.where(bad, self._ema, decay * self._ema + (1 - decay) * loss)
        self._ema_weight = torch.where(bad, self._ema_weight, decay * self._ema_weight + (1 - decay))

    def optimizer_step(self) -> None:
        """Every optimizer's step, applied only if ``before_optimizer_step`` allowed it. (Optimizers that cannot
        skip on the device are asked on the host in skip mode only: in stop mode nothing after the bad step is
        ever saved, so their update may as well go through.)"""
        if not self.in_kernel and self.cfg.on_nonfinite == "skip" and self._skip.item():
            return
        for optimizer in self.optimizers:
            if self.in_kernel:
                optimizer.found_inf = self._skip.float()
            optimizer.step()

    def check(self, step: int) -> dict[str, float]:
        """At a log or checkpoint step (the host syncs there anyway): stop the run if a bad step calls for it, log
        the worst loss spike since the last check, and return the guard's numbers for the log line."""
        first_step, skipped, spikes = torch.stack([self._first_bad_step, self._skipped, self._spikes]).tolist()
        if first_step:
            loss, norm = self._first_bad.tolist()
            what = f"step {first_step}: the loss is {loss:.4g} and the gradient norm {norm:.4g}"
            hint = "lower --optimizer.lr, raise --lr_scheduler.warmup_steps, or check the data"
            if self.cfg.on_nonfinite == "stop":
                held = "neither that step nor any later one was applied, and " if self.in_kernel else ""
                raise NonFiniteError(
                    f"{what}. Stopped at step {step}: {held}no checkpoint was written after step {first_step - 1}. "
                    f"To go on past such steps set --guards.on_nonfinite skip; or {hint}"
                )
            limit = self.cfg.max_skipped_steps
            if limit and skipped > limit:
                raise NonFiniteError(
                    f"{skipped} steps skipped (more than --guards.max_skipped_steps {limit}); the first was {what}. "
                    f"Stopped at step {step}; no skipped step was applied. {hint[0].upper()}{hint[1:]}"
                )
        if spikes:
            ratio, spike_step, loss, mean = self._worst.tolist()
            logger.warning(
                "loss spike at step %d: %.4f is %.2fx its running mean %.4f (%d spike(s) since the last check)",
                spike_step,
                loss,
                ratio,
                mean,
                spikes,
            )
            self._spikes.zero_()
            self._worst.zero_()
        return {"guards/skipped_steps": float(skipped)} if skipped else {}
