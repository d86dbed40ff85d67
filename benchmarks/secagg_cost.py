"""What secure aggregation costs: seconds and bytes per round with and without SecAgg+ at N clients per round
(C = 4 N), the quickstart's model and client work, noise at the server beside noise in shares under SecAgg+.

    python -m benchmarks.secagg_cost                  # N in 4, 16, 64 (about 10 min here)
    python -m benchmarks.secagg_cost --cohorts 4,16 --rounds 3
Results: benchmarks/results/secagg_cost.{md,json}. Runs are in process (the ServerApp and ClientApp over an
in-process Grid, clients one after the other): a round's seconds are the clients' work plus the server's, without
Ray or the network, so the difference between the placements is what SecAgg+ computes (key agreement, Shamir
shares, masks, the integer encoding, unmasking). Bytes are the protocol's payload per client and round (release,
keys, encrypted shares, masked vector), Flower's message framing not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks.common import RESULTS, command_line, machine, revision, run_inprocess
from fedlora.config import load_config

COHORTS = (4, 16, 64)
PLACEMENTS = ("server", "secagg")
STORE = RESULTS / "secagg_cost.json"


def measure(n: int, placement: str, rounds: int) -> dict:
    """Steady rounds (the first, which builds the model, and the last, which evaluates, left out)."""
    config = load_config(None, [f'noise-placement="{placement}"', f"clients-per-round={n}", f"num-clients={4 * n}",
                                f"num-rounds={rounds}", "eval-every=1000", "test-examples=200"])
    with tempfile.TemporaryDirectory() as out:
        rows = run_inprocess(config, out)
    steady = rows[1:-1]
    return {"n": n, "placement": placement, "rounds": len(steady), "min_replies": config.required_replies(),
            "seconds_per_round": statistics.mean(r["seconds"] for r in steady),
            "client_privatize_seconds": statistics.mean(r["client_privatize_seconds"] for r in steady),
            "bytes_up_per_client": statistics.mean(r["bytes_up"] for r in steady),
            "bytes_down_per_client": statistics.mean(r["bytes_down"] for r in steady),
            "replies": min(r["replies"] for r in steady), "epsilon": rows[-1]["epsilon"],
            "threat_model": rows[-1]["threat_model"]}


def shamir_seconds(n: int, threshold: int) -> dict:
    """Seconds for a client's Shamir split of its key and its mask seed (each client, every round), with fedlora.shamir
    (what the ClientApp's secaggplus_mod runs) and with Flower's own, side by side, and for the server's reconstruction
    of the round's n mask seeds from all n survivors' shares (fedlora.shamir: the coefficients once a round, then n
    multiplications per 16 bytes; every seed costs the same, so one seed's shares stand for all)."""
    from flwr.common.secure_aggregation.crypto import shamir as flower
    from flwr.supercore.primitives.asymmetric import generate_key_pairs, private_key_to_bytes

    from fedlora import shamir

    key, seed = private_key_to_bytes(generate_key_pairs()[0]), os.urandom(32)  # as secaggplus_mod's
    seconds = {}
    for name, split in (("flower", flower.create_shares), ("fedlora", shamir.create_shares)):
        started = time.perf_counter()
        split(key, threshold, n)
        shares = split(seed, threshold, n)
        seconds[name] = time.perf_counter() - started
    shamir.lagrange_at_zero.cache_clear()
    started = time.perf_counter()
    for _ in range(n):
        shamir.combine_shares(shares)
    return {"client_split_seconds": seconds, "server_shamir_seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cohorts", default=",".join(map(str, COHORTS)))
    parser.add_argument("--rounds", type=int, default=4, help="rounds per run; all but the first and last are timed")
    args = parser.parse_args()
    try:
        cohorts = [int(n) for n in args.cohorts.split(",")]
        if any(n < 2 for n in cohorts) or args.rounds < 3:
            raise ValueError("cohorts must be at least 2 clients (SecAgg+ sums at least 2) and --rounds at least 3.")
    except ValueError as error:
        print(f"secagg_cost: error: {str(error).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    done = json.loads(STORE.read_text()) if STORE.is_file() else {}
    for n in cohorts:
        row = {placement: measure(n, placement, args.rounds) for placement in PLACEMENTS}  # side by side
        row.update(shamir_seconds(n, row["secagg"]["min_replies"]))
        row.update(commit=revision(), command=command_line("benchmarks.secagg_cost"))
        done[str(n)] = row
        print(f"N = {n}: {row['server']['seconds_per_round']:.2f} s per round with noise at the server, "
              f"{row['secagg']['seconds_per_round']:.2f} s under SecAgg+", flush=True)
        RESULTS.mkdir(exist_ok=True)
        STORE.write_text(json.dumps(done, indent=1) + "\n")
    write_table(done)


def _shamir(row: dict) -> str:
    """fedlora's split / Flower's split / the server's reconstruction; rows from before fedlora split timed Flower's
    split alone (as client_shamir_seconds), rows older still nothing."""
    split = row.get("client_split_seconds", {"flower": row.get("client_shamir_seconds")})
    return " / ".join("-" if value is None else f"{value:.2f}"
                      for value in (split.get("fedlora"), split["flower"], row.get("server_shamir_seconds")))


def write_table(done: dict) -> None:
    lines = ["# Secure aggregation's cost per round", "",
             f"Machine: {machine()}. The quickstart's model and client work (sgmm-ffa-lora, updates, K = 2, batch 16), "
             "C = 4 N, epsilon 8; in process, clients one after the other (see benchmarks/secagg_cost.py). "
             "Each N's two runs were measured side by side; its commit and command are in secagg_cost.json.", "",
             "| N | seconds / round, noise at the server | under SecAgg+ | ratio | client privatize (s), server / SecAgg+ | "
             "bytes up / client, server placement | under SecAgg+ | bytes down / client (protocol only) | N_min | "
             "Shamir (s): a client's split of its key and seed, fedlora.shamir (what the clients run) / Flower's; the "
             "server's reconstruction of the round's N seeds |",
             "|---:|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for key in sorted(done, key=int):
        s, a = done[key]["server"], done[key]["secagg"]
        lines.append(f"| {key} | {s['seconds_per_round']:.2f} | {a['seconds_per_round']:.2f} | "
                     f"{a['seconds_per_round'] / s['seconds_per_round']:.2f} | {s['client_privatize_seconds']:.3f} / "
                     f"{a['client_privatize_seconds']:.3f} | "
                     f"{s['bytes_up_per_client'] / 1024:.1f} KiB | {a['bytes_up_per_client'] / 1024:.1f} KiB | "
                     f"{(a['bytes_down_per_client'] - s['bytes_down_per_client']) / 1024:.1f} KiB | "
                     f"{a['min_replies']} | {_shamir(done[key])} |")
    lines += ["", "Where the time goes at large N: every client splits its key and mask seed into N Shamir shares of "
              "threshold N_min, O(N N_min) per client (fedlora.shamir: Horner by the share's index, every 16-byte "
              "chunk in one integer; Flower's `create_shares`: PyCryptodome's masked GF(2^128) arithmetic in "
              "Python), all clients one after the other here, in parallel on real devices, and the server combines "
              "the survivors' shares of each client's seed (fedlora.shamir: the Lagrange coefficients once a round, "
              "O(N^2), then O(N) per client"
              + ("; a row's \"-\" was not measured by its commit: its seconds per round are with the clients "
                 "splitting by Flower's `create_shares`, and rows with no Shamir seconds at all timed one key's split "
                 "and Flower's combine of N_min shares, O(N_min^2) per client: in secagg_cost.json"
                 if any("client_split_seconds" not in row for row in done.values()) else "")
              + "). SecAgg+ with fewer neighbours than N (its `num_shares`) is the known remedy; fedlora uses every "
              "client as a neighbour so far.", "",
              "SecAgg+ sends each entry as a masked 64-bit integer (the server placement: 32-bit floats), plus two "
              "public keys, one encrypted share pair per other client and, at the unmask stage, one share per "
              "client: the upload grows with N, as every client is every other's neighbour here.", ""]
    (RESULTS / "secagg_cost.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
