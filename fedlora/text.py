"""Text for language models: real corpora offline, the user's own text, tokenizers, and token blocks on the device;
labelled text for text classifiers (``labelled_text``, one example a text, ``example_tokens``).

A text dataset is a list of *units*, each a writer's or a document's text: a chapter of the King James Bible, a
file of a folder, the lines of a JSON-lines file that share a user id, the rows of a hub dataset that share a
client column. Units are the natural partition (one or more units per client, ``partition_units``), and a split's
units are what ``token_blocks`` packs into blocks of ``seq-len`` tokens.

Offline real text (Debian packages, installable by CI as root):
- ``bible-kjv`` (`apt-get install bible-kjv`): the King James Bible, public domain, 66 books, 1,189 chapters; each
  chapter is a unit. Every tenth chapter (by canonical order) is held out as the test split; the other 1,071 are
  the federation's private training text.
- ``fortunes`` (`apt-get install fortunes`): about 15,000 fortune-cookie texts of many modern writers. It is the
  public text the packaged tiny language model and its tokenizer were trained on (``fedlora pretrain --dataset
  fortunes``), and never a federation's data.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedlora.data import (CLIENT_COLUMN, CLIENT_COLUMNS, FOLDER_PREFIX, HELD_OUT_FRACTION, HELD_OUT_SEED, HUB_PREFIX,
                          _hub_dataset, _onto_device, deal_units)
from fedlora.models import PACKAGED_TOKENIZERS, architecture, model_spec

BIBLE_KJV = "bible-kjv"
FORTUNES = "fortunes"
TEXT_DATASETS = (BIBLE_KJV,)  # built-in private text corpora (fortunes is public: pretraining only)
BIBLE_HELD_OUT_EVERY = 10  # every tenth chapter is test text
FORTUNES_DIR = Path("/usr/share/games/fortunes")
FORTUNES_SKIPPED = ("ascii-art", "translate-me")  # pictures made of characters, and text that is not English
TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl", ".json")
TEXT_COLUMNS = ("text", "content", "sentence", "document")  # recognized without text-column
LABEL_COLUMNS = ("label", "labels", "class", "category")  # a classifier's labels, recognized without label-column
TEXT_PARTITIONERS = ("natural", "iid")
EOS = "<|endoftext|>"
PAD_TOKENS = ("[PAD]", "<pad>", EOS)  # a tokenizers file's padding token (BERT's, RoBERTa's, GPT-2's end-of-text)


class TextUnavailableError(ValueError):
    """A text corpus cannot be read here (a Debian package not installed, a hub dataset unreachable)."""


@dataclass(frozen=True)
class TextSplits:
    """A text dataset's units, by split: each unit a (name, text) pair."""

    train: tuple[tuple[str, str], ...]
    test: tuple[tuple[str, str], ...]
    left_out: tuple[str, ...] = ()  # files or lines that do not decode, skipped as the user asked (unreadable = "skip")


# -- corpora ----------------------------------------------------------------------------------------------------
def bible_unavailable_reason() -> str | None:
    if shutil.which("bible") is None:
        return ("dataset = \"bible-kjv\" needs the King James Bible offline: `sudo apt-get install bible-kjv` (its "
                "`bible` program prints the text).")
    return None


@functools.lru_cache(maxsize=1)
def bible_chapters() -> tuple[tuple[str, str], ...]:
    """The King James Bible's 1,189 chapters in canonical order, each ("Ge1", its verses joined by newlines), from
    the Debian package's `bible` program."""
    if reason := bible_unavailable_reason():
        raise TextUnavailableError(reason)
    return parse_bible(subprocess.run(["bible", "-f", "gen1:1-rev22:21"], capture_output=True, text=True,
                                      check=True).stdout)


def parse_bible(printed: str) -> tuple[tuple[str, str], ...]:
    """Chapters from what `bible -f` prints, one verse a line ("Ge1:1 In the beginning ..."), in order."""
    chapters: dict[str, list[str]] = {}
    for line in printed.splitlines():
        reference, _, verse = line.partition(" ")
        if verse:  # "Ge1:1 In the beginning ..."
            chapters.setdefault(reference.rpartition(":")[0], []).append(verse.strip())
    return tuple((name, "\n".join(verses)) for name, verses in chapters.items())


