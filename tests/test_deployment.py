"""Real deployments on 127.0.0.1: a SuperLink and SuperNodes as processes, a few rounds, then nothing left."""

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from fedlora.checkpoint import BUDGET_SPENT, ENDED, FINISHED, RUNNING, STATE_FILE, Checkpoint
from fedlora.cli import _done, main
from fedlora.config import DEPLOY_PRESET, RunConfig
from fedlora.credentials import make_credentials
from fedlora.experiment import reconstruct
from fedlora.round_plan import GlobalState
from fedlora.launch import (CONNECTION, DEPLOYMENT_FILE, Flower, RoundProgress, deploy_locally, free_port, node_ledger,
                            supernode_args)
from fedlora.privacy.node_budget import NodeBudget
from tests.helpers import leftover_flower_processes

ROOT = Path(__file__).resolve().parents[1]
FAST = {**DEPLOY_PRESET, "local-steps": 2, "train-examples": 120, "test-examples": 60}


def _kill_supernode_after_round_one(out_dir: Path, partition: int, num_nodes: int) -> threading.Thread:
    """Kills the SuperNode of ``partition`` (and its ClientApp processes) once round 1's metrics are written."""
    def kill():
        metrics = out_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.2)
        for process in psutil.process_iter(["cmdline"]):
            line = " ".join(process.info["cmdline"] or [])
            if "flower-supernode" in line and f"partition-id={partition} num-partitions={num_nodes}" in line:
                for member in [*process.children(recursive=True), process]:
                    member.kill()
    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def test_an_insecure_deployment_goes_on_when_a_supernode_disconnects_and_cleans_up(monkeypatch, tmp_path, capsys):
    """Also the levers in deployment: noise at the server (from the OS), updates with server momentum, adaptive
    clipping with the clip bits of real SuperNodes; the run's last line counts the lost node's reply."""
    config = RunConfig.from_mapping({**FAST, "num-clients": 3, "clients-per-round": 3, "num-rounds": 2,
                                     "min-replies": 2, "reply-timeout": 70, "noise-placement": "server",
                                     "message": "update", "server-optimizer": "momentum", "clip-quantile": 0.5,
                                     "clip-count-stddev": 5.0})
    monkeypatch.setattr(RoundProgress, "PLAIN_EVERY", 10.0)  # 30 s for users: the test waits less
    lines = []
    killer = _kill_supernode_after_round_one(tmp_path, partition=2, num_nodes=3)
    rows = deploy_locally(config, tmp_path, credentials=None, echo=lines.append)
    killer.join(timeout=1)
    round_lines = [line for line in lines if line.startswith("round")]
    assert [r["round"] for r in rows] == [1, 2] and len(round_lines) == 2
    assert [r["replies"] for r in rows] == [3, 2] and "(2 of 3 replies)" in round_lines[1]
    # round 2 waits out its 70 s timeout for the lost node (round 1 takes about 20 s on a quiet 2-core machine, 40 s
    # and more on a slower one beside another test worker, where 35 s lost round 1): after 10 s it says how many
    # replies have arrived
    assert any(re.fullmatch(r"  round   2/2  [0-2] of 3 replies so far", line) for line in lines), lines
    assert all(r["accuracy"] is not None for r in rows)
    assert rows[-1]["releases"] == 2  # the lost node's reply never arrived, but its sampling counts
    assert rows[-1]["threat_model"].startswith("known-sketch, noise at the server;") and rows[-1]["epsilon"] <= config.target_epsilon
    assert len({r["clip_norm"] for r in rows}) == 2  # the clip norm moved
    assert rows[-1]["client_startup_seconds"] > 0  # every message ran in a fresh process
    fixed = rows[-1]["fixed_seconds"]  # the SuperLink's and SuperNodes' start counts before round 1
    assert fixed["before first round"] > fixed["nodes"] >= 0 and lines[-1].startswith("outside the rounds: ")
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    _done(rows, tmp_path, config)  # what `fedlora deploy` prints last
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("clients failed: 1 reply not aggregated in 1 of 2 rounds (") and ", the first, round 2: " \
        not in last and "; the first, round 2: " in last and str(tmp_path / "flower.log") in last, last
    assert not leftover_flower_processes()


