"""The soak (benchmarks/soak.py) at a size CI affords: a short simulation whose server is made to keep 16 MiB more
every round is found growing by about that much, and the same run without the leak is not."""

import json

import numpy as np
import pytest

from benchmarks.soak import analyse, slope, soak, verdict, with_committed_modes

LEAK_MIB = 16
TOLERANCE_MIB = 2.0
SERVER = "simulation (Ray driver)"  # a simulation's ServerApp runs in it  # a short run's warm-up moves more than the long soak's tolerance


def test_the_fit_gives_the_slope_and_an_interval_that_holds_it():
    rng = np.random.default_rng(0)
    x = np.arange(1.0, 101.0)
    fit = slope(x, 500 + 0.5 * x + rng.normal(0, 1, x.size))
    assert fit["low"] < 0.5 < fit["high"] and fit["high"] - fit["low"] < 0.05
    rounds = {r: {"least": {SERVER: 500.0 + rng.normal(0, 1)}, "most": {SERVER: 600.0},
                  "processes": {SERVER: 1}, "dir_bytes": 1000 * r} for r in range(1, 101)}
    flat = analyse(rounds, 100)
    assert not flat["roles"][SERVER]["grows"] and flat["dir"]["slope"] == pytest.approx(1000)
    assert verdict(flat).startswith("no role grows")


def test_a_run_of_one_mode_keeps_the_committed_run_of_the_other(tmp_path):
    committed = tmp_path / "soak.json"
    committed.write_text(json.dumps({"modes": {"simulation": {"command": "old", "rounds": 300},
                                               "deployment": {"command": "old", "rounds": 150}}}))
    new = {"tolerance_mib": 0.05, "modes": {"deployment": {"command": "new", "rounds": 300}}}
    merged = with_committed_modes(new, committed)
    assert merged["modes"] == {"simulation": {"command": "old", "rounds": 300},
                               "deployment": {"command": "new", "rounds": 300}} and merged["tolerance_mib"] == 0.05
    assert with_committed_modes(new, tmp_path / "none.json")["modes"] == new["modes"]


def test_a_planted_per_round_leak_in_the_server_is_found_and_a_run_without_it_is_clean(tmp_path):
    leaking = soak(tmp_path / "leak", modes=("simulation",), rounds=30, plant_leak=LEAK_MIB,
                   tolerance=TOLERANCE_MIB, echo=lambda line: None)["modes"]["simulation"]
    assert leaking["code"] == 0 and leaking["rounds_done"] == 30
    server = leaking["analysis"]["roles"][SERVER]
    assert server["grows"] and LEAK_MIB * 0.75 < server["slope"] < LEAK_MIB * 1.5, server
    assert verdict(leaking["analysis"]).startswith(f"grows: {SERVER}")

    clean = soak(tmp_path / "clean", modes=("simulation",), rounds=30, tolerance=TOLERANCE_MIB,
                 echo=lambda line: None)["modes"]["simulation"]
    assert clean["code"] == 0
    assert not any(fit["grows"] for fit in clean["analysis"]["roles"].values()), clean["analysis"]
    assert 0 < clean["analysis"]["dir"]["slope"] < 64 * 1024  # metrics, events and logs: KiB a round


def test_a_preset_soaks_for_the_rounds_asked_and_its_table_names_it(tmp_path, monkeypatch):
    """With --config the soak runs the preset for --rounds (not the preset's own T), a deployment on its SuperNodes,
    and each mode's table names the federation it soaked (the small one's description was printed for any)."""
    import benchmarks.soak as soak_module
    from benchmarks.soak import federation, settings

    assert settings("simulation", 400, "bible") == {"num-rounds": 400, "eval-every": 40}
    assert settings("deployment", 100, "bible", 3) == {"num-clients": 3, "clients-per-round": 3, "num-rounds": 100,
                                                       "eval-every": 10}
    assert settings("simulation", 300, None)["num-clients"] == 6  # the small federation
    runs = {mode: {"command": "c", "commit": "x", "machine": "m", "plant_leak_mib": 0, "code": 0, "seconds": 60.0,
                   "nodes": 2 if mode == "deployment" else None, "rounds": 30, "rounds_done": 30,
                   "federation": federation(mode, "bible", ["lr=0.002"], 2),
                   "analysis": {"error": "too few rounds"}, "samples": {}} for mode in ("simulation", "deployment")}
    monkeypatch.setattr(soak_module, "RESULTS", tmp_path)
    monkeypatch.setattr(soak_module, "_plot", lambda results: None)
    monkeypatch.setattr(soak_module, "verdict", lambda analysis: analysis["error"])
    soak_module.write_results({"tolerance_mib": 0.05, "modes": runs})
    table = (tmp_path / "soak.md").read_text()
    assert "Federation: the bible preset, --set lr=0.002  \n" in table
    assert "Federation: the bible preset, --set lr=0.002; 2 SuperNodes on loopback, every node every round  \n" in table
    assert "tiny ViT" not in table
