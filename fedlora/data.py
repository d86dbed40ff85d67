"""CIFAR-100 from the Hugging Face hub, Fashion-MNIST (offline from Debian's package, or the hub), the user's own
images (any hub dataset by id, or a folder with one subfolder per class), synthetic CIFAR-like data, all in one
schema; partitioners, transforms.

Every dataset here has CIFAR-100's hub schema (``uoft-cs/cifar100``): an ``img`` column of RGB images
(32x32 for CIFAR; Fashion-MNIST's 28 x 28 grayscale as three equal channels, resized by the transforms
like any image), a ``fine_label`` ClassLabel and a ``coarse_label``. Code downstream therefore cannot
tell one dataset from another, and tests and offline runs use the synthetic one.

Clients get their data from flwr-datasets partitioners over an in-memory ``datasets.Dataset``
(``make_partitioner``, then ``load_partition``), and feed a model through ``to_torch``: decoded once onto the
device, transformed there a batch at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import logging
import math
import os
import pickle
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import datasets
import numpy as np
import PIL.Image
import torch

from fedlora.hub import offline_requested, unreachable_reason

if TYPE_CHECKING:  # imported where used: flwr-datasets (seaborn, scipy) and torchvision take 2.6 s to import, and
    # the CLI and the launchers import this module (through fedlora.config) for its names only
    from flwr_datasets.partitioner import Partitioner
    from torchvision.transforms import v2

CIFAR100_HUB_ID = "uoft-cs/cifar100"
IMAGE_COLUMN = "img"
LABEL_COLUMN = "fine_label"
COARSE_LABEL_COLUMN = "coarse_label"
IMAGE_SIZE = 32

# Class names exactly as on the hub, including its "cra" (sic, for crab) at index 26.
FINE_LABEL_NAMES = (
    "apple", "aquarium_fish", "baby", "bear", "beaver", "bed", "bee", "beetle", "bicycle", "bottle",
    "bowl", "boy", "bridge", "bus", "butterfly", "camel", "can", "castle", "caterpillar", "cattle",
    "chair", "chimpanzee", "clock", "cloud", "cockroach", "couch", "cra", "crocodile", "cup",
    "dinosaur", "dolphin", "elephant", "flatfish", "forest", "fox", "girl", "hamster", "house",
    "kangaroo", "keyboard", "lamp", "lawn_mower", "leopard", "lion", "lizard", "lobster", "man",
    "maple_tree", "motorcycle", "mountain", "mouse", "mushroom", "oak_tree", "orange", "orchid",
    "otter", "palm_tree", "pear", "pickup_truck", "pine_tree", "plain", "plate", "poppy",
    "porcupine", "possum", "rabbit", "raccoon", "ray", "road", "rocket", "rose", "sea", "seal",
    "shark", "shrew", "skunk", "skyscraper", "snail", "snake", "spider", "squirrel", "streetcar",
    "sunflower", "sweet_pepper", "table", "tank", "telephone", "television", "tiger", "tractor",
    "train", "trout", "tulip", "turtle", "wardrobe", "whale", "willow_tree", "wolf", "woman",
    "worm",
)
COARSE_LABEL_NAMES = (
    "aquatic_mammals", "fish", "flowers", "food_containers", "fruit_and_vegetables",
    "household_electrical_devices", "household_furniture", "insects", "large_carnivores",
    "large_man-made_outdoor_things", "large_natural_outdoor_scenes",
    "large_omnivores_and_herbivores", "medium_mammals", "non-insect_invertebrates", "people",
    "reptiles", "small_mammals", "trees", "vehicles_1", "vehicles_2",
)
CIFAR100_FEATURES = datasets.Features({
    IMAGE_COLUMN: datasets.Image(),
    LABEL_COLUMN: datasets.ClassLabel(names=list(FINE_LABEL_NAMES)),
    COARSE_LABEL_COLUMN: datasets.ClassLabel(names=list(COARSE_LABEL_NAMES)),
})

# Per-channel statistics of the CIFAR-100 train split, for models trained on 32 px images, and the
# normalization google/vit-base-patch16-224 was pretrained with, for images upsampled to its size.
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
VIT_MEAN = (0.5, 0.5, 0.5)
VIT_STD = (0.5, 0.5, 0.5)

SYNTHETIC_SPLITS = ("train", "test")
SYNTHETIC_CLASSES = 10  # num-classes = 0 (the data's) on synthetic data
PARTITIONER_KINDS = ("iid", "dirichlet", "pathological", "natural")  # natural: by a client column's values
CLIENT_COLUMN = "client"  # the writer (user, device) of each row, where a dataset has one: the natural partition's
CLIENT_COLUMNS = ("user", "user_id", "client", "client_id", "author", "writer", "writer_id", "speaker")  # without
# client-column

# flwr-datasets redraws the whole Dirichlet split while any partition is smaller than this and raises
# a ValueError after 11 draws, so it always terminates. 1 keeps every client non-empty; the default
# (10) makes small datasets retry, warn and often fail.
DIRICHLET_MIN_PARTITION_SIZE = 1

# Synthetic images: a class prototype (a base colour plus a few low-frequency waves per channel),
# shifted by up to image_size // 8 pixels, maybe mirrored, tinted and noised per example. These
# values keep a nearest-class-mean classifier on raw pixels at about 88% for 10 classes and 77% for
# 100: learnable, yet not solved by the colour alone.
_WAVES_PER_CHANNEL = 3
_MAX_WAVE_FREQUENCY = 2  # cycles per image, whole so that shifted prototypes wrap around seamlessly
_TINT_STD = 24.0
_PIXEL_NOISE_STD = 32.0
_PUBLIC_STREAM = 0x9B11C  # spawn key of the public data's seed sequence (a run's has none)
_CHUNK = 1024  # examples generated at a time, to bound float memory at large image sizes


class DatasetUnavailableError(ValueError):
    """A dataset can be neither downloaded nor found in the local cache."""


def load_cifar100(split: str, *, cache_dir: str | os.PathLike[str] | None = None) -> datasets.Dataset:
    """One split of CIFAR-100 ("train" or "test") from the Hugging Face hub or the local HF cache.

    Raises DatasetUnavailableError within a few seconds when the hub is unreachable or offline mode
    is on and no cached copy exists.
    """
    offline_reason = _hub_offline_reason()
    try:
        with _datasets_offline() if offline_reason else contextlib.nullcontext():
            return datasets.load_dataset(CIFAR100_HUB_ID, split=split, cache_dir=cache_dir)
    except OSError as err:  # ConnectionError, and DatasetNotFoundError (a FileNotFoundError)
        reason = f"{offline_reason} and no cached copy was found" if offline_reason else _first_line(err)
        raise DatasetUnavailableError(
            f"CIFAR-100 could not be loaded from the Hugging Face hub ({CIFAR100_HUB_ID}): {reason}; "
            'offline, use the synthetic dataset (dataset = "synthetic").'
        ) from err


FASHION_MNIST_HUB_ID = "zalando-datasets/fashion_mnist"
FASHION_MNIST_DIR_ENV = "FEDLORA_FASHION_MNIST_DIR"  # where the IDX files are, if not Debian's folder
FASHION_MNIST_DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")  # `apt-get install dataset-fashion-mnist`
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                         "Ankle boot")
_FASHION_MNIST_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
                        "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
# The last 10,000 of the 60,000 training images are public: `fedlora pretrain` may see them, no federation does.
FASHION_MNIST_PUBLIC = 10_000
FASHION_MNIST_SPLITS = ("train", "public", "test")


def fashion_mnist_dir() -> Path:
    return Path(os.environ.get(FASHION_MNIST_DIR_ENV) or FASHION_MNIST_DEBIAN_DIR)


def fashion_mnist_offline() -> bool:
    """Whether the original IDX files (gzipped, as Debian ships them, or not) are in ``fashion_mnist_dir()``."""
    folder = fashion_mnist_dir()
    return all((folder / name).is_file() or (folder / f"{name}.gz").is_file()
               for names in _FASHION_MNIST_FILES.values() for name in names)


def fashion_mnist_unavailable_reason() -> str | None:
    """None when Fashion-MNIST can be read (its files here, or the hub reachable), else one sentence naming both
    ways to get it."""
    if fashion_mnist_offline():
        return None
    hub = _hub_offline_reason()
    if hub is None:
        return None
    return (f"Fashion-MNIST is not in {fashion_mnist_dir()} and the Hugging Face hub cannot be used ({hub}): install "
            "it with `apt-get install dataset-fashion-mnist` (Debian; or put its four IDX files in a folder named "
            f"by {FASHION_MNIST_DIR_ENV}), or go online for the hub's {FASHION_MNIST_HUB_ID}.")


def load_fashion_mnist(split: str, *, cache_dir: str | os.PathLike[str] | None = None) -> datasets.Dataset:
    """One split of Fashion-MNIST in CIFAR-100's schema: "train" (the first 50,000 of the original training images:
    the federations' data), "public" (the last 10,000: public data for pretraining, held out of every federation)
    or "test" (10,000). Read by torchvision's FashionMNIST from the original IDX files (Debian's package, or
    ``FEDLORA_FASHION_MNIST_DIR``), else from the Hugging Face hub (``zalando-datasets/fashion_mnist``: columns
    image and label). Raises DatasetUnavailableError, naming both ways to get it, when neither is there."""
    if split not in FASHION_MNIST_SPLITS:
        raise ValueError(f"Unknown split {split!r}; expected one of {', '.join(FASHION_MNIST_SPLITS)}.")
    source_split = "test" if split == "test" else "train"
    if fashion_mnist_offline():
        images, labels = _torchvision_fashion_mnist(source_split, cache_dir)
    else:
        if (reason := fashion_mnist_unavailable_reason()) is not None:
            raise DatasetUnavailableError(reason)
        try:
            hub = datasets.load_dataset(FASHION_MNIST_HUB_ID, split=source_split, cache_dir=cache_dir)
        except OSError as err:
            raise DatasetUnavailableError(f"Fashion-MNIST could not be loaded from the hub ({_first_line(err)}); "
                                          "offline, `apt-get install dataset-fashion-mnist`.") from err
        images = np.stack([np.asarray(image.convert("L"), dtype=np.uint8) for image in hub["image"]])
        labels = np.asarray(hub["label"], dtype=np.int64)
    if split != "test":  # the hub keeps the original order, as do the IDX files
        private = len(images) - FASHION_MNIST_PUBLIC
        images, labels = (images[:private], labels[:private]) if split == "train" else (images[private:],
                                                                                         labels[private:])
    features = datasets.Features({**CIFAR100_FEATURES,
                                  LABEL_COLUMN: datasets.ClassLabel(names=list(FASHION_MNIST_CLASSES)),
                                  COARSE_LABEL_COLUMN: datasets.ClassLabel(names=list(FASHION_MNIST_CLASSES))})
    rgb = np.repeat(images[..., None], 3, axis=-1)  # grayscale into the three channels every model here takes
    # BMP, as the synthetic data (make_synthetic_cifar): every process of a run reads its split
    return datasets.Dataset.from_dict({IMAGE_COLUMN: [{"bytes": _bmp(image), "path": None} for image in rgb],
                                       LABEL_COLUMN: labels, COARSE_LABEL_COLUMN: labels}, features=features)


def _torchvision_fashion_mnist(split: str, cache_dir: str | os.PathLike[str] | None) -> tuple[np.ndarray, np.ndarray]:
    """torchvision's reader over the IDX files: it wants them unpacked in ROOT/FashionMNIST/raw, so they are
    unpacked once into a cache folder (the gzipped originals stay where the package put them)."""
    import gzip
    import shutil
    import tempfile

    from torchvision.datasets import FashionMNIST

    root = Path(cache_dir or Path.home() / ".cache" / "fedlora") / "fashion-mnist"
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    source = fashion_mnist_dir()
    for name in (n for names in _FASHION_MNIST_FILES.values() for n in names):  # torchvision checks all four
        target = raw / name
        if target.is_file():
            continue
        # Another process (a run's other workers, on a fresh machine) may be unpacking the same file: each writes
        # its own partial file and renames it into place, atomically (the same bytes, whoever is last).
        with tempfile.NamedTemporaryFile(dir=raw, prefix=f"{name}.", suffix=".partial", delete=False) as out:
            partial = Path(out.name)
            try:
                if (source / name).is_file():
                    with (source / name).open("rb") as unpacked:
                        shutil.copyfileobj(unpacked, out)
                else:
                    with gzip.open(source / f"{name}.gz", "rb") as packed:
                        shutil.copyfileobj(packed, out)
            except BaseException:
                partial.unlink()
                raise
        partial.replace(target)
    data = FashionMNIST(str(root), train=split == "train", download=False)
    return data.data.numpy().astype(np.uint8), data.targets.numpy().astype(np.int64)


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")

HUB_PREFIX, FOLDER_PREFIX = "hf:", "folder:"  # dataset = "hf:<id>" or "folder:<path>": the user's own data
HELD_OUT_FRACTION = 0.1  # of the train split, held out as the test split when the data has none
HELD_OUT_SEED = 0  # the same held-out images whatever the run's seed, so that seeds compare on one test set
_LABEL_NAMES = ("label", "labels", "fine_label")  # integer label columns recognized without a ClassLabel


def is_user_dataset(name: str) -> bool:
    return name.startswith((HUB_PREFIX, FOLDER_PREFIX))


def load_user_dataset(name: str, *, image_column: str = "", label_column: str = "", client_column: str = "",
                      unreadable: str = "refuse") -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, test) of ``_user_dataset``."""
    return _user_dataset(name, image_column, label_column, client_column, unreadable)[:2]


