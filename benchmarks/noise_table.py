"""The paper's noise table beside ours (`fedlora privacy --paper-table`), rendered as markdown.

    python -m benchmarks.noise_table        # writes benchmarks/results/noise_table.md
"""

from __future__ import annotations

import time

from benchmarks.common import RESULTS, command_line, machine, revision
from fedlora.privacy import paper


def main() -> None:
    started = time.perf_counter()
    rows = paper.paper_table()
    seconds = time.perf_counter() - started
    analyses = paper.ANALYSES
    lines = [
        "# Noise multipliers for epsilon 1.70: the paper's and ours",
        "",
        f"Command: `{command_line('benchmarks.noise_table')}` (the same numbers as `fedlora privacy --paper-table`)  ",
        f"Commit: {revision()}  ",
        f"Machine: {machine()}; computed in {seconds:.1f} s  ",
        f"Setting: C = {paper.NUM_CLIENTS}, N = {paper.CLIENTS_PER_ROUND} sampled without replacement "
        f"(replace-one), T = {paper.ROUNDS}, delta = {paper.DELTA:g}, r = {paper.RANK}, "
        f"b = {paper.SKETCH_DIMS['sgmm']}, h = {paper.SKETCH_DIMS['sgmv']}.",
        "",
        "| strategy | paper z | " + " | ".join(f"z, {a}" for a in analyses) + " | "
        + " | ".join(f"epsilon at paper z, {a}" for a in analyses) + " |",
        "|---|---:|" + "---:|" * (2 * len(analyses)),
    ]
    for row in rows:
        lines.append(f"| {row.strategy} | {row.paper_noise_multiplier:.2f} | "
                     + " | ".join(f"{row.calibrated[a]:.3f}" for a in analyses) + " | "
                     + " | ".join(f"{row.epsilon_at_paper_noise[a]:.3f}" for a in analyses) + " |")
    lines += [
        "",
        "- known-sketch (the default, sound): the adversary knows R; every strategy is then a Gaussian mechanism "
        "of the clipped message, accounted with dp-accounting (replace-one: sensitivity 2 tau).",
        "- secret-sketch: R hidden; our bound on the joint release of the N clients sharing R "
        "(fedlora/privacy/shared_sketch_bound.md), amplified by sampling without replacement (WBK19 Thm 9).",
        "- per-message: the paper's Lemma 2.7 per client, amplified the same way: UNSOUND for shared sketches, "
        "shown only to explain the paper's numbers.",
        "",
        "Why they differ from the paper's: see docs/explanation/threat-models.md.",
    ]
    (RESULTS / "noise_table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
