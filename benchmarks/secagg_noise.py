"""Is secure aggregation's noise the server placement's noise, as far as accuracy goes? One round of the quickstart's
gm-ffa-lora with everything fixed (seed, sampled clients, their training and clipped updates) but the noise draw:
the Gaussian the server adds, N(0, (z tau)^2) per entry, against the decoded sum of N Skellam shares
(fedlora.secure_sum) at N_min = 45 (the secagg default: N / N_min = 1.11 times the variance) and N_min = N = 50 (the
same variance). Each draw's noisy mean update is applied (server SGD, lr 1) and the model evaluated.

    python -m benchmarks.secagg_noise                  # 20 draws of each (about 6 min here)
    python -m benchmarks.secagg_noise --draws 5 --seed 1
    python -m benchmarks.secagg_noise --replay --epsilon 4 --seed 0   # whole runs (about 15 min here)
    python -m benchmarks.secagg_noise --spread --epsilon 4 --seed 0 --draws 6 --workers 2   # about 20 min here
Results: benchmarks/results/secagg_noise.{md,json}; --replay: secagg_replay.{md,json}; --spread: secagg_spread.{md,json}. The noiseless round is one in-process run at z = 1e-6; the noisy
global model is that round's state plus the noise over N, exactly what either placement's aggregation computes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import RESULTS, provenance, run_inprocess, worker_pool
from fedlora.checkpoint import Checkpoint
from fedlora.config import load_config
from fedlora.experiment import RunRecorder
from fedlora.federation import Protocol
from fedlora.round_plan import GlobalState
from fedlora.secure_sum import SkellamSecureSum

Z = 1.470703125  # the quickstart's calibrated z at epsilon 8 (both placements)
ARMS = {"gaussian (noise at the server)": None, "skellam shares, N_min = 45": 45, "skellam shares, N_min = 50": 50}


def measure(seed: int, draws: int) -> dict[str, list[float]]:
    config = load_config(None, ['strategy="gm-ffa-lora"', "num-rounds=1", "target-epsilon=0", "noise-multiplier=1e-6",
                                'noise-placement="server"', f"seed={seed}"])
    n, tau = config.clients_per_round, config.clip_norm
    with tempfile.TemporaryDirectory() as out:
        run_inprocess(config, Path(out) / "run")
        clean = Checkpoint.load(Path(out) / "run").state
        recorder = RunRecorder(dataclasses.replace(config, tracker="none"), Protocol(config, Z), Path(out) / "eval",
                               echo=lambda line: None)  # evaluates only: no run to track
        names = sorted(clean.message)
        dim = sum(clean.message[name].numel() for name in names)

        def accuracy(noise: np.ndarray) -> float:
            message, start = {}, 0
            for name in names:
                t = clean.message[name]
                message[name] = t + torch.from_numpy(noise[start:start + t.numel()]).reshape(t.shape).to(t.dtype) / n
                start += t.numel()
            return recorder.evaluate(GlobalState(message, clean.produced_by))[0]

        results: dict[str, list[float]] = {arm: [] for arm in ARMS}
        zero = {"w": torch.zeros(dim)}
        for k in range(draws):
            for arm, min_replies in ARMS.items():
                if min_replies is None:
                    noise = np.random.default_rng([seed, k]).standard_normal(dim) * Z * tau
                else:
                    codec = SkellamSecureSum(Z, tau, n, min_replies, dim)
                    total = sum(codec.encode(zero, np.random.default_rng([seed, k, min_replies, i]))["w"]
                                for i in range(n))
                    noise = codec.decode({"w": total}, torch.float64)["w"].numpy()
                results[arm].append(accuracy(noise))
            print(f"draw {k + 1}/{draws}: " + ", ".join(f"{a} {v[-1]:.3f}" for a, v in results.items()), flush=True)
        results["noiseless"] = [recorder.evaluate(clean)[0]]
    return results


def replay(seed: int, epsilon: float) -> dict:
    """A secagg run that records each round's noise, then the server placement with that noise; both in process."""
    import math

    from fedlora.mechanisms import Mechanism

    base = ['strategy="gm-ffa-lora"', f"target-epsilon={epsilon}", f"seed={seed}"]
    pending, noises, ratios, means = [], [], [], []
    encode, decode = SkellamSecureSum.encode, SkellamSecureSum.decode

    def recording_encode(self, release, generator):
        pending.append({n: t.detach().double().clone() for n, t in release.items()})
        return encode(self, release, generator)

    def recording_decode(self, total, dtype=torch.float32):
        out = decode(self, total, dtype)
        noise = {n: t.double() - sum(p[n] for p in pending) for n, t in out.items()}
        flat = torch.cat([t.ravel() for t in noise.values()])
        ratios.append(float(flat.std()) / (self.noise_multiplier * self.clip_norm
                                           * math.sqrt(len(pending) / self.min_replies)))
        means.append(float(flat.mean() / flat.std()))
        noises.append(noise)
        pending.clear()
        return out

    def replaying_noise_sum(self, total, noise, *, scale=1.0):
        recorded = next(replayed)
        return {n: t + recorded[n].to(t.dtype) for n, t in total.items()}

    with tempfile.TemporaryDirectory() as out:
        SkellamSecureSum.encode, SkellamSecureSum.decode = recording_encode, recording_decode
        try:
            secure = run_inprocess(load_config(None, [*base, 'noise-placement="secagg"']), Path(out) / "secagg",
                                   echo=lambda line: print(f"  [secagg, recording its noise] {line}", flush=True))
        finally:
            SkellamSecureSum.encode, SkellamSecureSum.decode = encode, decode
        replayed, noise_sum = iter(noises), Mechanism.noise_sum
        Mechanism.noise_sum = replaying_noise_sum
        try:
            server = run_inprocess(load_config(None, [*base, 'noise-placement="server"']), Path(out) / "server",
                                   echo=lambda line: print(f"  [server, secagg's noise] {line}", flush=True))
        finally:
            Mechanism.noise_sum = noise_sum
    return {"seed": seed, "epsilon": epsilon, "noise_multiplier": secure[-1]["noise_multiplier"],
            "secagg": [r["accuracy"] for r in secure], "server_with_secagg_noise": [r["accuracy"] for r in server],
            "noise_sd_over_expected": ratios, "noise_mean_in_sds": means, "summed": [r["replies"] for r in secure]}


