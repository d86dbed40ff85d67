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
- Who looks (``Observer``, docs/explanation/threat-models.md): sampling amplifies only against
  an observer who does not know the sample. The server draws it, so against the server (noise at
  the client, or secure aggregation) the accountant conditions on the rounds the client took part in,
  k ~ Bin(T, q): delta(eps) = E_k delta_k(eps), under replace-one (sensitivity 2 tau; a server that
  sees who replied learns membership anyway, so add/remove has nothing left to protect). For Gaussian
  releases delta_k is the Gaussian mechanism's exact curve at mu = sqrt(k) 2 / z (exact, "known-sample
  exact"); for sketched and Skellam releases it is the RDP conversion of k rounds' curve (a sound
  bound, "known-sample RDP"). Under fixed-size sampling that guarantee also holds against the
  model's observers (they see less, under the same replace-one relation), so their epsilon is the
  smaller of the two: where the amplification theorem is loose (small z, large q) the known-sample
  number wins.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial

import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant as rdp
from scipy import optimize, special, stats

from fedlora.privacy.curves import sketched_rdp, skellam_rdp
from fedlora.privacy.events import (GaussianRelease, NonPrivateRelease, Observer, Phase, Release, Sampling,
                                    SamplingScheme, SkellamRelease, SketchedRelease, observers, trust_label)

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
    method: str  # "RDP", "PLD", "known-sample exact", "known-sample RDP", or "none" (not private)
    order: float | None = None
    observer: str = Observer.MODEL.value  # whom the number holds against (the label names it too)

    def describe(self) -> str:
        if math.isinf(self.epsilon):
            return f"epsilon = inf (not private), threat model {self.threat_model}"
        return (f"epsilon = {self.epsilon:.4g} at delta = {self.delta:g} ({self.method}, {self.sampling} sampling, "
                f"threat model {self.threat_model})")


REPLACE_ONE_SENSITIVITY = 2.0  # the known-sample accounting's relation, whatever the sampler (module docstring)


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


def _round_curve(release: Sequence[Release], s: float) -> Callable[[float], float]:
    """RDP of one round's release at sensitivity ``s`` clip norms, before sampling, as a function of the order."""

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
    """Per-round RDP of a non-Gaussian release (secret sketch, Skellam) after sampling: without replacement, WBK19
    Thm 9; Poisson (add/remove), Zhu and Wang 2019's general upper bound (Thm 6); both through autodp."""
    from autodp.autodp_core import Mechanism as AutodpMechanism
    from autodp.transformer_zoo import AmplificationBySampling

    poisson = sampling.kind is Sampling.POISSON
    base = AutodpMechanism()
    base.name, base.params = "sketched", {"release": 1}
    base.neighboring = "add_remove" if poisson else "replace_one"
    base.propagate_updates(_round_curve(release, _sensitivity(sampling)), "RDP")
    with np.errstate(all="ignore"):  # autodp's log-sum-exp meets the curve's +inf at high orders
        amplified = AmplificationBySampling(PoissonSampling=poisson).amplify(base, sampling.q, improved_bound_flag=False)
        values = np.array([amplified.RenyiDP(a) for a in orders], dtype=float)
    return np.where(np.isnan(values), np.inf, values)  # autodp gives NaN where the base curve is infinite


def phase_rdp(phase: Phase, orders: np.ndarray = ORDERS, *, allow_poisson_skellam: bool = False) -> np.ndarray:
    """Total RDP of a phase's rounds at ``orders``: identical rounds compose linearly in RDP.
    ``allow_poisson_skellam``: account a Skellam release under Poisson sampling as if its shares were fixed (only for
    ``other_convention``'s comparison: a run cannot do it)."""
    if phase.rounds == 0:
        return np.zeros_like(orders)
    return phase.rounds * _round_rdp(phase.release, phase.sampling, tuple(orders), allow_poisson_skellam)


