"""What a client does to its message before it leaves: clip, sketch, clip again, add noise.

A message is an ordered mapping ``name -> tensor`` holding everything a client sends in one
round (all LoRA factors, and the classifier head when it is trained). Names say how an entry is
sketched (see ``fedlora.sketch.side_of``). Clipping is always on the Frobenius norm of the
WHOLE message, all entries together (../shared/design/PRIVACY.md, section 1).

One ``Mechanism`` class covers GM, SGMM, SGMV and the non-private baselines: they differ only in
the sketch they compose with and in their noise.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch
from torch import Tensor

from fedlora.privacy.events import GaussianRelease, NonPrivateRelease, Release, SketchedRelease
from fedlora.sketch import MatrixSketch, NoSketch, Side, Sketch, SketchKey, VectorSketch, side_of

Message = dict[str, Tensor]


class ThreatModel(str, Enum):
    """Who may know the sketch (../shared/design/PRIVACY.md, section 3)."""

    KNOWN_SKETCH = "known-sketch"  # default and sound: the adversary knows R
    SECRET_SKETCH = "secret-sketch"  # the paper's assumption: R hidden from every observer


def message_norm(message: Mapping[str, Tensor]) -> float:
    """Frobenius norm of the whole message (all entries concatenated), in float64."""
    return float(torch.sqrt(sum(t.detach().double().pow(2).sum() for t in message.values())))


# Clipping scales to (1 - CLIP_MARGIN) * clip_norm, so that float32 rounding never lifts a norm above it.
CLIP_MARGIN = 1e-6


def clip_message(message: Mapping[str, Tensor], clip_norm: float) -> Message:
    """Scales the whole message by min(1, clip_norm / ||message||_F), in float64, at least float32 out.

    A message that is not finite is refused: min(1, clip / NaN) would let it through unclipped.
    """
    if not clip_norm > 0:
        raise ValueError(f"Clip norm must be positive, got {clip_norm}.")
    norm = message_norm(message)
    if not math.isfinite(norm):
        raise ValueError("The message holds NaN or infinite values; it cannot be clipped or sent.")
    scale = 1.0 if norm <= clip_norm else (1 - CLIP_MARGIN) * clip_norm / norm
    return {name: (t.double() * scale).to(torch.promote_types(t.dtype, torch.float32)) for name, t in message.items()}


def os_gaussian_like(t: Tensor, std: float) -> Tensor:
    """N(0, std^2) entries shaped like t, every bit from the operating system's secure randomness (Box-Muller
    on 53-bit uniforms from os.urandom), so nothing the server knows or sees can predict the noise."""
    n = t.numel()
    pairs = (n + 1) // 2
    words = np.frombuffer(os.urandom(16 * pairs), dtype=np.uint64).reshape(2, pairs)
    u1, u2 = ((words >> np.uint64(11)).astype(np.float64) * 2.0 ** -53)  # uniform on [0, 1)
    radius = np.sqrt(-2.0 * np.log1p(-u1))  # 1 - u1 lies in (0, 1]: the log is finite
    z = np.concatenate([radius * np.cos(2 * np.pi * u2), radius * np.sin(2 * np.pi * u2)])[:n]
    return torch.from_numpy(z.reshape(t.shape) * std).to(device=t.device, dtype=t.dtype)


def gaussian_noise_like(t: Tensor, std: float, generator: torch.Generator | None) -> Tensor:
    """N(0, std^2) entries shaped like t: from a seeded generator (reproducible simulations), or, with None,
    from the OS's secure randomness (deployments)."""
    if generator is None:
        return os_gaussian_like(t, std)
    noise = torch.randn(t.shape, generator=generator, device=generator.device, dtype=torch.float32)
    return noise.to(device=t.device, dtype=t.dtype) * std


