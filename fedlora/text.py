"""Text for language models: real corpora offline, the user's own text, tokenizers, and token blocks on the device.

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
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedlora.data import FOLDER_PREFIX, HELD_OUT_FRACTION, HELD_OUT_SEED, HUB_PREFIX, _hub_dataset, _onto_device

BIBLE_KJV = "bible-kjv"
FORTUNES = "fortunes"
TEXT_DATASETS = (BIBLE_KJV,)  # built-in private text corpora (fortunes is public: pretraining only)
BIBLE_HELD_OUT_EVERY = 10  # every tenth chapter is test text
FORTUNES_DIR = Path("/usr/share/games/fortunes")
FORTUNES_SKIPPED = ("ascii-art", "translate-me")  # pictures made of characters, and text that is not English
TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl", ".json")
TEXT_COLUMNS = ("text", "content", "sentence", "document")  # recognized without text-column
CLIENT_COLUMNS = ("user", "user_id", "client", "client_id", "author", "writer", "speaker")  # without client-column
TEXT_PARTITIONERS = ("natural", "iid")
EOS = "<|endoftext|>"


class TextUnavailableError(ValueError):
    """A text corpus cannot be read here (a Debian package not installed, a hub dataset unreachable)."""


@dataclass(frozen=True)
class TextSplits:
    """A text dataset's units, by split: each unit a (name, text) pair."""

    train: tuple[tuple[str, str], ...]
    test: tuple[tuple[str, str], ...]


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
def user_text(name: str, *, text_column: str = "", client_column: str = "") -> TextSplits:
    """The units of "folder:<path>" (.txt files, one unit each; JSON-lines files, one unit per client-column value or
    per line; train/ and test/ subfolders, if there, are the splits) or of "hf:<id>" (a hub dataset's text column,
    one unit per client-column value or per row). Without a test split, a seeded HELD_OUT_FRACTION of the units is
    held out. Raises ValueError, one sentence, on anything that cannot be used."""
    if name.startswith(HUB_PREFIX):
        raw = _hub_dataset(name.removeprefix(HUB_PREFIX))
        train = raw["train"] if "train" in raw else raw[next(iter(raw))] if len(raw) == 1 else None
        if train is None:
            raise ValueError(f"{name} has no train split (its splits: {', '.join(raw)}).")
        test = next((raw[s] for s in ("test", "validation") if s in raw), None)
        splits = [_rows_units(name, list(split), text_column, client_column) if split is not None else None
                  for split in (train, test)]
    else:
        root = Path(name.removeprefix(FOLDER_PREFIX)).expanduser()
        if not root.is_dir():
            raise ValueError(f"{name}: '{root}' is not a directory.")
        folders = [root / "train", root / "test"] if (root / "train").is_dir() else [root, None]
        splits = [_folder_units(name, f, text_column, client_column) if f is not None and f.is_dir() else None
                  for f in folders]
    train, test = splits
    if not train:
        raise ValueError(f"{name} holds no text: expected .txt or .jsonl files.")
    if test is None:
        order = np.random.default_rng(HELD_OUT_SEED).permutation(len(train))
        count = max(1, round(HELD_OUT_FRACTION * len(train)))
        if len(train) < 2:
            raise ValueError(f"{name} has 1 unit of text: a test split needs another (add a file, or a test/ folder).")
        test, train = [train[i] for i in sorted(order[:count])], [train[i] for i in sorted(order[count:])]
    return TextSplits(tuple(train), tuple(test))


def _folder_units(name: str, folder: Path, text_column: str, client_column: str) -> list[tuple[str, str]]:
    units = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = str(path.relative_to(folder))
        if path.suffix.lower() in TEXT_SUFFIXES:
            text = path.read_text(encoding="utf-8", errors="replace")
            if not text.strip():
                raise ValueError(f"{name}: '{relative}' is empty: every file is a unit of text, and a unit needs "
                                 "text.")
            units.append((relative, text))
        elif path.suffix.lower() in JSONL_SUFFIXES:
            rows = []
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    raise ValueError(f"{name}: line {number} of '{relative}' is not JSON.") from None
            if not rows:
                raise ValueError(f"{name}: '{relative}' is empty.")
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


