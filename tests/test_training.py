"""Tests for fedlora.training: local training with a fresh optimizer per call, and evaluation."""

import pytest
import torch
from torch import nn

from fedlora.training import LOCAL_OPTIMIZERS, evaluate, local_train


class Batches:
    """A to_torch-like dataset: a list of indices gives {"pixel_values", "labels"}."""

    def __init__(self, n: int = 64, scale: float = 1.0):
        generator = torch.Generator().manual_seed(0)
        self.labels = torch.arange(n) % 2
        self.pixels = torch.randn(n, 3, 2, 2, generator=generator) + scale * self.labels.view(-1, 1, 1, 1)
        self.pixels *= scale  # wide features: large gradients on the head

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, rows):
        return {"pixel_values": self.pixels[rows], "labels": self.labels[rows]}


def linear_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 2))


@pytest.mark.parametrize("optimizer, lr", [("sgd", 0.1), ("adam", 0.05)])
def test_local_training_learns_with_either_optimizer(optimizer, lr):
    data, model = Batches(), linear_model()
    before, _ = evaluate(model, data)
    local_train(model, data, steps=60, batch_size=16, lr=lr, generator=torch.Generator().manual_seed(1),
                optimizer=optimizer)
    after, _ = evaluate(model, data)
    assert after > max(before, 0.8), (before, after)


def test_adam_steps_do_not_scale_with_the_gradient():
    """Features 100 times wider: SGD's first step is far longer (its lr must shrink with them); Adam's is not."""
    moved = {}
    for optimizer in LOCAL_OPTIMIZERS:
        for scale in (1.0, 100.0):
            model = linear_model()
            start = model[1].weight.detach().clone()
            local_train(model, Batches(scale=scale), steps=1, batch_size=16, lr=1e-3,
                        generator=torch.Generator().manual_seed(1), optimizer=optimizer)
            moved[optimizer, scale] = (model[1].weight - start).norm().item()
    assert moved["sgd", 100.0] > 10 * moved["sgd", 1.0]
    assert moved["adam", 100.0] == pytest.approx(moved["adam", 1.0], rel=0.05)


def test_local_training_refuses_an_empty_partition_and_an_unknown_optimizer():
    with pytest.raises(ValueError, match="empty partition"):
        local_train(linear_model(), Batches(n=0), steps=1, batch_size=4, lr=0.1, generator=torch.Generator())
    with pytest.raises(ValueError, match="Unknown local optimizer 'lamb'; choose one of: sgd, adam."):
        local_train(linear_model(), Batches(), steps=1, batch_size=4, lr=0.1, generator=torch.Generator(),
                    optimizer="lamb")