@lru_cache(maxsize=256)
def _round_rdp(release: tuple[Release, ...], sampling: SamplingScheme, orders: tuple[float, ...],
               allow_poisson_skellam: bool = False) -> np.ndarray:
    """RDP of one round (cached: a run's ledger asks for the same round every round)."""
    orders = np.asarray(orders)
    if any(isinstance(part, NonPrivateRelease) or part.noise_multiplier == 0 for part in release):
        return np.full_like(orders, np.inf)
    if _all_gaussian(release):
        from absl import logging as absl_logging

        accountant = rdp.RdpAccountant(list(orders), _relation(sampling))
        verbosity = absl_logging.get_verbosity()
        absl_logging.set_verbosity(absl_logging.ERROR)  # Poisson at small z: "excluding this order" (sound), per order
        try:
            accountant.compose(gaussian_event(release, sampling), 1)
        finally:
            absl_logging.set_verbosity(verbosity)
        return np.asarray(accountant._rdp, dtype=float)  # dp-accounting keeps the composed RDP here
    if sampling.kind is Sampling.POISSON and not allow_poisson_skellam:
        if any(isinstance(part, SkellamRelease) for part in release):
            raise ValueError("Secure aggregation's accounting supports fixed-size sampling only: with Poisson "
                             "sampling the number of noise shares in the sum changes with the participants.")
        raise ValueError("Secret-sketch accounting supports fixed-size sampling only: the shared-sketch bound "
                         "needs the number of clients per round, which Poisson sampling does not fix.")
    return _amplified_rdp(release, sampling, orders)


def _participation(phases: Sequence[Phase]) -> tuple[np.ndarray, np.ndarray]:
    """The rounds of each phase a client takes part in, k_p ~ Bin(rounds_p, q_p) independently, as rows of counts
    with their probabilities (those below 1e-300 dropped: they cannot move a delta)."""
    counts, probs = np.zeros((1, 0), dtype=float), np.ones(1)
    for phase in phases:
        pmf = stats.binom.pmf(np.arange(phase.rounds + 1), phase.rounds, phase.sampling.q)
        keep = np.nonzero(pmf > 1e-300)[0]
        counts = np.hstack([np.repeat(counts, len(keep), axis=0), np.tile(keep, len(counts))[:, None]])
        probs = np.outer(probs, pmf[keep]).ravel()
        live = probs > 1e-300
        counts, probs = counts[live], probs[live]
    return counts, probs


def gaussian_delta(eps: float, mu: np.ndarray) -> np.ndarray:
    """The Gaussian mechanism's exact delta(eps) at mu = sensitivity / sigma: Phi(-eps/mu + mu/2) - e^eps
    Phi(-eps/mu - mu/2) (Balle and Wang 2018), 0 where mu = 0."""
    mu = np.asarray(mu, dtype=float)
    safe = np.where(mu > 0, mu, 1.0)
    with np.errstate(over="ignore"):
        value = special.ndtr(-eps / safe + safe / 2) - np.exp(eps + special.log_ndtr(-eps / safe - safe / 2))
    return np.where(mu > 0, np.clip(value, 0.0, 1.0), 0.0)


def rdp_delta(eps: float, rdp_curves: np.ndarray, orders: np.ndarray = ORDERS) -> np.ndarray:
    """dp-accounting's RDP-to-delta conversion (``rdp.compute_delta``), vectorized over rows of RDP curves."""
    rdp_curves = np.atleast_2d(rdp_curves)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        kl = np.where(rdp_curves == 0, -np.inf, 0.5 * np.log1p(-np.exp(-rdp_curves)))
        bound = (orders - 1) * (rdp_curves - eps + np.log1p(-1 / orders)) - np.log(orders)
        log_delta = np.where(orders > 1.01, np.minimum(kl, bound), kl)
    return np.minimum(np.exp(np.nan_to_num(log_delta, nan=0.0, posinf=0.0).min(axis=1)), 1.0)


def _solve_epsilon(delta_of: Callable[[float], float], delta: float) -> float:
    """The least epsilon with delta_of(epsilon) <= delta (delta_of falls as epsilon grows); inf if none."""
    if delta_of(0.0) <= delta:
        return 0.0
    hi = 1.0
    while delta_of(hi) > delta:
        if hi > 1e4:
            return math.inf
        hi *= 2
    return float(optimize.brentq(lambda e: delta_of(e) - delta, hi / 2 if hi > 1 else 0.0, hi, xtol=1e-12,
                                 rtol=1e-10))


