"""What a command costs the machine: CPU seconds and peak memory of its whole process tree, by process role.

Flower runs a federation in several processes (the CLI, the SuperLink, `flwr run`, SuperExecs, the ServerApp, the
simulation's driver, Ray's daemons and workers) and pfl-research in several too (torchrun and its workers): a peer
comparison must count every one. ``measure`` runs a command and samples its tree every ``interval`` seconds: each
process's CPU seconds (user + system, its own, as last seen) and, every ``memory_interval``, the tree's proportional
set size (PSS: a library mapped by several processes counts once in all, split between them; read from
/proc/PID/smaps_rollup, which costs the sampler far less than walking every mapping), whose peak it keeps. Where the machine lets it
(cgroup v1's cpuacct, as root), the command also runs in a cgroup of its own, whose counter is exact: it includes
the processes that ended between two samples, which sampling misses.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil

CPUACCT = Path("/sys/fs/cgroup/cpuacct")

# a process's role, by the first pattern its command line matches (the order matters: a Ray worker's command line
# names Python too)
ROLES = (
    ("Ray worker", r"ray::ClientAppActor|default_worker\.py"),
    ("Ray daemons", r"gcs_server|raylet|ray::|ray/dashboard|log_monitor|monitor\.py|ray_client_server|runtime_env"),
    ("SuperLink", r"flower-superlink"),
    ("ServerApp", r"flwr-serverapp"),
    ("SuperNode", r"flower-supernode"),
    ("ClientApp", r"flwr-clientapp"),
    ("simulation (Ray driver)", r"flwr-simulation"),
    ("SuperExec", r"flower-superexec"),
    ("flwr run", r"flwr run"),
    ("fedlora CLI", r"fedlora(\.cli)? (run|deploy)|bin/fedlora"),
    ("fedlora reaper", r"fedlora\.reaper"),
    ("torchrun", r"torch\.distributed\.run|torchrun"),
    ("pfl worker", r"benchmarks\.pfl_run"),
)


def role_of(cmdline: list[str]) -> str:
    text = " ".join(cmdline)
    return next((role for role, pattern in ROLES if re.search(pattern, text)), "other")


@dataclass
class TreeCost:
    """What one command's process tree spent."""
    wall_seconds: float
    cpu_seconds: float  # the cgroup's exact count where there is one, else the sampled sum
    cpu_exact: bool  # whether cpu_seconds is the cgroup's count
    sampled_cpu_by_role: dict[str, float] = field(default_factory=dict)  # each process's CPU as last sampled
    peak_pss_bytes: int = 0  # the largest sum of the tree's PSS in one sample
    peak_pss_by_role: dict[str, int] = field(default_factory=dict)  # each role's PSS at that sample
    returncode: int = 0
    started: float = 0.0  # time.time() when the command started
    # (time.time(), the tree's CPU seconds so far: the cgroup's where exact, else the sampled sum) every sample
    timeline: list[tuple[float, float]] = field(default_factory=list)
    started_by_role: dict[str, float] = field(default_factory=dict)  # seconds from the start to a role's first process
    # (time.time(), {role: sampled CPU seconds so far}) every sample
    role_timeline: list[tuple[float, dict[str, float]]] = field(default_factory=list)

    def cpu_between(self, start: float, end: float) -> float:
        """CPU seconds the tree spent from ``start`` to ``end`` (time.time()), interpolated between samples."""
        times, cpus = [t for t, _ in self.timeline], [c for _, c in self.timeline]
        return float(np.interp(end, times, cpus) - np.interp(start, times, cpus))

    def role_cpu_between(self, start: float, end: float) -> dict[str, float]:
        """Each role's sampled CPU seconds from ``start`` to ``end``."""
        times = [t for t, _ in self.role_timeline]
        roles = {role for _, spent in self.role_timeline for role in spent}
        out = {role: float(np.interp(end, times, [spent.get(role, 0.0) for _, spent in self.role_timeline])
                           - np.interp(start, times, [spent.get(role, 0.0) for _, spent in self.role_timeline]))
               for role in roles}
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def to_dict(self) -> dict:
        return {"wall_seconds": self.wall_seconds, "cpu_seconds": self.cpu_seconds, "cpu_exact": self.cpu_exact,
                "sampled_cpu_by_role": self.sampled_cpu_by_role, "peak_pss_bytes": self.peak_pss_bytes,
                "peak_pss_by_role": self.peak_pss_by_role, "started_by_role": self.started_by_role,
                "returncode": self.returncode}


