"""Times configs/cifar100_private.toml's rounds on this machine through its offline twin: CIFAR-100-schema
synthetic data (32 px images resized to 224, as CIFAR-100's are) and ViT-B/16 with random weights, so it needs
neither the hub nor the dataset; the ServerApp and ClientApp over the in-process grid (no Ray). It prints the
clients trained so far every 100 clients, with the peak GPU memory. For GPUs: on a 2-core CPU a client takes
about 40 s.

    python -m benchmarks.preset_round            # one round of 500 clients
    python -m benchmarks.preset_round --rounds 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import machine, run_inprocess
from fedlora import federation
from fedlora.config import load_config

PRESET = Path(__file__).resolve().parent.parent / "configs" / "cifar100_private.toml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    if args.rounds < 1:
        print(f"preset_round: error: --rounds must be at least 1, got {args.rounds}.", file=sys.stderr)
        sys.exit(2)
    config = load_config(PRESET, ['dataset="synthetic"', 'model="vit-b16-random"', "train-examples=50000",
                                  "test-examples=2000", f"num-rounds={args.rounds}", "eval-every=1"])
    print(machine(), flush=True)
    started, trained = time.time(), [0]
    local_train = federation.local_train

    def counted(*a, **kw):
        loss = local_train(*a, **kw)
        trained[0] += 1
        if trained[0] % 100 == 0:
            memory = torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available() else 0.0
            print(f"  {trained[0]} clients trained, {time.time() - started:.1f} s, peak GPU memory {memory:.2f} GiB",
                  flush=True)
        return loss

    federation.local_train = counted  # the name Protocol.local_round calls
    with tempfile.TemporaryDirectory() as tmp:
        run_inprocess(config, Path(tmp) / "run", echo=lambda line: print(line, flush=True))
    print(f"{args.rounds} round(s) of {config.clients_per_round} clients in {time.time() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
