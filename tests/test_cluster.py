"""Simulations on a Ray cluster (fedlora.cluster): a real cluster of two Ray nodes on this machine, started with
`ray start` as docs/how-to/ray.md says; the run joins it by address, its clients train on both nodes, and it
ends as the same run on a local Ray does; a node without the data is named before the run, and a node lost in
the middle of a round costs its clients' replies, not the run."""

import json
import re
import subprocess
import sys

import psutil
import pytest
import torch
from safetensors.torch import load_file

from fedlora.checkpoint import FINISHED, Checkpoint
from fedlora.cli import main
from fedlora.cluster import LocalCluster, _probe, check_address, check_cluster, library_versions, ray_address
from fedlora.config import RunConfig
from fedlora.data import FASHION_MNIST_DIR_ENV
from fedlora.launch import run_simulation

TINY = {"strategy": "sgmm-ffa-lora", "num-clients": 4, "clients-per-round": 2, "local-steps": 2,
        "train-examples": 150, "test-examples": 60}
FLOWER = ("flower-superlink", "flower-superexec", "flwr-simulation", "flwr-serverapp")


def flower_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "stat,cmd"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in out if any(p in line for p in FLOWER) and not line.startswith("Z")]


def ray_processes(cluster: LocalCluster) -> list[str]:
    """The cluster's own live Ray processes (their command lines name its folder)."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        command = " ".join(process.info["cmdline"] or [])
        if str(cluster.temp_dir) in command and process.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(command)
    return found


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head and a second node, one CPU each; the second finds no Fashion-MNIST (the head finds the four files
    the check looks for), as a machine whose data was never copied."""
    fashion = tmp_path_factory.mktemp("fashion")
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        (fashion / name).touch()
    with LocalCluster([1, 1], node_env={0: {FASHION_MNIST_DIR_ENV: str(fashion)},
                                        1: {FASHION_MNIST_DIR_ENV: "/nonexistent", "HF_HUB_OFFLINE": "1"}}) as c:
        yield c


