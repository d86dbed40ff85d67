"""RDP curves of the sketched Gaussian mechanisms under the secret-sketch threat model and of secure
aggregation's distributed Skellam mechanism, and the closed-form Renyi divergences between Gaussians that test
them. Pure NumPy; no accountant here.

Notation (fedlora.sketch): the release of one matrix X (m x r, ||X||_F <= tau) is b
i.i.d. rows y_i ~ N(0, X^T X / b + sigma^2 I_r) when R is secret. z = sigma / tau.
The derivation of the shared-sketch bound is in shared_sketch_bound.md beside this file.
"""

from __future__ import annotations

import numpy as np


def _g(u: float, alpha: np.ndarray) -> np.ndarray:
    """max(f(1 + u), f(1 - u)) with f(x) = alpha ln x - ln(1 - alpha + alpha x): the worst eigenvalue of the
    covariance ratio within [1 - u, 1 + u]. log1p forms keep it accurate (and >= 0) for tiny u; +inf where
    1 - alpha u <= 0 (the bound's domain ends), never NaN."""
    with np.errstate(divide="ignore", invalid="ignore"):
        upper = alpha * np.log1p(u) - np.log1p(alpha * u)
        lower = np.where(alpha * u < 1, alpha * np.log1p(-u) - np.log1p(-alpha * u), np.inf)
    return np.maximum(np.maximum(upper, lower), 0.0)


def _orders(orders) -> np.ndarray:
    alpha = np.atleast_1d(np.asarray(orders, dtype=float))
    if np.any(np.isnan(alpha) | (alpha <= 1)):
        raise ValueError("Renyi orders must be greater than 1.")
    return alpha


def _finite_orders_only(curve: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """+inf at alpha = inf (accountants probe it), instead of the NaN the closed forms give there."""
    return np.where(np.isinf(alpha), np.inf, curve)


def _check(sketch_dim: int, rank: int, noise_multiplier: float, clients_per_round: int) -> None:
    if sketch_dim < 1 or rank < 1:
        raise ValueError(f"Sketch dimension and rank must be at least 1, got b={sketch_dim}, r={rank}.")
    if not noise_multiplier >= 0:
        raise ValueError(f"Noise multiplier must be non-negative, got {noise_multiplier}.")
    if clients_per_round < 1:
        raise ValueError(f"Clients per round must be at least 1, got {clients_per_round}.")


def sketched_rdp(orders, *, sketch_dim: int, rank: int, noise_multiplier: float,
                 clients_per_round: int = 1) -> np.ndarray:
    """RDP of one round's release of SGMM (or SGMV with (b, r) -> (h, 1)) when R is secret.

    clients_per_round = 1 is the paper's Lemma 2.7, in its exact (not Taylor) form:
        eps(alpha) = (b r / (2 (alpha - 1))) max(f(1 + u), f(1 - u)),  u = 2 / (b z^2).
    N > 1 bounds the JOINT release of the N clients that share R in Algorithms 1-2:
        eps_N(alpha) = (b k / (2 (alpha - 1))) max(f(1 + u_N), f(1 - u_N)),
        u_N = (2 + 2 sqrt(N - 1)) / (b z^2),  k = 2 r,
    which reduces to Lemma 2.7 at N = 1. Valid for a whole multi-layer message clipped at tau,
    under the replace-one and add/remove relations. +inf where the bound's domain ends; never NaN.
    """
    _check(sketch_dim, rank, noise_multiplier, clients_per_round)
    alpha = _orders(orders)
    if noise_multiplier == 0:
        return np.full_like(alpha, np.inf)
    n = clients_per_round
    u = (2.0 + 2.0 * np.sqrt(n - 1)) / (sketch_dim * noise_multiplier ** 2)
    k = rank if n == 1 else 2 * rank
    finite = np.where(np.isinf(alpha), 2.0, alpha)
    return _finite_orders_only(sketch_dim * k / (2.0 * (finite - 1.0)) * _g(u, finite), alpha)


def skellam_rdp(orders, *, l2_sensitivity: float, variance: float, dim: int) -> np.ndarray:
    """RDP of adding Skellam noise of variance ``variance`` per entry to an integer vector of d = ``dim`` entries
    whose neighbours differ by at most ``l2_sensitivity`` in norm (Agarwal, Kairouz and Liu 2021, Cor. 3.6),
    at integer orders:
        eps(alpha) = alpha D2^2 / (2 V) + min(((2 alpha - 1) D2^2 + 6 D1) / (4 V^2), 3 D1 / (2 V)),
    with D1 = min(D2^2, sqrt(d) D2) the L1 sensitivity of integer vectors. The first term is the Gaussian
    mechanism's of the same variance. Between integers the cumulant (alpha - 1) eps(alpha), convex in alpha, is
    bounded by its chord (as dp-accounting does for sampled Gaussians, WBK19 Cor. 10)."""
    alpha = _orders(orders)
    if not variance > 0:
        return np.full_like(alpha, np.inf)
    d2 = float(l2_sensitivity)
    d1 = min(d2 * d2, np.sqrt(dim) * d2)

    def cumulant(a: np.ndarray) -> np.ndarray:  # (a - 1) eps(a) at integers a >= 1 (0 at a = 1)
        eps = a * d2 ** 2 / (2 * variance) + np.minimum(((2 * a - 1) * d2 ** 2 + 6 * d1) / (4 * variance ** 2),
                                                        3 * d1 / (2 * variance))
        return (a - 1) * eps

    finite = np.where(np.isinf(alpha), 2.0, alpha)
    low, high = np.floor(finite), np.ceil(finite)
    t = finite - low
    curve = ((1 - t) * cumulant(low) + t * cumulant(high)) / (finite - 1)
    return _finite_orders_only(curve, alpha)


def gaussian_renyi_divergence(cov_p: np.ndarray, cov_q: np.ndarray, alpha: float) -> float:
    """D_alpha(N(0, cov_p) || N(0, cov_q)), closed form; +inf where alpha cov_q + (1 - alpha) cov_p is not PD."""
    mixed = alpha * cov_q + (1.0 - alpha) * cov_p
    sign, logdet_mixed = np.linalg.slogdet(mixed)
    if sign <= 0 or np.min(np.linalg.eigvalsh((mixed + mixed.T) / 2)) <= 0:
        return float("inf")
    _, logdet_p = np.linalg.slogdet(cov_p)
    _, logdet_q = np.linalg.slogdet(cov_q)
    return float(-(logdet_mixed - (1.0 - alpha) * logdet_p - alpha * logdet_q) / (2.0 * (alpha - 1.0)))


def shared_sketch_divergence(clients: np.ndarray, neighbours: np.ndarray, *, sketch_dim: int, sigma: float,
                             alpha: float) -> float:
    """Exact D_alpha between the joint releases of N clients sharing one secret R (b x m).

    ``clients`` and ``neighbours`` are G = [X_1 ... X_N] (m x N r) for two neighbouring inputs. Each of
    the b sketch rows is N(0, G^T G / b + sigma^2 I), independently, so the divergence is b times one row's.
    """
    eye = np.eye(clients.shape[1])
    cov_p = clients.T @ clients / sketch_dim + sigma ** 2 * eye
    cov_q = neighbours.T @ neighbours / sketch_dim + sigma ** 2 * eye
    return sketch_dim * gaussian_renyi_divergence(cov_p, cov_q, alpha)
