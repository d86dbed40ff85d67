"""Every strategy at the same target epsilon, with the non-private references, over several seeds:
accuracy per round (as the paper's Figure 1) and a table of final and best accuracy, noise, traffic, time.

    python -m benchmarks.compare_strategies                       # the quickstart, 7 strategies x 2 seeds
    python -m benchmarks.compare_strategies --preset small-cohort  # the first quickstart (N = 4, random init)
    python -m benchmarks.compare_strategies --preset paper        # CIFAR-100 + ViT-B/16: a GPU job
    python -m benchmarks.compare_strategies --sweep target-epsilon=2,8,32 --strategies sgmm-ffa-lora,gm-ffa-lora
Results: benchmarks/results/compare_<preset>[_<sweep key>].{md,csv,png}. Runs are kept in compare_<...>_runs.json:
re-running some strategies replaces their runs and keeps the others' (with the commit each was measured at).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.common import RESULTS, command_line, machine, revision
from fedlora.algorithms import ALGORITHMS
from fedlora.cli import add_overrides
from fedlora.config import load_config
from fedlora.experiment import check_before_start
from fedlora.launch import run_simulation

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PRESETS = {"cpu": None,  # the quickstart
           "small-cohort": CONFIGS / "small_cohort.toml",  # the first quickstart, where private runs sit at chance
           "paper": CONFIGS / "paper_cifar100.toml"}


def _mean_std(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def main() -> None:
    try:
        compare()
    except ValueError as error:  # bad input, an unreachable target, data or weights offline: one line
        print(f"compare_strategies: error: {error}", file=sys.stderr)
        sys.exit(2)


def compare() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=list(PRESETS), default="cpu")
    parser.add_argument("--strategies", default=",".join(ALGORITHMS), help="comma-separated")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--sweep", help="KEY=V1,V2,...: repeat for each value (e.g. target-epsilon, sketch-dim, rank)")
    add_overrides(parser, "override the preset")
    args = parser.parse_args()
    sweep_key, sweep_values = (args.sweep.split("=", 1)[0], args.sweep.split("=", 1)[1].split(",")) if args.sweep \
        else (None, [None])
    configs = {}
    for value in sweep_values:  # every run's config is checked before the first starts
        for strategy in args.strategies.split(","):
            if strategy not in ALGORITHMS:
                raise ValueError(f"Unknown strategy '{strategy}'; choose from {', '.join(ALGORITHMS)}.")
            for seed in args.seeds.split(","):
                overrides = [f"strategy={strategy}", f"seed={seed}", *args.set]
                if sweep_key:
                    overrides.append(f"{sweep_key}={value}")
                config = load_config(PRESETS[args.preset], overrides)
                check_before_start(config)
                configs[strategy, seed, value] = config
    name = f"compare_{args.preset}" + (f"_{sweep_key}" if sweep_key else "")
    store = RESULTS / f"{name}_runs.json"
    strategies = args.strategies.split(",")
    seeds = [int(seed) for seed in args.seeds.split(",")]
    runs = [r for r in (json.loads(store.read_text()) if store.is_file() else [])  # the other strategies' runs
            if r.get("set") == args.set and r["sweep"] in sweep_values and r["seed"] in seeds
            and r["strategy"] not in strategies]
    with tempfile.TemporaryDirectory() as tmp:
        for value in sweep_values:
            for strategy in args.strategies.split(","):
                for seed in args.seeds.split(","):
                    config = configs[strategy, seed, value]
                    out = Path(tmp) / f"{strategy}-{seed}-{value}"
                    print(f"== {strategy}, seed {seed}" + (f", {sweep_key} = {value}" if sweep_key else ""), flush=True)
                    rows = run_simulation(config, out, echo=lambda line: print("   ", line, flush=True))
                    runs.append({"strategy": strategy, "seed": int(seed), "sweep": value, "rows": rows,
                                 "private": ALGORITHMS[strategy].private, "set": args.set, "commit": revision()})
    table = []
    for value in sweep_values:
        for strategy in [s for s in ALGORITHMS if any(r["strategy"] == s and r["sweep"] == value for r in runs)]:
            group = [r for r in runs if r["strategy"] == strategy and r["sweep"] == value]
            finals = [g["rows"][-1]["accuracy"] for g in group]
            bests = [max(x["accuracy"] for x in g["rows"] if x["accuracy"] is not None) for g in group]
            last = group[0]["rows"][-1]
            table.append({"strategy": strategy, sweep_key or "setting": value or args.preset,
                          "final_accuracy": _mean_std(finals), "best_accuracy": _mean_std(bests),
                          "noise_multiplier": round(last["noise_multiplier"], 4),
                          "epsilon": "inf" if not group[0]["private"] else round(last["epsilon"], 3),
                          "threat_model": last["threat_model"],
                          "kib_up_per_client_round": round(statistics.mean(x["bytes_up"] for g in group
                                                                           for x in g["rows"]) / 1024, 1),
                          "kib_down_per_client_round": round(statistics.mean(x["bytes_down"] for g in group
                                                                             for x in g["rows"]) / 1024, 1),
                          "seconds_per_round": round(statistics.mean(x["seconds"] for g in group
                                                                     for x in g["rows"][1:]), 2)})
    kept = {r["strategy"] for r in runs if r["strategy"] not in strategies}
    kept_commits = {r.get("commit", "not recorded") for r in runs if r["strategy"] in kept}
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    store.write_text(json.dumps(runs, indent=1, default=str))
    _plot(runs, RESULTS / f"{name}.png", sweep_key)
    config = load_config(PRESETS[args.preset], args.set)
    header = list(table[0])
    lines = [f"# Strategies compared ({args.preset} preset" + (f", sweep over {sweep_key}" if sweep_key else "") + ")",
             "", f"Command: `{command_line('benchmarks.compare_strategies')}`"
             + (f" (the runs of {', '.join(sorted(kept))} kept from earlier commands: {name}_runs.json)" if kept else "")
             + "  ", f"Commit: {revision()}" + (f" (kept runs: {', '.join(sorted(kept_commits))})" if kept else "") + "  ",
             f"Machine: {machine()}  ",
             f"Setting: {config.dataset} data, {config.model}, C = {config.num_clients}, N = {config.clients_per_round},"
             f" K = {config.local_steps}, batch {config.batch_size}, T = {config.num_rounds}, r = {config.rank}, "
             f"target epsilon {config.target_epsilon:g}, delta {config.delta:g}, seeds {args.seeds}; accuracy is the "
             f"test accuracy of the global model (mean ± std over seeds); seconds per round leave out round 1. Noise "
             f"at the {config.noise_placement}; clients send {config.message}s"
             + (" (FlexLoRA strategies: the change of each product B A)." if config.message == "update" else "."),
             "", "| " + " | ".join(h.replace("_", " ") for h in header) + " |", "|" + "---|" * len(header),
             *["| " + " | ".join(str(row[h]) for h in header) + " |" for row in table], "", f"![accuracy]({name}.png)"]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _plot(runs: list[dict], path: Path, sweep_key: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = list(dict.fromkeys(r["sweep"] for r in runs))
    fig, axes = plt.subplots(1, len(values), figsize=(6 * len(values), 4), squeeze=False)
    for ax, value in zip(axes[0], values):
        for strategy in dict.fromkeys(r["strategy"] for r in runs if r["sweep"] == value):
            group = [r for r in runs if r["strategy"] == strategy and r["sweep"] == value]
            rounds = [x["round"] for x in group[0]["rows"]]
            means = [statistics.mean(g["rows"][i]["accuracy"] for g in group) for i in range(len(rounds))]
            ax.plot(rounds, means, marker="o", markersize=3, label=strategy,
                    linestyle="-" if group[0]["private"] else "--")
        ax.set(xlabel="round", ylabel="test accuracy", title=f"{sweep_key} = {value}" if sweep_key else "")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
