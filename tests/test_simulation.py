"""The real simulation path: a SuperLink in simulation mode, `flwr run`, Ray clients; killed, resumed, and
with a Ray worker dying."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fedlora.checkpoint import FINISHED, Checkpoint
from fedlora.config import RunConfig
from fedlora.launch import LAUNCH_MARK, LaunchError, complete_lines, last_error, record_fixed_cost, run_simulation
from fedlora.tracking import read_progress
from fedlora.privacy.events import trust_label
from tests.helpers import leftover_flower_processes

TINY = ["noise-placement=client", "message=adapter", "num-clients=3", "clients-per-round=2", "local-steps=2",
        "train-examples=150", "test-examples=60"]


# with both clients of a round in one message to one node (simulation-nodes)
LEVERS = {"noise-placement": "server", "message": "update", "server-optimizer": "momentum", "clip-quantile": 0.5,
          "clip-count-stddev": 5.0, "simulation-nodes": 1}


SECAGG = {"noise-placement": "secagg", "message": "update", "clients-per-round": 3, "min-replies": 3}  # N_min >= 3


def _assert_a_finished_ray_run(run: Path, lines: list[str], config: RunConfig) -> None:
    """What a finished `fedlora run` leaves and says: its rounds, its fixed cost, its epsilon's label, its outputs,
    and no Flower or Ray process."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rounds = [line for line in lines if line.startswith("round ")]  # a round past 30 s says how it goes, indented
    assert [r["round"] for r in rows] == list(range(1, config.num_rounds + 1)) and len(rounds) == config.num_rounds
    # what the launch spent outside its rounds: said after the last round, and kept in metrics.jsonl's last row
    fixed = rows[-1]["fixed_seconds"]
    assert rows[0]["startup"] and all(r["startup"] is None for r in rows[1:])
    warmed = 0 < config.flower_nodes(2) < config.num_clients  # a node per Ray worker: warmed up before round 1
    assert set(fixed) == {"before first round", "after last round", "process", "imports", "noise calibration",
                          "model", "nodes", *(["workers"] if warmed else [])}
    assert 0 < fixed["after last round"] and sum(rows[0]["startup"].values()) < fixed["before first round"] < 120
    said = [i for i, line in enumerate(lines) if line.startswith("outside the rounds: ")]
    assert len(said) == 1 and said[0] > lines.index(rounds[-1])
    assert lines[said[0]].startswith(f"outside the rounds: {fixed['before first round']:.1f} s before the first")
    label = trust_label("known-sketch", config.noise_placement, "model", seeded=True)
    assert rounds[0].startswith(f"round   1/{config.num_rounds}  accuracy") and f"({label})" in rounds[0]
    assert (rows[0]["clip_norm"] == rows[1]["clip_norm"]) == (config.clip_quantile == 0)  # adaptive clip moves
    assert rows[-1]["epsilon"] <= config.target_epsilon and rows[-1]["replies"] == config.clients_per_round
    assert (run / "adapter" / "adapter_config.json").exists() and (run / "accuracy.png").exists()
    assert json.loads((run / "config.json").read_text())["strategy"] == config.strategy
    progress = read_progress(run)  # replies counted as they came back from the Ray clients
    assert progress["round"] == config.num_rounds and progress["arrived"] == progress["sent"] > 0
    assert list(run.glob("events.out.tfevents.*"))  # TensorBoard's, by default
    assert not leftover_flower_processes()


# the paper's form (noise at each client, whole adapters) runs through `fedlora run` in the kill -9 test below
@pytest.mark.parametrize("levers", [LEVERS, SECAGG], ids=["server-update-adaptive-one-node", "secagg"])
def test_a_ray_simulation_of_two_rounds_with_three_clients(tmp_path, monkeypatch, levers):
    monkeypatch.chdir(tmp_path)  # a relative run directory, as `fedlora run` uses by default
    config = RunConfig.from_mapping({"strategy": "sgmm-ffa-lora", "num-clients": 3, "clients-per-round": 2,
                                     "num-rounds": 2, "local-steps": 2, "train-examples": 150,
                                     "test-examples": 60, **levers})
    lines = []
    rows = run_simulation(config, Path("run"), echo=lines.append)
    assert rows[-1]["fixed_seconds"] and len([line for line in lines if not line.endswith("so far")]) == 3
    _assert_a_finished_ray_run(tmp_path / "run", lines, config)


