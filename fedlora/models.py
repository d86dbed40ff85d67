"""ViT backbones from transformers and timm: pretrained from the hub when reachable, tiny and random offline.

A backbone is returned bare (no wrapper module), so that a PEFT adapter saved from it loads with
``PeftModel.from_pretrained`` onto the same model built by its own library.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from fedlora.hub import offline_requested, unreachable_reason


class ModelUnavailableError(ValueError):
    """Pretrained weights could not be fetched (offline, or an unknown hub id)."""


@dataclass(frozen=True)
class ModelSpec:
    """What a model name stands for."""

    family: str  # "transformers" or "timm"
    source: str  # hub id (transformers) or timm model name
    image_size: int
    pretrained: bool
    # Architecture overrides for random-init models (transformers ViTConfig / timm kwargs).
    overrides: tuple[tuple[str, int], ...] = ()
    random_twin: str | None = None  # the same architecture with random weights (shapes without the hub)
    packaged: bool = False  # weights shipped in the package (PACKAGED_WEIGHTS) on the random twin's architecture

    @property
    def head(self) -> str:
        """Name of the classifier head module."""
        return "classifier" if self.family == "transformers" else "head"


# Tiny ViT for CPUs and tests: 32 px, patch 4 (64 tokens), 6 blocks of width 192.
_TINY = dict(hidden_size=192, num_hidden_layers=6, num_attention_heads=3, intermediate_size=384)


@dataclass(frozen=True)
class PackagedWeights:
    """Backbone weights shipped inside the package, checked against their sha256 before use."""

    architecture: str  # the random-init model they fit
    file: str  # in fedlora/weights/, unless absolute
    sha256: str
    dataset: str  # the public data `fedlora pretrain --dataset` trains them on
    pretrained_on: str
    head: str = "classifier"  # left out of the file: every run gets a fresh head for its own classes

    @property
    def path(self) -> Path:
        return Path(__file__).resolve().parent / "weights" / self.file  # an absolute file stays as it is

    def locate(self) -> Path:
        """The file beside this module, else the installed fedlora's: a Flower app bundle (FAB) carries code,
        not weights, and its copy of fedlora shadows the installed one in the ServerApp and ClientApp."""
        import importlib.metadata
        import json
        from urllib.parse import unquote, urlparse

        candidates = [self.path]
        for dist in importlib.metadata.distributions(name="fedlora"):
            candidates.append(Path(dist.locate_file(f"fedlora/weights/{self.file}")))  # a wheel install
            direct = json.loads(dist.read_text("direct_url.json") or "{}")
            if direct.get("dir_info", {}).get("editable"):  # `pip install -e`: the source tree
                candidates.append(Path(unquote(urlparse(direct["url"]).path)) / "fedlora" / "weights" / self.file)
        return next((c for c in candidates if c.is_file()), self.path)


# Built by `fedlora pretrain --dataset DATASET` (fedlora/pretrain.py); rebuild and update the checksum together.
PACKAGED_WEIGHTS: dict[str, PackagedWeights] = {
    "vit-tiny-public": PackagedWeights(
        "vit-tiny", "vit-tiny-public.safetensors",
        "496e2302a155b50669c256cdf7b518327475eac6a670d75de31ef05fd62e482a", "synthetic",
        "100 public synthetic classes from a seed stream no federation uses (no federation data, private or test)"),
    "vit-tiny-fashion-public": PackagedWeights(
        "vit-tiny", "vit-tiny-fashion-public.safetensors",
        "477c5a7b36547467cf255a922babe9ec280aa2408f71d21c3d38a028eb52d90d", "fashion-mnist",
        "Fashion-MNIST's public split: the last 10,000 of its 60,000 training images, which no federation uses "
        "(its train split is the first 50,000; no test image)"),
}

MODELS: dict[str, ModelSpec] = {
    "vit-tiny": ModelSpec("transformers", "vit-tiny", 32, False,
                          tuple({"image_size": 32, "patch_size": 4, **_TINY}.items())),
    # The same tiny ViT pretrained offline on public synthetic data (PACKAGED_WEIGHTS): the CPU quickstart's.
    "vit-tiny-public": ModelSpec("transformers", "vit-tiny-public", 32, False, random_twin="vit-tiny",
                                 packaged=True),
    # The same pretrained on real public images: Fashion-MNIST's public split (PACKAGED_WEIGHTS says what it saw).
    "vit-tiny-fashion-public": ModelSpec("transformers", "vit-tiny-fashion-public", 32, False,
                                         random_twin="vit-tiny", packaged=True),
    "timm-vit-tiny": ModelSpec("timm", "vit_tiny_patch16_224", 32, False,
                               (("img_size", 32), ("patch_size", 4), ("embed_dim", 192), ("depth", 6),
                                ("num_heads", 3))),
    # ViT-B/16 pretrained on ImageNet-21k, the paper's backbone size (86M parameters).
    "vit-b16": ModelSpec("transformers", "google/vit-base-patch16-224-in21k", 224, True,
                         random_twin="vit-b16-random"),
    "timm-vit-b16": ModelSpec("timm", "vit_base_patch16_224.augreg_in21k", 224, True,
                              random_twin="timm-vit-b16-random"),
    # The same architectures with random weights: offline shape checks and benchmarks.
    "vit-b16-random": ModelSpec("transformers", "vit-b16-random", 224, False),
    "timm-vit-b16-random": ModelSpec("timm", "vit_base_patch16_224", 224, False),
}


# Target presets, as full-match regexes over module paths (so timm's patch-embedding conv, also
# named "proj", is never adapted). timm fuses q, k and v into one Linear, "qkv": its "qv" preset
# adapts that fused projection.
TARGETS: dict[tuple[str, str], str] = {
    ("transformers", "qv"): r".*layers\.\d+\.attention\.(q_proj|v_proj)",
    ("transformers", "all"): r".*layers\.\d+\.(attention\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(fc1|fc2))",
    ("timm", "qv"): r".*blocks\.\d+\.attn\.qkv",
    ("timm", "all"): r".*blocks\.\d+\.(attn\.(qkv|proj)|mlp\.(fc1|fc2))",
}


def model_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"Unknown model '{name}'; choose one of: {', '.join(MODELS)}.")
    return MODELS[name]


def build_backbone(name: str, *, num_classes: int, seed: int = 0) -> nn.Module:
    """The classifier backbone for a model name, with a fresh ``num_classes``-way head.

    Random weights (the head, and the whole model for random-init presets) are drawn from
    ``seed`` so that every client builds the very same model.
    """
    spec = model_spec(name)
    if num_classes < 2:
        raise ValueError(f"A classifier needs at least 2 classes, got {num_classes}.")
    if spec.pretrained and not offline_requested() and (reason := unreachable_reason()):
        raise _unavailable(spec, f"{reason}; set HF_HUB_OFFLINE=1 to use weights already in your HF cache")
    if spec.packaged:
        backbone = build_backbone(spec.random_twin, num_classes=num_classes, seed=seed)
        if next(backbone.parameters()).device.type != "meta":  # shapes only: no weights to load
            _load_packaged(backbone, PACKAGED_WEIGHTS[name])
        return backbone
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if spec.family == "transformers":
            return _transformers_vit(spec, num_classes)
        return _timm_vit(spec, num_classes)


def _load_packaged(backbone: nn.Module, weights: PackagedWeights) -> None:
    """Every weight but the head from the package's file, after checking its checksum."""
    state = _packaged_state(weights)
    missing, unexpected = backbone.load_state_dict(state, strict=False)
    if unexpected or any(not name.startswith(weights.head) for name in missing):
        raise ModelUnavailableError(f"'{weights.path}' does not fit {weights.architecture} (missing {missing}, "
                                    f"unexpected {unexpected}); rebuild it with `fedlora pretrain --dataset {weights.dataset}`.")