def _secagg_variance_factor() -> float:
    """N / N_min at the quickstart under secure aggregation: how much more variance its sums carry when all reply."""
    config = load_config(None, ['noise-placement="secagg"'])
    return config.clients_per_round / config.required_replies()


SPREAD_ARMS = ("z (noise at the server)", "z sqrt(N / N_min) (what secagg's sums carry at the default N_min)")


def _spread_run(epsilon: float, seed: int, draw: int, variance_factor: float, threads: int) -> list[float]:
    """One whole run of the server placement whose noise is draw ``draw`` (everything else the seed's), its variance
    times ``variance_factor``; in a worker process, which runs several: the patches are undone after each."""
    import math

    from fedlora.round_plan import derive_seed
    from fedlora.mechanisms import Mechanism

    torch.set_num_threads(threads)
    server_noise, noise_sum = Protocol.server_noise, Mechanism.noise_sum
    Protocol.server_noise = lambda self, release: torch.Generator().manual_seed(
        derive_seed(self.config.seed, "server-noise", release, "draw", draw))
    Mechanism.noise_sum = lambda self, total, noise, *, scale=1.0: noise_sum(
        self, total, noise, scale=scale * math.sqrt(variance_factor))
    config = load_config(None, ['strategy="gm-ffa-lora"', f"target-epsilon={epsilon}", f"seed={seed}",
                                'noise-placement="server"'])
    try:
        with tempfile.TemporaryDirectory() as out:
            return [r["accuracy"] for r in run_inprocess(config, Path(out) / "run")]
    finally:
        Protocol.server_noise, Mechanism.noise_sum = server_noise, noise_sum


