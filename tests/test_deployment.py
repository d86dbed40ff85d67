"""Real deployments on 127.0.0.1: a SuperLink and SuperNodes as processes, a few rounds, then nothing left."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from fedlora.cli import main
from fedlora.config import DEPLOY_PRESET, RunConfig
from fedlora.credentials import make_credentials
from fedlora.experiment import reconstruct
from fedlora.launch import CONNECTION, Flower, deploy_locally, free_port, supernode_args
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


def test_an_insecure_deployment_goes_on_when_a_supernode_disconnects_and_cleans_up(tmp_path):
    """Also the levers in deployment: noise at the server (from the OS), updates with server momentum, adaptive
    clipping with the clip bits of real SuperNodes."""
    config = RunConfig.from_mapping({**FAST, "num-clients": 3, "clients-per-round": 3, "num-rounds": 3,
                                     "min-replies": 2, "reply-timeout": 45, "noise-placement": "server",
                                     "message": "update", "server-optimizer": "momentum", "clip-quantile": 0.5,
                                     "clip-count-stddev": 5.0})
    lines = []
    killer = _kill_supernode_after_round_one(tmp_path, partition=2, num_nodes=3)
    rows = deploy_locally(config, tmp_path, credentials=None, echo=lines.append)
    killer.join(timeout=1)
    assert [r["round"] for r in rows] == [1, 2, 3] and len(lines) == 3
    assert [r["replies"] for r in rows] == [3, 2, 2] and "(2 of 3 replies)" in lines[1]
    assert all(r["accuracy"] is not None for r in rows)
    assert rows[-1]["releases"] == 3  # the lost node's replies never arrived, but its sampling counts
    assert rows[-1]["threat_model"] == "known-sketch, noise at the server" and rows[-1]["epsilon"] <= config.target_epsilon
    assert len({r["clip_norm"] for r in rows}) == 3  # the clip norm moved every round
    assert rows[-1]["client_startup_seconds"] > 0  # every message ran in a fresh process
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    assert not leftover_flower_processes()


def test_a_tls_deployment_with_node_auth_keeps_the_sketch_secret_on_the_nodes(tmp_path):
    credentials = make_credentials(tmp_path / "credentials", nodes=2)
    config = RunConfig.from_mapping({**FAST, "threat-model": "secret-sketch", "sketch-secret": "node-file"})
    out = tmp_path / "run"
    rows = deploy_locally(config, out, credentials=credentials, echo=lambda line: None)
    assert [r["round"] for r in rows] == [1, 2] and all(r["replies"] == 2 for r in rows)
    assert rows[-1]["threat_model"] == "secret-sketch, noise at the client" and rows[-1]["epsilon"] <= config.target_epsilon
    assert all(r["accuracy"] is None for r in rows)  # the server cannot de-sketch: it never had the secret
    secret = (credentials.node_dir(0) / "sketch-secret").read_text().strip()
    server_side = [p for p in out.rglob("*") if p.is_file() and "credentials" not in p.parts]
    assert server_side and not [p for p in server_side if secret.encode() in p.read_bytes()]
    assert not (out / "adapter").exists()
    accuracy, _ = reconstruct(out, credentials.node_dir(1) / "sketch-secret", echo=lambda line: None)
    assert 0 <= accuracy <= 1 and (out / "adapter" / "adapter_config.json").exists()
    assert not leftover_flower_processes()


def test_a_tls_deployment_under_secure_aggregation(tmp_path):
    """SecAgg+ between real SuperNodes (each stage a message, Flower's mod in each ClientApp process): the round's
    sum is released, and no file on the server side holds a reply."""
    config = RunConfig.from_mapping({**FAST, "noise-placement": "secagg", "num-rounds": 1})  # min-replies: 2
    credentials = make_credentials(tmp_path / "credentials", nodes=2)
    rows = deploy_locally(config, tmp_path / "run", credentials=credentials, echo=lambda line: None)
    assert [r["replies"] for r in rows] == [2] and rows[0]["accuracy"] is not None
    assert rows[0]["threat_model"] == "known-sketch, noise in client shares under secure aggregation"
    assert rows[0]["epsilon"] <= config.target_epsilon and rows[0]["bytes_up"] > 0
    assert not leftover_flower_processes()


@pytest.mark.parametrize("argv, message", [
    (["--set", "noise-source=seeded"], "noise from the OS"),
    (["--set", "threat-model=secret-sketch", "--set", "sketch-secret=run-seed"], "would give the server"),
    (["--set", "threat-model=secret-sketch", "--insecure"], "drop --insecure"),
    (["--insecure", "--credentials", "creds"], "exclude each other"),
    (["--credentials", "missing"], "fedlora credentials DIR --nodes 2"),
    (["--set", "simulation-nodes=1"], "simulation-nodes is for simulations"),
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


def test_the_readme_deployment_steps_work_verbatim(tmp_path):
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- deployment steps: begin -->")[1].split("<!-- deployment steps: end -->")[0]
    script = block.split("```bash\n")[1].split("```")[0]
    assert script.startswith("DEPLOY=$PWD/deploy")
    script = script.replace("DEPLOY=$PWD/deploy", f"DEPLOY={tmp_path}", 1)  # the same steps, elsewhere
    env = {**os.environ, "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"]}
    try:
        result = subprocess.run(["bash", "-e", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=400)
    finally:  # a failed step leaves the background processes to us; each names $DEPLOY on its command line
        subprocess.run(["pkill", "-f", str(tmp_path)])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and all(r["replies"] == 2 for r in rows)
    assert rows[-1]["threat_model"] == "known-sketch, noise at the client" and (tmp_path / "run" / "adapter").is_dir()
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
    assert not leftover_flower_processes()
