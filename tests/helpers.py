"""Shared by the tests: those that start real Flower processes, and those that also run on a GPU where there is one."""

import contextlib
import os

import psutil
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
    """Live (not zombie) Flower and Ray processes that this test worker started: under pytest-xdist the other
    worker's tests start their own (a chaos run, a soak), and every process inherits its worker's
    PYTEST_XDIST_WORKER, Ray's raylet too; without xdist, every such process on the machine."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    left = []
    for process in psutil.process_iter(["cmdline", "status"]):
        command = " ".join(process.info["cmdline"] or [])
        if not any(p in command for p in FLOWER_PROCESSES) or process.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        with contextlib.suppress(psutil.Error):  # it ended meanwhile
            if worker is None or process.environ().get("PYTEST_XDIST_WORKER") == worker:
                left.append(f"{process.pid} {command}")
    return left


def assert_trained_together_as_alone(model, data, task) -> set[str]:
    """Three clients trained in one pass per step (``local_train_clients``) change the model's trainable parameters
    and lose what each does alone (``local_train``), within 1e-4; returns the trainable parameters' names."""
    from fedlora.training import local_train, local_train_clients

    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    train = {"steps": 3, "batch_size": 4, "lr": 0.01, "optimizer": "adam", "task": task}
    together, losses = local_train_clients(model, data, generators=[torch.Generator().manual_seed(m)
                                                                    for m in range(len(data))],
                                           augment_seeds=[10 + m for m in range(len(data))], **train)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert together.keys() == trainable
    for m in range(len(data)):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start[n])
        loss = local_train(model, data[m], generator=torch.Generator().manual_seed(m), **train)
        alone = {n: p.detach() - start[n] for n, p in model.named_parameters() if n in trainable}
        error = sum(((together[n][m] - start[n]) - alone[n]).norm() ** 2 for n in alone) ** 0.5
        assert error <= 1e-4 * sum(alone[n].norm() ** 2 for n in alone) ** 0.5
        assert losses[m] == pytest.approx(loss, rel=1e-5)
    assert len({round(loss, 6) for loss in losses}) == len(data)
    return trainable
