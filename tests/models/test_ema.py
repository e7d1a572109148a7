"""The actor's EMA against its closed form: ema_k = beta^k w_0 + (1 - beta) sum_j beta^(k-j) w_j."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlhfkit.models.ema import ParameterEMA


def test_ema_equals_closed_form_after_k_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model[1].bias.requires_grad_(False)  # a frozen parameter is not averaged
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    beta, k = 0.9, 5
    ema = ParameterEMA(model, beta)
    iterates = [{n: p.detach().double().clone() for n, p in model.named_parameters()}]
    for _ in range(k):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        ema.update(model)
        iterates.append({n: p.detach().double().clone() for n, p in model.named_parameters()})
    assert set(ema.shadow) == {"0.weight", "0.bias", "1.weight"}
    for name, value in ema.shadow.items():
        closed = beta ** k * iterates[0][name] + sum((1 - beta) * beta ** (k - j) * iterates[j][name]
                                                     for j in range(1, k + 1))
        torch.testing.assert_close(value.double(), closed, atol=1e-6, rtol=0)

    current = {n: p.detach().clone() for n, p in model.named_parameters()}
    with ema.swapped_in(model):
        torch.testing.assert_close(model[0].weight.detach(), ema.shadow["0.weight"])
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), current[n])  # the training weights come back

    restored = ParameterEMA(model, beta)
    restored.load_state_dict(ema.state_dict())
    assert restored.updates == k and torch.equal(restored.shadow["0.bias"], ema.shadow["0.bias"])
    with pytest.raises(ValueError, match="beta"):
        ParameterEMA(model, 1.0)
