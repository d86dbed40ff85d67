"""Tests for fedlora.data: synthetic CIFAR, partitioners, transforms, and offline CIFAR-100 loading."""

import glob
import json
import pickle
import shutil
import time
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from datasets.packaged_modules.parquet.parquet import Parquet
from PIL import Image

from fedlora.data import (
    CIFAR100_FEATURES,
    CIFAR100_HUB_ID,
    CIFAR100_MEAN,
    CIFAR100_STD,
    COARSE_LABEL_COLUMN,
    IMAGE_COLUMN,
    LABEL_COLUMN,
    DatasetUnavailableError,
    batch_of,
    image_transform,
    load_cifar100,
    load_image_dir,
    load_partition,
    make_partitioner,
    make_synthetic_cifar,
    to_torch,
)
from tests.helpers import DEVICES

NUM_CLASSES = 10
NUM_PARTITIONS = 10


def assert_one_sentence(message: str) -> None:
    assert "\n" not in message, message
    assert message.endswith("."), message
    assert ". " not in message, message


def pixels(dataset: datasets.Dataset) -> np.ndarray:
    """float32 (N, H * W * 3) of a dataset's images."""
    images = np.stack([np.asarray(image) for image in dataset[IMAGE_COLUMN]])
    return images.reshape(len(dataset), -1).astype(np.float32)


@pytest.fixture(scope="module")
def splits() -> tuple[datasets.Dataset, datasets.Dataset]:
    return (make_synthetic_cifar(1000, num_classes=NUM_CLASSES, split="train"),
            make_synthetic_cifar(500, num_classes=NUM_CLASSES, split="test"))


@pytest.fixture(scope="module")
def indexed(splits) -> datasets.Dataset:
    """The train split with a "row" column, to tell which rows each partition holds."""
    train, _ = splits
    return train.add_column("row", list(range(len(train))))


def partition_rows(partitioner) -> list[list[int]]:
    return [load_partition(partitioner, i)["row"] for i in range(partitioner.num_partitions)]


def partition_labels(partitioner) -> list[list[int]]:
    return [load_partition(partitioner, i)[LABEL_COLUMN] for i in range(partitioner.num_partitions)]


def assert_exact_cover(rows: list[list[int]], num_rows: int) -> None:
    flat = [r for part in rows for r in part]
    assert len(flat) == len(set(flat)) == num_rows  # no row twice, and every row once
    assert set(flat) == set(range(num_rows))


def mean_top_label_fraction(labels: list[list[int]]) -> float:
    return float(np.mean([Counter(part).most_common(1)[0][1] / len(part) for part in labels]))


# Synthetic data.

def test_synthetic_has_cifar100_schema():
    dataset = make_synthetic_cifar(200, seed=0)
    assert dataset.column_names == [IMAGE_COLUMN, LABEL_COLUMN, COARSE_LABEL_COLUMN]
    assert dataset.features == CIFAR100_FEATURES
    example = dataset[0]
    assert isinstance(example[IMAGE_COLUMN], Image.Image)
    assert example[IMAGE_COLUMN].size == (32, 32)
    assert example[IMAGE_COLUMN].mode == "RGB"
    assert example[COARSE_LABEL_COLUMN] == example[LABEL_COLUMN] % 20


def test_synthetic_with_fewer_classes_keeps_column_types(splits):
    train, test = splits
    for dataset in splits:
        assert dataset.column_names == list(CIFAR100_FEATURES)
        assert isinstance(dataset.features[IMAGE_COLUMN], datasets.Image)
        assert dataset.features[LABEL_COLUMN].num_classes == NUM_CLASSES
        assert dataset.features[COARSE_LABEL_COLUMN] == CIFAR100_FEATURES[COARSE_LABEL_COLUMN]
    assert (len(train), len(test)) == (1000, 500)
    assert set(Counter(train[LABEL_COLUMN]).values()) == {100}  # balanced


def test_synthetic_is_deterministic_per_seed():
    first, again, other = (make_synthetic_cifar(50, num_classes=5, seed=seed) for seed in (7, 7, 8))
    assert np.array_equal(pixels(first), pixels(again))
    assert first[LABEL_COLUMN] == again[LABEL_COLUMN]
    assert not np.array_equal(pixels(first), pixels(other))
    test = make_synthetic_cifar(50, num_classes=5, seed=7, split="test")
    assert not np.array_equal(pixels(first), pixels(test))


def test_synthetic_classes_are_learnable_and_shared_across_splits(splits):
    """A nearest-class-mean classifier on raw pixels, fit on train, scores far above chance on test."""
    train, test = splits
    train_x, train_y = pixels(train), np.array(train[LABEL_COLUMN])
    test_x, test_y = pixels(test), np.array(test[LABEL_COLUMN])
    means = np.stack([train_x[train_y == c].mean(axis=0) for c in range(NUM_CLASSES)])
    predicted = ((test_x[:, None, :] - means[None]) ** 2).sum(axis=-1).argmin(axis=1)
    assert (predicted == test_y).mean() > 0.5  # chance: 0.1


@pytest.mark.parametrize("kwargs, message", [
    ({"num_examples": 0}, "Number of examples must be at least 1, got 0."),
    ({"num_examples": 10, "num_classes": 0}, "Number of classes must be at least 1, got 0."),
    ({"num_examples": 10, "image_size": 0}, "Image size must be at least 1, got 0."),
    ({"num_examples": 10, "split": "validation"}, "Unknown split 'validation'"),
])
def test_synthetic_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError) as info:
        make_synthetic_cifar(**kwargs)
    assert str(info.value).startswith(message)
    assert_one_sentence(str(info.value))


