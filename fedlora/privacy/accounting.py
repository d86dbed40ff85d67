"""Client-level epsilon of a run, from the phases it ran, and the noise multiplier for a target epsilon.

- Gaussian releases (GM, and every release under the known-sketch threat model) are accounted
  with dp-accounting: ``SampledWithoutReplacementDpEvent`` (replace-one) for fixed-size
  sampling, ``PoissonSampledDpEvent`` (add/remove-one) for Poisson sampling, with RDP and, where
  dp-accounting supports it (Poisson), PLD; the tighter one is reported.
  Under replace-one, a client's message X (||X|| <= tau) may become any X' (||X'|| <= tau), so the
  sensitivity is 2 tau and the event's noise multiplier is z / 2.
- Secret-sketch releases (SGMM/SGMV, ``curves.sketched_rdp``) are not Gaussian: their per-round
  RDP curve is amplified with the general theorem for sampling without replacement (Wang, Balle
  and Kasiviswanathan 2019, Thm 9, via autodp), composed over rounds by adding RDP and converted
  with dp-accounting's ``compute_epsilon``. Poisson sampling is refused there: the shared-sketch
  bound needs the number of clients that share a sketch, which Poisson sampling does not fix.
- Where the noise is added does not change the number: with noise at the server the sum of the
  round's clipped messages gets N(0, z^2 tau^2), the Gaussian mechanism each client's own noise
  gives under noise at the client, with the same sensitivity. It changes who the guarantee holds
  against, so every report names it (``placement``); the secret-sketch bound is refused there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant as rdp

from fedlora.privacy.curves import sketched_rdp, skellam_rdp
from fedlora.privacy.events import (GaussianRelease, NonPrivateRelease, Phase, Release, Sampling, SamplingScheme,
                                    SkellamRelease, SketchedRelease, trust_label)

# Renyi orders: dense where small epsilons are optimal, sparse in the tail.
ORDERS = np.array([1 + x / 20 for x in range(1, 60)] + [4 + x / 4 for x in range(28)]
                  + list(range(11, 64)) + [64, 80, 96, 128, 192, 256], dtype=float)

THREAT_MODELS = ("known-sketch", "secret-sketch")
PLACEMENTS = ("client", "server", "secagg")


@dataclass(frozen=True)
class PrivacyReport:
    """An (epsilon, delta) guarantee and everything needed to read it."""

    epsilon: float
    delta: float
    threat_model: str
    sampling: str
    method: str  # "RDP", "PLD", or "none" (not private)
    order: float | None = None

    def describe(self) -> str:
        if math.isinf(self.epsilon):
            return f"epsilon = inf (not private), threat model {self.threat_model}"
        return (f"epsilon = {self.epsilon:.4g} at delta = {self.delta:g} ({self.method}, {self.sampling} sampling, "
                f"threat model {self.threat_model})")


def _check_delta(delta: float) -> None:
    if not 0 < delta < 1:
        raise ValueError(f"Delta must lie in (0, 1), got {delta}.")


def _relation(sampling: SamplingScheme) -> rdp.NeighborRel:
    return rdp.NeighborRel.REPLACE_ONE if sampling.kind is Sampling.FIXED else rdp.NeighborRel.ADD_OR_REMOVE_ONE


def _sensitivity(sampling: SamplingScheme) -> float:
    """Sensitivity of a message clipped at 1: replacing it moves it by up to 2, removing it by up to 1."""
    return 2.0 if sampling.kind is Sampling.FIXED else 1.0


def gaussian_event(release: Sequence[Release], sampling: SamplingScheme) -> dp_event.DpEvent:
    """The dp-accounting event of one round whose release is all Gaussian."""
    inverse_square = sum(part.noise_multiplier ** -2 for part in release)  # Gaussians compose into one
    z = inverse_square ** -0.5 / _sensitivity(sampling)
    if sampling.kind is Sampling.FIXED:
        return dp_event.SampledWithoutReplacementDpEvent(sampling.num_clients, sampling.clients_per_round,
                                                         dp_event.GaussianDpEvent(z))
    return dp_event.PoissonSampledDpEvent(sampling.rate, dp_event.GaussianDpEvent(z))


def _all_gaussian(release: Sequence[Release]) -> bool:
    return all(isinstance(part, GaussianRelease) for part in release)


def _round_curve(release: Sequence[Release], sampling: SamplingScheme) -> Callable[[float], float]:
    """RDP of one round's release, before sampling, as a function of the order (for autodp)."""
    s = _sensitivity(sampling)

    def curve(alpha: float) -> float:
        total = 0.0
        for part in release:
            if isinstance(part, SketchedRelease):
                total += float(sketched_rdp([alpha], sketch_dim=part.sketch_dim, rank=part.rank,
                                            noise_multiplier=part.noise_multiplier,
                                            clients_per_round=part.clients_per_round)[0])
            elif isinstance(part, SkellamRelease):
                total += float(skellam_rdp([alpha], l2_sensitivity=s * part.norm_bound, variance=part.variance,
                                           dim=part.dim)[0])
            else:
                total += alpha * s * s / (2 * part.noise_multiplier ** 2)
        return total

    return curve