@dataclass(frozen=True)
class Mechanism:
    """Clip the whole message at ``clip_norm``, sketch it, add N(0, (noise_multiplier * clip_norm)^2).

    Under the known-sketch threat model the sketched message is clipped again at ``clip_norm``
    before the noise: given R, the sensitivity of R X is ||R (X - X')||, which can exceed the
    clip norm by a factor of about 1 + sqrt(m / b); post-sketch clipping restores it.
    ``clip_norm=None`` means no clipping (non-private baselines); zero noise is allowed and the
    mechanism then reports itself as not private.
    """

    sketch: Sketch = NoSketch()
    clip_norm: float | None = None
    noise_multiplier: float = 0.0
    threat_model: ThreatModel = ThreatModel.KNOWN_SKETCH

    def __post_init__(self) -> None:
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"Clip norm must be positive, got {self.clip_norm}.")
        if not self.noise_multiplier >= 0:
            raise ValueError(f"Noise multiplier must be non-negative, got {self.noise_multiplier}.")
        if self.noise_multiplier > 0 and self.clip_norm is None:
            raise ValueError("Noise without a clip norm bounds nothing: set clip_norm for a noisy mechanism.")
        object.__setattr__(self, "threat_model", ThreatModel(self.threat_model))

    @property
    def private(self) -> bool:
        """Whether the release carries a differential-privacy guarantee at all."""
        return self.noise_multiplier > 0

    @property
    def noise_std(self) -> float:
        """sigma, the standard deviation of each noise entry."""
        return self.noise_multiplier * self.clip_norm if self.private else 0.0

    @property
    def clips_after_sketch(self) -> bool:
        return (self.clip_norm is not None and not isinstance(self.sketch, NoSketch)
                and self.threat_model is ThreatModel.KNOWN_SKETCH)

    def privatize(self, message: Mapping[str, Tensor], *, key: SketchKey,
                  noise: torch.Generator | None = None) -> Message:
        """The client's release. ``noise`` defaults to the OS's secure randomness; seed it only in simulation."""
        out = clip_message(message, self.clip_norm) if self.clip_norm is not None else dict(message)
        out = {name: self.sketch.sketch(t, key=key, name=name) for name, t in out.items()}
        if self.clips_after_sketch:
            out = clip_message(out, self.clip_norm)
        if self.private:
            out = {name: t + gaussian_noise_like(t, self.noise_std, noise) for name, t in out.items()}
        return out

    def released_shapes(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The shape of every entry of the release of a message with these entry shapes."""
        return {name: self.sketch.released_shape(name, shape) for name, shape in shapes.items()}

    def norm_allowance(self, shapes: Mapping[str, tuple[int, ...]], *, failure_probability: float = 1e-9) -> float:
        """The largest norm an honest client's release of a message with these entry shapes has, except with
        probability ``failure_probability``: the clip norm times how much the sketch can grow it, plus a
        chi-square tail bound on the noise (Laurent and Massart 2000). Infinite without clipping."""
        if self.clip_norm is None:
            return math.inf
        x = math.log(4 / failure_probability)  # the sketch may fail with p / 2, the noise with p / 4
        gain = 1.0 if self.clips_after_sketch else self.sketch.gain_bound(shapes, x)
        d = sum(math.prod(shape) for shape in self.released_shapes(shapes).values())
        return self.clip_norm * gain + self.noise_std * math.sqrt(d + 2 * math.sqrt(d * x) + 2 * x)

    def desketch(self, message: Mapping[str, Tensor], *, key: SketchKey,
                 shapes: Mapping[str, torch.Size | tuple[int, ...]]) -> Message:
        """Maps an (aggregated) release back to full space: R^T S for B, S R_A^T for A."""
        missing = set(message) - set(shapes)
        if missing:
            raise ValueError(f"No target shape for message entries {sorted(missing)}.")
        return {name: self.sketch.desketch(t, key=key, name=name, shape=shapes[name]) for name, t in message.items()}

    def release_of(self, message: Mapping[str, Tensor], *, clients_per_round: int) -> tuple[Release, ...]:
        """The release of ``message`` (its rank and whether it carries dense entries come from the message)."""
        sketched = [t for name, t in message.items() if side_of(name) is not Side.DENSE]
        ranks = {t.shape[1] if side_of(name) is Side.LEFT else t.shape[0]
                 for name, t in message.items() if side_of(name) is not Side.DENSE}
        dense = len(sketched) < len(message)
        return self.release(rank=max(ranks, default=1), clients_per_round=clients_per_round, dense=dense)

    def release(self, *, rank: int, clients_per_round: int, dense: bool) -> tuple[Release, ...]:
        """What one round of this mechanism releases, for the accountant.

        ``rank`` is the LoRA rank r of the sketched factors, ``clients_per_round`` the N clients that
        share a round's sketch, ``dense`` whether the message also carries unsketched entries (a head).
        """
        if not self.private:
            return (NonPrivateRelease(),)
        if isinstance(self.sketch, NoSketch) or self.threat_model is ThreatModel.KNOWN_SKETCH:
            # Whoever knows R sees a Gaussian mechanism: on X (GM) or on the post-clipped R X.
            return (GaussianRelease(self.noise_multiplier),)
        vectorized = isinstance(self.sketch, VectorSketch)  # SGMV: (b, r) -> (h, 1)
        sketched = SketchedRelease(self.noise_multiplier, self.sketch.dim, 1 if vectorized else rank, clients_per_round)
        return (sketched, GaussianRelease(self.noise_multiplier)) if dense else (sketched,)

    def describe(self) -> str:
        """One line naming the sketch, clip, noise and threat model; says NOT private when it is not."""
        clip = f"clip {self.clip_norm:g}" if self.clip_norm is not None else "no clipping"
        if not self.private:
            return f"{self.sketch!r}, {clip}, no noise: NOT private (epsilon = inf)"
        return f"{self.sketch!r}, {clip}, noise multiplier {self.noise_multiplier:g}, threat model {self.threat_model.value}"


def gaussian_mechanism(*, clip_norm: float, noise_multiplier: float) -> Mechanism:
    """GM: clip the dense message and add Gaussian noise to every entry."""
    return Mechanism(NoSketch(), clip_norm, noise_multiplier)


def sgmm_mechanism(*, sketch_dim: int, clip_norm: float, noise_multiplier: float,
                   threat_model: ThreatModel | str = ThreatModel.KNOWN_SKETCH) -> Mechanism:
    """SGMM (paper Def. 2.4): R clip(B) + Xi with Xi in R^{b x r}; A R_A + Xi for A."""
    return Mechanism(MatrixSketch(sketch_dim), clip_norm, noise_multiplier, ThreatModel(threat_model))


def sgmv_mechanism(*, sketch_dim: int, clip_norm: float, noise_multiplier: float,
                   threat_model: ThreatModel | str = ThreatModel.KNOWN_SKETCH) -> Mechanism:
    """SGMV (paper Def. 2.3): R_v vec(clip(B)) + xi with xi in R^h; ``sketch_dim`` is h (the paper uses h = b r)."""
    return Mechanism(VectorSketch(sketch_dim), clip_norm, noise_multiplier, ThreatModel(threat_model))