def test_the_clientapp_starts_without_torch():
    """A SuperNode starts a process for every message: the ClientApp's module imports Flower alone, so a query or
    a stage of SecAgg+ does not wait for torch, PEFT and the data libraries (the first message that trains
    imports them)."""
    code = ("import sys, fedlora.clients.app; print(sorted(m for m in ('torch', 'peft', 'transformers', 'timm', "
            "'datasets', 'flwr_datasets', 'torchvision') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_tls_deployment_under_secure_aggregation(tmp_path):
    """SecAgg+ between real SuperNodes (each stage a message, Flower's mod in each ClientApp process): the round's
    sum is released, and no file on the server side holds a reply. Each node keeps its own ledger: its one reply,
    its own noise share."""
    config = RunConfig.from_mapping({**FAST, "noise-placement": "secagg", "num-rounds": 1, "num-clients": 3,
                                     "clients-per-round": 3})  # N_min >= 3: two would expose each reply
    credentials = make_credentials(tmp_path / "credentials", nodes=3)
    said = []
    rows = deploy_locally(config, tmp_path / "run", credentials=credentials, echo=said.append, node_budget=1e3)
    assert [r["replies"] for r in rows] == [3] and rows[0]["accuracy"] is not None
    assert rows[0]["threat_model"].startswith("known-sketch, noise in client shares under secure aggregation;")
    assert rows[0]["epsilon"] <= config.target_epsilon and rows[0]["bytes_up"] > 0
    for i in range(3):
        (record,) = NodeBudget(node_ledger(tmp_path / "run", i)).records()
        (share,) = record["release"]
        assert record["round"] == 1 and share["type"] == "SkellamRelease"
        assert share["noise_multiplier"] == pytest.approx(rows[0]["noise_multiplier"] / 3 ** 0.5)
    assert said[-1].startswith("the nodes' own ledgers: epsilon ") and "of each node's budget 1000" in said[-1]
    assert not leftover_flower_processes()


def test_a_language_model_deploys_under_secure_aggregation(tmp_path):
    """The text task on real SuperNodes with TLS and SecAgg+: a tiny GPT-2, each node one file of text; the round's
    sum is released and the server evaluates the test text's perplexity."""
    for i in range(5):
        (tmp_path / "text" / f"{i}.txt").parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "text" / f"{i}.txt").write_text(" ".join(["in the beginning was the word"] * 40))
    config = RunConfig.from_mapping({**DEPLOY_PRESET, "model": "gpt2-tiny", "dataset": f"folder:{tmp_path / 'text'}",
                                     "partitioner": "natural", "head": "frozen", "seq-len": 16, "local-steps": 2,
                                     "noise-placement": "secagg", "num-rounds": 1, "num-clients": 3,
                                     "clients-per-round": 3})
    credentials = make_credentials(tmp_path / "credentials", nodes=3)
    rows = deploy_locally(config, tmp_path / "run", credentials=credentials, echo=lambda line: None)
    assert [r["replies"] for r in rows] == [3] and rows[0]["perplexity"] == pytest.approx(math.exp(rows[0]["loss"]))
    assert rows[0]["threat_model"].startswith("known-sketch, noise in client shares under secure aggregation;")
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").exists()
    assert not leftover_flower_processes()


