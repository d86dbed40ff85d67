"""What a client does to its message before it leaves: clip, sketch, clip again, add noise.

A message is an ordered mapping ``name -> tensor`` holding everything a client sends in one
round (all LoRA factors, and the classifier head when it is trained). Names say how an entry is
sketched (see ``fedlora.sketch.side_of``). Clipping is always on the Frobenius norm of the
WHOLE message, all entries together (docs/explanation/sketched-mechanisms.md).

One ``Mechanism`` class covers GM, SGMM, SGMV and the non-private baselines: they differ only in
the sketch they compose with and in their noise. As in pfl-research, a mechanism is two steps:
``constrain`` (clip, sketch, clip again: bounds what one client can change, always on the client)
and ``add_noise``, done by each client to its own message or by the server to the sum of the
round's messages, as its ``placement`` says. Noise at the client and at the server release the same Gaussian
mechanism to whoever sees the aggregate without knowing who took part (same z, same amplified epsilon); they differ
in what the server sees: with noise at the client each noisy message and whose it is (so against the
server the epsilon is the known-sample one, without amplification), with noise at the server every
message before the noise (no guarantee against it). Under secure aggregation (``NoisePlacement.SECAGG``)
each client adds a share of integer Skellam noise that the server sees only summed (fedlora.secure_sum).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch
from torch import Tensor

from fedlora.privacy.events import GaussianRelease, NonPrivateRelease, Release, SketchedRelease, trust_label
from fedlora.sketch import MatrixSketch, NoSketch, Side, Sketch, SketchKey, VectorSketch, side_of

Message = dict[str, Tensor]


class ThreatModel(str, Enum):
    """Who may know the sketch (docs/explanation/threat-models.md)."""

    KNOWN_SKETCH = "known-sketch"  # default and sound: the adversary knows R
    SECRET_SKETCH = "secret-sketch"  # the paper's assumption: R hidden from every observer


class NoisePlacement(str, Enum):
    """Where the noise is added (docs/explanation/threat-models.md): it decides who the epsilon holds against."""

    CLIENT = "client"  # the paper: every client noises its own message; against the server, who knows whose, unamplified
    SERVER = "server"  # central DP: the server noises the sum; it holds against all who see the model, not the server
    SECAGG = "secagg"  # clients add shares of the noise to integers the server only sees summed (SecAgg+); against
    # the server, who knows who was summed, unamplified


def message_norm(message: Mapping[str, Tensor]) -> float:
    """Frobenius norm of the whole message (all entries concatenated), in float64."""
    # square_ on a float64 copy: the same values as pow(2) on a cast, a third of the time (one array fewer)
    return float(torch.sqrt(sum(t.detach().to(torch.float64, copy=True).square_().sum() for t in message.values())))


# Clipping scales to (1 - CLIP_MARGIN) * clip_norm, a margin for the float rounding of what follows the clip.
CLIP_MARGIN = 1e-6
# Clip norms and noise standard deviations a float32 message carries at full precision: below, entries fall among
# float32's subnormals, whose rounding can lift a clipped message's norm far above the clip (1.9x at 7e-44), and
# noise drawn in float32 loses its shape; above, squares and noise overflow.
FLOAT_RANGE = (1e-30, 1e30)


def check_carried(clip_norm: float, noise_multiplier: float = 0.0) -> None:
    """Refuses a clip norm, or a noise standard deviation (noise multiplier times clip norm), outside FLOAT_RANGE:
    whatever a server sends, the sensitivity the accountant assumes must survive the arithmetic."""
    low, high = FLOAT_RANGE
    if not low <= clip_norm <= high:
        raise ValueError(f"Clip norm must lie in [{low:g}, {high:g}], where a float32 message carries it, got "
                         f"{clip_norm:g}.")
    if noise_multiplier > 0 and not low <= noise_multiplier * clip_norm <= high:
        raise ValueError(f"The noise's standard deviation (noise multiplier {noise_multiplier:g} times clip norm "
                         f"{clip_norm:g}) must lie in [{low:g}, {high:g}], where float32 carries it.")


def toward_zero(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` cast to ``dtype`` rounding toward zero: no entry grows, so neither does any norm (round-to-nearest can
    lift a clipped message above its clip, where entries are subnormal)."""
    out = t.to(dtype)
    if out.dtype == t.dtype:
        return out
    grew = out.to(t.dtype).abs() > t.abs()
    return torch.where(grew, torch.nextafter(out, torch.zeros_like(out)), out)


def out_dtypes(message: Mapping[str, Tensor]) -> dict[str, torch.dtype]:
    """The dtype each entry of a message is sent in: its own, at least float32."""
    return {name: torch.promote_types(t.dtype, torch.float32) for name, t in message.items()}


