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
    lines = [
        f"# Noise multipliers for epsilon {paper.TARGET_EPSILON}: the paper's and ours",
        "",
        f"Command: `{command_line('benchmarks.noise_table')}` (the same numbers as `fedlora privacy --paper-table`)  ",
        f"Commit: {revision()}  ",
        f"Machine: {machine()}; computed in {seconds:.1f} s  ",
        *paper.table_lines(rows),
        "",
        "Why they differ from the paper's: see docs/explanation/threat-models.md.",
    ]
    (RESULTS / "noise_table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
