"""How the costs scale with the layer size m = k: SGMM vs SGMV sketching, and FlexLoRA's redistribution by
QR of the stacked factors vs a dense SVD; and the peak memory of a simulation with C = 20 vs C = 625.

    python -m benchmarks.scaling                 # writes benchmarks/results/scaling.{md,csv,png}
    python -m benchmarks.scaling --quick         # smaller sizes, for a smoke test
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys

import torch

from benchmarks.common import RESULTS, median_seconds, provenance, save_figure
from fedlora.aggregation import redistribute, svd_of_mean_product
from fedlora.sketch import MatrixSketch, SketchKey, VectorSketch

RANK, SKETCH_DIM = 4, 150


def sketch_times(m: int, repeats: int) -> dict:
    """Sketch + de-sketch of one B (m x r), R regenerated from its seed as in the product."""
    x, key = torch.randn(m, RANK), SketchKey(0, 1)
    rows = {}
    for name, sketch in (("sgmm", MatrixSketch(SKETCH_DIM)), ("sgmv", VectorSketch(SKETCH_DIM * RANK))):
        rows[name] = median_seconds(lambda: sketch.desketch(sketch.sketch(x, key=key, name="l.lora_B"), key=key,
                                                      name="l.lora_B", shape=x.shape), repeats)
    return rows


def svd_times(m: int, nr: int, repeats: int) -> dict:
    """Top-r redistribution of W = mean B_c A_c from N clients of rank r (N r = nr), float64."""
    n = nr // RANK
    g = torch.Generator().manual_seed(m + nr)
    bs = [torch.randn(m, RANK, generator=g, dtype=torch.float64) for _ in range(n)]
    as_ = [torch.randn(RANK, m, generator=g, dtype=torch.float64) for _ in range(n)]

    def qr_path():
        return redistribute(*svd_of_mean_product(bs, as_), RANK)

    def dense_path():
        w = sum(b @ a for b, a in zip(bs, as_)) / n
        u, s, vt = torch.linalg.svd(w, full_matrices=False)
        return redistribute(u, s, vt, RANK)

    qr = median_seconds(qr_path, repeats)
    dense = median_seconds(dense_path, 1 if m >= 2048 else repeats)
    (b1, a1), (b2, a2) = qr_path(), dense_path()
    error = float(torch.linalg.norm(b1 @ a1 - b2 @ a2) / torch.linalg.norm(b2 @ a2))
    return {"qr_svd_s": qr, "dense_svd_s": dense, "speedup": dense / qr, "relative_error": error}


_MEMORY_PROBE = """
import json, resource, sys
sys.path.insert(0, {root!r})
from flwr.app import Context, RecordDict
from fedlora.clients.app import app
from fedlora.strategies.server_app import run_federation
from fedlora.strategies.inprocess_grid import InProcessGrid
c = int(sys.argv[1])
cfg = {{"num-clients": c, "clients-per-round": 4, "num-rounds": 3, "local-steps": 2, "train-examples": 2500,
        "test-examples": 200, "out-dir": sys.argv[2]}}
run_federation(InProcessGrid(app, c, cfg), Context(run_id=1, node_id=0, node_config={{}}, state=RecordDict(),
               run_config=cfg), echo=lambda line: None)
