"""The first seed's Table 1 in federated form (issue 66): what a language model federation leaks about a client's
text, measured by `fedlora audit --text` (membership inference against a reference federation, canary exposure, the
one-run lower bound) beside its test perplexity, in two federations of the text preset (the King James Bible, a
chapter a client, the tiny public GPT-2, LoRA r = 4):

- **made to remember**, as the seed's runs are (many local epochs, few clients averaged): LoRA with A trained
  (flexlora) and FA-LoRA with A frozen at the seed's Gaussian N(0, 1/r) (ffa-lora), without noise, at two (local
  epochs, batch) settings with the same local steps (the seed's (E, b) = (20, 8) and (40, 16));
- **the preset's own** (100 clients a round, 5 local steps), where a private run learns: the same two without
  noise beside the private strategies at epsilon 1, 2, 4, 8 (noise at the server, client level). In the first
  federation noise at any of these epsilons leaves no model (the server's noise accumulates to 0.7-1.7 an adapter
  entry over its 112 rounds of 5, where 0.075 already takes the zero-shot perplexity from 238 to 1,544:
  docs/tutorials/language-models.md), so its private cells would measure nothing.

Each federation is sized so that about a quarter of its clients are never drawn (the non-members). Every cell is an
audit directory under --work: a cell with its audit.json is not run again, a cell stopped midway continues from its
federations' checkpoints, the reference federations are shared by the cells of one recipe, and the rows of seeds
not asked for are kept.

    python -m benchmarks.text_membership --seeds 0     # writes benchmarks/results/text_membership.{md,json,png}
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, command_line, machine, revision, save_figure
from fedlora.config import load_config

FEDERATIONS = {
    # (1 - 5 / 400) ** 112 = 0.245 never drawn; 20 local steps: 3.8 or 7.6 local epochs a visit
    "remember": {"sets": {"num-clients": 400, "clients-per-round": 5, "num-rounds": 112, "local-steps": 20,
                          "eval-every": 28}, "batches": (8, 16), "canaries": 50,
                 "title": "A federation made to remember"},
    # the preset less the auxiliary chapters: (1 - 100 / 971) ** 15 = 0.196 never drawn
    "preset": {"sets": {"num-clients": 971}, "batches": (16,), "canaries": 100,
               "title": "The text preset's federation"},
}
NOT_PRIVATE = {"flexlora": "LoRA (A trained)", "ffa-lora": "FA-LoRA (A frozen)"}
AUX_UNITS = 100
NAME = "text_membership"


def cells(seeds: list[int], private: list[str], epsilons: list[float]) -> list[dict]:
    """Every cell of the table, in the order they run: a seed's before the next seed's; in it the remembering
    federation without noise (the larger batch first), then the preset's without noise and with it, from the
    largest epsilon down."""
    out = []
    for seed in seeds:
        out += [{"seed": seed, "federation": "remember", "strategy": s, "batch": b, "epsilon": None}
                for b in FEDERATIONS["remember"]["batches"][::-1] for s in NOT_PRIVATE]
        out += [{"seed": seed, "federation": "preset", "strategy": s, "batch": 16, "epsilon": None}
                for s in reversed(NOT_PRIVATE)]
        out += [{"seed": seed, "federation": "preset", "strategy": s, "batch": 16, "epsilon": e}
                for e in sorted(epsilons, reverse=True) for s in private]
    return out


def cell_name(cell: dict, strategy: str | None = None) -> str:
    """The cell's directory, or with ``strategy`` "reference-<family>" that of its reference federation (the
    remembering federation's without a prefix: its cells were the first measured)."""
    prefix = "" if cell["federation"] == "remember" else f"{cell['federation']}-"
    if strategy:
        return f"{prefix}{strategy}-b{cell['batch']}"
    return f"{prefix}{cell['strategy']}-b{cell['batch']}" + (f"-eps{cell['epsilon']:g}" if cell["epsilon"] else "")


def cell_config(cell: dict):
    sets = [f"{k}={v}" for k, v in FEDERATIONS[cell["federation"]]["sets"].items()]
    sets += [f"strategy={cell['strategy']}", f"seed={cell['seed']}", f"batch-size={cell['batch']}"]
    return load_config("bible", sets + ([f"target-epsilon={cell['epsilon']}"] if cell["epsilon"] else []))


