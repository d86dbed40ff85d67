"""What one deployed client costs per message: process start-up, one local round, and peak memory.

A SuperNode starts a new process for every message, so each round a client pays for the interpreter,
the imports, building the model and loading its data before it trains. Each model is measured in a
fresh process doing exactly what the ClientApp does (the same functions), one local round of
sgmm-ffa-lora with the given K and B, on this machine's device (CUDA if present).

    python -m benchmarks.client_cost                      # tiny ViT (32 px) and ViT-B/16 shapes (224 px)
    python -m benchmarks.client_cost --models vit-tiny    # one model
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from benchmarks.common import RESULTS, command_line, machine, revision

# model -> (local steps K, batch B): the quickstart's for the tiny ViT, the paper's batch for ViT-B/16
# (with K = 2: on a CPU one ViT-B step takes seconds; memory does not grow with K).
SETTINGS = {"vit-tiny": (5, 16), "vit-b16-random": (2, 8)}

_CHILD = r"""
import json, resource, sys, time
import psutil
started = psutil.Process().create_time()
import fedlora.clients.rounds as client
from fedlora.config import RunConfig
from fedlora.federation import Protocol
from fedlora.node import NodeSettings
imported = time.time()
import torch
model_name, steps, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
config = RunConfig.from_mapping({"model": model_name, "local-steps": steps, "batch-size": batch,
                                 "num-clients": 2, "clients-per-round": 2, "train-examples": 200,
                                 "test-examples": 10, "noise-source": "os"})
model, base = client._model(config, config.rank)
built = time.time()
data = client._local_data(config, NodeSettings(0, 2))
loaded = time.time()
protocol = Protocol(config, 1.0)
result = protocol.local_round(model, base, data, protocol.initial_state(model), round_=1, partition_id=0, noise=None)
trained = time.time()
cuda = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
print(json.dumps({"model": model_name, "steps": steps, "batch": batch, "startup_s": imported - started,
                  "model_s": built - imported, "data_s": loaded - built, "round_s": trained - loaded,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "cuda_peak_mib": cuda, "device": str(next(model.parameters()).device)}))
"""


def measure(model: str) -> dict:
    steps, batch = SETTINGS[model]
    out = subprocess.run([sys.executable, "-c", _CHILD, model, str(steps), str(batch)], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(SETTINGS), help=f"comma-separated, from {', '.join(SETTINGS)}")
    args = parser.parse_args()
    models = args.models.split(",")
    unknown = [m for m in models if m not in SETTINGS]
    if unknown:
        print(f"client_cost: error: unknown model '{unknown[0]}'; choose from {', '.join(SETTINGS)}", file=sys.stderr)
        sys.exit(2)
    rows = []
    for model in models:
        started = time.time()
        rows.append(measure(model))
        print(f"{model}: {json.dumps(rows[-1])} ({time.time() - started:.0f} s)", flush=True)
    lines = [
        "# One deployed client per message: start-up, one local round, peak memory", "",
        f"`{command_line('benchmarks.client_cost')}` at {revision()}; {machine()}.", "",
        "Each row is a fresh process doing what the ClientApp does for one message (sgmm-ffa-lora, r = 4). "
        "Start-up is from process creation to the imports done; the SuperNode pays it, plus building the "
        "model and loading the data, on every message.", "",
        "| model | device | K | B | start-up (s) | model build (s) | data (s) | local round (s) | peak RSS (MiB) "
        "| CUDA peak (MiB) |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cuda = f"{r['cuda_peak_mib']:.0f}" if r["cuda_peak_mib"] is not None else "-"
        lines.append(f"| {r['model']} | {r['device']} | {r['steps']} | {r['batch']} | {r['startup_s']:.2f} | "
                     f"{r['model_s']:.2f} | {r['data_s']:.2f} | {r['round_s']:.2f} | {r['peak_rss_mib']:.0f} | "
                     f"{cuda} |")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "client_cost.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
