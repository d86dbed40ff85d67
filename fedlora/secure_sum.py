"""Distributed noise for secure aggregation (noise-placement = "secagg"), free of Flower: the distributed Skellam
mechanism (Agarwal, Kairouz and Liu, NeurIPS 2021).

Secure aggregation sums integers modulo 2^k, so each client turns its constrained (clipped, sketched) release into
integers: scale by gamma, round each entry up or down at random (conditional randomized rounding: redrawn until the
rounded vector's norm is at most a bound B fixed in advance, so B bounds what one client adds whatever the draws),
add Skellam noise (a difference of two Poisson draws) of variance V / N_min per entry, reduce modulo 2^bits. A sum
of independent Skellams is a Skellam, so the sum of n >= N_min replies carries Skellam noise of variance
n V / N_min >= V with no approximation; V = (z gamma tau)^2 is the server placement's noise N(0, z^2 tau^2) in
integer units. The modular sum is a function of the exact integer sum: decoding it is post-processing.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fedlora.privacy.events import SkellamRelease

Message = dict[str, Tensor]

# Probability that one draw of the randomized rounding exceeds the norm bound and is redrawn (Kairouz, Liu and
# Steinke 2021 use e^-0.5: a looser bound B would cost privacy, a tighter one redraws)
ROUNDING_BETA = math.exp(-0.5)
HEADROOM_STDS = 10.0  # the modulus holds the largest possible signal plus 10 noise standard deviations per entry


def rounded_norm_bound(norm: float, dim: int) -> float:
    """The norm the randomized rounding of a d-entry vector of norm <= ``norm`` is conditioned on (Kairouz, Liu and
    Steinke 2021, Thm 2): rounding moves each entry by less than 1, and with probability >= 1 - ROUNDING_BETA the
    norm grows to at most this."""
    loose = norm + math.sqrt(dim)
    tight = math.sqrt(norm ** 2 + dim / 4 + math.sqrt(2 * math.log(1 / ROUNDING_BETA)) * (norm + math.sqrt(dim) / 2))
    return min(loose, tight)


def os_generator() -> np.random.Generator:
    """A generator seeded with 256 bits of the operating system's secure randomness (deployments)."""
    return np.random.default_rng(np.random.SeedSequence(int.from_bytes(os.urandom(32), "little")))


@dataclass(frozen=True)
class SkellamSecureSum:
    """How a round's releases are turned into integers for secure aggregation, and the noise each client adds.

    ``noise_multiplier`` z and ``clip_norm`` tau are the release's (the noise in the sum is z tau, as under noise at
    the server); ``clients`` N is the most replies that are summed, ``min_replies`` N_min the fewest a round is
    released with; ``dim`` the number of entries of one release.
    """

    noise_multiplier: float
    clip_norm: float
    clients: int
    min_replies: int
    dim: int
    bits: int = 30

    def __post_init__(self) -> None:
        if not self.noise_multiplier > 0:
            raise ValueError(f"Secure aggregation adds noise: the noise multiplier must be positive, got "
                             f"{self.noise_multiplier}.")
        if not 3 <= self.min_replies <= self.clients:
            raise ValueError(f"The fewest replies summed must lie in [3, {self.clients}] (clients-per-round), got "
                             f"{self.min_replies}: a sum of one reveals it, and of two Flower's 32-bit mask seeds "
                             "can be brute-forced.")
        if not 8 <= self.bits <= 30:  # Flower's SecAgg+ quantizes into int32 and masks modulo 2^32
            raise ValueError(f"The modulus must be 2^8 to 2^30, got 2^{self.bits}.")

    @property
    def half_range(self) -> int:
        """c: integers live in [-c, c), modulo 2c = 2^bits."""
        return 2 ** (self.bits - 1)

    @property
    def scale(self) -> float:
        """gamma, integer units per unit of value: the largest that keeps every entry of the sum of N rounded
        releases (each entry <= tau + 1 in size) and of its noise within [-c, c), but for 10 standard deviations."""
        noise_std = self.noise_multiplier * self.clip_norm * math.sqrt(self.clients / self.min_replies)
        return (self.half_range - self.clients) / (self.clients * self.clip_norm + HEADROOM_STDS * noise_std)

    @property
    def norm_bound(self) -> float:
        """B: the norm of one client's rounded, scaled release (its sensitivity in integer units)."""
        return rounded_norm_bound(self.scale * self.clip_norm, self.dim)

    @property
    def sum_variance(self) -> float:
        """V = (z gamma tau)^2: the least Skellam variance per entry of a released sum (N_min replies)."""
        return (self.noise_multiplier * self.scale * self.clip_norm) ** 2

    @property
    def share_variance(self) -> float:
        """What each client adds: V / N_min per entry."""
        return self.sum_variance / self.min_replies

    def release(self) -> SkellamRelease:
        """What a round releases, for the accountant: the sum of at least N_min replies through SecAgg+."""
        return SkellamRelease(self.noise_multiplier, self.norm_bound, self.sum_variance, self.dim, self.min_replies)

    def message_release(self) -> SkellamRelease:
        """What one client's reply alone would release, for a server that breaks the protocol or sums fewer replies
        than it may."""
        return self.release().one_reply()

    def encode(self, release: Mapping[str, Tensor], generator: np.random.Generator) -> dict[str, np.ndarray]:
        """One client's integers (int64 in [-c, c), by entry name): scaled, rounded, noised, reduced."""
        names = sorted(release)
        flat = np.concatenate([release[n].detach().cpu().double().numpy().ravel() for n in names])
        if flat.size != self.dim:
            raise ValueError(f"The release has {flat.size} entries, not {self.dim}.")
        if not np.isfinite(flat).all() or np.linalg.norm(flat) > self.clip_norm * (1 + 1e-6):
            raise ValueError("Only a finite release clipped to the clip norm can be encoded.")
        rounded = self._round(flat * self.scale, generator)
        lam = self.share_variance / 2  # Skellam(lam) = Poisson(lam) - Poisson(lam) has variance 2 lam
        noisy = rounded + generator.poisson(lam, flat.size) - generator.poisson(lam, flat.size)
        wrapped = np.mod(noisy + self.half_range, 2 * self.half_range) - self.half_range
        out, start = {}, 0
        for name in names:
            size = release[name].numel()
            out[name] = wrapped[start:start + size].reshape(tuple(release[name].shape))
            start += size
        return out

    def _round(self, scaled: np.ndarray, generator: np.random.Generator, max_draws: int = 1000) -> np.ndarray:
        """Conditional randomized rounding: unbiased per entry, redrawn until the norm is at most B."""
        low = np.floor(scaled)
        frac = scaled - low
        bound = self.norm_bound
        for _ in range(max_draws):
            rounded = (low + (generator.random(scaled.size) < frac)).astype(np.int64)
            if np.linalg.norm(rounded.astype(np.float64)) <= bound:
                return rounded
        raise RuntimeError(f"Randomized rounding exceeded the norm bound {max_draws} times in a row.")

    def decode(self, total: Mapping[str, np.ndarray], dtype: torch.dtype = torch.float32) -> Message:
        """The noisy sum of the releases, from any integers congruent to the sum of their encodings modulo 2c."""
        c = self.half_range
        return {name: torch.from_numpy((np.mod(np.asarray(t, dtype=np.int64) + c, 2 * c) - c) / self.scale).to(dtype)
                for name, t in total.items()}