# Partitioners.

def test_iid_partitions_cover_every_row_once_in_balanced_sizes(indexed):
    rows = partition_rows(make_partitioner("iid", num_partitions=7, dataset=indexed, seed=0))
    assert_exact_cover(rows, len(indexed))
    sizes = [len(part) for part in rows]
    assert max(sizes) - min(sizes) <= 1
    assert rows == partition_rows(make_partitioner("iid", num_partitions=7, dataset=indexed, seed=0))
    assert rows != partition_rows(make_partitioner("iid", num_partitions=7, dataset=indexed, seed=1))


def test_dirichlet_skew_follows_alpha(indexed):
    def partitioner(alpha, seed=0):
        return make_partitioner("dirichlet", num_partitions=NUM_PARTITIONS, dataset=indexed, alpha=alpha,
                                seed=seed)

    iid = mean_top_label_fraction(
        partition_labels(make_partitioner("iid", num_partitions=NUM_PARTITIONS, dataset=indexed)))
    skewed = mean_top_label_fraction(partition_labels(partitioner(0.1)))
    flat = mean_top_label_fraction(partition_labels(partitioner(1000.0)))
    assert skewed > 2 * iid
    assert flat < 1.5 / NUM_CLASSES  # near-even labels, like IID's (a huge alpha even stratifies them)
    for alpha in (0.1, 1000.0):
        rows = partition_rows(partitioner(alpha))
        assert_exact_cover(rows, len(indexed))
        assert min(len(part) for part in rows) >= 1
    assert partition_rows(partitioner(0.1)) == partition_rows(partitioner(0.1))
    assert partition_rows(partitioner(0.1)) != partition_rows(partitioner(0.1, seed=1))


def test_pathological_partitions_hold_at_most_their_classes(indexed):
    partitioner = make_partitioner("pathological", num_partitions=NUM_PARTITIONS, dataset=indexed,
                                   classes_per_partition=2, seed=0)
    for labels in partition_labels(partitioner):
        assert 1 <= len(set(labels)) <= 2
    # As many partitions as labels: "first-deterministic" leaves no label, hence no row, out.
    assert_exact_cover(partition_rows(partitioner), len(indexed))


@pytest.mark.parametrize(("kind", "kwargs", "message"), [
    ("shards", {}, "Unknown partitioner 'shards'"),
    ("iid", {"num_partitions": 0}, "Number of partitions must be at least 1, got 0."),
    ("iid", {"num_partitions": 1001}, "Cannot split 1000 examples into 1001 partitions."),
    ("dirichlet", {"alpha": 0.0}, "Dirichlet alpha must be positive, got 0.0."),
    ("dirichlet", {"alpha": -1.0}, "Dirichlet alpha must be positive, got -1.0."),
    ("dirichlet", {"label_column": "label"}, "Dataset has no column 'label'"),
    ("pathological", {"classes_per_partition": 0}, "Classes per partition must be between 1 and"),
    ("pathological", {"classes_per_partition": NUM_CLASSES + 1}, "Classes per partition must be between 1 and"),
])
def test_make_partitioner_rejects_bad_arguments(indexed, kind, kwargs, message):
    with pytest.raises(ValueError) as info:
        make_partitioner(kind, dataset=indexed, **{"num_partitions": NUM_PARTITIONS, **kwargs})
    assert str(info.value).startswith(message)
    assert_one_sentence(str(info.value))


@pytest.mark.filterwarnings("ignore:The specified min_partition_size")
def test_dirichlet_that_cannot_fill_every_partition_fails_at_once(indexed):
    with pytest.raises(ValueError) as info:
        make_partitioner("dirichlet", num_partitions=100, dataset=indexed, alpha=0.01)
    assert_one_sentence(str(info.value))


def test_load_partition_rejects_ids_out_of_range(indexed):
    partitioner = make_partitioner("iid", num_partitions=3, dataset=indexed)
    for partition_id in (-1, 3):
        with pytest.raises(ValueError) as info:
            load_partition(partitioner, partition_id)
        assert_one_sentence(str(info.value))


# Transforms.

@pytest.mark.parametrize("image_size", [32, 224])
def test_to_torch_yields_float_images_and_int64_labels(splits, image_size):
    train, _ = splits
    example = to_torch(train, image_size, train=True)[0]
    assert example["pixel_values"].shape == (3, image_size, image_size)
    assert example["pixel_values"].dtype == torch.float32
    assert example["labels"].dtype == torch.int64
    assert int(example["labels"]) == train[0][LABEL_COLUMN]


def test_a_list_of_indices_gives_a_batch(splits):
    train, _ = splits
    batch = to_torch(train, 224)[[0, 1, 2, 3]]
    assert batch["pixel_values"].shape == (4, 3, 224, 224)
    assert batch["pixel_values"].dtype == torch.float32
    assert batch["labels"].shape == (4,)
    assert batch["labels"].dtype == torch.int64
    assert batch["labels"].tolist() == train[:4][LABEL_COLUMN]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("image_size", [32, 224])
