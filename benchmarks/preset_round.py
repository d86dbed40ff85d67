"""Times configs/cifar100_private.toml's rounds on this machine through its offline twin: CIFAR-100-schema
synthetic data (32 px images resized to 224, as CIFAR-100's are) and ViT-B/16 with random weights, so it needs
neither the hub nor the dataset; the ServerApp and ClientApp over the in-process grid (no Ray: `fedlora run` times
the Ray path). It prints the clients trained so far every 100 clients, with the peak GPU memory. For GPUs: on a
2-core CPU a client takes about 40 s.

    python -m benchmarks.preset_round                             # one round of 500 clients, the preset's settings
    python -m benchmarks.preset_round --rounds 2 --set client-batch=1 precision=\\"fp32\\"   # the path before
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import machine, run_inprocess
from fedlora.cli import add_overrides
from fedlora.config import load_config
from fedlora.client_round import ClientSide
from fedlora.training import clients_at_once, resolved_precision, select_device

PRESET = Path(__file__).resolve().parent.parent / "configs" / "cifar100_private.toml"
OFFLINE_TWIN = ['dataset="synthetic"', 'model="vit-b16-random"', "train-examples=50000", "test-examples=2000"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    add_overrides(parser, "run-config overrides")
    args = parser.parse_args()
    if args.rounds < 1:
        print(f"preset_round: error: --rounds must be at least 1, got {args.rounds}.", file=sys.stderr)
        sys.exit(2)
    try:
        config = load_config(PRESET, [*OFFLINE_TWIN, f"num-rounds={args.rounds}", "eval-every=1", *args.set])
    except ValueError as error:
        print(f"preset_round: error: {error}", file=sys.stderr)
        sys.exit(2)
    device = select_device()
    print(machine(), f"client-batch {clients_at_once(config.client_batch, device)}, precision "
          f"{resolved_precision(config.precision, device)}", flush=True)
    started, trained = time.time(), [0]
    train_clients = ClientSide.train_clients

    def counted(self, model, base, datasets, *a, **kw):
        rounds = train_clients(self, model, base, datasets, *a, **kw)
        before, trained[0] = trained[0], trained[0] + len(datasets)
        if trained[0] // 100 > before // 100:
            memory = torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available() else 0.0
            print(f"  {trained[0]} clients trained, {time.time() - started:.1f} s, peak GPU memory {memory:.2f} GiB",
                  flush=True)
        return rounds

    ClientSide.train_clients = counted
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_inprocess(config, Path(tmp) / "run", echo=lambda line: print(line, flush=True))
    for row in rows:
        print(f"round {row['round']}: {row['seconds']:.1f} s", flush=True)
    print(f"{args.rounds} round(s) of {config.clients_per_round} clients in {time.time() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