def local_epochs(config, batch: int) -> float:
    """Local epochs a visit: local steps times the batch, over a client's blocks (the mean over clients)."""
    from fedlora.text import load_tokenizer, partition_units, token_blocks, tokenized_units, tokenizer_of

    units = tokenized_units(config.dataset, "train", tokenizer_of(config))
    eos = load_tokenizer(tokenizer_of(config)).eos_id
    blocks = [len(token_blocks([units[i] for i in partition_units(
        config.partitioner, units=len(units) - AUX_UNITS, num_partitions=config.num_clients, partition_id=c,
        seed=config.seed)], config.seq_len, eos)[0]) for c in range(config.num_clients)]
    return config.local_steps * batch / float(np.mean(blocks))


def zero_shot_perplexity(config) -> float:
    import torch

    from fedlora.federation import Protocol

    model = Protocol(config, 0.0).build_model(device=torch.device("cpu"))  # B = 0: the public model itself
    return config.task.evaluate(model, config.task.test_data(config, "cpu"))["perplexity"]


def run_cell(cell: dict, work: Path, commit: str = "") -> dict:
    from fedlora.strategies.text_audit import audit_text

    config = cell_config(cell)
    out_dir = work / f"seed{cell['seed']}" / cell_name(cell)
    if (out_dir / "audit.json").is_file():
        return json.loads((out_dir / "audit.json").read_text())
    family = "flexlora" if "flexlora" in cell["strategy"] else "ffa-lora"
    reference = work / f"seed{cell['seed']}" / cell_name(cell, f"reference-{family}")
    print(f"== {cell_name(cell)}, seed {cell['seed']}", flush=True)
    result = audit_text(config, canaries=FEDERATIONS[cell["federation"]]["canaries"], aux_units=AUX_UNITS,
                        out_dir=out_dir, reference_dir=reference, echo=lambda line: print(f"   {line}", flush=True))
    result = {**cell, **result, "commit": commit or revision(),
              "accountant_epsilon": result["accountant_epsilon"] if math.isfinite(result["accountant_epsilon"])
              else None}
    (out_dir / "audit.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    parser.add_argument("--private", default="gm-ffa-lora,sgmm-ffa-lora", help="private strategies")
    parser.add_argument("--epsilons", default="1,2,4,8", help="their target epsilons")
    parser.add_argument("--work", default="runs/text_membership", help="the cells' audit directories (resumable)")
    args = parser.parse_args(argv)
    from fedlora.algorithms import ALGORITHMS
    from fedlora.text import bible_unavailable_reason

    try:
        seeds = [int(s) for s in args.seeds.split(",")]
        epsilons = [float(e) for e in args.epsilons.split(",")]
    except ValueError:
        print(f"{NAME}: error: --seeds and --epsilons take comma-separated numbers.", file=sys.stderr)
        return 2
    private = args.private.split(",")
    known = {name for name, a in ALGORITHMS.items() if a.mechanism != "none"}
    if unknown := [s for s in private if s not in known]:
        print(f"{NAME}: error: not a private strategy: {', '.join(unknown)} (one of {', '.join(sorted(known))}).",
              file=sys.stderr)
        return 2
    if (reason := bible_unavailable_reason()) is not None:
        print(f"{NAME}: error: {reason}", file=sys.stderr)
        return 2
    todo = cells(seeds, private, epsilons)
    try:
        for cell in todo:
            cell_config(cell)  # every config checked before the first run
    except ValueError as error:
        print(f"{NAME}: error: {error}", file=sys.stderr)
        return 2
    saved = json.loads((RESULTS / f"{NAME}.json").read_text()) if (RESULTS / f"{NAME}.json").is_file() else {}
    rows = {_key(r): r for r in saved.get("cells", [])}
    federations = saved.get("federations") or {
        name: {**{k: v for k, v in f.items() if k != "batches"}, "local_epochs": {
            str(b): local_epochs(cell_config({"seed": 0, "federation": name, "strategy": "ffa-lora", "batch": b,
                                              "epsilon": None}), b) for b in f["batches"]}}
        for name, f in FEDERATIONS.items()}
    meta = {"federations": federations, "aux_units": AUX_UNITS, "zero_shot_perplexity": saved.get(
        "zero_shot_perplexity") or zero_shot_perplexity(cell_config(todo[0]))}
    started, commit = time.time(), revision()  # the code this process runs, whatever is committed meanwhile
    for i, cell in enumerate(todo, 1):
        if _key(cell) in rows:  # a cell in the committed results stands (delete its row to measure it again)
            continue
        rows[_key(cell)] = run_cell(cell, Path(args.work), commit)
        print(f"[{i}/{len(todo)}] {cell_name(cell)} seed {cell['seed']}: {_summary(rows[_key(cell)])} "
              f"({(time.time() - started) / 60:.0f} min so far)", flush=True)
        _write({**meta, "cells": sorted(rows.values(), key=_order)}, command_line(f"benchmarks.{NAME}"))
    return 0


def _key(cell: dict) -> tuple:
    return cell["seed"], cell["federation"], cell["strategy"], cell["batch"], cell["epsilon"]


def _order(r: dict) -> tuple:
    return (list(FEDERATIONS).index(r["federation"]), r["epsilon"] is not None,
            r["strategy"] not in NOT_PRIVATE or list(NOT_PRIVATE).index(r["strategy"]), r["strategy"],
            r["epsilon"] or 0, r["batch"], r["seed"])


def _summary(r: dict) -> str:
    m, c = r["membership"], r["canaries"]
    return (f"perplexity {r['perplexity']:.2f}, AUC {m['auc']:.3f}, TPR@1% {m['tpr_at_fpr_0.01']:.3f}, exposure "
            f"{c['exposure_included']:.2f} bits")


def _label(r: dict) -> str:
    name = NOT_PRIVATE.get(r["strategy"], r["strategy"])
    if r["epsilon"] is not None:
        return f"{name}, epsilon {r['epsilon']:g}"
    return f"{name}, batch {r['batch']}" if r["federation"] == "remember" else f"{name}, no noise"


def _groups(rows: list[dict]) -> list[list[dict]]:
    """The rows of one cell over the seeds, in the table's order."""
    out: dict[tuple, list[dict]] = {}
    for r in sorted(rows, key=_order):
        out.setdefault(_key(r)[1:], []).append(r)
    return list(out.values())


def _mean(group: list[dict], get) -> str:
    values = [get(r) for r in group]
    text = f"{np.mean(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"
    return text + (f" ({', '.join(f'{v:.3f}' for v in values)})" if len(values) > 1 else "")


def _recent(group: list[dict]) -> str:
    """The AUC of the members the model saw last, with its interval per seed ("-" for runs scored before it was)."""
    recent = [r["membership"].get("recent", {}) for r in group]
    if not all("auc" in x for x in recent):
        return "-"
    return (f"{np.mean([x['auc'] for x in recent]):.3f} ("
            + "; ".join(f"{x['auc']:.3f} [{x['auc_interval'][0]:.3f}, {x['auc_interval'][1]:.3f}], "
                        f"{x['members']} members" for x in recent) + ")")


def _setting(name: str, f: dict, aux_units: int) -> str:
    sets, epochs = f["sets"], f["local_epochs"]
    preset = load_config("bible", [f"{k}={v}" for k, v in sets.items()])
    return (f"{preset.num_clients} clients (the preset's chapters less the {aux_units} auxiliary ones), "
            f"{preset.clients_per_round} a round for {preset.num_rounds} rounds, {preset.local_steps} local Adam steps "
            "a visit (" + "; ".join(f"batch {b}: {e:.1f} local epochs" for b, e in epochs.items()) + f"), "
            f"{f['canaries']} canary clients, clip {preset.clip_norm:g}.")


def _write(result: dict, command: str) -> None:
    (RESULTS / f"{NAME}.json").write_text(json.dumps({**result, "command": command, "machine": machine()},
                                                     indent=2) + "\n")
    rows = result["cells"]
    lines = [
        "# The first seed's Table 1, federated: membership, canaries and perplexity on text", "",
        f"The text preset (the King James Bible, a chapter a client, the tiny public GPT-2, LoRA r = 4 on every "
        f"block's query/key/value) in two federations. In each, {result['aux_units']} chapters kept from every "
        "client train the reference federation (the same recipe without noise); members are the clients the seeded "
        "sampler drew at least once, non-members those it never drew; the canary clients (each canary 8 whole-word "
        "tokens written 4 times, with probability 1/2) are in neither group. Exposure: of the canaries written, "
        "against 1,000 never written (chance about 1.44 bits). Noise at the server, client level. Zero-shot test "
        f"perplexity {result['zero_shot_perplexity']:.2f}. Means over seeds, each seed's value in brackets; the "
        "TPR intervals of each run are in the JSON."]
    header = ["| run | seeds | test perplexity | MIA AUC | its 95% interval, each seed | TPR @ FPR 10% | TPR @ FPR 1% "
              "| AUC, members drawn in the last tenth of the rounds | exposure, bits | one-run lower bound "
              "| accountant epsilon |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, f in result["federations"].items():
        groups = [g for g in _groups(rows) if g[0]["federation"] == name]
        if not groups:
            continue
        lines += ["", f"## {f['title']}", "", _setting(name, f, result["aux_units"]), "", *header]
        for group in groups:
            r = group[0]
            eps = "inf (not private)" if r["accountant_epsilon"] is None else \
                f"{r['accountant_epsilon']:.2f} ({r['threat_model']})"
            lines.append(
                f"| {_label(r)} | {len(group)} | {_mean(group, lambda x: x['perplexity'])} "
                f"| {_mean(group, lambda x: x['membership']['auc'])} "
                f"| {'; '.join('[{:.3f}, {:.3f}]'.format(*x['membership']['auc_interval']) for x in group)} "
                f"| {_mean(group, lambda x: x['membership']['tpr_at_fpr_0.1'])} "
                f"| {_mean(group, lambda x: x['membership']['tpr_at_fpr_0.01'])} "
                f"| {_recent(group)} "
                f"| {_mean(group, lambda x: x['canaries']['exposure_included'])} "
                f"| {_mean(group, lambda x: x['canaries']['one_run_lower_bound'])} "
                f"| {eps} |")
    lines += ["", f"Command: `{command}`  ", f"Commits: {', '.join(sorted({r['commit'] for r in rows}))}  ",
              f"Machine: {machine()}  ", "", f"![the table as figures]({NAME}.png)", ""]
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines))
    _plot(rows, command)