def test_batches_on_the_device_equal_the_per_image_transform_with_the_same_flips(splits, image_size, device):
    """DeviceImages transforms a batch at once what image_transform does to each image: the same resize, the same
    mirrors for a seed (one draw of torch's global generator per image, in order) and the same normalization; on a
    GPU the same up to a resize's rounding (a level of 255)."""
    train, _ = splits
    rows = [5, 0, 7, 7, 2, 9, 1, 3]
    reference = image_transform(image_size, train=True)
    torch.manual_seed(11)
    expected = torch.stack([reference(train[r][IMAGE_COLUMN]) for r in rows])
    after_expected = torch.rand(1)
    images = to_torch(train, image_size, train=True, device=device)
    torch.manual_seed(11)
    batch = {name: value.cpu() for name, value in images[rows].items()}
    assert torch.rand(1) == after_expected  # as many draws as the per-image transform
    assert batch["pixel_values"].shape == (len(rows), 3, image_size, image_size)
    if device == "cpu":
        assert torch.equal(batch["pixel_values"], expected)
    else:
        level = 1 / 255 / min(images.std)
        torch.testing.assert_close(batch["pixel_values"], expected, rtol=0, atol=1.01 * level)
    assert batch["labels"].tolist() == [train[r][LABEL_COLUMN] for r in rows]
    flipped = [bool(torch.equal(batch["pixel_values"][i], batch["pixel_values"][i].flip(-1))) for i in range(len(rows))]
    plain = to_torch(train, image_size, device=device)[rows]["pixel_values"].cpu()
    mirrored = [not torch.equal(batch["pixel_values"][i], plain[i]) for i in range(len(rows))]
    assert any(mirrored) and not all(mirrored) and not any(flipped)  # some mirrored, not symmetric images


def test_device_images_decode_once_at_the_native_size_unless_larger_or_mixed():
    small = datasets.Dataset.from_dict({IMAGE_COLUMN: [np.zeros((28, 28, 3), np.uint8)] * 2, LABEL_COLUMN: [0, 1]},
                              features=datasets.Features({IMAGE_COLUMN: datasets.Image(), LABEL_COLUMN: datasets.Value("int64")}))
    assert to_torch(small, 224).images.shape == (2, 3, 28, 28)  # 2.3 KiB an image, resized batch by batch
    mixed = datasets.Dataset.from_dict({IMAGE_COLUMN: [np.zeros((28, 28, 3), np.uint8), np.zeros((40, 30, 3), np.uint8)],
                               LABEL_COLUMN: [0, 1]},
                              features=datasets.Features({IMAGE_COLUMN: datasets.Image(), LABEL_COLUMN: datasets.Value("int64")}))
    images = to_torch(mixed, 32)
    assert images.images.shape == (2, 3, 32, 32) and images.images.dtype == torch.uint8
    assert images[[0, 1]]["pixel_values"].shape == (2, 3, 32, 32)
    assert images[1]["pixel_values"].shape == (3, 32, 32) and images[0:2]["labels"].tolist() == [0, 1]
    assert images[np.int64(1)]["labels"] == 1 and images[[]]["pixel_values"].shape == (0, 3, 32, 32)
    assert to_torch(mixed, 32, train=True)[[]]["labels"].shape == (0,)


@pytest.mark.parametrize("device", DEVICES)
def test_several_draws_transformed_as_one_batch_equal_each_transformed_alone(splits, device):
    """A group's local step: three clients' draws (one stored at 28 px, so resized apart; one not training, so never
    mirrored), each drawn with its own seed, give the batches each gives alone, concatenated."""
    train, _ = splits
    small = datasets.Dataset.from_dict(
        {IMAGE_COLUMN: [np.random.default_rng(0).integers(0, 256, (28, 28, 3), np.uint8) for _ in range(4)],
         LABEL_COLUMN: [3, 1, 4, 1]},
        features=datasets.Features({IMAGE_COLUMN: datasets.Image(), LABEL_COLUMN: datasets.Value("int64")}))
    clients = [to_torch(train.select(range(50)), 64, train=True, device=device),
               to_torch(small, 64, train=True, device=device),
               to_torch(train.select(range(50, 100)), 64, device=device)]
    rows = [[4, 0, 4, 9], [2, 3, 0], [1, 7]]
    draws = []
    for seed, (images, key) in enumerate(zip(clients, rows)):
        torch.manual_seed(seed)
        draws.append(images.draw(key))
    together = batch_of(draws)
    alone = []
    for seed, (images, key) in enumerate(zip(clients, rows)):
        torch.manual_seed(seed)
        alone.append(images[key])
    for name in ("pixel_values", "labels"):
        assert torch.equal(together[name], torch.cat([batch[name] for batch in alone])), name
    assert together["labels"].tolist()[4:7] == [4, 1, 3]
    with pytest.raises(ValueError, match="one device, size and normalization"):
        batch_of([clients[0].draw([0]), to_torch(train.select(range(5)), 32).draw([0])])


def test_image_transform_normalizes_as_the_model_expects():
    image = Image.fromarray(np.full((32, 32, 3), 255, dtype=np.uint8))
    cifar = image_transform(32, train=False)  # at 32 px CIFAR-100's own statistics
    expected = (1 - torch.tensor(CIFAR100_MEAN)) / torch.tensor(CIFAR100_STD)
    assert torch.allclose(cifar(image), expected[:, None, None].expand(3, 32, 32))
    vit = image_transform(224, train=False)  # upsampled for a pretrained ViT: mean 0.5, std 0.5
    assert torch.allclose(vit(image), torch.ones(3, 224, 224))