def unreadable_left_out(name: str, *, image_column: str = "", label_column: str = "", client_column: str = "",
                        unreadable: str = "refuse") -> tuple[str, ...]:
    """The images of a user's dataset left out because they do not decode (unreadable = "skip"): each file (or
    split and row), why, in one line apiece."""
    return _user_dataset(name, image_column, label_column, client_column, unreadable)[2]


@functools.lru_cache(maxsize=4)
def _user_dataset(name: str, image_column: str, label_column: str, client_column: str,
                  unreadable: str) -> tuple[datasets.Dataset, datasets.Dataset, tuple[str, ...]]:
    """(train, test) of the user's own image-classification data, in CIFAR-100's schema: a Hugging Face dataset
    ("hf:<id>", read by ``datasets.load_dataset``) or a folder with one subfolder of images per class
    ("folder:<path>", read by the ``imagefolder`` builder; ``train/`` and ``test/`` subfolders, if there, are the
    splits). The image column is the one Image feature, the label column the one ClassLabel (else an integer
    column named label, labels or fine_label), unless named. A client column (client-column, else one of
    CLIENT_COLUMNS), where there is one, is kept in train as ``client``: the natural partition's. Without a test (or
    validation) split, a stratified ``HELD_OUT_FRACTION`` of train is held out. Every image is opened first: one that
    does not decode is refused (``unreadable`` = "refuse", naming it) or left out ("skip", the third element says
    which). Raises ValueError, one sentence, on anything that cannot be used."""
    with _quiet_datasets():
        if name.startswith(HUB_PREFIX):
            raw = _hub_dataset(name.removeprefix(HUB_PREFIX))
        else:
            raw = _folder_dataset(Path(name.removeprefix(FOLDER_PREFIX)).expanduser())
        return _common_splits(name, raw, image_column, label_column, client_column, unreadable)