def text_splits(dataset: str, *, text_column: str = "", client_column: str = "") -> TextSplits:
    """The units of a text dataset by name: a built-in corpus, "folder:<path>" or "hf:<id>"."""
    if dataset == BIBLE_KJV:
        return bible_splits()
    if dataset.startswith((FOLDER_PREFIX, HUB_PREFIX)):
        return user_text(dataset, text_column=text_column, client_column=client_column)
    raise ValueError(f"'{dataset}' is not text: a language model reads {', '.join(TEXT_DATASETS)}, folder:<path> "
                     "(.txt or .jsonl files) or hf:<id>.")


def partition_units(kind: str, *, units: int, num_partitions: int, partition_id: int, seed: int = 0) -> list[int]:
    """The units of one partition: "natural" gives client c the units c, c + C, c + 2C, ... (one unit each when
    there are as many clients as units); "iid" shuffles the units (seeded) and deals equal shares."""
    if kind not in TEXT_PARTITIONERS:
        raise ValueError(f"Text is partitioned by its units: partitioner must be one of {', '.join(TEXT_PARTITIONERS)}"
                         f", got '{kind}'.")
    if num_partitions > units:
        raise ValueError(f"The text has {units} units (chapters, files or users) for {num_partitions} clients: set "
                         f"num-clients <= {units}.")
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"Partition id {partition_id} is out of range for {num_partitions} partitions.")
    if kind == "natural":
        return list(range(partition_id, units, num_partitions))
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

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        if hasattr(self.backend, "encode_batch"):
            return [e.ids for e in self.backend.encode_batch(list(texts))]
        return self.backend(list(texts), add_special_tokens=False)["input_ids"]


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

    if not offline_requested() and (reason := unreachable_reason()):
        raise TextUnavailableError(f"The tokenizer '{name}' could not be loaded from the Hugging Face hub ({reason}); "
                                   "offline, use model = \"gpt2-tiny-public\" (its tokenizer is packaged).")
    from transformers import AutoTokenizer

    try:
        return TextTokenizer(name, AutoTokenizer.from_pretrained(name))
    except (OSError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise TextUnavailableError(f"The tokenizer '{name}' could not be loaded ({first}); offline, use model = "
                                   "\"gpt2-tiny-public\" (its tokenizer is packaged).") from None


# -- token blocks on the device -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def tokenized_units(dataset: str, split: str, tokenizer: str, text_column: str = "",
                    client_column: str = "") -> tuple[np.ndarray, ...]:
    """Each unit of a split as token ids, once per process."""
    splits = text_splits(dataset, text_column=text_column, client_column=client_column)
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
    bool (B, L)} there (``valid``: a real token, not padding)."""

    def __init__(self, ids: torch.Tensor, valid: torch.Tensor, device: torch.device | str | None = None):
        self.device = torch.device(device or "cpu")
        self.ids, self.valid = ids.to(self.device), valid.to(self.device)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def tokens(self) -> int:
        return int(self.valid.sum())

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + self.valid.nbytes

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
        rows = _onto_device(torch.cat([d.rows for d in draws]), first.device).split([len(d.rows) for d in draws])
        return {"input_ids": torch.cat([d.tokens.ids[r] for d, r in zip(draws, rows)]),
                "valid": torch.cat([d.tokens.valid[r] for d, r in zip(draws, rows)])}


def to_device_tokens(units: Sequence[np.ndarray], seq_len: int, eos_id: int,
                     device: torch.device | str | None = None) -> DeviceTokens:
    return DeviceTokens(*token_blocks(units, seq_len, eos_id), device=device)


def text_dir_units(path: str | os.PathLike[str]) -> list[tuple[str, str]]:
    """A device's own text (data-dir): its .txt and .jsonl files, every file's text one unit."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ValueError(f"data-dir '{root}' is not a directory.")
    units = _folder_units(f"data-dir {root}", root, "", "")
    if not units:
        raise ValueError(f"data-dir '{root}' holds no text (.txt or .jsonl files).")
    return units