# CIFAR-100 from the hub, offline.

@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def test_load_cifar100_offline_fails_fast_naming_synthetic(offline, tmp_path):
    start = time.monotonic()
    with pytest.raises(DatasetUnavailableError) as info:
        load_cifar100("train", cache_dir=tmp_path)
    assert time.monotonic() - start < 5
    assert isinstance(info.value, ValueError)
    assert "synthetic" in str(info.value)
    assert CIFAR100_HUB_ID in str(info.value)
    assert_one_sentence(str(info.value))


def test_load_cifar100_fails_fast_when_the_hub_is_unreachable(monkeypatch, tmp_path):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)

    def unreachable(address, timeout):
        raise OSError("no route to host")

    monkeypatch.setattr("fedlora.hub.socket.create_connection", unreachable)
    start = time.monotonic()
    with pytest.raises(DatasetUnavailableError, match=r"unreachable.*synthetic"):
        load_cifar100("test", cache_dir=tmp_path)
    assert time.monotonic() - start < 5
    assert datasets.config.HF_HUB_OFFLINE is False  # offline mode was for that one call only


def test_load_cifar100_offline_uses_a_cached_copy(offline, tmp_path):
    """A copy laid out as datasets caches a hub download (namespace___name/config/version/commit)."""
    cached = make_synthetic_cifar(20, seed=1)
    cached.to_parquet(tmp_path / "train.parquet")
    Parquet(cache_dir=str(tmp_path / "build"), dataset_name="cifar100", repo_id=CIFAR100_HUB_ID,
            config_name="cifar100", data_files={"train": [str(tmp_path / "train.parquet")]},
            features=cached.features).download_and_prepare()
    (built,) = glob.glob(str(tmp_path / "build" / "uoft-cs___cifar100" / "*" / "0.0.0"))
    target = tmp_path / "cache" / "uoft-cs___cifar100" / "cifar100" / "0.0.0" / "0123abcd"
    shutil.copytree(built, target)
    assert json.loads(Path(target, "dataset_info.json").read_text())["config_name"] == "cifar100"

    loaded = load_cifar100("train", cache_dir=tmp_path / "cache")
    assert loaded.features == CIFAR100_FEATURES
    assert loaded[LABEL_COLUMN] == cached[LABEL_COLUMN]


# -- a device's own images (data-dir) ---------------------------------------------------------------

def test_image_dir_reads_cifar100_python_format(tmp_path):
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(5, 3 * 32 * 32), dtype=np.uint8)
    with (tmp_path / "train").open("wb") as f:
        pickle.dump({b"data": data, b"fine_labels": [3, 1, 4, 1, 5], b"coarse_labels": [0] * 5}, f)
    ds = load_image_dir(tmp_path, num_classes=100)
    assert ds.features[LABEL_COLUMN].names[3] == "bear" and ds[LABEL_COLUMN] == [3, 1, 4, 1, 5]
    # rows are CHW-flattened, as CIFAR stores them
    assert np.array_equal(np.asarray(ds[0][IMAGE_COLUMN]), data[0].reshape(3, 32, 32).transpose(1, 2, 0))


def test_image_dir_reads_an_image_folder_by_class_name_or_index(tmp_path):
    for folder, n in (("apple", 2), ("worm", 1)):
        (tmp_path / folder).mkdir()
        for i in range(n):
            Image.new("RGB", (40, 24), (i, 0, 0)).save(tmp_path / folder / f"{i}.png")
    ds = load_image_dir(tmp_path, num_classes=100)
    assert sorted(ds[LABEL_COLUMN]) == [0, 0, 99]
    batch = to_torch(ds, 32)[[0, 1, 2]]
    assert batch["pixel_values"].shape == (3, 3, 32, 32)  # any size is resized
    indexed = tmp_path / "indexed"
    (indexed / "7").mkdir(parents=True)
    Image.new("RGB", (32, 32)).save(indexed / "7" / "a.jpg")
    assert load_image_dir(indexed, num_classes=10)[LABEL_COLUMN] == [7]


@pytest.mark.parametrize("layout, message", [
    ({"cat": 1}, "neither a label index 0..9"),
    ({"12": 1}, "neither a label index 0..9"),
    ({}, "holds no images"),
])
def test_image_dir_rejects_what_it_cannot_label(tmp_path, layout, message):
    for folder, n in layout.items():
        (tmp_path / folder).mkdir()
        for i in range(n):
            Image.new("RGB", (8, 8)).save(tmp_path / folder / f"{i}.png")
    with pytest.raises(ValueError, match=message):
        load_image_dir(tmp_path, num_classes=10)


def test_an_image_in_a_data_dir_that_does_not_decode_is_named_or_left_out(tmp_path):
    (tmp_path / "3").mkdir()
    for i in range(2):
        Image.new("RGB", (8, 8)).save(tmp_path / "3" / f"{i}.png")
    (tmp_path / "3" / "bad.png").write_text("not an image")
    with pytest.raises(ValueError, match=r"has 1 image that does not decode, the first 3/bad.png: remove or replace it"):
        load_image_dir(tmp_path, num_classes=10)
    assert load_image_dir(tmp_path, num_classes=10, unreadable="skip")[LABEL_COLUMN] == [3, 3]


