"""The ceilings beside every federated number on real images: centralized training of the same model and recipe on
Fashion-MNIST's 50,000 private training images, tested on its 10,000 test images.

- logistic regression on the raw pixels (the dataset's published baseline, 0.84): what any credible ViT must beat;
- for each backbone (random init; pretrained on public synthetic classes; pretrained on Fashion-MNIST's public
  split), a linear probe on its frozen features (the transfer of its pretraining) and LoRA fine-tuning of the
  federated recipe, centralized (LoRA on q and v at rank 4 plus the head, the local optimizer and lr of the
  real-data preset, batch 64), and the same with the quickstart's SGD at lr 0.05 for the real-data backbone;
- the ceiling against training length: the preset's recipe on the real-data backbone continued past the first step
  count to each later one (a fresh Adam at each, as every federated round starts one).

    python -m benchmarks.real_data                     # 600 steps, then 1200 and 2400: about 30 min on 2 cores
    python -m benchmarks.real_data --steps 200         # quicker, lower ceilings

Results: benchmarks/results/real_data.{md,csv,json}, with the command, commit and machine.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.common import RESULTS, command_line, machine, revision, step_counts
from fedlora.config import load_config
from fedlora.data import fashion_mnist_unavailable_reason, load_fashion_mnist, to_torch
from fedlora.lora import build_lora_model
from fedlora.models import build_backbone, logits
from fedlora.training import evaluate, local_train

BACKBONES = {"vit-tiny": "random init", "vit-tiny-public": "pretrained on public synthetic classes",
             "vit-tiny-fashion-public": "pretrained on Fashion-MNIST's public split"}
PROBE_EXAMPLES = 20_000  # training images the linear probes fit on (features of all 50,000 cost minutes more)


def _linear_fit(x: torch.Tensor, y: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor) -> float:
    """Multinomial logistic regression on standardized inputs (full-batch Adam, weight decay 1e-4); test accuracy."""
    mean, std = x.mean(0), x.std(0) + 1e-6
    x, x_test = (x - mean) / std, (x_test - mean) / std
    torch.manual_seed(0)
    head = torch.nn.Linear(x.shape[1], int(y.max()) + 1)
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2, weight_decay=1e-4)
    for _ in range(500):
        loss = F.cross_entropy(head(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        return (head(x_test).argmax(1) == y_test).double().mean().item()


@torch.no_grad()
def _features(model, data) -> torch.Tensor:
    model.eval()
    model.classifier = torch.nn.Identity()  # the [CLS] feature after the final layer norm
    return torch.cat([logits(model, data[list(range(s, min(s + 500, len(data))))]["pixel_values"])
                      for s in range(0, len(data), 500)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="600,1200,2400",
                        help="fine-tuning steps at batch 64, increasing: every recipe trains for the first count, the "
                             "preset's on the real-data backbone continues to each later one (default 600,1200,2400)")
    args = parser.parse_args(argv)
    steps = step_counts(args.steps)
    if steps is None:
        print(f"real_data: error: --steps takes increasing positive step counts (e.g. 600,1200), got {args.steps!r}.",
              file=sys.stderr)
        return 2
    if (reason := fashion_mnist_unavailable_reason()) is not None:
        print(f"real_data: {reason}", file=sys.stderr)
        return 2
    preset = load_config("fashion_mnist")
    train, test = load_fashion_mnist("train"), load_fashion_mnist("test")
    test_t = to_torch(test, 32)
    rows = []

    def record(method: str, backbone: str, accuracy: float, started: float) -> None:
        rows.append({"method": method, "backbone": backbone, "accuracy": round(accuracy, 4)})
        print(f"  {method:<44} {backbone:<24} {accuracy:.3f}  ({time.time() - started:.0f} s)", flush=True)

    started = time.time()
    pixels = torch.tensor(train.with_format("numpy")[:]["img"][..., 0], dtype=torch.float32).flatten(1)
    test_pixels = torch.tensor(test.with_format("numpy")[:]["img"][..., 0], dtype=torch.float32).flatten(1)
    labels, test_labels = torch.tensor(train["fine_label"]), torch.tensor(test["fine_label"])
    record("logistic regression on the pixels", "-", _linear_fit(pixels, labels, test_pixels, test_labels), started)

    subset = to_torch(train.select(range(PROBE_EXAMPLES)), 32)
    for name in BACKBONES:
        started = time.time()
        x = _features(build_backbone(name, num_classes=10), subset)
        x_test = _features(build_backbone(name, num_classes=10), test_t)
        record(f"linear probe ({PROBE_EXAMPLES:,} images)", name, _linear_fit(x, labels[:PROBE_EXAMPLES], x_test,
                                                                             test_labels), started)
    recipes = [(name, preset.local_optimizer, preset.lr) for name in BACKBONES]
    recipes.append((preset.model, "sgd", 0.05))  # the quickstart's optimizer, on the real-data backbone
    augmented = to_torch(train, 32, train=True)
    for name, optimizer, lr in recipes:
        started = time.time()
        model = build_lora_model(name, num_classes=10, rank=preset.rank, alpha=preset.lora_alpha,
                                 targets=preset.targets, train_head=True)
        generator = torch.Generator().manual_seed(0)
        continued = steps if (name, optimizer, lr) == (preset.model, preset.local_optimizer, preset.lr) else steps[:1]
        for done, total in zip([0, *continued], continued):
            local_train(model, augmented, steps=total - done, batch_size=64, lr=lr, optimizer=optimizer,
                        generator=generator)
            record(f"LoRA {preset.targets} r{preset.rank} + head, {optimizer} lr {lr:g}, {total} steps", name,
                   evaluate(model, test_t)[0], started)

    RESULTS.mkdir(exist_ok=True)
    header = (f"Command: `{command_line('benchmarks.real_data')}`; commit {revision()}; {machine()}.\n\n"
              f"Fashion-MNIST: trained on the 50,000 private training images (probes on the first "
              f"{PROBE_EXAMPLES:,}), tested on the 10,000 test images; chance 0.10. Backbones: "
              + "; ".join(f"{k}: {v}" for k, v in BACKBONES.items()) + ". LoRA runs past the first step count "
              "continue the same model with a fresh Adam (as each federated round starts one) and the same stream "
              "of batches.\n\n")
    table = ["| method | backbone | test accuracy |", "|---|---|---|"]
    table += [f"| {r['method']} | {r['backbone']} | {r['accuracy']:.3f} |" for r in rows]
    (RESULTS / "real_data.md").write_text("# Centralized ceilings on Fashion-MNIST\n\n" + header + "\n".join(table) + "\n")
    with (RESULTS / "real_data.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (RESULTS / "real_data.json").write_text(json.dumps({"command": command_line("benchmarks.real_data"),
                                                        "commit": revision(), "machine": machine(), "rows": rows},
                                                       indent=1))
    print(f"wrote {RESULTS / 'real_data.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
