"""Causal language modelling: GPT-2 and LLaMA-style models on real text (the King James Bible offline, the user's
own text, hub datasets), measured by token-level loss, perplexity and next-token accuracy."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fedlora.models import architecture, model_spec
from fedlora.tasks import Task
from fedlora.text import (BIBLE_KJV, TEXT_DATASETS, TEXT_PARTITIONERS, bible_unavailable_reason, check_tokenizer_fits,
                          load_tokenizer, partition_units, text_dir_units, text_splits, to_device_tokens,
                          tokenized_units, tokenizer_of)


class CausalLM(Task):
    name = "causal-lm"
    metric = "next-token accuracy"
    plotted = ("perplexity", "test perplexity")

    def problems(self, config) -> list[str]:
        problems = []
        if not (config.dataset in TEXT_DATASETS or config.dataset.startswith(("hf:", "folder:"))) or \
                config.dataset in ("hf:", "folder:"):
            problems.append(f"{config.model} is a language model: dataset must be text ({', '.join(TEXT_DATASETS)}, "
                            f"folder:<path> of .txt or .jsonl files, or hf:<id>), got '{config.dataset}'.")
        if config.num_classes:
            problems.append(f"num-classes is for classifiers: {config.model} predicts the next token (set "
                            "num-classes = 0).")
        if config.image_column or config.label_column:
            problems.append(f"image-column and label-column name a classifier's columns; {config.model} reads "
                            "text (text-column, client-column).")
        if config.dataset == BIBLE_KJV and (config.text_column or config.client_column):
            problems.append("text-column and client-column name the columns of an hf: or folder: dataset; bible-kjv "
                            "has its own (one unit per chapter).")
        if config.partitioner not in TEXT_PARTITIONERS:
            problems.append(f"Text is split over clients by its units (chapters, files, users): partitioner must be "
                            f"{' or '.join(TEXT_PARTITIONERS)}, got '{config.partitioner}'.")
        if config.head == "probe":
            problems.append(f"head = \"probe\" trains a classifier head first; {config.model} has none (its output "
                            "layer is tied to its input embedding and stays frozen): use head = \"frozen\".")
        positions = _max_positions(config.model)
        if positions and config.seq_len > positions:
            problems.append(f"seq-len ({config.seq_len}) exceeds {config.model}'s {positions} positions.")
        return problems

    def check_before_start(self, config) -> None:
        if config.dataset == BIBLE_KJV and (reason := bible_unavailable_reason()):
            raise ValueError(reason)
        check_tokenizer_fits(config).eos_id  # raises if there is none to pack texts with
        splits = _splits(config)
        if config.num_clients > len(splits.train):
            raise ValueError(f"{config.dataset} has {len(splits.train)} units of training text (chapters, files or "
                             f"users) for num-clients = {config.num_clients}: set num-clients <= {len(splits.train)}.")

    def left_out(self, config) -> tuple[str, ...]:
        return _splits(config).left_out

    def train_data(self, config, node, device):
        """The node's own text (data-dir), else its partition's units, packed into blocks on ``device``."""
        tokenizer = load_tokenizer(tokenizer_of(config))
        if node.data_dir:
            units = [torch.as_tensor(ids).numpy() for ids in tokenizer.encode([t for _, t in
                                                                              text_dir_units(node.data_dir,
                                                                                             config.unreadable)])]
        else:
            every = tokenized_units(config.dataset, "train", tokenizer_of(config), config.text_column,
                                    config.client_column, config.unreadable)
            units = [every[i] for i in partition_units(config.partitioner, units=len(every),
                                                       num_partitions=node.num_partitions,
                                                       partition_id=node.partition_id, seed=config.seed)]
        return to_device_tokens(units, config.seq_len, tokenizer.eos_id, device=device)

    def test_data(self, config, device):
        tokenizer = load_tokenizer(tokenizer_of(config))
        units = tokenized_units(config.dataset, "test", tokenizer_of(config), config.text_column, config.client_column,
                                config.unreadable)
        return to_device_tokens(units, config.seq_len, tokenizer.eos_id, device=device)

    def example_losses(self, model, batch):
        """Each block's mean next-token loss over its real tokens."""
        token, predicted = _token_losses(model, batch)
        return (token * predicted).sum(1) / predicted.sum(1).clamp(min=1)

    @torch.no_grad()
    def evaluate(self, model, data, *, precision: str = "fp32", batch_size: int = 64) -> dict[str, float]:
        """Token-level loss (nats per predicted token), its perplexity, and next-token accuracy, over every real token
        of ``data`` that has one before it in its block."""
        from fedlora.training import autocast, compute_dtype

        device = next(model.parameters()).device
        dtype = compute_dtype(precision, device)
        model.eval()
        loss = torch.zeros((), dtype=torch.float64, device=device)
        correct = torch.zeros((), dtype=torch.int64, device=device)
        count = torch.zeros((), dtype=torch.int64, device=device)
        for start in range(0, len(data), batch_size):
            batch = data[list(range(start, min(start + batch_size, len(data))))]
            with autocast(device, dtype):
                token, predicted, guesses = _token_losses(model, batch, guesses=True)
            loss += (token * predicted).sum().double()
            correct += ((guesses == batch["input_ids"][:, 1:]) & (predicted > 0)).sum()
            count += predicted.sum().long()
        mean = loss.item() / max(count.item(), 1)
        return {"accuracy": correct.item() / max(count.item(), 1), "loss": mean, "perplexity": math.exp(mean)}


def _splits(config):
    return text_splits(config.dataset, text_column=config.text_column, client_column=config.client_column,
                       unreadable=config.unreadable)


def _token_losses(model, batch, *, guesses: bool = False):
    """(per-token loss (B, L - 1), 1.0 where the token is predicted from a real one before it, else 0.0[, the
    argmax guesses])."""
    ids, valid = batch["input_ids"], batch["valid"]
    scores = model(input_ids=ids).logits[:, :-1].float()
    token = F.cross_entropy(scores.reshape(-1, scores.shape[-1]), ids[:, 1:].reshape(-1),
                            reduction="none").view(ids.shape[0], -1)
    predicted = (valid[:, 1:] & valid[:, :-1]).float()
    return (token, predicted, scores.argmax(-1)) if guesses else (token, predicted)


def _max_positions(model: str) -> int | None:
    arch = architecture(model)
    return arch.get("n_positions") or arch.get("max_position_embeddings") or (1024 if model_spec(model).family ==
                                                                               "gpt2" else None)
