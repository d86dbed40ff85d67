"""The same rounds on a Ray cluster of one node and of two (each node with the same cores), on this machine:
seconds per round side by side, and one node with the two nodes' cores together, to tell what a second node adds
from what its cores add (all three are `ray start` clusters on this machine).

    python -m benchmarks.ray_cluster                    # the quickstart's rounds, 3 per setting (about 6 min here)
    python -m benchmarks.ray_cluster --rounds 4 --cpus-per-node 1
Results: benchmarks/results/ray_cluster.{md,json}. Every setting runs the quickstart's config (C, N, K, model)
through `fedlora run`'s path (SuperLink, Flower's Ray backend) with noise seeded from the run seed, so the
settings train the same clients; the first round (Ray starting its workers) is reported apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS, command_line, machine, revision
from fedlora.cluster import LocalCluster
from fedlora.config import load_config
from fedlora.launch import run_simulation

STORE = RESULTS / "ray_cluster.json"


def measure(name: str, config, cpus: list[int]) -> dict:
    """One setting's rounds, on a cluster of ``len(cpus)`` nodes with those CPUs started for it on this machine."""
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(cpus) as cluster:
        started = time.time()
        rows = run_simulation(config, Path(tmp) / "run", echo=print, ray_address=cluster.address,
                              workers=sum(cpu // config.client_cpus for cpu in cpus))  # as `fedlora run`
        wall = time.time() - started
    return {"setting": name, "nodes": len(cpus), "cpus": sum(cpus), "first_round_seconds": rows[0]["seconds"],
            "seconds_per_round": statistics.mean(r["seconds"] for r in rows[1:]), "rounds": len(rows),
            "wall_seconds": wall, "max_nodes_in_a_round": max(r["nodes"] for r in rows),
            "final_accuracy": rows[-1]["accuracy"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpus-per-node", type=int, default=1)
    args = parser.parse_args()
    if args.rounds < 2 or args.cpus_per_node < 1:
        print("ray_cluster: error: --rounds must be at least 2 (the first is reported apart) and --cpus-per-node "
              "at least 1.", file=sys.stderr)
        sys.exit(2)
    config = load_config(None, [f"num-rounds={args.rounds}", "eval-every=1000", "tracker=none"])
    c = args.cpus_per_node
    settings = [(f"one node, {c} CPU", [c]), (f"two nodes, {c} CPU each", [c, c]),
                (f"one node, {2 * c} CPUs", [2 * c])]
    rows = [measure(name, config, cpus) for name, cpus in settings]
    result = {"command": command_line("benchmarks.ray_cluster"), "commit": revision(), "machine": machine(),
              "setting": f"the quickstart's rounds (C = {config.num_clients}, N = {config.clients_per_round}, K = "
                         f"{config.local_steps}, batch {config.batch_size}, {config.model}), one client per CPU, "
                         f"{args.rounds} rounds", "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    STORE.write_text(json.dumps(result, indent=1) + "\n")
    base = rows[0]["seconds_per_round"]
    lines = ["# The same rounds on one Ray node and on two", "", f"Command: `{result['command']}`  ",
             f"Commit: {result['commit']}  ", f"Machine: {result['machine']}  ",
             f"Setting: {result['setting']}; every node a `ray start` on this machine (fedlora.cluster.LocalCluster), "
             "the run joining it by address as `fedlora run --ray-address` does. Seconds per round: the mean over "
             "the rounds after the first (the first starts Ray's workers and is shown apart).", "",
             "| setting | CPUs | seconds per round | speed-up over one node | first round (s) | nodes a round used |",
             "|---|---:|---:|---:|---:|---:|",
             *[f"| {r['setting']} | {r['cpus']} | {r['seconds_per_round']:.1f} | {base / r['seconds_per_round']:.2f}x "
               f"| {r['first_round_seconds']:.1f} | {r['max_nodes_in_a_round']} |" for r in rows], ""]
    (RESULTS / "ray_cluster.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