def _common_splits(name: str, raw: datasets.DatasetDict, image_column: str, label_column: str,
                   client_column: str = "", unreadable: str = "refuse") -> tuple[datasets.Dataset, datasets.Dataset,
                                                                               tuple[str, ...]]:
    train = raw["train"] if "train" in raw else raw[next(iter(raw))] if len(raw) == 1 else None
    if train is None:
        raise ValueError(f"{name} has no train split (its splits: {', '.join(raw)}).")
    image, label = _image_column(name, train, image_column), _label_column(name, train, label_column)
    held_out = next((raw[s] for s in ("test", "validation") if s in raw), None)
    left_out = []
    for split_name, split in (("train", train), ("test", held_out)):
        if split is not None and image in split.column_names:
            kept, dropped = _readable_images(name, split_name, split, image, unreadable)
            train, held_out = (kept, held_out) if split_name == "train" else (train, kept)
            left_out += dropped
    found = [c for c in CLIENT_COLUMNS if c in train.column_names and c not in (image, label)]
    client = _column(name, train, client_column, found, kind="client") if client_column or len(found) == 1 else None
    if isinstance(train.features[label], datasets.ClassLabel):
        names = list(train.features[label].names)
    else:
        values = set(train.unique(label))
        if not all(isinstance(v, int) and v >= 0 for v in values):
            raise ValueError(f"{name}'s label column '{label}' holds {sorted(values, key=str)[:3]}...: labels must "
                             "be a ClassLabel or integers 0..K-1.")
        names = [str(i) for i in range(max(values) + 1)]
    if len(names) < 2:
        raise ValueError(f"{name} has {len(names)} class; a classifier needs at least 2.")
    counts = np.bincount(np.asarray(train[label], dtype=np.int64), minlength=len(names))
    if (empty := [names[i] for i in np.flatnonzero(counts == 0)]):
        raise ValueError(f"{name} has no training images of class {', '.join(map(repr, empty[:5]))}"
                         f"{' and others' if len(empty) > 5 else ''}: remove the class or add images.")
    features = datasets.Features({IMAGE_COLUMN: datasets.Image(mode="RGB"),  # grayscale and RGBA become RGB
                                  LABEL_COLUMN: datasets.ClassLabel(names=names),
                                  COARSE_LABEL_COLUMN: datasets.ClassLabel(names=names)})

    def common_schema(split: datasets.Dataset, writers: str | None = None) -> datasets.Dataset:
        if image not in split.column_names or label not in split.column_names:
            raise ValueError(f"{name}'s test split lacks the columns '{image}' and '{label}' of its train split.")
        split = split.select_columns([image, label]).rename_columns({image: IMAGE_COLUMN, label: LABEL_COLUMN})
        split = split.cast_column(IMAGE_COLUMN, datasets.Image(mode="RGB"))
        split = split.cast_column(LABEL_COLUMN, features[LABEL_COLUMN])
        split = split.add_column(COARSE_LABEL_COLUMN, split[LABEL_COLUMN]).cast(features)
        return split.add_column(CLIENT_COLUMN, [str(v) for v in writers]) if writers is not None else split

    train = common_schema(train, train[client] if client else None)
    if held_out is None:
        stratified = counts.min() >= 2 and math.ceil(HELD_OUT_FRACTION * len(train)) >= len(names)
        parts = train.train_test_split(test_size=HELD_OUT_FRACTION, seed=HELD_OUT_SEED,
                                       stratify_by_column=LABEL_COLUMN if stratified else None)
        return parts["train"], parts["test"], tuple(left_out)
    return train, common_schema(held_out), tuple(left_out)


