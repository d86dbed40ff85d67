"""What a SuperNode's operator configures: node-config keys and the shared sketch secret."""

import stat

import pytest

from fedlora.node import NodeSettings, read_sketch_seed, write_sketch_secret


def test_node_config_gives_partition_data_and_secret():
    node = NodeSettings.from_node_config({"partition-id": 1, "num-partitions": 2, "data-dir": "/data",
                                          "sketch-secret-file": "/s"})
    assert node == NodeSettings(1, 2, "/data", "/s")
    assert NodeSettings.from_node_config({"partition-id": 0, "num-partitions": 3}).data_dir == ""


@pytest.mark.parametrize("node_config, message", [
    ({"num-partitions": 2}, "needs partition-id"),
    ({"partition-id": 2, "num-partitions": 2}, r"must lie in \[0, num-partitions = 2\)"),
    ({"partition-id": "a", "num-partitions": 2}, "whole numbers"),
    ({"partition-id": 0, "num-partitions": 2, "data_dir": "/d"}, "Unknown node-config key 'data_dir'"),
    ({"partition-id": 0, "num-partitions": 2, "privacy-budget": 8}, "need privacy-ledger"),
    ({"partition-id": 0, "num-partitions": 2, "privacy-ledger": "/l", "privacy-budget": 0}, "positive epsilon"),
    ({"partition-id": 0, "num-partitions": 2, "privacy-ledger": "/l", "privacy-budget": "eight"}, "must be a number"),
    ({"partition-id": 0, "num-partitions": 2, "privacy-ledger": "/l", "privacy-delta": 1}, r"lie in \(0, 1\)"),
])
def test_bad_node_config_is_one_sentence(node_config, message):
    with pytest.raises(ValueError, match=message):
        NodeSettings.from_node_config(node_config)


def test_a_node_budget_comes_with_its_ledger(tmp_path):
    plain = NodeSettings.from_node_config({"partition-id": 0, "num-partitions": 2})
    assert plain.budget() is None
    node = NodeSettings.from_node_config({"partition-id": 0, "num-partitions": 2, "privacy-ledger": str(tmp_path / "l"),
                                          "privacy-budget": "4.5", "privacy-delta": "1e-6"})
    budget = node.budget()
    assert (budget.path, budget.epsilon, budget.delta) == (tmp_path / "l", 4.5, 1e-6)
    recording = NodeSettings.from_node_config({"partition-id": 0, "num-partitions": 2, "privacy-ledger": "~/l"})
    assert recording.budget().epsilon is None and recording.budget().delta == 1e-5
    assert not str(recording.budget().path).startswith("~")


def test_sketch_secret_is_256_bits_owner_only_and_fixes_the_seed(tmp_path):
    path = write_sketch_secret(tmp_path / "secret")
    assert len(bytes.fromhex(path.read_text().strip())) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_sketch_seed(path) == read_sketch_seed(path)
    assert read_sketch_seed(path) != read_sketch_seed(write_sketch_secret(tmp_path / "other"))
    assert read_sketch_seed(path).bit_length() > 128  # the whole secret seeds the sketches


@pytest.mark.parametrize("text, message", [("abcd" * 7, "at least 128"), ("xyz", "must be hex")])
def test_weak_or_malformed_secrets_are_refused(tmp_path, text, message):
    (tmp_path / "s").write_text(text)
    with pytest.raises(ValueError, match=message):
        read_sketch_seed(tmp_path / "s")
    with pytest.raises(ValueError, match="Cannot read the sketch secret"):
        read_sketch_seed(tmp_path / "missing")