def test_image_dir_rejects_a_missing_directory_and_a_foreign_pickle(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        load_image_dir(tmp_path / "missing", num_classes=10)
    (tmp_path / "train").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="not CIFAR-100's pickled train file"):
        load_image_dir(tmp_path, num_classes=10)


# Fashion-MNIST: the original IDX files (Debian's package), or the hub.

def _write_idx(folder: Path, images: np.ndarray, labels: np.ndarray, prefix: str) -> None:
    """IDX files as Zalando (and Debian) ship them, gzipped: magic 0x0803 / 0x0801, big-endian sizes, bytes."""
    import gzip
    import struct

    with gzip.open(folder / f"{prefix}-images-idx3-ubyte.gz", "wb") as f:
        f.write(struct.pack(">IIII", 0x803, *images.shape) + images.tobytes())
    with gzip.open(folder / f"{prefix}-labels-idx1-ubyte.gz", "wb") as f:
        f.write(struct.pack(">II", 0x801, len(labels)) + labels.astype(np.uint8).tobytes())


def test_fashion_mnist_is_read_from_idx_files_by_torchvision_into_the_common_schema(monkeypatch, tmp_path):
    from fedlora.data import FASHION_MNIST_CLASSES, FASHION_MNIST_DIR_ENV, load_fashion_mnist

    rng = np.random.default_rng(0)
    folder = tmp_path / "idx"
    folder.mkdir()
    train = rng.integers(0, 256, (12, 28, 28), dtype=np.uint8), np.arange(12) % 10
    test = rng.integers(0, 256, (5, 28, 28), dtype=np.uint8), np.array([9, 0, 3, 3, 1])
    _write_idx(folder, *train, "train")
    _write_idx(folder, *test, "t10k")
    monkeypatch.setenv(FASHION_MNIST_DIR_ENV, str(folder))
    monkeypatch.setattr("fedlora.data.FASHION_MNIST_PUBLIC", 4)  # of 10,000 in the real files
    public = train[0][8:], train[1][8:]
    train = train[0][:8], train[1][:8]
    for split, (images, labels) in (("train", train), ("public", public), ("test", test)):
        data = load_fashion_mnist(split, cache_dir=tmp_path / "cache")
        assert data.features[LABEL_COLUMN].names == list(FASHION_MNIST_CLASSES)
        assert data[LABEL_COLUMN] == labels.tolist()
        pixels = np.stack([np.asarray(image) for image in data[IMAGE_COLUMN]])
        assert pixels.shape == (len(labels), 28, 28, 3)  # grayscale into three equal channels
        assert (pixels == images[..., None]).all()
    batch = to_torch(data, 32)[:2]  # resized to the model's size like any image
    assert batch["pixel_values"].shape == (2, 3, 32, 32)


def test_fashion_mnist_is_unpacked_safely_while_another_process_unpacks_the_same_files(monkeypatch, tmp_path):
    """A run's workers on a fresh machine unpack the IDX files at once: none may take another's partial file."""
    import shutil

    from fedlora.data import FASHION_MNIST_DIR_ENV, _torchvision_fashion_mnist

    rng = np.random.default_rng(0)
    folder = tmp_path / "idx"
    folder.mkdir()
    test = rng.integers(0, 256, (5, 28, 28), dtype=np.uint8), np.array([9, 0, 3, 3, 1])
    _write_idx(folder, *test, "t10k")
    _write_idx(folder, rng.integers(0, 256, (4, 28, 28), dtype=np.uint8), np.arange(4), "train")
    monkeypatch.setenv(FASHION_MNIST_DIR_ENV, str(folder))
    copy, raced = shutil.copyfileobj, []

    def racing_copy(source, out, *args):
        if not raced:  # the other process starts on the same file, and finishes every file, meanwhile
            raced.append(True)
            _torchvision_fashion_mnist("test", tmp_path / "cache")
        return copy(source, out, *args)

    monkeypatch.setattr(shutil, "copyfileobj", racing_copy)
    images, labels = _torchvision_fashion_mnist("test", tmp_path / "cache")
    assert raced and (images == test[0]).all() and labels.tolist() == test[1].tolist()
    assert not list((tmp_path / "cache").rglob("*.partial"))


def test_fashion_mnist_from_the_hub_schema(monkeypatch, tmp_path):
    """Without the IDX files, the hub's zalando-datasets/fashion_mnist (columns image, label) in the same schema."""
    import fedlora.data as data_module
    from fedlora.data import FASHION_MNIST_CLASSES, FASHION_MNIST_DIR_ENV, FASHION_MNIST_HUB_ID, load_fashion_mnist

    monkeypatch.setenv(FASHION_MNIST_DIR_ENV, str(tmp_path))  # no files here
    monkeypatch.setattr(data_module, "_hub_offline_reason", lambda: None)
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (6, 28, 28), dtype=np.uint8)
    hub = datasets.Dataset.from_dict(
        {"image": [Image.fromarray(i, mode="L") for i in images], "label": [0, 1, 2, 7, 8, 9]},
        features=datasets.Features({"image": datasets.Image(),
                                    "label": datasets.ClassLabel(names=list(FASHION_MNIST_CLASSES))}))
    asked = []
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split, cache_dir=None: asked.append((name, split)) or hub)
    data = load_fashion_mnist("test")
    assert asked == [(FASHION_MNIST_HUB_ID, "test")] and data[LABEL_COLUMN] == [0, 1, 2, 7, 8, 9]
    assert (np.stack([np.asarray(i) for i in data[IMAGE_COLUMN]]) == images[..., None]).all()


