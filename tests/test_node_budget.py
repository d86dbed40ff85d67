"""A node's own privacy budget against the server: its ledger, its epsilon, its refusals."""

import fcntl
import json
import multiprocessing
import time
from pathlib import Path

import numpy as np
import pytest
from scipy import optimize, stats

from fedlora.privacy.events import GaussianRelease, NonPrivateRelease, SkellamRelease
from fedlora.privacy.node_budget import BudgetRefused, NodeBudget


def _gaussian_epsilon(mu: float, delta: float) -> float:
    """The Gaussian mechanism's exact epsilon at mu (Balle and Wang 2018), written out here as the oracle."""
    def excess(eps):
        return stats.norm.cdf(-eps / mu + mu / 2) - np.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2) - delta
    return optimize.brentq(excess, 0.0, 100.0, xtol=1e-12)


def test_replies_compose_as_gaussians_at_the_multipliers_the_node_used(tmp_path):
    budget = NodeBudget(tmp_path / "ledger.jsonl", None, 1e-5)
    assert budget.spent() == 0.0 and budget.records() == []
    for z in (1.0, 1.0, 2.5):
        budget.spend((GaussianRelease(z),), run=7, round=1)
    mu = np.sqrt(2 * (2 / 1.0) ** 2 + (2 / 2.5) ** 2)  # replace-one: sensitivity 2 tau, noise z tau
    assert budget.spent() == pytest.approx(_gaussian_epsilon(mu, 1e-5), rel=1e-6)
    records = budget.records()
    assert [r["run"] for r in records] == [7, 7, 7] and records[2]["release"] == [
        {"type": "GaussianRelease", "noise_multiplier": 2.5, "shares": 1}]
    # a clip bit beside the message: one more Gaussian in the same reply
    assert budget.spend((GaussianRelease(1.0), GaussianRelease(20.0))) > budget.spent(records)


def test_a_reply_past_the_budget_is_refused_and_not_recorded(tmp_path, caplog):
    budget = NodeBudget(tmp_path / "ledger.jsonl", 3.0, 1e-5)
    allowed = _replies_within(3.0, 6.0)
    spent = [budget.spend((GaussianRelease(6.0),), round=r) for r in range(1, allowed + 1)]
    assert allowed > 1 and spent == sorted(spent) and spent[-1] <= 3.0
    before = (tmp_path / "ledger.jsonl").read_text()
    with caplog.at_level("WARNING"), pytest.raises(BudgetRefused) as refused:
        budget.spend((GaussianRelease(6.0),))
    # the server hears the reason; what the ledger holds (the node's other federations too) stays in the node's log
    assert str(refused.value) == ("Refused by this node's privacy budget against the server: this reply would carry "
                                  "Gaussian noise at multiplier 6, past the budget.")
    assert f"{allowed} replies spent epsilon {spent[-1]:.3f} at delta 1e-05" in caplog.text
    with pytest.raises(BudgetRefused, match="past the budget"):
        budget.check((GaussianRelease(6.0),))  # the same answer before any work
    assert (tmp_path / "ledger.jsonl").read_text() == before
    assert budget.spend((GaussianRelease(1e6),)) <= 3.0  # a nearly free reply still fits


def _replies_within(limit: float, z: float) -> int:
    """How many replies at multiplier z a budget of ``limit`` allows, by the oracle (mu = sqrt(k) 2 / z)."""
    k = 0
    while _gaussian_epsilon(np.sqrt(k + 1) * 2 / z, 1e-5) <= limit:
        k += 1
    return k


def test_a_reply_without_the_nodes_own_noise_is_refused_with_the_reason(tmp_path):
    budget = NodeBudget(tmp_path / "ledger.jsonl", 100.0)
    with pytest.raises(BudgetRefused, match=r"carry no noise of the node's own \(the noise is added by the server\)"):
        budget.spend((NonPrivateRelease(),), why_unprotected="the noise is added by the server")
    recording = NodeBudget(tmp_path / "ledger.jsonl")  # no budget: it records, and says what was spent
    assert recording.spend((NonPrivateRelease(),)) == float("inf") and len(recording.records()) == 1


def test_a_secure_aggregation_share_is_accounted_alone(tmp_path):
    share = SkellamRelease(1.0, 1.0, 1.0, 1000, shares=4).one_reply()  # this node's share: z / sqrt(4)
    alone = NodeBudget(tmp_path / "share.jsonl").spend((share,))
    assert alone > NodeBudget(tmp_path / "gauss.jsonl").spend((GaussianRelease(1.0),))
    assert np.isfinite(alone)


def test_an_unusable_ledger_stops_the_node_and_only_its_own_log_says_where(tmp_path, caplog):
    path = tmp_path / "ledger.jsonl"
    path.write_text(json.dumps({"release": [{"type": "GaussianRelease", "noise_multiplier": 1}]}) + "\n{oops\n")
    for attempt in (lambda b: b.spend((GaussianRelease(1.0),)), lambda b: b.check((GaussianRelease(1.0),))):
        with caplog.at_level("ERROR"), pytest.raises(ValueError) as stopped:
            attempt(NodeBudget(path, 8.0))
        assert str(stopped.value) == "This node's privacy ledger cannot be used; the node's own log says why."
        assert f"{path} cannot be used" in caplog.text and "unreadable line 2" in caplog.text
    with pytest.raises(ValueError, match="unreadable line 2"):  # the operator's own reading names the line
        NodeBudget(path).records()
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="the node's own log says why"):
        NodeBudget(tmp_path / "file" / "ledger.jsonl", 8.0).spend((GaussianRelease(1.0),))


def _spend_repeatedly(path: str, start, tries: int) -> int:
    start.wait()
    accepted = 0
    for _ in range(tries):
        try:
            NodeBudget(Path(path), 6.0).spend((GaussianRelease(4.0),))
            accepted += 1
        except BudgetRefused:
            pass
    return accepted


def test_processes_of_one_node_never_overspend_together(tmp_path):
    path = tmp_path / "ledger.jsonl"
    allowed = _replies_within(6.0, 4.0)
    context = multiprocessing.get_context("spawn")  # fork would copy the locks of threads earlier tests left
    with context.Manager() as manager:
        start = manager.Event()
        with context.Pool(8) as pool:
            results = [pool.apply_async(_spend_repeatedly, (str(path), start, 3)) for _ in range(8)]
            start.set()
            accepted = sum(r.get(timeout=120) for r in results)
    ledger = NodeBudget(path, 6.0)
    assert accepted == allowed == len(ledger.records()) and ledger.spent() <= 6.0


def _spend_after_marking(path: str, marker: str) -> None:
    Path(marker).touch()
    NodeBudget(Path(path), 6.0).spend((GaussianRelease(4.0),))


def test_a_reply_waits_while_another_process_of_the_node_holds_the_ledger(tmp_path):
    path, marker = tmp_path / "ledger.jsonl", tmp_path / "started"
    path.touch()
    with open(path) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        worker = multiprocessing.get_context("spawn").Process(target=_spend_after_marking,
                                                              args=(str(path), str(marker)))
        worker.start()
        while not marker.exists() and worker.is_alive():
            time.sleep(0.05)
        time.sleep(0.5)  # time to write, were the file not locked
        assert worker.is_alive() and path.read_text() == ""
    worker.join(timeout=60)
    assert worker.exitcode == 0 and len(NodeBudget(path).records()) == 1
