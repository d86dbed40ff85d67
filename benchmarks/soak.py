"""Memory over long runs (issue 67): a federation of several hundred rounds, small model and cohort, in simulation
(`fedlora run`: the SuperLink, the ServerApp's process, Ray's workers) and in deployment (`fedlora deploy`: the
SuperLink, the ServerApp, SuperNodes and their ClientApp processes), with the resident memory (RSS) of every
process of the launch sampled from outside four times a second and the run directory's size beside it.

Per round and role (benchmarks.process_cost's: the ServerApp, or the simulation's Ray driver that runs it; Ray's
workers or the ClientApps; the SuperNodes, the SuperLink, Ray's daemons, the launcher) it
keeps the least RSS seen between the round's end and the next's (what the processes hold across rounds, not what
a round allocates and frees) and the most. After the warm-up (the first fifth of the rounds) it fits a line to the
least: the slope in MiB a round with its 95% interval. A role grows when the interval's lower end passes the
tolerance; the interval is ordinary least squares', which treats rounds as independent, so it is narrower than
the truth where memory moves in steps. The run directory's size is fitted the same way, in bytes a round.

`--plant-leak MIB` makes the server keep MIB more every round (a sitecustomize on the launch's PYTHONPATH wraps the
ServerApp's per-round row writer): the check that the soak finds a leak when there is one.

    python -m benchmarks.soak                                  # the committed run: results/soak.{md,json,png}
    python -m benchmarks.soak --modes deployment --deployment-nodes 1 --deployment-rounds 300   # one mode again:
                                                               # the committed file keeps the other's
    python -m benchmarks.soak --modes simulation --rounds 30 --out DIR [--plant-leak 16]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

from benchmarks.common import RESULTS, command_line, machine, revision, save_figure
from benchmarks.process_cost import _tree, role_of

NAME = "soak"
MODES = ("simulation", "deployment")
SMALL = {"num-clients": 6, "clients-per-round": 3, "local-steps": 1, "train-examples": 240, "test-examples": 60,
         "noise-placement": "'client'", "message": "'adapter'", "target-epsilon": 0, "noise-multiplier": 1.0}
DEPLOY_NODES = 2
SAMPLE_SECONDS = 0.25
WARM_UP = 0.2  # the fraction of the rounds left out of the fit
TOLERANCE_MIB = 0.05  # a round: 20 MiB over the paper preset's 400 rounds

LEAK_SITE = '''"""benchmarks.soak --plant-leak: the ServerApp's row writer keeps {mib} MiB more every round."""
import importlib.machinery, sys

