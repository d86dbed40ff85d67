"""Backbones: ViTs from transformers and timm, causal language models (GPT-2, LLaMA) from transformers; pretrained
from the hub when reachable, tiny and random offline, and tiny ones pretrained on public data shipped in the package.

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

    family: str  # "transformers" (ViT), "timm" (ViT), "gpt2" or "llama" (causal LMs), "bert", "roberta" or
    # "distilbert" (sequence classifiers; all but timm from transformers)
    source: str  # hub id (transformers) or timm model name
    image_size: int  # 0 for a language model
    pretrained: bool
    # Architecture overrides for random-init models (transformers ViTConfig / timm kwargs).
    overrides: tuple[tuple[str, int], ...] = ()
    random_twin: str | None = None  # the same architecture with random weights (shapes without the hub)
    packaged: bool = False  # weights shipped in the package (PACKAGED_WEIGHTS) on the random twin's architecture
    task: str = "image-classification"  # what the model does (fedlora.tasks)
    tokenizer: str = ""  # a language model's: a hub id, or a packaged tokenizer's name (PACKAGED_TOKENIZERS)

    @property
    def head(self) -> tuple[str, ...]:
        """Names of the classifier head's modules, fresh at every init (DistilBERT's reads its first token through
        pre_classifier first); none for a causal LM, whose output layer is tied to its input embedding and stays
        frozen."""
        return {"transformers": ("classifier",), "timm": ("head",), "bert": ("classifier",),
                "roberta": ("classifier",), "distilbert": ("pre_classifier", "classifier")}.get(self.family, ())


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
    head: str = "classifier"  # left out of the file: every run gets a fresh head for its own classes (a causal
    # LM's output layer is its input embedding, tied: stored once)

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

# The packaged language models' tokenizer: a byte-level BPE of 4,096 tokens trained on the public text (fortunes)
# by `fedlora pretrain --dataset fortunes`, which rebuilds it with the model.
PACKAGED_TOKENIZERS: dict[str, PackagedWeights] = {
    "fortunes-bpe-4096": PackagedWeights(
        "", "fortunes-bpe-4096.json", "a80cd8044428340b36a3a8fb54483f52ac1b26440876c0f7a7bb63af5a8bc4fb", "fortunes",
        "the fortunes package's texts (about 15,000 fortune-cookie texts of many modern writers; no federation's)"),
}
PACKAGED_WEIGHTS["gpt2-tiny-public"] = PackagedWeights(
    "gpt2-tiny", "gpt2-tiny-public.safetensors", "310593290d719529ed4627f4d9bfaa7796d845ee0f4d1ff645403adbb27f793c", "fortunes",
    "the fortunes package's texts (about 15,000 fortune-cookie texts of many modern writers, 0.8 M tokens), which no "
    "federation uses", head="lm_head")

# Tiny causal LMs for CPUs and tests: 4 blocks of width 128, 4,096 tokens, sequences up to 256.
_TINY_GPT2 = dict(vocab_size=4096, n_positions=256, n_embd=128, n_layer=4, n_head=4)
_TINY_LLAMA = dict(vocab_size=4096, max_position_embeddings=256, hidden_size=128, intermediate_size=256,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
# TinyLlama 1.1B's shapes (LLaMA 2 architecture, grouped-query attention): the GPU throughput benchmark's 1B model.
_LLAMA_1B = dict(vocab_size=32000, max_position_embeddings=2048, hidden_size=2048, intermediate_size=5632,
                 num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4)
# Tiny text classifiers for CPUs and tests (BERT, RoBERTa and DistilBERT architectures): 4 blocks of width 128, the
# packaged tokenizer's 4,096 tokens, sequences up to 256 (RoBERTa's positions start after its padding id: 2 more).
_TINY_BERT = dict(vocab_size=4096, max_position_embeddings=256, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=4, num_attention_heads=4)
_TINY_ROBERTA = {**_TINY_BERT, "max_position_embeddings": 258}
_TINY_DISTILBERT = dict(vocab_size=4096, max_position_embeddings=256, dim=128, hidden_dim=256, n_layers=4, n_heads=4)
CAUSAL_LM = "causal-lm"
TEXT_CLASSIFICATION = "text-classification"
SEQUENCE_CLASSIFIERS = ("bert", "roberta", "distilbert")  # families of transformers' *ForSequenceClassification
_LM = dict(task=CAUSAL_LM)
_TC = dict(task=TEXT_CLASSIFICATION)

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
    # Causal language models. Offline: tiny GPT-2 and LLaMA at random init, and the tiny GPT-2 pretrained on the
    # public text (PACKAGED_WEIGHTS), all with the packaged tokenizer.
    "gpt2-tiny": ModelSpec("gpt2", "gpt2-tiny", 0, False, tuple(_TINY_GPT2.items()), tokenizer="fortunes-bpe-4096",
                           **_LM),
    "gpt2-tiny-public": ModelSpec("gpt2", "gpt2-tiny-public", 0, False, random_twin="gpt2-tiny", packaged=True,
                                  tokenizer="fortunes-bpe-4096", **_LM),
    "llama-tiny": ModelSpec("llama", "llama-tiny", 0, False, tuple(_TINY_LLAMA.items()),
                            tokenizer="fortunes-bpe-4096", **_LM),
    # GPT-2 small (124M) and TinyLlama 1.1B from the hub, with their random twins (shapes and speed offline).
    "gpt2": ModelSpec("gpt2", "openai-community/gpt2", 0, True, random_twin="gpt2-random",
                      tokenizer="openai-community/gpt2", **_LM),
    "gpt2-random": ModelSpec("gpt2", "gpt2-random", 0, False, tokenizer="openai-community/gpt2", **_LM),
    "tinyllama": ModelSpec("llama", "TinyLlama/TinyLlama_v1.1", 0, True, random_twin="llama-1b-random",
                           tokenizer="TinyLlama/TinyLlama_v1.1", **_LM),
    "llama-1b-random": ModelSpec("llama", "llama-1b-random", 0, False, tuple(_LLAMA_1B.items()),
                                 tokenizer="TinyLlama/TinyLlama_v1.1", **_LM),
    # Text (sequence) classifiers. Offline: tiny BERT, RoBERTa and DistilBERT at random init with the packaged
    # tokenizer; from the hub: the three base models with their tokenizers, and their random twins.
    "bert-tiny": ModelSpec("bert", "bert-tiny", 0, False, tuple(_TINY_BERT.items()), tokenizer="fortunes-bpe-4096",
                           **_TC),
    "roberta-tiny": ModelSpec("roberta", "roberta-tiny", 0, False, tuple(_TINY_ROBERTA.items()),
                              tokenizer="fortunes-bpe-4096", **_TC),
    "distilbert-tiny": ModelSpec("distilbert", "distilbert-tiny", 0, False, tuple(_TINY_DISTILBERT.items()),
                                 tokenizer="fortunes-bpe-4096", **_TC),
    "bert-base": ModelSpec("bert", "google-bert/bert-base-uncased", 0, True, random_twin="bert-base-random",
                           tokenizer="google-bert/bert-base-uncased", **_TC),
    "bert-base-random": ModelSpec("bert", "bert-base-random", 0, False, tokenizer="google-bert/bert-base-uncased",
                                  **_TC),
    "roberta-base": ModelSpec("roberta", "FacebookAI/roberta-base", 0, True, random_twin="roberta-base-random",
                              tokenizer="FacebookAI/roberta-base", **_TC),
    "roberta-base-random": ModelSpec("roberta", "roberta-base-random", 0, False, tokenizer="FacebookAI/roberta-base",
                                     **_TC),
    "distilbert": ModelSpec("distilbert", "distilbert/distilbert-base-uncased", 0, True,
                            random_twin="distilbert-random", tokenizer="distilbert/distilbert-base-uncased", **_TC),
    "distilbert-random": ModelSpec("distilbert", "distilbert-random", 0, False,
                                   tokenizer="distilbert/distilbert-base-uncased", **_TC),
}


# Target presets, as full-match regexes over module paths (so timm's patch-embedding conv, also
# named "proj", is never adapted). timm fuses q, k and v into one Linear, "qkv": its "qv" preset
# adapts that fused projection.
TARGETS: dict[tuple[str, str], str] = {
    ("transformers", "qv"): r".*layers\.\d+\.attention\.(q_proj|v_proj)",
    ("transformers", "all"): r".*layers\.\d+\.(attention\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(fc1|fc2))",
    ("timm", "qv"): r".*blocks\.\d+\.attn\.qkv",
    ("timm", "all"): r".*blocks\.\d+\.(attn\.(qkv|proj)|mlp\.(fc1|fc2))",
    # GPT-2 fuses query, key and value into one Conv1D, c_attn: its "qv" adapts all three (TEXT.md)
    ("gpt2", "qv"): r".*h\.\d+\.attn\.c_attn",
    ("gpt2", "all"): r".*h\.\d+\.(attn\.(c_attn|c_proj)|mlp\.(c_fc|c_proj))",
    ("llama", "qv"): r".*layers\.\d+\.self_attn\.(q_proj|v_proj)",
    ("llama", "all"): r".*layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj))",
    ("bert", "qv"): r".*layer\.\d+\.attention\.self\.(query|value)",
    ("bert", "all"): r".*layer\.\d+\.(attention\.(self\.(query|key|value)|output\.dense)|intermediate\.dense|"
                     r"output\.dense)",
    ("distilbert", "qv"): r".*layer\.\d+\.attention\.(q_lin|v_lin)",
    ("distilbert", "all"): r".*layer\.\d+\.(attention\.(q_lin|k_lin|v_lin|out_lin)|ffn\.(lin1|lin2))",
}
TARGETS["roberta", "qv"], TARGETS["roberta", "all"] = TARGETS["bert", "qv"], TARGETS["bert", "all"]  # BERT's blocks


HUB_MODEL_PREFIX = "hf:"  # model = "hf:<hub id or local folder>": any checkpoint of a family LoRA targets here
# transformers' model_type -> fedlora's family (LLaMA's module names are Mistral's, Qwen's and Gemma's too)
HUB_FAMILIES = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
                "gemma": "llama", "gemma2": "llama", "bert": "bert", "roberta": "roberta", "distilbert": "distilbert"}


def model_spec(name: str) -> ModelSpec:
    if name.startswith(HUB_MODEL_PREFIX):
        return _hub_spec(name)
    if name not in MODELS:
        raise ValueError(f"Unknown model '{name}'; choose one of: {', '.join(MODELS)}, or hf:<hub id or folder>.")
    return MODELS[name]


def is_local(source: str) -> bool:
    """A checkpoint in a folder (save_pretrained's), read without the hub."""
    return Path(source).expanduser().is_dir()


@lru_cache(maxsize=8)
def _hub_spec(name: str) -> ModelSpec:
    """What "hf:<id>" stands for, read off its config (the hub's, the HF cache's, or a folder's): its family by
    model_type, its task by family (a causal LM or a sequence classifier), its own tokenizer."""
    source = name.removeprefix(HUB_MODEL_PREFIX)
    if not source:
        raise ValueError("model = \"hf:\" names no checkpoint: give hf:<hub id> or hf:<folder>.")
    model_type = hub_architecture(name).get("model_type", "")
    if model_type not in HUB_FAMILIES:
        raise ValueError(f"{name} is a '{model_type}' model; fedlora adapts {', '.join(sorted(HUB_FAMILIES))}.")
    family = HUB_FAMILIES[model_type]
    source = str(Path(source).expanduser().resolve()) if is_local(source) else source
    return ModelSpec(family, source, 0, True, task=TEXT_CLASSIFICATION if family in SEQUENCE_CLASSIFIERS else CAUSAL_LM,
                     tokenizer=source)


@lru_cache(maxsize=8)
def hub_architecture(name: str) -> dict:
    """The config of "hf:<id>" as a dict (ValueError, one sentence, where it cannot be read)."""
    from transformers import AutoConfig

    source = name.removeprefix(HUB_MODEL_PREFIX)
    if not is_local(source) and not offline_requested() and (reason := unreachable_reason()):
        raise ModelUnavailableError(f"{name}: the Hugging Face hub cannot be reached ({reason}); offline, give a "
                                    "folder saved by save_pretrained as hf:<folder>, set HF_HUB_OFFLINE=1 for the HF "
                                    "cache, or use model = \"gpt2-tiny-public\" or \"bert-tiny\".")
    try:
        return AutoConfig.from_pretrained(source).to_dict()
    except (OSError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelUnavailableError(f"{name}: its config could not be read ({first}).") from None


def architecture(model: str) -> dict:
    """The model's architecture settings (its own, its random twin's, or the checkpoint's config); {} for a named
    hub model without overrides (transformers' defaults are its own)."""
    if model.startswith(HUB_MODEL_PREFIX):
        return dict(hub_architecture(model))  # a copy: the cache's stays as read
    spec = model_spec(model)
    return dict(model_spec(spec.random_twin).overrides if spec.random_twin else spec.overrides)


def build_backbone(name: str, *, num_classes: int, seed: int = 0) -> nn.Module:
    """The classifier backbone for a model name, with a fresh ``num_classes``-way head.

    Random weights (the head, and the whole model for random-init presets) are drawn from
    ``seed`` so that every client builds the very same model.
    """
    spec = model_spec(name)
    if num_classes < 2 and spec.task != CAUSAL_LM:
        raise ValueError(f"A classifier needs at least 2 classes, got {num_classes}.")
    if torch.get_default_device().type == "meta" and name.startswith(HUB_MODEL_PREFIX):
        return _from_config(spec, num_classes)  # shapes only: the checkpoint's architecture, no weights
    if spec.pretrained and not is_local(spec.source) and not offline_requested() and (reason := unreachable_reason()):
        raise _unavailable(spec, f"{reason}; set HF_HUB_OFFLINE=1 to use weights already in your HF cache")
    if spec.packaged:
        backbone = build_backbone(spec.random_twin, num_classes=num_classes, seed=seed)
        if next(backbone.parameters()).device.type != "meta":  # shapes only: no weights to load
            _load_packaged(backbone, PACKAGED_WEIGHTS[name])
        return backbone
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if spec.task == CAUSAL_LM:
            return _causal_lm(spec)
        if spec.task == TEXT_CLASSIFICATION:
            return _sequence_classifier(spec, num_classes)
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
    offline = {CAUSAL_LM: "model = \"gpt2-tiny-public\" (pretrained offline, packaged)",
               TEXT_CLASSIFICATION: "model = \"bert-tiny\" (random init)"}.get(
        spec.task, "model = \"vit-tiny\" (random init, 32 px)")
    twin = f" or its random twin '{spec.random_twin}'" if spec.random_twin else ""
    return ModelUnavailableError(
        f"Pretrained weights '{spec.source}' could not be loaded from the Hugging Face hub ({reason}); "
        f"offline, use {offline}{twin}.")


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


def _causal_lm(spec: ModelSpec) -> nn.Module:
    """A transformers causal LM without dropout: local training must be deterministic given its batches (clients
    trained together equal clients trained alone), and DP training gains nothing from it."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if spec.pretrained:
        try:
            model = AutoModelForCausalLM.from_pretrained(spec.source, attn_implementation="sdpa")
        except (OSError, ValueError) as error:
            raise _unavailable(spec, error) from None
    elif spec.family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(**dict(spec.overrides), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                           bos_token_id=0, eos_token_id=0, attn_implementation="sdpa"))
    else:
        model = LlamaForCausalLM(LlamaConfig(**dict(spec.overrides), bos_token_id=0, eos_token_id=0,
                                             attn_implementation="sdpa"))
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def _from_config(spec: ModelSpec, num_classes: int) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(spec.source)
    if spec.task == CAUSAL_LM:
        return AutoModelForCausalLM.from_config(config)
    config.num_labels = num_classes
    return AutoModelForSequenceClassification.from_config(config)


def _sequence_classifier(spec: ModelSpec, num_classes: int) -> nn.Module:
    """A transformers sequence classifier with a ``num_classes``-way head (fresh, unless a checkpoint has one of that
    size: a fine-tuned classifier goes on from its own), without dropout (as ``_causal_lm``)."""
    import transformers

    kinds = {"bert": "Bert", "roberta": "Roberta", "distilbert": "DistilBert"}[spec.family]
    if spec.pretrained:
        try:  # a checkpoint's own head of another size is replaced by a fresh one (seeded above)
            model = transformers.AutoModelForSequenceClassification.from_pretrained(
                spec.source, num_labels=num_classes, attn_implementation="sdpa", ignore_mismatched_sizes=True)
        except (OSError, ValueError, RuntimeError) as error:
            raise _unavailable(spec, error) from None
    else:
        # the packaged tokenizer pads with its end-of-text, id 0; a hub tokenizer's ids are its family's defaults
        padding = {"pad_token_id": 0} if spec.tokenizer in PACKAGED_TOKENIZERS else {}
        config = getattr(transformers, f"{kinds}Config")(**dict(spec.overrides), num_labels=num_classes,
                                                       attn_implementation="sdpa", **padding)
        model = getattr(transformers, f"{kinds}ForSequenceClassification")(config)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def linear_sides(module: nn.Module) -> tuple[int, int] | None:
    """(out_features m, in_features k) of a linear layer LoRA can adapt: ``nn.Linear``, or GPT-2's ``Conv1D``, whose
    weight is stored transposed (k x m); None for any other module."""
    if isinstance(module, nn.Linear):
        return module.out_features, module.in_features
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers.pytorch_utils.Conv1D
        return module.weight.shape[1], module.weight.shape[0]
    return None


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
    return OrderedDict((name, linear_sides(module)) for name, module in backbone.named_modules()
                       if linear_sides(module) and re.fullmatch(TARGETS[spec.family, targets], name))
