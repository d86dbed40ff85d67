"""Side by side with Apple's pfl-research (PyPI pfl 0.6.0), the simulator researchers in private FL pick for speed:
the same federation (`strategy = gm-ffa-lora`: updates clipped to tau, Gaussian noise of z tau on their sum added
by the server, the mean applied by server SGD) run by `fedlora run` and by pfl in its multi-process mode, on one
preset's model, partitions, cohorts, batches and z (benchmarks/pfl_run.py says how pfl is made to do exactly that
work), measured as a user meets them: the whole process tree of each command.

    python -m benchmarks.pfl_peer                                  # quickstart and fashion_mnist, 10 rounds each
    python -m benchmarks.pfl_peer --presets quickstart --repeats 3  # three interleaved pairs
    python -m benchmarks.pfl_peer --table-only                     # rewrite the tables from the json

pfl pins dp-accounting < 0.6, fedlora takes 0.6: pfl runs in an environment of its own, made here on first use
(--pfl-env, default .venv-pfl beside the repository: pfl and its two accountants, with a .pth file that puts this
environment's packages, torch and fedlora among them, behind its own). Before the runs, each preset's first client of
round 1 is trained by both (benchmarks/pfl_run.py --check-update): the updates must be bit-identical.

Each run reports the CPU seconds of its whole process tree (exact where a cpuacct cgroup can be made, else sampled,
benchmarks/process_cost.py), its wall time, the seconds before round 1 (from the command's start), round 1 and the
steady rounds (the median of the others), the CPU seconds of each (from the tree's CPU timeline), peak memory (PSS
of the tree) and the final accuracy; fedlora's CPU by process role, over the run and a steady round, says where its
time goes. pfl runs with as many processes as fedlora has Ray workers (--workers, one torch thread each), and draws
its own noise: the accuracies compare as runs of two seeds. Goals (issue 65): fedlora's CPU at most 1.1x pfl's,
its wall at most pfl's, its time before round 1 at most pfl's, its round 1 at most 1.5x its steady round, its peak
memory at most pfl's plus 1 GiB.
Results: benchmarks/results/pfl_peer.{json,md}; every run is kept in the json with its commit, so the table shows
the latest run of each preset and framework (all repeats of that commit).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS, command_line, machine, revision
from benchmarks.process_cost import measure

ROOT = Path(__file__).resolve().parent.parent
STORE = RESULTS / "pfl_peer.json"
STRATEGY = "gm-ffa-lora"  # the mechanism pfl's GaussianMechanism implements, noise on the sum at the server
PFL_PACKAGES = ["pfl==0.6.0", "dp-accounting>=0.5,<0.6", "prv-accountant>=0.2,<0.3"]
GiB = 1 << 30
GOALS = {"cpu": 1.1, "wall": 1.0, "before round 1": 1.0, "round 1 / steady": 1.5, "memory": GiB}


def pfl_python(env: Path) -> Path:
    """The Python of pfl's environment, made on first use: pfl and its pinned accountants without their dependencies,
    and a .pth file that adds this environment's packages (torch, PEFT, fedlora) behind its own."""
    python = env / "bin" / "python"
    marker = env / ".fedlora-pfl-ready"
    if marker.is_file():
        return python
    print(f"making pfl's environment in {env} ({', '.join(PFL_PACKAGES)})", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", *PFL_PACKAGES], check=True)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    here = sysconfig.get_paths()["purelib"]
    Path(purelib, "zz_fedlora.pth").write_text(f"import site; site.addsitedir({here!r})\n")  # processes its .pth files
    marker.write_text(" ".join(PFL_PACKAGES) + "\n")
    return python


def calibrated_z(preset: str, rounds: int) -> float:
    """fedlora's noise multiplier for the preset's target epsilon over ``rounds`` (pfl is given the same)."""
    from fedlora.config import load_config
    from fedlora.experiment import noise_for

    return noise_for(load_config(preset, [f"strategy={STRATEGY}", f"num-rounds={rounds}"])).noise_multiplier


def check_update(python: Path, preset: str) -> dict:
    """Round 1's first client trained by pfl and by fedlora: whether the updates are bit-identical."""
    out = subprocess.run([str(python), "-m", "benchmarks.pfl_run", "--config", preset, "--set",
                          f"strategy={STRATEGY}", "--check-update"], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"pfl's update check failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return json.loads(lines[-1])


def commands(framework: str, preset: str, rounds: int, out: Path, *, z: float, workers: int,
             python: Path) -> tuple[list[str], dict]:
    """The command a user of each framework runs, and its environment."""
    if framework == "fedlora":
        fedlora = Path(sys.executable).parent / "fedlora"
        return ([str(fedlora), "run", "--config", preset, "--set", f"strategy={STRATEGY}", "--set",
                 f"num-rounds={rounds}", "--out", str(out)], dict(os.environ))
    return ([str(python), "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={workers}", "-m",
             "benchmarks.pfl_run", "--config", preset, "--set", f"strategy={STRATEGY}", "--rounds", str(rounds),
             "--noise-multiplier", repr(z), "--out", str(out)], {**os.environ, "OMP_NUM_THREADS": "1"})


def run_one(framework: str, preset: str, rounds: int, work: Path, **kwargs) -> dict:
    """One measured run: its tree's cost and its rounds' timing."""
    out = work / f"{framework}-{preset}"
    shutil.rmtree(out, ignore_errors=True)
    command, env = commands(framework, preset, rounds, out, **kwargs)
    with open(f"{out}.log", "w") as log:
        cost = measure(command, cwd=ROOT, env=env, stdout=log)
    metrics = out / "metrics.jsonl"
    if cost.returncode or not metrics.is_file():
        raise RuntimeError(f"{framework} on {preset} failed (exit {cost.returncode}); see {out}.log")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    # a round lasts from its start to the next one's (the last: to its row): fedlora evaluates a round while the
    # next one trains, pfl between them; either way this is the run's pace
    starts = [row["started"] if row.get("started") is not None else row["time"] - row["seconds"] for row in rows]
    bounds = [*starts, rows[-1]["time"]]
    rounds = [b - a for a, b in zip(bounds, bounds[1:])]
    per_steady = {role: seconds / (len(rows) - 1)
                  for role, seconds in cost.role_cpu_between(bounds[1], bounds[-1]).items()}
    return {
        "framework": framework, "preset": preset, "rounds": len(rows), "cpu_seconds": cost.cpu_seconds,
        "cpu_exact": cost.cpu_exact, "wall_seconds": cost.wall_seconds, "before_round1": starts[0] - cost.started,
        "round1_seconds": rounds[0], "steady_seconds": statistics.median(rounds[1:]), "round_seconds": rounds,
        "cpu_before_round1": cost.cpu_between(cost.started, bounds[0]),
        "cpu_round1": cost.cpu_between(bounds[0], bounds[1]),
        "cpu_steady_round": cost.cpu_between(bounds[1], bounds[-1]) / (len(rows) - 1),
        "peak_pss_bytes": cost.peak_pss_bytes, "peak_pss_by_role": cost.peak_pss_by_role,
        "cpu_by_role": cost.sampled_cpu_by_role, "steady_cpu_by_role": per_steady,
        "before_round1_cpu_by_role": cost.role_cpu_between(cost.started, bounds[0]),
        "started_by_role": cost.started_by_role, "accuracy": rows[-1]["accuracy"],
        "accuracies": [row["accuracy"] for row in rows],
    }


def _latest(store: dict) -> dict[str, dict[str, list[dict]]]:
    """preset -> framework -> the runs of the newest commit that measured the preset."""
    out: dict[str, dict[str, list[dict]]] = {}
    for preset in dict.fromkeys(run["preset"] for run in store["runs"]):
        runs = [run for run in store["runs"] if run["preset"] == preset]
        commit = runs[-1]["commit"]
        out[preset] = {fw: [r for r in runs if r["commit"] == commit and r["framework"] == fw]
                       for fw in ("fedlora", "pfl")}
    return out


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def write_tables(store: dict) -> None:
    lines = ["# fedlora against pfl-research: the same federation, CPU, wall and memory", "",
             "The quickstart's and the fashion_mnist preset's task with `strategy = gm-ffa-lora` (updates clipped, "
             "Gaussian noise on their sum at the server, the mean applied by server SGD), 10 rounds, run by `fedlora "
             "run` (Flower's SuperLink, simulation engine and Ray workers) and by pfl-research 0.6.0 in its "
             "multi-process mode (torchrun, one process per fedlora Ray worker, one torch thread each), on the same "
             "model, partitions, cohorts, batches and z: each framework's command as a user runs it, measured over "
             "its whole process tree (benchmarks/process_cost.py). Medians over the runs listed; pfl draws its own "
             "noise, so accuracies compare as two seeds.", ""]
    for preset, by in _latest(store).items():
        fed, pfl = by["fedlora"], by["pfl"]
        if not fed or not pfl:
            continue
        check = store.get("checks", {}).get(preset, {})
        lines += [f"## {preset}", "",
                  f"Runs: {len(fed)} of each, interleaved; commit {fed[0]['commit']}; {fed[0]['machine']}; "
                  f"`{fed[0]['command']}`  ",
                  f"Round 1's first client, trained by both: update bit-identical: {check.get('identical')} "
                  f"(largest difference {check.get('max_abs_diff')}, {check.get('entries')} entries).", "",
                  "| | fedlora | pfl | fedlora / pfl | goal | met |", "|---|---:|---:|---:|---|---|"]
        cpu = (_median(fed, "cpu_seconds"), _median(pfl, "cpu_seconds"))
        wall = (_median(fed, "wall_seconds"), _median(pfl, "wall_seconds"))
        before = (_median(fed, "before_round1"), _median(pfl, "before_round1"))
        first = (_median(fed, "round1_seconds"), _median(pfl, "round1_seconds"))
        steady = (_median(fed, "steady_seconds"), _median(pfl, "steady_seconds"))
        memory = (_median(fed, "peak_pss_bytes"), _median(pfl, "peak_pss_bytes"))
        ratio = first[0] / steady[0]
        exact = "exact" if all(r["cpu_exact"] for r in fed + pfl) else "sampled"
        rows = [
            (f"CPU seconds, whole tree ({exact})", cpu, f"<= {GOALS['cpu']}x pfl", cpu[0] <= GOALS["cpu"] * cpu[1]),
            ("wall seconds", wall, "<= pfl", wall[0] <= wall[1]),
            ("seconds before round 1", before, "<= pfl", before[0] <= before[1]),
            ("round 1, seconds", first, f"<= {GOALS['round 1 / steady']}x fedlora's steady round "
                                        f"(is {ratio:.2f}x)", ratio <= GOALS["round 1 / steady"]),
            ("steady round, seconds", steady, "", None),
            ("CPU seconds before round 1", (_median(fed, "cpu_before_round1"), _median(pfl, "cpu_before_round1")),
             "", None),
            ("CPU seconds of round 1", (_median(fed, "cpu_round1"), _median(pfl, "cpu_round1")), "", None),
            ("CPU seconds a steady round", (_median(fed, "cpu_steady_round"), _median(pfl, "cpu_steady_round")),
             "", None),
            ("peak memory (PSS), GiB", (memory[0] / GiB, memory[1] / GiB), "<= pfl + 1 GiB",
             memory[0] <= memory[1] + GOALS["memory"]),
            ("final accuracy", (_median(fed, "accuracy"), _median(pfl, "accuracy")), "", None),
        ]
        for name, (a, b), goal, met in rows:
            lines.append(f"| {name} | {a:.3g} | {b:.3g} | {a / b:.2f} | {goal} | "
                         f"{'' if met is None else ('met' if met else 'MISSED')} |")
        lines += ["", "Where each framework's CPU goes (each one's last run): over the run, before round 1, and a "
                      "steady round's share (CPU seconds sampled per process, by role; the tree's exact total above "
                      "also counts what ended between samples), with each role's share of the peak memory:", "",
                  "| framework | process | CPU seconds, the run | before round 1 | a steady round | at peak PSS, MiB |",
                  "|---|---|---:|---:|---:|---:|"]
        for run in (fed[-1], pfl[-1]):
            for role, seconds in run["cpu_by_role"].items():
                lines.append(f"| {run['framework']} | {role} | {seconds:.1f} | "
                             f"{run.get('before_round1_cpu_by_role', {}).get(role, 0.0):.1f} | "
                             f"{run['steady_cpu_by_role'].get(role, 0.0):.2f} | "
                             f"{run['peak_pss_by_role'].get(role, 0) / 2 ** 20:.0f} |")
        last = fed[-1]
        lines += ["", "When each process started, seconds after the command: " + ", ".join(
            f"{role} {seconds:.1f}" for role, seconds in last["started_by_role"].items()) + ".", ""]
    lines += store.get("notes", [])
    (RESULTS / "pfl_peer.md").write_text("\n".join(lines).rstrip() + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="quickstart,fashion_mnist")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1, help="interleaved pairs of runs per preset")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="pfl's processes (fedlora's Ray workers: one per CPU at client-cpus = 1)")
    parser.add_argument("--pfl-env", type=Path, default=ROOT / ".venv-pfl")
    parser.add_argument("--work", type=Path, help="where the runs' directories go (default: a temporary folder)")
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    store = json.loads(STORE.read_text()) if STORE.is_file() else {"runs": [], "checks": {}}
    if not args.table_only:
        python = pfl_python(args.pfl_env)
        presets = args.presets.split(",")
        where = {"commit": revision(), "machine": machine(), "command": command_line("benchmarks.pfl_peer"),
                 "load_before": os.getloadavg()[0]}
        for preset in presets:
            store["checks"][preset] = check_update(python, preset)
            print(f"{preset}: update bit-identical: {store['checks'][preset]['identical']}", flush=True)
        z = {preset: calibrated_z(preset, args.rounds) for preset in presets}
        with tempfile.TemporaryDirectory() as tmp:
            work = args.work or Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            for repeat in range(args.repeats):
                for preset in presets:
                    order = ("fedlora", "pfl") if repeat % 2 == 0 else ("pfl", "fedlora")
                    for framework in order:
                        started = time.time()
                        run = run_one(framework, preset, args.rounds, work, z=z[preset], workers=args.workers,
                                      python=python)
                        store["runs"].append({**run, **where, "repeat": repeat, "z": z[preset]})
                        STORE.write_text(json.dumps(store, indent=1) + "\n")
                        print(f"{preset} {framework}: {run['cpu_seconds']:.0f} CPU s, {run['wall_seconds']:.0f} s "
                              f"wall, {run['before_round1']:.1f} s before round 1, round 1 {run['round1_seconds']:.1f}"
                              f" s, steady {run['steady_seconds']:.1f} s, {run['peak_pss_bytes'] / GiB:.2f} GiB, "
                              f"accuracy {run['accuracy']} ({time.time() - started:.0f} s)", flush=True)
    write_tables(store)
    print(f"wrote {RESULTS / 'pfl_peer.md'}")


if __name__ == "__main__":
    main()
