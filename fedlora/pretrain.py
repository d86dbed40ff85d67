"""The offline public backbones: the tiny ViT pretrained, non-privately, on public data no federation holds.

Real users fine-tune ViTs pretrained on public images (ImageNet-21k for `vit-b16`). Offline there is no hub, so
the tiny ViT is pretrained here, on one of two public sources:

- ``vit-tiny-public``: 100 synthetic classes whose prototypes come from a seed stream of their own
  (``make_synthetic_cifar(public=True)``), disjoint from every federation's classes. The synthetic quickstart's
  backbone. It does not transfer to real images (docs: explanation/backbones.md).
- ``vit-tiny-fashion-public``: Fashion-MNIST's public split, the last 10,000 of its 60,000 training images, which
  no federation uses (``load_fashion_mnist("train")`` is the first 50,000). The real-data preset's backbone.

    fedlora pretrain --dataset fashion-mnist   # rebuilds fedlora/weights/vit-tiny-fashion-public.safetensors
    fedlora pretrain                           # the synthetic one, vit-tiny-public.safetensors; both print the sha256

The weights are committed with their checksums (``fedlora.models.PACKAGED_WEIGHTS``), so that runs never wait for
this; rebuilding on another torch version or CPU may differ in the last bits, and then in the checksum.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from fedlora.data import FASHION_MNIST_CLASSES, load_fashion_mnist, make_synthetic_cifar, to_torch
from fedlora.models import PACKAGED_TOKENIZERS, PACKAGED_WEIGHTS, build_backbone, logits
from fedlora.text import FORTUNES, fortunes_texts, to_device_tokens, train_tokenizer

BATCH_SIZE = 64
LR = 1e-3
WEIGHT_DECAY = 0.05
SEED = 0


@dataclass(frozen=True)
class Recipe:
    """AdamW with a linear warmup and a cosine decay, on one public dataset; random flips, and random shifts of up to
    ``shift`` pixels (the usual pad-and-crop)."""

    steps: int
    warmup: int = 0
    label_smoothing: float = 0.0
    shift: int = 0


# The synthetic backbone's recipe is the one it was built with. The real images' adds what a ViT trained from scratch
# on little data needs: warmup, label smoothing, random shifts and more epochs (about 38 of the 10,000 public images;
# at 13 epochs and without shifts its linear probe was 0.839, docs/explanation/backbones.md).
RECIPES = {"vit-tiny-public": Recipe(steps=1_000), "vit-tiny-fashion-public": Recipe(6_000, 100, 0.1, shift=4)}
SYNTHETIC_PUBLIC_CLASSES = 100
SYNTHETIC_PUBLIC_EXAMPLES = 32_000


def public_data(model: str, examples: int | None = None):
    """(dataset in the common schema, number of classes) of the public data ``model`` is pretrained on."""
    if model == "vit-tiny-fashion-public":
        data = load_fashion_mnist("public")
        return (data.select(range(examples)) if examples else data), len(FASHION_MNIST_CLASSES)
    return (make_synthetic_cifar(examples or SYNTHETIC_PUBLIC_EXAMPLES, num_classes=SYNTHETIC_PUBLIC_CLASSES,
                                 seed=SEED, public=True), SYNTHETIC_PUBLIC_CLASSES)


def pretrain(dataset: str = "synthetic", out: Path | None = None, *, steps: int | None = None,
             examples: int | None = None, echo: Callable[[str], None] = print) -> str:
    """Trains the tiny ViT on ``dataset``'s public data ("synthetic" or "fashion-mnist"); saves it without its
    head, in float16, to ``out`` (default: the packaged file its model loads); returns the file's sha256."""
    from safetensors.torch import save_file

    if dataset == FORTUNES:
        return pretrain_language_model(out, steps=steps, echo=echo)
    model = next((name for name, w in PACKAGED_WEIGHTS.items() if w.dataset == dataset), None)
    if model is None:
        raise ValueError(f"No public data to pretrain on in '{dataset}'; choose one of: "
                         f"{', '.join(w.dataset for w in PACKAGED_WEIGHTS.values())}.")
    weights, recipe = PACKAGED_WEIGHTS[model], RECIPES[model]
    steps = steps or recipe.steps
    warmup = min(recipe.warmup, steps // 10)
    out = Path(out or weights.path)
    torch.manual_seed(SEED)
    data, classes = public_data(model, examples)
    # Decoded, resized and normalized once; only the flips are drawn per step, from the global generator, one per
    # image in batch order, as the train transform's RandomHorizontalFlip would (so the same seed, the same run).
    public = to_torch(data, 32)[list(range(len(data)))]
    net = build_backbone(weights.architecture, num_classes=classes, seed=SEED)
    optimizer, schedule = _adamw(net, steps, warmup)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(SEED))
    net.train()
    for step in range(steps):
        start = step * BATCH_SIZE % len(data)
        rows = order[start:start + BATCH_SIZE]
        flips = torch.cat([torch.rand(1) for _ in rows]) < 0.5
        images = public["pixel_values"][rows]
        labels = public["labels"][rows]
        images = torch.where(flips.view(-1, 1, 1, 1), images.flip(-1), images)
        if recipe.shift:
            images = _shifted(images, recipe.shift)
        out_ = logits(net, images)
        loss = F.cross_entropy(out_, labels, label_smoothing=recipe.label_smoothing)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if (step + 1) % 50 == 0 or step + 1 == steps:
            accuracy = (out_.argmax(1) == labels).float().mean().item()
            echo(f"pretrain {model}: step {step + 1}/{steps}  loss {loss.item():.3f}  batch accuracy {accuracy:.2f}")
    backbone = {k: v.detach().to(torch.float16).contiguous() for k, v in net.state_dict().items()
                if not k.startswith(weights.head)}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(backbone, str(out), metadata={"pretrained_on": weights.pretrained_on, "steps": str(steps)})
    digest = sha256(out)
    echo(f"pretrain {model}: wrote {out} (sha256 {digest})")
    return digest


