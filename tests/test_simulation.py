"""The real simulation path: a SuperLink in simulation mode, `flwr run`, Ray clients."""

import json
from pathlib import Path

import pytest

from fedlora.cli import main
from fedlora.config import RunConfig
from fedlora.launch import run_simulation
from tests.helpers import leftover_flower_processes


def test_a_ray_simulation_of_two_rounds_with_three_clients(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative run directory, as `fedlora run` uses by default
    config = RunConfig.from_mapping({"strategy": "sgmm-ffa-lora", "num-clients": 3, "clients-per-round": 2,
                                     "num-rounds": 2, "local-steps": 2, "train-examples": 150,
                                     "test-examples": 60})
    lines = []
    rows = run_simulation(config, Path("run"), echo=lines.append)
    tmp_path = tmp_path / "run"
    assert [r["round"] for r in rows] == [1, 2] and len(lines) == 2
    assert lines[0].startswith("round   1/2  accuracy") and "(known-sketch)" in lines[0]
    assert rows[-1]["epsilon"] <= config.target_epsilon and rows[-1]["replies"] == 2
    assert (tmp_path / "adapter" / "adapter_config.json").exists() and (tmp_path / "accuracy.png").exists()
    assert json.loads((tmp_path / "config.json").read_text())["strategy"] == "sgmm-ffa-lora"
    assert not leftover_flower_processes()


@pytest.mark.parametrize("argv, message", [
    (["--set", "strategy=fedavg"], "strategy must be one of"),
    (["--set", "num-client=3"], "did you mean 'num-clients'"),
    (["--set", "num-clients=3", "--set", "clients-per-round=4"], "cannot exceed num-clients"),
    (["--set", "target-epsilon=1e-9"], "unreachable"),
    (["--set", "dataset=cifar100", "--set", "num-classes=100"], "synthetic"),
    (["--set", "rank=500"], "exceeds the smallest side (192)"),
    (["--set", "sketch-dim=500"], "Sketch dimension 500 must lie in [1, 192]"),
    (["--config", "missing.toml"], "does not exist"),
])
def test_run_bad_input_is_one_line_and_exit_2_before_ray_starts(capsys, monkeypatch, tmp_path, argv, message):
    monkeypatch.setattr("fedlora.hub.unreachable_reason", lambda: "huggingface.co is unreachable")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()  # nothing started