print(json.dumps({{"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


def peak_memory(num_clients: int, out_dir: str) -> float:
    """Peak RSS of a whole in-process simulation (server and clients in one process), 3 rounds, N = 4."""
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    result = subprocess.run([sys.executable, "-c", _MEMORY_PROBE.format(root=root), str(num_clients), out_dir],
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_rss_mib"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="m in {256, 768} only")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sizes = [256, 768] if args.quick else [256, 768, 2048, 4096]
    rows = []
    for m in sizes:
        sk = sketch_times(m, args.repeats)
        for nr in (16, 64):
            sv = svd_times(m, nr, args.repeats)
            rows.append({"m": m, "nr": nr, "sgmm_s": sk["sgmm"], "sgmv_s": sk["sgmv"],
                         "sgmv_over_sgmm": sk["sgmv"] / sk["sgmm"], **sv})
            print(rows[-1], flush=True)
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        memory = {c: peak_memory(c, f"{tmp}/c{c}") for c in (20, 625)}
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "scaling.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    _plot(rows)
    at = {(r["m"], r["nr"]): r for r in rows}
    growth = memory[625] / memory[20] - 1
    lines = [
        "# Scaling: sketching and FlexLoRA redistribution vs layer size; memory vs number of clients",
        "",
        *provenance("benchmarks.scaling"),
        f"Sketching: one B (m x {RANK}) sketched and de-sketched, R regenerated from its seed (as in the product), "
        f"SGMM b = {SKETCH_DIM}, SGMV h = {SKETCH_DIM * RANK}; float32; median of {args.repeats}. Redistribution: "
        f"top-{RANK} factors of W = mean B_c A_c (m x m) from N r stacked columns, float64; relative error of "
        "B A against the dense path.",
        "",
        "| m = k | N r | SGMM (ms) | SGMV (ms) | SGMV / SGMM | QR-SVD (ms) | dense SVD (ms) | speedup | rel. error |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *[f"| {r['m']} | {r['nr']} | {1e3 * r['sgmm_s']:.2f} | {1e3 * r['sgmv_s']:.2f} | {r['sgmv_over_sgmm']:.1f} | "
          f"{1e3 * r['qr_svd_s']:.2f} | {1e3 * r['dense_svd_s']:.1f} | {r['speedup']:.0f}x | {r['relative_error']:.1e} |"
          for r in rows],
        "",
        f"Peak memory of a whole in-process simulation (3 rounds, N = 4, tiny ViT): C = 20: {memory[20]:.0f} MiB, "
        f"C = 625: {memory[625]:.0f} MiB ({100 * growth:+.1f}%).",
        "",
        "![scaling](scaling.png)",
        "",
        "Targets (goals, not asserts): QR-SVD >= 10x faster than dense at m = 768 and >= 100x at 4096 with relative "
        "error <= 1e-5; peak memory at C = 625 within 10% of C = 20.",
    ]
    for m, goal in ((768, 10), (4096, 100)):
        for nr in (16, 64):
            if (m, nr) in at:
                r = at[(m, nr)]
                verdict = "met" if r["speedup"] >= goal and r["relative_error"] <= 1e-5 else "MISSED"
                lines.append(f"- m = {m}, N r = {nr}: {r['speedup']:.0f}x (goal {goal}x), error "
                             f"{r['relative_error']:.1e}: {verdict}.")
    lines.append(f"- memory: {100 * growth:+.1f}% (goal within 10%): {'met' if abs(growth) <= 0.10 else 'MISSED'}.")
    (RESULTS / "scaling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    ms = sorted({r["m"] for r in rows})
    first = [next(r for r in rows if r["m"] == m) for m in ms]
    left.loglog(ms, [1e3 * r["sgmm_s"] for r in first], marker="o", label="SGMM (b = 150)")
    left.loglog(ms, [1e3 * r["sgmv_s"] for r in first], marker="s", label="SGMV (h = 600)")
    left.set(xlabel="m", ylabel="sketch + de-sketch (ms)", title="Sketching one B")
    for nr, style in ((16, "-"), (64, "--")):
        sub = [r for r in rows if r["nr"] == nr]
        right.loglog([r["m"] for r in sub], [1e3 * r["qr_svd_s"] for r in sub], style, marker="o", label=f"QR-SVD, Nr={nr}")
        right.loglog([r["m"] for r in sub], [1e3 * r["dense_svd_s"] for r in sub], style, marker="s",
                     label=f"dense SVD, Nr={nr}")
    right.set(xlabel="m = k", ylabel="time (ms)", title="FlexLoRA redistribution")
    for ax in (left, right):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    save_figure(fig, "scaling.png")


if __name__ == "__main__":
    main()
