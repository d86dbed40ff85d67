"""The seven named strategies: an aggregation family (FFA or Flex) times a mechanism, not seven copies."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from fedlora.mechanisms import (Mechanism, NoisePlacement, ThreatModel, gaussian_mechanism, sgmm_mechanism,
                                sgmv_mechanism)


class LoRAMode(str, Enum):
    FFA = "ffa"  # A frozen at its seeded N(0, 1/r) init, only B trained (FFA-LoRA)
    FLEX = "flex"  # A and B trained (FlexLoRA)


@dataclass(frozen=True)
class Algorithm:
    name: str
    family: LoRAMode  # FFA: mean of (sketched) B; Flex: mean of B A products, then top-r SVD
    mechanism: str  # "none", "gaussian", "sgmm" or "sgmv"

    @property
    def private(self) -> bool:
        return self.mechanism != "none"

    @property
    def sketched(self) -> bool:
        return self.mechanism in ("sgmm", "sgmv")


ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("sgmm-ffa-lora", LoRAMode.FFA, "sgmm"),
    Algorithm("sgmv-ffa-lora", LoRAMode.FFA, "sgmv"),
    Algorithm("sgmm-flexlora", LoRAMode.FLEX, "sgmm"),
    Algorithm("gm-ffa-lora", LoRAMode.FFA, "gaussian"),
    Algorithm("gm-flexlora", LoRAMode.FLEX, "gaussian"),
    Algorithm("ffa-lora", LoRAMode.FFA, "none"),
    Algorithm("flexlora", LoRAMode.FLEX, "none"),
)}
PRIVATE_ALGORITHMS = tuple(name for name, a in ALGORITHMS.items() if a.private)


def get_algorithm(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise ValueError(f"Unknown strategy '{name}'; choose one of: {', '.join(ALGORITHMS)}.")
    return ALGORITHMS[name]


def check_layer_sizes(algorithm: Algorithm, shapes, *, rank: int, sketch_dim: int) -> None:
    """Rank and sketch dimension against the adapted layers' (m, k) shapes; one sentence on failure.

    SGMM sketches B (m x r) from the left and FlexLoRA's A (r x k) from the right; SGMV sketches vec(B).
    """
    shapes = list(shapes)
    smallest = min(min(m, k) for m, k in shapes)
    if rank > smallest:
        raise ValueError(f"Rank {rank} exceeds the smallest side ({smallest}) of an adapted layer.")
    if algorithm.sketched:
        limit = min(m * rank if algorithm.mechanism == "sgmv" else min(m, k) if algorithm.family is LoRAMode.FLEX
                    else m for m, k in shapes)
        if not 1 <= sketch_dim <= limit:
            raise ValueError(f"Sketch dimension {sketch_dim} must lie in [1, {limit}] for {algorithm.name}.")


def make_mechanism(algorithm: Algorithm, *, clip_norm: float | None, noise_multiplier: float,
                   sketch_dim: int | None = None, threat_model: ThreatModel | str = ThreatModel.KNOWN_SKETCH,
                   placement: NoisePlacement | str = NoisePlacement.CLIENT) -> Mechanism:
    """The mechanism of a strategy. ``sketch_dim`` is b for SGMM and h for SGMV."""
    if algorithm.mechanism == "none":
        return Mechanism(clip_norm=clip_norm)
    if clip_norm is None:
        raise ValueError(f"Strategy '{algorithm.name}' is private and needs a clip norm.")
    if algorithm.mechanism == "gaussian":
        return gaussian_mechanism(clip_norm=clip_norm, noise_multiplier=noise_multiplier, placement=placement)
    if sketch_dim is None:
        raise ValueError(f"Strategy '{algorithm.name}' needs a sketch dimension.")
    make = sgmm_mechanism if algorithm.mechanism == "sgmm" else sgmv_mechanism
    return make(sketch_dim=sketch_dim, clip_norm=clip_norm, noise_multiplier=noise_multiplier,
                threat_model=threat_model, placement=placement)