def clip_message(message: Mapping[str, Tensor], clip_norm: float, *, exact: bool = False) -> Message:
    """Scales the whole message by min(1, clip_norm / ||message||_F) in float64, then casts it back (at least
    float32) rounding toward zero, so that its norm stays <= clip_norm. ``exact``: keep float64, for noise to be
    added before any rounding.

    A message that is not finite is refused: min(1, clip / NaN) would let it through unclipped.
    """
    if not clip_norm > 0:
        raise ValueError(f"Clip norm must be positive, got {clip_norm}.")
    norm = message_norm(message)
    if not math.isfinite(norm):
        raise ValueError("The message holds NaN or infinite values; it cannot be clipped or sent.")
    scale = 1.0 if norm <= clip_norm else (1 - CLIP_MARGIN) * clip_norm / norm
    scaled = {name: t.double() * scale for name, t in message.items()}
    if exact:
        return scaled
    dtypes = out_dtypes(message)
    return {name: toward_zero(t, dtypes[name]) for name, t in scaled.items()}


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
    placement: NoisePlacement = NoisePlacement.CLIENT

    def __post_init__(self) -> None:
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"Clip norm must be positive, got {self.clip_norm}.")
        if not self.noise_multiplier >= 0:
            raise ValueError(f"Noise multiplier must be non-negative, got {self.noise_multiplier}.")
        if self.noise_multiplier > 0 and self.clip_norm is None:
            raise ValueError("Noise without a clip norm bounds nothing: set clip_norm for a noisy mechanism.")
        if self.clip_norm is not None:
            check_carried(self.clip_norm, self.noise_multiplier)
        object.__setattr__(self, "threat_model", ThreatModel(self.threat_model))
        object.__setattr__(self, "placement", NoisePlacement(self.placement))
        if self.placement is not NoisePlacement.CLIENT and not isinstance(self.sketch, NoSketch) \
                and self.threat_model is ThreatModel.SECRET_SKETCH:
            raise ValueError(f"Noise placement '{self.placement.value}' needs the known-sketch threat model: the "
                             "secret-sketch bound is derived for noise on every client's message.")

    def with_clip_norm(self, clip_norm: float) -> Mechanism:
        """The same mechanism at another clip norm (adaptive clipping); the noise multiplier stays."""
        return dataclasses.replace(self, clip_norm=clip_norm)

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

    @property
    def trust_model(self) -> str:
        """The threat model and where the noise is added, as every epsilon of this mechanism is labelled."""
        return trust_label(self.threat_model.value, self.placement.value) if self.private else "no noise: not private"

    def constrain(self, message: Mapping[str, Tensor], *, key: SketchKey, exact: bool = False) -> Message:
        """What bounds one client's influence: clip the whole message, sketch it, clip again under known-sketch.
        ``exact``: the clip that bounds the sensitivity (the last), and what follows it, stay in float64."""
        last = self.clips_after_sketch
        out = (clip_message(message, self.clip_norm, exact=exact and not last) if self.clip_norm is not None
               else dict(message))
        out = {name: self.sketch.sketch(t, key=key, name=name) for name, t in out.items()}
        if last:
            out = clip_message(out, self.clip_norm, exact=exact)
        return out

    def add_noise(self, message: Mapping[str, Tensor], noise: torch.Generator | None, *, scale: float = 1.0) -> Message:
        """N(0, (scale * sigma)^2) on every entry; ``scale`` is the sensitivity of what is noised in clip norms."""
        if not self.private:
            return dict(message)
        return {name: t + gaussian_noise_like(t, scale * self.noise_std, noise) for name, t in message.items()}

    def privatize(self, message: Mapping[str, Tensor], *, key: SketchKey,
                  noise: torch.Generator | None = None) -> Message:
        """The client's release: constrained, and noised when the noise is added at the client (under secure
        aggregation the noise comes with the integer encoding, ``fedlora.secure_sum``). ``noise`` defaults to the
        OS's secure randomness; seed it only in simulation."""
        if self.placement is not NoisePlacement.CLIENT or not self.private:
            return self.constrain(message, key=key)
        # the noise goes on the float64 clipped message, before it is rounded: no rounding can lift its sensitivity
        dtypes = out_dtypes(message)
        noised = self.add_noise(self.constrain(message, key=key, exact=True), noise)
        return {name: t.to(dtypes[name]) for name, t in noised.items()}

    def noise_sum(self, total: Mapping[str, Tensor], noise: torch.Generator | None, *, scale: float = 1.0) -> Message:
        """The server's step on the sum of a round's releases: the noise, when it is added at the server."""
        return self.add_noise(total, noise, scale=scale) if self.placement is NoisePlacement.SERVER else dict(total)

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
        if self.placement is not NoisePlacement.CLIENT:  # the client's release carries no noise
            return self.clip_norm * gain
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
        return (f"{self.sketch!r}, {clip}, noise multiplier {self.noise_multiplier:g}, threat model "
                f"{self.trust_model}")


def gaussian_mechanism(*, clip_norm: float, noise_multiplier: float,
                       placement: NoisePlacement | str = NoisePlacement.CLIENT) -> Mechanism:
    """GM: clip the dense message and add Gaussian noise to every entry."""
    return Mechanism(NoSketch(), clip_norm, noise_multiplier, placement=NoisePlacement(placement))


def sgmm_mechanism(*, sketch_dim: int, clip_norm: float, noise_multiplier: float,
                   threat_model: ThreatModel | str = ThreatModel.KNOWN_SKETCH,
                   placement: NoisePlacement | str = NoisePlacement.CLIENT) -> Mechanism:
    """SGMM (paper Def. 2.4): R clip(B) + Xi with Xi in R^{b x r}; A R_A + Xi for A."""
    return Mechanism(MatrixSketch(sketch_dim), clip_norm, noise_multiplier, ThreatModel(threat_model),
                     NoisePlacement(placement))


def sgmv_mechanism(*, sketch_dim: int, clip_norm: float, noise_multiplier: float,
                   threat_model: ThreatModel | str = ThreatModel.KNOWN_SKETCH,
                   placement: NoisePlacement | str = NoisePlacement.CLIENT) -> Mechanism:
    """SGMV (paper Def. 2.3): R_v vec(clip(B)) + xi with xi in R^h; ``sketch_dim`` is h (the paper uses h = b r)."""
    return Mechanism(VectorSketch(sketch_dim), clip_norm, noise_multiplier, ThreatModel(threat_model),
                     NoisePlacement(placement))
