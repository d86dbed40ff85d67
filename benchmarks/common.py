"""Shared bits of the benchmark scripts: where results go and how the machine is described."""

from __future__ import annotations

import contextlib
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def command_line(module: str) -> str:
    """The exact command that produced a result (run from the repository root), to be written beside it."""
    return " ".join(["python -m", module, *map(shlex.quote, sys.argv[1:])])


def step_counts(text: str) -> list[int] | None:
    """Increasing positive step counts from "300,600,1200", or None if ``text`` is not that."""
    try:
        steps = [int(s) for s in text.split(",")]
    except ValueError:
        return None
    return steps if steps and steps[0] >= 1 and steps == sorted(set(steps)) else None


def provenance(module: str) -> list[str]:
    """The lines under a result that say what produced it: the command, the commit and the machine (Markdown line
    breaks)."""
    return [f"Command: `{command_line(module)}`  ", f"Commit: {revision()}  ", f"Machine: {machine()}  "]


def revision() -> str:
    """The git commit the numbers were measured at ("unknown" outside a checkout). Changes to the results alone do
    not mark it changed: a script that runs several benchmarks writes results between them."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=root).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)benchmarks/results"], capture_output=True, text=True,
                               cwd=root).stdout.strip()
        return out + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> str:
    """One line: CPU, cores, GPU if any, and the library versions that set the speed."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}, {os.cpu_count()} cores, {gpu}; Python {platform.python_version()}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} torch threads")


@contextlib.contextmanager
def worker_pool(workers: int, name: str, after_stop: str, **options):
    """A pool of ``workers`` spawned processes that SIGTERM ends with it. `kill` reaches only this process, and the
    pool's shutdown would wait for the runs in flight: the workers would compute on, unseen, beside whatever runs
    next. So SIGTERM ends their process trees first, then this command, with one line: ``after_stop``, what is kept
    and how to continue."""
    import concurrent.futures
    import multiprocessing
    import signal

    import psutil

    from fedlora.reaper import end_trees

    pool = None

    def terminated(signum, frame):
        processes = []  # the pool's workers, not its resource tracker, which the pool's own shutdown still needs
        for pid in list(getattr(pool, "_processes", None) or {}):
            with contextlib.suppress(psutil.NoSuchProcess):
                processes.append(psutil.Process(pid))
        end_trees(processes)
        print(f"{name}: stopped by SIGTERM, its workers with it; {after_stop}", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                                    **options) as pool:
            yield pool
    finally:
        signal.signal(signal.SIGTERM, previous)


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_inprocess(config, out_dir: Path, echo=lambda line: None, resume: bool = False) -> list[dict]:
    """One federation in this process (the ServerApp and ClientApp over an in-process Grid: the same protocol,
    strategy and accountant as `fedlora run`, without Ray); its metrics.jsonl rows. ``resume``: continue from the
    checkpoint in ``out_dir`` if there is one."""
    import json
    import logging

    from flwr.app import Context, RecordDict
    from flwr.common.logger import LOGGER_NAME

    from fedlora.clients.app import app
    from fedlora.run_keys import OUT_DIR_KEY, RESUME_KEY
    from fedlora.strategies.inprocess_grid import InProcessGrid
    from fedlora.strategies.server_app import run_federation

    run_config = {**config.to_mapping(), OUT_DIR_KEY: str(out_dir), RESUME_KEY: resume}
    flower = logging.getLogger(LOGGER_NAME)
    level, _ = flower.level, flower.setLevel(logging.WARNING)
    try:
        run_federation(InProcessGrid(app, config.flower_nodes(), run_config),
                       Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config),
                       echo=echo)
    finally:
        flower.setLevel(level)
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def save_figure(fig, name: str, source: str = "") -> None:
    """Lays out ``fig``, writes it to results/<name> and closes it; ``source`` (the command and commit that made it)
    goes in small print under the plot, so that the picture alone says where it came from."""
    import matplotlib.pyplot as plt

    fig.tight_layout(rect=(0, 0.04, 1, 1) if source else None)
    if source:
        fig.text(0.005, 0.005, source, fontsize=6, color="grey", ha="left", va="bottom", wrap=True)
    fig.savefig(RESULTS / name, dpi=120)
    plt.close(fig)
