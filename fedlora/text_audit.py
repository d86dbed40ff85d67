"""What a language model federation leaks about a client's text, measured (issue 66; the statistics are in
fedlora.audit): loss-based membership inference at client level against a reference model trained on an auxiliary
split (../shared/papers/000, Sec. 8, in federated form), and canary exposure (Carlini et al. 2019, "The Secret
Sharer") of random word sequences written into chosen clients' text, each included with probability 1/2 so that the
same canaries give the one-run lower bound (Steinke, Nasr and Jagielski 2023).

The audited federation reads its text from a folder this module writes (train/ with the canaries in, test/ as the
dataset's, aux/ the auxiliary split no client holds), so that it runs through the product's own path, in process or
on Ray. Torch and the tokenizer only: no Flower here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from fedlora.tasks import task_named
from fedlora.text import TextSplits, TextTokenizer, to_device_tokens

WORD = re.compile(r"Ġ[a-z]{3,}")  # a byte-level BPE token that is a whole lower-case word after a space
CAUSAL_LM = task_named("causal-lm")
UNIT_NAME = "{:05d}.txt"  # files sort in the units' order, which the natural partitioner deals by


def word_ids(tokenizer: TextTokenizer) -> np.ndarray:
    """The ids of the tokenizer's whole-word tokens: a sequence of them reads back as the same ids (each word is
    pre-tokenized alone and is one token), so a canary written as text is trained on as drawn."""
    if not hasattr(tokenizer.backend, "get_vocab") or not hasattr(tokenizer.backend, "decode"):
        raise ValueError(f"Text canaries need a byte-level BPE tokenizer file; '{tokenizer.name}' is not one.")
    ids = np.array(sorted(i for token, i in tokenizer.backend.get_vocab().items() if WORD.fullmatch(token)))
    if len(ids) < 100:
        raise ValueError(f"The tokenizer '{tokenizer.name}' has {len(ids)} whole-word tokens: too few to draw canaries "
                         "from (at least 100).")
    return ids


def draw_sequences(tokenizer: TextTokenizer, count: int, length: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``count`` sequences of ``length`` whole words drawn uniformly (with replacement), each one that reads back
    as itself."""
    words = word_ids(tokenizer)
    sequences = [words[rng.integers(len(words), size=length)] for _ in range(count)]
    texts = [tokenizer.backend.decode(s.tolist()) for s in sequences]
    if any(list(ids) != s.tolist() for ids, s in zip(tokenizer.encode(texts), sequences)):
        raise ValueError(f"The tokenizer '{tokenizer.name}' does not read its word sequences back as drawn.")
    return sequences


@dataclass(frozen=True)
class TextCanaries:
    """Canaries for one audit: client ``clients[i]`` writes ``sequences[i]`` ``repeats`` times into its text when
    ``included[i]``; ``candidates`` are drawn alike and never written (the exposure's reference set)."""

    clients: tuple[int, ...]
    sequences: tuple[np.ndarray, ...]
    included: np.ndarray
    candidates: tuple[np.ndarray, ...]
    repeats: int

    @classmethod
    def draw(cls, tokenizer: TextTokenizer, clients: Sequence[int], *, length: int, candidates: int, repeats: int,
             seed: int) -> "TextCanaries":
        rng = np.random.default_rng(seed)
        drawn = draw_sequences(tokenizer, len(clients) + candidates, length, rng)
        included = rng.random(len(clients)) < 0.5  # the coins, drawn after the sequences: nothing scored reads them
        return cls(tuple(clients), tuple(drawn[:len(clients)]), included, tuple(drawn[len(clients):]), repeats)

    def written(self, tokenizer: TextTokenizer) -> dict[int, str]:
        """The text each included canary's client gets appended to its first unit: a line per repeat, its words
        space-led as drawn (a newline is a token of its own, so the canary's ids appear in the client's stream)."""
        return {client: "".join(["\n" + tokenizer.backend.decode(sequence.tolist())] * self.repeats)
                for client, sequence, coin in zip(self.clients, self.sequences, self.included) if coin}


def write_audit_text(splits: TextSplits, root: Path, *, clients: int, aux_units: int,
                     written: dict[int, str]) -> Path:
    """The audited dataset as a folder (dataset = "folder:<root>"): train/ holds the training units less the last
    ``aux_units`` (the auxiliary split, which no client holds: ``write_reference_text``), unit u with ``written[u]``
    appended; test/ the dataset's test units."""
    if aux_units < 1 or len(splits.train) - aux_units < clients:
        raise ValueError(f"The text has {len(splits.train)} training units: {clients} clients and an auxiliary split "
                         f"of {aux_units} need {clients + aux_units}.")
    kept = splits.train[:len(splits.train) - aux_units]
    return _write_folder(root, train=[text + written.get(i, "") for i, (_, text) in enumerate(kept)],
                         test=[text for _, text in splits.test])


def write_reference_text(splits: TextSplits, root: Path, *, aux_units: int) -> Path:
    """The reference model's dataset as a folder: the auxiliary split (the last ``aux_units`` training units, as
    ``write_audit_text`` keeps them out) to train on, the dataset's test units to evaluate on."""
    return _write_folder(root, train=[text for _, text in splits.train[len(splits.train) - aux_units:]],
                         test=[text for _, text in splits.test])


def _write_folder(root: Path, **splits: list[str]) -> Path:
    for split, texts in splits.items():
        folder = root / split
        folder.mkdir(parents=True, exist_ok=True)
        for i, text in enumerate(texts):
            (folder / UNIT_NAME.format(i)).write_text(text, encoding="utf-8")
    return root


@torch.no_grad()
def sequence_losses(model, sequences: Sequence[np.ndarray], eos_id: int, *, batch_size: int = 64) -> np.ndarray:
    """Each sequence's mean next-token loss (nats), every token predicted from the end-of-text token and the tokens
    before it: the log-perplexity the exposure ranks by (lower: the model finds the sequence more likely)."""
    device = next(model.parameters()).device
    model.eval()
    out = []
    for start in range(0, len(sequences), batch_size):
        ids = torch.as_tensor(np.stack([np.concatenate([[eos_id], s]) for s in sequences[start:start + batch_size]]),
                              device=device)
        batch = {"input_ids": ids, "valid": torch.ones_like(ids, dtype=torch.bool)}
        out.append(CAUSAL_LM.example_losses(model, batch).double().cpu().numpy())
    return np.concatenate(out) if out else np.zeros(0)


def text_loss(model, units: Sequence[np.ndarray], seq_len: int, eos_id: int) -> float:
    """The mean next-token loss (nats per predicted token) of ``units`` packed into blocks as a client trains on them:
    a client's membership score is the reference model's loss less the audited model's."""
    device = next(model.parameters()).device
    return CAUSAL_LM.evaluate(model, to_device_tokens(units, seq_len, eos_id, device=device))["loss"]
