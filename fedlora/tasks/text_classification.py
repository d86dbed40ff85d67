"""Text (sequence) classification: BERT, RoBERTa and DistilBERT-style classifiers over labelled text (the user's
folders of class subfolders or JSON lines, hub datasets), measured by accuracy and cross-entropy."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fedlora.data import FOLDER_PREFIX, HUB_PREFIX, PARTITIONER_KINDS
from fedlora.models import architecture, model_spec
from fedlora.tasks import Task
from fedlora.text import (check_tokenizer_fits, example_tokens, labelled_text, load_tokenizer, partition_examples,
                          text_dir_units, tokenizer_of)


class TextClassification(Task):
    name = "text-classification"

    def classes(self, config) -> int:
        """num-classes, else the data's (read off the data)."""
        return config.num_classes or len(_text(config).classes)

    def problems(self, config) -> list[str]:
        problems = []
        if not config.dataset.startswith((HUB_PREFIX, FOLDER_PREFIX)) or config.dataset in (HUB_PREFIX, FOLDER_PREFIX):
            problems.append(f"{config.model} classifies text: dataset must be labelled text (folder:<path> with a "
                            "subfolder of .txt files per class or .jsonl files with a text and a label field, or "
                            f"hf:<id>), got '{config.dataset}'.")
        if config.image_column:
            problems.append(f"image-column names an image dataset's column; {config.model} reads text (text-column, "
                            "label-column, client-column).")
        if config.num_classes == 1:
            problems.append("num-classes must be 0 (the data's) or at least 2, got 1.")
        if config.partitioner not in PARTITIONER_KINDS:
            problems.append(f"partitioner must be one of {', '.join(PARTITIONER_KINDS)} for a text classifier, got "
                            f"'{config.partitioner}'.")
        positions = max_positions(config.model)
        if positions and config.seq_len > positions:
            problems.append(f"seq-len ({config.seq_len}) exceeds {config.model}'s {positions} positions.")
        return problems

    def check_before_start(self, config) -> None:
        check_tokenizer_fits(config).pad_id  # raises if there is nothing to pad examples with
        text = _text(config)
        if config.num_classes and config.num_classes != len(text.classes):
            raise ValueError(f"{config.dataset} has {len(text.classes)} classes, but num-classes = "
                             f"{config.num_classes}: set num-classes = {len(text.classes)}, or 0 (the data's).")
        units = len({c for _, _, c in text.train}) if config.partitioner == "natural" and text.has_clients \
            else len(text.train)
        if config.num_clients > units:
            what = "writers" if config.partitioner == "natural" else "training examples"
            raise ValueError(f"{config.dataset} has {units} {what} for num-clients = {config.num_clients}: set "
                             f"num-clients <= {units}.")
        partition_examples(config.partitioner, text, num_partitions=config.num_clients, partition_id=0,
                           seed=config.seed, alpha=config.dirichlet_alpha)  # a natural split without writers: here

    def left_out(self, config) -> tuple[str, ...]:
        return _text(config).left_out

    def train_data(self, config, node, device):
        """The node's own labelled text (data-dir: a subfolder of .txt files per class, named as the run's classes, or
        0..K-1), else its partition of the run's dataset, one example a block on ``device``."""
        if node.data_dir:
            own = own_examples(node.data_dir, _class_index(config), config.unreadable)
            texts, labels = [t for t, _ in own], [label for _, label in own]
        else:
            text = _text(config)
            rows = _partition(config, node.num_partitions, node.partition_id)
            texts, labels = [text.train[i][0] for i in rows], [text.train[i][1] for i in rows]
        return example_tokens(texts, labels, load_tokenizer(tokenizer_of(config)), config.seq_len, device=device)

    def test_data(self, config, device):
        test = _text(config).test
        return example_tokens([t for t, _, _ in test], [label for _, label, _ in test],
                              load_tokenizer(tokenizer_of(config)), config.seq_len, device=device)

    def example_losses(self, model, batch):
        return F.cross_entropy(_scores(model, batch), batch["labels"], reduction="none")

    @torch.no_grad()
    def evaluate(self, model, data, *, precision: str = "fp32", batch_size: int = 128) -> dict[str, float]:
        from fedlora.training import autocast, compute_dtype

        device = next(model.parameters()).device
        dtype = compute_dtype(precision, device)
        model.eval()
        loss = torch.zeros((), dtype=torch.float64, device=device)
        correct = torch.zeros((), dtype=torch.int64, device=device)
        for start in range(0, len(data), batch_size):
            batch = data[list(range(start, min(start + batch_size, len(data))))]
            with autocast(device, dtype):
                scores = _scores(model, batch)
            loss += F.cross_entropy(scores, batch["labels"], reduction="sum").double()
            correct += (scores.argmax(1) == batch["labels"]).sum()
        return {"accuracy": correct.item() / len(data), "loss": loss.item() / len(data)}

    def chance(self, config) -> float | None:
        return 1 / self.classes(config)


def _scores(model, batch) -> torch.Tensor:
    """Class scores (float32) of a batch, padding masked out of attention."""
    return model(input_ids=batch["input_ids"], attention_mask=batch["valid"].long()).logits.float()


def _text(config):
    return labelled_text(config.dataset, text_column=config.text_column, label_column=config.label_column,
                         client_column=config.client_column, unreadable=config.unreadable)


def _class_index(config) -> dict[str, int]:
    """The run's class names and their indices: the run's dataset's where this node can read it, else 0..K-1 for
    num-classes (a SuperNode with its own data only names its class folders by index, as for images)."""
    try:
        return {c: i for i, c in enumerate(_text(config).classes)}
    except ValueError:
        if not config.num_classes:
            raise ValueError(f"This node cannot read the run's dataset {config.dataset} for its class names: set "
                             "num-classes and name the data-dir's class folders 0..K-1.") from None
        return {str(i): i for i in range(config.num_classes)}


@functools.lru_cache(maxsize=2)
def _partitions(config, num_partitions: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(partition_examples(config.partitioner, _text(config), num_partitions=num_partitions,
                                          partition_id=p, seed=config.seed, alpha=config.dirichlet_alpha))
                 for p in range(num_partitions))


def _partition(config, num_partitions: int, partition_id: int) -> tuple[int, ...]:
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"Partition id {partition_id} is out of range for {num_partitions} partitions.")
    return _partitions(config, num_partitions)[partition_id]


def own_examples(data_dir, index: dict[str, int], unreadable: str = "refuse") -> list[tuple[str, int]]:
    """A device's own labelled text: a subfolder of .txt files per class, each class one of the run's."""
    from pathlib import Path

    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise ValueError(f"data-dir '{root}' is not a directory.")
    examples = []
    for directory in sorted(d for d in root.iterdir() if d.is_dir()):
        if directory.name not in index:
            raise ValueError(f"data-dir '{root}': class folder '{directory.name}' is not one of the run's classes "
                             f"({', '.join(list(index)[:5])}{', ...' if len(index) > 5 else ''}).")
        examples += [(text, index[directory.name]) for _, text in text_dir_units(directory, unreadable)]
    if not examples:
        raise ValueError(f"data-dir '{root}' holds no labelled text (a subfolder of .txt files per class).")
    return examples


def max_positions(model: str) -> int | None:
    """The positions a classifier's architecture embeds (RoBERTa's less the two its padding offset takes)."""
    roberta = model_spec(model).family == "roberta"
    positions = architecture(model).get("max_position_embeddings") or (514 if roberta else 512)  # the hub's
    return positions - 2 if roberta else positions