def test_fashion_mnist_neither_here_nor_reachable_is_one_line_naming_both_ways(offline, monkeypatch, tmp_path,
                                                                               capsys):
    from fedlora.cli import main
    from fedlora.data import FASHION_MNIST_DIR_ENV, load_fashion_mnist

    monkeypatch.setenv(FASHION_MNIST_DIR_ENV, str(tmp_path))
    with pytest.raises(DatasetUnavailableError) as info:
        load_fashion_mnist("train")
    assert "apt-get install dataset-fashion-mnist" in str(info.value) and "zalando-datasets/fashion_mnist" in \
        str(info.value)
    assert main(["run", "--set", "dataset=fashion-mnist", "--set", "num-classes=10", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "apt-get install dataset-fashion-mnist" in err
    assert not (tmp_path / "r").exists()  # before any work
    assert main(["run", "--set", "dataset=fashion-mnist", "--set", "num-classes=100"]) == 2  # contradicts the data
    assert "fashion-mnist has 10 classes: set num-classes = 10" in capsys.readouterr().err


def test_the_real_fashion_mnist(tmp_path):
    """The real files, when this machine has them (CI installs Debian's package: there a missing file fails)."""
    import os

    from fedlora.data import fashion_mnist_offline, fashion_mnist_unavailable_reason, load_fashion_mnist

    if not fashion_mnist_offline():
        message = (fashion_mnist_unavailable_reason() or "Fashion-MNIST's IDX files are missing") + \
            " (CI installs dataset-fashion-mnist in .ci/run)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    test = load_fashion_mnist("test", cache_dir=tmp_path)
    train = load_fashion_mnist("train", cache_dir=tmp_path)
    public = load_fashion_mnist("public", cache_dir=tmp_path)
    assert (len(train), len(public), len(test)) == (50000, 10000, 10000)  # 60,000 training images, 10,000 public
    assert np.bincount(test[LABEL_COLUMN]).tolist() == [1000] * 10
    assert train[0][LABEL_COLUMN] == 9 and test[0][LABEL_COLUMN] == 9  # an ankle boot opens both, as published


# The user's own data: hf:<id> and folder:<path>.


@pytest.fixture
def fresh_user_datasets():
    from fedlora.data import _user_dataset

    _user_dataset.cache_clear()
    yield
    _user_dataset.cache_clear()


def image_folder(root: Path, counts: dict[str, int], *, gray: str | None = None) -> Path:
    rng = np.random.default_rng(0)
    for name, count in counts.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            shape = (20, 24) if name == gray else (20, 24, 3)
            Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(root / name / f"{i}.png")
    return root


def test_a_folder_with_one_subfolder_per_class_in_the_common_schema(tmp_path, fresh_user_datasets):
    """Classes follow the folders (sorted names), grayscale becomes RGB, and without a test split a stratified
    tenth of train is held out, the same for every run seed."""
    from fedlora.config import load_config
    from fedlora.data import load_split
    from fedlora.data import HELD_OUT_FRACTION, dataset_classes, load_user_dataset

    root = image_folder(tmp_path / "pets", {"cat": 10, "dog": 10, "fox": 10}, gray="fox")
    train, test = load_user_dataset(f"folder:{root}")
    assert train.features[LABEL_COLUMN].names == ["cat", "dog", "fox"] and dataset_classes(f"folder:{root}") == 3
    assert set(train.column_names) == {IMAGE_COLUMN, LABEL_COLUMN, COARSE_LABEL_COLUMN}
    assert (len(train), len(test)) == (27, 3) and len(test) == round(30 * HELD_OUT_FRACTION)
    assert sorted(test[LABEL_COLUMN]) == [0, 1, 2]  # stratified
    assert {image.mode for image in train[IMAGE_COLUMN]} == {"RGB"}
    assert to_torch(train, 32)[:2]["pixel_values"].shape == (2, 3, 32, 32)
    config = load_config(None, [f"dataset=folder:{root}", "seed=7"])
    assert config.classes == 3 and load_split(config, "test")[LABEL_COLUMN] == test[LABEL_COLUMN]


def test_a_folder_with_train_and_test_subfolders_keeps_its_splits(tmp_path, fresh_user_datasets):
    from fedlora.data import load_user_dataset

    image_folder(tmp_path / "train", {"a": 4, "b": 5})
    image_folder(tmp_path / "test", {"a": 2, "b": 1})
    train, test = load_user_dataset(f"folder:{tmp_path}")
    assert (len(train), len(test)) == (9, 3) and sorted(test[LABEL_COLUMN]) == [0, 0, 1]


def hub_dict(labels: list[int], *, names: list[str] | None, image="image", label="label", test=True):
    rng = np.random.default_rng(2)
    label_feature = datasets.ClassLabel(names=names) if names else datasets.Value("int64")
    features = datasets.Features({image: datasets.Image(), label: label_feature, "id": datasets.Value("int64")})

    def split(ys):
        return datasets.Dataset.from_dict(
            {image: [Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8), mode="L") for _ in ys],
             label: ys, "id": list(range(len(ys)))}, features=features)

    return datasets.DatasetDict({"train": split(labels), **({"test": split(labels[:4])} if test else {})})


