"""The chaos benchmark at a size CI affords: 3 SuperNodes with TLS, authentication and ledgers, 3 rounds, one node
replying NaN throughout, one killed and restarted, one stalled until its round ends without it, the SuperLink killed
and the run resumed; every check of benchmarks/chaos.py must hold, its ledger check must catch a doctored ledger,
and a torn last row of metrics.jsonl must not stop it."""

import dataclasses

from benchmarks.chaos import KINDS, LEDGER_CHECK, chaos, summary, verify
from fedlora.launch import node_ledger


def test_a_deployment_survives_kills_stalls_garbage_and_a_superlink_restart(tmp_path):
    lines = []
    out = tmp_path / "run"
    outcome = chaos(out, nodes=3, rounds=3, seed=0, kills=1, stalls=1, reply_timeout=60.0, min_replies=1,
                    echo=lines.append)
    launcher_log = (out.parent / f"{out.name}-launcher.log").read_text()
    assert outcome.passed, ({k: v for k, v in outcome.checks.items() if v != "ok"}, launcher_log[-3000:])
    facts = summary(outcome)
    # the SuperLink's kill, then a resume; on a loaded machine a round whose one healthy reply misses the timeout
    # through every retry stops a launch too, and the next resumes it
    assert facts["rounds completed"] == 3 and 2 <= facts["launches"] <= 3, (facts, launcher_log[-3000:])
    assert facts["by kind"] == {kind: 1 for kind in KINDS}, (facts, lines)
    assert facts["replies rejected"] >= 1  # the NaN replies never count
    assert outcome.status == "finished" and outcome.last_line.startswith("clients failed: ")

    with (out / "metrics.jsonl").open("a") as metrics:
        metrics.write('{"round": 4, "accu')  # a row torn by a ServerApp killed as it wrote is not read
    torn = dataclasses.replace(outcome, checks={})
    verify(out, torn, 1000.0, ["ok"], 0)
    assert torn.rows == outcome.rows

    ledger = next(node_ledger(out, i) for i in range(3) if node_ledger(out, i).is_file())
    records = ledger.read_text().splitlines()
    ledger.write_text("\n".join([*records, records[-1]]) + "\n")  # a reply recorded twice
    doubled = dataclasses.replace(outcome, checks={})
    verify(out, doubled, 1000.0, ["ok"], 0)
    assert "recorded a release twice" in doubled.checks[LEDGER_CHECK]
    for i in range(3):  # no reply recorded: the aggregated replies outnumber the records
        node_ledger(out, i).unlink(missing_ok=True)
    unrecorded = dataclasses.replace(outcome, checks={})
    verify(out, unrecorded, 1000.0, ["ok"], 0)
    assert "aggregated more replies than the nodes recorded" in unrecorded.checks[LEDGER_CHECK]
