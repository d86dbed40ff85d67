"""Simulations on a Ray cluster: which Ray a run uses, a check of every node before the run, and a cluster of
several Ray nodes on this machine (to try the steps, and for the tests).

`fedlora run --ray-address HOST:PORT` (or the standard ``RAY_ADDRESS``) runs the simulation's clients on the
cluster whose head listens there: the address reaches Flower's Ray backend through the environment of the
processes fedlora starts (Flower's federation config has no address), and Ray places each client's worker on
any node with its CPUs and GPUs (client-cpus, client-gpus). The ServerApp, its aggregation, accountant and
checkpoints stay on the machine that runs `fedlora run`, which must be a node of the cluster (a Ray driver
attaches to its own node). Without an address a run starts its own Ray, even if a cluster runs on this machine.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import psutil

from fedlora.config import RunConfig
from fedlora.reaper import end_trees

RAY_ADDRESS_ENV = "RAY_ADDRESS"
LOCAL = "local"  # Ray's own word for "start a new instance here", whatever else runs on this machine
PROBE_TIMEOUT = 180.0  # seconds for every node to import fedlora and read the data


@dataclass(frozen=True)
class ClusterNode:
    node_id: str
    ip: str
    cpus: float
    gpus: float

    def clients(self, config: RunConfig) -> int:
        """Clients this node trains at once: the workers its resources hold at client-cpus and client-gpus."""
        slots = math.floor(self.cpus / config.client_cpus + 1e-9)
        if config.client_gpus > 0:
            slots = min(slots, math.floor(self.gpus / config.client_gpus + 1e-9))
        return slots

    def __str__(self) -> str:
        return f"{self.ip} ({self.node_id[:8]})"


def check_local_resources(config: RunConfig) -> int:
    """The clients Ray started on this machine trains at once (its workers at client-cpus and client-gpus); a
    ValueError, one line, if it cannot hold one: Ray would have no worker, and the run would fail after its start."""
    gpus = 0
    if config.client_gpus > 0:
        import torch

        gpus = torch.cuda.device_count()
    here = ClusterNode(LOCAL, "127.0.0.1", float(os.cpu_count() or 1), float(gpus))
    if here.clients(config) < 1:
        lower = "set client-gpus = 0" if config.client_gpus > 0 and not gpus else "lower them"
        raise ValueError(f"This machine has {here.cpus:g} CPUs and {gpus} GPUs, less than one client asks "
                         f"(client-cpus = {config.client_cpus}, client-gpus = {config.client_gpus:g}): {lower}, "
                         "or join a Ray cluster that has them (--ray-address).")
    return here.clients(config)


def ray_address(given: str | None = None) -> str | None:
    """The cluster a run joins: ``given`` (--ray-address), else RAY_ADDRESS; None: Ray starts on this machine."""
    address = (given or os.environ.get(RAY_ADDRESS_ENV) or "").strip()
    return None if address in ("", LOCAL) else address


def check_cluster(address: str, config: RunConfig, *, timeout: float = PROBE_TIMEOUT) -> list[ClusterNode]:
    """The alive nodes of the cluster at ``address`` that can hold a client, once each has run a probe: it imports
    fedlora and its libraries (the same versions as here) and looks for the run's data as its clients will. Raises
    ValueError, one line, naming the first node that fails; or if nothing answers at ``address``, no node holds one
    client's resources, or another job holds some of them (Flower sizes its workers by the cluster's total)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    check_address(address)
    with _connected(address):
        nodes = [node for node in _alive_nodes() if node.clients(config) > 0]
        if not nodes:
            raise ValueError(f"No node of the Ray cluster at {address} has the resources of one client "
                             f"(client-cpus = {config.client_cpus}, client-gpus = {config.client_gpus:g}): lower them "
                             "or add nodes.")
        _wait_until_idle(address)
        probe = ray.remote(num_cpus=0)(_probe())
        pending = {probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)).remote(
            config.to_mapping(), library_versions()): node for node in nodes}
        deadline = time.time() + timeout
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.time()))
            if not ready:
                raise ValueError(f"Ray node {next(iter(pending.values()))} did not finish fedlora's check within "
                                 f"{timeout:.0f} s (starting a worker and looking for the data): is its Python "
                                 "environment the same as this one's?")
            node = pending.pop(ready[0])
            try:
                problem = ray.get(ready[0])
            except Exception as error:  # the probe could not run there at all
                problem = f"its worker failed: {_one_line(getattr(error, 'cause', None) or error)}"
            if problem:
                raise ValueError(f"Ray node {node} cannot run this run's clients: {problem}")
        return nodes


