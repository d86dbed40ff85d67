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


def ray_address(given: str | None = None) -> str | None:
    """The cluster a run joins: ``given`` (--ray-address), else RAY_ADDRESS; None: Ray starts on this machine."""
    address = (given or os.environ.get(RAY_ADDRESS_ENV) or "").strip()
    return None if address in ("", LOCAL) else address


def check_cluster(address: str, config: RunConfig, *, timeout: float = PROBE_TIMEOUT) -> list[ClusterNode]:
    """The alive nodes of the cluster at ``address``, once each has run a probe: it imports fedlora and Flower (the
    same versions as here) and reads the run's data as its clients will. Raises ValueError, one line, naming the
    first node that fails, or if nothing answers at ``address`` or no node holds one client's resources."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    check_address(address)
    try:
        with warnings.catch_warnings():  # Ray's notice about a future default for GPU visibility
            warnings.simplefilter("ignore", FutureWarning)
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise ValueError(f"Cannot join the Ray cluster at {address}: {str(error).splitlines()[0]}") from None
    try:
        nodes = [ClusterNode(n["NodeID"], n["NodeManagerAddress"], n["Resources"].get("CPU", 0.0),
                             n["Resources"].get("GPU", 0.0)) for n in ray.nodes() if n["Alive"]]
        if sum(node.clients(config) for node in nodes) == 0:
            raise ValueError(f"No node of the Ray cluster at {address} has the resources of one client "
                             f"(client-cpus = {config.client_cpus}, client-gpus = {config.client_gpus:g}): lower them "
                             "or add nodes.")
        from flwr import __version__ as flwr_version

        from fedlora import __version__

        probe = ray.remote(num_cpus=0)(_probe())
        pending = {probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)).remote(
            config.to_mapping(), __version__, flwr_version): node for node in nodes}
        ready, late = ray.wait(list(pending), num_returns=len(pending), timeout=timeout)
        for ref in ready:
            try:
                problem = ray.get(ref)
            except Exception as error:  # the probe could not even start there (a worker's Python without Ray's deps)
                problem = f"its worker failed: {str(error).splitlines()[0]}"
            if problem:
                raise ValueError(f"Ray node {pending[ref]} cannot run this run's clients: {problem}")
        if late:
            raise ValueError(f"Ray node {pending[late[0]]} did not answer fedlora's check within {timeout:.0f} s: is "
                             "its worker able to start (same Python environment as this one)?")
        return nodes
    finally:
        ray.shutdown()


def check_address(address: str) -> None:
    """That ``address`` names a Ray head that answers (else ValueError, one line): ray.init would retry for minutes."""
    if address.startswith("ray://"):
        raise ValueError(f"--ray-address {address}: Ray Client addresses (ray://) cannot run Flower's simulation; "
                         "run fedlora on a node of the cluster with the head's HOST:PORT (6379 by default).")
    if address == "auto":  # the cluster `ray start` left on this machine: ray.init finds it or says so at once
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--ray-address {address}: expected HOST:PORT of the cluster's head (as `ray start --head` "
                         "prints it), or auto.")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as error:
        raise ValueError(f"Nothing answers at the Ray address {address} ({error.strerror or error}): start the head "
                         "with `ray start --head`, or check the address.") from None


def _probe():
    """The check each node runs, as a function pickled by value: a node without fedlora cannot import a function
    of fedlora, but runs this one and says so."""

    def probe(mapping: dict, version: str, flwr_version: str) -> str | None:
        try:
            import flwr

            import fedlora
            from fedlora.config import RunConfig
            from fedlora.experiment import check_before_start
        except ImportError as error:
            return f"cannot import it ({error}): install the same fedlora ({version}) on every node"
        if (fedlora.__version__, flwr.__version__) != (version, flwr_version):
            return (f"it has fedlora {fedlora.__version__} and Flower {flwr.__version__}, this machine fedlora "
                    f"{version} and Flower {flwr_version}: install the same on every node")
        try:
            check_before_start(RunConfig.from_mapping(mapping))
        except Exception as error:  # the data: missing files, an unreachable hub, a folder this node lacks
            return str(error).splitlines()[0]
        return None

    return probe


def describe(address: str, nodes: list[ClusterNode], config: RunConfig) -> str:
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

    def __init__(self, cpus: list[int], *, node_env: dict[int, dict[str, str]] | None = None,
                 object_store_bytes: int = 200_000_000):
        self.cpus, self.node_env, self.object_store_bytes = cpus, node_env or {}, object_store_bytes
        self.ip = _node_ip()
        self.port = _free_port()
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
                  "--object-store-memory", str(self.object_store_bytes), "--min-worker-port", "0",
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
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(process.pid)
        tree = [root, *root.children(recursive=True)]
        for member in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                member.kill() if kill else member.terminate()
        _, alive = psutil.wait_procs(tree, timeout=30)
        for member in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                member.kill()
    process.wait()


def _node_ip() -> str:
    """This machine's address as Ray sees it: Ray rewrites loopback addresses to it, so both ends must use it."""
    import ray

    return ray.util.get_node_ip_address()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
