"""Which levers make private federations learn: noise placement, update form with a server optimizer, and
private adaptive clipping, for sgmm-ffa-lora and gm-ffa-lora at epsilon 8, in the first quickstart's setting
(configs/small_cohort.toml, named "quickstart" here) and with a larger cohort. Final test accuracy over seeds,
beside the non-private ffa-lora of the same setting.

    python -m benchmarks.private_levers                      # both settings, seeds 0 and 1 (~40 min here)
    python -m benchmarks.private_levers --settings quickstart --seeds 0
Results: benchmarks/results/private_levers.{md,csv,json}. Runs are in process (the ServerApp and ClientApp
over an in-process Grid: the same protocol, strategy and accountant as `fedlora run`, without Ray); each
finished run is saved in the json at once, so an interrupted benchmark continues where it stopped.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


from benchmarks.common import RESULTS, provenance, run_inprocess
from fedlora.config import load_config
from fedlora.experiment import noise_for

BASE = Path(__file__).resolve().parents[1] / "configs" / "small_cohort.toml"  # the first quickstart
SETTINGS = {  # on top of BASE
    "quickstart": {},
    "cohort": {"num-clients": 200, "clients-per-round": 20},
    # the quickstart's population, cohort and pretrained backbone (configs/quickstart.toml)
    "pretrained": {"num-clients": 500, "clients-per-round": 50, "local-steps": 2, "train-examples": 20000,
                   "model": "vit-tiny-public"},
}
UPDATE = {"message": "update", "server-optimizer": "momentum", "server-lr": 1.0, "server-momentum": 0.9}
LEVERS = {  # name -> overrides; the private strategies run each
    "adapter, noise at the client (the paper)": {},
    "update + momentum, noise at the client": UPDATE,
    "update + momentum, noise at the server": {**UPDATE, "noise-placement": "server"},
    "update + sgd, noise at the server (the quickstart)": {**UPDATE, "server-optimizer": "sgd",
                                                           "noise-placement": "server"},
    "update + momentum, noise at the server, adaptive clip (median)": {**UPDATE, "noise-placement": "server",
                                                                       "clip-quantile": 0.5},
}
PRIVATE = ("sgmm-ffa-lora", "gm-ffa-lora")
REFERENCE = ("ffa-lora", "adapter, not private")


def plan(settings: list[str], seeds: list[str]) -> list[dict]:
    """Every run, its config checked (and its noise calibrated) before the first starts; a lever a setting cannot
    run (the clip count's noise alone past the budget) is kept with its reason."""
    runs = []
    for setting in settings:
        # lever-major, the reference first: an interrupted benchmark has whole rows for the first levers
        cases = [(REFERENCE[0], REFERENCE[1], {})] + [(s, lever, o) for lever, o in LEVERS.items() for s in PRIVATE]
        for strategy, lever, overrides in cases:
            for seed in seeds:
                values = {**SETTINGS[setting], **overrides, "strategy": strategy, "seed": seed, "eval-every": 10}
                config = load_config(BASE, [f"{k}={json.dumps(v) if isinstance(v, str) else v}"
                                            for k, v in values.items()])
                try:
                    z = noise_for(config).noise_multiplier
                    reason = None
                except ValueError as error:
                    z, reason = None, str(error)
                runs.append({"setting": setting, "strategy": strategy, "lever": lever, "seed": int(seed),
                             "config": config, "noise_multiplier": z, "skipped": reason})
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--seeds", default="0,1")
    args = parser.parse_args()
    try:
        settings = args.settings.split(",")
        unknown = [s for s in settings if s not in SETTINGS]
        if unknown:
            raise ValueError(f"Unknown setting '{unknown[0]}'; choose from {', '.join(SETTINGS)}.")
        runs = plan(settings, args.seeds.split(","))
    except ValueError as error:
        print(f"private_levers: error: {error}", file=sys.stderr)
        sys.exit(2)
    store = RESULTS / "private_levers.json"
    done = json.loads(store.read_text()) if store.is_file() else {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, run in enumerate(runs):
            key = f"{run['setting']}|{run['strategy']}|{run['lever']}|{run['seed']}"
            if run["skipped"] or key in done:
                continue
            print(f"== [{i + 1}/{len(runs)}] {run['setting']}: {run['strategy']}, {run['lever']}, seed {run['seed']}",
                  flush=True)
            started = time.time()
            rows = run_inprocess(run["config"], Path(tmp) / key.replace("|", "_").replace(" ", ""),
                                 echo=lambda line: print("   ", line, flush=True))
            done[key] = {"final_accuracy": rows[-1]["accuracy"], "epsilon": rows[-1]["epsilon"],
                         "threat_model": rows[-1]["threat_model"], "clip_norms": [r["clip_norm"] for r in rows],
                         "seconds": time.time() - started}
            RESULTS.mkdir(exist_ok=True)
            store.write_text(json.dumps(done, indent=1) + "\n")
    write_table(runs, done, args)


def _mean_spread(values: list[float]) -> str:
    if not values:
        return "-"
    text = f"{statistics.mean(values):.3f}"
    return text + (f" ({', '.join(f'{v:.3f}' for v in values)})" if len(values) > 1 else "")


def write_table(runs: list[dict], done: dict, args) -> None:
    rows = []
    order = [REFERENCE[1], *LEVERS]
    for setting in dict.fromkeys(r["setting"] for r in runs):
        cases = dict.fromkeys((r["strategy"], r["lever"]) for r in runs if r["setting"] == setting)
        for strategy, lever in sorted(cases, key=lambda c: ((PRIVATE + REFERENCE).index(c[0]), order.index(c[1]))):
            group = [r for r in runs if (r["setting"], r["strategy"], r["lever"]) == (setting, strategy, lever)]
            results = [done[f"{setting}|{strategy}|{lever}|{r['seed']}"] for r in group
                       if f"{setting}|{strategy}|{lever}|{r['seed']}" in done]
            first = group[0]
            c = first["config"]
            rows.append({
                "setting": f"C = {c.num_clients}, N = {c.clients_per_round}, T = {c.num_rounds}",
                "strategy": strategy, "lever": lever,
                "final_accuracy": _mean_spread([x["final_accuracy"] for x in results]) if not first["skipped"]
                else f"not run: {first['skipped']}",
                "noise_multiplier": "-" if first["noise_multiplier"] in (None, 0.0) else
                f"{first['noise_multiplier']:.3f}",
                "epsilon": "-" if not results else ("inf" if results[0]["epsilon"] == float("inf") else
                                                    f"{results[0]['epsilon']:.2f} ({results[0]['threat_model']})"),
                "final_clip_norm": "-" if not results or not c.clip_quantile else
                _mean_spread([x["clip_norms"][-1] for x in results]),
            })
    with open(RESULTS / "private_levers.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    header = list(rows[0])
    config = runs[0]["config"]
    lines = ["# Private levers: placement, update form, adaptive clipping", "",
             *provenance("benchmarks.private_levers"),
             f"Setting: the first quickstart, configs/small_cohort.toml ({config.dataset} data, {config.classes} classes, {config.model} at random "
             f"init, K = {config.local_steps}, batch {config.batch_size}, lr {config.lr:g}, r = {config.rank}, "
             f"clip norm {config.clip_norm:g} (the start, with adaptive clipping), target epsilon "
             f"{config.target_epsilon:g}, delta {config.delta:g}, fixed-size sampling) with C and N as given; final "
             f"test accuracy after T rounds, mean (each seed); chance is {1 / config.classes:.2f}. Update runs use "
             "server momentum 0.9 at server lr 1 (DP-FedAvg's, not tuned); adaptive clipping uses Andrew et al.'s "
             "defaults (step 0.2, count noise N / 20), and the update's noise is raised to pay for the count.",
             "", "| " + " | ".join(h.replace("_", " ") for h in header) + " |", "|" + "---|" * len(header),
             *["| " + " | ".join(str(row[h]) for h in header) + " |" for row in rows]]
    (RESULTS / "private_levers.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
