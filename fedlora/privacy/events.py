"""What one client's message releases per round, described for the accountant (no math here).

A mechanism describes its release with these immutable parts (``Mechanism.release``), so a new
mechanism cannot forget its privacy cost. Noise multipliers are relative to the clip norm tau.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Sampling(str, Enum):
    FIXED = "fixed"  # exactly N of C clients without replacement (the paper); replace-one neighbours
    POISSON = "poisson"  # each client independently with rate q; add/remove-one neighbours


def trust_label(threat_model: str, placement: str) -> str:
    """How every epsilon is labelled: who may know the sketch, and where the noise is added."""
    if placement == "secagg":
        return f"{threat_model}, noise in client shares under secure aggregation"
    return f"{threat_model}, noise at the {placement}"


@dataclass(frozen=True)
class GaussianRelease:
    """A Gaussian mechanism on the whole clipped message (GM, or a sketch whose R the adversary knows)."""

    noise_multiplier: float


@dataclass(frozen=True)
class SketchedRelease:
    """SGMM (or SGMV with rank 1 and sketch_dim h) with a secret sketch shared by the round's clients."""

    noise_multiplier: float
    sketch_dim: int
    rank: int
    clients_per_round: int


@dataclass(frozen=True)
class SkellamRelease:
    """Secure aggregation's distributed Skellam mechanism (fedlora.secure_sum): one client adds integers of norm
    <= ``norm_bound`` (d = ``dim`` entries) to a sum that carries Skellam noise of variance >= ``variance`` per
    entry. ``noise_multiplier`` is the Gaussian z it stands in for (the same noise at the server)."""

    noise_multiplier: float
    norm_bound: float
    variance: float
    dim: int


@dataclass(frozen=True)
class NonPrivateRelease:
    """No noise: epsilon is infinite, whatever the sketch (../shared/papers/001, Prop. 2)."""


Release = GaussianRelease | SketchedRelease | SkellamRelease | NonPrivateRelease


@dataclass(frozen=True)
class SamplingScheme:
    """How the clients of a round are chosen; the accountant must match the sampler the strategy used."""

    kind: Sampling
    num_clients: int
    clients_per_round: int | None = None  # fixed
    rate: float | None = None  # poisson

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Sampling(self.kind))
        if self.num_clients < 1:
            raise ValueError(f"Number of clients must be at least 1, got {self.num_clients}.")
        if self.kind is Sampling.FIXED:
            n = self.clients_per_round
            if n is None or not 1 <= n <= self.num_clients:
                raise ValueError(f"Clients per round must lie in [1, {self.num_clients}] (the number of clients), "
                                 f"got {n}.")
        elif self.rate is None or not 0 < self.rate <= 1:
            raise ValueError(f"Sampling rate must lie in (0, 1], got {self.rate}.")

    @property
    def q(self) -> float:
        """Probability that a given client takes part in a round."""
        return self.clients_per_round / self.num_clients if self.kind is Sampling.FIXED else self.rate



@dataclass(frozen=True)
class Phase:
    """``rounds`` rounds with the same per-client release and sampling (e.g. a linear probe, then LoRA)."""

    name: str
    release: tuple[Release, ...]
    sampling: SamplingScheme
    rounds: int

    def __post_init__(self) -> None:
        if self.rounds < 0:
            raise ValueError(f"Rounds must be non-negative, got {self.rounds}.")
        if not self.release:
            raise ValueError("A phase must release something.")
