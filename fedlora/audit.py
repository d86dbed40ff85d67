"""Empirical privacy: membership tests against a mechanism's releases, and canaries in a whole run.

Mechanism level (../shared/papers/001, App. F.1, at the level of one client message): many trials
release a client message X or its neighbour X' (both of Frobenius norm at most the clip norm tau)
through the product's own ``Mechanism.privatize``; the attacker scores each release with the
strongest statistic it has and we report ROC AUC, TPR at FPR 1% and 10%, and a lower bound on
epsilon that holds with the stated confidence (Clopper-Pearson on a held-out half of the trials).
- R known (GM, or any sketch under known-sketch): the release is Gaussian around M(X), the noiseless
  release the attacker recomputes from the public seed, so the likelihood ratio is <Y, M(X) - M(X')>.
  The pair is X' = -X (distance 2 tau, the replace-one worst case).
- R secret (SGMM/SGMV under secret-sketch, and the noise-free sketch): each sketch row of the release
  is N(0, G^T G / b + noise), G the sketched matrix (X for SGMM, vec(X) for SGMV), so the likelihood
  ratio is a quadratic form in the rows: the covariance statistic. The pair is X' orthogonal to X
  (different row spaces, ../shared/papers/001 Prop. 2) for SGMM, X' = 0 for SGMV and rank 1 (there
  only the norm shows). With ``clients_per_round`` N > 1 the round's other N - 1 clients share R and
  their messages are known to the attacker (DP fixes everyone but the target): they send X, whose
  releases reveal R X, and the pair is X' = -X. This is where the paper's per-message analysis fails.

Federation level (Andrew et al. 2024, "One-shot empirical privacy estimation for federated
learning"): canary clients whose message is a fixed random direction at the clip norm take part in a
run like any client; each is scored by the largest cosine between its direction and a round's
update of the global model. Each canary takes part with probability 1/2 (an excluded one sends
zero), which makes the run a one-run audit (Steinke, Nasr and Jagielski 2023): guessing "included"
for the highest scores, the count of right guesses of an (epsilon, delta)-DP run is bounded by a
binomial, so it gives the run's empirical epsilon as a lower bound at a stated confidence. Andrew et
al.'s estimate (Gaussians fitted to the included canaries' scores and to those of directions never
inserted) is reported beside it: a point estimate, not a bound.

Pure NumPy/torch: no Flower here (the canary run's glue is in ``fedlora.strategies.canary_audit``).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
from scipy import optimize, special, stats

from fedlora.algorithms import LoRAMode
from fedlora.mechanisms import Mechanism, NoisePlacement, ThreatModel
from fedlora.privacy.accounting import epsilon as accountant_epsilon
from fedlora.privacy.events import Observer, Phase, SamplingScheme, trust_label
from fedlora.secure_sum import SkellamSecureSum
from fedlora.sketch import NoSketch, Side, SketchKey, VectorSketch, is_product, layer_of, side_of

CONFIDENCE = 0.95
ENTRY = "audit.lora_B"  # the audited message: one LoRA B factor, sketched from the left like a real one


# -- statistics of two score samples ---------------------------------------------------------------
def roc_auc(members: np.ndarray, others: np.ndarray) -> float:
    """P(a member's score > a non-member's), ties counted half (Mann-Whitney)."""
    ranks = stats.rankdata(np.concatenate([members, others]))
    n1, n0 = len(members), len(others)
    return float((ranks[:n1].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def tpr_at_fpr(members: np.ndarray, others: np.ndarray, fpr: float) -> float:
    """The fraction of members scored above the threshold that only ``fpr`` of the non-members pass."""
    threshold = np.quantile(others, 1 - fpr, method="higher")
    return float(np.mean(members > threshold))


def auc_interval(members: np.ndarray, others: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """A two-sided interval for the AUC (DeLong et al. 1988: the variance of the Mann-Whitney statistic from each
    sample's placements among the other), clipped to [0, 1]. Asymptotic: with a few dozen per side its coverage is
    approximate, and at an AUC of exactly 0 or 1 it has no width."""
    members, others = np.asarray(members, dtype=float), np.asarray(others, dtype=float)
    n1, n0 = len(members), len(others)
    if n1 < 2 or n0 < 2:
        raise ValueError("An AUC interval needs at least two scores on each side.")
    ranks = stats.rankdata(np.concatenate([members, others]))
    # a member's placement: the fraction of non-members it beats (ties half); a non-member's: of members beating it
    member_place = (ranks[:n1] - stats.rankdata(members)) / n0
    other_place = 1 - (ranks[n1:] - stats.rankdata(others)) / n1
    auc = float(member_place.mean())
    half = stats.norm.ppf((1 + confidence) / 2) * math.sqrt(member_place.var(ddof=1) / n1 +
                                                             other_place.var(ddof=1) / n0)
    return max(0.0, auc - half), min(1.0, auc + half)


def tpr_interval(members: np.ndarray, others: np.ndarray, fpr: float,
                 confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Clopper-Pearson for the TPR at ``tpr_at_fpr``'s threshold (the threshold taken as given: the non-members'
    quantile moves it too, so with few non-members at FPR 1% read the TPR as rough)."""
    members = np.asarray(members, dtype=float)
    n, k = len(members), int(np.sum(members > np.quantile(others, 1 - fpr, method="higher")))
    tail = (1 - confidence) / 2
    return (float(stats.beta.ppf(tail, k, n - k + 1)) if k else 0.0,
            float(stats.beta.ppf(1 - tail, k + 1, n - k)) if k < n else 1.0)


def exposure(canaries: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Each canary's exposure in bits (Carlini et al. 2019, "The Secret Sharer"): log2 of how many sequences it was
    drawn among (the candidates, drawn alike but never inserted, and itself) less log2 of its rank among them by
    score (1: scored above every candidate; ties count against it). At most log2(candidates + 1); a canary the
    model never saw has a uniform rank, so its expected exposure is about log2(e) = 1.44 bits."""
    canaries, candidates = np.asarray(canaries, dtype=float), np.sort(np.asarray(candidates, dtype=float))
    rank = 1 + len(candidates) - np.searchsorted(candidates, canaries, side="left")
    return np.log2(len(candidates) + 1) - np.log2(rank)


def _epsilons(tp: np.ndarray, n1: int, fp: np.ndarray, n0: int, delta: float, level: float) -> np.ndarray:
    """log((TPR_low - delta) / FPR_high) with one-sided Clopper-Pearson bounds, each at ``level``."""
    tpr_low = np.where(tp > 0, stats.beta.ppf(level, np.maximum(tp, 1), n1 - tp + 1), 0.0)
    fpr_high = np.where(fp < n0, stats.beta.ppf(1 - level, fp + 1, np.maximum(n0 - fp, 1)), 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(tpr_low > delta, np.log((tpr_low - delta) / fpr_high), 0.0)


def _counts(positives: np.ndarray, negatives: np.ndarray, thresholds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """How many of each sample score at or above every threshold."""
    return (len(positives) - np.searchsorted(np.sort(positives), thresholds, side="left"),
            len(negatives) - np.searchsorted(np.sort(negatives), thresholds, side="left"))


def epsilon_lower_bound(members: np.ndarray, others: np.ndarray, *, delta: float, confidence: float = CONFIDENCE,
                        seed: int = 0) -> float:
    """An epsilon that the mechanism exceeds with probability at least ``confidence``, or 0.

    Any (epsilon, delta)-DP mechanism has TPR <= e^epsilon FPR + delta for every test, with either
    hypothesis as the positive one. The test (which hypothesis is positive, a threshold and its side) is
    chosen on one half of the trials; its TPR and FPR are bounded with Clopper-Pearson on the other half, each bound at
    (1 - confidence) / 2, so choosing the test costs no confidence.
    """
    rng = np.random.default_rng(seed)
    halves = {name: np.array_split(rng.permutation(sample), 2) for name, sample in (("m", members), ("o", others))}
    level = (1 - confidence) / 2
    best, choice = -np.inf, None
    # a test: which sample plays "positive" (DP bounds both ways round) and which side of the threshold it is on
    for positive, negative in (("m", "o"), ("o", "m")):
        for side in (1, -1):
            pos, neg = side * halves[positive][0], side * halves[negative][0]
            thresholds = np.unique(np.concatenate([pos, neg]))
            tp, fp = _counts(pos, neg, thresholds)
            eps = _epsilons(tp, len(pos), fp, len(neg), delta, level)
            i = int(np.argmax(eps))
            if eps[i] > best:
                best, choice = eps[i], (positive, negative, side, thresholds[i])
    positive, negative, side, threshold = choice
    pos, neg = side * halves[positive][1], side * halves[negative][1]
    tp, fp = _counts(pos, neg, np.array([threshold]))
    return max(0.0, float(_epsilons(tp, len(pos), fp, len(neg), delta, level)[0]))


# -- one run (Steinke, Nasr and Jagielski 2023) ---------------------------------------------------
def _one_run_p_value(canaries: int, guesses: int, correct: int, eps: float, delta: float) -> float:
    """P(at least ``correct`` of ``guesses`` right) in an (eps, delta)-DP run where each of ``canaries`` was
    included with probability 1/2: the binomial tail of eps-DP randomized response, plus their delta term."""
    q = special.expit(eps)
    beta = stats.binom.sf(correct - 1, guesses, q)
    shortfall = np.arange(1, correct + 1)
    alpha = np.max((stats.binom.sf(correct - shortfall - 1, guesses, q) - beta) / shortfall, initial=0.0)
    return min(1.0, float(beta + 2 * canaries * delta * alpha))


def one_run_lower_bound(scores: np.ndarray, included: np.ndarray, *, delta: float,
                        confidence: float = CONFIDENCE) -> float:
    """An epsilon that the run exceeds with probability at least ``confidence``, or 0, from one run in which each
    canary was included independently with probability 1/2.

    The auditor guesses "included" for the k highest scores (scores never see the coins) and abstains on
    the rest, for k = 1, 2, 4, ... and k = all canaries; the levels are Bonferroni-corrected over those k.
    """
    scores, included = np.asarray(scores, dtype=float), np.asarray(included, dtype=bool)
    m = len(scores)
    if not m or len(included) != m or not np.all(np.isfinite(scores)):
        raise ValueError("One-run auditing needs one finite score and one coin per canary.")
    hits = np.cumsum(included[np.argsort(-scores, kind="stable")])
    guesses = sorted({*(2 ** j for j in range(m.bit_length()) if 2 ** j <= m), m})
    level = (1 - confidence) / len(guesses)
    best = 0.0
    for k in guesses:
        correct = int(hits[k - 1])

        def excess(eps: float) -> float:  # < 0 while an (eps, delta) claim is rejected at this level
            return _one_run_p_value(m, k, correct, eps, delta) - level

        if excess(best) >= 0:
            continue
        hi = max(1.0, 2 * best)
        while excess(hi) < 0:
            hi *= 2
        best = optimize.brentq(excess, best, hi, xtol=1e-6)
    return best


# -- epsilon of two Gaussians (the canary estimate) -------------------------------------------------
def _probability(lo: float, hi: float, mean: float, std: float) -> float:
    """P(lo < X < hi) for X ~ N(mean, std^2), from the nearer tail so that far tails keep their precision."""
    if lo >= mean:
        return stats.norm.sf(lo, mean, std) - stats.norm.sf(hi, mean, std)
    return stats.norm.cdf(hi, mean, std) - stats.norm.cdf(lo, mean, std)


def _gaussian_delta(eps: float, p: tuple[float, float], q: tuple[float, float]) -> float:
    """sup_S P(S) - e^eps Q(S) for P = N(p), Q = N(q) (mean, std): S is where log p/q > eps, a quadratic."""
    (m1, s1), (m0, s0) = p, q
    a = 0.5 / s0 ** 2 - 0.5 / s1 ** 2
    b = m1 / s1 ** 2 - m0 / s0 ** 2
    c = m0 ** 2 / (2 * s0 ** 2) - m1 ** 2 / (2 * s1 ** 2) + math.log(s0 / s1) - eps

    def mass(lo: float, hi: float) -> float:
        return _probability(lo, hi, m1, s1) - math.exp(eps) * _probability(lo, hi, m0, s0)

    if abs(a) < 1e-12 * max(1.0, abs(b)):  # equal variances: a half line
        if b == 0:
            return max(0.0, mass(-math.inf, math.inf)) if c > 0 else 0.0
        x = -c / b
        return max(0.0, mass(x, math.inf) if b > 0 else mass(-math.inf, x))
    disc = b * b - 4 * a * c
    if disc <= 0:
        return max(0.0, mass(-math.inf, math.inf)) if a > 0 else 0.0
    r1, r2 = sorted(((-b - math.sqrt(disc)) / (2 * a), (-b + math.sqrt(disc)) / (2 * a)))
    if a > 0:  # outside the roots
        return max(0.0, mass(-math.inf, r1) + mass(r2, math.inf))
    return max(0.0, mass(r1, r2))


def gaussian_pair_epsilon(p: tuple[float, float], q: tuple[float, float], delta: float) -> float:
    """The smallest epsilon with which N(p) and N(q) (mean, std) are (epsilon, delta)-indistinguishable."""
    def worst(eps: float) -> float:
        return max(_gaussian_delta(eps, p, q), _gaussian_delta(eps, q, p))

    if worst(0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while worst(hi) > delta:
        lo, hi = hi, 2 * hi
        if hi > 512:  # e^eps overflows beyond about 709: indistinguishable from no privacy at all
            return math.inf
    while hi - lo > 1e-6 * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if worst(mid) <= delta else (mid, hi)
    return hi


def canary_epsilon(inserted: np.ndarray, null: np.ndarray, delta: float) -> float:
    """Andrew et al.'s estimate: epsilon between Gaussians fitted to the inserted and the null canary scores."""
    for scores in (inserted, null):
        if len(scores) < 2 or not np.all(np.isfinite(scores)) or not np.std(scores) > 0:
            raise ValueError("Canary scores must be at least two finite values that are not all equal.")
    return gaussian_pair_epsilon((float(np.mean(inserted)), float(np.std(inserted, ddof=1))),
                                 (float(np.mean(null)), float(np.std(null, ddof=1))), delta)


# -- results ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AuditResult:
    """One audit: how well the attacker told members from non-members, against what the accountant claims."""

    name: str
    level: str  # "mechanism" or "federation"
    threat_model: str
    attack: str
    trials: int  # per hypothesis (mechanism level) or canaries inserted (federation level)
    auc: float
    tpr_at_fpr_0_01: float
    tpr_at_fpr_0_1: float
    empirical_epsilon: float
    empirical_kind: str  # what the empirical epsilon is: a lower bound at a confidence, or an estimate
    accountant_epsilon: float
    delta: float
    noise_multiplier: float
    claimed_epsilon: float | None = None  # the paper's per-message analysis, where it differs from ours
    estimate_epsilon: float | None = None  # canaries: Andrew et al.'s estimate (not a bound)
    null_epsilon: float | None = None  # canaries: that estimate with nothing inserted, its noise floor
    seconds: float = 0.0

    def to_json(self) -> dict:
        out = asdict(self)
        out["tpr_at_fpr_0.01"], out["tpr_at_fpr_0.1"] = out.pop("tpr_at_fpr_0_01"), out.pop("tpr_at_fpr_0_1")
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in out.items()}  # null: infinite


def verdict(result: dict) -> str:
    """What an audit (its JSON form) says about the claims: its empirical epsilon is a lower bound."""
    empirical, accountant, claimed = result["empirical_epsilon"], result["accountant_epsilon"], result["claimed_epsilon"]
    if accountant is None:
        return "not private, as the accountant says"
    if empirical > accountant:
        return "the accountant is refuted"
    if claimed is not None and empirical > claimed:
        return f"the accountant holds; the paper's per-message epsilon {claimed:.2f} is refuted"
    return "the accountant holds"


def summarize(name: str, level: str, members: np.ndarray, others: np.ndarray, *, threat_model: str, attack: str,
              empirical_epsilon: float, empirical_kind: str, accountant: float, delta: float,
              noise_multiplier: float, claimed: float | None = None, estimate: float | None = None,
              null_epsilon: float | None = None, seconds: float = 0.0) -> AuditResult:
    return AuditResult(name, level, threat_model, attack, len(members), roc_auc(members, others),
                       tpr_at_fpr(members, others, 0.01), tpr_at_fpr(members, others, 0.1), empirical_epsilon,
                       empirical_kind, accountant, delta, noise_multiplier, claimed, estimate, null_epsilon, seconds)


# -- mechanism level --------------------------------------------------------------------------------
def _unit(rng: np.random.Generator, m: int, *, orthogonal_to: np.ndarray | None = None) -> np.ndarray:
    u = rng.standard_normal(m)
    if orthogonal_to is not None:
        u -= (u @ orthogonal_to) * orthogonal_to
    return u / np.linalg.norm(u)


def _sketched_form(x: np.ndarray, vectorized: bool) -> np.ndarray:
    """What the sketch multiplies from the left: X (m x r) for SGMM, vec(X) as one column for SGMV."""
    return x.T.reshape(-1, 1) if vectorized else x


def mechanism_name(mechanism: Mechanism, clients_per_round: int = 1) -> str:
    """E.g. "SGMM b=64, z=1, secret sketch shared by 4 clients"."""
    sketch = mechanism.sketch
    parts = ["GM" if isinstance(sketch, NoSketch) else
             f"SGMV h={sketch.dim}" if isinstance(sketch, VectorSketch) else f"SGMM b={sketch.dim}",
             f"z={mechanism.noise_multiplier:.3g}" if mechanism.private else "no noise"]
    if not isinstance(sketch, NoSketch):
        parts.append("known sketch" if mechanism.threat_model is ThreatModel.KNOWN_SKETCH else
                     "secret sketch" + (f" shared by {clients_per_round} clients" if clients_per_round > 1 else ""))
    return ", ".join(parts)


def audit_mechanism(mechanism: Mechanism, *, shape: tuple[int, int] = (192, 4), trials: int = 5000,
                    delta: float = 1e-5, seed: int = 0, clients_per_round: int = 1,
                    confidence: float = CONFIDENCE) -> AuditResult:
    """Membership test against ``trials`` releases of X and of its neighbour X' through ``mechanism``.

    ``clients_per_round`` > 1 (secret sketch only) adds the round's other clients, who share R and whose
    messages the attacker knows. Their N - 1 releases enter as their mean, which is exactly distributed as
    one release with noise multiplier z / sqrt(N - 1): same information, one call instead of N - 1.
    """
    if mechanism.clip_norm is None:
        raise ValueError("An audit needs a clip norm: the neighbouring messages sit at it.")
    label = mechanism.trust_model + ("; one release, its sample known (no amplification)" if mechanism.private else "")
    # Noise at the server: whoever sees the noisy sum and knows the round's other messages (DP fixes everyone but
    # the target) sees the target's constrained message plus the server's noise, the release audited here.
    mechanism = replace(mechanism, placement=NoisePlacement.CLIENT)
    if trials < 100:
        raise ValueError(f"An audit needs at least 100 trials per hypothesis, got {trials}.")
    m, r = shape
    started = time.perf_counter()
    knows_r = isinstance(mechanism.sketch, NoSketch) or mechanism.threat_model is ThreatModel.KNOWN_SKETCH
    colluders = 0 if knows_r else clients_per_round - 1
    vectorized = isinstance(mechanism.sketch, VectorSketch)
    tau = mechanism.clip_norm
    rng = np.random.default_rng(seed)
    u = _unit(rng, m)
    v, v2 = np.eye(r)[0], np.eye(r)[min(1, r - 1)]
    x = tau * np.outer(u, v)
    if knows_r or colluders:
        neighbour = -x  # R known (or revealed by the colluders): the sign shows; distance 2 tau
    elif vectorized or r == 1:
        neighbour = np.zeros_like(x)  # only the norm shows
    else:
        neighbour = tau * np.outer(_unit(rng, m, orthogonal_to=u), v2)  # another row space
    messages = {1: {ENTRY: torch.from_numpy(x).float()}, 0: {ENTRY: torch.from_numpy(neighbour).float()}}
    noiseless = replace(mechanism, noise_multiplier=0.0)
    helpers = replace(mechanism, noise_multiplier=mechanism.noise_multiplier / math.sqrt(max(colluders, 1)))
    noise = torch.Generator().manual_seed(seed)
    sketch_seed = int(rng.integers(2 ** 62))
    observed = {1: [], 0: []}
    for trial in range(trials):
        for member in (1, 0):
            key = SketchKey(sketch_seed, 2 * trial + member)  # a fresh R every release
            y = mechanism.privatize(messages[member], key=key, noise=noise)[ENTRY].double()
            if knows_r:  # the likelihood ratio of N(M(X), s^2) vs N(-M(X), s^2); M odd, so M(-X) = -M(X)
                observed[member].append(float((y * noiseless.privatize(messages[1], key=key)[ENTRY].double()).sum()))
            else:
                rows = y.reshape(y.shape[0], -1).numpy()
                if colluders:
                    known = helpers.privatize(messages[1], key=key, noise=noise)[ENTRY].double()
                    rows = np.concatenate([rows, known.reshape(known.shape[0], -1).numpy()], axis=1)
                observed[member].append(rows)
    if knows_r:
        scores = {h: np.asarray(s) for h, s in observed.items()}
        attack = "likelihood ratio, R known"
    else:
        scores = _covariance_scores(observed, x, neighbour, vectorized=vectorized, colluders=colluders,
                                    sketch_dim=mechanism.sketch.dim, sigma=mechanism.noise_std, tau=tau)
        attack = "covariance likelihood ratio, R secret" + (f", {colluders} colluding clients" if colluders else "")
    accountant, claimed = _accountant(mechanism, rank=r, clients_per_round=1 if knows_r else clients_per_round,
                                      delta=delta)
    bound = epsilon_lower_bound(scores[1], scores[0], delta=delta, confidence=confidence, seed=seed)
    return summarize(mechanism_name(mechanism, 1 if knows_r else clients_per_round), "mechanism", scores[1],
                     scores[0], threat_model=label, attack=attack, empirical_epsilon=bound,
                     empirical_kind=f"lower bound at {confidence:.0%} confidence, Clopper-Pearson",
                     accountant=accountant, delta=delta, noise_multiplier=mechanism.noise_multiplier,
                     claimed=claimed, seconds=time.perf_counter() - started)


def audit_secure_sum(mechanism: Mechanism, *, clients_per_round: int, min_replies: int, alone: bool = False,
                     shape: tuple[int, int] = (192, 4), trials: int = 5000, delta: float = 1e-5, seed: int = 0,
                     confidence: float = CONFIDENCE) -> AuditResult:
    """Membership test against secure aggregation's release (noise-placement = "secagg"), through the product's codec.

    The target client's constrained message (``mechanism.constrain``: clip, sketch, clip) of X or X' = -X (distance
    2 tau; R is public under the known-sketch model secagg needs) is encoded by ``fedlora.secure_sum`` (scaled,
    randomly rounded, its Skellam noise share, reduced modulo 2^bits). A server that follows SecAgg+ decodes the
    modular sum with N_min - 1 other replies: DP fixes their messages and the attacker knows them, so they add only
    their noise shares, drawn here as one Skellam of their total variance (a sum of independent Skellams is exactly
    that). ``alone``: a server that breaks the protocol decodes the target's reply by itself, its own share only.
    The score is <Y, M(X)>, the Gaussian likelihood ratio the Skellam noise approaches.
    """
    if not mechanism.private or mechanism.clip_norm is None:
        raise ValueError("Secure aggregation's audit needs a private mechanism: its noise is in the client shares.")
    if trials < 100:
        raise ValueError(f"An audit needs at least 100 trials per hypothesis, got {trials}.")
    started = time.perf_counter()
    m, r = shape
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(mechanism.clip_norm * np.outer(_unit(rng, m), np.eye(r)[0])).float()
    key = SketchKey(int(rng.integers(2 ** 62)), 1)  # public under known-sketch: the attacker recomputes M(X)
    released = {h: mechanism.constrain({ENTRY: sign * x}, key=key) for h, sign in ((1, 1.0), (0, -1.0))}
    target = released[1][ENTRY].double().numpy().ravel()
    codec = SkellamSecureSum(mechanism.noise_multiplier, mechanism.clip_norm, clients_per_round, min_replies,
                             target.size)
    others_lam = 0.0 if alone else (min_replies - 1) * codec.share_variance / 2
    observed = {1: [], 0: []}
    for _ in range(trials):
        for member in (1, 0):
            total = codec.encode(released[member], rng)[ENTRY].ravel()
            if others_lam:
                total = total + rng.poisson(others_lam, total.size) - rng.poisson(others_lam, total.size)
            y = codec.decode({ENTRY: total}, torch.float64)[ENTRY].numpy()
            observed[member].append(float(y @ target))
    scores = {h: np.asarray(s) for h, s in observed.items()}
    release = codec.message_release() if alone else codec.release()
    sampling = SamplingScheme("fixed", clients_per_round, clients_per_round=clients_per_round)
    observer = Observer.ONE_REPLY if alone else Observer.SERVER  # who sees one reply, or the sum, knowing whose
    accountant = accountant_epsilon([Phase("audit", (codec.release(),), sampling, 1)], delta=delta,
                                    threat_model=mechanism.threat_model.value, placement="secagg",
                                    observer=observer).epsilon
    view = "SecAgg+ broken: one reply alone" if alone else f"SecAgg+: sum of N_min = {min_replies} of {clients_per_round}"
    return summarize(f"{mechanism_name(mechanism)}, {view}", "mechanism", scores[1], scores[0],
                     threat_model=trust_label(mechanism.threat_model.value, "secagg", observer),
                     attack="likelihood ratio, R known, others' messages known",
                     empirical_epsilon=epsilon_lower_bound(scores[1], scores[0], delta=delta, confidence=confidence,
                                                           seed=seed),
                     empirical_kind=f"lower bound at {confidence:.0%} confidence, Clopper-Pearson",
                     accountant=accountant, delta=delta, noise_multiplier=release.noise_multiplier,
                     seconds=time.perf_counter() - started)


def _covariance_scores(observed: dict, x: np.ndarray, neighbour: np.ndarray, *, vectorized: bool, colluders: int,
                       sketch_dim: int, sigma: float, tau: float) -> dict[int, np.ndarray]:
    """The Gaussian log-likelihood ratio of each release's sketch rows (up to a constant):
    0.5 sum_i y_i^T (S0^-1 - S1^-1) y_i, with S = G^T G / b + noise covariance. Without noise S is
    singular; a variance far below float32 resolution stands in for zero."""
    floor = 1e-10 * tau ** 2 / sketch_dim

    def covariance(target: np.ndarray) -> np.ndarray:
        g = _sketched_form(target, vectorized)
        noise = [sigma ** 2] * g.shape[1]
        if colluders:
            g = np.concatenate([g, _sketched_form(x, vectorized)], axis=1)
            noise += [sigma ** 2 / colluders] * (g.shape[1] - len(noise))
        return g.T @ g / sketch_dim + np.diag(np.maximum(noise, floor))

    form = np.linalg.inv(covariance(neighbour)) - np.linalg.inv(covariance(x))
    return {h: 0.5 * np.einsum("tbi,ij,tbj->t", np.stack(rows), form, np.stack(rows)) for h, rows in observed.items()}


def _accountant(mechanism: Mechanism, *, rank: int, clients_per_round: int, delta: float) -> tuple[float, float | None]:
    """The accountant's epsilon for one release without sampling (replace-one, as for the run's fixed-size
    sampling), and the paper's per-message epsilon where the sketch is secret and shared."""
    sampling = SamplingScheme("fixed", clients_per_round, clients_per_round=clients_per_round)

    def of(n: int) -> float:
        release = mechanism.release(rank=rank, clients_per_round=n, dense=False)
        return accountant_epsilon([Phase("audit", release, sampling, 1)], delta=delta,
                                  threat_model=mechanism.threat_model.value, allow_unsound_per_message=n == 1).epsilon

    ours = of(clients_per_round)
    shared_secret = mechanism.private and clients_per_round > 1 and not isinstance(mechanism.sketch, NoSketch)
    return ours, of(1) if shared_secret and mechanism.threat_model is ThreatModel.SECRET_SKETCH else None


# -- federation level (canaries) --------------------------------------------------------------------
def model_view(protocol, state, template: dict[str, torch.Tensor], entries: list[str]) -> np.ndarray:
    """What a round's global state means in full space, as one vector over the canaries' ``entries``:
    de-sketched with its release's R (as clients do), B A per layer for FlexLoRA (whose factors the SVD
    redistribution rotates), the entries themselves otherwise. What clients download, not the server's dense
    products (FlexLoRA updates): a canary's product change is seen through the top-r factors of the products."""
    from fedlora.round_plan import DENSE

    message = state.broadcast
    if state.produced_by != DENSE:
        message = protocol.mechanism.desketch(message, key=protocol.key(state.produced_by),
                                              shapes={n: tuple(t.shape) for n, t in template.items()})
    return _flat(message, entries, flex=protocol.mode is LoRAMode.FLEX)


def canary_signature(protocol, message: dict[str, torch.Tensor]) -> np.ndarray:
    """A canary's message in the same full-space form as ``model_view``."""
    return _flat(message, list(message), flex=protocol.mode is LoRAMode.FLEX)


def _flat(message: dict[str, torch.Tensor], entries: list[str], *, flex: bool) -> np.ndarray:
    parts = []
    for name in sorted(entries):
        if flex and side_of(name) is Side.RIGHT:
            continue  # inside its layer's product
        if is_product(name) and name not in message:  # a state's product: its factors'
            name = f"{layer_of(name)}.lora_B"
        t = message[name].double()
        if flex and side_of(name) is Side.LEFT and not is_product(name):
            a = message[f"{layer_of(name)}.lora_A"].double()
            if t.shape[1] != a.shape[0]:
                raise ValueError(f"'{name}' has rank {t.shape[1]} but its A has rank {a.shape[0]}.")
            t = t @ a
        parts.append(t.reshape(-1).numpy())
    return np.concatenate(parts)


def canary_scores(views: np.ndarray, signatures: np.ndarray) -> np.ndarray:
    """Each canary's largest cosine with a round's update of the global model (rows of ``views`` are the
    states before round 1, after round 1, ..., after round T): every round's aggregate is released."""
    updates = np.diff(views, axis=0)
    updates /= np.maximum(np.linalg.norm(updates, axis=1, keepdims=True), 1e-300)
    unit = signatures / np.linalg.norm(signatures, axis=1, keepdims=True)
    return (unit @ updates.T).max(axis=1)