def _amplified_rdp(release: Sequence[Release], sampling: SamplingScheme, orders: np.ndarray) -> np.ndarray:
    """Per-round RDP of a non-Gaussian release (secret sketch, Skellam) after sampling without replacement (WBK19
    Thm 9, autodp)."""
    from autodp.autodp_core import Mechanism as AutodpMechanism
    from autodp.transformer_zoo import AmplificationBySampling

    base = AutodpMechanism()
    base.name, base.params, base.neighboring = "sketched", {"release": 1}, "replace_one"
    base.propagate_updates(_round_curve(release, sampling), "RDP")
    with np.errstate(all="ignore"):  # autodp's log-sum-exp meets the curve's +inf at high orders
        amplified = AmplificationBySampling(PoissonSampling=False).amplify(base, sampling.q, improved_bound_flag=False)
        values = np.array([amplified.RenyiDP(a) for a in orders], dtype=float)
    return np.where(np.isnan(values), np.inf, values)  # autodp gives NaN where the base curve is infinite


def phase_rdp(phase: Phase, orders: np.ndarray = ORDERS) -> np.ndarray:
    """Total RDP of a phase's rounds at ``orders``: identical rounds compose linearly in RDP."""
    if phase.rounds == 0:
        return np.zeros_like(orders)
    return phase.rounds * _round_rdp(phase.release, phase.sampling, tuple(orders))


@lru_cache(maxsize=256)
def _round_rdp(release: tuple[Release, ...], sampling: SamplingScheme, orders: tuple[float, ...]) -> np.ndarray:
    """RDP of one round (cached: a run's ledger asks for the same round every round)."""
    orders = np.asarray(orders)
    if any(isinstance(part, NonPrivateRelease) or part.noise_multiplier == 0 for part in release):
        return np.full_like(orders, np.inf)
    if _all_gaussian(release):
        accountant = rdp.RdpAccountant(list(orders), _relation(sampling))
        accountant.compose(gaussian_event(release, sampling), 1)
        return np.asarray(accountant._rdp, dtype=float)  # dp-accounting keeps the composed RDP here
    if sampling.kind is Sampling.POISSON:
        if any(isinstance(part, SkellamRelease) for part in release):
            raise ValueError("Secure aggregation's accounting supports fixed-size sampling only: with Poisson "
                             "sampling the number of noise shares in the sum changes with the participants.")
        raise ValueError("Secret-sketch accounting supports fixed-size sampling only: the shared-sketch bound "
                         "needs the number of clients per round, which Poisson sampling does not fix.")
    return _amplified_rdp(release, sampling, orders)


def _pld_epsilon(phases: Sequence[Phase], delta: float) -> float | None:
    """PLD epsilon where dp-accounting supports every phase's event, else None."""
    accountant = pld_privacy_accountant.PLDAccountant()
    for phase in phases:
        if phase.rounds == 0:
            continue
        if not _all_gaussian(phase.release):
            return None
        event = gaussian_event(phase.release, phase.sampling)
        if not accountant.supports(event):
            return None
        accountant.compose(event, phase.rounds)
    return float(accountant.get_epsilon(delta))


def _check_threat_model(phases: Sequence[Phase], threat_model: str) -> None:
    if threat_model not in THREAT_MODELS:
        raise ValueError(f"Unknown threat model '{threat_model}'; choose one of {', '.join(THREAT_MODELS)}.")
    if threat_model == "known-sketch" and any(isinstance(p, SketchedRelease) for ph in phases for p in ph.release):
        raise ValueError("A secret-sketch release cannot be accounted under the known-sketch threat model.")


def _check_placement(phases: Sequence[Phase], placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"Unknown noise placement '{placement}'; choose one of {', '.join(PLACEMENTS)}.")
    if placement != "client" and any(isinstance(p, SketchedRelease) for ph in phases for p in ph.release):
        raise ValueError("The secret-sketch bound holds for noise on every client's message, not for noise on "
                         "their sum.")