def wait_for_live_nodes(address: str, *, timeout: float = 120.0) -> int:
    """Blocks until every node the cluster lists as alive answers (a node just lost stays listed until the head's
    health checks give it up, and Flower would size its workers by it); returns how many there are."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ping = ray.remote(num_cpus=0)(lambda: None)
    deadline = time.time() + timeout
    with _connected(address):
        while True:
            nodes = _alive_nodes()
            refs = [ping.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False)).remote()
                    for n in nodes]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=10)
            if len(ready) == len(refs) and len(_alive_nodes()) == len(nodes):
                return len(nodes)
            if time.time() > deadline:
                raise RuntimeError(f"The Ray cluster at {address} still lists nodes that do not answer after "
                                   f"{timeout:.0f} s.")
            time.sleep(2)


def library_versions() -> dict[str, str]:
    """What a node must share with this machine for its clients to compute what they would here."""
    from importlib.metadata import version

    return {name: version(name) for name in ("fedlora", "flwr", "torch", "transformers", "peft", "timm")}


@contextlib.contextmanager
def _connected(address: str):
    """This process attached to the cluster as a Ray driver, then detached; the process's signal handlers kept
    (ray.init replaces SIGTERM's) and RAY_ADDRESS out of the way (it would override "auto")."""
    import ray

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    environment = os.environ.pop(RAY_ADDRESS_ENV, None)
    try:
        with warnings.catch_warnings():  # Ray's notice about a future default for GPU visibility
            warnings.simplefilter("ignore", FutureWarning)
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as error:
        _restore(handlers, environment)
        hint = (" Is this machine a node of the cluster (`ray start --address ...`)? A Ray driver runs on one."
                if isinstance(error, ConnectionError) else "")
        raise ValueError(f"Cannot join the Ray cluster at {address}: {_one_line(error)}{hint}") from None
    try:
        yield
    finally:
        ray.shutdown()
        _restore(handlers, environment)


def _restore(handlers: dict, environment: str | None) -> None:
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    if environment is not None:
        os.environ[RAY_ADDRESS_ENV] = environment


def _alive_nodes() -> list[ClusterNode]:
    import ray

    return [ClusterNode(n["NodeID"], n["NodeManagerAddress"], n["Resources"].get("CPU", 0.0),
                        n["Resources"].get("GPU", 0.0)) for n in ray.nodes() if n["Alive"]]


def _wait_until_idle(address: str, timeout: float = 15.0) -> None:
    """Another job's workers hold CPUs or GPUs: Flower would start as many workers as the cluster has in total,
    and messages sent to those Ray cannot place wait out reply-timeout (a run's own workers free theirs within
    seconds of its end, hence the wait)."""
    import ray

    deadline = time.time() + timeout
    while True:
        total, free = ray.cluster_resources(), ray.available_resources()
        held = {r: total.get(r, 0.0) - free.get(r, 0.0) for r in ("CPU", "GPU") if total.get(r, 0.0)}
        if all(h < 1e-6 for h in held.values()):
            return
        if time.time() > deadline:
            busy = ", ".join(f"{h:g} of {total[r]:g} {r}s" for r, h in held.items() if h >= 1e-6)
            raise ValueError(f"Another job holds {busy} of the Ray cluster at {address}: run one simulation at a time "
                             "on a cluster (Flower starts a worker for every CPU or GPU it has).")
        time.sleep(1)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def check_address(address: str) -> None:
    """That ``address`` names a Ray head that answers (else ValueError, one line): ray.init would retry for minutes."""
    if address.startswith("ray://"):
        raise ValueError(f"Ray address {address}: Ray Client addresses (ray://) cannot run Flower's simulation; "
                         "run fedlora on a node of the cluster with the head's HOST:PORT (6379 by default).")
    if address == "auto":  # the cluster `ray start` left on this machine: ray.init finds it or says so at once
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"Ray address {address}: expected HOST:PORT of the cluster's head (as `ray start --head` "
                         "prints it), or auto.")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as error:
        raise ValueError(f"Nothing answers at the Ray address {address} ({error.strerror or error}): start the head "
                         "with `ray start --head`, or check the address.") from None


def _probe():
    """The check each node runs, as a function pickled by value: a node without fedlora cannot import a function
    of fedlora, but runs this one and says so."""

    def probe(mapping: dict, versions: dict[str, str]) -> str | None:
        try:
            from importlib.metadata import version

            from fedlora.config import RunConfig
            from fedlora.experiment import check_before_start

            here = {name: version(name) for name in versions}
        except Exception as error:  # noqa: BLE001 (whatever stops the import is what the user must hear)
            return f"cannot import fedlora ({type(error).__name__}: {error}): install the same fedlora on every node"
        if differ := [f"{name} {here[name]} (here {want})" for name, want in versions.items() if here[name] != want]:
            return f"it has {', '.join(differ)}: install the same versions on every node"
        try:
            check_before_start(RunConfig.from_mapping(mapping))
        except Exception as error:  # noqa: BLE001 (the data: missing files, an unreachable hub, a folder it lacks)
            return " ".join(str(error).split())
        return None

    return probe