def bible_splits() -> TextSplits:
    chapters = bible_chapters()
    held_out = {i for i in range(len(chapters)) if i % BIBLE_HELD_OUT_EVERY == BIBLE_HELD_OUT_EVERY - 1}
    return TextSplits(tuple(c for i, c in enumerate(chapters) if i not in held_out),
                      tuple(c for i, c in enumerate(chapters) if i in held_out))


def fortunes_unavailable_reason() -> str | None:
    if not FORTUNES_DIR.is_dir():
        return "The public text (fortunes) is missing: `sudo apt-get install fortunes`."
    return None


def fortunes_texts() -> list[str]:
    """Every fortune of the base package (no offensive ones: those are the separate fortunes-off), one text each."""
    if reason := fortunes_unavailable_reason():
        raise TextUnavailableError(reason)
    texts = []
    for path in sorted(FORTUNES_DIR.iterdir()):
        if path.suffix or path.is_dir() or path.name in FORTUNES_SKIPPED:  # .dat indexes and .u8 links
            continue
        texts += [t.strip() for t in path.read_text(encoding="utf-8", errors="replace").split("\n%\n") if t.strip()]
    return texts


# -- the user's own text ----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def user_text(name: str, *, text_column: str = "", client_column: str = "", unreadable: str = "refuse") -> TextSplits:
    """The units of "folder:<path>" (.txt files, one unit each; JSON-lines files, one unit per client-column value or
    per line; train/ and test/ subfolders, if there, are the splits) or of "hf:<id>" (a hub dataset's text column,
    one unit per client-column value or per row). Without a test split, a seeded HELD_OUT_FRACTION of the units is
    held out. Raises ValueError, one sentence, on anything that cannot be used; a file that is not UTF-8 or a line
    that is not JSON is refused so too, or with ``unreadable`` = "skip" left out and named in ``left_out``."""
    undecodable = Undecodable(name, unreadable)
    if name.startswith(HUB_PREFIX):
        splits = [_rows_units(name, list(split), text_column, client_column) if split is not None else None
                  for split in _hub_splits(name)]
    else:
        splits = [_folder_units(name, f, text_column, client_column, undecodable) if f is not None else None
                  for f in _folder_splits(name)]
    train, test = splits
    if not train:
        raise ValueError(f"{name} holds no text: expected .txt or .jsonl files.")
    if test is None:
        order = np.random.default_rng(HELD_OUT_SEED).permutation(len(train))
        count = max(1, round(HELD_OUT_FRACTION * len(train)))
        if len(train) < 2:
            raise ValueError(f"{name} has 1 unit of text: a test split needs another (add a file, or a test/ folder).")
        test, train = [train[i] for i in sorted(order[:count])], [train[i] for i in sorted(order[count:])]
    return TextSplits(tuple(train), tuple(test), tuple(undecodable.left_out))


def _hub_splits(name: str, label_column: str = "") -> tuple:
    """(train, test or None) of "hf:<id>": its train split (or its only one), and its test or validation split; with
    a label column, a split whose labels are all negative (GLUE's unlabelled test splits hold -1) is not a test."""
    raw = _hub_dataset(name.removeprefix(HUB_PREFIX))
    train = raw["train"] if "train" in raw else raw[next(iter(raw))] if len(raw) == 1 else None
    if train is None:
        raise ValueError(f"{name} has no train split (its splits: {', '.join(raw)}).")

    def labelled(split) -> bool:
        if not label_column or label_column not in split.column_names:
            return True
        return any(not (isinstance(v, int) and v < 0) for v in split[label_column])
    return train, next((raw[s] for s in ("test", "validation") if s in raw and labelled(raw[s])), None)


def _folder_splits(name: str) -> tuple[Path, Path | None]:
    """(train, test or None) folders of "folder:<path>": its train/ and test/ subfolders if there, else itself."""
    root = Path(name.removeprefix(FOLDER_PREFIX)).expanduser()
    if not root.is_dir():
        raise ValueError(f"{name}: '{root}' is not a directory.")
    if (root / "train").is_dir():
        return root / "train", root / "test" if (root / "test").is_dir() else None
    return root, None


def _folder_units(name: str, folder: Path, text_column: str, client_column: str,
                  undecodable: Undecodable) -> list[tuple[str, str]]:
    units = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = str(path.relative_to(folder))
        if path.suffix.lower() in TEXT_SUFFIXES:
            if (text := undecodable.text(path, relative)) is None:
                continue
            if not text.strip():
                raise ValueError(f"{name}: '{relative}' is empty: every file is a unit of text, and a unit needs "
                                 "text.")
            units.append((relative, text))
        elif path.suffix.lower() in JSONL_SUFFIXES and (rows := undecodable.json_lines(path, relative)):
            units += [(f"{relative}:{unit}", text) for unit, text in _rows_units(f"{name}/{relative}", rows,
                                                                                 text_column, client_column)]
    return units