def test_a_deployment_whose_superlink_and_serverapp_are_killed_resumes_and_finishes(tmp_path):
    """A TLS deployment with SuperNode authentication and the sketch secret held by the nodes; kill -9 of the
    SuperLink and everything under it (the ServerApp) after round 1; `fedlora deploy --resume` completes the rounds
    from the checkpoint, every release counted once (a cut release under OS noise stays counted and is never
    replayed), the secret never on the server side; a node's secret reconstructs the adapter afterwards."""
    out = tmp_path / "run"
    settings = {"threat-model": "'secret-sketch'", "noise-multiplier": 2.3,
                "target-epsilon": 0}  # no budget: the cut release must not end the run
    _deploy_and_kill_the_superlink_after_round_one(out, settings)
    cut = Checkpoint.load(out)
    assert cut.status == RUNNING and cut.rounds_done == 1
    assert main(["deploy", "--resume", str(out)]) == 0
    saved = Checkpoint.load(out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert saved.status == FINISHED and [r["round"] for r in rows] == [1, 2]
    recorded = sum(p["rounds"] for p in saved.ledger["phases"])
    assert saved.releases == recorded == rows[-1]["releases"] == 2 + cut.in_flight
    assert rows[-1]["threat_model"].startswith("secret-sketch, noise at the client;") and all(r["accuracy"] is None for r in rows)
    secret = (out / "credentials" / "supernode-0" / "sketch-secret").read_text().strip()
    server_side = [p for p in out.rglob("*") if p.is_file() and "credentials" not in p.parts]
    assert server_side and not [p for p in server_side if secret.encode() in p.read_bytes()]
    assert not (out / "adapter").exists()  # the server cannot de-sketch: it never had the secret
    accuracy = reconstruct(out, out / "credentials" / "supernode-1" / "sketch-secret", echo=lambda line: None)["accuracy"]
    assert 0 <= accuracy <= 1 and (out / "adapter" / "adapter_config.json").exists()
    assert not leftover_flower_processes()


def _deploy_and_kill_the_superlink_after_round_one(out: Path, settings: dict, *flags: str) -> None:
    """`fedlora deploy` (FAST, with ``settings``) in its own process; kill -9 of its SuperLink and everything under it
    (the ServerApp) once round 1's metrics are written; the launcher must then exit 1 naming `deploy --resume`."""
    settings = {**{k: v for k, v in FAST.items() if DEPLOY_PRESET.get(k) != v}, **settings}
    launcher = subprocess.Popen([str(Path(sys.executable).parent / "fedlora"), "deploy", "--out", str(out), *flags,
                                 *[f"--set={k}={v}" for k, v in settings.items()]],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().strip()):
            assert launcher.poll() is None and time.time() < deadline, launcher.communicate()
            time.sleep(0.2)
        superlink = next(p for p in psutil.Process(launcher.pid).children(recursive=True)
                         if "flower-superlink" in " ".join(p.cmdline()))
        for member in [superlink, *superlink.children(recursive=True)]:
            member.kill()
        _, err = launcher.communicate(timeout=180)
    finally:
        launcher.kill()
    assert launcher.returncode == 1 and f"fedlora deploy --resume {out}" in err, err


def test_a_resumed_deployment_continues_each_nodes_ledger_and_a_node_refuses_past_its_budget(tmp_path, capsys):
    """Node budgets across `fedlora deploy --resume`: each SuperNode's ledger (one file for every run it serves)
    goes on after the SuperLink is killed, counting every reply it made once, the cut round's included; its budget
    holds two replies, so in the resumed run the third is refused by every node and the run stops in one line."""
    from tests.test_node_budget import _gaussian_epsilon

    out, noise = tmp_path / "run", 4.0
    two = _gaussian_epsilon(math.sqrt(2) * 2 / noise, 1e-5)  # replace-one: sensitivity 2 tau, noise z tau a reply
    _deploy_and_kill_the_superlink_after_round_one(out, {"num-rounds": 3, "noise-multiplier": noise,
                                                         "target-epsilon": 0}, "--insecure",
                                                   f"--node-budget={two * 1.01!r}")
    before = [[r["round"] for r in NodeBudget(node_ledger(out, i)).records()] for i in range(2)]
    assert all(rounds[0] == 1 and len(rounds) <= 2 for rounds in before), before  # round 2 may have been cut
    assert main(["deploy", "--resume", str(out)]) == 0
    printed = capsys.readouterr().out
    saved, rows = Checkpoint.load(out), [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for i in range(2):
        ledger = NodeBudget(node_ledger(out, i), two * 1.01)
        records = ledger.records()
        assert [r["round"] for r in records] == [1, 2], records  # round 1 once; round 2 once, cut or not
        assert all(r["release"] == [{"type": "GaussianRelease", "noise_multiplier": noise, "shares": 1}]
                   for r in records)
        assert ledger.spent() == pytest.approx(two, rel=1e-6) and ledger.spent() <= two * 1.01
    # the run stops at the first round no node would reply to: round 3, or round 2 again where its cut replies spent it
    assert [r["round"] for r in rows] in ([1, 2], [1]), rows
    assert saved.status == BUDGET_SPENT and saved.reason.startswith("the nodes' own privacy budgets are spent: round")
    assert "got 0 valid replies" in saved.reason and "Refused by this node's privacy budget" in saved.reason
    assert f"stopped after round {len(rows)}: {saved.reason}" in printed and "the nodes' own ledgers: epsilon" in printed
    assert (out / "adapter" / "adapter_config.json").exists()  # what the budgets allowed is kept
    assert not leftover_flower_processes()


def _finished_run(path: Path, simulated: bool) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**RunConfig.from_mapping(FAST).to_mapping(),
                                                  "noise-multiplier (used)": 1.0, "probe-noise-multiplier (used)": 0.0}))
    if not simulated:
        (path / DEPLOYMENT_FILE).write_text(json.dumps({"credentials": None}))
    return path


