"""Image classification: ViTs over CIFAR-100, Fashion-MNIST, synthetic CIFAR-like images or the user's own images."""

from __future__ import annotations

import difflib
import functools

import torch.nn.functional as F

from fedlora.data import (FOLDER_PREFIX, HUB_PREFIX, dataset_classes, is_user_dataset, load_image_dir,
                          load_partition, load_split, make_partitioner, to_torch, unreadable_left_out)
from fedlora.models import logits, model_spec
from fedlora.tasks import Task

DATASETS = ("synthetic", "cifar100", "fashion-mnist")
DATASET_CLASSES = {"cifar100": 100, "fashion-mnist": 10}  # num-classes must say the same


class ImageClassification(Task):
    name = "image-classification"

    def classes(self, config) -> int:
        """num-classes, else the data's (read off the data for hf: and folder:)."""
        return config.num_classes or dataset_classes(config.dataset, image_column=config.image_column,
                                                     label_column=config.label_column,
                                                     client_column=config.client_column,
                                                     unreadable=config.unreadable)

    def problems(self, config) -> list[str]:
        problems = []
        if not (config.dataset in DATASETS or is_user_dataset(config.dataset)) or config.dataset in (HUB_PREFIX,
                                                                                                    FOLDER_PREFIX):
            near = difflib.get_close_matches(config.dataset, DATASETS, n=1)
            problems.append(f"dataset must be one of {', '.join(DATASETS)}, hf:<id> or folder:<path>, got "
                            f"'{config.dataset}'" + (f"; did you mean '{near[0]}'?" if near else "."))
        elif (config.image_column or config.label_column) and not is_user_dataset(config.dataset):
            problems.append(f"image-column and label-column name the columns of an hf: or folder: dataset; "
                            f"{config.dataset} has its own.")
        if config.num_classes == 1:
            problems.append("num-classes must be 0 (the data's) or at least 2, got 1.")
        if config.partitioner == "natural" and not is_user_dataset(config.dataset):
            problems.append(f"partitioner = \"natural\" gives each client its writers' images (a client column of an "
                            f"hf: or folder: dataset); {config.dataset} has none: use iid, dirichlet or pathological.")
        if config.client_column and not is_user_dataset(config.dataset):
            problems.append(f"client-column names a column of an hf: or folder: dataset; {config.dataset} has none.")
        if config.text_column:
            problems.append(f"text-column names the column of text for a language model; {config.model} classifies "
                            "images.")
        if problems:
            return problems
        if config.dataset == "synthetic" and config.train_examples < config.num_clients:
            problems.append(f"train-examples ({config.train_examples}) cannot be fewer than num-clients "
                            f"({config.num_clients}): every client needs at least one example.")
        if config.num_classes and config.dataset in DATASET_CLASSES and \
                config.num_classes != DATASET_CLASSES[config.dataset]:
            problems.append(f"{config.dataset} has {DATASET_CLASSES[config.dataset]} classes: set num-classes = "
                            f"{DATASET_CLASSES[config.dataset]} (or 0, the data's).")
        return problems

    def left_out(self, config) -> tuple[str, ...]:
        if not is_user_dataset(config.dataset):
            return ()
        return unreadable_left_out(config.dataset, image_column=config.image_column, label_column=config.label_column,
                                   client_column=config.client_column, unreadable=config.unreadable)

    def check_before_start(self, config) -> None:
        from fedlora.data import fashion_mnist_unavailable_reason
        from fedlora.hub import offline_requested, unreachable_reason

        if config.dataset == "cifar100" and not offline_requested() and (reason := unreachable_reason()):
            raise ValueError(f"CIFAR-100 cannot be fetched ({reason}); offline, use dataset = \"synthetic\" or "
                             "\"fashion-mnist\".")
        if config.dataset == "fashion-mnist" and (reason := fashion_mnist_unavailable_reason()):
            raise ValueError(reason)
        if is_user_dataset(config.dataset):  # read now (cached for the run): a bad column or class is one line here
            found = dataset_classes(config.dataset, image_column=config.image_column,
                                    label_column=config.label_column, client_column=config.client_column,
                                    unreadable=config.unreadable)
            if config.num_classes and config.num_classes != found:
                raise ValueError(f"{config.dataset} has {found} classes, but num-classes = {config.num_classes}: set "
                                 f"num-classes = {found}, or 0 (the data's).")
            if config.partitioner == "natural":  # no client column, or fewer writers than clients: here
                _partitioner(config, config.num_clients)

    def train_data(self, config, node, device):
        """The node's own images (data-dir), else its partition of the run's dataset, decoded onto ``device``."""
        data = (load_image_dir(node.data_dir, num_classes=self.classes(config), unreadable=config.unreadable)
                if node.data_dir
                else load_partition(_partitioner(config, node.num_partitions), node.partition_id))
        return to_torch(data, model_spec(config.model).image_size, train=True, device=device)

    def test_data(self, config, device):
        return to_torch(load_split(config, "test"), model_spec(config.model).image_size, device=device)

    def example_losses(self, model, batch):
        return F.cross_entropy(logits(model, batch["pixel_values"]).float(), batch["labels"], reduction="none")

    def loss(self, model, batch):
        return F.cross_entropy(logits(model, batch["pixel_values"]).float(), batch["labels"])

    def evaluate(self, model, data, *, precision: str = "fp32") -> dict[str, float]:
        from fedlora.training import evaluate

        accuracy, loss = evaluate(model, data, precision=precision)
        return {"accuracy": accuracy, "loss": loss}

    def chance(self, config) -> float | None:
        return 1 / self.classes(config)


@functools.lru_cache(maxsize=2)
def _partitioner(config, num_partitions: int):
    train = load_split(config, "train")
    return make_partitioner(config.partitioner, num_partitions=num_partitions, dataset=train,
                            alpha=config.dirichlet_alpha, seed=config.seed)