def cluster_summary(address: str, nodes: list[ClusterNode], config: RunConfig) -> str:
    """One line: the cluster and how many clients it trains at once."""
    workers = sum(node.clients(config) for node in nodes)
    return (f"  Ray cluster at {address}: {len(nodes)} node{'s' * (len(nodes) != 1)}, {workers} clients at a time "
            f"({config.client_cpus} CPU{'s' * (config.client_cpus != 1)}"
            + (f", {config.client_gpus:g} GPU" if config.client_gpus else "") + " each); the server stays here")


class LocalCluster:
    """A Ray cluster of ``len(cpus)`` nodes on this machine, each with its own CPUs (its own raylet and workers),
    the first the head: the steps of docs/how-to/ray.md, for trying them and for the tests. ``node_env`` adds
    environment variables to one node's processes (a node whose data is elsewhere). Use as a context manager;
    ``stop_node(i)`` ends one node as a lost machine would."""

    OBJECT_STORE_BYTES = 200_000_000  # each node's; Ray's default, a share of the memory, is far more than needed

    def __init__(self, cpus: list[int], *, node_env: dict[int, dict[str, str]] | None = None):
        self.cpus, self.node_env = cpus, node_env or {}
        self.ip = _node_ip()
        self.port = free_port("")
        self.address = f"{self.ip}:{self.port}"
        # a short folder of its own: Ray's socket paths must fit 107 bytes, and `ray.init()` elsewhere must not find it
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rayc", dir="/tmp"))
        self.nodes: list[subprocess.Popen] = []

    def __enter__(self) -> LocalCluster:
        try:
            for i, cpus in enumerate(self.cpus):
                self._start(i, cpus)
                self._wait_for_nodes(i + 1)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self, index: int, cpus: int) -> None:
        common = ["--node-ip-address", self.ip, "--num-cpus", str(cpus), "--num-gpus", "0",
                  "--object-store-memory", str(self.OBJECT_STORE_BYTES), "--min-worker-port", "0",
                  "--max-worker-port", "0", "--disable-usage-stats", "--block"]
        args = (["--head", "--port", str(self.port), "--temp-dir", str(self.temp_dir), "--include-dashboard",
                 "false"] if index == 0 else
                ["--address", self.address, "--dashboard-agent-listen-port", "0", "--include-log-monitor", "False"])
        ray = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
        env = {**os.environ, **self.node_env.get(index, {})}
        env.pop(RAY_ADDRESS_ENV, None)
        with (self.temp_dir / f"node-{index}.log").open("w") as log:
            self.nodes.append(subprocess.Popen([ray, "start", *args, *common], stdout=log, stderr=subprocess.STDOUT,
                                               env=env, start_new_session=True))

    def _wait_for_nodes(self, count: int, timeout: float = 120.0) -> None:
        """Until the head reports ``count`` alive nodes (`ray start` returns before its node has joined)."""
        deadline = time.time() + timeout
        script = ("import ray; ray.init(address=%r, logging_level='ERROR', log_to_driver=False); "
                  "print(sum(n['Alive'] for n in ray.nodes()))" % self.address)
        while time.time() < deadline:
            if any(node.poll() is not None for node in self.nodes):
                raise RuntimeError(f"A Ray node exited at start-up; see {self.temp_dir}/node-*.log.")
            result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                                    env={k: v for k, v in os.environ.items() if k != RAY_ADDRESS_ENV})
            if result.returncode == 0 and result.stdout.strip().splitlines()[-1:] == [str(count)]:
                return
            time.sleep(1)
        raise RuntimeError(f"The Ray cluster did not reach {count} nodes within {timeout:.0f} s.")

    def stop_node(self, index: int, *, kill: bool = False) -> None:
        """Ends node ``index`` and every process it started (its raylet, its workers): SIGKILL with ``kill``."""
        _end_tree(self.nodes[index], kill=kill)

    def stop(self) -> None:
        for node in reversed(self.nodes):  # workers before the head
            _end_tree(node, kill=False)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _end_tree(process: subprocess.Popen, *, kill: bool) -> None:
    if process.poll() is not None:  # ended and reaped: its pid may be another process's by now
        return
    with contextlib.suppress(psutil.NoSuchProcess):
        end_trees([psutil.Process(process.pid)], grace=30.0, kill=kill)
    process.wait()


def _node_ip() -> str:
    """This machine's address as Ray sees it: Ray rewrites loopback addresses to it, so both ends must use it."""
    import ray

    return ray.util.get_node_ip_address()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now ("": on every interface, as a Ray head listens)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
