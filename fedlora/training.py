"""Local training and evaluation of a LoRA model, free of Flower: K local steps on a partition, accuracy on a split."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedlora.models import logits


def select_device() -> torch.device:
    """CUDA when present, CPU otherwise."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


LOCAL_OPTIMIZERS = ("sgd", "adam")


def local_train(model: nn.Module, dataset, *, steps: int, batch_size: int, lr: float, generator: torch.Generator,
                optimizer: str = "sgd") -> float:
    """``steps`` optimizer steps on mini-batches drawn (with replacement) from ``dataset``; returns the mean loss.

    ``optimizer`` is fresh each call (no state crosses rounds, so a client's reply depends on its data and the
    global model only): "sgd", or "adam", whose steps do not scale with the gradient, so that one lr serves a
    head whose gradients are large (wide features) and adapters whose gradients are small.
    ``dataset`` yields {"pixel_values", "labels"} for a list of indices (``fedlora.data.to_torch``).
    """
    if len(dataset) == 0:
        raise ValueError("Cannot train on an empty partition.")
    if optimizer not in LOCAL_OPTIMIZERS:
        raise ValueError(f"Unknown local optimizer '{optimizer}'; choose one of: {', '.join(LOCAL_OPTIMIZERS)}.")
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    step = torch.optim.Adam(params, lr=lr) if optimizer == "adam" else torch.optim.SGD(params, lr=lr)
    model.train()
    total = 0.0
    for _ in range(steps):
        indices = torch.randint(len(dataset), (batch_size,), generator=generator).tolist()
        batch = dataset[indices]
        loss = F.cross_entropy(logits(model, batch["pixel_values"].to(device)), batch["labels"].to(device))
        step.zero_grad(set_to_none=True)
        loss.backward()
        step.step()
        total += loss.item()
    return total / steps


@torch.no_grad()
def evaluate(model: nn.Module, dataset, *, batch_size: int = 256) -> tuple[float, float]:
    """(accuracy, mean cross-entropy loss) on ``dataset``."""
    device = next(model.parameters()).device
    model.eval()
    correct, loss, count = 0, 0.0, 0
    for start in range(0, len(dataset), batch_size):
        batch = dataset[list(range(start, min(start + batch_size, len(dataset))))]
        labels = batch["labels"].to(device)
        out = logits(model, batch["pixel_values"].to(device))
        loss += F.cross_entropy(out, labels, reduction="sum").item()
        correct += (out.argmax(dim=1) == labels).sum().item()
        count += len(labels)
    return correct / count, loss / count