def known_sample_epsilon(phases: Sequence[Phase], delta: float, *, every_round: bool = False) -> tuple[float, str]:
    """Epsilon against an observer who knows the rounds the client took part in (no amplification), and the
    method: exact for Gaussian releases, the RDP conversion per participation count otherwise. ``every_round``: the
    observer chose the sample and took the client in every round (a server that does not follow the protocol),
    not k ~ Bin(T, q)."""
    phases = [p for p in phases if p.rounds > 0]
    if any(isinstance(part, NonPrivateRelease) or part.noise_multiplier == 0 for p in phases for part in p.release):
        return math.inf, "none"
    if every_round:
        counts, probs = np.array([[float(p.rounds) for p in phases]]).reshape(1, len(phases)), np.ones(1)
    else:
        counts, probs = _participation(phases)
    s = REPLACE_ONE_SENSITIVITY
    if all(_all_gaussian(p.release) for p in phases):
        mu2 = np.array([s * s * sum(part.noise_multiplier ** -2 for part in p.release) for p in phases])
        mu = np.sqrt(counts @ mu2)
        return _solve_epsilon(lambda e: float(probs @ gaussian_delta(e, mu)), delta), "known-sample exact"
    per_round = np.array([[_round_curve(p.release, s)(a) for a in ORDERS] for p in phases])
    with np.errstate(invalid="ignore"):  # 0 rounds of an infinite order is no release
        curves = np.where(counts[:, :, None] > 0, counts[:, :, None] * per_round[None], 0.0).sum(axis=1)
    return _solve_epsilon(lambda e: float(probs @ rdp_delta(e, curves)), delta), "known-sample RDP"


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


PLD_DISCRETIZATION = 1e-4  # dp-accounting's own default for the privacy loss's grid
# The PLD is tried for noise multipliers from this one up: its grid (the privacy loss's range over 1e-4) grows as
# 1 / z^2, about 2e6 points at 0.1, and no longer fits in memory at 1e-4 (5e11 points); below it RDP alone
PLD_MIN_NOISE = 0.1


def _pld_fits(phases: Sequence[Phase]) -> bool:
    return all(part.noise_multiplier >= PLD_MIN_NOISE for p in phases for part in p.release
               if isinstance(part, GaussianRelease))


@lru_cache(maxsize=64)
def _fixed_sampling_pld(noise_multiplier: float, q: float):
    """The PLD of one round of a Gaussian of multiplier z under fixed-size sampling without replacement at rate q,
    replace-one neighbours: Dong, Roth and Su's C_q(G_{2/z}) (Gaussian Differential Privacy, JRSS-B 2022, Thm 4.2,
    whose subsampling draws a fixed-size subset and whose neighbours differ in one individual), the symmetric pair
    whose privacy profile is, at every epsilon, the larger of the two mixtures' A = (1-q) N(0, z^2) + q N(2, z^2)
    against B = N(0, z^2) and B against A (replacing a client moves the sum by up to twice the clip). Its hockey
    sticks come from dp-accounting's subsampled-Gaussian privacy losses (remove and add, at sensitivity 2); the
    pessimistic connect-the-dots discretization (Doroshenko et al. 2022) gives a PLD that dominates the pair, and
    dominating pairs compose (Dong, Roth and Su Thm 3.2; Zhu, Dong and Wang 2022)."""
    from dp_accounting.pld import pld_pmf
    from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution
    from dp_accounting.pld.privacy_loss_mechanism import AdjacencyType, GaussianPrivacyLoss

    pair = [GaussianPrivacyLoss(noise_multiplier, sensitivity=REPLACE_ONE_SENSITIVITY, sampling_prob=q,
                                adjacency_type=adjacency) for adjacency in (AdjacencyType.REMOVE, AdjacencyType.ADD)]
    reach = max(abs(b) for loss in pair for b in (loss.connect_dots_bounds().epsilon_upper,
                                                  loss.connect_dots_bounds().epsilon_lower))
    top = math.ceil(reach / PLD_DISCRETIZATION)
    grid = np.arange(-top, top + 1) * PLD_DISCRETIZATION
    deltas = np.maximum(*(np.asarray(loss.get_delta_for_epsilon(grid), dtype=float) for loss in pair))
    return PrivacyLossDistribution(pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(
        PLD_DISCRETIZATION, -top, top, deltas))


def fixed_sampling_pld_epsilon(phases: Sequence[Phase], delta: float) -> float | None:
    """Epsilon of Gaussian phases under fixed-size sampling (replace-one) from the composed PLD of
    ``_fixed_sampling_pld``; None where a phase is not Gaussian or not fixed-size."""
    composed = None
    for phase in phases:
        if phase.rounds == 0:
            continue
        if phase.sampling.kind is not Sampling.FIXED or not _all_gaussian(phase.release):
            return None
        z = sum(part.noise_multiplier ** -2 for part in phase.release) ** -0.5
        pld = _fixed_sampling_pld(float(z), phase.sampling.q).self_compose(phase.rounds)
        composed = pld if composed is None else composed.compose(pld)
    return None if composed is None else float(composed.get_epsilon_for_delta(delta))