def _rows_units(name: str, rows: Sequence[dict], text_column: str, client_column: str) -> list[tuple[str, str]]:
    """Rows of records grouped into units by the client column (in first-seen order), else one unit per row."""
    if not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{name}: every row must be a JSON object with a text field.")
    columns = list(rows[0])
    text = _text_column(name, columns, rows[0], text_column, TEXT_COLUMNS, kind="text")
    client = (_text_column(name, columns, rows[0], client_column, CLIENT_COLUMNS, kind="client", optional=True))
    units: dict[str, list[str]] = {}
    for i, row in enumerate(rows):
        if text not in row or not isinstance(row[text], str):
            raise ValueError(f"{name}: row {i + 1} has no text in its '{text}' field.")
        key = str(row.get(client)) if client else str(i)
        units.setdefault(key, []).append(row[text])
    return [(key, "\n".join(parts)) for key, parts in units.items() if any(p.strip() for p in parts)]


def _text_column(name: str, columns: list[str], first: dict, chosen: str, candidates: tuple[str, ...], *, kind: str,
                 optional: bool = False) -> str | None:
    if chosen:
        if chosen not in columns:
            raise ValueError(f"{name} has no column '{chosen}' ({kind}-column); its columns: {', '.join(columns)}.")
        return chosen
    found = [c for c in candidates if c in columns]
    if not found and kind == "text":
        found = [c for c in columns if isinstance(first.get(c), str)]
    if len(found) == 1:
        return found[0]
    if optional and not found:
        return None
    raise ValueError(f"{name} has {len(found) or 'no'} {kind} columns ({', '.join(found) or ', '.join(columns)}): "
                     f"set {kind}-column.")


def text_splits(dataset: str, *, text_column: str = "", client_column: str = "",
                unreadable: str = "refuse") -> TextSplits:
    """The units of a text dataset by name: a built-in corpus, "folder:<path>" or "hf:<id>"."""
    if dataset == BIBLE_KJV:
        return bible_splits()
    if dataset.startswith((FOLDER_PREFIX, HUB_PREFIX)):
        return user_text(dataset, text_column=text_column, client_column=client_column, unreadable=unreadable)
    raise ValueError(f"'{dataset}' is not text: a language model reads {', '.join(TEXT_DATASETS)}, folder:<path> "
                     "(.txt or .jsonl files) or hf:<id>.")


def partition_units(kind: str, *, units: int, num_partitions: int, partition_id: int, seed: int = 0) -> list[int]:
    """The units of one partition: "natural" gives client c the units c, c + C, c + 2C, ... (one unit each when
    there are as many clients as units); "iid" shuffles the units (seeded) and deals equal shares."""
    if kind not in TEXT_PARTITIONERS:
        raise ValueError(f"Text is partitioned by its units: partitioner must be one of {', '.join(TEXT_PARTITIONERS)}"
                         f", got '{kind}'.")
    if kind == "natural":
        return deal_units(units, num_partitions, partition_id)
    if num_partitions > units:
        raise ValueError(f"The text has {units} units (chapters, files or users) for {num_partitions} clients: set "
                         f"num-clients <= {units}.")
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"Partition id {partition_id} is out of range for {num_partitions} partitions.")
    order = np.random.default_rng(seed).permutation(units)
    return sorted(np.array_split(order, num_partitions)[partition_id].tolist())


