"""Ends the processes a launch started, and theirs, once the launch is gone: also when it was killed (``kill -9``, the
OOM killer) and could not clean up. Flower's processes run in sessions of their own, so without this a killed
`fedlora run` would leave its SuperLink running the federation to its end, and `--resume` would find nothing to resume.

The launcher starts ``python -m fedlora.reaper`` with a pipe on its standard input and writes a line "<pid>
<start time>" for each process it starts. The pipe's end comes when the launcher closes it or dies, however it dies;
then every listed process still alive (the same process: its pid and start time) is ended with all it started.
Only the standard library and psutil: it starts in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import sys
import time

import psutil


def end_trees(roots: list[psutil.Process], *, grace: float = 20.0, kill: bool = False) -> None:
    """SIGTERM (SIGKILL with ``kill``) to each of ``roots`` and every process under it, SIGKILL to what is left
    after ``grace`` seconds."""
    tree = []
    for root in roots:
        with contextlib.suppress(psutil.NoSuchProcess):
            tree += [root, *root.children(recursive=True)]
    for member in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill() if kill else member.terminate()
    for member in _running(tree, grace):
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()


def _running(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of ``processes`` still running after up to ``timeout`` seconds. A zombie has ended: its parent, which
    may not be this process, is yet to reap it."""
    deadline = time.monotonic() + timeout
    while True:
        running = []
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                if process.status() != psutil.STATUS_ZOMBIE:
                    running.append(process)
        if not running or time.monotonic() >= deadline:
            return running
        processes = running
        time.sleep(0.1)


def _listed(lines) -> list[psutil.Process]:
    """The listed processes still alive, in the order listed (a pid reused by another process is not one)."""
    alive = []
    for line in lines:
        with contextlib.suppress(ValueError, psutil.NoSuchProcess):
            pid, started = line.split()
            process = psutil.Process(int(pid))
            if process.create_time() == float(started):
                alive.append(process)
    return alive


def main() -> None:
    lines = list(sys.stdin)  # until the launcher closes the pipe or dies
    end_trees(list(reversed(_listed(lines))))  # the last started first: SuperNodes before the SuperLink


if __name__ == "__main__":
    main()