def _check_phases(phases: Sequence[Phase], allow_unsound_per_message: bool) -> None:
    if len({p.sampling.kind for p in phases}) > 1:
        raise ValueError("Phases with different sampling kinds use different neighbour relations (replace-one "
                         "vs add/remove) and cannot be composed: use one sampling kind for the whole run.")
    for phase in phases:
        for part in phase.release:
            if (isinstance(part, SketchedRelease) and phase.sampling.kind is Sampling.FIXED
                    and part.clients_per_round < phase.sampling.clients_per_round
                    and not allow_unsound_per_message):
                raise ValueError(f"The sketch is shared by {phase.sampling.clients_per_round} clients per round, but "
                                 f"the release is accounted for {part.clients_per_round}: that bound is unsound.")


def epsilon(phases: Sequence[Phase], *, delta: float, threat_model: str, placement: str = "client",
            use_pld: bool = True, allow_unsound_per_message: bool = False) -> PrivacyReport:
    """The client-level (epsilon, delta) of all ``phases`` composed, labelled with the threat model and
    where the noise was added.

    ``allow_unsound_per_message`` lets a secret-sketch release be accounted per message although its
    sketch is shared (the paper's analysis): only for showing the paper's numbers, labelled UNSOUND.
    """
    _check_delta(delta)
    _check_threat_model(phases, threat_model)
    _check_placement(phases, placement)
    _check_phases(phases, allow_unsound_per_message)
    unsound = any(isinstance(part, SketchedRelease) and part.clients_per_round < (p.sampling.clients_per_round or 1)
                  for p in phases for part in p.release)
    threat_model = trust_label(threat_model, placement)
    if unsound:
        threat_model = f"{threat_model}, per-message analysis: UNSOUND for shared sketches"
    sampling = "+".join(sorted({p.sampling.kind.value for p in phases})) or "none"
    total = sum((phase_rdp(p) for p in phases), np.zeros_like(ORDERS))
    if np.any(np.isnan(total)) or np.any(total < 0):
        raise ValueError("An RDP curve came out NaN or negative; refusing to report an epsilon from it.")
    if np.all(np.isinf(total)):
        return PrivacyReport(math.inf, delta, threat_model, sampling, "none")
    eps, order = rdp.compute_epsilon(ORDERS, total, delta)
    report = PrivacyReport(float(eps), delta, threat_model, sampling, "RDP", float(order))
    if use_pld and eps > 0:
        pld_eps = _pld_epsilon(phases, delta)
        if pld_eps is not None and pld_eps < report.epsilon:
            report = PrivacyReport(pld_eps, delta, threat_model, sampling, "PLD")
    return report


@dataclass(frozen=True)
class Calibration:
    noise_multiplier: float
    report: PrivacyReport


def calibrate(phases_for: Callable[[float], Sequence[Phase]], *, target_epsilon: float, delta: float,
              threat_model: str, placement: str = "client", tolerance: float = 2.5e-3, max_noise_multiplier: float = 1e3,
              allow_unsound_per_message: bool = False) -> Calibration:
    """The smallest noise multiplier (to ``tolerance`` relative) whose epsilon is <= ``target_epsilon``.

    ``phases_for(z)`` gives the run's phases at noise multiplier z. Epsilon falls as z rises, so a
    bisection on z converges; the returned multiplier always meets the target.
    """
    if not target_epsilon > 0:
        raise ValueError(f"Target epsilon must be positive, got {target_epsilon}.")
    _check_delta(delta)

    def eps_at(z: float) -> PrivacyReport:
        return epsilon(phases_for(z), delta=delta, threat_model=threat_model, placement=placement,
                       allow_unsound_per_message=allow_unsound_per_message)

    hi = 1.0
    report = eps_at(hi)
    while report.epsilon > target_epsilon:
        if hi >= max_noise_multiplier:
            raise ValueError(f"Target epsilon {target_epsilon:g} is unreachable: even noise multiplier {hi:g} "
                             f"gives epsilon {report.epsilon:.3g}.")
        hi *= 2
        report = eps_at(hi)
    lo = hi / 2 if hi > 1 else 0.0
    while hi - lo > tolerance * hi:
        mid = (lo + hi) / 2
        mid_report = eps_at(mid)
        if mid_report.epsilon <= target_epsilon:
            hi, report = mid, mid_report
        else:
            lo = mid
    return Calibration(hi, report)