def test_a_hub_dataset_by_id_with_its_columns_detected_or_named(monkeypatch, fresh_user_datasets):
    """hf:<id> goes through datasets.load_dataset; the Image and ClassLabel columns are found by their features,
    others named by image-column / label-column."""
    import fedlora.data as data_module
    from fedlora.data import load_user_dataset

    monkeypatch.setattr(data_module, "_hub_offline_reason", lambda: None)
    hubs = {"me/clothes": hub_dict([0, 1, 2] * 4, names=["hat", "sock", "shoe"]),
            "me/plain": hub_dict([0, 1, 0, 1, 1, 0], names=None, image="pic", label="y", test=False)}
    asked = []
    monkeypatch.setattr(datasets, "load_dataset", lambda name: asked.append(name) or hubs[name])
    train, test = load_user_dataset("hf:me/clothes")
    assert asked == ["me/clothes"] and (len(train), len(test)) == (12, 4)
    assert train.features[LABEL_COLUMN].names == ["hat", "sock", "shoe"] and train[IMAGE_COLUMN][0].mode == "RGB"
    with pytest.raises(ValueError, match=r"^hf:me/plain has no label columns \(columns: pic, y, id\): set label-column\.$"):
        load_user_dataset("hf:me/plain")  # integers in a column of no known name
    train, test = load_user_dataset("hf:me/plain", label_column="y")
    assert train.features[LABEL_COLUMN].names == ["0", "1"] and len(train) + len(test) == 6


