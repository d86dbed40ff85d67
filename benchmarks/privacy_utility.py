"""The privacy-utility frontier at a preset's setting (the quickstart's by default): final test accuracy against
epsilon for the private strategies under each noise placement, accuracy against the cohort size N at epsilon 8, and
the upload per client it takes to reach an accuracy.

    python -m benchmarks.privacy_utility                          # everything, seeds 0 and 1 (hours here)
    python -m benchmarks.privacy_utility --config fashion_mnist   # the same on real data (a day on 2 cores)
    python -m benchmarks.privacy_utility --parts frontier --epsilons 8 --seeds 0
    python -m benchmarks.privacy_utility --config fashion_mnist --parts rounds --epsilons 2,8 --seeds 0
    python -m benchmarks.privacy_utility --workers 2     # two runs at a time, one torch thread each
    python -m benchmarks.privacy_utility --strategies gm-ffa-lora --placements server,secagg --epsilons 8 \
        --seeds 0,1,2,3,4,5                               # more seeds of one comparison
Results: benchmarks/results/privacy_utility.{md,csv,json} and privacy_utility_{epsilon,cohort}.png (with --config
NAME: privacy_utility_NAME.* and privacy_utility_NAME_{epsilon,cohort}.png). Runs are in
process (fedlora's ServerApp and ClientApp over an in-process Grid: the protocol, strategy and accountant of
`fedlora run`, without Ray); each finished run is saved in the json at once, so an interrupted benchmark
continues where it stopped. The options choose the runs to run; the tables and plots always show every finished run
in the json (`--table-only` rewrites them), so a frontier run piece by piece keeps one table.

The rounds part (not run by default) spreads the same budget over T = 10 rounds instead of the preset's: each round
then gets less noise (a smaller z), evaluated every T / 6 rounds as the preset's T = 30 is every 5.

Every strategy runs the preset's form: clients send updates (FlexLoRA: the change of each product B A), applied by
server SGD. The FlexLoRA runs of the adapter form measured before are kept under keys ending "|message=adapter",
outside the tables. Secure aggregation (noise in shares under SecAgg+) runs at its default min-replies (N_min = 90%
of N: 45 of 50 on images, 90 of 100 on text).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.common import RESULTS, command_line, machine, revision, run_inprocess, save_figure, worker_pool
from fedlora.algorithms import get_algorithm
from fedlora.config import RunConfig, load_config
from fedlora.experiment import noise_for
from fedlora.privacy.events import Observer, observer_label, other_observers

PRIVATE = ("gm-ffa-lora", "sgmm-ffa-lora", "sgmv-ffa-lora", "gm-flexlora", "sgmm-flexlora")
REFERENCE = {"ffa": "ffa-lora", "flex": "flexlora"}
PLACEMENTS = ("client", "server", "secagg")
# Noise at the server with Poisson sampling, so that target-epsilon is in the field's convention (add/remove
# neighbours; Opacus, TF Privacy, pfl-research): where fedlora's curve sits in the units other tools print.
POISSON = "poisson"
EPSILONS = (1.0, 2.0, 4.0, 8.0)
COHORTS = (5, 10, 25, 50, 100)  # N at the preset's C
COHORT_STRATEGIES = ("gm-ffa-lora", "sgmm-ffa-lora")  # also those of accuracy against T
ROUNDS = (10, 30)  # T, the rounds one budget is spread over (30: the fashion_mnist preset's)


def stem(preset: str | None) -> str:
    """The results' file name stem: each preset's runs are stored and tabled apart."""
    return "privacy_utility" + (f"_{preset}" if preset else "")


def _family(strategy: str) -> str:
    return get_algorithm(strategy).family.value


def plan(parts: list[str], epsilons: list[float], seeds: list[int], strategies: list[str] | None = None,
         placements: list[str] | None = None, min_replies: int | None = None, preset: str | None = None,
         check: bool = True) -> list[dict]:
    """Every run with its config (with ``check``, calibrated before the first starts); ``strategies`` and
    ``placements`` (default all) restrict it, the non-private references counting as placement "-";
    ``min_replies``: secagg's N_min instead of its default (such runs are stored under their own keys); ``preset``:
    the packaged config the runs start from (default: the quickstart's)."""
    cases = []  # (part, strategy, placement, epsilon, N, T); None: the preset's
    if "frontier" in parts:
        for strategy in PRIVATE:
            cases += [("frontier", strategy, placement, eps, None, None) for eps in epsilons
                      for placement in PLACEMENTS]
        cases += [("frontier", reference, "-", math.inf, None, None) for reference in REFERENCE.values()]
        cases += [("frontier", strategy, POISSON, eps, None, None) for strategy in COHORT_STRATEGIES
                  for eps in epsilons]
    if "cohort" in parts:
        for n in COHORTS:
            cases += [("cohort", s, "server", 8.0, n, None) for s in COHORT_STRATEGIES]
            cases.append(("cohort", REFERENCE["ffa"], "-", math.inf, n, None))
    if "rounds" in parts:
        cases += [("rounds", s, "server", eps, None, t) for t in ROUNDS for s in COHORT_STRATEGIES for eps in epsilons]
    for name, chosen, known in (("strategy", strategies, (*PRIVATE, *REFERENCE.values())),
                                ("placement", placements, (*PLACEMENTS, POISSON, "-"))):
        if unknown := [c for c in chosen or () if c not in known]:
            raise ValueError(f"Unknown {name} '{unknown[0]}'; choose from {', '.join(known)}.")
    cases = [c for c in cases if (strategies is None or c[1] in strategies)
             and (placements is None or c[2] in placements)]
    runs = []
    preset_config = load_config(preset)
    for part, strategy, placement, eps, n, rounds in cases:
        for seed in seeds:
            # fp32 wherever a run computes (auto is bf16-backbone on a GPU): a lent GPU runs the CPU's computation
            values = {"strategy": strategy, "seed": seed, "precision": "fp32"}
            if placement == POISSON:
                values["noise-placement"], values["sampling"] = "server", "poisson"
            elif placement != "-":
                values["noise-placement"] = placement
            if eps != math.inf:
                values["target-epsilon"] = eps
            if n is not None:
                values["clients-per-round"] = n
            if rounds is not None and rounds != preset_config.num_rounds:
                values["num-rounds"] = rounds
                values["eval-every"] = max(1, round(rounds * preset_config.eval_every / preset_config.num_rounds))
            variant = ""
            if min_replies is not None and placement == "secagg":
                values["min-replies"], variant = min_replies, f"|min-replies={min_replies}"
            config = load_config(preset, [f"{k}={json.dumps(v) if isinstance(v, str) else v}"
                                          for k, v in values.items()])
            # at the preset's N and T a cohort or rounds run is the frontier's run: it is run (and stored) once
            same = part != "frontier" and config.clients_per_round == preset_config.clients_per_round \
                and config.num_rounds == preset_config.num_rounds
            variant += f"|T={config.num_rounds}" if config.num_rounds != preset_config.num_rounds else ""
            runs.append({"part": part, "strategy": strategy, "placement": placement, "epsilon": eps, "seed": seed,
                         "n": config.clients_per_round, "rounds": config.num_rounds, "config": config,
                         "key": f"{'frontier' if same else part}|{strategy}|{placement}|{eps}|"
                                f"{config.clients_per_round}|{seed}{variant}"})
    for run in runs if check else ():
        noise_for(run["config"])  # an unreachable target fails here, before any run
    return runs


def finished(done: dict, min_replies: int | None = None, preset: str | None = None) -> list[dict]:
    """The runs the tables show: every run of the preset's plan (at any epsilon and seed) that ``done`` holds; with
    ``min_replies``, the secagg runs at that N_min in place of those at the default."""
    fields = [key.split("|") for key in done]
    epsilons = sorted({float(f[3]) for f in fields} - {math.inf})
    seeds = sorted({int(f[5]) for f in fields})
    return [run for run in plan(["frontier", "cohort", "rounds"], epsilons, seeds, min_replies=min_replies,
                                preset=preset, check=False) if run["key"] in done]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="the packaged preset the runs start from (default: the quickstart's; "
                                         "fashion_mnist: the real-data preset)")
    parser.add_argument("--parts", help="frontier, cohort, rounds, comma-separated (default: frontier,cohort)")
    parser.add_argument("--epsilons", help=f"default: {','.join(f'{e:g}' for e in EPSILONS)}")
    parser.add_argument("--seeds", help="default: 0,1")
    parser.add_argument("--strategies", help="only these (comma-separated; default: all)")
    parser.add_argument("--placements", help="only these noise placements (client, server, secagg; poisson for noise "
                                             "at the server with Poisson sampling, the field's convention; '-' for "
                                             "the non-private references; default: all)")
    parser.add_argument("--table-only", action="store_true",
                        help="rewrite the tables and plots (every finished run in the json) and run nothing")
    parser.add_argument("--workers", type=int, default=1,
                        help="runs at a time, each in its own process with cores / workers torch threads (on 2 "
                             "cores, 2 workers finish about 1.3x more runs per hour than 1: tiny matrices scale "
                             "poorly across threads)")
    parser.add_argument("--min-replies", type=int, help="secagg's N_min for these runs (default: the config's, "
                                                         "90%% of N); its runs are tabled only with this option")
    parser.add_argument("--run-dirs", type=Path,
                        help="keep each run's directory here (default: a temporary one): a run stopped midway "
                             "continues from its last round's checkpoint when the benchmark is started again")
    args = parser.parse_args()
    try:
        chosen = [f"--{name.replace('_', '-')}" for name in ("parts", "epsilons", "seeds", "strategies", "placements",
                                                             "workers", "run_dirs")
                  if getattr(args, name) != parser.get_default(name)]
        if args.table_only and chosen:
            raise ValueError(f"--table-only runs nothing and tables every finished run in the json: leave out "
                             f"{chosen[0]}.")
        args.parts, args.seeds = args.parts or "frontier,cohort", args.seeds or "0,1"
        args.epsilons = args.epsilons or ",".join(f"{e:g}" for e in EPSILONS)
        parts = args.parts.split(",")
        if unknown := [p for p in parts if p not in ("frontier", "cohort", "rounds")]:
            raise ValueError(f"Unknown part '{unknown[0]}'; choose frontier, cohort or rounds.")
        if args.min_replies is not None and args.min_replies < 2:  # 0 would mean the default, stored apart
            raise ValueError(f"--min-replies is secagg's N_min: at least 2, got {args.min_replies}.")
        runs = plan(parts, [float(e) for e in args.epsilons.split(",")], [int(s) for s in args.seeds.split(",")],
                    args.strategies.split(",") if args.strategies else None,
                    args.placements.split(",") if args.placements else None, args.min_replies, args.config,
                    check=not args.table_only)
        if args.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {args.workers}.")
        if args.min_replies is not None and not any(r["placement"] == "secagg" for r in runs):
            raise ValueError("--min-replies sets secure aggregation's N_min: it needs secagg runs "
                             "(--placements secagg).")
        if args.run_dirs is not None and args.run_dirs.exists() and not args.run_dirs.is_dir():
            raise ValueError(f"--run-dirs {args.run_dirs} is a file, not a directory.")
        for run in runs if args.run_dirs else ():
            _check_run_dir(run_dir(args.run_dirs, run["key"]), run["config"])
    except ValueError as error:
        print(f"privacy_utility: error: {str(error).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    store = RESULTS / f"{stem(args.config)}.json"
    done = json.loads(store.read_text()) if store.is_file() else {}
    todo = [] if args.table_only else [r for r in runs if r["key"] not in done]
    # What is least known first: noise at the client and private FlexLoRA sit at chance already at epsilon 8; each
    # from the largest epsilon down, so that a benchmark stopped midway leaves the most informative rows
    todo.sort(key=lambda r: (r["placement"] == "client", _family(r["strategy"]) == "flex", -r["epsilon"]))
    todo = list({r["key"]: r for r in todo}.values())  # a run two parts share, once
    threads = max(1, (os.cpu_count() or 1) // args.workers)
    # Workers are spawned processes that return results; only this process writes the store.
    with worker_pool(args.workers, "privacy_utility", "what finished is saved: the same command continues",
                     initializer=_set_threads, initargs=(threads,)) as pool:
        futures = {pool.submit(_run_one, run["key"], run["config"], args.run_dirs): run for run in todo}
        failed = []
        for i, future in enumerate(concurrent.futures.as_completed(futures)):
            try:
                key, result = future.result()
            except Exception as error:  # the other runs go on and are saved: one run's failure loses only itself
                failed.append(futures[future]["key"])
                traceback.print_exception(error, file=sys.stderr)
                print(f"== [{i + 1}/{len(todo)}] {failed[-1]}: failed: {type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else ''}", flush=True)
                continue
            # Re-read first: another benchmark (or a run on another machine merged in) may have saved meanwhile.
            done = {**(json.loads(store.read_text()) if store.is_file() else {}), key: result}
            RESULTS.mkdir(exist_ok=True)
            store.write_text(json.dumps(done, indent=1) + "\n")
            metric = "perplexity" if "perplexity" in result else "accuracy"
            print(f"== [{i + 1}/{len(todo)}] {key}: {metric} {result[metric][-1]:.3f} "
                  f"({result['seconds']:.0f} s)", flush=True)
    write_results(finished(done, args.min_replies, args.config), done, args.config)
    if failed:
        print(f"privacy_utility: {len(failed)} of {len(todo)} runs failed ({', '.join(failed)}); the others are "
              f"saved: run the same command again to retry them", file=sys.stderr)
        sys.exit(1)


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def run_dir(run_dirs: Path, key: str) -> Path:
    """Where --run-dirs keeps ``key``'s run: a run `fedlora run --out` wrote there with the same config counts."""
    return run_dirs / key.replace("|", "_").replace("=", "-")


def _check_run_dir(path: Path, config: RunConfig) -> None:
    """A run directory the benchmark would continue or reuse must hold the run it plans."""
    from fedlora.experiment import load_run_config

    if (path / "config.json").is_file():
        saved, planned = _as_run(load_run_config(path)[0].to_mapping()), _as_run(config.to_mapping())
        reporting = {"tracker"}  # where the metrics go besides metrics.jsonl: not what the run measures
        if differ := sorted(k for k in {*saved, *planned} - reporting if saved.get(k) != planned.get(k)):
            keys = ", ".join(f"{k} = {saved.get(k)!r}, planned {planned.get(k)!r}" for k in differ[:3])
            raise ValueError(f"{path} holds another run ({keys}).")


def _as_run(values: dict) -> dict:
    """A config's values as they run on this machine: "client-batch = 0" is 1 on a CPU, "precision = auto" fp32."""
    from fedlora.training import clients_at_once, resolved_precision, select_device

    device = select_device()
    return {**values, "client-batch": clients_at_once(values["client-batch"], device),
            "precision": resolved_precision(values["precision"], device)}


def _run_one(key: str, config: RunConfig, run_dirs: Path | None) -> tuple[str, dict]:
    """One run, in a worker process: its key and what the store keeps of it."""
    from fedlora.checkpoint import ENDED, STATE_FILE, Checkpoint

    started = time.time()

    def echo(line: str) -> None:
        print(f"    [{key}] {line}", flush=True)

    commit = revision()
    with tempfile.TemporaryDirectory() as tmp:
        out = run_dir(run_dirs, key) if run_dirs else Path(tmp) / "run"
        resumed = (out / STATE_FILE).is_file()
        if resumed and Checkpoint.load(out).status in ENDED:  # it ended before the store was written, or came
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]  # from `fedlora run`
            commit = "not recorded (found finished on disk)"
        else:
            if resumed:  # its earlier rounds may have run at another commit: a run directory records none
                commit += " (the launch that finished it)"
            if resumed:
                echo(f"resuming from {out}")
            rows = run_inprocess(config, out, echo=echo, resume=resumed)
    perplexity = {"perplexity": [r.get("perplexity") for r in rows]} if "perplexity" in rows[-1] else {}
    return key, {"accuracy": [r["accuracy"] for r in rows], **perplexity, "epsilon": rows[-1]["epsilon"],
                 "threat_model": rows[-1]["threat_model"],
                 "epsilon_by_observer": rows[-1].get("epsilon_by_observer", {}), "noise_multiplier": rows[-1]["noise_multiplier"],
                 "bytes_up": [r["bytes_up"] for r in rows], "machine": machine(), "commit": commit,
                 # a run found on disk, finished or continued: the seconds its rounds took (and its launches'
                 # start-up, where `fedlora run` recorded it), not this launch's
                 "seconds": sum(r["seconds"] + r.get("fixed_seconds", 0.0) for r in rows) if resumed
                 else time.time() - started,
                 **({"resumed": True} if resumed else {})}


def _upload_to_reach(result: dict, target: float, metric: str = "accuracy") -> float | None:
    """Bytes one sampled client uploads per round, times the rounds until the global model first reaches ``target``
    of ``metric`` (an accuracy at least it, a perplexity at most it; None if it never does)."""
    for round_, value in enumerate(result[metric], start=1):
        if value is not None and (value <= target if metric == "perplexity" else value >= target):
            return statistics.mean(result["bytes_up"][:round_]) * round_
    return None


def _other_observers(result: dict, placement: str) -> str:
    """The run's finite epsilons against the observers besides the one it was calibrated for, as its progress lines
    print them (secure aggregation: the server, a client of the round, and a server that breaks SecAgg+; the noise
    added by the server holds nothing against it). A run saved before 2026-11-29 (its model label without "who are
    not clients of the round") counted a server that breaks SecAgg+ as sampling honestly: that number is left out."""
    threat_model = result["threat_model"].split(",")[0]
    where = "server" if placement in (POISSON, "-") else placement
    labels = {o: observer_label(o, threat_model, where) for o in Observer}
    calibrated = next((o for o in Observer if result["threat_model"].endswith(labels[o])), None)
    if calibrated is None and result["threat_model"].endswith(observer_label(Observer.MODEL, threat_model)):
        calibrated = Observer.MODEL  # saved before the label named the clients of the round
    current = result["threat_model"].endswith(labels[Observer.MODEL]) or where == "server"
    by_observer = {o: v for o, v in result.get("epsilon_by_observer", {}).items()
                   if current or o != Observer.ONE_REPLY.value}
    return "".join(f"; {value:.3g} {label}"
                   for value, label in other_observers(by_observer, calibrated, threat_model, where))


LATE = 3  # evaluations averaged for the steadier reading: a private run's model moves from one evaluation to the next


def _late_rounds(result: dict, metric: str = "accuracy") -> list[int]:
    """The rounds of a run's last LATE evaluations in the later half of its rounds (the text preset evaluates 3
    times in 15 rounds: its first, at round 5, is not a late reading)."""
    values = result[metric]
    return [i + 1 for i, a in enumerate(values) if a is not None and 2 * (i + 1) > len(values)][-LATE:]


def _late(result: dict, metric: str = "accuracy") -> float:
    """A run's mean test accuracy (or perplexity) over its late evaluations."""
    return statistics.mean(result[metric][r - 1] for r in _late_rounds(result, metric))


def baseline(config: RunConfig, metric: str) -> tuple[str, float] | None:
    """The line the frontier is read against: a classifier's chance accuracy; a language model's zero-shot test
    perplexity, the public model's before any private text, as benchmarks/text_ceiling.py measured it."""
    if metric == "accuracy":
        chance = config.task.chance(config)
        return ("chance", chance) if chance else None
    measured = RESULTS / "text_ceiling.json"  # of the King James Bible's test chapters, the only text it measures
    rows = json.loads(measured.read_text()) if measured.is_file() and config.dataset == "bible-kjv" else []
    zero_shot = [r["perplexity"] for r in rows if r["model"] == config.model and r["steps"] == 0]
    return ("zero-shot", zero_shot[0]) if zero_shot else None


def utility_metric(config: RunConfig) -> str:
    """What the frontier measures utility by: a classifier's test accuracy, a language model's test perplexity."""
    return "perplexity" if config.task.name == "causal-lm" else "accuracy"


def _reproduce(runs: list[dict], parts: list[str], preset: str | None) -> str:
    """The commands whose plans hold the tabled runs (their unfinished runs are what is left to run): the parts at the
    default seeds, then each comparison run at more seeds (each row's n says how many)."""
    base = ["python -m benchmarks.privacy_utility", *(["--config", preset] if preset else [])]
    variant = {f"--min-replies {key.split('min-replies=')[1].split('|')[0]}" for key in (r["key"] for r in runs)
               if "min-replies=" in key}
    commands = [" ".join([*base, "--parts", ",".join(parts), *sorted(variant)])]
    extra: dict[tuple, tuple[set, set]] = {}  # (strategy, seeds beyond 0 and 1) -> (placements, epsilons)
    for strategy, eps in {(r["strategy"], r["epsilon"]) for r in runs if r["part"] == "frontier"}:
        mine = [r for r in runs if r["part"] == "frontier" and (r["strategy"], r["epsilon"]) == (strategy, eps)]
        if seeds := tuple(sorted({r["seed"] for r in mine} - {0, 1})):
            placements, epsilons = extra.setdefault((strategy, seeds), (set(), set()))
            placements.update(r["placement"] for r in mine if r["seed"] in seeds)
            epsilons.add(eps)
    commands += [" ".join([*base, "--parts frontier --strategies", strategy, "--placements",
                           ",".join(sorted(placements)), "--epsilons", ",".join(f"{e:g}" for e in sorted(epsilons)),
                           "--seeds", ",".join(map(str, seeds)), *sorted(variant)])
                 for (strategy, seeds), (placements, epsilons) in sorted(extra.items())]
    return "`, `".join(commands)


def _pm(mean: float, spread: float) -> str:
    """``mean ± spread`` to three places, rounded once: rounding to four places first turned 0.80455 into 0.804 (the
    round to nine drops the averaging's float noise, so a tie such as 0.4365 rounds as the float 0.4365 does)."""
    return f"{round(mean, 9):.3f} ± {round(spread, 9):.3f}"


def _summary(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (max(values) - min(values)) / 2 if len(values) > 1 else 0.0


MACHINE_UNKNOWN = "not recorded (runs before 2026-11-24, all on 2-core AMD EPYC machines)"


def _recorded(groups: dict[tuple, list[dict]], field: str, missing: str) -> str:
    """Each value of ``field`` (the machine, the commit) the table's runs recorded, with how many runs each."""
    counts: dict[str, int] = {}
    # a cohort group at the preset's N holds the frontier's runs themselves: each run counted once
    for result in {id(r): r for results in groups.values() for r in results}.values():
        value = result.get(field, missing)
        counts[value] = counts.get(value, 0) + 1
    return "; ".join(f"{value} ({n} runs)" for value, n in sorted(counts.items(), key=lambda kv: -kv[1]))


# The accuracies whose upload cost is tabled: on real data the first evaluation already passes the synthetic ones
REACH = {None: (0.3, 0.5, 0.7), "fashion_mnist": (0.7, 0.8, 0.83)}
# A perplexity's targets, set by a rule rather than by eye: these shares of the way, in test loss (log perplexity),
# from the public model's zero-shot to the non-private FFA-LoRA's final (its mean over the seeds), as the text
# tutorial reads a run's gain
REACH_SHARES = (0.25, 0.5, 0.75)


def reach_targets(rows_by_group: dict, preset: str | None, metric: str,
                  line: tuple[str, float] | None) -> tuple[tuple[float, ...], str]:
    """The values whose upload cost is tabled, and how they were set (a sentence; empty for fixed accuracies)."""
    if metric != "perplexity":
        return REACH.get(preset, REACH[None]), ""
    finals = [r[metric][-1] for (part, strategy, *_), results in rows_by_group.items()
              if part == "frontier" and strategy == REFERENCE["ffa"] for r in results]
    if line is None or not finals:
        return (), " (none yet: the targets are set from the zero-shot and the non-private run's perplexity)"
    start, end = math.log(line[1]), math.log(statistics.mean(finals))
    targets = tuple(round(math.exp(start + share * (end - start)), 1) for share in REACH_SHARES)
    return targets, (f" (targets {', '.join(f'{a:g}' for a in targets)}: a quarter, half and three quarters of the "
                     f"way in test loss from the {line[0]} {line[1]:.2f} to the non-private {REFERENCE['ffa']}'s "
                     f"final {statistics.mean(finals):.2f}, its mean over {len(finals)} seed{'s' * (len(finals) != 1)})")


NOISE = {"server": "at the server", POISSON: "at the server, Poisson sampling (epsilon under add/remove)",
         "secagg": "in shares under SecAgg+", "client": "at each client", "-": "none"}


def _at_a_glance(rows: list[dict], metric: str = "accuracy") -> list[str]:
    """The frontier as one table to look at: a row per strategy and noise placement, a column per epsilon, each cell
    the final accuracy's (or perplexity's) mean over the seeds and how many (the full table below gives the spread and the threat
    models)."""
    frontier = [r for r in rows if r["part"] == "frontier"]
    epsilons = sorted({r["epsilon"] for r in frontier}, key=float)
    digits = 2 if metric == "perplexity" else 3
    cells = {(r["strategy"], r["placement"], r["epsilon"]): f"{round(r[metric], 9):.{digits}f} ({r['seeds']})"
             for r in frontier}
    order = [*PRIVATE, *REFERENCE.values()]
    lines = ["| strategy | noise | " + " | ".join("not private" if e == "inf" else f"epsilon {e}" for e in epsilons)
             + " |",
             "|---|---|" + "---:|" * len(epsilons)]
    for strategy, placement in sorted({(s, p) for s, p, _ in cells},
                                      key=lambda sp: (order.index(sp[0]), list(NOISE).index(sp[1]))):
        lines.append(f"| {strategy} | {NOISE[placement]} | "
                     + " | ".join(cells.get((strategy, placement, e), "") for e in epsilons) + " |")
    return lines


def write_results(runs: list[dict], done: dict, preset: str | None = None) -> None:
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        if run["key"] in done:
            groups.setdefault((run["part"], run["strategy"], run["placement"], run["epsilon"], run["n"],
                               run["rounds"]), []).append(done[run["key"]])
    if not groups:
        print("privacy_utility: no finished runs yet.")
        return
    config: RunConfig = load_config(preset)
    metric = utility_metric(config)
    line = baseline(config, metric)
    reach, how_set = reach_targets(groups, preset, metric, line)
    rows = []
    late_rounds: dict[int, list[int]] = {}  # T -> the rounds of its late evaluations
    for (part, strategy, placement, eps, n, rounds), results in groups.items():
        late_rounds[rounds] = _late_rounds(results[0], metric)
        mean, spread = _summary([r[metric][-1] for r in results])
        late, late_spread = _summary([_late(r, metric) for r in results])
        rows.append({"part": part, "strategy": strategy, "placement": placement,
                     "epsilon": "inf" if eps == math.inf else f"{eps:g}", "n": n, "rounds": rounds,
                     "seeds": len(results),
                     metric: mean, "spread": spread, f"late_{metric}": late, "late_spread": late_spread,
                     "noise_multiplier": round(results[0]["noise_multiplier"], 4),
                     "threat_model": results[0]["threat_model"] + _other_observers(results[0], placement),
                     "bytes_per_client_round": round(statistics.mean(results[0]["bytes_up"])),
                     **{f"upload_to_{a:g}": _upload_to_reach(results[0], a, metric) for a in reach}})
    # accuracy against T: the preset's T beside the others, for the strategies and epsilons run at another T
    varied = {(r["strategy"], r["epsilon"]) for r in rows if r["part"] == "rounds" and r["rounds"] != config.num_rounds}
    rows = [r for r in rows if r["part"] != "rounds" or (r["strategy"], r["epsilon"]) in varied]
    name = stem(preset)
    RESULTS.mkdir(exist_ok=True)
    reproduce = _reproduce(runs, [p for p in ("frontier", "cohort", "rounds") if any(r["part"] == p for r in rows)],
                           preset)
    with open(RESULTS / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        # rounded here only: the tables format the exact means (rounding twice can move the third digit)
        writer.writerows({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rows)
    _plot(rows, line, name, config.num_clients, metric,
          f"{reproduce.replace('`', '')} · commit {revision()}")

    def kib(value):
        return "never" if value is None else f"{value / 1024:.0f} KiB"

    setting = f"the {preset} preset's" if preset else "the quickstart's"
    # the cohort part's run at the preset's N is the frontier's own: alone it is no curve
    against_n = len({r["n"] for r in rows if r["part"] == "cohort"}) > 1
    against_t = sorted((r for r in rows if r["part"] == "rounds"),
                       key=lambda r: (r["strategy"], float(r["epsilon"]), r["rounds"]))
    lines = [f"# Privacy-utility frontier at {setting} setting", "",
             f"Runs: `{reproduce}` (each skips the runs {name}.json holds; with `--run-dirs DIR` a stopped run "
             "continues from its last round): the tables show every run of these finished so far, the n per row "
             "how many seeds  ", f"Tables written by: `{command_line('benchmarks.privacy_utility')}`  ",
             f"Commit: {revision()}; the runs' own, where they recorded it: "
             f"{_recorded(groups, 'commit', 'not recorded (runs before 2026-12-03)')}  ",
             f"Machine: {machine()}; the runs' own, where they recorded it: {_recorded(groups, 'machine', MACHINE_UNKNOWN)}  ",
             f"Setting: {setting} ({config.dataset} data, {f'{config.classes} classes' if metric == 'accuracy' else 'next-token prediction'}, {config.model}, "
             f"C = {config.num_clients}, N = {config.clients_per_round} unless given, T = {config.num_rounds}, "
             f"K = {config.local_steps} local {config.local_optimizer} steps at lr {config.lr:g}, clip "
             f"{config.clip_norm:g}, delta {config.delta:g}, fixed-size sampling, replace-one neighbours, except "
             "the rows of noise at the server with Poisson sampling: rate N / C, add/remove neighbours, the field's "
             "convention, whose epsilon reads smaller for the same noise); "
             f"clients send {'updates (FlexLoRA: the change of each product B A) applied by server SGD' if config.message == 'update' else 'their adapters'}. Final test "
             f"{metric} after T rounds: mean ± half the range over the seeds"
             f"{f' ({line[0]} {line[1]:.2f})' if line else ''}. Upload to reach "
             f"a{'' if metric == 'perplexity' else 'n'} {metric}: bytes one sampled client sends per round times the "
             "rounds until the global model first "
             f"reaches it (first seed; at its evaluations, every {config.eval_every} rounds){how_set}. Late evaluations: each run's mean {metric} at rounds "
             f"{', '.join(map(str, late_rounds.get(config.num_rounds, [])))} (at most its last {LATE} evaluations, "
             "those in the later half of the rounds), the steadier reading where a private model moves from one evaluation to "
             "the next (mean ± half the range over the seeds).", "",
             "## At a glance", "",
             f"Final test {metric}, mean over the seeds (how many in brackets); noise: where it is added, each "
             "epsilon against observers of the model (the table below names every threat model).", "",
             *_at_a_glance(rows, metric), "",
             f"## {metric.capitalize()} against epsilon", "",
             f"| strategy | epsilon (threat model, noise placement) | {metric} | late evaluations | z | "
             "upload / client round | " + " | ".join(f"to {a:g}" for a in reach) + " |",
             "|---|---|---:|---:|---:|---:|" + "---:|" * len(reach),
             *[f"| {r['strategy']} | {r['epsilon']} ({r['threat_model']}"
               f"{'; Poisson sampling, add/remove' if r['placement'] == POISSON else ''}) | "
               f"{_pm(r[metric], r['spread'])} "
               f"(n={r['seeds']}) | {_pm(r[f'late_{metric}'], r['late_spread'])} | {r['noise_multiplier']:g} | "
               f"{r['bytes_per_client_round'] / 1024:.1f} KiB | "
               + " | ".join(kib(r[f"upload_to_{a:g}"]) for a in reach) + " |"
               for r in rows if r["part"] == "frontier"],
             *(["", f"## {metric.capitalize()} against N (C fixed), epsilon 8 (known-sketch, noise at the server)",
                "", f"| strategy | N | {metric} | late evaluations | z |", "|---|---:|---:|---:|---:|",
                *[f"| {r['strategy']} | {r['n']} | {_pm(r[metric], r['spread'])} (n={r['seeds']}) | "
                  f"{_pm(r[f'late_{metric}'], r['late_spread'])} | {r['noise_multiplier']:g} |"
                  for r in rows if r["part"] == "cohort"]] if against_n else []),
             *(["", f"## {metric.capitalize()} against T (the same budget over fewer rounds), epsilon "
                f"({against_t[0]['threat_model'] if against_t else ''})", "",
                f"The budget spread over T rounds: fewer rounds, less noise each (z). Evaluated every T / "
                f"{config.num_rounds // config.eval_every} rounds: "
                + "; ".join(f"T = {t}: the late ones at rounds {', '.join(map(str, late_rounds[t]))}"
                            for t in sorted({r['rounds'] for r in against_t})) + ".", "",
                f"| strategy | epsilon | T | {metric} | late evaluations | z |",
                "|---|---:|---:|---:|---:|---:|",
                *[f"| {r['strategy']} | {r['epsilon']} | {r['rounds']} | {_pm(r[metric], r['spread'])} "
                  f"(n={r['seeds']}) | {_pm(r[f'late_{metric}'], r['late_spread'])} | {r['noise_multiplier']:g} |"
                  for r in against_t]] if against_t else []),
             "", f"![{metric} against epsilon]({name}_epsilon.png)",
             *([f"![{metric} against N]({name}_cohort.png)"] if against_n else []), ""]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _plot(rows: list[dict], line: tuple[str, float] | None, name: str, num_clients: int, metric: str,
          source: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    frontier = [r for r in rows if r["part"] == "frontier"]
    # a panel per placement run (the text frontier runs none at the client)
    placements = [p for p in PLACEMENTS if any(r["placement"] == p for r in frontier)] or ["server"]
    fig, axes = plt.subplots(1, len(placements), figsize=(5 * len(placements), 4), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, placement in zip(axes, placements):
        for strategy in PRIVATE:
            points = sorted((float(r["epsilon"]), r[metric], r["spread"]) for r in frontier
                            if r["strategy"] == strategy and r["placement"] == placement)
            if points:
                xs, ys, es = zip(*points)
                ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=strategy)
        for reference in REFERENCE.values():
            ref = [r[metric] for r in frontier if r["strategy"] == reference]
            if ref:
                ax.axhline(ref[0], ls="--", lw=1, color="grey" if reference == "ffa-lora" else "black",
                           label=f"{reference} (not private)")
        if line:
            ax.axhline(line[1], ls=":", color="red", lw=1, label=line[0])
        where = "noise in shares under SecAgg+" if placement == "secagg" else f"noise at the {placement}"
        ax.set(xscale="log", xlabel="epsilon (delta 1e-5)", title=where)
        ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"final test {metric}" + (" (lower is better)" if metric == "perplexity" else ""))
    if metric == "perplexity":  # epsilon 1 can end far above the zero-shot: a log axis keeps the rest readable
        axes[0].set_yscale("log")
        for ticks in (axes[0].yaxis.set_major_formatter, axes[0].yaxis.set_minor_formatter):
            ticks(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    labelled = {label: handle for ax in axes for handle, label in zip(*ax.get_legend_handles_labels())}
    axes[-1].legend(labelled.values(), labelled.keys(), fontsize=7)  # every strategy, wherever it was drawn
    save_figure(fig, f"{name}_epsilon.png", source)

    cohort = [r for r in rows if r["part"] == "cohort"]
    if len({r["n"] for r in cohort}) < 2:  # the preset's N alone (the frontier's runs) is no curve
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for strategy in (*COHORT_STRATEGIES, REFERENCE["ffa"]):
        points = sorted((r["n"], r[metric], r["spread"]) for r in cohort if r["strategy"] == strategy)
        if points:
            xs, ys, es = zip(*points)
            ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3,
                        label=strategy + ("" if strategy in COHORT_STRATEGIES else " (not private)"))
    if line:
        ax.axhline(line[1], ls=":", color="red", lw=1, label=line[0])
    ax.set(xscale="log", xlabel=f"clients per round N (C = {num_clients})", ylabel=f"final test {metric}",
           title="epsilon 8, noise at the server")
    ax.set_xticks(COHORTS, [str(n) for n in COHORTS])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, f"{name}_cohort.png", source)


if __name__ == "__main__":
    main()
