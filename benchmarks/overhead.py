"""What the framework costs as cohorts grow: rounds of the real simulation (SuperLink, Flower messages, Ray
clients) against a bare PyTorch loop doing the same client work, at N clients per round (C = 4 N), with the
ServerApp process's peak memory; plus the client's clip + sketch + noise time and the server's aggregation time.

    python -m benchmarks.overhead                        # N in 4, 32, 128, 512 (about 25 min here)
    python -m benchmarks.overhead --cohorts 4,32 --rounds 3
Results: benchmarks/results/overhead.md. The setting is the quickstart's client work (model, K, batch).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

from benchmarks.common import RESULTS, command_line, machine, revision
from fedlora.config import RunConfig, load_config, load_splits
from fedlora.data import load_partition, make_partitioner, to_torch
from fedlora.federation import Protocol, derive_seed
from fedlora.launch import run_simulation
from fedlora.models import model_spec
from fedlora.training import local_sgd

GOAL_RATIO, GOAL_MEMORY = 1.10, 0.10
WHY_MISSED = ("Where the ratio is missed, the likely cause (read in the code, not yet profiled): Flower 1.41's "
              "simulation engine polls every node for its messages every 0.1 s (`vce_api.add_messages_to_queue`), "
              "and each poll scans every pending message under the state's lock "
              "(`InMemoryLinkState.get_message_ins`): O(C N) work per sweep, on the same cores as the clients. "
              "A path with several clients per message (fewer Flower nodes) is the planned fix.")


def bare_rounds(config: RunConfig, rounds: int) -> list[float]:
    """Seconds per round of plain PyTorch: N clients' K steps one after the other, same model, batches, seeds."""
    model = Protocol(config, 0.0).build_model()
    train, _ = load_splits(config)
    partitioner = make_partitioner(config.partitioner, num_partitions=config.num_clients, dataset=train,
                                   seed=config.seed)
    size = model_spec(config.model).image_size
    times = []
    for round_ in range(1, rounds + 1):
        clients = torch.randperm(config.num_clients, generator=torch.Generator().manual_seed(round_))
        start = time.perf_counter()
        for pid in clients[:config.clients_per_round].tolist():
            data = to_torch(load_partition(partitioner, pid), size, train=True)
            local_sgd(model, data, steps=config.local_steps, batch_size=config.batch_size, lr=config.lr,
                      generator=torch.Generator().manual_seed(derive_seed(config.seed, "batches", round_, pid)))
        times.append(time.perf_counter() - start)
    return times


def measure(n: int, rounds: int, overrides: list[str], out_dir: str) -> dict:
    # eval-every beyond the run: only the last round evaluates the global model, and it is left out
    config = load_config(None, [f"num-clients={4 * n}", f"clients-per-round={n}", f"num-rounds={rounds}",
                                f"eval-every={rounds + 1}", *overrides])
    print(f"== N = {n}, C = {4 * n}: bare loop", flush=True)
    bare = bare_rounds(config, rounds - 1)
    print(f"== N = {n}, C = {4 * n}: real simulation", flush=True)
    sim = run_simulation(config, out_dir, echo=lambda line: print("  ", line, flush=True))
    steady = sim[1:-1]  # round 1 starts the Ray workers and builds the models; the last evaluates
    bare_s, sim_s = statistics.mean(bare[1:]), statistics.mean(r["seconds"] for r in steady)
    return {"n": n, "c": 4 * n, "bare_s": bare_s, "sim_s": sim_s, "ratio": sim_s / bare_s,
            "first_round_s": sim[0]["seconds"], "server_peak_rss_mib": max(r["server_peak_rss_mib"] for r in sim),
            "privatize_share": statistics.mean(r["client_privatize_seconds"] / r["client_train_seconds"]
                                               for r in steady),
            "aggregation_share": statistics.mean(r["aggregation_seconds"] / r["seconds"] for r in steady),
            "config": config}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cohorts", default="4,32,128,512", help="N values, comma-separated (C = 4 N)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per run: the first and the last are left out")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override the quickstart")
    args = parser.parse_args()
    try:
        cohorts = [int(n) for n in args.cohorts.split(",")]
        if args.rounds < 3 or min(cohorts) < 1:
            raise ValueError("--rounds must be at least 3 and every N at least 1.")
        for n in cohorts:  # every config checked before the first run
            load_config(None, [f"num-clients={4 * n}", f"clients-per-round={n}", *args.set])
    except ValueError as error:
        print(f"overhead: error: {str(error).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(n, args.rounds, args.set, f"{tmp}/n{n}") for n in cohorts]
    config, base = rows[0]["config"], rows[0]
    lines = [
        "# Overhead: the real simulation against a bare PyTorch loop, as cohorts grow",
        "",
        f"Command: `{command_line('benchmarks.overhead')}`  ",
        f"Commit: {revision()}  ",
        f"Machine: {machine()}  ",
        f"Setting: the quickstart's client work ({config.strategy}, {config.model}, K = {config.local_steps}, batch "
        f"{config.batch_size}, noise at the {config.noise_placement}, message {config.message}) with C = 4 N; "
        f"{args.rounds} rounds per run, the first (Ray workers start, models are built) and the last (evaluation) "
        f"left out of the means; Ray clients with {config.client_cpus} CPU each. Path: the per-message path "
        "(`fedlora run`: one Flower message per sampled client). Server memory: the peak RSS of the process the "
        "ServerApp runs in (with the simulation engine's driver), at the end of the run.",
        "",
        "| N | C | bare loop (s/round) | real simulation (s/round) | ratio | round 1 (s) | server peak RSS (MiB) | "
        f"vs N = {base['n']} | clip + sketch + noise / training | aggregation / round |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *[f"| {r['n']} | {r['c']} | {r['bare_s']:.2f} | {r['sim_s']:.2f} | {r['ratio']:.3f} | {r['first_round_s']:.1f} | "
          f"{r['server_peak_rss_mib']:.0f} | {100 * (r['server_peak_rss_mib'] / base['server_peak_rss_mib'] - 1):+.1f}% | "
          f"{100 * r['privatize_share']:.2f}% | {100 * r['aggregation_share']:.3f}% |" for r in rows],
        "",
        f"Goals: ratio <= {GOAL_RATIO:.2f} at every N; server peak memory at the largest N within "
        f"{100 * GOAL_MEMORY:.0f}% of N = {base['n']}.",
        *[f"- N = {r['n']}: ratio {r['ratio']:.3f}: {'met' if r['ratio'] <= GOAL_RATIO else 'MISSED'}." for r in rows],
    ]
    growth = rows[-1]["server_peak_rss_mib"] / base["server_peak_rss_mib"] - 1
    lines.append(f"- server memory at N = {rows[-1]['n']}: {100 * growth:+.1f}%: "
                 f"{'met' if abs(growth) <= GOAL_MEMORY else 'MISSED'}.")
    if any(r["ratio"] > GOAL_RATIO for r in rows):
        lines += ["", WHY_MISSED]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