def other_convention(phases: Sequence[Phase], delta: float) -> PrivacyReport | None:
    """What the same noise gives, against the model's observers, under the other common convention: Poisson sampling
    at the same rate with add/remove neighbours (Opacus, TF Privacy, pfl-research) for a fixed-size run, fixed-size
    sampling with replace-one for a Poisson run. Not the run's guarantee: a number to compare tools by. Gaussian
    releases: what ``epsilon`` gives them (Poisson: dp-accounting's PLD and RDP; fixed-size: RDP, the proven PLD
    and the known-sample bound, the tightest); Skellam: RDP, amplified by autodp; None for a secret sketch, whose
    bound needs fixed-size sampling."""
    if any(isinstance(part, SketchedRelease) for p in phases for part in p.release):
        return None
    swapped = []
    for p in phases:
        s = p.sampling
        other = (SamplingScheme(Sampling.POISSON, s.num_clients, rate=s.q) if s.kind is Sampling.FIXED else
                 SamplingScheme(Sampling.FIXED, s.num_clients, clients_per_round=max(1, round(s.q * s.num_clients))))
        swapped.append(dataclasses.replace(p, sampling=other))
    kind = swapped[0].sampling.kind
    if all(_all_gaussian(p.release) for p in swapped):  # the tightest sound number this accountant has for it
        best = epsilon(swapped, delta=delta, threat_model="known-sketch", placement="server", fixed_sampling_pld=True)
        eps, method, order = best.epsilon, best.method, best.order
    else:  # Skellam: its curve amplified by the other sampler's general theorem
        total = sum((phase_rdp(p, allow_poisson_skellam=True) for p in swapped), np.zeros_like(ORDERS))
        if np.all(np.isinf(total)):
            return None
        (eps, order), method = rdp.compute_epsilon(ORDERS, total, delta), "RDP"
    convention = ("Poisson sampling, add/remove neighbours" if kind is Sampling.POISSON
                  else "fixed-size sampling, replace-one neighbours")
    return PrivacyReport(float(eps), delta, f"the field's other convention ({convention}; not this run's guarantee)",
                         kind.value, method, order)


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


def _shared_noise(part: Release) -> bool:
    """Whether a release describes its noise as shares of the replies' (what one reply or a client of the round
    sees of it follows)."""
    return isinstance(part, (GaussianRelease, SkellamRelease))


def _sees_through(phases: Sequence[Phase], observer: Observer, placement: str, *, seeded: bool,
                  server_derives_sketch: bool) -> bool:
    """Whether ``observer`` (not the model's) sees a release without noise that protects it: the server sees every
    message before its own noise; whoever holds the run seed (the server, and every client it is sent to) removes
    seeded noise; whoever knows R removes the secret-sketch bound (the clients always, the server where it derives
    R)."""
    sketched = any(isinstance(part, SketchedRelease) for p in phases for part in p.release)
    return (placement == "server" or seeded or (sketched and server_derives_sketch)
            or (sketched and observer is Observer.CO_CLIENT))