@pytest.mark.parametrize("case, message", [
    ("simulation", "was a simulation: continue it with `fedlora run --resume"),
    ("finished", "has ended (finished"),
    ("format", "has format 99; this fedlora reads formats 1, 2, 3"),
    ("damaged", "is damaged (ValueError"),
    ("flags", "drop --set"),
    ("credentials", "The deployment's credentials lack"),
    ("nothing", "holds no config.json"),
])
def test_deploy_resume_bad_input_is_one_line_and_exit_2(capsys, tmp_path, case, message):
    run = _finished_run(tmp_path / "run", simulated=case == "simulation") if case != "nothing" else tmp_path
    if case == "credentials":  # the folder it started with is gone
        (run / DEPLOYMENT_FILE).write_text(json.dumps({"credentials": str(tmp_path / "gone")}))
    if case in ("finished", "format", "damaged", "simulation", "credentials"):
        state = GlobalState({"w": torch.zeros(2)}, 0)
        Checkpoint(state, status=FINISHED if case == "finished" else RUNNING, simulated=case == "simulation").save(run)
    if case in ("format", "damaged"):
        from safetensors.torch import load_file, save_file
        from safetensors import safe_open
        with safe_open(str(run / STATE_FILE), framework="pt") as f:
            metadata = {**f.metadata(), "format": "99" if case == "format" else "abc"}
        save_file(load_file(str(run / STATE_FILE)), str(run / STATE_FILE), metadata=metadata)
    argv = ["deploy", "--resume", str(run)] + (["--set", "num-rounds=4"] if case == "flags" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_run_resume_refuses_a_deployment(capsys, tmp_path):
    run = _finished_run(tmp_path / "run", simulated=False)
    assert main(["run", "--resume", str(run)]) == 2
    assert f"continue it with `fedlora deploy --resume {run}`" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--set", "noise-source=seeded"], "the sample of clients from the OS"),
    (["--set", "threat-model=secret-sketch", "--set", "sketch-secret=run-seed"], "would give the server"),
    (["--set", "threat-model=secret-sketch", "--insecure"], "drop --insecure"),
    (["--insecure", "--credentials", "creds"], "exclude each other"),
    (["--credentials", "missing"], "fedlora credentials DIR --nodes 2"),
    (["--set", "simulation-nodes=1"], "simulation-nodes is for simulations"),
    (["--node-budget", "0"], "must be positive"),
])
def test_deploy_bad_input_is_one_line_and_exit_2_before_anything_starts(capsys, monkeypatch, tmp_path, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main(["deploy", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()


def test_simulations_refuse_a_node_held_secret(capsys, tmp_path):
    argv = ["run", "--out", str(tmp_path / "r"), "--set", "threat-model=secret-sketch", "--set",
            "sketch-secret=node-file", "--set", "noise-placement=client", "--set", "message=adapter"]
    assert main(argv) == 2
    assert "use `fedlora deploy`" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_reconstruct_needs_a_finished_run(capsys, tmp_path):
    assert main(["reconstruct", str(tmp_path), "--sketch-secret-file", str(Path(tmp_path) / "s")]) == 2
    assert "holds no global-state.safetensors" in capsys.readouterr().err


DEPLOY_TUTORIAL = ROOT / "docs" / "tutorials" / "deploy.md"


def _tutorial_block(marker: str) -> str:
    """A bash block of the deployment tutorial, between its markers: the lines a user copies."""
    page = DEPLOY_TUTORIAL.read_text()
    block = page.split(f"<!-- {marker}: begin -->")[1].split(f"<!-- {marker}: end -->")[0]
    return block.split("```bash\n")[1].split("```")[0]


def test_the_tutorials_steps_work_verbatim_and_its_restart_resumes_a_killed_server(tmp_path):
    """Every line of the tutorial's steps 1-6 and of its restart steps, in one shell as a user runs them: the
    SuperLink and the ServerApp are killed (-9) once round 1's release has left, so step 5's `flwr run` fails (the
    one line added to the tutorial's: `|| true` after it), the restart lines bring the SuperLink back, the
    SuperNodes of step 4, never restarted, reconnect and the run ends from its checkpoint, every release in the
    ledger once; step 6 then stops everything."""
    steps = _tutorial_block("deployment steps")
    assert steps.startswith("DEPLOY=$PWD/deploy")
    steps = steps.replace("DEPLOY=$PWD/deploy", f"DEPLOY={tmp_path}", 1)  # the same steps, elsewhere
    setup, rest = steps.split("# 5.")
    run, stop = rest.split("# 6.")
    script = f"{setup}# 5.{run.rstrip()} || true\n{_tutorial_block('restart steps')}# 6.{stop}"
    env = {**os.environ, "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"]}
    metrics, state, log = tmp_path / "run" / "metrics.jsonl", tmp_path / "run" / STATE_FILE, tmp_path / "steps.log"
    try:
        with log.open("w") as out:
            steps = subprocess.Popen(["bash", "-e", "-c", script], cwd=ROOT, env=env, stdout=out,
                                     stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while not (state.is_file() and Checkpoint.load(state.parent).in_flight):  # round 1's release has left
            assert steps.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        superlink = next(p for p in psutil.process_iter(["cmdline"])  # not the shell, whose script names it too
                         if any(Path(a).name == "flower-superlink" for a in (p.info["cmdline"] or [])[:2])
                         and str(tmp_path) in " ".join(p.info["cmdline"]))
        killed = [superlink, *superlink.children(recursive=True)]
        for member in killed:
            member.kill()
        psutil.wait_procs(killed, timeout=30)
        cut = Checkpoint.load(state.parent)  # nothing writes it until the restarted run's ServerApp
        assert steps.wait(timeout=500) == 0, log.read_text()[-4000:]
    finally:  # every process of these steps names $DEPLOY on its command line, or is a child of one that does
        for process in psutil.process_iter(["cmdline"]):
            if str(tmp_path) in " ".join(process.info["cmdline"] or []):
                for member in [*process.children(recursive=True), process]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        member.kill()
    saved = Checkpoint.load(state.parent)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert cut.rounds_done == 0 and cut.releases == 1 and saved.status in ENDED
    recorded = sum(p["rounds"] for p in saved.ledger["phases"])
    assert saved.releases == recorded == rows[-1]["releases"] == 1 + len(rows)
    # every round had both replies: only step 4's SuperNodes exist, so they served the resumed run
    assert [r["round"] for r in rows] == list(range(1, len(rows) + 1)) and all(r["replies"] == 2 for r in rows)
    assert rows[-1]["threat_model"].startswith("known-sketch, noise at the client;") and (tmp_path / "run" / "adapter").is_dir()
    deadline = time.time() + 60  # killed SuperNodes' SuperExecs notice their parent is gone and exit
    while leftover_flower_processes() and time.time() < deadline:
        time.sleep(1)
    assert not leftover_flower_processes()


def test_the_superlink_admits_registered_supernodes_only(tmp_path):
    credentials = make_credentials(tmp_path / "credentials", nodes=2)
    flower = Flower(tmp_path)
    try:
        port = free_port()
        flower.connect(port, credentials.ca_cert)
        superlink = flower.start("superlink", [
            "flower-superlink", "--host", "127.0.0.1", "--port", str(port), "--disable-runtime-dependency-installation",
            "--ssl-ca-certfile", str(credentials.ca_cert), "--ssl-certfile", str(credentials.server_cert),
            "--ssl-keyfile", str(credentials.server_key), "--enable-supernode-auth"])
        flower.wait_for_port(port, superlink, "superlink")
        flower.call("register", ["flwr", "supernode", "register", str(credentials.node_dir(0) / "node.pub"),
                                 CONNECTION])  # node 1 is never registered
        nodes = [flower.start(f"supernode-{i}", supernode_args(i, superlink=f"127.0.0.1:{port}", port=free_port(),
                                                                 num_nodes=2, credentials=credentials, secret=False))
                 for i in range(2)]
        deadline = time.time() + 60
        while nodes[1].poll() is None and time.time() < deadline:
            time.sleep(0.5)
        assert nodes[1].poll() not in (None, 0)  # refused: it gives up with an error
        while True:  # the registered node connects (and stays)
            listed = json.loads(flower.call("list", ["flwr", "supernode", "list", CONNECTION, "--format", "json"]))
            statuses = [n["status"] for n in listed["nodes"]]
            if statuses == ["online"] or time.time() > deadline:
                break
            time.sleep(1)
        assert statuses == ["online"] and nodes[0].poll() is None
    finally:
        flower.stop_all()
    deadline = time.time() + 60  # a stopped SuperNode's SuperExec notices its parent is gone and exits (a CI run
    while leftover_flower_processes() and time.time() < deadline:  # once found it still exiting)
        time.sleep(1)
    assert not leftover_flower_processes()


@pytest.mark.parametrize("folder", ["runs/plain dir", "runs/it's", 'runs/say "hi"'])
def test_a_nodes_ledger_path_reaches_its_node_config_as_written(folder):
    from flwr.common.config import parse_config_args

    ledger = Path(folder) / "privacy-ledger.jsonl"
    args = supernode_args(0, superlink="127.0.0.1:1", port=2, num_nodes=2, credentials=None, secret=False,
                          ledger=ledger, budget=8.0)
    parsed = parse_config_args([args[args.index("--node-config") + 1]])
    assert parsed == {"partition-id": 0, "num-partitions": 2, "privacy-ledger": str(ledger), "privacy-budget": 8.0}
    with pytest.raises(ValueError, match="both kinds of quote"):
        supernode_args(0, superlink="127.0.0.1:1", port=2, num_nodes=2, credentials=None, secret=False,
                       ledger=Path("it's \"both\""), budget=8.0)
