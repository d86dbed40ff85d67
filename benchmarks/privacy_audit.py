"""The privacy audit report: every strategy's accountant epsilon beside its empirical epsilon, under each threat model.

    python -m benchmarks.privacy_audit     # writes benchmarks/results/privacy_audit.{md,json,png}
    python -m benchmarks.privacy_audit --only mechanism   # re-measures one level, keeps the other's saved rows

Mechanism level: one 192 x 4 LoRA B (the tiny ViT's query/value) at clip norm 1, released through each
strategy's mechanism; the attacker's best statistic; Clopper-Pearson lower bounds (fedlora.audit).
Secure aggregation (noise-placement = "secagg", N = 50 replies, N_min = 45): the same message through the codec, seen
by a server that follows SecAgg+ (the decoded sum) and by one that breaks it (one reply alone).
Federation level: `fedlora audit`'s canary run (the quickstart: 500 clients, 50 per round, noise at the server,
target epsilon 8, 300 canaries) for every strategy and threat model.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, command_line, machine, revision
from fedlora.audit import audit_mechanism, audit_secure_sum, verdict
from fedlora.config import AUDIT_PRESET, load_config
from fedlora.mechanisms import Mechanism, gaussian_mechanism, sgmm_mechanism, sgmv_mechanism
from fedlora.sketch import MatrixSketch

SHAPE = (192, 4)


def mechanism_rows(z: float) -> list[tuple[str, Mechanism, int]]:
    """(strategies, mechanism, clients sharing the sketch) for every mechanism and threat model."""
    def sgmm(threat: str, b: int = 64, noise: float = z):
        return sgmm_mechanism(sketch_dim=b, clip_norm=1.0, noise_multiplier=noise, threat_model=threat)

    def sgmv(threat: str):
        return sgmv_mechanism(sketch_dim=64 * SHAPE[1], clip_norm=1.0, noise_multiplier=z, threat_model=threat)

    return [
        ("ffa-lora, flexlora (not private)", Mechanism(clip_norm=1.0), 1),
        ("a sketch without noise (papers 000/003)", Mechanism(MatrixSketch(64), 1.0, 0.0, "secret-sketch"), 1),
        ("gm-ffa-lora, gm-flexlora", gaussian_mechanism(clip_norm=1.0, noise_multiplier=z), 1),
        ("sgmm-ffa-lora, sgmm-flexlora", sgmm("known-sketch"), 1),
        ("sgmv-ffa-lora", sgmv("known-sketch"), 1),
        ("sgmm-ffa-lora, sgmm-flexlora", sgmm("secret-sketch"), 1),
        ("sgmv-ffa-lora", sgmv("secret-sketch"), 1),
        ("sgmm-ffa-lora, sgmm-flexlora", sgmm("secret-sketch"), 4),
        ("sgmm-ffa-lora, sgmm-flexlora", sgmm("secret-sketch", b=150, noise=0.8), 64),
    ]


SECAGG_CLIENTS, SECAGG_MIN_REPLIES = 50, 45  # the quickstart's N and the secagg default N_min (90% of N)


def secagg_rows(z: float) -> list[tuple[str, Mechanism, bool]]:
    """(strategies, mechanism, one reply alone) under secure aggregation: the sum a server that follows SecAgg+
    decodes, and one reply a server that breaks it decodes."""
    gm = gaussian_mechanism(clip_norm=1.0, noise_multiplier=z, placement="secagg")
    sgmm = sgmm_mechanism(sketch_dim=64, clip_norm=1.0, noise_multiplier=z, placement="secagg")
    return [("gm-ffa-lora, gm-flexlora", gm, False), ("sgmm-ffa-lora, sgmm-flexlora", sgmm, False),
            ("gm-ffa-lora, gm-flexlora", gm, True)]


FEDERATION_RUNS = [("ffa-lora", "known-sketch"), ("flexlora", "known-sketch"),
                   ("gm-ffa-lora", "known-sketch"), ("gm-flexlora", "known-sketch"),
                   ("sgmm-ffa-lora", "known-sketch"), ("sgmm-ffa-lora", "secret-sketch"),
                   ("sgmv-ffa-lora", "known-sketch"), ("sgmv-ffa-lora", "secret-sketch"),
                   ("sgmm-flexlora", "known-sketch"), ("sgmm-flexlora", "secret-sketch")]


def federation_config(strategy: str, threat: str, delta: float):
    """`fedlora audit`'s default run for ``strategy``: under secret-sketch in the paper's form (noise at the client,
    adapters sent), the only one that threat model's bound covers."""
    paper_form = ['noise-placement="client"', 'message="adapter"'] if threat == "secret-sketch" else []
    return load_config(None, [f"{k}={v}" for k, v in AUDIT_PRESET.items()]
                       + [f"strategy={strategy}", f"threat-model={threat}", f"delta={delta}", *paper_form])