FAST_PATH_RUNS = {  # issue 65's three: the quickstart's form, a FlexLoRA run, a secure-aggregation run
    "quickstart": {"strategy": "sgmm-ffa-lora"},
    "flexlora": {"strategy": "sgmm-flexlora", "noise-placement": "server", "message": "update"},
    "secagg": {"strategy": "gm-ffa-lora", **SECAGG, "clients-per-round": 4, "min-replies": 4},
}


@pytest.mark.parametrize("overrides", FAST_PATH_RUNS.values(), ids=FAST_PATH_RUNS.keys())
def test_the_fast_path_makes_the_run_a_node_per_client_makes(tmp_path, overrides):
    """`fedlora run`'s speed-ups: a node per Ray worker, several clients a message (not under SecAgg+, where each
    client is a party), the workers warmed up before round 1, the noise calibrated once by the command, each round
    evaluated while the next trains. The run they make is the one a node per client makes (here in process, at the
    Ray workers' one torch thread: the thread count moves float rounding), with the ServerApp calibrating its own
    noise: the same metrics, epsilons and final global state, bit for bit."""
    from benchmarks.common import run_inprocess
    from fedlora.experiment import noise_for

    config = RunConfig.from_mapping({"num-clients": 8, "clients-per-round": 4, "num-rounds": 2, "local-steps": 2,
                                     "train-examples": 160, "test-examples": 60, **overrides})
    plan = noise_for(config)
    fast = run_simulation(config, tmp_path / "fast", echo=lambda line: None, workers=2,
                          noise=(plan.noise_multiplier, plan.probe_noise_multiplier))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        slow = run_inprocess(config, tmp_path / "slow")
    finally:
        torch.set_num_threads(threads)
    keep = ("accuracy", "loss", "epsilon", "epsilon_by_observer", "releases", "replies", "clip_norm", "bytes_up")
    assert [[r[k] for k in keep] for r in fast] == [[r[k] for k in keep] for r in slow]
    fast_state, slow_state = (Checkpoint.load(tmp_path / d).state.message for d in ("fast", "slow"))
    assert fast_state.keys() == slow_state.keys()
    assert all(torch.equal(fast_state[n], slow_state[n]) for n in fast_state)
    nodes = 8 if overrides.get("noise-placement") == "secagg" else 2  # SecAgg+'s parties are one per client
    assert f"flower-nodes = {nodes}\n" in (tmp_path / "fast" / "flower-app" / "pyproject.toml").read_text()
    assert all(r["replies"] == config.clients_per_round for r in fast) and not leftover_flower_processes()


def _fedlora(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fedlora.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **popen)