def test_a_hub_dataset_with_a_writer_column_is_partitioned_by_writer(monkeypatch, fresh_user_datasets, tmp_path,
                                                                    capsys):
    """FEMNIST-style: a column of writers (found by name, or named by client-column) is kept in train, and the
    natural partition gives each client its writers' images, writers dealt in the order they first appear; a dataset
    without one, or with fewer writers than clients, is one line before any work."""
    import fedlora.data as data_module
    from fedlora.cli import main
    from fedlora.config import load_config
    from fedlora.data import CLIENT_COLUMN, load_partition, load_user_dataset, make_partitioner

    monkeypatch.setattr(data_module, "_hub_offline_reason", lambda: None)
    hub = hub_dict([0, 1, 2] * 6, names=["a", "b", "c"])
    hub["train"] = hub["train"].add_column("writer_id", [f"w{i % 5}" for i in range(18)])
    named = datasets.DatasetDict({"train": hub["train"].rename_column("writer_id", "hand"), "test": hub["test"]})
    monkeypatch.setattr(datasets, "load_dataset", lambda name: {"me/femnist": hub, "me/hands": named,
                                                                 "me/plain": hub_dict([0, 1] * 6, names=["x", "y"])}[name])
    train, test = load_user_dataset("hf:me/femnist")
    assert train[CLIENT_COLUMN] == [f"w{i % 5}" for i in range(18)] and CLIENT_COLUMN not in test.column_names
    partitioner = make_partitioner("natural", num_partitions=2, dataset=train)
    parts = [load_partition(partitioner, p) for p in range(2)]
    assert [sorted(set(p[CLIENT_COLUMN])) for p in parts] == [["w0", "w2", "w4"], ["w1", "w3"]]
    assert sum(map(len, parts)) == 18
    assert load_user_dataset("hf:me/hands", client_column="hand")[0][CLIENT_COLUMN][:2] == ["w0", "w1"]
    config = load_config(None, ["dataset=hf:me/femnist", "partitioner=natural", "num-clients=5",
                                "clients-per-round=2"])
    config.task.check_before_start(config)  # five writers for five clients
    from flwr.app import Context, RecordDict

    from fedlora.clients.app import app as client_app
    from fedlora.strategies.inprocess_grid import InProcessGrid
    from fedlora.strategies.server_app import run_federation

    run = {**config.to_mapping(), "model": "vit-tiny", "num-rounds": 1, "local-steps": 1, "batch-size": 2,
           "out-dir": str(tmp_path / "natural")}
    strategy = run_federation(InProcessGrid(client_app, 5, run), Context(run_id=1, node_id=0, node_config={},
                                                                         state=RecordDict(), run_config=run),
                              echo=lambda line: None)
    assert strategy.ledger.rounds == 1  # a round of clients each training on its own writer's images
    capsys.readouterr()  # the round's log
    for sets, message in ((["dataset=hf:me/femnist", "num-clients=6"], "The data has 5 units"),
                          (["dataset=hf:me/plain"], 'partitioner = "natural" needs a client column'),
                          (["dataset=hf:me/hands", "client-column=pen"], "has no column 'pen' (client-column)"),
                          (["dataset=synthetic"], "synthetic has none: use iid, dirichlet or pathological.")):
        args = ["run", "--set", "partitioner=natural", "--set", "num-clients=5", "--set", "clients-per-round=2",
                "--out", str(tmp_path / "run")]
        assert main([*args, *(x for s in sets for x in ("--set", s))]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1 and not (tmp_path / "run").exists(), err


def test_a_hub_dataset_with_two_image_columns_needs_image_column(monkeypatch, fresh_user_datasets):
    import fedlora.data as data_module
    from fedlora.data import load_user_dataset

    monkeypatch.setattr(data_module, "_hub_offline_reason", lambda: None)
    image = Image.fromarray(np.zeros((8, 8), dtype=np.uint8), mode="L")
    hub = datasets.DatasetDict({"train": datasets.Dataset.from_dict(
        {"image": [image] * 6, "mask": [image] * 6, "label": [0, 1] * 3},
        features=datasets.Features({"image": datasets.Image(), "mask": datasets.Image(),
                                    "label": datasets.ClassLabel(names=["a", "b"])}))})
    monkeypatch.setattr(datasets, "load_dataset", lambda name: hub)
    with pytest.raises(ValueError) as info:
        load_user_dataset("hf:me/masks")
    assert str(info.value) == "hf:me/masks has 2 image columns (image, mask): set image-column."
    assert sum(map(len, load_user_dataset("hf:me/masks", image_column="mask"))) == 6


@pytest.mark.parametrize("make, message", [
    (lambda root: image_folder(root, {"a": 3}) and (root / "b").mkdir(),
     r"Class folder '.*/b' holds no images \(\.png"),
    (lambda root: image_folder(root, {"a": 3}) and (root / "notes").mkdir() or (root / "notes" / "x.txt").write_text(""),
     r"Class folder '.*/notes' holds no images"),
    (lambda root: root.mkdir() or (root / "x.png").write_bytes(b""), r"has no class subfolders"),
    (lambda root: None, r"is not a directory"),
    (lambda root: image_folder(root, {"only": 3}), r"has 1 class subfolder; a classifier needs at least 2"),
])
def test_folders_that_cannot_be_used_are_one_line_each(tmp_path, make, message, fresh_user_datasets):
    from fedlora.data import load_user_dataset

    make(tmp_path / "data")
    with pytest.raises(ValueError, match=message) as info:
        load_user_dataset(f"folder:{tmp_path / 'data'}")
    assert "\n" not in str(info.value)


def test_images_that_do_not_decode_are_left_out_and_named_when_asked(tmp_path, fresh_user_datasets):
    """unreadable = "skip": a text file named .png (in train) and a truncated PNG (in test) are left out, each named
    with why; the rest loads as before."""
    from fedlora.data import load_user_dataset, unreadable_left_out

    image_folder(tmp_path / "train", {"a": 4, "b": 5})
    image_folder(tmp_path / "test", {"a": 2, "b": 1})
    (tmp_path / "train" / "a" / "notes.png").write_text("not an image")
    whole = (tmp_path / "test" / "b" / "0.png").read_bytes()
    (tmp_path / "test" / "b" / "cut.png").write_bytes(whole[:len(whole) // 2])
    name = f"folder:{tmp_path}"
    with pytest.raises(ValueError, match='unreadable = "skip"') as refused:
        load_user_dataset(name)
    assert "\n" not in str(refused.value) and "train/a/notes.png" in str(refused.value)
    train, test = load_user_dataset(name, unreadable="skip")
    assert (len(train), len(test)) == (9, 3)
    left_out = unreadable_left_out(name, unreadable="skip")
    assert [line.split(" (")[0] for line in left_out] == ["train/a/notes.png", "test/b/cut.png"], left_out
    assert "UnidentifiedImageError" in left_out[0]
    from fedlora.config import load_config

    config = load_config(None, [f"dataset={name}", "unreadable=skip"])
    assert config.task.left_out(config) == left_out and config.classes == 2


def test_a_hub_class_without_training_images_is_refused(monkeypatch, fresh_user_datasets):
    import fedlora.data as data_module
    from fedlora.data import load_user_dataset

    monkeypatch.setattr(data_module, "_hub_offline_reason", lambda: None)
    hub = hub_dict([0, 2, 0, 2], names=["a", "b", "c"])
    monkeypatch.setattr(datasets, "load_dataset", lambda name: hub)
    with pytest.raises(ValueError, match=r"hf:me/gappy has no training images of class 'b': remove the class"):
        load_user_dataset("hf:me/gappy")


def test_bad_user_data_stops_the_cli_before_any_work(tmp_path, capsys, offline, fresh_user_datasets):
    """Unknown dataset, unknown hub id offline, a missing column, num-classes that contradicts the data: one
    line each, exit 2, no run folder."""
    from fedlora.cli import main

    root = image_folder(tmp_path / "pets", {"cat": 3, "dog": 3})
    broken = image_folder(tmp_path / "broken", {"cat": 3, "dog": 3})
    (broken / "cat" / "bad.png").write_text("not an image")
    out = tmp_path / "run"
    cases = [(["dataset=fashion_mnist"], "dataset must be one of synthetic, cifar100, fashion-mnist, hf:<id> or "
                                          "folder:<path>, got 'fashion_mnist'; did you mean 'fashion-mnist'?"),
             (["dataset=hf:nobody/nothing"], "hf:nobody/nothing could not be loaded from the Hugging Face hub"),
             ([f"dataset=folder:{root}", "label-column=kind"], "has no column 'kind' (label-column)"),
             ([f"dataset=folder:{root}", "num-classes=10"], "has 2 classes, but num-classes = 10: set num-classes = 2"),
             (["image-column=pixels"], "image-column and label-column name the columns of an hf: or folder: dataset"),
             ([f"dataset=folder:{broken}"], f"folder:{broken} has an image in its train split that does not decode: "
                                            "cat/bad.png (UnidentifiedImageError")]
    for assignments, message in cases:
        assert main(["run", *[a for s in assignments for a in ("--set", s)], "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
        assert not out.exists()