def _readable_images(name: str, split_name: str, split: datasets.Dataset, column: str,
                     unreadable: str) -> tuple[datasets.Dataset, list[str]]:
    """``split`` without the rows whose image does not open as one (a text file named .png, a truncated file):
    refused in one line naming the first, or with ``unreadable`` = "skip" left out and named."""
    root = Path(name.removeprefix(FOLDER_PREFIX)).expanduser() if name.startswith(FOLDER_PREFIX) else None
    bad: list[tuple[int, str]] = []
    rows = split.cast_column(column, datasets.Image(decode=False)).select_columns([column])
    for start in range(0, len(rows), 1000):
        for offset, value in enumerate(rows[start:start + 1000][column]):
            where = value.get("path") or ""
            where = os.path.relpath(where, root) if root is not None and where else where or \
                f"{split_name} row {start + offset}"
            if why := _decode_error(io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"]):
                bad.append((start + offset, f"{where} ({why})"))
    if not bad:
        return split, []
    if unreadable != "skip":
        many = f"{len(bad)} images in its {split_name} split that do not decode, the first" if len(bad) > 1 else \
            f"an image in its {split_name} split that does not decode:"
        raise ValueError(f"{name} has {many} {bad[0][1]}: remove or replace "
                         f"{'them' if len(bad) > 1 else 'it'}, or set unreadable = \"skip\" to leave such images out "
                         "(counted where the run starts).")
    dropped = {i for i, _ in bad}
    return split.select([i for i in range(len(split)) if i not in dropped]), [why for _, why in bad]


def _hub_dataset(hub_id: str) -> datasets.DatasetDict:
    offline_reason = _hub_offline_reason()
    try:
        with _datasets_offline() if offline_reason else contextlib.nullcontext():
            raw = datasets.load_dataset(hub_id)
    except (OSError, ValueError) as err:  # unreachable, unknown id (DatasetNotFoundError), a config to choose
        reason = f"{offline_reason} and no cached copy was found" if offline_reason else _first_line(err)
        raise DatasetUnavailableError(f"hf:{hub_id} could not be loaded from the Hugging Face hub: {reason}; a "
                                      "local copy works as dataset = \"folder:<path>\" (one subfolder per class).") \
            from err
    return raw


def _folder_dataset(root: Path) -> datasets.DatasetDict:
    """The imagefolder builder over ``root``, once every class folder is checked to hold images (the builder
    would silently drop an empty class, and with it a label)."""
    if not root.is_dir():
        raise ValueError(f"folder:{root} is not a directory.")
    splits = [d for d in (root / "train", root / "test") if d.is_dir()]
    for split in splits or [root]:
        classes = sorted(d for d in split.iterdir() if d.is_dir())
        if not classes:
            raise ValueError(f"folder:{split} has no class subfolders: put each class's images in a subfolder named "
                             "after the class.")
        if len(classes) < 2:
            raise ValueError(f"folder:{split} has 1 class subfolder; a classifier needs at least 2.")
        for folder in classes:
            if not any(f.suffix.lower() in IMAGE_SUFFIXES for f in folder.rglob("*") if f.is_file()):
                raise ValueError(f"Class folder '{folder}' holds no images ({', '.join(IMAGE_SUFFIXES)}).")
    return datasets.load_dataset("imagefolder", data_dir=str(root))


def _image_column(name: str, train: datasets.Dataset, chosen: str) -> str:
    images = [c for c, f in train.features.items() if isinstance(f, datasets.Image)]
    return _column(name, train, chosen, images, kind="image")


def _label_column(name: str, train: datasets.Dataset, chosen: str) -> str:
    labels = [c for c, f in train.features.items() if isinstance(f, datasets.ClassLabel)]
    if len(labels) > 1:
        labels = [c for c in labels if c in _LABEL_NAMES] or labels
    if not labels:
        labels = [c for c in _LABEL_NAMES if c in train.column_names]
    return _column(name, train, chosen, labels, kind="label")


def _column(name: str, train: datasets.Dataset, chosen: str, candidates: list[str], *, kind: str) -> str:
    """The column the config names (``<kind>-column``), checked; else the one candidate found; else one line."""
    columns = ", ".join(train.column_names)
    if chosen:
        if chosen not in train.column_names:
            raise ValueError(f"{name} has no column '{chosen}' ({kind}-column); its columns: {columns}.")
        return chosen
    if len(candidates) != 1:
        found = ", ".join(candidates) or f"columns: {columns}"
        raise ValueError(f"{name} has {len(candidates) or 'no'} {kind} columns ({found}): set {kind}-column.")
    return candidates[0]


def dataset_classes(dataset: str, *, image_column: str = "", label_column: str = "", client_column: str = "",
                    unreadable: str = "refuse") -> int:
    """How many classes a dataset has: fixed for the built-in ones, read off the data for the user's own."""
    if is_user_dataset(dataset):
        train, _ = load_user_dataset(dataset, image_column=image_column, label_column=label_column,
                                     client_column=client_column, unreadable=unreadable)
        return train.features[LABEL_COLUMN].num_classes
    return {"cifar100": len(FINE_LABEL_NAMES), "fashion-mnist": len(FASHION_MNIST_CLASSES)}.get(dataset,
                                                                                                SYNTHETIC_CLASSES)


def load_image_dir(data_dir: str | os.PathLike[str], *, num_classes: int,
                   unreadable: str = "refuse") -> datasets.Dataset:
    """A device's own images, in CIFAR-100's schema: CIFAR-100's python format or an ImageFolder layout.

    CIFAR-100's python format is a directory holding the pickled ``train`` file of
    ``cifar-100-python.tar.gz``. An ImageFolder has one sub-directory per class; a class is named by its
    CIFAR-100 name (with 100 classes) or by its label index, so that every device maps a class to the same
    label whichever classes it happens to hold. An image that does not decode is refused in one line naming it, or
    with ``unreadable`` = "skip" left out (the node's log counts them).
    """
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise ValueError(f"data-dir '{root}' is not a directory.")
    if (root / "train").is_file():
        images, labels = _cifar_python_train(root / "train")
    else:
        images, labels = _image_folder(root, num_classes)
        bad = [i for i, path in enumerate(images) if _decode_error(path)]
        if bad and unreadable != "skip":
            raise ValueError(f"data-dir '{root}' has {len(bad)} {'images that do' if len(bad) > 1 else 'image that does'} not decode, "
                             f"the first {os.path.relpath(images[bad[0]], root)}: remove or replace "
                             f"{'them' if len(bad) > 1 else 'it'}, or set unreadable = \"skip\" to leave such "
                             "images out.")
        if bad:
            logging.getLogger("fedlora").warning("data-dir '%s': %d images that do not decode left out, the first %s",
                                                 root, len(bad), os.path.relpath(images[bad[0]], root))
            dropped = set(bad)
            images, labels = ([x for i, x in enumerate(xs) if i not in dropped] for xs in (images, labels))
    if not len(labels):
        raise ValueError(f"data-dir '{root}' holds no images (expected CIFAR-100's python 'train' file or one "
                         f"folder of {', '.join(IMAGE_SUFFIXES)} images per class).")
    if max(labels) >= num_classes:
        raise ValueError(f"data-dir '{root}' has label {max(labels)}, but the run has {num_classes} classes.")
    fine = (datasets.ClassLabel(names=list(FINE_LABEL_NAMES)) if num_classes == len(FINE_LABEL_NAMES)
            else datasets.ClassLabel(num_classes=num_classes))
    features = datasets.Features({**CIFAR100_FEATURES, LABEL_COLUMN: fine})
    labels = np.asarray(labels)
    return datasets.Dataset.from_dict({IMAGE_COLUMN: images, LABEL_COLUMN: labels,
                                       COARSE_LABEL_COLUMN: labels % len(COARSE_LABEL_NAMES)}, features=features)


def _decode_error(source) -> str | None:
    """Why an image (a path or a file object) does not open as one, in one line; None if it does. Verified, not
    decoded: cheap enough for every process that reads the data."""
    try:
        with PIL.Image.open(source) as opened:
            opened.verify()
        return None
    except Exception as error:  # PIL's many kinds: UnidentifiedImageError, OSError, SyntaxError, ...
        return f"{type(error).__name__}: {_first_line(error)}"


def _cifar_python_train(path: Path) -> tuple[list, list[int]]:
    with path.open("rb") as f:
        try:
            batch = pickle.load(f, encoding="bytes")
        except Exception as err:  # a corrupt or foreign file: pickle raises many kinds
            raise ValueError(f"'{path}' is not CIFAR-100's pickled train file ({type(err).__name__}).") from None
    if not isinstance(batch, dict) or b"data" not in batch or b"fine_labels" not in batch:
        raise ValueError(f"'{path}' is not CIFAR-100's pickled train file (no b'data' / b'fine_labels').")
    data = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, IMAGE_SIZE, IMAGE_SIZE).transpose(0, 2, 3, 1)
    return list(data), [int(y) for y in batch[b"fine_labels"]]