# -- tokenizers -------------------------------------------------------------------------------------------------
class TextTokenizer:
    """A tokenizer's two uses here: ids of texts, and the end-of-text id that separates packed texts."""

    def __init__(self, name: str, backend):
        self.name, self.backend = name, backend  # a tokenizers.Tokenizer or a transformers tokenizer

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size() if hasattr(self.backend, "get_vocab_size") else len(self.backend)

    @property
    def eos_id(self) -> int:
        if hasattr(self.backend, "token_to_id"):
            found = self.backend.token_to_id(EOS)
        else:
            found = self.backend.eos_token_id
        if found is None:
            raise ValueError(f"The tokenizer '{self.name}' has no end-of-text token to separate packed texts.")
        return found

    @property
    def pad_id(self) -> int:
        """The id padding is filled with (masked out wherever it is): the tokenizer's pad token, else end-of-text."""
        if hasattr(self.backend, "token_to_id"):  # a tokenizers file: its pad token by the usual names
            found = next((i for t in PAD_TOKENS if (i := self.backend.token_to_id(t)) is not None), None)
        else:
            found = self.backend.pad_token_id if self.backend.pad_token_id is not None else self.backend.eos_token_id
        if found is None:
            raise ValueError(f"The tokenizer '{self.name}' has no padding or end-of-text token to pad examples with.")
        return found

    def encode(self, texts: Sequence[str], *, special: bool = False, max_length: int | None = None) -> list[list[int]]:
        """Each text's ids, at most ``max_length``; ``special``: with the tokens a hub tokenizer adds around one
        sequence (BERT's [CLS] and [SEP], kept when the text is cut), as its classifier was trained to read (a
        tokenizers file adds none)."""
        if hasattr(self.backend, "encode_batch"):
            return [e.ids[:max_length] for e in self.backend.encode_batch(list(texts))]
        return self.backend(list(texts), add_special_tokens=special, truncation=max_length is not None,
                            max_length=max_length)["input_ids"]


def train_tokenizer(texts: Sequence[str], vocab_size: int):
    """A byte-level BPE (GPT-2's scheme: every byte has a token, so no text is out of vocabulary) trained on
    ``texts``, with the end-of-text token as id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str) -> TextTokenizer:
    """A tokenizer.json file (the packaged one is a path), else a hub id through transformers' AutoTokenizer."""
    path = Path(name).expanduser()
    if path.suffix == ".json":
        if not path.is_file():
            raise ValueError(f"The tokenizer file '{path}' does not exist.")
        from tokenizers import Tokenizer

        try:
            return TextTokenizer(name, Tokenizer.from_file(str(path)))
        except Exception as error:  # the tokenizers library raises its own kinds for a foreign file
            raise ValueError(f"'{path}' is not a tokenizers tokenizer.json ({type(error).__name__}).") from None
    from fedlora.hub import offline_requested, unreachable_reason

    if not path.is_dir() and not offline_requested() and (reason := unreachable_reason()):  # a folder: no hub
        raise TextUnavailableError(f"The tokenizer '{name}' could not be loaded from the Hugging Face hub ({reason}); "
                                   "offline, use model = \"gpt2-tiny-public\" (its tokenizer is packaged).")
    from transformers import AutoTokenizer

    try:
        return TextTokenizer(name, AutoTokenizer.from_pretrained(name))
    except (OSError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise TextUnavailableError(f"The tokenizer '{name}' could not be loaded ({first}); offline, use model = "
                                   "\"gpt2-tiny-public\" (its tokenizer is packaged).") from None


# -- the run's tokenizer -----------------------------------------------------------------------------------------
def check_tokenizer_fits(config) -> TextTokenizer:
    """The run's tokenizer, once its ids are known to fall inside the model's embedding (ValueError, one sentence,
    if not)."""
    tokenizer = load_tokenizer(tokenizer_of(config))
    vocab = vocab_size(config.model)
    if tokenizer.vocab_size > vocab:
        raise ValueError(f"The tokenizer '{config.tokenizer or model_spec(config.model).tokenizer}' has "
                         f"{tokenizer.vocab_size} tokens, more than {config.model}'s {vocab}: its ids would fall "
                         "outside the model's embedding (use the model's own tokenizer: tokenizer = \"\").")
    return tokenizer


def tokenizer_of(config) -> str:
    """The run's tokenizer as ``load_tokenizer`` reads it: tokenizer, else the model's (a packaged one by its path)."""
    name = config.tokenizer or model_spec(config.model).tokenizer
    if name in PACKAGED_TOKENIZERS:
        return str(_checked_tokenizer(name))
    return name


def _checked_tokenizer(name: str) -> Path:
    import hashlib

    packaged = PACKAGED_TOKENIZERS[name]
    path = packaged.locate()
    if not path.is_file():
        raise ValueError(f"The packaged tokenizer '{path}' is missing; rebuild it with `fedlora pretrain --dataset "
                         f"{packaged.dataset}`.")
    if hashlib.sha256(path.read_bytes()).hexdigest() != packaged.sha256:
        raise ValueError(f"The packaged tokenizer '{path}' does not match its sha256 {packaged.sha256[:12]}...; "
                         f"rebuild it with `fedlora pretrain --dataset {packaged.dataset}`.")
    return path


def vocab_size(model: str) -> int:
    """The model's vocabulary (the hub models' defaults: GPT-2's, BERT's, RoBERTa's, DistilBERT's)."""
    default = {"gpt2": 50257, "bert": 30522, "roberta": 50265, "distilbert": 30522}.get(model_spec(model).family,
                                                                                        32000)
    return architecture(model).get("vocab_size", default)


# -- token blocks on the device -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def tokenized_units(dataset: str, split: str, tokenizer: str, text_column: str = "", client_column: str = "",
                    unreadable: str = "refuse") -> tuple[np.ndarray, ...]:
    """Each unit of a split as token ids, once per process."""
    splits = text_splits(dataset, text_column=text_column, client_column=client_column, unreadable=unreadable)
    units = splits.train if split == "train" else splits.test
    return tuple(np.asarray(ids, dtype=np.int64) for ids in load_tokenizer(tokenizer).encode([t for _, t in units]))