def test_the_address_comes_from_the_flag_then_ray_address_and_local_means_this_machine(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_address(None) is None and ray_address("10.0.0.1:6379") == "10.0.0.1:6379"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert ray_address(None) == "10.0.0.2:6379" and ray_address("10.0.0.1:6379") == "10.0.0.1:6379"
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert ray_address(None) is None


@pytest.mark.parametrize("address, message", [
    ("ray://10.0.0.1:10001", "Ray Client addresses (ray://) cannot run Flower's simulation"),
    ("10.0.0.1", "expected HOST:PORT"),
    ("127.0.0.1:1", "Nothing answers at the Ray address 127.0.0.1:1"),
])
def test_a_bad_address_is_one_line_and_exit_2_before_anything_runs(capsys, tmp_path, address, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_address(address)
    assert main(["run", "--ray-address", address, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "run").exists()


def test_a_node_without_fedlora_or_with_other_versions_says_so(monkeypatch):
    """The probe travels pickled by value, so a Python without fedlora loads it, runs it and says what is missing."""
    import ray.cloudpickle

    blob = ray.cloudpickle.dumps(_probe())
    code = ("import pickle, sys; sys.modules['fedlora'] = None; "  # as on a node where fedlora is not installed
            "print(pickle.loads(sys.stdin.buffer.read())({}, {'fedlora': '0.2.0'}))")
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, timeout=120)
    assert out.stdout.decode().startswith("cannot import fedlora (ModuleNotFoundError"), out.stderr.decode()[-500:]
    versions = {**library_versions(), "torch": "0.0.1"}
    problem = _probe()(RunConfig.from_mapping(TINY).to_mapping(), versions)
    assert problem == (f"it has torch {library_versions()['torch']} (here 0.0.1): install the same versions on "
                       "every node")
    assert _probe()(RunConfig.from_mapping(TINY).to_mapping(), library_versions()) is None


def test_the_check_names_the_node_without_the_data(cluster, capsys):
    config = RunConfig.from_mapping({**TINY, "dataset": "fashion-mnist"})
    with pytest.raises(ValueError) as error:
        check_cluster(cluster.address, config)
    message = str(error.value)
    assert "\n" not in message and "Fashion-MNIST is not in /nonexistent" in message and cluster.ip in message
    nodes = check_cluster(cluster.address, RunConfig.from_mapping(TINY))  # synthetic data: every node has it
    assert len(nodes) == 2 and [n.clients(RunConfig.from_mapping(TINY)) for n in nodes] == [1, 1]
    with pytest.raises(ValueError, match="No node of the Ray cluster .* has the resources of one client"):
        check_cluster(cluster.address, RunConfig.from_mapping({**TINY, "client-cpus": 2}))
    capsys.readouterr()
    assert main(["cluster", "--ray-address", cluster.address]) == 0  # the same check, alone, for `flwr run` users
    assert capsys.readouterr().out.count("clients at a time: the same fedlora and libraries, the synthetic data reachable") == 2
    assert main(["cluster", "--ray-address", cluster.address, "--set", 'dataset="fashion-mnist"']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot run this run's clients: Fashion-MNIST is not in /nonexistent" in err[0]


def test_a_run_on_two_nodes_trains_on_both_and_ends_as_on_a_local_ray(cluster, tmp_path, capsys):
    argv = [f"--set={k}={v}" for k, v in {**TINY, "num-rounds": 2}.items()]
    assert main(["run", *argv, "--ray-address", cluster.address, "--out", str(tmp_path / "cluster")]) == 0
    out = capsys.readouterr().out
    assert f"Ray cluster at {cluster.address}: 2 nodes, 2 clients at a time" in out
    rows = [json.loads(line) for line in (tmp_path / "cluster" / "metrics.jsonl").read_text().splitlines()]
    assert [r["nodes"] for r in rows] == [2, 2] and "(replies from 2 Ray nodes)" in out  # one client on each node
    local = run_simulation(RunConfig.from_mapping({**TINY, "num-rounds": 2}), tmp_path / "local", echo=lambda _: None)
    assert [r["nodes"] for r in local] == [1, 1]
    assert [r["epsilon"] for r in local] == [r["epsilon"] for r in rows]
    assert [r["accuracy"] for r in local] == [r["accuracy"] for r in rows]
    ours, theirs = (load_file(tmp_path / d / "adapter" / "adapter_model.safetensors") for d in ("cluster", "local"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not flower_processes()


def test_a_node_lost_mid_round_costs_its_replies_and_the_run_goes_on(tmp_path):
    """The second node dies (SIGKILL of its raylet and workers) as round 2 starts: its client's reply fails, the
    release stays counted, the engine restarts on the head alone once the cluster has given the node up, and the
    run finishes. A cluster of its own: this one ends with a node less."""
    lines = []
    with LocalCluster([1, 1]) as cluster:
        assert len(ray_processes(cluster)) >= 2  # a raylet a node at least: what must be gone at the end

        def echo(line: str) -> None:
            lines.append(line)
            if line.startswith("round   1/"):  # round 2's messages are out: its clients are training
                cluster.stop_node(1, kill=True)

        config = RunConfig.from_mapping({**TINY, "num-rounds": 3, "local-steps": 30})
        rows = run_simulation(config, tmp_path / "run", echo=echo, ray_address=cluster.address)
        assert any("restarting the simulation engine" in line for line in lines)
        assert "  on the Ray cluster's 1 live nodes" in lines
        assert [r["round"] for r in rows] == [1, 2, 3] and Checkpoint.load(tmp_path / "run").status == FINISHED
        lost = rows[1]
        assert lost["failed"] == 1 and lost["replies"] == 1 and lost["releases"] == 2  # counted, not aggregated
        assert rows[0]["nodes"] == 2 and rows[2]["nodes"] == 1 and rows[2]["replies"] == 2
        assert rows[-1]["epsilon"] <= config.target_epsilon
    assert not flower_processes() and not ray_processes(cluster) and not cluster.temp_dir.exists()