def _image_folder(root: Path, num_classes: int) -> tuple[list, list[int]]:
    paths, labels = [], []
    for folder in sorted(d for d in root.iterdir() if d.is_dir()):
        if num_classes == len(FINE_LABEL_NAMES) and folder.name in FINE_LABEL_NAMES:
            label = FINE_LABEL_NAMES.index(folder.name)
        elif folder.name.isdigit() and int(folder.name) < num_classes:
            label = int(folder.name)
        else:
            raise ValueError(f"Class folder '{folder.name}' in '{root}' is neither a label index 0..{num_classes - 1}"
                             + (" nor a CIFAR-100 class name." if num_classes == len(FINE_LABEL_NAMES) else "."))
        files = sorted(f for f in folder.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
        paths += [str(f) for f in files]
        labels += [label] * len(files)
    return paths, labels


def _hub_offline_reason() -> str | None:
    """Why the hub cannot be used now, or None when it may be."""
    if offline_requested() or datasets.config.HF_HUB_OFFLINE:
        return "offline mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)"
    return unreachable_reason()


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """No progress bars from datasets while it reads and casts a user's dataset (the run prints its own)."""
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


@contextlib.contextmanager
def _datasets_offline() -> Iterator[None]:
    """Offline mode for datasets during one call, so that it goes straight to the local cache."""
    # datasets has no per-call switch, but reads this attribute on every hub access (so: not thread-safe).
    previous = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = previous


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0].rstrip(".") if lines else type(err).__name__