class _Leak:
    def find_spec(self, name, path=None, target=None):
        if name != "fedlora.experiment":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            complete, kept = module.RunRecorder._complete, []

            def leaking(self, *args, **kwargs):
                kept.append(bytearray(b"x") * ({mib} << 20))  # written, so resident
                return complete(self, *args, **kwargs)
            module.RunRecorder._complete = leaking
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Leak())
'''


def dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def rounds_done(out: Path) -> int:
    with contextlib.suppress(OSError):
        return sum(1 for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip())
    return 0


class Sampler(threading.Thread):
    """Samples the launch's process tree: per round done, each role's least and most RSS (MiB) and process count,
    and the run directory's bytes."""

    def __init__(self, launcher: psutil.Process, out: Path):
        super().__init__(daemon=True)
        self.launcher, self.out, self.stop = launcher, out, threading.Event()
        self.rounds: dict[int, dict] = {}

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_SECONDS):
            done = rounds_done(self.out)
            with contextlib.suppress(psutil.NoSuchProcess):
                rss: dict[str, list[float]] = {}
                for process in _tree(self.launcher):
                    with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                        rss.setdefault(role_of(process.cmdline()), []).append(
                            process.memory_info().rss / 2**20)
                row = self.rounds.setdefault(done, {"least": {}, "most": {}, "processes": {}, "samples": 0})
                row["samples"] += 1
                for name, values in rss.items():
                    total = sum(values)
                    row["least"][name] = min(row["least"].get(name, math.inf), total)
                    row["most"][name] = max(row["most"].get(name, 0.0), total)
                    row["processes"][name] = len(values)
                row["dir_bytes"] = dir_bytes(self.out)


def settings(mode: str, rounds: int, config: str | None, deployment_nodes: int = DEPLOY_NODES) -> dict:
    """What the soak sets over the small federation (without ``config``) or the preset: its rounds, an evaluation
    every tenth of them, and a deployment's SuperNodes, every node every round."""
    nodes = {"num-clients": deployment_nodes, "clients-per-round": deployment_nodes} if mode == "deployment" else {}
    return {**({} if config else SMALL), **nodes, "num-rounds": rounds, "eval-every": max(rounds // 10, 1)}


def federation(mode: str, config: str | None, sets: list[str], deployment_nodes: int = DEPLOY_NODES) -> str:
    """The federation a mode's run soaked, in words, for its table."""
    what = (f"the {config} preset" if config else "the small model and cohort (the tiny ViT at 32 px, LoRA r = 4, "
            "noise at the client)") + "".join(f", --set {s}" for s in sets)
    if mode == "deployment":
        return f"{what}; {deployment_nodes} SuperNode{'s' * (deployment_nodes > 1)} on loopback, every node every round"
    clients = "" if config else f"; {SMALL['num-clients']} clients, {SMALL['clients-per-round']} a round"
    return what + clients


def launch(mode: str, out: Path, rounds: int, config: str | None, sets: list[str], plant_leak: int,
           deployment_nodes: int = DEPLOY_NODES, echo=print) -> tuple[int, dict[int, dict], float]:
    """One run of ``mode`` into ``out``; (its exit code, the sampler's rounds, seconds)."""
    fedlora = str(Path(sys.executable).parent / "fedlora")
    args = [fedlora, "run" if mode == "simulation" else "deploy", "--out", str(out)]
    args += ["--config", config] if config else []
    args += [f"--set={k}={v}" for k, v in settings(mode, rounds, config, deployment_nodes).items()]
    args += [f"--set={s}" for s in sets]
    env = dict(os.environ)
    site = tempfile.TemporaryDirectory(prefix="soak-leak-")
    if plant_leak:
        (Path(site.name) / "sitecustomize.py").write_text(LEAK_SITE.format(mib=int(plant_leak)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [site.name, env.get("PYTHONPATH")]))
    started = time.time()
    with site, (out.parent / f"{out.name}-launcher.log").open("w") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        sampler = Sampler(psutil.Process(process.pid), out)
        sampler.start()
        shown = 0
        while process.poll() is None:
            time.sleep(1.0)
            if (done := rounds_done(out)) >= shown + max(rounds // 10, 1):
                shown = done
                echo(f"  {mode}: round {done}/{rounds}, {time.time() - started:.0f} s")
        sampler.stop.set()
        sampler.join()
    return process.returncode, sampler.rounds, time.time() - started


def slope(x: np.ndarray, y: np.ndarray) -> dict:
    """Least squares' slope of y on x with its 95% interval, and the fit's largest residual."""
    from scipy import stats

    fit = stats.linregress(x, y)
    half = stats.t.ppf(0.975, len(x) - 2) * fit.stderr
    residual = y - (fit.intercept + fit.slope * x)
    return {"slope": float(fit.slope), "low": float(fit.slope - half), "high": float(fit.slope + half),
            "max_residual": float(np.abs(residual).max()), "rounds": len(x)}


def analyse(rounds: dict[int, dict], total: int, tolerance: float = TOLERANCE_MIB, by_most: tuple[str, ...] = ()) -> dict:
    """Each role's growth after the warm-up (MiB a round) and verdict, and the run directory's (bytes a round).
    Roles in ``by_most`` live for one message (a deployment's ClientApps): nothing of theirs outlives a round, so
    they are fitted on their most a round (their least is whichever had just started) and not judged; their most
    sums the processes alive together, more of them when rounds are slow."""
    done = sorted(r for r in rounds if 1 <= r < total)  # after the last round the launch ends its processes
    after = [r for r in done if r > total * WARM_UP]
    out = {"roles": {}, "tolerance_mib": tolerance, "warm_up_rounds": int(total * WARM_UP)}
    if len(after) < 5:
        return {**out, "error": f"only {len(after)} rounds sampled after the warm-up"}
    names = dict.fromkeys(name for r in after for name in rounds[r]["least"])
    for name in names:
        xs = np.array([r for r in after if name in rounds[r]["least"]], dtype=float)
        ys = np.array([rounds[int(r)]["most" if name in by_most else "least"][name] for r in xs])
        if len(xs) < 5:
            continue
        fit = slope(xs, ys)
        out["roles"][name] = {**fit, "first": float(ys[0]), "last": float(ys[-1]),
                              "most": float(max(rounds[int(r)]["most"][name] for r in xs)),
                              "processes": max(rounds[int(r)]["processes"][name] for r in xs),
                              "fitted": "most" if name in by_most else "least",
                              "grows": None if name in by_most else bool(fit["low"] > tolerance)}
    xs = np.array(after, dtype=float)
    out["dir"] = {**slope(xs, np.array([rounds[r]["dir_bytes"] for r in after], dtype=float)),
                  "bytes": rounds[after[-1]]["dir_bytes"]}
    return out


def verdict(analysis: dict) -> str:
    if "error" in analysis:
        return analysis["error"]
    grows = [f"{name} {fit['slope']:+.3f} MiB a round [{fit['low']:+.3f}, {fit['high']:+.3f}]"
             for name, fit in analysis["roles"].items() if fit["grows"]]  # None: a process a message, not judged
    return ("grows: " + "; ".join(grows)) if grows else \
        f"no role grows beyond {analysis['tolerance_mib']:g} MiB a round after the warm-up"


def with_committed_modes(results: dict, committed: Path) -> dict:
    """``results`` with the committed file's runs of the modes it did not run (each keeps its command, commit and
    machine)."""
    kept = json.loads(committed.read_text())["modes"] if committed.is_file() else {}
    modes = {mode: results["modes"].get(mode) or kept[mode] for mode in MODES if mode in results["modes"] or mode in kept}
    return {**results, "modes": modes}


def write_results(results: dict) -> None:
    lines = ["# Memory over long runs: RSS by role and the run directory, round by round", "",
             "Each mode's federation is named under it; evaluated every tenth of the run. RSS sampled from "
             f"outside every {SAMPLE_SECONDS} s; per round the least seen between its end and the next's (the "
             "deployment's ClientApps, a process a message: the most); a line "
             f"fitted after the first {WARM_UP:.0%} of the rounds (the interval: least squares', rounds taken as "
             f"independent). A role grows when its interval's lower end passes {TOLERANCE_MIB} MiB a round.", ""]
    for mode, run in results["modes"].items():
        a = run["analysis"]
        nodes = f" of {run['nodes']} SuperNode{'s' * (run['nodes'] > 1)}" if mode == "deployment" else ""
        lines += [f"## {mode.capitalize()}: {run['rounds_done']} rounds{nodes} in {run['seconds'] / 60:.1f} min, "
                  f"exit {run['code']}", "", f"Federation: {run.get('federation') or federation(mode, None, [], run['nodes'])}  ",
                  f"Command: `{run['command']}` at {run['commit']}  ",
                  f"Machine: {run['machine']}" + (f"; a leak of {run['plant_leak_mib']} MiB a round planted in the "
                                                  "server" if run["plant_leak_mib"] else "") + "  ",
                  f"Verdict: {verdict(a)}.", ""]
        if "error" in a:
            continue
        lines += ["| role | processes | RSS after the warm-up, MiB | at the end | most seen | slope, MiB a round | "
                  "95% interval | largest residual, MiB |", "|---|---:|---:|---:|---:|---:|---|---:|"]
        lines += [f"| {name}{' (a process a message, most a round: not judged)' if f['grows'] is None else ''} | "
                  f"{f['processes']} | {f['first']:.1f} | {f['last']:.1f} | {f['most']:.1f} | "
                  f"{f['slope']:+.4f} | [{f['low']:+.4f}, {f['high']:+.4f}] | {f['max_residual']:.1f} |"
                  for name, f in a["roles"].items()]
        d = a["dir"]
        lines += ["", f"Run directory: {d['bytes'] / 2**20:.2f} MiB at the end, growing {d['slope'] / 1024:.2f} KiB a "
                  f"round [{d['low'] / 1024:.2f}, {d['high'] / 1024:.2f}] (largest departure from the line "
                  f"{d['max_residual'] / 1024:.1f} KiB): about {d['slope'] * 400 / 2**20:.1f} MiB over 400 rounds.", ""]
    lines += [f"![RSS by round]({NAME}.png)", ""]
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines))
    (RESULTS / f"{NAME}.json").write_text(json.dumps(results, indent=1) + "\n")
    _plot(results)


def _plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results["modes"].items())
    fig, axes = plt.subplots(1, len(modes) + 1, figsize=(5 * (len(modes) + 1), 4))
    for ax, (mode, run) in zip(axes, modes):
        rounds = {int(r): v for r, v in run["samples"].items() if 1 <= int(r) < run["rounds"]}  # not the end's
        for name, fit in run["analysis"].get("roles", {}).items():
            xs = [r for r in sorted(rounds) if name in rounds[r][fit["fitted"]]]
            ax.plot(xs, [rounds[r][fit["fitted"]][name] for r in xs],
                    label=name + (" (most)" if fit["fitted"] == "most" else ""))
        ax.set_title(f"{mode}: RSS a round (least), by role")
        ax.set_xlabel("round")
        ax.set_ylabel("MiB")
        ax.legend(fontsize=7)
    for mode, run in modes:
        rounds = {int(r): v for r, v in run["samples"].items()}
        xs = [r for r in sorted(rounds) if r >= 1]
        axes[-1].plot(xs, [rounds[r]["dir_bytes"] / 2**20 for r in xs], label=mode)
    axes[-1].set_title("run directory")
    axes[-1].set_xlabel("round")
    axes[-1].set_ylabel("MiB")
    axes[-1].legend(fontsize=7)
    save_figure(fig, NAME, "; ".join(dict.fromkeys(run["command"] for _, run in modes)))


def soak(work: Path, *, modes: tuple[str, ...], rounds: int, config: str | None = None, sets: list[str] = (),
         plant_leak: int = 0, tolerance: float = TOLERANCE_MIB, deployment_rounds: int = 0,
         deployment_nodes: int = DEPLOY_NODES, command: str = "", echo=print) -> dict:
    """Each mode's run under ``work`` (which must not exist), sampled and analysed."""
    work.mkdir(parents=True)
    out = {"tolerance_mib": tolerance, "modes": {}}
    made = {"command": command, "commit": revision(), "machine": machine(), "plant_leak_mib": plant_leak}
    for mode in modes:
        total = deployment_rounds if mode == "deployment" and deployment_rounds else rounds
        code, samples, seconds = launch(mode, work / mode, total, config, list(sets), plant_leak, deployment_nodes,
                                        echo)
        analysis = analyse(samples, total, tolerance, by_most=("ClientApp",))
        out["modes"][mode] = {**made, "code": code, "seconds": seconds,
                              "federation": federation(mode, config, list(sets), deployment_nodes),
                              "nodes": deployment_nodes if mode == "deployment" else None if config else SMALL["num-clients"],
                              "rounds": total, "rounds_done": rounds_done(work / mode),
                              "analysis": analysis, "samples": {str(r): v for r, v in sorted(samples.items())}}
        echo(f"{mode}: exit {code}, {rounds_done(work / mode)} rounds in {seconds:.0f} s; {verdict(analysis)}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--deployment-rounds", type=int, default=0,
                        help="the deployment's rounds, where they differ (its ClientApp starts anew every message)")
    parser.add_argument("--deployment-nodes", type=int, default=DEPLOY_NODES, help="the deployment's SuperNodes")
    parser.add_argument("--modes", default=",".join(MODES), help="simulation, deployment or both (without --out, "
                                                                 "the committed results keep the other mode's run)")
    parser.add_argument("--config", help="a preset instead of the small federation (e.g. cifar100_private on a GPU)")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    parser.add_argument("--plant-leak", type=int, default=0, metavar="MIB",
                        help="the server keeps MIB more every round (the check that the soak finds a leak)")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE_MIB, help="MiB a round a role may grow")
    parser.add_argument("--out", type=Path, help="work here and write no committed results")
    parser.add_argument("--render", action="store_true", help="analyse the committed samples again and rewrite the "
                                                              "table and figure (the command stays the run's)")
    args = parser.parse_args(argv)
    if args.render:
        results = json.loads((RESULTS / f"{NAME}.json").read_text())
        for mode, run in results["modes"].items():
            samples = {int(r): v for r, v in run["samples"].items()}
            run["analysis"] = analyse(samples, run["rounds"], results.get("tolerance_mib", TOLERANCE_MIB),
                                      by_most=("ClientApp",))
        write_results(results)
        return 0
    modes = tuple(m.strip() for m in args.modes.split(","))
    unknown = [m for m in modes if m not in MODES]
    if unknown or min(args.rounds, args.deployment_rounds or 10) < 10 or args.deployment_nodes < 1:
        print(f"{NAME}: error: --modes takes {' or '.join(MODES)}" + (f" (not {', '.join(unknown)})" if unknown else "")
              + ", --rounds and --deployment-rounds at least 10 and --deployment-nodes at least 1.", file=sys.stderr)
        return 2
    work = args.out or Path(tempfile.mkdtemp(prefix="soak-")) / "work"
    if args.out is not None and args.out.exists():
        print(f"{NAME}: error: {args.out} exists; give a new directory.", file=sys.stderr)
        return 2
    results = soak(work, modes=modes, rounds=args.rounds, config=args.config, sets=args.set,
                   plant_leak=args.plant_leak, tolerance=args.tolerance, deployment_rounds=args.deployment_rounds,
                   deployment_nodes=args.deployment_nodes, command=command_line(f"benchmarks.{NAME}"))
    if args.out is None:
        write_results(with_committed_modes(results, RESULTS / f"{NAME}.json"))
    else:
        (args.out / f"{NAME}.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0 if all(m["code"] == 0 for m in results["modes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
