"""What one client's message releases per round, described for the accountant (no math here).

A mechanism describes its release with these immutable parts (``Mechanism.release``), so a new
mechanism cannot forget its privacy cost. Noise multipliers are relative to the clip norm tau.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from enum import Enum

import numpy as np


class Sampling(str, Enum):
    FIXED = "fixed"  # exactly N of C clients without replacement (the paper); replace-one neighbours
    POISSON = "poisson"  # each client independently with rate q; add/remove-one neighbours


class Observer(str, Enum):
    """Who an epsilon holds against (docs/explanation/threat-models.md). Amplification by sampling needs the
    sample hidden from the observer; the server draws it, so against the server it does not amplify."""

    MODEL = "model"  # sees what the server releases (every round's model), not who took part
    SERVER = "server"  # draws the sample: knows the rounds each client took part in, and sees what it is sent
    ONE_REPLY = "one-reply"  # secure aggregation: a server that breaks SecAgg+ holds one reply alone, and knows whose;
    # it does not follow the protocol, so it may also sample its target every round
    CO_CLIENT = "co-client"  # a client of the same round: knows its own noise and (under SecAgg+) who else is summed


OBSERVER_LABELS = {
    Observer.MODEL: "against observers of the model (sample hidden)",
    Observer.SERVER: "against the server (sample known, drawn as the protocol says)",
    Observer.ONE_REPLY: ("against a server that breaks SecAgg+ (one reply alone, sample known, the target sampled "
                         "every round)"),
    Observer.CO_CLIENT: ("against a client of the same round (sample known, its own noise removed; no other client "
                         "colluding)"),
}
# Where every reply carries noise (at the client, or shares under SecAgg+), the model's noise is the sum of the
# replies': a client of a round with the target knows its own share, so the model's number holds against the others.
MODEL_NOT_CO_CLIENTS = ("against observers of the model who were in no round with the client (sample hidden, no "
                        "client colluding)")
R_HIDDEN = ", while R stays hidden from it"  # the secret-sketch bound, against anyone but the model's observers
# The secret-sketch bound covers the sketched releases alone: every client holds R, and a model de-sketched with R
# leaks its round's messages as a Gaussian mechanism does (fedlora/privacy/shared_sketch_bound.md).
SKETCHES_ONLY = ("against observers of the sketched releases only (sample and R hidden: not the clients, not "
                 "whoever holds a de-sketched model)")


def observer_label(observer: Observer | str, threat_model: str = "known-sketch", placement: str = "server") -> str:
    """Whom an epsilon of ``threat_model`` against ``observer`` holds against, in words, where the noise is added at
    ``placement``."""
    observer = Observer(observer)
    if observer is Observer.MODEL and threat_model == "secret-sketch":
        return SKETCHES_ONLY
    if observer is Observer.MODEL and placement in ("client", "secagg"):
        return MODEL_NOT_CO_CLIENTS
    if threat_model == "secret-sketch":
        return OBSERVER_LABELS[observer][:-1] + R_HIDDEN + ")"
    return OBSERVER_LABELS[observer]


def other_observers(epsilon_by_observer: dict[str, float], calibrated: Observer | str | None,
                    threat_model: str = "known-sketch", placement: str = "server") -> list[tuple[float, str]]:
    """The finite epsilons, with their labels, against the observers besides the one a run was calibrated for (an
    infinite one, e.g. the server placement's against the server, is left to the placement's name)."""
    return [(value, observer_label(observer, threat_model, placement)) for observer, value in epsilon_by_observer.items()
            if observer != calibrated and math.isfinite(value)]


def observers(placement: str) -> tuple[Observer, ...]:
    """The observers a noise placement tells apart. Where every reply carries noise (at the client, or shares under
    secure aggregation), a client of the round, who knows its own, sees less noise than the model's other
    observers; secure aggregation adds a server that breaks the protocol. With noise at the server a client of the
    round knows nothing the model's observers' guarantee does not allow (its own message, that it took part)."""
    if placement == "secagg":
        return Observer.MODEL, Observer.SERVER, Observer.ONE_REPLY, Observer.CO_CLIENT
    if placement == "client":
        return Observer.MODEL, Observer.SERVER, Observer.CO_CLIENT
    return Observer.MODEL, Observer.SERVER


def trust_label(threat_model: str, placement: str, observer: Observer | str | None = None, *, seeded: bool = False,
                server_derives_sketch: bool = False) -> str:
    """How every epsilon is labelled: who may know the sketch, where the noise is added, whether it is a seeded
    simulation's, and (given ``observer``) whom the number holds against."""
    derived = " (a simulation: the server derives R)" if server_derives_sketch else ""
    where = ("noise in client shares under secure aggregation" if placement == "secagg"
             else f"noise at the {placement}")
    label = f"{threat_model}{derived}, {where}"
    if seeded:
        label += ", seeded noise (a simulation)"  # whoever holds the run seed removes it
    if observer is not None:
        label += f"; {observer_label(observer, threat_model, placement)}"
    return label