def make_synthetic_cifar(num_examples: int, *, num_classes: int = 100, image_size: int = IMAGE_SIZE,
                         seed: int = 0, split: str = "train", public: bool = False) -> datasets.Dataset:
    """A deterministic CIFAR-like dataset in CIFAR-100's schema, with labels balanced across classes.

    Each class has a fixed smooth colour pattern; an example is its class's pattern, randomly shifted,
    mirrored, tinted and noised. The patterns depend on (seed, num_classes, image_size) only, and the
    examples of each split on a stream of their own, so a model fit on "train" generalizes to "test".
    With 100 classes the features equal CIFAR100_FEATURES; the coarse label is fine_label % 20.
    ``public`` draws from a seed stream no federation uses (its classes are disjoint from every run's): the
    public data the offline backbone is pretrained on.
    """
    if split not in SYNTHETIC_SPLITS:
        raise ValueError(f"Unknown split {split!r}; expected one of {', '.join(SYNTHETIC_SPLITS)}.")
    for name, value in (("Number of examples", num_examples), ("Number of classes", num_classes),
                        ("Image size", image_size)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}.")
    stream = np.random.SeedSequence(seed, spawn_key=(_PUBLIC_STREAM,) if public else ())
    pattern_seed, *split_seeds = stream.spawn(1 + len(SYNTHETIC_SPLITS))
    prototypes = _prototypes(num_classes, image_size, np.random.default_rng(pattern_seed))
    rng = np.random.default_rng(split_seeds[SYNTHETIC_SPLITS.index(split)])

    # Round-robin labels, shuffled: class sizes differ by at most one.
    labels = rng.permutation(np.arange(num_examples) % num_classes)
    images = np.empty((num_examples, image_size, image_size, 3), dtype=np.uint8)
    for start in range(0, num_examples, _CHUNK):
        images[start:start + _CHUNK] = _jittered(prototypes, labels[start:start + _CHUNK], rng)

    fine = (datasets.ClassLabel(names=list(FINE_LABEL_NAMES)) if num_classes == len(FINE_LABEL_NAMES)
            else datasets.ClassLabel(num_classes=num_classes))
    features = datasets.Features({**CIFAR100_FEATURES, LABEL_COLUMN: fine})
    # Encoded as BMP, lossless like the hub's PNG and 7x faster to write (datasets' PNG took 3.5 of 4.8 s for 20,000;
    # Fashion-MNIST's 50,000 training images: 5.9 -> 2.0 s): every Ray worker of a run generates its training data
    return datasets.Dataset.from_dict(
        {IMAGE_COLUMN: [{"bytes": _bmp(image), "path": None} for image in images], LABEL_COLUMN: labels,
         COARSE_LABEL_COLUMN: labels % len(COARSE_LABEL_NAMES)},
        features=features,
    )


