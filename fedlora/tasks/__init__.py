"""Tasks: what differs between image classification, causal language modelling and text classification, chosen once
by the model.

A task builds nothing the rest of fedlora must know about: mechanisms, clipping, accounting, the strategies, the Flower
apps, batched clients, checkpoints and tracking see a LoRA model, batches and a loss. What a task owns:

- its data: a node's training data (``train_data``) and the server's test data (``test_data``), each a device
  dataset with ``len``, ``draw(indices)`` (a draw whose ``join`` batches several clients' draws) and ``[indices]``;
- its loss on a batch, per example (``example_losses``: clients trained together take each its own mean) and
  as the mean (``loss``);
- its metrics (``evaluate``: "accuracy" and "loss", and its own, such as a language model's "perplexity");
- its checks: configuration problems (``problems``, one sentence each) and what can be known before any process
  starts (``check_before_start``: a missing package, a tokenizer that does not fit the model).
"""

from __future__ import annotations

import functools

from fedlora.models import model_spec


class Task:
    """The interface every task implements (see the module's docstring)."""

    name = ""
    metric = "accuracy"  # what a row's "accuracy" measures
    plotted = ("accuracy", "test accuracy")  # the row column the run's plot (<column>.png) shows, and its label

    def classes(self, config) -> int:
        return 0

    def problems(self, config) -> list[str]:
        return []

    def check_before_start(self, config) -> None:
        """Raises ValueError, one sentence, on what would fail once processes run."""

    def left_out(self, config) -> tuple[str, ...]:
        """The samples of the run's data left out because they do not decode (unreadable = "skip"), one line each."""
        return ()

    def train_data(self, config, node, device):
        raise NotImplementedError

    def test_data(self, config, device):
        raise NotImplementedError

    def example_losses(self, model, batch):
        raise NotImplementedError

    def loss(self, model, batch):
        return self.example_losses(model, batch).mean()

    def evaluate(self, model, data, *, precision: str = "fp32") -> dict[str, float]:
        raise NotImplementedError

    def chance(self, config) -> float | None:
        """The accuracy of guessing, drawn on plots; None where it means little."""
        return None


@functools.cache
def task_named(name: str) -> Task:
    from fedlora.tasks.causal_lm import CausalLM
    from fedlora.tasks.image import ImageClassification
    from fedlora.tasks.text_classification import TextClassification

    tasks = {task.name: task for task in (ImageClassification(), CausalLM(), TextClassification())}
    return tasks[name]


def task_of(model: str) -> Task:
    """The task of a model (every model does one)."""
    return task_named(model_spec(model).task)