def _eps(value: float | None) -> str:
    return "inf" if value is None or math.isinf(value) else f"{value:.2f}"


def _verdict(r: dict) -> str:
    text = verdict(r)
    return f"**{text}**" if "refuted" in text else text


def _plot(results: list[dict], path: Path) -> None:
    """One bar pair per audit: the accountant's epsilon and the empirical one (a red x: the paper's claim)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cap = 12.0
    levels = [lvl for lvl in ("mechanism", "federation") if any(r["level"] == lvl for r in results)]
    fig, axes = plt.subplots(len(levels), 1, figsize=(9, 1.2 + 0.42 * len(results)), squeeze=False,
                             gridspec_kw={"height_ratios": [sum(r["level"] == lvl for r in results) for lvl in levels]})
    for ax, level in zip(axes[:, 0], levels):
        rows = [r for r in results if r["level"] == level][::-1]
        y = np.arange(len(rows))
        accountant = [cap if r["accountant_epsilon"] is None else min(r["accountant_epsilon"], cap) for r in rows]
        empirical = [cap if r["empirical_epsilon"] is None else min(r["empirical_epsilon"], cap) for r in rows]
        ax.barh(y + 0.2, accountant, height=0.38, color="lightgray", label="accountant epsilon")
        ax.barh(y - 0.2, empirical, height=0.38, color="tab:blue" if level == "mechanism" else "tab:green",
                label="empirical: 95% lower bound" if level == "mechanism" else "empirical: 95% lower bound, one run")
        for i, r in enumerate(rows):
            for value, dy in ((r["accountant_epsilon"], 0.2), (r["empirical_epsilon"], -0.2)):
                if value is None or value > cap:
                    ax.text(cap, i + dy, " inf" if value is None else f" {value:.1f}", va="center", fontsize=7)
            if r.get("claimed_epsilon") is not None:
                ax.plot([r["claimed_epsilon"]], [i], "x", color="tab:red", markersize=9,
                        label="the paper's per-message epsilon")
        ax.set_yticks(y, [f"{r['strategies']} ({r['threat_model']})" if level == "federation" else r["name"]
                          for r in rows], fontsize=7)
        ax.set_xlim(0, cap * 1.12)
        ax.set_title("one client message" if level == "mechanism" else "canaries in a whole run", fontsize=9)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.legend(unique.values(), unique.keys(), fontsize=7, loc="center right")
    axes[-1, 0].set_xlabel("epsilon at delta 1e-5 (bars cut at 12)")
    fig.suptitle("A lower bound longer than its gray bar (or past a red x) refutes that claim", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10000, help="releases per hypothesis (mechanism level)")
    parser.add_argument("--noise-multiplier", type=float, default=1.0, help="z of the mechanism-level rows")
    parser.add_argument("--canaries", type=int, default=300, help="canary clients per run (0: no federation level)")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--only", choices=["mechanism", "federation"],
                        help="measure one level, keep the other level's rows from the saved JSON")
    parser.add_argument("--render", action="store_true", help="rewrite the markdown and plot from the saved JSON")
    args = parser.parse_args()
    saved = RESULTS / "privacy_audit.json"
    if args.only and not saved.is_file():
        parser.error(f"--only keeps the other level's rows from {saved}, which does not exist: run without --only")
    if args.render:
        report = json.loads(saved.read_text())
    else:
        report = measure(args)
        if args.only:
            report = merged(json.loads(saved.read_text()), report, args.only)
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "privacy_audit.json").write_text(json.dumps(report, indent=2) + "\n")
    render(report)
    print(f"wrote {RESULTS / 'privacy_audit.md'}")


def merged(saved: dict, new: dict, level: str) -> dict:
    """``new``'s rows of ``level`` with ``saved``'s rows of the other level, each level with its own commit."""
    other = "federation" if level == "mechanism" else "mechanism"
    commits = {**saved.get("commits", {lvl: saved["commit"] for lvl in ("mechanism", "federation")}),
               level: new["commit"]}
    rows = [r for r in new["results"] if r["level"] == level] + [r for r in saved["results"] if r["level"] == other]
    rows.sort(key=lambda r: r["level"] != "mechanism")
    keep = {k: saved[k] for k in ("canaries", "federation_setting") if level == "mechanism"} | \
        {k: saved[k] for k in ("trials", "noise_multiplier") if level == "federation"}
    return {**new, **keep, "command": f"{saved['command']}; {new['command']}", "commits": commits,
            "minutes": saved["minutes"] + new["minutes"], "results": rows}


def measure(args: argparse.Namespace) -> dict:
    from fedlora.strategies.canary_audit import audit_federation

    started = time.perf_counter()
    results = []
    mechanism_level = args.only != "federation"
    for strategies, mechanism, n in mechanism_rows(args.noise_multiplier) if mechanism_level else []:
        r = audit_mechanism(mechanism, shape=SHAPE, trials=args.trials, delta=args.delta, clients_per_round=n)
        results.append({"strategies": strategies, **r.to_json()})
        print(f"{strategies}: {r.name}: AUC {r.auc:.3f}, empirical {r.empirical_epsilon:.2f}, accountant "
              f"{r.accountant_epsilon:.2f} ({r.threat_model})", flush=True)
    for strategies, mechanism, alone in secagg_rows(args.noise_multiplier) if mechanism_level else []:
        r = audit_secure_sum(mechanism, clients_per_round=SECAGG_CLIENTS, min_replies=SECAGG_MIN_REPLIES,
                             alone=alone, shape=SHAPE, trials=args.trials, delta=args.delta)
        results.append({"strategies": strategies, **r.to_json()})
        print(f"{strategies}: {r.name}: AUC {r.auc:.3f}, empirical {r.empirical_epsilon:.2f}, accountant "
              f"{r.accountant_epsilon:.2f} ({r.threat_model})", flush=True)
    for strategy, threat in FEDERATION_RUNS if args.canaries and args.only != "mechanism" else []:
        config = federation_config(strategy, threat, args.delta)
        with tempfile.TemporaryDirectory() as out:
            r = audit_federation(config, args.canaries, Path(out), echo=lambda line: None)
        results.append({"strategies": strategy, **r.to_json()})
        print(f"{strategy} ({threat}): AUC {r.auc:.3f}, empirical {r.empirical_epsilon:.2f}, accountant "
              f"{r.accountant_epsilon:.2f}", flush=True)
    default = federation_config("sgmm-ffa-lora", "known-sketch", args.delta)
    setting = (f"{default.num_clients} clients, {default.clients_per_round} per round, noise at the "
               f"{default.noise_placement}, clients sending {default.message}s (under secret-sketch in the paper's "
               "form: noise at the client, adapters sent)")
    return {"command": command_line("benchmarks.privacy_audit"), "commit": revision(), "machine": machine(),
            "federation_setting": setting,
            "minutes": (time.perf_counter() - started) / 60, "trials": args.trials,
            "noise_multiplier": args.noise_multiplier, "canaries": args.canaries, "delta": args.delta,
            "results": results}


def render(report: dict) -> None:
    results = report["results"]
    _plot(results, RESULTS / "privacy_audit.png")
    head = ("| strategies | release | threat model | attack | AUC | TPR at FPR 1% | TPR at FPR 10% | empirical epsilon "
            "| accountant epsilon | verdict |\n|---|---|---|---|---:|---:|---:|---:|---:|---|")

    def table(level: str) -> list[str]:
        return [head] + [f"| {r['strategies']} | {r['name']} | {r['threat_model']} | {r['attack']} | {r['auc']:.3f} | "
                         f"{r['tpr_at_fpr_0.01']:.3f} | {r['tpr_at_fpr_0.1']:.3f} | {_eps(r['empirical_epsilon'])}"
                         + (f" (estimate {_eps(r['estimate_epsilon'])}, floor {_eps(r['null_epsilon'])})"
                            if r["level"] == "federation" else "")
                         + f" | {_eps(r['accountant_epsilon'])} | {_verdict(r)} |" for r in results if r["level"] == level]

    lines = [
        "# Privacy audit: accountant epsilon against empirical epsilon",
        "",
        f"Command: `{report['command']}`  ",
        (f"Commits: mechanism level {report['commits']['mechanism']}, federation level "
         f"{report['commits']['federation']}  " if "commits" in report else f"Commit: {report['commit']}  "),
        f"Machine: {report['machine']}; all of it took {report['minutes']:.1f} min  ",
        f"delta = {report['delta']:g}. Plot: [privacy_audit.png](privacy_audit.png); every number: "
        "[privacy_audit.json](privacy_audit.json).",
        "",
        "## Mechanism level: one client message",
        "",
        f"One {SHAPE[0]} x {SHAPE[1]} LoRA B at the clip norm (tau = 1) and its neighbour, {report['trials']} releases "
        "of each through the product's own `Mechanism.privatize`, noise multiplier "
        f"{report['noise_multiplier']:g} unless the release says otherwise. R known: the likelihood ratio against the "
        "noiseless releases of X and X' = -X. R secret: the Gaussian likelihood ratio of the release's sketch rows "
        "(a covariance statistic) against X' orthogonal to X (SGMM) or X' = 0 (SGMV); with N clients sharing R, "
        "the other N - 1 send X and are known to the attacker. Empirical epsilon: a lower bound that holds with 95% "
        "confidence (threshold chosen on half the trials, Clopper-Pearson on the other half; with this many "
        "trials no test can certify much more than 7). Accountant epsilon: fedlora's for that one release "
        "(replace-one, no sampling). Secure aggregation (the rows \"SecAgg+\"): the target's constrained "
        "message goes through the product's codec (`fedlora.secure_sum`: scaled, randomly rounded, its Skellam "
        f"noise share, reduced modulo 2^30); a server that follows SecAgg+ decodes the sum with N_min - 1 = "
        f"{SECAGG_MIN_REPLIES - 1} other replies (known to the attacker, so they add only their noise shares; N = "
        f"{SECAGG_CLIENTS}), one that breaks it decodes the reply alone; the accountant is the Skellam one the run "
        "uses.",
        "",
        *table("mechanism"),
        "",
    ]
    if report["canaries"]:
        lines += [
            "## Federation level: canaries in a whole run",
            "",
            "`fedlora audit`'s run for each strategy: the quickstart (tiny ViT, synthetic data, 10 rounds, target "
            f"epsilon 8) with {report['federation_setting']}, of which {report['canaries']} are "
            "canaries; each is included "
            "with probability 1/2 and then sends a fixed random direction at the clip norm (an excluded one sends "
            "zero). Each canary's score is its largest cosine with a round's update of the global model (de-sketched "
            "as clients see it). Empirical epsilon: a lower bound that holds with 95% confidence from this one run "
            "(Steinke, Nasr and Jagielski 2023: guessing \"included\" for the k highest scores, k = 1, 2, 4, ... "
            "Bonferroni-corrected; a few hundred canaries cannot certify much more than 2-3). In brackets, Andrew "
            "et al.'s estimate from Gaussians fitted to the included canaries' scores and to those of directions "
            "never inserted (a point estimate, not a bound), and its floor: the same estimate between two sets of "
            "directions never inserted, what it says when there is nothing to find. AUC and TPR: included "
            "canaries against directions never inserted.",
            "",
            *table("federation"),
            "",
        ]
    lines += [
        "## Reading it",
        "",
        "- Without noise every strategy is caught: AUC 1, and the lower bound is as large as the trial count "
        "allows, whether or not the message is sketched with a secret R (../shared/papers/001, Prop. 2). The "
        "accountant says epsilon = inf for them, never a number.",
        "- Every lower bound stays below fedlora's accountant epsilon for the same release, under both threat "
        "models: the accountant is not refuted.",
        "- The paper's per-message analysis of a secret sketch (its Lemma 2.7, accounted by fedlora for the one "
        "release: the red x) is refuted where the sketch is shared: with 64 "
        "clients of a round sharing R, the clients the attacker knows reveal R X and the target's sign shows. "
        "fedlora accounts the joint release of the round (fedlora/privacy/shared_sketch_bound.md) and uses the "
        "known-sketch threat model by default.",
        "- In whole runs the canaries of the private strategies are not detected (AUC about 0.5, TPR at FPR 1% "
        "near 0.01, one-run lower bounds near 0): their Gaussian-fit estimates come from noise (compare the "
        "floors), not from leakage. The non-private runs are caught, with a positive lower bound from the one run, "
        "although a third of the included canaries are never sampled. The score uses the de-sketched model, the "
        "view of clients, who hold R: under secret-sketch that observer is outside the accountant's premise.",
        "- Secure aggregation: the sum a server that follows SecAgg+ decodes is as hard to attack as the server "
        "placement's Gaussian (same AUC within the trials' noise), and its accountant epsilon (Skellam) is a little "
        "above the Gaussian's; one reply decoded alone, what a server that breaks the protocol sees, carries only "
        "z / sqrt(N_min) and is caught nearly always: its own, much larger, epsilon is what `fedlora run` prints "
        "beside the run's.",
        "- Each lower bound holds at 95% on its own (no correction over the rows).",
    ]
    (RESULTS / "privacy_audit.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
