"""Flower processes for a run: a SuperLink in simulation mode, or a SuperLink and SuperNodes on this machine.

``run_simulation`` (`fedlora run`) starts its own ``flower-superlink --simulation`` on a free local
port; ``deploy_locally`` (`fedlora deploy`) starts a ``flower-superlink`` and one ``flower-supernode``
per client, with TLS and SuperNode authentication when given credentials. Both submit a small
generated Flower app with ``flwr run --stream``, print one line per round from the run's metrics.jsonl
as they arrive, and stop every process they started however the run ends. Neither installs anything at
run time: the apps import fedlora from this environment.

A simulation whose Ray worker died is restarted from its checkpoint: Flower 1.41's Ray backend keeps
a dead actor in its pool, so every later message sent to it would fail too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import psutil

from fedlora.checkpoint import ENDED, RESTART, STATE_FILE, Checkpoint
from fedlora.cluster import LOCAL, RAY_ADDRESS_ENV, free_port, wait_for_live_nodes
from fedlora.config import RunConfig
from fedlora.run_keys import NODES_KEY, NOISE_KEY, OUT_DIR_KEY, RESUME_KEY, SIMULATION_KEY
from fedlora.credentials import Credentials
from fedlora.experiment import format_progress
from fedlora.reaper import end_trees
from fedlora.tracking import clear_progress, read_progress

CONNECTION = "fedlora-local"
DEPLOYMENT_FILE = "deployment.json"  # in a deployment's run directory: the credentials it runs with
ENGINE_RESTARTS = 3  # restarts of a simulation that lost a Ray worker, per launch
LAUNCH_MARK = "=== fedlora launch"  # starts each launch's part of a process's log


class LaunchError(RuntimeError):
    """The federation did not finish; the message names the log to read."""


def _make_run_dir(out_dir: Path) -> None:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # the CLI checked what it could (fedlora.cli._output_dir); /proc lets root pass its check
        raise LaunchError(f"The run directory '{out_dir}' cannot be made: {error.strerror or error}.") from None


def _toml_value(value) -> str:
    return json.dumps(value) if isinstance(value, (str, bool)) else repr(value)


def write_app(config: RunConfig, out_dir: Path, *, simulation: bool, resume: bool = False,
              client_app: str = "fedlora.clients.app:app", server_app: str = "fedlora.strategies.server_app:app",
              nodes: int | None = None, noise: tuple[float, float] | None = None) -> Path:
    """A minimal Flower app whose components are fedlora's (or the given ones: fault injection, Flower's own DP in
    benchmarks/flower_peer.py) and whose run config is ``config``; with ``resume`` the ServerApp continues from the
    run directory's checkpoint. ``nodes``: the Flower nodes started for it; ``noise``: the noise multipliers the
    command calibrated already (the ServerApp accounts what it uses, so it need not calibrate them again)."""
    app_dir = out_dir / "flower-app"
    app_dir.mkdir(parents=True, exist_ok=True)
    values = {**config.to_mapping(), OUT_DIR_KEY: str(out_dir.resolve()), RESUME_KEY: resume,
              SIMULATION_KEY: simulation}
    if nodes is not None:
        values[NODES_KEY] = nodes
    if noise is not None:
        values[NOISE_KEY] = ",".join(map(repr, noise))  # repr: the floats exactly
    (app_dir / "pyproject.toml").write_text("\n".join([
        "[build-system]", 'requires = ["setuptools>=69"]', 'build-backend = "setuptools.build_meta"', "",
        "[project]", 'name = "fedlora-run"', 'version = "0.1.0"', 'description = "A fedlora run"',
        'license = "Apache-2.0"', "", "[tool.flwr.app]", 'publisher = "fedlora"', "",
        "[tool.flwr.app.components]", f'serverapp = "{server_app}"', f'clientapp = "{client_app}"',
        "", "[tool.flwr.app.config]", *[f"{k} = {_toml_value(v)}" for k, v in values.items()], ""]))
    return app_dir


class Flower:
    """The processes of one run, with their logs in the run directory; ``stop_all`` ends every one."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.home = out_dir / "flwr-home"
        self.home.mkdir(parents=True, exist_ok=True)
        bin_dir = str(Path(sys.executable).parent)
        self.env = {**os.environ, "FLWR_HOME": str(self.home), "PYTHONUNBUFFERED": "1",
                    "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
        self.processes: list[subprocess.Popen] = []
        # ends them if we are killed before stop_all (each runs in a session of its own and would outlive us)
        self.reaper = subprocess.Popen([sys.executable, "-m", "fedlora.reaper"], stdin=subprocess.PIPE,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                                       start_new_session=True)

    def which(self, program: str) -> str:
        return shutil.which(program, path=self.env["PATH"]) or program

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """A process in its own session (a Ctrl-C to us does not reach it first), logging to <name>.log: appended
        to, after a line that marks this launch, so that a resumed run keeps its earlier launches' logs."""
        with (self.out_dir / f"{name}.log").open("a") as log:
            log.write(f"{LAUNCH_MARK} {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            log.flush()
            process = subprocess.Popen([self.which(args[0]), *args[1:]], stdout=log, stderr=subprocess.STDOUT,
                                       env={**self.env, **(env or {})}, cwd=self.out_dir, start_new_session=True)
        self.processes.append(process)
        with contextlib.suppress(psutil.NoSuchProcess):  # one that is gone already needs no reaping
            self.reaper.stdin.write(f"{process.pid} {psutil.Process(process.pid).create_time()!r}\n")
            self.reaper.stdin.flush()
        return process

    def call(self, name: str, args: list[str], *, timeout: float = 60) -> str:
        """A short flwr CLI command; raises LaunchError (naming its output) if it fails."""
        result = subprocess.run([self.which(args[0]), *args[1:]], capture_output=True, text=True, env=self.env,
                                cwd=self.out_dir, timeout=timeout)
        if result.returncode != 0:
            (self.out_dir / f"{name}.log").write_text(result.stdout + result.stderr)
            raise LaunchError(f"`{' '.join(args[:3])}` failed; see {self.out_dir / f'{name}.log'}.")
        return result.stdout

    def wait_for_port(self, port: int, process: subprocess.Popen, name: str, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if process.poll() is not None:
                raise LaunchError(f"The {name} exited at start-up; see {self.out_dir / f'{name}.log'}.")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return
            except OSError:
                time.sleep(0.3)
        raise LaunchError(f"The {name} did not open port {port} within {timeout:.0f} s; see "
                          f"{self.out_dir / f'{name}.log'}.")

    def connect(self, port: int, root_certificates: Path | None) -> None:
        """The flwr CLI's connection to the SuperLink (FLWR_HOME/config.toml)."""
        security = (f'root-certificates = "{root_certificates.resolve()}"' if root_certificates
                    else "insecure = true")
        (self.home / "config.toml").write_text(f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
                                               f'address = "127.0.0.1:{port}"\n{security}\n')

    def stop_all(self) -> None:
        """Stops every process started, and every process they started (some leave their parent's session)."""
        roots = []
        for process in reversed(self.processes):  # SuperNodes first, the SuperLink last
            with contextlib.suppress(psutil.NoSuchProcess):
                roots.append(psutil.Process(process.pid))
        end_trees(roots)
        for process in self.processes:
            process.wait()  # reaps our own children
        self.reaper.stdin.close()  # it finds nothing left and exits
        self.reaper.wait(timeout=60)

    def follow(self, app_dir: Path, config: RunConfig, echo, federation_config: str | None = None, *,
               resume: bool = False) -> Checkpoint | None:
        """Submits the app and prints each new round's line as metrics.jsonl grows; returns the checkpoint the
        run left (None if it left none)."""
        metrics_path = self.out_dir / "metrics.jsonl"
        state_path = self.out_dir / STATE_FILE
        rows = Checkpoint.load(self.out_dir).rows if resume and state_path.is_file() else []
        if not resume:
            state_path.unlink(missing_ok=True)
        # a resumed run starts from its checkpoint's rows: a row written after the checkpoint is not a round done
        metrics_path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        done = len(rows)
        args = ["flwr", "run", str(app_dir), CONNECTION, "--stream"]
        if federation_config:
            args += ["--federation-config", federation_config]
        clear_progress(self.out_dir)  # an interrupted round's count is not this run's
        runner = self.start("flower", args)
        in_round = RoundProgress(self.out_dir, config.num_rounds, echo)
        try:
            while True:
                finished = runner.poll() is not None
                for line in complete_lines(metrics_path)[done:]:
                    if line.strip():
                        in_round.clear()
                        echo(format_progress(json.loads(line), config))
                        done += 1
                if finished:
                    break
                in_round.show(done)
                time.sleep(0.5)
        finally:  # however it ends (Ctrl-C included), the terminal's line is left clean
            in_round.clear()
        return Checkpoint.load(self.out_dir) if state_path.is_file() else None


def complete_lines(path: Path) -> list[str]:
    """The lines of a file another process appends to, less a last one not yet ended by its newline (being
    written, or torn by a ServerApp killed as it wrote: the checkpoint's rows are the run's)."""
    text = path.read_text() if path.exists() else ""
    return text[:text.rfind("\n") + 1].splitlines()


class RoundProgress:
    """The replies of the round under way, from the ServerApp's progress file: updated in place on a terminal;
    elsewhere (a log, a pipe) a plain line every PLAIN_EVERY seconds of a round that lasts longer."""

    PLAIN_EVERY = 30.0

    def __init__(self, out_dir: Path, num_rounds: int, echo, *, live: bool | None = None):
        self.out_dir, self.num_rounds, self.echo = out_dir, num_rounds, echo
        self.live = echo is print and sys.stdout.isatty() if live is None else live
        self.shown = ""  # the text on the terminal's current line
        self.round, self.printed = 0, 0.0  # the round shown, and when its last plain line was printed

    def text(self, rounds_done: int) -> str | None:
        progress = read_progress(self.out_dir)
        if not progress or progress["round"] <= rounds_done:  # none yet, or a round whose line is out
            return None
        return f"round {progress['round']:>3}/{self.num_rounds}  {progress['arrived']} of {progress['sent']} replies"

    def show(self, rounds_done: int) -> None:
        text = self.text(rounds_done)
        if text is None:
            return
        now = time.monotonic()
        if rounds_done + 1 != self.round:
            self.round, self.printed = rounds_done + 1, now
        if self.live and text != self.shown:
            sys.stdout.write("\r\033[K" + text)
            sys.stdout.flush()
            self.shown = text
        elif not self.live and now - self.printed >= self.PLAIN_EVERY:
            self.echo(f"  {text} so far")
            self.printed = now

    def clear(self) -> None:
        if self.shown:
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()
            self.shown = ""


def round_start(row: dict) -> float:
    """When a metrics row's round started (rows before the "started" field ended with their evaluation)."""
    return row["started"] if row.get("started") is not None else row["time"] - row["seconds"]


def record_fixed_cost(out_dir: Path, rows: list[dict], began: float, ended: float | None = None) -> dict | None:
    """What the launch spent outside its rounds, added to metrics.jsonl's last row as "fixed_seconds": from ``began``
    (the command's start) to the start of the first round it ran, and from the last round's row to ``ended``
    (default: now), with the ServerApp's parts of the first ("startup": its process, imports, noise calibration,
    model, the workers' warm-up, the nodes). None when the launch ran no round."""
    # the first round this launch ran (a resumed run's rows start with its earlier launches')
    first = next((row for row in rows if row.get("startup") and round_start(row) >= began), None)
    if first is None:
        return None
    ended = time.time() if ended is None else ended
    fixed = {"before first round": round_start(first) - began,
             "after last round": ended - rows[-1]["time"], **first["startup"]}
    rows[-1]["fixed_seconds"] = fixed
    path = Path(out_dir) / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("".join(line + "\n" for line in lines[:-1]) + json.dumps(rows[-1]) + "\n")
    return fixed


def describe_fixed_cost(fixed: dict, last_round: int) -> str:
    """One line: the seconds before the first round (by part) and after the last."""
    parts = ", ".join(f"{name} {seconds:.1f}" for name, seconds in fixed.items()
                      if name not in ("before first round", "after last round"))
    return (f"outside the rounds: {fixed['before first round']:.1f} s before the first (the ServerApp's {parts}), "
            f"{fixed['after last round']:.1f} s after round {last_round}")


def _outcome(saved: Checkpoint | None, config: RunConfig, out_dir: Path) -> list[dict]:
    """The rows of a run that ended (finished, or stopped by its budget); else a LaunchError saying why."""
    if saved is not None and saved.status in ENDED:
        return saved.rows
    done = saved.rounds_done if saved else 0
    why = f" ({saved.reason})" if saved and saved.reason else ""
    hint = f"; resume it with `fedlora {'run' if saved.simulated else 'deploy'} --resume {out_dir}`" if saved else ""
    if not why and (error := last_error(out_dir / "flower.log")):
        why = f" ({error})"
    raise LaunchError(f"The federation stopped after {done} of {config.num_rounds} rounds{why}; see "
                      f"{out_dir / 'flower.log'}{hint}.")


ANSI = re.compile(r"\x1b\[[0-9;]*m")

EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception|Interrupt|Exit): ")  # a traceback's last line


def last_error(log: Path, limit: int = 200) -> str | None:
    """Why a run that left no checkpoint stopped, from its Flower log, in a line of at most ``limit`` characters:
    the last exception raised, else the last error box of Flower's CLI, else its last ERROR record."""
    if not log.is_file():
        return None
    lines = [ANSI.sub("", line).strip() for line in log.read_text(errors="replace").splitlines()]
    lines = lines[max((i for i, line in enumerate(lines) if line.startswith(LAUNCH_MARK)), default=-1) + 1:]
    box, found = None, None  # the error box being read, and the last one read
    for line in lines:
        if line.startswith("╭─ Error"):
            box = []
        elif line.startswith("│") and box is not None:
            box.append(line.strip("│ "))
        elif line.startswith("╰") and box is not None:
            found, box = " ".join(part for part in box if part), None
    candidates = ([line for line in lines if EXCEPTION_LINE.match(line)] or ([found] if found else [])
                  or [line.split(":", 1)[1].strip() for line in lines
                      if line.startswith("ERROR") and ":" in line and "Exit Code" not in line])
    if not candidates:
        return None
    error = " ".join(candidates[-1].split())
    return error if len(error) <= limit else error[:limit - 3] + "..."


@contextmanager
def _flower(out_dir: Path):
    flower = Flower(out_dir)
    try:
        yield flower
    finally:
        flower.stop_all()


def run_simulation(config: RunConfig, out_dir: Path, *, echo=print, start_timeout: float = 60.0, resume: bool = False,
                   client_app: str = "fedlora.clients.app:app", ray_address: str | None = None,
                   began: float | None = None, workers: int | None = None,
                   noise: tuple[float, float] | None = None) -> list[dict]:
    """Runs (or, with ``resume``, continues) the federation on Ray: a Ray of its own on this machine, or with
    ``ray_address`` the cluster there (fedlora.cluster); returns the per-round metrics. A run that lost a Ray
    worker (or a cluster node) is restarted from its checkpoint. Raises LaunchError if it does not end.
    ``began``: when the wait for it began, for its fixed cost (default: now; `fedlora run`: its process's start).
    ``workers``: the clients Ray trains at once, for simulation-nodes = 0 (``RunConfig.flower_nodes``; None: one node
    per client). ``noise``: the noise multipliers calibrated for ``config`` already (see ``write_app``)."""
    began = time.time() if began is None else began
    nodes = config.flower_nodes(workers)
    out_dir = Path(out_dir).resolve()  # the SuperLink and flwr run work inside it: relative paths would resolve twice
    _make_run_dir(out_dir)
    for restart in range(ENGINE_RESTARTS + 1):
        app_dir = write_app(config, out_dir, simulation=True, resume=resume, client_app=client_app, nodes=nodes,
                            noise=noise)
        with _flower(out_dir) as flower:
            port = free_port()
            flower.connect(port, None)
            # Flower's Ray backend calls ray.init() in a process the SuperLink starts: the address goes by the
            # environment, and so does Ray's prestart of a worker per CPU, which Flower's actors never use (each
            # gets a worker of its own: on 2 CPUs, 2 idle workers started, each importing Ray, then ended)
            superlink = flower.start("superlink", [
                "flower-superlink", "--simulation", "--insecure", "--host", "127.0.0.1", "--port", str(port),
                "--disable-runtime-dependency-installation"],
                env={RAY_ADDRESS_ENV: ray_address or LOCAL, "RAY_enable_worker_prestart": "0"})
            flower.wait_for_port(port, superlink, "superlink", start_timeout)
            saved = flower.follow(app_dir, config, echo, federation_config=(
                f"num-supernodes={nodes} client-resources-num-cpus={config.client_cpus} "
                f"client-resources-num-gpus={config.client_gpus}"), resume=resume)
        if saved is None or saved.status != RESTART or restart == ENGINE_RESTARTS:
            break
        echo(f"A simulation worker died: restarting the simulation engine, resuming after round {saved.rounds_done}.")
        if ray_address:  # a lost node stays listed for a while: Flower would start workers on it again
            echo(f"  on the Ray cluster's {wait_for_live_nodes(ray_address)} live nodes")
        resume = True
    rows = _outcome(saved, config, out_dir)
    if fixed := record_fixed_cost(out_dir, rows, began):
        echo(describe_fixed_cost(fixed, rows[-1]["round"]))
    return rows


def supernode_args(index: int, *, superlink: str, port: int, num_nodes: int, credentials: Credentials | None,
                   secret: bool, ledger: Path | None = None, budget: float | None = None) -> list[str]:
    """The `flower-supernode` command of node ``index``: TLS and authentication with its own credentials; with
    ``ledger``, the node records its replies there and refuses those past ``budget`` (fedlora.privacy.node_budget)."""
    node_config = f"partition-id={index} num-partitions={num_nodes}"
    if ledger is not None:
        node_config += f" privacy-ledger={_quoted(ledger)}" + (f" privacy-budget={budget!r}" if budget is not None
                                                               else "")
    args = ["flower-supernode", "--superlink", superlink, "--host", "127.0.0.1", "--port", str(port)]
    if credentials is None:
        return [*args, "--insecure", "--node-config", node_config]
    folder = credentials.node_dir(index).resolve()
    if secret:
        node_config += f" sketch-secret-file={_quoted(folder / 'sketch-secret')}"
    return [*args, "--root-certificates", str(folder / "ca.crt"), "--auth-supernode-private-key",
            str(folder / "node.key"), "--node-config", node_config]


def deployment_credentials(out_dir: Path, config: RunConfig) -> Credentials | None:
    """The credentials a deployment ran with (None: insecure), to resume it with the same."""
    path = Path(out_dir) / DEPLOYMENT_FILE
    if not path.is_file():
        raise ValueError(f"'{out_dir}' holds no {DEPLOYMENT_FILE}: is it a deployment's run directory?")
    root = json.loads(path.read_text())["credentials"]
    if root is None:
        return None
    credentials = Credentials(Path(root), config.num_clients)
    if missing := credentials.missing(secret=config.sketch_secret == "node-file"):
        raise ValueError(f"The deployment's credentials lack {missing[0]}: a resumed deployment needs the ones it "
                         "started with.")
    return credentials


def _quoted(path: Path) -> str:
    """``path`` as a --node-config value: Flower reads a quoted value up to the next quote of its kind, as TOML."""
    text = str(path)
    if "'" not in text:
        return f"'{text}'"  # a TOML literal string: no escapes
    if '"' not in text and "\\" not in text:
        return f'"{text}"'
    raise ValueError(f"'{text}' holds both kinds of quote: --node-config cannot pass it; choose another --out.")


def node_ledger(out_dir: Path, index: int) -> Path:
    """Where node ``index`` of a local deployment keeps its privacy ledger."""
    return Path(out_dir) / "nodes" / f"node-{index}" / "privacy-ledger.jsonl"


def describe_node_ledgers(out_dir: Path, num_nodes: int, budget: float) -> str:
    """What the nodes of a local deployment spent by their own ledgers, in one line."""
    from fedlora.privacy.node_budget import NodeBudget

    try:
        spent = [NodeBudget(node_ledger(out_dir, i), budget).spent() for i in range(num_nodes)]
    except ValueError as error:  # a damaged ledger: the run's outcome stands, the ledger is named
        return f"the nodes' own ledgers: {error}"
    return (f"the nodes' own ledgers: epsilon {min(spent):.3f} to {max(spent):.3f} against the server, of each "
            f"node's budget {budget:g} (only the noise each node added; {Path(out_dir) / 'nodes'})")


def deploy_locally(config: RunConfig, out_dir: Path, *, credentials: Credentials | None, echo=print,
                   start_timeout: float = 60.0, resume: bool = False, began: float | None = None,
                   node_budget: float | None = None, noise: tuple[float, float] | None = None) -> list[dict]:
    """A SuperLink and ``num-clients`` SuperNodes on 127.0.0.1, one run (with ``resume``: the rest of the run in
    ``out_dir``, from its checkpoint), then every process stopped.

    With ``credentials`` the SuperLink serves TLS with them and admits only the registered SuperNodes;
    without, everything runs in Flower's insecure mode. With ``node_budget`` every node keeps a privacy ledger
    (``node_ledger``) and refuses replies past that epsilon against the server. ``out_dir`` records both, for a
    resume. ``began`` and ``noise``: as for run_simulation (the SuperNodes' start counts before the first round).
    """
    began = time.time() if began is None else began
    out_dir = Path(out_dir).resolve()
    _make_run_dir(out_dir)
    if not resume:
        (out_dir / DEPLOYMENT_FILE).write_text(json.dumps(
            {"credentials": str(credentials.root.resolve()) if credentials else None, "node_budget": node_budget})
            + "\n")
    else:
        node_budget = json.loads((out_dir / DEPLOYMENT_FILE).read_text()).get("node_budget")
    app_dir = write_app(config, out_dir, simulation=False, resume=resume, noise=noise)
    with _flower(out_dir) as flower:
        port = free_port()
        flower.connect(port, credentials.ca_cert if credentials else None)
        security = (["--ssl-ca-certfile", str(credentials.ca_cert), "--ssl-certfile", str(credentials.server_cert),
                     "--ssl-keyfile", str(credentials.server_key), "--enable-supernode-auth"] if credentials
                    else ["--insecure"])
        superlink = flower.start("superlink", ["flower-superlink", "--host", "127.0.0.1", "--port", str(port),
                                               "--disable-runtime-dependency-installation", *security])
        flower.wait_for_port(port, superlink, "superlink", start_timeout)
        secret = config.sketch_secret == "node-file"
        # The nodes share this machine's cores: more torch threads than cores slow training about 15-fold.
        threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // config.num_clients))}
        for i in range(config.num_clients):
            if credentials:
                flower.call(f"register-{i}", ["flwr", "supernode", "register",
                                              str(credentials.node_dir(i) / "node.pub"), CONNECTION])
            node_port = free_port()
            node = flower.start(f"supernode-{i}", supernode_args(
                i, superlink=f"127.0.0.1:{port}", port=node_port, num_nodes=config.num_clients,
                credentials=credentials, secret=secret, budget=node_budget,
                ledger=node_ledger(out_dir, i) if node_budget is not None else None), env=threads)
            flower.wait_for_port(node_port, node, f"supernode-{i}", start_timeout)
        saved = flower.follow(app_dir, config, echo, resume=resume)
    rows = _outcome(saved, config, out_dir)
    if fixed := record_fixed_cost(out_dir, rows, began):
        echo(describe_fixed_cost(fixed, rows[-1]["round"]))
    if node_budget is not None:
        echo(describe_node_ledgers(out_dir, config.num_clients, node_budget))
    return rows