def _adamw(net: torch.nn.Module, steps: int, warmup: int):
    """AdamW over every parameter with a linear warmup and a cosine decay to zero over ``steps``."""
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup if warmup else 1.0) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    return optimizer, schedule


def _shifted(images: torch.Tensor, shift: int) -> torch.Tensor:
    """Each image moved by its own random offset of up to ``shift`` pixels each way, the border filled with the
    background (the smallest normalized value); offsets from the global generator, as the flips."""
    size = images.shape[-1]
    padded = F.pad(images, (shift,) * 4, value=float(images.min()))
    offsets = torch.randint(0, 2 * shift + 1, (len(images), 2)).tolist()
    return torch.stack([p[:, y:y + size, x:x + size] for p, (y, x) in zip(padded, offsets)])


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# The tiny language model: its tokenizer and its weights, on the public text only (fortunes). About 0.8 M tokens; 1,500
# steps of 16 blocks of 128 tokens are about 4 passes over it (held-out loss still falling slowly, the model tiny).
LM_MODEL, LM_TOKENIZER = "gpt2-tiny-public", "fortunes-bpe-4096"
LM_RECIPE = Recipe(steps=1_500, warmup=100)
LM_BATCH, LM_SEQ_LEN = 16, 128


def pretrain_language_model(out: Path | None = None, *, steps: int | None = None,
                            echo: Callable[[str], None] = print) -> str:
    """Trains the packaged tokenizer (a byte-level BPE of 4,096 tokens) and the tiny GPT-2 on the public text, the
    fortunes package's; saves both (the tokenizer beside ``out``), the weights in float16 without the output layer
    (tied to the input embedding); returns the weights' sha256 and prints the tokenizer's."""
    from safetensors.torch import save_file

    weights, packaged = PACKAGED_WEIGHTS[LM_MODEL], PACKAGED_TOKENIZERS[LM_TOKENIZER]
    steps = steps or LM_RECIPE.steps
    warmup = min(LM_RECIPE.warmup, steps // 10)
    out = Path(out or weights.path)
    out.parent.mkdir(parents=True, exist_ok=True)
    texts = fortunes_texts()
    tokenizer = train_tokenizer(texts, vocab_size=4096)
    tokenizer_path = out.parent / packaged.file
    tokenizer.save(str(tokenizer_path))
    echo(f"pretrain {LM_MODEL}: wrote {tokenizer_path} (sha256 {sha256(tokenizer_path)})")
    torch.manual_seed(SEED)
    units = [torch.tensor(e.ids).numpy() for e in tokenizer.encode_batch(texts)]
    order = torch.randperm(len(units), generator=torch.Generator().manual_seed(SEED)).tolist()
    blocks = to_device_tokens([units[i] for i in order], LM_SEQ_LEN, tokenizer.token_to_id("<|endoftext|>"))
    from fedlora.tasks import task_named

    task = task_named("causal-lm")
    net = build_backbone(weights.architecture, num_classes=0, seed=SEED)
    optimizer, schedule = _adamw(net, steps, warmup)
    rows = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(SEED))
    net.train()
    for step in range(steps):
        start = step * LM_BATCH % len(blocks)
        loss = task.loss(net, blocks[rows[start:start + LM_BATCH].tolist()])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if (step + 1) % 50 == 0 or step + 1 == steps:
            echo(f"pretrain {LM_MODEL}: step {step + 1}/{steps}  loss {loss.item():.3f}  perplexity "
                 f"{math.exp(loss.item()):.1f}")
    backbone = {k: v.detach().to(torch.float16).contiguous() for k, v in net.state_dict().items()
                if not k.startswith(weights.head)}
    save_file(backbone, str(out), metadata={"pretrained_on": weights.pretrained_on, "steps": str(steps)})
    digest = sha256(out)
    echo(f"pretrain {LM_MODEL}: wrote {out} (sha256 {digest})")
    return digest
