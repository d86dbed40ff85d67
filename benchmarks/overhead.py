"""What the framework costs as cohorts grow: rounds of the real simulation (SuperLink, Flower messages, Ray
clients) against a bare PyTorch loop doing the same client work, at N clients per round (C = 4 N), with the
ServerApp process's peak memory; plus the client's clip + sketch + noise time and the server's aggregation time.
Both simulation paths are measured beside the same bare loop: one Flower message per sampled client (one node
per client, as in a deployment) and several clients per message (`simulation-nodes` = one node per Ray worker).

    python -m benchmarks.overhead                        # N in 4, 32, 128, 512, both paths (about 40 min here)
    python -m benchmarks.overhead --cohorts 4,32 --paths packed
Results: benchmarks/results/overhead.{md,json}: each N's row (its bare loop and both paths, measured side by
side in one run) is kept in the json with its commit, so a later run re-measures only the N it is given. The
setting is the quickstart's client work (model, K, batch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from benchmarks.common import RESULTS, command_line, machine, revision
from fedlora.cli import add_overrides
from fedlora.config import RunConfig, load_config
from fedlora.data import load_partition, load_split, make_partitioner, to_torch
from fedlora.federation import Protocol
from fedlora.round_plan import derive_seed
from fedlora.launch import run_simulation
from fedlora.models import model_spec
from fedlora.training import local_train

GOAL_RATIO, GOAL_MEMORY = 1.10, 0.10
STORE = RESULTS / "overhead.json"
PATHS = {"message": "one message per client", "packed": "several clients per message"}
WHY = ("Why the per-message path slows as cohorts grow (measured: see docs/how-to/ray.md): "
       "Flower 1.41's simulation engine polls every node for its messages every 0.1 s "
       "(`vce_api.add_messages_to_queue`), and each poll scans every stored message under the state's lock "
       "(`InMemoryLinkState.get_message_ins`): O(C N) work per sweep, on the clients' cores. With several clients "
       "per message there are as many nodes and messages as Ray workers.")


def bare_rounds(config: RunConfig, rounds: int) -> list[float]:
    """Seconds per round of plain PyTorch: N clients' K steps one after the other, same model, batches, seeds."""
    model = Protocol(config, 0.0).build_model()
    train = load_split(config, "train")
    partitioner = make_partitioner(config.partitioner, num_partitions=config.num_clients, dataset=train,
                                   seed=config.seed)
    size = model_spec(config.model).image_size
    times = []
    for round_ in range(1, rounds + 1):
        clients = torch.randperm(config.num_clients, generator=torch.Generator().manual_seed(round_))
        start = time.perf_counter()
        for pid in clients[:config.clients_per_round].tolist():
            data = to_torch(load_partition(partitioner, pid), size, train=True)
            local_train(model, data, steps=config.local_steps, batch_size=config.batch_size, lr=config.lr,
                        optimizer=config.local_optimizer,
                        generator=torch.Generator().manual_seed(derive_seed(config.seed, "batches", round_, pid)))
        times.append(time.perf_counter() - start)
    return times