@dataclass(frozen=True)
class GaussianRelease:
    """A Gaussian mechanism on the whole clipped message (GM, or a sketch whose R the adversary knows).

    ``noise_multiplier`` is the noise the model's observers see. Where each of at least ``shares`` replies adds its
    own noise of multiplier z (noise at the client, summed by the server), that is z sqrt(shares)."""

    noise_multiplier: float
    shares: int = 1

    def one_reply(self) -> GaussianRelease:
        """One reply's own noise: z / sqrt(shares)."""
        return GaussianRelease(self.noise_multiplier / self.shares ** 0.5)

    def without_one_share(self) -> GaussianRelease:
        """What a client of the round sees of the others' noise, its own known: the sum of at least two replies
        (it and the target) less its own share."""
        return GaussianRelease(self.noise_multiplier * (max(self.shares - 1, 1) / self.shares) ** 0.5)


def sum_of_replies(part: GaussianRelease, shares: int) -> GaussianRelease:
    """The sum of ``shares`` replies, each the Gaussian release ``part`` of its own noise."""
    return GaussianRelease(part.noise_multiplier * shares ** 0.5, shares)


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
    shares: int = 1  # the clients that each add 1 / shares of the variance (N_min): one reply alone has variance / shares

    def one_reply(self) -> SkellamRelease:
        """One client's reply alone: its own noise share, variance / N_min (z / sqrt(N_min))."""
        return SkellamRelease(self.noise_multiplier / self.shares ** 0.5, self.norm_bound, self.variance / self.shares,
                              self.dim)

    def without_one_share(self) -> SkellamRelease:
        """What a client of the round sees of the sum's noise, its own share known: (N_min - 1) / N_min of it."""
        kept = max(self.shares - 1, 1) / self.shares
        return SkellamRelease(self.noise_multiplier * kept ** 0.5, self.norm_bound, self.variance * kept, self.dim)


@dataclass(frozen=True)
class NonPrivateRelease:
    """No noise: epsilon is infinite, whatever the sketch (../shared/papers/001, Prop. 2)."""


Release = GaussianRelease | SketchedRelease | SkellamRelease | NonPrivateRelease
_RELEASES = {cls.__name__: cls for cls in typing.get_args(Release)}  # every kind a ledger can hold


def release_to_dict(release: Release) -> dict:
    """A release as JSON-ready data (checkpoints, a node's ledger)."""
    return {"type": type(release).__name__, **dataclasses.asdict(release)}


def release_from_dict(data: dict) -> Release:
    return _RELEASES[data["type"]](**{k: v for k, v in data.items() if k != "type"})


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

    def draw(self, rng: np.random.Generator) -> list[int]:
        """One round's clients, sorted: ``clients_per_round`` of them without replacement, or each with probability
        ``rate``. Amplification by sampling holds only against whoever cannot predict ``rng``."""
        if self.kind is Sampling.FIXED:
            return sorted(rng.choice(self.num_clients, self.clients_per_round, replace=False).tolist())
        return [c for c, u in enumerate(rng.random(self.num_clients)) if u < self.rate]



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
