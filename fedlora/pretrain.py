"""The offline public backbone: the tiny ViT pretrained, non-privately, on public data no federation holds.

Real users fine-tune ViTs pretrained on public images (ImageNet-21k for `vit-b16`). Offline there is no hub, so
the tiny ViT gets the same story from the synthetic generator: 100 public classes whose prototypes come from a
seed stream of their own (``make_synthetic_cifar(public=True)``), disjoint from every federation's classes, which
are drawn from the run seed. No federation data, private or test, is seen.

    fedlora pretrain                  # rebuilds fedlora/weights/vit-tiny-public.safetensors, prints its sha256

The weights are committed with their checksum (``fedlora.models.PUBLIC_WEIGHTS``), so that runs never wait for
this; rebuilding on another torch version or CPU may differ in the last bits, and then in the checksum.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from fedlora.data import make_synthetic_cifar, to_torch
from fedlora.models import PUBLIC_WEIGHTS, build_backbone, logits

PUBLIC_CLASSES = 100
PUBLIC_EXAMPLES = 32_000
STEPS = 1_000
BATCH_SIZE = 64
LR = 1e-3
WEIGHT_DECAY = 0.05
SEED = 0


def pretrain(out: Path = PUBLIC_WEIGHTS.path, *, steps: int = STEPS, examples: int = PUBLIC_EXAMPLES,
             echo: Callable[[str], None] = print) -> str:
    """Trains the tiny ViT on the public classes with AdamW (cosine schedule); saves it without its head, in
    float16; returns the file's sha256."""
    from safetensors.torch import save_file

    torch.manual_seed(SEED)
    public = to_torch(make_synthetic_cifar(examples, num_classes=PUBLIC_CLASSES, seed=SEED, public=True), 32,
                      train=True)
    model = build_backbone(PUBLIC_WEIGHTS.architecture, num_classes=PUBLIC_CLASSES, seed=SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    order = torch.randperm(examples, generator=torch.Generator().manual_seed(SEED))
    model.train()
    for step in range(steps):
        start = step * BATCH_SIZE % examples
        batch = public[order[start:start + BATCH_SIZE].tolist()]
        out_ = logits(model, batch["pixel_values"])
        loss = F.cross_entropy(out_, batch["labels"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if (step + 1) % 50 == 0 or step + 1 == steps:
            accuracy = (out_.argmax(1) == batch["labels"]).float().mean().item()
            echo(f"pretrain: step {step + 1}/{steps}  loss {loss.item():.3f}  batch accuracy {accuracy:.2f}")
    backbone = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()
                if not k.startswith(PUBLIC_WEIGHTS.head)}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(backbone, str(out), metadata={"pretrained_on": PUBLIC_WEIGHTS.pretrained_on, "steps": str(steps)})
    digest = sha256(out)
    echo(f"pretrain: wrote {out} (sha256 {digest})")
    return digest


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
