"""Shared by the tests: those that start real Flower processes, and those that also run on a GPU where there is one."""

import subprocess

import pytest
import torch

# The same test on the CPU always and on CUDA where there is a GPU (never in CI: a GPU session runs them).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]

# The paper's round (each client noises its own adapter): the form most tests were written for. The quickstart's
# defaults (noise at the server, updates) are tested where a test names them.
PAPER_FORM = {"noise-placement": "client", "message": "adapter"}

FLOWER_PROCESSES = ("flower-superlink", "flower-supernode", "flower-superexec", "flwr-serverapp", "flwr-clientapp",
                    "raylet")


def leftover_flower_processes() -> list[str]:
    """Live (not zombie) Flower and Ray processes on this machine."""
    out = subprocess.run(["ps", "-eo", "stat,cmd"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in out if any(p in line for p in FLOWER_PROCESSES) and not line.startswith("Z")]
