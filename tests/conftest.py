"""The suite runs on up to two pytest-xdist workers (pyproject's addopts; `pytest -n 0` runs it in one process).

The tests that start Flower or Ray processes check that none of their worker's is left when they end (a process
inherits its worker's PYTEST_XDIST_WORKER, tests/helpers.py); their modules are one unit of work, run one after the
other on one worker, so that at most one of them shares the cores with the other worker's tests (among which the
chaos and soak benchmarks' tests, each a unit of its own, start such processes too). (A scheduler of our own rather
than xdist_group marks: with pytest 9.2, pytest-xdist's loadgroup ignores the marks, pytest-xdist#1386.) Each
worker's torch gets its share of the cores, so that the workers' thread pools do not oversubscribe them.
"""

import os

import pytest

PROCESS_MODULES = ("tests/test_deployment.py", "tests/test_simulation.py", "tests/test_cluster.py")


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ProcessTestsOnOneWorker(LoadScopeScheduling):
        """Every test its own unit, but those of PROCESS_MODULES one unit (the largest, so it starts first)."""

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "flower-processes" if module in PROCESS_MODULES else nodeid

    return ProcessTestsOnOneWorker(config, log)


def pytest_configure(config):
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:  # set in the workers only
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))