def _bmp(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    PIL.Image.fromarray(image).save(buffer, format="BMP")
    return buffer.getvalue()


def _prototypes(num_classes: int, image_size: int, rng: np.random.Generator) -> np.ndarray:
    """float32 (num_classes, image_size, image_size, 3): a base colour plus a few 2-D waves per channel."""
    shape = (num_classes, _WAVES_PER_CHANNEL, 1, 1, 3)  # axes: class, wave, y, x, channel
    base = rng.uniform(64, 192, size=(num_classes, 1, 1, 3))
    freq_y, freq_x = rng.integers(-_MAX_WAVE_FREQUENCY, _MAX_WAVE_FREQUENCY + 1, size=(2, *shape))
    amplitude = rng.uniform(24, 48, size=shape)
    phase = rng.uniform(0, 2 * np.pi, size=shape)
    grid = np.arange(image_size) / image_size
    angle = 2 * np.pi * (freq_y * grid[:, None, None] + freq_x * grid[None, :, None]) + phase
    return (base + (amplitude * np.sin(angle)).sum(axis=1)).astype(np.float32)


def _jittered(prototypes: np.ndarray, labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """uint8 images: each label's prototype shifted (wrapping around), maybe mirrored, tinted, noised."""
    n, size = len(labels), prototypes.shape[1]
    max_shift = size // 8
    shift_y, shift_x = rng.integers(-max_shift, max_shift + 1, size=(2, n, 1))
    mirrored = rng.random((n, 1)) < 0.5
    pixels = np.arange(size)
    rows = (pixels + shift_y) % size
    cols = (np.where(mirrored, pixels[::-1], pixels) + shift_x) % size
    images = prototypes[labels[:, None, None], rows[:, :, None], cols[:, None, :]]
    images += rng.normal(0, _TINT_STD, size=(n, 1, 1, 3)).astype(np.float32)
    images += rng.standard_normal(images.shape, dtype=np.float32) * _PIXEL_NOISE_STD
    return np.clip(np.rint(images), 0, 255).astype(np.uint8)


def make_partitioner(kind: str, *, num_partitions: int, dataset: datasets.Dataset, alpha: float = 0.5,
                     classes_per_partition: int = 2, seed: int = 0,
                     label_column: str = LABEL_COLUMN) -> Partitioner:
    """A flwr-datasets partitioner over ``dataset``, ready for ``load_partition``.

    kind: "iid" (equal random shares), "dirichlet" (each label spread over partitions by a
    Dirichlet(alpha) draw: small alpha, strong skew) or "pathological" (each partition holds
    ``classes_per_partition`` labels; with fewer partitions than labels, rows of labels that no
    partition drew are left out). The same arguments always give the same partitions.
    """
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, PathologicalPartitioner

    if kind not in PARTITIONER_KINDS:
        raise ValueError(f"Unknown partitioner {kind!r}; expected one of {', '.join(PARTITIONER_KINDS)}.")
    if num_partitions < 1:
        raise ValueError(f"Number of partitions must be at least 1, got {num_partitions}.")
    if kind == "natural":
        return NaturalPartitioner(dataset, num_partitions)
    if num_partitions > len(dataset):
        raise ValueError(f"Cannot split {len(dataset)} examples into {num_partitions} partitions.")
    if kind != "iid" and label_column not in dataset.column_names:
        raise ValueError(f"Dataset has no column {label_column!r}; its columns are {dataset.column_names}.")
    if kind == "dirichlet" and not alpha > 0:
        raise ValueError(f"Dirichlet alpha must be positive, got {alpha}.")
    if kind == "pathological":
        num_classes = len(dataset.unique(label_column))
        if not 1 <= classes_per_partition <= num_classes:
            raise ValueError(f"Classes per partition must be between 1 and the dataset's {num_classes} "
                             f"classes, got {classes_per_partition}.")

    if kind == "iid":
        partitioner = IidPartitioner(num_partitions=num_partitions)
    elif kind == "dirichlet":
        partitioner = DirichletPartitioner(
            num_partitions=num_partitions, partition_by=label_column, alpha=float(alpha),
            min_partition_size=DIRICHLET_MIN_PARTITION_SIZE, seed=seed)
    else:
        # "first-deterministic" gives partition i label i % num_classes first, so that no label is
        # left out when there are at least as many partitions as labels; the others are drawn at random.
        partitioner = PathologicalPartitioner(
            num_partitions=num_partitions, partition_by=label_column,
            num_classes_per_partition=classes_per_partition, class_assignment_mode="first-deterministic",
            seed=seed)
    # Shuffled first, as FederatedDataset does: IidPartitioner takes contiguous shards, and the others
    # split each label's rows in stored order, so partitions must not depend on that order.
    partitioner.dataset = dataset.shuffle(seed=seed, keep_in_memory=True)
    if kind == "dirichlet":
        try:
            partitioner.load_partition(0)  # draws every partition now, so that a failure surfaces here
        except ValueError as err:
            raise ValueError(f"Dirichlet partitioning with alpha {alpha} cannot give each of the "
                             f"{num_partitions} partitions {DIRICHLET_MIN_PARTITION_SIZE} or more examples; "
                             "raise alpha or use fewer partitions.") from err
    return partitioner


def deal_units(units: int, num_partitions: int, partition_id: int) -> list[int]:
    """The natural partition's rule: client c of C holds units c, c + C, c + 2C, ... (one each when there are as
    many clients as units), so that no unit is split and no client holds another's."""
    if num_partitions > units:
        raise ValueError(f"The data has {units} units (writers, chapters or files) for {num_partitions} clients: "
                         f"set num-clients <= {units}.")
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"Partition id {partition_id} is out of range for {num_partitions} partitions.")
    return list(range(partition_id, units, num_partitions))


class NaturalPartitioner:
    """Partitions by the client column: each writer's rows stay together, writers dealt to the clients by
    ``deal_units`` in the order they first appear. (flwr-datasets' NaturalIdPartitioner gives one partition per
    writer; this deals them over fewer clients too.) Read as a flwr-datasets partitioner: ``load_partition``."""

    def __init__(self, dataset: datasets.Dataset, num_partitions: int):
        if CLIENT_COLUMN not in dataset.column_names:
            raise ValueError("partitioner = \"natural\" needs a client column (client-column, or a user, writer, "
                             "author, ... column): this dataset has none; use iid, dirichlet or pathological.")
        units: dict[str, list[int]] = {}
        for row, client in enumerate(dataset[CLIENT_COLUMN]):
            units.setdefault(client, []).append(row)
        self.units, self.dataset, self.num_partitions = list(units.values()), dataset, num_partitions
        deal_units(len(self.units), num_partitions, 0)  # more clients than writers: one line, here

    def load_partition(self, partition_id: int) -> datasets.Dataset:
        rows = sorted(r for u in deal_units(len(self.units), self.num_partitions, partition_id) for r in self.units[u])
        return self.dataset.select(rows)


def load_partition(partitioner: Partitioner, partition_id: int) -> datasets.Dataset:
    """Partition ``partition_id`` of ``partitioner``, with a clear error for an id out of range."""
    if not 0 <= partition_id < partitioner.num_partitions:
        raise ValueError(f"Partition id {partition_id} is out of range for {partitioner.num_partitions} "
                         "partitions.")
    return partitioner.load_partition(partition_id)


def normalization(image_size: int) -> tuple[list[float], list[float]]:
    """(mean, std): CIFAR100_MEAN/STD at 32 px (models trained on CIFAR itself), VIT_MEAN/STD otherwise (pretrained
    ViTs fed upsampled images)."""
    native = image_size == IMAGE_SIZE
    return (list(CIFAR100_MEAN if native else VIT_MEAN), list(CIFAR100_STD if native else VIT_STD))


def image_transform(image_size: int, *, train: bool) -> v2.Compose:
    """One PIL image -> normalized float32 tensor (3, image_size, image_size), for DataLoader pipelines; ``to_torch``
    applies the same steps to whole batches on the device. ``train`` adds random mirroring."""
    from torchvision.transforms import v2

    mean, std = normalization(image_size)
    # Resize returns images already at the target size untouched.
    steps: list[v2.Transform] = [v2.ToImage(), v2.Resize((image_size, image_size), antialias=True)]
    if train:
        steps.append(v2.RandomHorizontalFlip())
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean=mean, std=std)]
    return v2.Compose(steps)