def epsilon(phases: Sequence[Phase], *, delta: float, threat_model: str, placement: str = "client",
            observer: Observer | str = Observer.MODEL, seeded: bool = False, server_derives_sketch: bool = False,
            use_pld: bool = True, fixed_sampling_pld: bool = False,
            allow_unsound_per_message: bool = False) -> PrivacyReport:
    """The client-level (epsilon, delta) of all ``phases`` composed against ``observer``, labelled with the threat
    model, where the noise was added, whether the noise was seeded (a simulation) and the observer.

    ``server_derives_sketch``: a secret sketch whose R the server derives (sketch-secret = "run-seed"): the
    secret-sketch bound then holds against no observer who knows R, the server included (epsilon = inf there).
    ``fixed_sampling_pld``: under fixed-size sampling, also the PLD of a proven dominating pair
    (``fixed_sampling_pld_epsilon``), tighter than RDP (accountant = "pld").
    ``allow_unsound_per_message`` lets a secret-sketch release be accounted per message although its
    sketch is shared (the paper's analysis): only for showing the paper's numbers, labelled UNSOUND.
    """
    _check_delta(delta)
    _check_threat_model(phases, threat_model)
    _check_placement(phases, placement)
    _check_phases(phases, allow_unsound_per_message)
    observer = Observer(observer)
    if observer not in observers(placement):
        raise ValueError(f"'{observer.value}' is not an observer that noise placement '{placement}' tells apart; "
                         f"choose one of {', '.join(o.value for o in observers(placement))}.")
    if placement == "secagg" and observer is not Observer.MODEL and not all(
            isinstance(part, SkellamRelease) for p in phases for part in p.release):
        raise ValueError(f"Under secure aggregation the '{observer.value}' observer needs each release as a "
                         "SkellamRelease (its noise shares): a Gaussian release does not say what one reply carries.")
    unsound = any(isinstance(part, SketchedRelease) and part.clients_per_round < (p.sampling.clients_per_round or 1)
                  for p in phases for part in p.release)
    label = trust_label(threat_model, placement, observer, seeded=seeded,
                        server_derives_sketch=server_derives_sketch and threat_model == "secret-sketch")
    if unsound:
        label = f"{label}, per-message analysis: UNSOUND for shared sketches"
    sampling = "+".join(sorted({p.sampling.kind.value for p in phases})) or "none"
    report = partial(PrivacyReport, delta=delta, threat_model=label, sampling=sampling, observer=observer.value)
    if observer is not Observer.MODEL:
        if _sees_through(phases, observer, placement, seeded=seeded, server_derives_sketch=server_derives_sketch):
            return report(math.inf, method="none")
        view = {Observer.SERVER: lambda part: part.one_reply() if placement == "client" else part,
                Observer.ONE_REPLY: lambda part: part.one_reply(),
                Observer.CO_CLIENT: lambda part: part.without_one_share()}[observer]
        phases = [dataclasses.replace(p, release=tuple(view(part) if _shared_noise(part) else part
                                                       for part in p.release)) for p in phases]
        eps, method = known_sample_epsilon(phases, delta, every_round=observer is Observer.ONE_REPLY)
        return report(eps, method=method)
    total = sum((phase_rdp(p) for p in phases), np.zeros_like(ORDERS))
    if np.any(np.isnan(total)) or np.any(total < 0):
        raise ValueError("An RDP curve came out NaN or negative; refusing to report an epsilon from it.")
    if np.all(np.isinf(total)):
        return report(math.inf, method="none")
    eps, order = rdp.compute_epsilon(ORDERS, total, delta)
    best = report(float(eps), method="RDP", order=float(order))
    use_pld, fixed_sampling_pld = (use_pld, fixed_sampling_pld) if _pld_fits(phases) else (False, False)
    if use_pld and eps > 0:
        pld_eps = _pld_epsilon(phases, delta)
        if pld_eps is not None and pld_eps < best.epsilon:
            best = report(pld_eps, method="PLD")
    if fixed_sampling_pld and eps > 0:
        fixed_eps = fixed_sampling_pld_epsilon(phases, delta)
        if fixed_eps is not None and fixed_eps < best.epsilon:
            best = report(fixed_eps, method="PLD (fixed-size sampling)")
    if use_pld and eps > 0 and all(p.sampling.kind is Sampling.FIXED for p in phases):
        known, method = known_sample_epsilon(phases, delta)  # replace-one both: it bounds the model's view too
        if known < best.epsilon:
            best = report(known, method=method)
    return best


@dataclass(frozen=True)
class Calibration:
    noise_multiplier: float
    report: PrivacyReport


def calibrate(phases_for: Callable[[float], Sequence[Phase]], *, target_epsilon: float, delta: float,
              threat_model: str, placement: str = "client", observer: Observer | str = Observer.MODEL,
              tolerance: float = 2.5e-3, max_noise_multiplier: float = 1e3, **labels) -> Calibration:
    """The smallest noise multiplier (to ``tolerance`` relative) whose epsilon is <= ``target_epsilon``.

    ``phases_for(z)`` gives the run's phases at noise multiplier z. Epsilon falls as z rises, so a
    bisection on z converges; the returned multiplier always meets the target against ``observer``.
    ``labels``: ``epsilon``'s other keywords (seeded, server_derives_sketch, allow_unsound_per_message).
    """
    if Observer(observer) is Observer.SERVER and placement == "server":
        raise ValueError("With noise at the server the server sees every message before the noise: no epsilon holds "
                         "against it to calibrate for (target the model's observers, or move the noise).")
    if not target_epsilon > 0:
        raise ValueError(f"Target epsilon must be positive, got {target_epsilon}.")
    _check_delta(delta)

    def eps_at(z: float) -> PrivacyReport:
        return epsilon(phases_for(z), delta=delta, threat_model=threat_model, placement=placement, observer=observer,
                       **labels)

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
