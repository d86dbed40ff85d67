"""PEFT LoRA on ViT and language-model backbones, in FFA mode (A frozen at a shared seeded init) or Flex mode (A and B trained).

Adapters travel as an ordered mapping ``layer -> LoRAFactors(A, B)`` with A (r x k) and B (m x r),
so that the update of a layer is (alpha / r) * B A. Layer names are module paths in the backbone
(``vit.layers.0.attention.q_proj``), the same on every client.
"""

from __future__ import annotations

import re
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import Tensor, nn

from fedlora.mechanisms import Message
from fedlora.algorithms import LoRAMode
from fedlora.models import TARGETS, build_backbone, linear_sides, model_spec
from fedlora.sketch import layer_of, seeded_normal

ADAPTER = "default"
_PREFIX = "base_model.model."



class LoRAFactors(NamedTuple):
    A: Tensor  # r x k
    B: Tensor  # m x r


Adapters = OrderedDict[str, LoRAFactors]


def build_lora_model(model: str, *, num_classes: int, rank: int, alpha: float, targets: str = "qv",
                     mode: LoRAMode | str = LoRAMode.FFA, seed: int = 0, train_head: bool = False) -> PeftModel:
    """A backbone (seeded, identical on every client) with LoRA attached."""
    spec = model_spec(model)
    backbone = build_backbone(model, num_classes=num_classes, seed=seed)
    return attach_lora(backbone, family=spec.family, head=spec.head, rank=rank, alpha=alpha, targets=targets,
                       mode=mode, seed=seed, train_head=train_head)


def attach_lora(backbone: nn.Module, *, family: str, head: str | tuple[str, ...] | None, rank: int, alpha: float, targets: str = "qv",
                mode: LoRAMode | str = LoRAMode.FFA, seed: int = 0, train_head: bool = False) -> PeftModel:
    """Wraps ``backbone`` with LoRA: A ~ N(0, 1/r) seeded per layer (the same on every client), B = 0.

    ``targets`` is a preset ("qv": attention query/value; "all": every attention and MLP linear); ``head`` names the
    classifier head's modules, trained whole (``train_head``) beside LoRA.
    """
    head = (head,) if isinstance(head, str) else tuple(head or ())
    if rank <= 0:
        raise ValueError(f"LoRA rank must be positive, got {rank}.")
    if not alpha > 0:
        raise ValueError(f"LoRA alpha must be positive, got {alpha}.")
    if seed < 0:
        raise ValueError(f"Seed must be non-negative, got {seed}.")
    mode = LoRAMode(mode)
    if (family, targets) not in TARGETS:
        raise ValueError(f"Unknown LoRA targets '{targets}'; choose 'qv' or 'all'.")
    for name, module in backbone.named_modules():
        if (sides := linear_sides(module)) and re.fullmatch(TARGETS[family, targets], name):
            if rank > min(sides):
                raise ValueError(f"LoRA rank {rank} exceeds the smaller side of layer '{name}' "
                                 f"({sides[0]} x {sides[1]}).")
    # GPT-2's Conv1D stores its weight transposed: PEFT's fan_in_fan_out says so (A stays r x k, B m x r)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=TARGETS[family, targets],
                        modules_to_save=list(head) if train_head and head else None, fan_in_fan_out=family == "gpt2")
    with warnings.catch_warnings():  # transformers 5 deprecation raised inside PEFT, not actionable here
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        model = get_peft_model(backbone, config)
    with torch.no_grad():
        for layer, module in _lora_layers(model):
            a = module.lora_A[ADAPTER].weight
            a.copy_(seeded_normal(*a.shape, std=rank ** -0.5, seed_parts=("lora-A", seed, layer),
                                  device=a.device, dtype=a.dtype))
            module.lora_B[ADAPTER].weight.zero_()
            a.requires_grad_(mode is LoRAMode.FLEX)
    return model


def is_backbone(name: str) -> bool:
    """Whether a LoRA model's parameter of this name is the backbone's: frozen in every round (not a LoRA factor,
    not the head's trained copy)."""
    return "lora_" not in name and "modules_to_save" not in name


def _lora_layers(model: nn.Module):
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            yield name.removeprefix(_PREFIX), module