class DeviceImages:
    """A dataset decoded once into one uint8 tensor on a device, transformed there a batch at a time.

    ``images[indices]`` gives {"pixel_values": float32 (B, 3, S, S), "labels": int64 (B,)} on the device: the
    stored images resized to S (antialiased bilinear, as ``image_transform``), in training each mirrored with
    probability 1/2, then scaled to [0, 1] and normalized. The mirrors are drawn from torch's global generator, one
    draw per image in batch order, as ``image_transform`` draws them, so a seed gives the same flips (and, on a CPU,
    the same pixels) either way. Images of one size up to S are stored at it (CIFAR-100's 32 px cost 3 KiB each, not
    the 147 KiB of 224 px); larger or mixed sizes are resized to S once, when decoded.
    """

    def __init__(self, dataset: datasets.Dataset, image_size: int, *, train: bool = False,
                 device: torch.device | str | None = None):
        from torchvision.transforms import v2

        self.image_size, self.train = image_size, train
        self.device = torch.device(device or "cpu")
        decoded = []
        for chunk in dataset.select_columns([IMAGE_COLUMN]).iter(batch_size=1024):  # a chunk of PIL images at a time
            for image in map(v2.functional.to_image, chunk[IMAGE_COLUMN]):
                larger = image.shape[-2] > image_size or image.shape[-1] > image_size
                decoded.append(self._resized(image) if larger else image)
        if len({tuple(image.shape) for image in decoded}) > 1:
            decoded = [self._resized(image) for image in decoded]
        self.images = (torch.stack(decoded) if decoded else torch.empty(0, 3, image_size, image_size,
                                                                          dtype=torch.uint8)).to(self.device)
        self.labels = torch.as_tensor(dataset[LABEL_COLUMN], dtype=torch.int64).to(self.device)
        self.mean, self.std = normalization(image_size)

    def _resized(self, images: torch.Tensor) -> torch.Tensor:
        from torchvision.transforms import v2

        return v2.functional.resize(images, [self.image_size, self.image_size], antialias=True)

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def nbytes(self) -> int:
        return self.images.nbytes + self.labels.nbytes

    def draw(self, key: int | slice | Sequence[int]) -> Draw:
        """The host's part of ``self[key]``: its rows and, in training, its mirrors (one draw of torch's global
        generator per image, in batch order, as ``image_transform`` draws them)."""
        rows = torch.arange(len(self))[key] if isinstance(key, slice) else torch.as_tensor(key, dtype=torch.int64)
        return Draw(self, rows, torch.rand(len(rows)) < 0.5 if self.train else None)

    def __getitem__(self, key: int | slice | Sequence[int]) -> dict[str, torch.Tensor]:
        if isinstance(key, (int, np.integer)):
            return {name: value[0] for name, value in self[[int(key)]].items()}
        return batch_of([self.draw(key)])


@dataclasses.dataclass(frozen=True)
class Draw:
    """A batch chosen from a DeviceImages (``DeviceImages.draw``), before the device's part of the work."""

    images: DeviceImages
    rows: torch.Tensor  # int64, on the host
    mirrored: torch.Tensor | None  # bool, on the host; None: not a training draw

    @staticmethod
    def join(draws: Sequence[Draw]) -> dict[str, torch.Tensor]:
        """Several clients' draws as one batch on the device (``batch_of``)."""
        return batch_of(draws)


def batch_of(draws: Sequence[Draw]) -> dict[str, torch.Tensor]:
    """The batches of ``draws`` concatenated in order, {"pixel_values": float32 (B, 3, S, S), "labels": int64 (B,)}
    on the device: each draw's stored images and labels gathered, then resized (apart only where datasets are
    stored at different sizes), mirrored, scaled and normalized as one batch. Several clients' draws of a local
    step thus add two gathers a client to one client's operations, not the whole transform again: on a GPU each
    operation launched costs the host a few microseconds while the device may wait."""
    from torchvision.transforms import v2

    first = draws[0].images
    if any((d.images.device, d.images.image_size, d.images.mean, d.images.std)
           != (first.device, first.image_size, first.mean, first.std) for d in draws):
        raise ValueError("Batches drawn together must come from images of one device, size and normalization.")
    rows = _onto_device(torch.cat([d.rows for d in draws]), first.device).split([len(d.rows) for d in draws])
    stored = [d.images.images[r] for d, r in zip(draws, rows)]
    if len({tuple(s.shape[1:]) for s in stored}) == 1:  # one resize for all
        images = first._resized(torch.cat(stored))
    else:  # datasets stored at different sizes (mixed-size user data is stored at S)
        images = torch.cat([first._resized(s) for s in stored])
    if any(d.mirrored is not None for d in draws):
        mirrored = torch.cat([d.mirrored if d.mirrored is not None else torch.zeros(len(d.rows), dtype=torch.bool)
                              for d in draws])
        images = torch.where(_onto_device(mirrored, first.device)[:, None, None, None], images.flip(-1), images)
    pixels = v2.functional.normalize(v2.functional.to_dtype(images, torch.float32, scale=True),
                                     mean=first.mean, std=first.std)
    return {"pixel_values": pixels, "labels": torch.cat([d.images.labels[r] for d, r in zip(draws, rows)])}


def _onto_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host values onto ``device`` without waiting for it. A copy from pageable memory waits for every kernel queued
    before it, so each batch drawn would wait for the step before it to finish and the GPU would idle while the host
    prepares the next (an H200 idled about 30% of a group, waiting for the host); from pinned memory the copy is
    queued like a kernel."""
    if device.type != "cuda" or values.device.type != "cpu":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


def to_torch(dataset: datasets.Dataset, image_size: int, *, train: bool = False,
             device: torch.device | str | None = None) -> DeviceImages:
    """``dataset`` decoded once onto ``device`` (default: the CPU), yielding {"pixel_values": float32 (3, S, S),
    "labels": int64} per index and batches of them per list of indices (``DeviceImages``)."""
    return DeviceImages(dataset, image_size, train=train, device=device)


@functools.lru_cache(maxsize=2)
def load_split(config, split: str) -> datasets.Dataset:
    """One split ("train" or "test") of a run config's dataset in CIFAR-100's schema, without reading or generating
    the other where the source allows (a client needs only the training data, the server only the test data)."""
    if split not in ("train", "test"):
        raise ValueError(f"Unknown split {split!r}; expected train or test.")
    if is_user_dataset(config.dataset):
        train, test = load_user_dataset(config.dataset, image_column=config.image_column,
                                        label_column=config.label_column, client_column=config.client_column,
                                        unreadable=config.unreadable)
        return train if split == "train" else test
    if config.dataset == "cifar100":
        return load_cifar100(split)
    if config.dataset == "fashion-mnist":
        return load_fashion_mnist(split)
    return make_synthetic_cifar(config.train_examples if split == "train" else config.test_examples, split=split,
                                num_classes=config.classes, seed=config.seed)