def steady_rounds(n: int) -> int:
    """Rounds averaged at N: enough that the mean covers about 64 clients (a round at N = 4 lasts a second)."""
    return max(1, 64 // n)


def measure(n: int, steady: int, overrides: list[str], out_dir: str, paths: list[str]) -> dict:
    # eval-every beyond the run: only the last round evaluates the global model, and it is left out
    rounds = steady + 2
    config = load_config(None, [f"num-clients={4 * n}", f"clients-per-round={n}", f"num-rounds={rounds}",
                                f"eval-every={rounds + 1}", *overrides])
    print(f"== N = {n}, C = {4 * n}: bare loop", flush=True)
    bare_s = statistics.mean(bare_rounds(config, steady + 1)[1:])  # its first round warms up
    result = {"n": n, "c": 4 * n, "bare_s": bare_s, "steady_rounds": steady, "commit": revision(),
              "command": command_line("benchmarks.overhead")}
    for path in paths:
        nodes = max(1, (os.cpu_count() or 1) // config.client_cpus) if path == "packed" else 0
        run_config = RunConfig.from_mapping({"simulation-nodes": nodes}, base=config)
        print(f"== N = {n}, C = {4 * n}: real simulation, {PATHS[path]}", flush=True)
        sim = run_simulation(run_config, f"{out_dir}-{path}", echo=lambda line: print("  ", line, flush=True))
        steady = sim[1:-1]  # round 1 starts the Ray workers and builds the models; the last evaluates
        sim_s = statistics.mean(r["seconds"] for r in steady)
        result[path] = {
            "nodes": nodes or 4 * n, "sim_s": sim_s, "ratio": sim_s / bare_s, "first_round_s": sim[0]["seconds"],
            "server_peak_rss_mib": max(r["server_peak_rss_mib"] for r in sim),
            "privatize_share": statistics.mean(r["client_privatize_seconds"] / r["client_train_seconds"]
                                               for r in steady),
            "aggregation_share": statistics.mean(r["aggregation_seconds"] / r["seconds"] for r in steady)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cohorts", default="4,32,128,512", help="N values, comma-separated (C = 4 N)")
    parser.add_argument("--rounds", type=int, default=0,
                        help="rounds averaged per run (0: about 64 clients' worth, at least 1); the first round "
                             "(start-up) and a last one (evaluation) are run besides and left out")
    parser.add_argument("--paths", default="message,packed", help="simulation paths: message, packed or both")
    parser.add_argument("--table-only", action="store_true", help="write overhead.md from overhead.json")
    add_overrides(parser, "override the quickstart")
    args = parser.parse_args()
    try:
        cohorts, paths = [int(n) for n in args.cohorts.split(",")], args.paths.split(",")
        if args.rounds < 0 or min(cohorts) < 1:
            raise ValueError("--rounds must be at least 0 and every N at least 1.")
        if unknown := [p for p in paths if p not in PATHS]:
            raise ValueError(f"Unknown path '{unknown[0]}'; choose message or packed.")
        for n in cohorts:  # every config checked before the first run
            load_config(None, [f"num-clients={4 * n}", f"clients-per-round={n}", *args.set])
    except ValueError as error:
        print(f"overhead: error: {str(error).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    store = {int(n): row for n, row in json.loads(STORE.read_text()).items()} if STORE.is_file() else {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in [] if args.table_only else cohorts:
            store[n] = {**store.get(n, {}), **measure(n, args.rounds or steady_rounds(n), args.set, f"{tmp}/n{n}",
                                                       paths)}
            RESULTS.mkdir(exist_ok=True)
            STORE.write_text(json.dumps({str(k): v for k, v in sorted(store.items())}, indent=1) + "\n")
    config = load_config(None, args.set)
    rows = [store[n] for n in sorted(store)]
    paths = [p for p in PATHS if all(p in r for r in rows)]
    base = rows[0]
    lines = [
        "# Overhead: the real simulation against a bare PyTorch loop, as cohorts grow",
        "",
        "Commands: " + ", ".join(f"`{c}` (N = {', '.join(str(r['n']) for r in rows if r['command'] == c)})"
                                 for c in dict.fromkeys(r["command"] for r in rows))
        + " (each N's row is kept in overhead.json; its commit is in the last column)  ",
        f"Machine: {machine()}  ",
        f"Setting: the quickstart's client work ({config.strategy}, {config.model}, K = {config.local_steps}, batch "
        f"{config.batch_size}, noise at the {config.noise_placement}, message {config.message}) with C = 4 N; "
        "per run the first round (Ray workers start, models are built) and the last (evaluation) are left out of "
        f"the means, which cover the steady rounds given; Ray clients with {config.client_cpus} CPU each. Paths: one Flower message per "
        "sampled client (a node per client, `fedlora run`'s default and a deployment's shape), and several clients "
        "per message (`--set simulation-nodes=K`, here K = one node per Ray worker; same strategy, mechanisms, "
        "validation and accountant). Server memory: the peak RSS of the process the ServerApp runs in (with the "
        "simulation engine's driver), at the end of the run.",
        "",
        "| N | C | path | Flower nodes | steady rounds | bare loop (s/round) | real simulation (s/round) | ratio | "
        f"round 1 (s) | server peak RSS (MiB) | vs N = {base['n']} | clip + sketch + noise / training | "
        "aggregation / round | commit |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        *[f"| {r['n']} | {r['c']} | {PATHS[p]} | {r[p]['nodes']} | {r['steady_rounds']} | {r['bare_s']:.2f} | "
          f"{r[p]['sim_s']:.2f} | {r[p]['ratio']:.3f} | {r[p]['first_round_s']:.1f} | "
          f"{r[p]['server_peak_rss_mib']:.0f} | "
          f"{100 * (r[p]['server_peak_rss_mib'] / base[p]['server_peak_rss_mib'] - 1):+.1f}% | "
          f"{100 * r[p]['privatize_share']:.2f}% | {100 * r[p]['aggregation_share']:.3f}% | {r['commit']} |"
          for r in rows for p in paths],
        "",
        f"Goals: ratio <= {GOAL_RATIO:.2f} at every N; server peak memory at the largest N within "
        f"{100 * GOAL_MEMORY:.0f}% of N = {base['n']}.",
    ]
    for p in paths:
        ratios = ", ".join(f"{r[p]['ratio']:.3f} (N = {r['n']})" for r in rows)
        growth = rows[-1][p]["server_peak_rss_mib"] / base[p]["server_peak_rss_mib"] - 1
        met = all(r[p]["ratio"] <= GOAL_RATIO for r in rows)
        lines.append(f"- {PATHS[p]}: ratio {ratios}: {'met' if met else 'MISSED'}; server memory at N = "
                     f"{rows[-1]['n']}: {100 * growth:+.1f}%: {'met' if abs(growth) <= GOAL_MEMORY else 'MISSED'}.")
    if len(paths) > 1:
        best = [min(r[p]["ratio"] for p in paths) for r in rows]
        lines.append(f"- the faster path at each N: ratio {', '.join(f'{b:.3f}' for b in best)}: "
                     f"{'met' if max(best) <= GOAL_RATIO else 'MISSED'}.")
    lines += ["", WHY]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
