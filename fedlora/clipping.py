"""Private adaptive clipping (Andrew, Thakkar, McMahan and Ramaswamy, NeurIPS 2021): the clip norm tracks a
quantile of the clients' message norms, learned from a noisy count, never from the raw norms.

Each sampled client also releases one bit, [its message norm <= the round's clip norm]. The count of
those bits gets N(0, sigma_b^2) noise (each client's own, or the server's on the sum: the mechanism's
placement), and the clip norm moves geometrically: C <- C exp(-eta (noisy fraction - target quantile)).
The bit is a Gaussian release of its own: centred (b - 1/2), its replace-one sensitivity is 1, so it is a
``GaussianRelease`` of multiplier 2 sigma_b in the clip-norm units the accountant uses (sensitivity 2 tau,
noise z tau). It composes with the update's release, and the update's noise is raised so that the pair
spends the target (for Gaussians: z_update = (z^-2 - (2 sigma_b)^-2)^(-1/2), Andrew et al.'s Thm 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fedlora.mechanisms import NoisePlacement, gaussian_noise_like
from fedlora.privacy.events import GaussianRelease


@dataclass(frozen=True)
class QuantileClipping:
    target_quantile: float  # gamma: e.g. 0.5 tracks the median norm
    learning_rate: float  # eta, the geometric step
    count_stddev: float  # sigma_b, the noise on the count
    placement: NoisePlacement = NoisePlacement.CLIENT

    def __post_init__(self) -> None:
        if not 0 < self.target_quantile < 1:
            raise ValueError(f"The target quantile must lie in (0, 1), got {self.target_quantile}.")
        if not self.learning_rate > 0 or not self.count_stddev > 0:
            raise ValueError("Adaptive clipping needs a positive learning rate and count noise.")
        object.__setattr__(self, "placement", NoisePlacement(self.placement))

    def release(self) -> GaussianRelease:
        """What one client's bit releases, for the accountant."""
        return GaussianRelease(2 * self.count_stddev)

    def client_bit(self, norm: float, clip_norm: float, noise: torch.Generator | None) -> float:
        """The client's bit, [norm <= clip norm], with its own noise when the noise is added at the client."""
        bit = float(norm <= clip_norm)
        if self.placement is NoisePlacement.CLIENT:
            bit += float(gaussian_noise_like(torch.zeros(1, dtype=torch.float64), self.count_stddev, noise))
        return bit

    def bit_allowance(self, failure_probability: float = 1e-9) -> float:
        """The largest |bit - 1/2| an honest client sends, except with probability ``failure_probability``."""
        if self.placement is NoisePlacement.SERVER:
            return 0.5
        return 0.5 + self.count_stddev * math.sqrt(2 * math.log(2 / failure_probability))

    def noisy_fraction(self, bits: Sequence[float], denominator: float, noise: torch.Generator | None) -> float:
        """The fraction of clients under the clip norm, from the centred bits, their sum noised at the server when
        the noise is added there. ``denominator`` is the round's clients (the expected N under Poisson)."""
        centred = sum(b - 0.5 for b in bits)
        if self.placement is NoisePlacement.SERVER:
            centred += float(gaussian_noise_like(torch.zeros(1, dtype=torch.float64), self.count_stddev, noise))
        return centred / denominator + 0.5

    def next_clip_norm(self, clip_norm: float, fraction: float) -> float:
        return clip_norm * math.exp(-self.learning_rate * (fraction - self.target_quantile))