class _Cgroup:
    """A cpuacct cgroup of its own for the command, where the machine offers one (else ``usable`` is False)."""

    def __init__(self):
        self.path = CPUACCT / f"fedlora-bench-{os.getpid()}-{time.monotonic_ns()}"
        try:
            self.path.mkdir()
            self.usable = True
        except OSError:
            self.usable = False

    def enter(self) -> None:
        """Run in the child before it execs: the command and everything it starts count here."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def processes(self) -> list[psutil.Process]:
        """Every process in the cgroup: also those that left the command's tree (a daemon that detached)."""
        out = []
        for pid in (self.path / "cgroup.procs").read_text().split():
            with contextlib.suppress(psutil.NoSuchProcess):
                out.append(psutil.Process(int(pid)))
        return out

    def seconds(self) -> float:
        return int((self.path / "cpuacct.usage").read_text()) / 1e9

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.rmdir()


def _tree(root: psutil.Process) -> list[psutil.Process]:
    with contextlib.suppress(psutil.NoSuchProcess):
        return [root, *root.children(recursive=True)]
    return []


def _pss(pid: int) -> int:
    """A process's proportional set size in bytes (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


def measure(command: list[str], *, cwd: Path | None = None, env: dict | None = None, interval: float = 0.5,
            memory_interval: float = 1.0, stdout=None, timeout: float | None = None) -> TreeCost:
    """Runs ``command`` to its end and returns what its tree spent (see the module's docstring)."""
    cgroup = _Cgroup()
    began, started = time.time(), time.monotonic()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=stdout, stderr=subprocess.STDOUT if stdout else None,
                               preexec_fn=cgroup.enter if cgroup.usable else None)
    root = psutil.Process(process.pid)
    seen: dict[tuple[int, float], tuple[str, float]] = {}  # (pid, create time) -> (role, CPU seconds)
    first: dict[str, float] = {}  # role -> seconds from the command's start to its first process's
    peak, peak_roles, timeline, role_timeline = 0, {}, [(began, 0.0)], [(began, {})]
    memory_due = 0.0
    try:
        while process.poll() is None:
            if timeout is not None and time.monotonic() - started > timeout:
                raise TimeoutError(f"{command[0]} ran past {timeout:.0f} s")
            total, roles = 0, {}
            sample_memory = time.monotonic() >= memory_due
            for proc in cgroup.processes() if cgroup.usable else _tree(root):
                try:
                    with proc.oneshot():
                        key = (proc.pid, proc.create_time())
                        role = seen[key][0] if key in seen else role_of(proc.cmdline())
                        first[role] = min(first.get(role, math.inf), key[1] - began)
                        times = proc.cpu_times()
                        seen[key] = (role, times.user + times.system)
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                if sample_memory:
                    pss = _pss(proc.pid)
                    total += pss
                    roles[role] = roles.get(role, 0) + pss
            if sample_memory:
                memory_due = time.monotonic() + memory_interval
                if total > peak:
                    peak, peak_roles = total, roles
            timeline.append((time.time(), cgroup.seconds() if cgroup.usable else sum(c for _, c in seen.values())))
            spent: dict[str, float] = {}
            for role, seconds in seen.values():
                spent[role] = spent.get(role, 0.0) + seconds
            role_timeline.append((timeline[-1][0], spent))
            time.sleep(interval)
        wall = time.monotonic() - started
        by_role: dict[str, float] = {}
        for role, seconds in seen.values():
            by_role[role] = by_role.get(role, 0.0) + seconds
        sampled = sum(by_role.values())
        exact = cgroup.usable
        cpu = cgroup.seconds() if exact else sampled
        timeline.append((time.time(), cpu))
        return TreeCost(wall, cpu, exact, dict(sorted(by_role.items(), key=lambda kv: -kv[1])), peak,
                        dict(sorted(peak_roles.items(), key=lambda kv: -kv[1])), process.returncode, began, timeline,
                        dict(sorted(first.items(), key=lambda kv: kv[1])), role_timeline)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if cgroup.usable:
            for _ in range(50):  # the tree's last processes may still be exiting
                if not (cgroup.path / "cgroup.procs").read_text().strip():
                    break
                time.sleep(0.2)
            cgroup.remove()
