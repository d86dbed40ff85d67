"""fedlora.reaper: what a launcher started is ended, with what that started, once the launcher's pipe closes."""

import subprocess
import sys
import time

import psutil


def test_the_listed_trees_end_when_the_pipe_closes_and_an_unlisted_or_reused_pid_is_spared():
    listed = subprocess.Popen(["bash", "-c", "sleep 120 & wait"], start_new_session=True)  # a tree: bash, sleep
    spared = subprocess.Popen(["sleep", "120"], start_new_session=True)
    reaper = subprocess.Popen([sys.executable, "-m", "fedlora.reaper"], stdin=subprocess.PIPE, text=True)
    try:
        tree = psutil.Process(listed.pid)
        deadline = time.time() + 30
        while not tree.children() and time.time() < deadline:  # until bash has started its sleep
            time.sleep(0.05)
        members = [tree, *tree.children(recursive=True)]
        reaper.stdin.write(f"{listed.pid} {tree.create_time()!r}\n")
        reaper.stdin.write(f"{spared.pid} {psutil.Process(spared.pid).create_time() + 1!r}\n")  # a pid reused
        reaper.stdin.close()
        assert reaper.wait(timeout=60) == 0
        _, alive = psutil.wait_procs(members, timeout=10)
        assert not alive and spared.poll() is None
    finally:
        for process in (listed, spared):
            process.kill()
            process.wait()