@lru_cache(maxsize=1)
def _packaged_state(weights: PackagedWeights) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    path = weights.locate()
    if not path.is_file():
        raise ModelUnavailableError(f"The pretrained weights '{path}' are missing; rebuild them with "
                                    f"`fedlora pretrain --dataset {weights.dataset}`, or use model = \"vit-tiny\" (random "
                                    "init).")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != weights.sha256:
        raise ModelUnavailableError(f"The pretrained weights '{path}' do not match their sha256 "
                                    f"{weights.sha256[:12]}...; rebuild them with `fedlora pretrain --dataset {weights.dataset}` and update "
                                    "PACKAGED_WEIGHTS, or use model = \"vit-tiny\" (random init).")
    return {name: tensor.float() for name, tensor in load(data).items()}


def _unavailable(spec: ModelSpec, error: Exception | str) -> ModelUnavailableError:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return ModelUnavailableError(
        f"Pretrained weights '{spec.source}' could not be loaded from the Hugging Face hub ({reason}); "
        f"offline, use model = \"vit-tiny\" (random init, 32 px) or a '-random' ViT-B variant.")


def _transformers_vit(spec: ModelSpec, num_classes: int) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    if spec.pretrained:
        try:
            return ViTForImageClassification.from_pretrained(spec.source, num_labels=num_classes,
                                                             attn_implementation="sdpa")
        except (OSError, ValueError) as error:  # hub errors surface as OSError subclasses
            raise _unavailable(spec, error) from None
    # PyTorch's fused attention (SDPA) in both families: timm's ViT uses it by default (fused_attn)
    return ViTForImageClassification(ViTConfig(num_labels=num_classes, attn_implementation="sdpa",
                                               **dict(spec.overrides)))


def _timm_vit(spec: ModelSpec, num_classes: int) -> nn.Module:
    import timm

    try:
        return timm.create_model(spec.source, pretrained=spec.pretrained, num_classes=num_classes,
                                 **dict(spec.overrides))
    except (OSError, RuntimeError, ValueError) as error:
        if spec.pretrained:
            raise _unavailable(spec, error) from None
        raise


def logits(model: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    """Class scores of either family (transformers returns an output object, timm a tensor)."""
    out = model(pixel_values)
    return out.logits if hasattr(out, "logits") else out


@lru_cache(maxsize=8)
def adapted_layer_shapes(model: str, *, targets: str = "qv") -> OrderedDict[str, tuple[int, int]]:
    """(out_features m, in_features k) of every linear the targets adapt, without weights or the hub."""
    spec = model_spec(model)
    if (spec.family, targets) not in TARGETS:
        raise ValueError(f"Unknown LoRA targets '{targets}'; choose 'qv' or 'all'.")
    with torch.device("meta"):  # shapes only: nothing is allocated or downloaded
        backbone = build_backbone(spec.random_twin or model, num_classes=2)
    return OrderedDict((name, (module.out_features, module.in_features)) for name, module in backbone.named_modules()
                       if isinstance(module, nn.Linear) and re.fullmatch(TARGETS[spec.family, targets], name))