def spread(seed: int, epsilon: float, draws: int, workers: int) -> dict:
    """How much one run's accuracy moves with its noise draw alone: ``draws`` whole runs per arm."""
    import concurrent.futures
    import os

    threads = max(1, (os.cpu_count() or 1) // workers)
    factors = dict(zip(SPREAD_ARMS, (1.0, _secagg_variance_factor())))
    runs: dict[str, list] = {arm: [None] * draws for arm in SPREAD_ARMS}  # by draw: the arms share each draw
    with worker_pool(workers, "secagg_noise", "the spread is written at its end only: run it again") as pool:
        futures = {pool.submit(_spread_run, epsilon, seed, draw, factor, threads): (arm, draw)
                   for draw in range(draws) for arm, factor in factors.items()}
        for future in concurrent.futures.as_completed(futures):
            arm, draw = futures[future]
            runs[arm][draw] = future.result()
            print(f"  [{arm}, draw {draw}] final accuracy {runs[arm][draw][-1]:.3f}", flush=True)
    return {"seed": seed, "epsilon": epsilon, "draws": draws, "variance_factors": list(factors.values()), "runs": runs}


def write_spread(result: dict) -> None:
    from scipy import stats

    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "secagg_spread.json").write_text(json.dumps(result, indent=1) + "\n")
    finals = {arm: [r[-1] for r in runs] for arm, runs in result["runs"].items()}
    late = {arm: [statistics.mean(r[4:]) for r in runs] for arm, runs in result["runs"].items()}
    lines = ["# How much a run's accuracy moves with its noise draw alone", "",
             *provenance("benchmarks.secagg_noise"),
             f"Setting: the quickstart's gm-ffa-lora with noise at the server, seed {result['seed']} (its sampled "
             f"clients, batches and partitions fixed), epsilon {result['epsilon']:g}; {result['draws']} whole runs "
             "per arm; draw k of both arms is the same standardized noise, scaled. The second arm's variance is "
             f"N / N_min = {result['variance_factors'][1]:.4f} times the first's: by the replay (secagg_replay.md) "
             "it is secure aggregation's mechanism at its default N_min, without the protocol.",
             "", "| noise | final accuracy per draw | mean | sd | rounds 5-10, mean | sd |", "|---|---|---:|---:|---:|---:|"]
    for arm in SPREAD_ARMS:
        values = finals[arm]
        lines.append(f"| {arm} | {', '.join(f'{v:.3f}' for v in values)} | {statistics.mean(values):.3f} | "
                     f"{statistics.stdev(values):.3f} | {statistics.mean(late[arm]):.3f} | "
                     f"{statistics.stdev(late[arm]):.3f} |")
    first, second = (finals[arm] for arm in SPREAD_ARMS)
    late_first, late_second = (late[arm] for arm in SPREAD_ARMS)
    lines += ["", "Paired by draw, the first arm's accuracy less the second's: final {:.3f} (t = {:.2f}, p = {:.4f}), "
              "rounds 5-10 {:.3f} (t = {:.2f}, p = {:.4f}); lower in {} of {} draws.".format(
                  statistics.mean(a - b for a, b in zip(first, second)), *stats.ttest_rel(first, second),
                  statistics.mean(a - b for a, b in zip(late_first, late_second)),
                  *stats.ttest_rel(late_first, late_second), sum(b < a for a, b in zip(first, second)), len(first))]
    (RESULTS / "secagg_spread.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def write_replay(result: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "secagg_replay.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# Secure aggregation's pipeline against the server placement's, given the same noise", "",
             *provenance("benchmarks.secagg_noise"),
             f"Setting: the quickstart's gm-ffa-lora, seed {result['seed']}, epsilon {result['epsilon']:g} (z = "
             f"{result['noise_multiplier']}), in process. A secagg run records each round's noise (decoded sum minus "
             "the plain sum of the releases); the server placement then runs with the same seed, adding exactly that "
             "noise.", "",
             "| round | secagg | server placement, secagg's noise | noise sd / (z tau sqrt(n / N_min)) | noise mean (sd) | replies summed |",
             "|---:|---:|---:|---:|---:|---:|"]
    for i, (a, b, r, m, n) in enumerate(zip(result["secagg"], result["server_with_secagg_noise"],
                                            result["noise_sd_over_expected"], result["noise_mean_in_sds"],
                                            result["summed"]), start=1):
        lines.append(f"| {i} | {a:.3f} | {b:.3f} | {r:.3f} | {m:+.3f} | {n} |")
    (RESULTS / "secagg_replay.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--replay", action="store_true", help="whole runs: secagg, then the server placement with "
                                                              "the noise secagg's sums carried")
    parser.add_argument("--spread", action="store_true", help="whole runs of the server placement, --draws noise "
                                                              "draws at z and at z sqrt(N / N_min)")
    parser.add_argument("--epsilon", type=float, default=4.0, help="target epsilon of the --replay and --spread runs")
    parser.add_argument("--workers", type=int, default=1, help="--spread runs at a time")
    args = parser.parse_args()
    problem = ("--draws must be at least 2" if args.draws < 2 else "--seed must be at least 0" if args.seed < 0
               else "--epsilon must be positive" if not args.epsilon > 0 else "--workers must be at least 1"
               if args.workers < 1 else "choose --replay or --spread, not both" if args.replay and args.spread
               else None)
    if problem:
        print(f"secagg_noise: error: {problem}.", file=sys.stderr)
        sys.exit(2)
    if args.spread:
        write_spread(spread(args.seed, args.epsilon, args.draws, args.workers))
        return
    if args.replay:
        write_replay(replay(args.seed, args.epsilon))
        return
    from scipy import stats

    results = measure(args.seed, args.draws)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "secagg_noise.json").write_text(json.dumps(results, indent=1) + "\n")
    gaussian = results["gaussian (noise at the server)"]
    lines = ["# Secure aggregation's noise against the server's, one round", "",
             *provenance("benchmarks.secagg_noise"),
             f"Setting: the quickstart's gm-ffa-lora, seed {args.seed}, round 1 (N = 50 clients, their clipped updates "
             f"fixed), z = {Z}; accuracy of the global model after one noisy round, {args.draws} noise draws per arm; "
             f"without noise: {results['noiseless'][0]:.3f}.", "",
             "| noise | accuracy, mean | sd over draws | Welch t-test against the Gaussian |", "|---|---:|---:|---|"]
    for arm in ARMS:
        values = results[arm]
        test = "-" if ARMS[arm] is None else "t = {:.2f}, p = {:.3f}".format(
            *stats.ttest_ind(gaussian, values, equal_var=False))
        lines.append(f"| {arm} | {statistics.mean(values):.3f} | {statistics.stdev(values):.3f} | {test} |")
    (RESULTS / "secagg_noise.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
