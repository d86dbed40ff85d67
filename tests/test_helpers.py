"""The leftover-process check that the process tests end with sees its own worker's processes only."""

import os
import subprocess
import sys

from tests.helpers import leftover_flower_processes


def test_the_leftover_check_sees_this_workers_flower_processes_and_not_the_other_workers(monkeypatch):
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)", "flower-superlink"]  # its command names Flower
    ours = subprocess.Popen(sleeper, env={**os.environ, "PYTEST_XDIST_WORKER": worker})
    theirs = subprocess.Popen(sleeper, env={**os.environ, "PYTEST_XDIST_WORKER": f"{worker}-other"})
    try:
        left = {int(line.split()[0]) for line in leftover_flower_processes()}
        assert ours.pid in left and theirs.pid not in left
    finally:
        for process in (ours, theirs):
            process.kill()
            process.wait()