def token_blocks(units: Sequence[np.ndarray], seq_len: int, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Units packed into blocks of ``seq_len`` tokens: each unit followed by the end-of-text token, all joined and
    cut; the last block padded (``valid`` false there) and dropped if it holds fewer than 2 tokens (no prediction).
    Returns (ids, valid), (blocks, seq_len) each."""
    stream = np.concatenate([np.append(u, eos_id) for u in units]) if units else np.zeros(0, dtype=np.int64)
    blocks = -(-len(stream) // seq_len)
    if blocks and len(stream) - (blocks - 1) * seq_len < 2:
        blocks -= 1
        stream = stream[:blocks * seq_len]
    ids = np.full(blocks * seq_len, eos_id, dtype=np.int64)
    ids[:len(stream)] = stream
    valid = np.zeros(blocks * seq_len, dtype=bool)
    valid[:len(stream)] = True
    return torch.from_numpy(ids).view(blocks, seq_len), torch.from_numpy(valid).view(blocks, seq_len)


class DeviceTokens:
    """Blocks of token ids stored once on a device; ``tokens[indices]`` gives {"input_ids": int64 (B, L), "valid":
    bool (B, L)} there (``valid``: a real token, not padding), and "labels" (B,) when each block is a labelled
    example (a text classifier's)."""

    def __init__(self, ids: torch.Tensor, valid: torch.Tensor, device: torch.device | str | None = None,
                 labels: torch.Tensor | None = None):
        self.device = torch.device(device or "cpu")
        self.ids, self.valid = ids.to(self.device), valid.to(self.device)
        self.labels = labels.to(self.device) if labels is not None else None

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def tokens(self) -> int:
        return int(self.valid.sum())

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + self.valid.nbytes + (self.labels.nbytes if self.labels is not None else 0)

    def draw(self, key: int | slice | Sequence[int]) -> TokenDraw:
        rows = torch.arange(len(self))[key] if isinstance(key, slice) else torch.as_tensor(key, dtype=torch.int64)
        return TokenDraw(self, rows)

    def __getitem__(self, key: int | slice | Sequence[int]) -> dict[str, torch.Tensor]:
        if isinstance(key, (int, np.integer)):
            return {name: value[0] for name, value in self[[int(key)]].items()}
        return TokenDraw.join([self.draw(key)])


@dataclass(frozen=True)
class TokenDraw:
    """Blocks chosen from a DeviceTokens, joined with other clients' into one batch by ``join``."""

    tokens: DeviceTokens
    rows: torch.Tensor  # int64, on the host

    @staticmethod
    def join(draws: Sequence[TokenDraw]) -> dict[str, torch.Tensor]:
        """The draws' blocks concatenated in order, on the device."""
        first = draws[0].tokens
        if any(d.tokens.ids.shape[1] != first.ids.shape[1] or d.tokens.device != first.device for d in draws):
            raise ValueError("Blocks drawn together must have one length and one device.")
        if any((d.tokens.labels is None) != (first.labels is None) for d in draws):
            raise ValueError("Blocks drawn together must all be labelled, or none.")
        rows = _onto_device(torch.cat([d.rows for d in draws]), first.device).split([len(d.rows) for d in draws])
        batch = {"input_ids": torch.cat([d.tokens.ids[r] for d, r in zip(draws, rows)]),
                 "valid": torch.cat([d.tokens.valid[r] for d, r in zip(draws, rows)])}
        if first.labels is not None:
            batch["labels"] = torch.cat([d.tokens.labels[r] for d, r in zip(draws, rows)])
        return batch


def to_device_tokens(units: Sequence[np.ndarray], seq_len: int, eos_id: int,
                     device: torch.device | str | None = None) -> DeviceTokens:
    return DeviceTokens(*token_blocks(units, seq_len, eos_id), device=device)


def text_dir_units(path: str | os.PathLike[str], unreadable: str = "refuse") -> list[tuple[str, str]]:
    """A device's own text (data-dir): its .txt and .jsonl files, every file's text one unit. A file that is not
    UTF-8 or a line that is not JSON is refused, or with ``unreadable`` = "skip" left out (the node's log counts
    them)."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ValueError(f"data-dir '{root}' is not a directory.")
    undecodable = Undecodable(f"data-dir {root}", unreadable)
    units = _folder_units(undecodable.name, root, "", "", undecodable)
    undecodable.log()
    if not units:
        raise ValueError(f"data-dir '{root}' holds no text (.txt or .jsonl files).")
    return units


# -- labelled text, for text classifiers ------------------------------------------------------------------------
@dataclass(frozen=True)
class LabelledText:
    """A text-classification dataset: each split's examples as (text, label index, client key or None), and the
    class names (a label's index is its place there)."""

    train: tuple[tuple[str, int, str | None], ...]
    test: tuple[tuple[str, int, str | None], ...]
    classes: tuple[str, ...]
    left_out: tuple[str, ...] = ()  # files or lines that do not decode, skipped as the user asked (unreadable = "skip")

    @property
    def has_clients(self) -> bool:
        return self.train[0][2] is not None


@functools.lru_cache(maxsize=4)
def labelled_text(name: str, *, text_column: str = "", label_column: str = "", client_column: str = "",
                  unreadable: str = "refuse") -> LabelledText:
    """The examples of "folder:<path>" (a subfolder of .txt files per class, each file an example; or JSON-lines
    files, a row an example, with a text and a label field; train/ and test/ subfolders, if there, are the splits) or
    of "hf:<id>" (a hub dataset's text and label columns). A client column, if set or found (user, author, ...),
    is the natural partition's unit. Without a test split a seeded, stratified HELD_OUT_FRACTION is held out.
    Raises ValueError, one sentence, on anything that cannot be used; a file that is not UTF-8 or a line that is not
    JSON is refused so too, or with ``unreadable`` = "skip" left out and named in ``left_out``."""
    undecodable = Undecodable(name, unreadable)
    names: list[str] | None = None  # a hub ClassLabel's names, in its order
    if name.startswith(HUB_PREFIX):
        import datasets

        label = _labels_column(name, _hub_splits(name)[0].column_names, label_column)
        hub = _hub_splits(name, label)
        if isinstance(hub[0].features[label], datasets.ClassLabel):
            names = list(hub[0].features[label].names)
        splits = [_rows_examples(name, list(split), text_column, label, client_column) if split is not None else None
                  for split in hub]
    else:
        splits = [_folder_examples(name, f, text_column, label_column, client_column, undecodable) if f is not None
                  else None for f in _folder_splits(name)]
    train, test = splits
    if not train:
        raise ValueError(f"{name} holds no labelled text: expected a subfolder of .txt files per class, or .jsonl "
                         "files with a text and a label field.")
    if test is None:
        train, test = _held_out(name, train)
    classes = _classes(name, train, names)
    # a ClassLabel's examples hold its indices, the others their names (whole numbers as their strings)
    index = {str(i): i for i in range(len(classes))} if names is not None else {c: i for i, c in enumerate(classes)}
    if unknown := sorted({str(label) for _, label, _ in test} - set(index)):
        raise ValueError(f"{name}'s test split has labels its train split lacks: {', '.join(unknown[:5])}.")
    if len(classes) < 2:
        raise ValueError(f"{name} has 1 class ({classes[0]}); a classifier needs at least 2.")
    if not test:
        raise ValueError(f"{name} has no test examples (each class has one example, or its test split is empty): add "
                         "examples, or a test/ folder.")
    as_index = lambda examples: tuple((t, index[str(label)], c) for t, label, c in examples)  # noqa: E731
    return LabelledText(as_index(train), as_index(test), tuple(classes), tuple(undecodable.left_out))


def _labels_column(name: str, columns: Sequence[str], chosen: str) -> str:
    if chosen:
        if chosen not in columns:
            raise ValueError(f"{name} has no column '{chosen}' (label-column); its columns: {', '.join(columns)}.")
        return chosen
    found = [c for c in LABEL_COLUMNS if c in columns]
    if len(found) != 1:
        raise ValueError(f"{name} has {len(found) or 'no'} label columns ({', '.join(found or columns)}): set "
                         "label-column.")
    return found[0]


def _rows_examples(name: str, rows: Sequence[dict], text_column: str, label: str | None,
                   client_column: str) -> list[tuple[str, object, str | None]]:
    """Rows of records, each an example: (its text, its label as stored, its client key or None)."""
    if not rows:
        return []
    if not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{name}: every row must be a JSON object with a text and a label field.")
    columns = list(rows[0])
    label = _labels_column(name, columns, label or "")
    text = _text_column(name, [c for c in columns if c != label], rows[0], text_column, TEXT_COLUMNS, kind="text")
    client = _text_column(name, columns, rows[0], client_column, CLIENT_COLUMNS, kind="client", optional=True)
    examples = []
    for i, row in enumerate(rows):
        if not isinstance(row.get(text), str) or not row[text].strip():
            raise ValueError(f"{name}: row {i + 1} has no text in its '{text}' field.")
        if row.get(label) is None or isinstance(row[label], (bool, float, list, dict)):
            raise ValueError(f"{name}: row {i + 1} has no label in its '{label}' field (a class name or a whole "
                             "number).")
        examples.append((row[text], row[label], str(row.get(client)) if client else None))
    return examples


def _folder_examples(name: str, folder: Path, text_column: str, label_column: str, client_column: str,
                     undecodable: Undecodable) -> list[tuple[str, object, str | None]]:
    """A split's folder: class subfolders of .txt files (each file an example of its folder's class), or JSON-lines
    files of labelled rows."""
    classes = sorted(d for d in folder.iterdir() if d.is_dir() and d.name not in ("train", "test"))
    if classes:
        if label_column or client_column or text_column:
            raise ValueError(f"{name}: class subfolders name the labels (one example a file): text-column, "
                             "label-column and client-column name JSON-lines fields.")
        examples = []
        for directory in classes:
            files = sorted(p for p in directory.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
            if not files:
                raise ValueError(f"{name}: class folder '{directory.name}' holds no .txt files.")
            for path in files:
                if (text := undecodable.text(path, str(path.relative_to(folder)))) is None:
                    continue
                if not text.strip():
                    raise ValueError(f"{name}: '{path.relative_to(folder)}' is empty: every file is an example, and "
                                     "an example needs text.")
                examples.append((text, directory.name, None))
        return examples
    units = _folder_rows(folder, undecodable)
    return [e for relative, rows in units for e in _rows_examples(f"{name}/{relative}", rows, text_column,
                                                                  label_column or None, client_column)]


def _folder_rows(folder: Path, undecodable: Undecodable) -> list[tuple[str, list[dict]]]:
    """Every JSON-lines file's rows under ``folder``, by its path."""
    found = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in JSONL_SUFFIXES):
        relative = str(path.relative_to(folder))
        if rows := undecodable.json_lines(path, relative):
            found.append((relative, rows))
    return found


class Undecodable:
    """What reading a user's text does with a file that is not UTF-8 or a JSON line that is not JSON: refuse, one
    sentence naming it (read with replacement, the model would train on U+FFFD and nobody would know), or with
    ``unreadable`` = "skip" leave it out and name it in ``left_out``."""

    SKIP = 'or set unreadable = "skip" to leave such text out (counted where the run starts)'

    def __init__(self, name: str, unreadable: str = "refuse"):
        self.name, self.skip, self.left_out = name, unreadable == "skip", []

    def text(self, path: Path, relative: str) -> str | None:
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            self._found(relative, f"not UTF-8 (byte {error.object[error.start]:#04x} at offset {error.start})",
                        "convert it (iconv -f <its encoding> -t utf-8) or remove it")
            return None

    def json_lines(self, path: Path, relative: str) -> list:
        """A JSON-lines file's rows (blank lines skipped); ValueError, one sentence, for a file with none."""
        if (text := self.text(path, relative)) is None:
            return []
        rows, skipped = [], False
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    self._found(f"{relative} line {number}", "not JSON", "fix or remove it")
                    skipped = True
        if not rows and not skipped:
            raise ValueError(f"{self.name}: '{relative}' is empty.")
        return rows

    def log(self) -> None:
        """A node's own data has no run start to count it at: its log says what was left out."""
        if self.left_out:
            logging.getLogger("fedlora").warning("%s: %d file(s) or line(s) of text that do not decode left out, the "
                                                 "first %s", self.name, len(self.left_out), self.left_out[0])

    def _found(self, where: str, why: str, fix: str) -> None:
        if not self.skip:
            raise ValueError(f"{self.name}: '{where}' is {why}: {fix}, {self.SKIP}.")
        self.left_out.append(f"{where}: {why}")


def _held_out(name: str, train: list) -> tuple[list, list]:
    """(train, test): a seeded HELD_OUT_FRACTION of each class's examples held out (at least one of a class with
    two or more), so that every class is tested where it can be."""
    if len(train) < 2:
        raise ValueError(f"{name} has 1 example: a test split needs another (add examples, or a test/ folder).")
    rng = np.random.default_rng(HELD_OUT_SEED)
    by_class: dict[str, list[int]] = {}
    for i, (_, label, _) in enumerate(train):
        by_class.setdefault(str(label), []).append(i)
    held = set()
    for rows in by_class.values():
        if len(rows) >= 2:
            held.update(rng.permutation(rows)[:max(1, round(HELD_OUT_FRACTION * len(rows)))].tolist())
    return [e for i, e in enumerate(train) if i not in held], [e for i, e in enumerate(train) if i in held]


def _classes(name: str, train: list, names: list[str] | None) -> list[str]:
    """The class names: a ClassLabel's; else whole-number labels 0..K-1 (each needs examples); else the names found,
    sorted."""
    found = {label for _, label, _ in train}
    if names is not None or all(isinstance(v, int) for v in found):
        count = len(names) if names is not None else max(found) + 1
        if any(not isinstance(v, int) or not 0 <= v < count for v in found):
            raise ValueError(f"{name}'s labels must be whole numbers 0..K-1 or class names, got "
                             f"{sorted(found, key=str)[:3]}.")
        if missing := sorted(set(range(count)) - found):
            raise ValueError(f"{name} has no training examples of class {', '.join(map(str, missing[:5]))}: remove "
                             "the class or add examples.")
        return [str(i) for i in range(count)] if names is None else [str(n) for n in names]
    if any(not isinstance(v, str) for v in found):
        raise ValueError(f"{name}'s labels mix names and numbers ({', '.join(sorted(map(str, found))[:3])}): use one "
                         "kind.")
    return sorted(found)


def partition_examples(kind: str, text: LabelledText, *, num_partitions: int, partition_id: int, seed: int = 0,
                       alpha: float = 0.5) -> list[int]:
    """The train examples of one partition, by fedlora.data's partitioners: "natural" deals the writers (a client
    column's values, each writer's examples together), "iid", "dirichlet" and "pathological" split by label."""
    import datasets

    from fedlora.data import LABEL_COLUMN, load_partition, make_partitioner

    table = {"row": list(range(len(text.train))), LABEL_COLUMN: [label for _, label, _ in text.train]}
    if text.has_clients:
        table[CLIENT_COLUMN] = [client for _, _, client in text.train]
    partitioner = make_partitioner(kind, num_partitions=num_partitions, dataset=datasets.Dataset.from_dict(table),
                                   alpha=alpha, seed=seed)
    return sorted(load_partition(partitioner, partition_id)["row"])


def example_tokens(texts: Sequence[str], labels: Sequence[int], tokenizer: TextTokenizer, seq_len: int,
                   device: torch.device | str | None = None) -> DeviceTokens:
    """Labelled examples as one block each: the text's ids (with a hub tokenizer's special tokens) cut to
    ``seq_len``, padded after its end (``valid`` false there)."""
    ids = np.full((len(texts), seq_len), tokenizer.pad_id, dtype=np.int64)
    valid = np.zeros((len(texts), seq_len), dtype=bool)
    for row, encoded in enumerate(tokenizer.encode(texts, special=True, max_length=seq_len)):
        ids[row, :len(encoded)], valid[row, :len(encoded)] = encoded, True
    return DeviceTokens(torch.from_numpy(ids), torch.from_numpy(valid), device=device,
                        labels=torch.as_tensor(list(labels), dtype=torch.int64))
