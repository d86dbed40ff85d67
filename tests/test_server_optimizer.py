"""The server optimizers that apply mean updates (message = update)."""

import pytest
import torch

from fedlora.server_optimizer import ADAM_BETA2, ADAM_EPSILON, ServerOptimizer


def test_sgd_at_lr_1_adds_the_update():
    params, update = {"w": torch.ones(3)}, {"w": torch.tensor([0.5, -1.0, 2.0])}
    assert torch.equal(ServerOptimizer("sgd", lr=1.0).step(params, update)["w"], torch.tensor([1.5, 0.0, 3.0]))


def test_momentum_accumulates_the_updates():
    optimizer, params, u = ServerOptimizer("momentum", lr=0.5, momentum=0.9), {"w": torch.zeros(2)}, torch.ones(2)
    for expected in (0.5, 0.5 + 0.5 * 1.9):  # m1 = u, m2 = 0.9 u + u
        params = optimizer.step(params, {"w": u})
        torch.testing.assert_close(params["w"], torch.full((2,), expected))


def test_adam_follows_reddi_et_al():
    optimizer, u = ServerOptimizer("adam", lr=0.1, momentum=0.9), torch.tensor([2.0])
    out = optimizer.step({"w": torch.zeros(1)}, {"w": u})["w"]
    m, v = 0.1 * 2.0, (1 - ADAM_BETA2) * 4.0
    assert float(out) == pytest.approx(0.1 * m / (v ** 0.5 + ADAM_EPSILON), rel=1e-6)
    assert set(optimizer.state) == {"adam-m/w", "adam-v/w"}


def test_bad_optimizers_are_refused():
    with pytest.raises(ValueError, match="Unknown server optimizer"):
        ServerOptimizer("lamb", lr=1.0)
    with pytest.raises(ValueError, match="momentum in"):
        ServerOptimizer("momentum", lr=1.0, momentum=1.0)
