"""Chaos for deployments: `fedlora deploy` on this machine's loopback (TLS, SuperNode authentication, node budgets,
noise at the client or in SecAgg+ shares) while a seeded schedule kills SuperNodes mid-round (SIGKILL) and restarts
them, stalls some until their round has ended without them (SIGSTOP, then SIGCONT), kills the SuperLink and its
ServerApp (the run goes on with `fedlora deploy --resume`), and has one node reply NaN throughout (GARBAGE_ENV names
its partition to every node; under secure aggregation, whose shares the server cannot check, it replies honestly). It
is bounded in time and in faults, stops by itself and leaves no process behind.

What must hold, checked after the run (and the run's ledger against its checkpoint after every launch): the run
ends, or stops with one clear line; no round was aggregated from fewer replies than min-replies; every node's
ledger holds each release it replied to once and stays within its budget, and the replies the server aggregated
from a release are never more than the nodes' records of it; the final adapter loads. It reports rounds completed,
faults injected and survived, replies lost and the time lost to faults.

    python -m benchmarks.chaos --nodes 16 --rounds 8             # the committed run: results/chaos.{md,json,png}
    python -m benchmarks.chaos --nodes 3 --rounds 3 --out DIR    # a small one, not committed
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import psutil

RESULTS = Path(__file__).resolve().parent / "results"
LEDGER_CHECK = "every node's ledger: each reply once, within its budget"
KINDS = ("garbage", "kill", "stall", "superlink")
DOWN_SECONDS = 5.0  # how long a killed SuperNode stays down before it is started again
RETRY_SECONDS = 10.0  # a restarted SuperNode the SuperLink still holds for online (until its heartbeat lapses, about
# 60 s with Flower 1.41's) exits with code 305: it is started again after this, as a device's supervisor would
RESTART_TRIES = 20


@dataclass
class Fault:
    round: int
    kind: str  # one of KINDS
    partition: int | None  # the node it hits (None: the SuperLink)
    after: float  # seconds into the round
    injected: float | None = None  # when (seconds since the benchmark began); None: the run never reached it


@dataclass
class Outcome:
    """What one chaos run measured and what its checks found."""

    nodes: int
    rounds: int
    placement: str
    seed: int
    faults: list[Fault]
    launches: int = 0
    rows: list[dict] = field(default_factory=list)
    status: str = ""  # the checkpoint's, at the end
    last_line: str = ""  # the last launch's last line (stdout, or its error line)
    checks: dict[str, str] = field(default_factory=dict)  # name -> "ok" or what failed
    seconds: float = 0.0
    # "<kind> node <partition>" -> it replied in a later round (faults of the last round have none to reply in)
    back: dict[str, bool] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(v == "ok" for v in self.checks.values())


def schedule(rng: np.random.Generator, *, nodes: int, rounds: int, kills: int, stalls: int,
             superlink: bool) -> list[Fault]:
    """The seeded faults: a node replying garbage throughout, then kills and stalls of other nodes in rounds after
    the first chosen at random (at most one a round, so a round keeps enough replies), and the SuperLink killed once
    in the middle of the run."""
    garbage = int(rng.integers(nodes))
    faults = [Fault(1, "garbage", garbage, 0.0)]
    others = [p for p in range(nodes) if p != garbage]
    choices = rng.permutation(np.arange(2, rounds + 1))[:kills + stalls]  # round 1 shows the run without them
    for i, round_ in enumerate(sorted(int(r) for r in choices)):
        kind = "kill" if i < kills else "stall"
        faults.append(Fault(round_, kind, int(rng.choice(others)), float(rng.uniform(1.0, 8.0))))
    if superlink and rounds > 1:
        faults.append(Fault(max(2, rounds // 2), "superlink", None, float(rng.uniform(2.0, 6.0))))
    return sorted(faults, key=lambda f: (f.round, f.after))


class Chaos:
    """The harness: launches `fedlora deploy` (and its resumes), injects the faults as the rounds come, restarts
    what it killed, and leaves nothing running."""

    def __init__(self, out: Path, faults: list[Fault], *, nodes: int, settings: dict, node_budget: float,
                 max_launches: int = 4, deadline: float = 3600.0, echo=print):
        self.out, self.faults, self.nodes, self.settings = out, faults, nodes, settings
        self.node_budget, self.max_launches = node_budget, max_launches
        self.began, self.deadline, self.echo = time.time(), time.time() + deadline, echo
        # SuperNodes this harness restarted (the launcher does not own them): (process, how to start it again)
        self.own: list[tuple[subprocess.Popen, dict]] = []
        # (the round they were stopped in, processes): continued once that round has ended without them, so that
        # the rounds after it show whether a stalled node comes back
        self.stalled: list[tuple[int, list[psutil.Process]]] = []
        self.down: list[tuple[float, dict]] = []  # (when to start it, how: cmdline, env, cwd, garbage, tries)
        self.garbage = next(f.partition for f in faults if f.kind == "garbage")
        self.ledger_checks: list[str] = []

    # -- processes ---------------------------------------------------------------------------------------------
    def _supernode(self, partition: int) -> psutil.Process | None:
        tag = f"partition-id={partition} num-partitions={self.nodes}"
        for process in psutil.process_iter(["cmdline", "status"]):
            line = " ".join(process.info["cmdline"] or [])
            if "flower-supernode" in line and tag in line and str(self.out) in line and \
                    process.info["status"] != psutil.STATUS_ZOMBIE:
                return process
        return None

    def _superlink(self, launcher: subprocess.Popen) -> psutil.Process | None:
        with contextlib.suppress(psutil.NoSuchProcess):
            return next((p for p in psutil.Process(launcher.pid).children(recursive=True)
                         if "flower-superlink" in " ".join(p.cmdline())), None)
        return None

    @staticmethod
    def _tree(process: psutil.Process) -> list[psutil.Process]:
        with contextlib.suppress(psutil.NoSuchProcess):
            return [process, *process.children(recursive=True)]
        return []

    @staticmethod
    def _signal(processes: list[psutil.Process], sig: int) -> None:
        for p in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)

    def _kill_node(self, partition: int, *, down: float) -> bool:
        node = self._supernode(partition)
        if node is None:
            return False
        try:
            cmdline, env, cwd = node.cmdline(), node.environ(), node.cwd()
        except psutil.NoSuchProcess:
            return False
        self._signal(self._tree(node), signal.SIGKILL)
        self.down.append((time.time() + down, {"cmdline": cmdline, "env": env, "cwd": cwd, "tries": 0}))
        return True

    def _restart_due(self, now: float) -> None:
        for process, how in [o for o in self.own if o[0].poll() not in (None, 0)]:  # it could not connect yet
            self.own.remove((process, how))
            if how["tries"] < RESTART_TRIES:
                self.down.append((now + RETRY_SECONDS, {**how, "tries": how["tries"] + 1}))
        for entry in [d for d in self.down if d[0] <= now]:
            self.down.remove(entry)
            how = entry[1]
            partition = re.search(r"partition-id=(\d+)", " ".join(how["cmdline"])).group(1)
            with (self.out / f"chaos-supernode-{partition}.log").open("a") as log:
                self.own.append((subprocess.Popen(how["cmdline"], env=how["env"], cwd=how["cwd"], stdout=log,
                                                  stderr=subprocess.STDOUT, start_new_session=True), how))

    def _continue_due(self, rounds_done: int, every: bool = False) -> None:
        for entry in [s for s in self.stalled if every or s[0] <= rounds_done]:
            self.stalled.remove(entry)
            self._signal(entry[1], signal.SIGCONT)

    def _stop_own(self) -> None:
        """Ends the nodes this harness started (a new launch starts its own: two nodes of a partition would be
        refused) and any it still holds stopped or down."""
        self._continue_due(0, every=True)
        self.down.clear()
        for process, _ in self.own:
            with contextlib.suppress(psutil.NoSuchProcess):
                self._signal(self._tree(psutil.Process(process.pid)) if process.poll() is None else [], signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        self.own.clear()

    # -- the run -----------------------------------------------------------------------------------------------
    def _launch(self, resume: bool) -> subprocess.Popen:
        fedlora = str(Path(sys.executable).parent / "fedlora")
        args = ([fedlora, "deploy", "--resume", str(self.out)] if resume else
                [fedlora, "deploy", "--out", str(self.out), f"--node-budget={self.node_budget!r}",
                 *[f"--set={k}={v}" for k, v in self.settings.items()]])
        from fedlora.clients.app import GARBAGE_ENV

        log = (self.out.parent / f"{self.out.name}-launcher.log").open("a")
        # unbuffered: its error line (stderr) comes after its round lines (stdout) in the log, as on a terminal
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, GARBAGE_ENV: str(self.garbage), "PYTHONUNBUFFERED": "1"})

    def _rows(self) -> int:
        from fedlora.launch import complete_lines

        return len(complete_lines(self.out / "metrics.jsonl"))

    def run(self) -> tuple[int, int]:
        """Launches and resumes until the run ends, a launch fails without a resume to offer, or the deadline;
        returns (launches, the last launch's exit code)."""
        from fedlora.tracking import read_progress

        launches, code, resume = 0, 1, False
        while launches < self.max_launches and time.time() < self.deadline:
            launcher, launches, started = self._launch(resume), launches + 1, time.time()
            seen: dict[int, float] = {}  # round -> when it was first seen under way
            self._mark("garbage", self.garbage, started)
            while launcher.poll() is None:
                now = time.time()
                if now > self.deadline:
                    launcher.send_signal(signal.SIGTERM)  # the launcher stops its processes and says how to resume
                    launcher.wait(timeout=120)
                    break
                progress, done = read_progress(self.out), self._rows()
                if progress and progress["round"] > done and progress["time"] >= started:  # this launch's
                    seen.setdefault(progress["round"], now)
                for fault in self.faults:
                    if fault.injected is None and fault.kind != "garbage" and fault.round in seen and \
                            now - seen[fault.round] >= fault.after and done < fault.round:
                        self._inject(fault, launcher, now)
                self._restart_due(now)
                self._continue_due(done)
                time.sleep(0.25)
            code = launcher.returncode if launcher.returncode is not None else 1
            self._stop_own()
            self.ledger_checks.append(agreement(self.out))
            if code == 0 or f"fedlora deploy --resume {self.out}" not in last_line(self.out):
                break
            resume = True
        return launches, code

    def _mark(self, kind: str, partition: int | None, now: float) -> None:
        fault = next((f for f in self.faults if f.kind == kind and f.partition == partition and f.injected is None),
                     None)
        if fault is not None:
            fault.injected = now - self.began
        self.echo(f"  chaos: {kind}{'' if partition is None else f' node {partition}'} at "
                  f"{now - self.began:.0f} s")

    def _inject(self, fault: Fault, launcher: subprocess.Popen, now: float) -> None:
        if fault.kind == "superlink":
            superlink = self._superlink(launcher)
            if superlink is None:
                return
            self._signal(self._tree(superlink), signal.SIGKILL)
        elif fault.kind == "kill":
            if not self._kill_node(fault.partition, down=DOWN_SECONDS):
                return
        elif fault.kind == "stall":
            node = self._supernode(fault.partition)
            if node is None:
                return
            members = self._tree(node)
            self._signal(members, signal.SIGSTOP)
            self.stalled.append((fault.round, members))
        fault.injected = now - self.began
        self.echo(f"  chaos: {fault.kind}{'' if fault.partition is None else f' node {fault.partition}'} in round "
                  f"{fault.round} at {fault.injected:.0f} s")


# -- the checks ----------------------------------------------------------------------------------------------------
def last_line(out: Path) -> str:
    """The launcher log's last line that is not blank: the last launch's outcome."""
    lines = [line for line in (out.parent / f"{out.name}-launcher.log").read_text().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def agreement(out: Path) -> str:
    """The run's own ledger against its checkpoint: every release counted once (the sum of its phases' rounds)."""
    from fedlora.checkpoint import STATE_FILE, Checkpoint

    if not (out / STATE_FILE).is_file():
        return "ok"
    saved = Checkpoint.load(out)
    recorded = sum(p["rounds"] for p in saved.ledger["phases"]) if saved.ledger else 0
    if saved.releases != recorded:
        return f"the checkpoint has {saved.releases} releases, its ledger {recorded}"
    return "ok"


def verify(out: Path, outcome: Outcome, node_budget: float, ledger_checks: list[str], code: int) -> None:
    """Fills ``outcome``'s rows, status, last line and checks."""
    from fedlora.checkpoint import ENDED, Checkpoint
    from fedlora.experiment import load_run_config
    from fedlora.launch import complete_lines, node_ledger
    from fedlora.privacy.node_budget import NodeBudget

    config, *_ = load_run_config(out)
    # a row torn by a ServerApp killed as it wrote is not the run's: its checkpoint is
    outcome.rows = [json.loads(line) for line in complete_lines(out / "metrics.jsonl")]
    saved = Checkpoint.load(out)
    outcome.status = saved.status
    outcome.last_line = last_line(out)
    checks = outcome.checks
    ended = saved.status in ENDED and code == 0
    one_line = code != 0 and outcome.last_line.startswith("fedlora: error: ")
    checks["the run ends, or stops in one line"] = "ok" if ended or one_line else \
        f"exit {code}, status {saved.status}, last line {outcome.last_line!r}"
    needed = config.required_replies()
    short = [r["round"] for r in outcome.rows if r["replies"] < needed]
    checks[f"every round aggregated from at least min-replies ({needed})"] = \
        "ok" if not short else f"rounds {short} had fewer"
    problems = []
    by_release: dict[int, int] = {}
    for i in range(config.num_clients):
        ledger = NodeBudget(node_ledger(out, i), node_budget)
        records = ledger.records()
        releases = [r["release_id"] for r in records]
        if len(set(releases)) != len(releases):
            problems.append(f"node {i} recorded a release twice ({sorted(releases)})")
        if ledger.spent(records) > node_budget:
            problems.append(f"node {i} spent {ledger.spent(records):.3f} > {node_budget:g}")
        for release in releases:
            by_release[release] = by_release.get(release, 0) + 1
        for fault in outcome.faults:  # a node hit before the last round: did it take part again (a later round)?
            if fault.partition == i and fault.kind in ("kill", "stall") and fault.injected is not None and \
                    fault.round < len(outcome.rows):
                outcome.back[f"{fault.kind} node {i}"] = any(r["round"] > fault.round for r in records)
    # a row's releases: the count so far, so the id of the release its round aggregated
    uncounted = [r["round"] for r in outcome.rows if r["replies"] > by_release.get(r["releases"], 0)]
    if uncounted:
        problems.append(f"rounds {uncounted} aggregated more replies than the nodes recorded")
    checks[LEDGER_CHECK] = "ok" if not problems else "; ".join(problems)
    disagree = [c for c in ledger_checks if c != "ok"]
    checks["the run's ledger and checkpoint agree after every launch"] = "ok" if not disagree else disagree[0]
    checks["the final adapter loads"] = _adapter_loads(out, config)
    deadline = time.time() + 60  # a killed SuperNode's SuperExec notices its parent is gone and exits
    while (left := [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline", "status"])
                    if str(out) in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE]) \
            and time.time() < deadline:
        time.sleep(1)
    checks["no process left behind"] = "ok" if not left else f"{len(left)} processes (pids {left[:5]})"


def _adapter_loads(out: Path, config) -> str:
    if not (out / "adapter" / "adapter_config.json").is_file():
        return "no adapter written"
    from peft import PeftModel

    from fedlora.models import build_backbone

    try:
        PeftModel.from_pretrained(build_backbone(config.model, num_classes=config.classes), str(out / "adapter"))
    except Exception as error:  # noqa: BLE001 - the check reports what failed
        return f"{type(error).__name__}: {error}"
    return "ok"


# -- the report ----------------------------------------------------------------------------------------------------
def summary(outcome: Outcome) -> dict:
    """Rounds completed, faults injected and survived, replies lost, time lost to faults (each round's time past
    the median of the rounds no fault touched)."""
    rows = outcome.rows
    hit = {f.round for f in outcome.faults if f.injected is not None and f.kind != "garbage"}
    clean = [r["seconds"] for r in rows if r["round"] not in hit and r.get("seconds")]
    typical = float(np.median(clean)) if clean else math.nan
    lost_time = sum(max(0.0, r["seconds"] - typical) for r in rows if r["round"] in hit and r.get("seconds"))
    injected = [f for f in outcome.faults if f.injected is not None]
    return {"rounds completed": len(rows), "rounds planned": outcome.rounds, "launches": outcome.launches,
            "faults injected": len(injected), "faults survived": len(injected) if outcome.passed else None,
            "by kind": {k: sum(f.kind == k for f in injected) for k in KINDS},
            "replies lost": sum(r["sampled"] - r["replies"] for r in rows),
            "replies rejected": sum(r.get("rejected", 0) for r in rows),
            "nodes back after their fault": f"{sum(outcome.back.values())} of {len(outcome.back)}",
            "median round without faults (s)": typical, "time lost to faults in rounds (s)": lost_time,
            "seconds": outcome.seconds}


def write_results(outcome: Outcome, command: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.common import machine, provenance, save_figure

    facts = summary(outcome)
    (RESULTS / "chaos.json").write_text(json.dumps({"summary": facts, "outcome": {
        **{k: v for k, v in asdict(outcome).items() if k != "rows"},
        "rows": [{k: r.get(k) for k in ("round", "releases", "sampled", "replies", "failed", "rejected",
                                        "seconds", "accuracy", "epsilon", "first_failure")}
                 for r in outcome.rows]}}, indent=1) + "\n")
    lines = [*provenance("benchmarks.chaos"), "", f"`{command}` on {machine()}", "",
             f"{outcome.nodes} SuperNodes, {outcome.rounds} rounds, noise {outcome.placement}, seed {outcome.seed}: "
             f"{facts['rounds completed']} rounds completed in {outcome.launches} launches, "
             f"{facts['faults injected']} faults injected, replies lost {facts['replies lost']} "
             f"(rejected {facts['replies rejected']}), time lost to faults {facts['time lost to faults in rounds (s)']:.0f} s "
             f"in the rounds (median round without faults {facts['median round without faults (s)']:.1f} s); "
             f"{outcome.seconds / 60:.1f} min in all.", "",
             "| fault | round | node | at (s) | the node replied again |", "|---|---|---|---|---|"]
    lines += [f"| {f.kind} | {f.round} | {'SuperLink' if f.partition is None else f.partition} | "
              f"{'not reached' if f.injected is None else f'{f.injected:.0f}'} | "
              f"{ {True: 'yes', False: 'no', None: ''}[outcome.back.get(f'{f.kind} node {f.partition}')]} |"
              for f in outcome.faults]
    lines += ["", "| check | result |", "|---|---|"] + [f"| {k} | {v} |" for k, v in outcome.checks.items()]
    lines += ["", "| round | sampled | replies | failed | rejected | seconds | accuracy |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['round']} | {r['sampled']} | {r['replies']} | {r['failed']} | {r['rejected']} | "
              f"{r.get('seconds') or math.nan:.1f} | {r['accuracy'] if r['accuracy'] is None else round(r['accuracy'], 3)} |"
              for r in outcome.rows]
    lines += ["", f"The last line: `{outcome.last_line}`", ""]
    (RESULTS / "chaos.md").write_text("\n".join(lines))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    rounds = [r["round"] for r in outcome.rows]
    ax.bar(rounds, [r["replies"] for r in outcome.rows], color="tab:blue", label="replies aggregated")
    ax.bar(rounds, [r["sampled"] - r["replies"] for r in outcome.rows], bottom=[r["replies"] for r in outcome.rows],
           color="tab:red", label="replies lost")
    for f in outcome.faults:
        if f.injected is not None and f.partition is not None or f.kind == "superlink":
            ax.annotate(f.kind, (f.round, outcome.nodes + 0.3), ha="center", fontsize=7, rotation=90)
    ax.set(xlabel="round", ylabel="clients", ylim=(0, outcome.nodes * 1.4),
           title=f"Chaos: {outcome.nodes} SuperNodes under faults ({'all checks hold' if outcome.passed else 'a check failed'})")
    ax.legend(loc="lower right", fontsize=8)
    save_figure(fig, "chaos.png", f"{command} @ {machine()}")


def chaos(out: Path, *, nodes: int, rounds: int, seed: int, placement: str = "client", kills: int = 2,
          stalls: int = 1, superlink: bool = True, reply_timeout: float = 90.0, min_replies: int = 0,
          node_budget: float = 1000.0, deadline: float = 3600.0, echo=print) -> Outcome:
    """One chaos run into ``out`` (which must not exist); the outcome with its checks."""
    faults = schedule(np.random.default_rng(seed), nodes=nodes, rounds=rounds, kills=kills, stalls=stalls,
                      superlink=superlink)
    settings = {"num-clients": nodes, "clients-per-round": nodes, "num-rounds": rounds, "local-steps": 2,
                "train-examples": 40 * nodes, "test-examples": 100, "reply-timeout": reply_timeout,
                "noise-placement": f"'{placement}'", "target-epsilon": 0, "noise-multiplier": 2.0,
                "min-replies": min_replies or (max(3, nodes - 4) if placement == "secagg" else 0)}
    harness = Chaos(out, faults, nodes=nodes, settings=settings, node_budget=node_budget, deadline=deadline,
                    echo=echo)
    outcome = Outcome(nodes, rounds, placement, seed, faults)
    try:
        outcome.launches, code = harness.run()
    finally:
        harness._stop_own()
    outcome.seconds = time.time() - harness.began
    verify(out, outcome, node_budget, harness.ledger_checks, code)
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--placement", choices=("client", "secagg"), default="client")
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--stalls", type=int, default=1)
    parser.add_argument("--reply-timeout", type=float, default=90.0)
    parser.add_argument("--min-replies", type=int, default=0, help="0: the run's default (half the nodes; under "
                                                                   "secagg all but the faults' and two)")
    parser.add_argument("--out", type=Path, help="the run directory (default: a new one under /tmp, and the results "
                                                 "are committed to benchmarks/results/chaos.*)")
    args = parser.parse_args()
    if args.nodes < 3 or args.rounds < 2 or args.kills + args.stalls > args.rounds - 1:
        print("chaos: error: at least 3 nodes and 2 rounds, and at most a kill or stall a round after the first.",
              file=sys.stderr)
        sys.exit(2)
    import tempfile

    out = args.out or Path(tempfile.mkdtemp(prefix="chaos-")) / "run"
    if out.exists():
        print(f"chaos: error: '{out}' exists: give a new --out.", file=sys.stderr)
        sys.exit(2)
    out.parent.mkdir(parents=True, exist_ok=True)
    outcome = chaos(out, nodes=args.nodes, rounds=args.rounds, seed=args.seed, placement=args.placement,
                    kills=args.kills, stalls=args.stalls, reply_timeout=args.reply_timeout, min_replies=args.min_replies,
                    echo=lambda line: print(line, flush=True))
    facts = summary(outcome)
    print(json.dumps(facts, indent=1))
    for name, result in outcome.checks.items():
        print(f"  {'ok  ' if result == 'ok' else 'FAIL'} {name}{'' if result == 'ok' else f': {result}'}")
    if args.out is None:
        from benchmarks.common import command_line

        write_results(outcome, command_line("benchmarks.chaos"))
    sys.exit(0 if outcome.passed else 1)


if __name__ == "__main__":
    main()