def _plot(rows: list[dict], command: str) -> None:
    """Perplexity, MIA AUC and exposure against epsilon per private strategy (the preset's federation); the runs
    without noise at the right ("none"): hollow markers the preset's, filled the federation made to remember."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("test perplexity (lower: better)", lambda r: r["perplexity"]),
              ("membership AUC and its 95% interval (0.5: no signal)", lambda r: r["membership"]["auc"]),
              ("canary exposure, bits (~1.44: chance)", lambda r: r["canaries"]["exposure_included"])]
    epsilons = sorted({r["epsilon"] for r in rows if r["epsilon"] is not None})
    none_x = max(epsilons) * 2 if epsilons else 1.0
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, (title, get) in zip(axes, panels):
        plain = [g for g in _groups(rows) if g[0]["epsilon"] is None]
        for i, group in enumerate(plain):
            r, values = group[0], [get(x) for x in group]
            mean = float(np.mean(values))
            # the AUC's interval (the widest over the seeds), else the seeds' spread
            low, high = ((min(x["membership"]["auc_interval"][0] for x in group),
                          max(x["membership"]["auc_interval"][1] for x in group)) if "AUC" in title
                         else (min(values), max(values)))
            ax.errorbar([none_x * 1.12 ** (i - (len(plain) - 1) / 2)], [mean],
                        yerr=[[mean - low], [high - mean]], capsize=3,
                        fmt="s" if r["strategy"] == "flexlora" else "D",
                        mfc="none" if r["federation"] == "preset" else None,
                        label=f"{_label(r)} ({'preset' if r['federation'] == 'preset' else 'made to remember'})")
        for strategy in dict.fromkeys(r["strategy"] for r in rows if r["epsilon"] is not None):
            points = [g for g in _groups(rows) if g[0]["strategy"] == strategy]
            ax.plot([g[0]["epsilon"] for g in points], [np.mean([get(x) for x in g]) for g in points], "o-",
                    label=f"{strategy} (preset)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(epsilons + [none_x], [f"{e:g}" for e in epsilons] + ["none"])
        ax.minorticks_off()
        ax.set_xlabel("target epsilon (client level)")
        ax.set_title(title, fontsize=10)
        if "AUC" in title:
            ax.axhline(0.5, color="grey", lw=0.8, ls=":")
        if "exposure" in title:
            ax.axhline(1.44, color="grey", lw=0.8, ls=":")
    axes[0].legend(fontsize=7)
    save_figure(fig, f"{NAME}.png", f"{command} at {revision()}")


if __name__ == "__main__":
    raise SystemExit(main())