def get_adapters(model: nn.Module) -> Adapters:
    """The model's LoRA factors, detached copies, in module order."""
    return OrderedDict((layer, LoRAFactors(m.lora_A[ADAPTER].weight.detach().clone(),
                                           m.lora_B[ADAPTER].weight.detach().clone()))
                       for layer, m in _lora_layers(model))


def set_adapters(model: nn.Module, adapters: Mapping[str, LoRAFactors]) -> None:
    """Loads factors into the model; every adapted layer must be given, with matching shapes."""
    layers = dict(_lora_layers(model))
    if set(layers) != set(adapters):
        missing, extra = sorted(set(layers) - set(adapters)), sorted(set(adapters) - set(layers))
        raise ValueError(f"Adapters do not match the model's LoRA layers (missing {missing[:3]}, unknown {extra[:3]}).")
    with torch.no_grad():
        for layer, (a, b) in adapters.items():
            for param, value, side in ((layers[layer].lora_A[ADAPTER].weight, a, "A"),
                                       (layers[layer].lora_B[ADAPTER].weight, b, "B")):
                if tuple(value.shape) != tuple(param.shape):
                    raise ValueError(f"LoRA {side} of '{layer}' must have shape {tuple(param.shape)}, "
                                     f"got {tuple(value.shape)}.")
                param.copy_(value)


def to_message(adapters: Mapping[str, LoRAFactors], *, mode: LoRAMode | str) -> Message:
    """What a client sends: B of every layer, and A too in Flex mode (FFA's A never changes)."""
    message: Message = {}
    for layer, (a, b) in adapters.items():
        if LoRAMode(mode) is LoRAMode.FLEX:
            message[f"{layer}.lora_A"] = a
        message[f"{layer}.lora_B"] = b
    return message


def from_message(message: Mapping[str, Tensor], base: Mapping[str, LoRAFactors]) -> Adapters:
    """Adapters from a message; factors the message does not carry (FFA's A) come from ``base``."""
    unknown = {layer_of(name) for name in message} - set(base)
    if unknown:
        raise ValueError(f"Message names unknown LoRA layers {sorted(unknown)[:3]}.")
    return OrderedDict((layer, LoRAFactors(message.get(f"{layer}.lora_A", a), message.get(f"{layer}.lora_B", b)))
                       for layer, (a, b) in base.items())


def save_adapters(model: PeftModel, path: str | Path) -> None:
    """PEFT format: ``PeftModel.from_pretrained(<same backbone>, path)`` loads it."""
    model.save_pretrained(str(path))



def message_parameters(model: PeftModel) -> dict[str, str]:
    """The name of the model's parameter behind each entry a client's message can carry: every layer's
    "{layer}.lora_A" and "{layer}.lora_B", and the trained head's entries (``get_head``)."""
    names = {id(p): n for n, p in model.named_parameters()}
    entries = {}
    for layer, module in _lora_layers(model):
        entries[f"{layer}.lora_A"] = names[id(module.lora_A[ADAPTER].weight)]
        entries[f"{layer}.lora_B"] = names[id(module.lora_B[ADAPTER].weight)]
    for name, module in _head_modules(model):
        entries.update({f"{name}.{p}": names[id(t)] for p, t in module.named_parameters()})
    return entries


def _head_modules(model: PeftModel) -> list[tuple[str, nn.Module]]:
    """The trainable copies PEFT keeps of the classifier head's modules (``modules_to_save``), if the head is
    trained; [] if frozen."""
    return [(name, model.base_model.model.get_submodule(name).modules_to_save[ADAPTER])
            for name in model.peft_config[ADAPTER].modules_to_save or []]


def get_head(model: PeftModel) -> dict[str, Tensor]:
    """The trained head's parameters as dense message entries (``classifier.weight``, ...); {} if frozen."""
    return {f"{name}.{p}": t.detach().clone() for name, module in _head_modules(model)
            for p, t in module.named_parameters()}


def set_head(model: PeftModel, values: Mapping[str, Tensor]) -> None:
    found = _head_modules(model)
    if not found and values:
        raise ValueError("This model's head is frozen, but head values were given.")
    with torch.no_grad():
        for name, module in found:
            for p, t in module.named_parameters():
                key = f"{name}.{p}"
                if key not in values or tuple(values[key].shape) != tuple(t.shape):
                    raise ValueError(f"Head entry '{key}' is missing or has the wrong shape.")
                t.copy_(values[key])
