"""`fedlora run`: a simulated federation on Flower's supported path, a SuperLink in simulation mode.

It starts its own ``flower-superlink --simulation`` on a free local port (no runtime dependency
installation: the apps import fedlora from this environment), submits a small generated Flower app
with ``flwr run``, prints one line per round from the run's metrics.jsonl as they arrive, and
stops the SuperLink (with the SuperExec and Ray it started) however the run ends.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from fedlora.config import RunConfig
from fedlora.experiment import OUT_DIR_KEY, format_progress

CONNECTION = "fedlora-local"


class SimulationError(RuntimeError):
    """The federation did not finish; the message names the log to read."""


def _toml_value(value) -> str:
    return json.dumps(value) if isinstance(value, str) else repr(value)


def write_app(config: RunConfig, out_dir: Path) -> Path:
    """A minimal Flower app whose components are fedlora's and whose run config is ``config``."""
    app_dir = out_dir / "flower-app"
    app_dir.mkdir(parents=True, exist_ok=True)
    values = {**config.to_mapping(), OUT_DIR_KEY: str(out_dir.resolve())}
    (app_dir / "pyproject.toml").write_text("\n".join([
        "[build-system]", 'requires = ["setuptools>=69"]', 'build-backend = "setuptools.build_meta"', "",
        "[project]", 'name = "fedlora-run"', 'version = "0.1.0"', 'description = "A fedlora simulation"',
        'license = "Apache-2.0"', "", "[tool.flwr.app]", 'publisher = "fedlora"', "",
        "[tool.flwr.app.components]", 'serverapp = "strategies.server_app:app"', 'clientapp = "clients.app:app"',
        "", "[tool.flwr.app.config]", *[f"{k} = {_toml_value(v)}" for k, v in values.items()], ""]))
    return app_dir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, process: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise SimulationError(f"The SuperLink exited at start-up; see {log}.")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.3)
    raise SimulationError(f"The SuperLink did not open port {port} within {timeout:.0f} s; see {log}.")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)  # the SuperExec and Ray follow their parent down
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def run_simulation(config: RunConfig, out_dir: Path, *, echo=print, start_timeout: float = 60.0) -> list[dict]:
    """Runs the federation; returns the per-round metrics. Raises SimulationError if it does not finish."""
    out_dir = Path(out_dir).resolve()  # the SuperLink and flwr run work inside it: relative paths would resolve twice
    out_dir.mkdir(parents=True, exist_ok=True)
    app_dir = write_app(config, out_dir)
    home = out_dir / "flwr-home"
    home.mkdir(exist_ok=True)
    port = _free_port()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
                                      f'address = "127.0.0.1:{port}"\ninsecure = true\n')
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "FLWR_HOME": str(home), "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
           "PYTHONUNBUFFERED": "1"}
    flwr = shutil.which("flwr", path=env["PATH"])
    superlink_bin = shutil.which("flower-superlink", path=env["PATH"])
    metrics_path = out_dir / "metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    superlink_log, flower_log = out_dir / "superlink.log", out_dir / "flower.log"
    with superlink_log.open("w") as slog, flower_log.open("w") as flog:
        superlink = subprocess.Popen(
            [superlink_bin, "--simulation", "--insecure", "--host", "127.0.0.1", "--port", str(port),
             "--disable-runtime-dependency-installation"], stdout=slog, stderr=subprocess.STDOUT, env=env,
            cwd=out_dir, start_new_session=True)
        try:
            _wait_for_port(port, superlink, start_timeout, superlink_log)
            federation = (f"num-supernodes={config.num_clients} client-resources-num-cpus={config.client_cpus} "
                          f"client-resources-num-gpus={config.client_gpus}")
            runner = subprocess.Popen([flwr, "run", str(app_dir), CONNECTION, "--federation-config", federation,
                                       "--stream"], stdout=flog, stderr=subprocess.STDOUT, env=env, cwd=out_dir)
            rows: list[dict] = []
            while True:
                finished = runner.poll() is not None
                if metrics_path.exists():
                    lines = metrics_path.read_text().splitlines()
                    for line in lines[len(rows):]:
                        if line.strip():
                            rows.append(json.loads(line))
                            echo(format_progress(rows[-1], config))
                if finished:
                    break
                time.sleep(0.5)
        finally:
            _stop(superlink)
    if len(rows) < config.num_rounds or not (out_dir / "adapter").exists():
        raise SimulationError(f"The federation stopped after {len(rows)} of {config.num_rounds} rounds; "
                              f"see {flower_log}.")
    return rows