def test_kill_9_mid_run_then_resume_ends_as_the_uninterrupted_run(tmp_path):
    """The uninterrupted run is the paper's form through `fedlora run`, into a relative directory."""
    settings = [arg for s in [*TINY, "num-rounds=4"] for arg in ("--set", s)]
    reference = _fedlora("run", *settings, "--out", "reference", cwd=tmp_path)
    output, _ = reference.communicate(timeout=400)
    assert reference.returncode == 0, output
    _assert_a_finished_ray_run(tmp_path / "reference", output.splitlines(),
                               RunConfig.from_mapping(dict(s.split("=") for s in [*TINY, "num-rounds=4"])))

    out = tmp_path / "killed"
    victim = _fedlora("run", *settings, "--out", str(out), start_new_session=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.2)
    # `kill -9 PID` of fedlora alone: no clean-up of its own, and its SuperLink, `flwr run` and the ServerApp run in
    # sessions of their own; fedlora.reaper ends them, or they would run the federation to its end
    victim.kill()
    victim.wait()
    deadline = time.time() + 60
    while time.time() < deadline and leftover_flower_processes():
        time.sleep(0.5)
    assert not leftover_flower_processes()
    saved = Checkpoint.load(out)
    assert 2 <= saved.rounds_done < 4 and saved.status != FINISHED

    resumed = _fedlora("run", "--resume", str(out))
    output, _ = resumed.communicate(timeout=400)
    assert resumed.returncode == 0, output
    assert f"resuming after round {saved.rounds_done} of 4, epsilon " in output
    assert ("(known-sketch, noise at the client, seeded noise (a simulation); against observers of the model who were "
            "in no round with the client (sample hidden, no client colluding)) spent") in output
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    expected = [json.loads(line) for line in (tmp_path / "reference" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]  # no round counted twice
    assert [r["epsilon"] for r in rows] == [r["epsilon"] for r in expected]
    assert [r["releases"] for r in rows] == [1, 2, 3, 4]
    final, uninterrupted = Checkpoint.load(out), Checkpoint.load(tmp_path / "reference")
    assert final.status == FINISHED and final.ledger == uninterrupted.ledger
    for name, t in uninterrupted.state.message.items():
        torch.testing.assert_close(final.state.message[name], t, rtol=1e-4, atol=1e-6)
    assert not leftover_flower_processes()


def test_sigterm_stops_every_flower_process_and_leaves_a_run_to_resume(tmp_path):
    """`kill` (SIGTERM) on `fedlora run` goes through its clean-up: no SuperLink, SuperExec or Ray left behind,
    exit status 143, and the checkpoint continues with --resume."""
    settings = [arg for s in [*TINY, "num-rounds=4"] for arg in ("--set", s)]
    out = tmp_path / "stopped"
    victim = _fedlora("run", *settings, "--out", str(out))
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and victim.poll() is None and not (metrics.exists() and metrics.read_text().strip()):
        time.sleep(0.2)
    victim.terminate()
    assert victim.wait(timeout=60) == 143, victim.stdout.read()
    assert not leftover_flower_processes()
    saved = Checkpoint.load(out)
    assert 1 <= saved.rounds_done and saved.status != FINISHED


FAULTY_APP = """
import os
from pathlib import Path

from flwr.clientapp import ClientApp

from fedlora.clients.app import identify as _identify, train as _train

app = ClientApp()
MARK = Path("{mark}")


@app.query()
def identify(msg, context):
    return _identify(msg, context)


@app.train()
def train(msg, context):
    if int(msg.content["config"]["server-round"]) == 2 and not MARK.exists():  # dies once, as an OOM kill would
        MARK.write_text("died")
        os._exit(1)
    return _train(msg, context)
"""


def test_a_dying_ray_worker_does_not_stop_the_run(tmp_path):
    """Flower 1.41 keeps a dead Ray actor in its pool; fedlora restarts the engine from the checkpoint."""
    out = tmp_path / "run"
    (out / "flower-app").mkdir(parents=True)
    (out / "flower-app" / "faulty.py").write_text(FAULTY_APP.replace("{mark}", str(tmp_path / "died")))
    config = RunConfig.from_mapping(dict(s.split("=") for s in [*TINY, "num-rounds=3", "strategy=ffa-lora"]))
    lines = []
    rows = run_simulation(config, out, echo=lines.append, client_app="faulty:app")
    assert (tmp_path / "died").exists()
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert any("restarting the simulation engine" in line for line in lines)
    assert Checkpoint.load(out).status == FINISHED and (out / "adapter" / "adapter_config.json").exists()
    assert not leftover_flower_processes()


FAILING_APP = """
from flwr.clientapp import ClientApp

from fedlora.clients.app import identify as _identify, train as _train

app = ClientApp()


@app.query()
def identify(msg, context):
    return _identify(msg, context)


@app.train()
def train(msg, context):
    if int(msg.content["config"]["partition"]) == 1:  # the client a bad file or a full disk would stop
        raise RuntimeError("the planted failure of partition 1")
    return _train(msg, context)
"""


def test_a_run_whose_client_fails_says_so_in_its_last_line(tmp_path, capsys):
    """A client that fails every round does not end the run (the others carry it), and the run's last line says how
    many replies were lost, in how many rounds, and the first error; its traceback is in flower.log."""
    from fedlora.cli import _done

    out = tmp_path / "run"
    (out / "flower-app").mkdir(parents=True)
    (out / "flower-app" / "failing.py").write_text(FAILING_APP)
    config = RunConfig.from_mapping(dict(s.split("=") for s in [*TINY, "clients-per-round=3", "num-rounds=2", "strategy=ffa-lora"]))
    rows = run_simulation(config, out, echo=lambda line: None, client_app="failing:app")
    assert [(r["replies"], r["failed"]) for r in rows] == [(2, 1), (2, 1)]
    _done(rows, out, config)  # what `fedlora run` prints last
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == (f"clients failed: 2 replies not aggregated in 2 of 2 rounds (2 failed); the first, round 1: the "
                    f"client of partition 1 failed: RuntimeError: the planted failure of partition 1 (tracebacks: "
                    f"{out / 'flower.log'})"), last
    assert "the planted failure of partition 1" in (out / "flower.log").read_text()
    assert not leftover_flower_processes()


def test_the_fixed_cost_is_this_launch_s(tmp_path):
    """A resumed run's rows begin with its earlier launch's: the fixed cost counts from the first round this launch
    ran, with its ServerApp's parts."""
    startup = {"process": 5.0, "noise calibration": 1.0, "model and test data": 0.5, "nodes": 0.0}
    rows = [{"round": 1, "seconds": 20.0, "time": 1020.0, "startup": startup},
            {"round": 2, "seconds": 10.0, "time": 1030.0, "startup": None},
            {"round": 3, "seconds": 25.0, "time": 2045.0, "startup": {**startup, "process": 6.0}},  # resumed at 2000
            {"round": 4, "seconds": 10.0, "time": 2055.0, "startup": None}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    fixed = record_fixed_cost(tmp_path, rows, began=2000.0, ended=2060.0)
    assert fixed == {"before first round": 20.0, "after last round": 5.0, **startup, "process": 6.0}
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["fixed_seconds"] == fixed
    assert record_fixed_cost(tmp_path, rows[:2], began=2000.0) is None  # a launch that ran no round


def test_the_launcher_reads_only_the_rows_the_server_app_has_ended(tmp_path):
    """A row being appended (or torn by a ServerApp killed as it wrote) is not read until its newline is there: the
    launcher would fail on its half of a JSON object."""
    metrics = tmp_path / "metrics.jsonl"
    assert complete_lines(metrics) == []
    metrics.write_text('{"round": 1}\n{"round": 2}\n{"rou')
    assert complete_lines(metrics) == ['{"round": 1}', '{"round": 2}']
    metrics.write_text('{"round": 1}\n{"round": 2}\n{"round": 3}\n')
    assert complete_lines(metrics)[2:] == ['{"round": 3}']


FLOWER_LOGS = {  # the three ways Flower's processes report a failure, as they print them (colours included)
    "traceback": ("\x1b[91mERROR \x1b[0m:     Simulation raised an exception\nTraceback (most recent call last):\n"
                  '  File "crash.py", line 5, in main\nRuntimeError: boom: no test data\n'
                  "\x1b[91mERROR \x1b[0m:     Exit Code: 700\n", "RuntimeError: boom: no test data"),
    "box": ("INFO :      \u251c\u2500\u2500 a strategy line\n\u256d\u2500 Error \u2500\u2500\u256e\n"
            "\u2502 Invalid Flower App configuration:   \u2502\n\u2502 - Unable to load module x \u2502\n"
            "\u2502                   \u2502\n\u2570\u2500\u2500\u2500\u256f\n",
            "Invalid Flower App configuration: - Unable to load module x"),
    "record": ("\x1b[91mERROR \x1b[0m:     ClientApp raised an exception\n\x1b[91mERROR \x1b[0m:     Exit Code: 700\n",
               "ClientApp raised an exception"),
    "none": ("INFO :      [ROUND 1/1]\n", None),
}


@pytest.mark.parametrize("form", FLOWER_LOGS)
def test_the_last_error_of_a_flower_log_is_the_one_that_says_why(tmp_path, form):
    text, expected = FLOWER_LOGS[form]
    (tmp_path / "flower.log").write_text(text)
    assert last_error(tmp_path / "flower.log") == expected
    (tmp_path / "flower.log").write_text(text.replace("boom", "boom" * 100))
    assert len(last_error(tmp_path / "flower.log") or "") <= 200
    # a resumed run's log keeps its earlier launches: only the last launch's part says why this one stopped
    (tmp_path / "flower.log").write_text(FLOWER_LOGS["traceback"][0] + f"{LAUNCH_MARK} 2026-11-28 14:00:00\n" + text)
    assert last_error(tmp_path / "flower.log") == expected


def test_a_run_that_stops_before_its_first_round_says_why_in_its_one_line(tmp_path):
    config = RunConfig.from_mapping(dict(s.split("=") for s in [*TINY, "num-rounds=1"]))
    with pytest.raises(LaunchError, match=r"stopped after 0 of 1 rounds \(Invalid Flower App .*Unable to load module "
                                          r"fedlora\.clients\.missing"):
        run_simulation(config, tmp_path / "run", echo=lambda line: None, client_app="fedlora.clients.missing:app")
    assert not leftover_flower_processes()
