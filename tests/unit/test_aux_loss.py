"""Auxiliary loss terms added from inside the model follow the loss rule: the gradient of
(sum of losses + sum of terms) / units, and the logged loss includes them."""

from __future__ import annotations

import torch

from titanium.models.common.aux_loss import AUX_LOSSES, add_aux_loss


def test_a_term_gets_the_gradient_of_being_added_to_the_loss_sum():
    weight = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(5, 3)
    units = torch.tensor(7)

    def run(attach: bool) -> torch.Tensor:
        h = x @ weight
        term = (h**2).sum()
        with AUX_LOSSES.scope(units) as aux:
            if attach:
                out = add_aux_loss(h, term)
                (out.sum() / units).backward()
                assert torch.equal(aux.total, term.detach())
            else:
                ((h.sum() + term) / units).backward()
        grad, weight.grad = weight.grad, None
        return grad

    torch.testing.assert_close(run(attach=True), run(attach=False), rtol=1e-6, atol=0)
    h = x @ weight
    assert add_aux_loss(h, h.sum()) is h  # outside a step: nothing
