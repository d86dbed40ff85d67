"""The secret-sketch curves bound the exact Renyi divergence between the output Gaussians."""

import numpy as np
import pytest

from fedlora.privacy.curves import gaussian_renyi_divergence, shared_sketch_divergence, sketched_rdp, skellam_rdp

ALPHAS = [1.5, 2.0, 3.0, 4.0, 8.0]


def _unit(rng, shape):
    x = rng.standard_normal(shape)
    return x / np.linalg.norm(x)


def test_reference_number_of_the_design_note():
    # PRIVACY.md: m=30, r=2, b=12, z=1.5, alpha=4 -> paper per-message bound 0.174
    assert sketched_rdp([4.0], sketch_dim=12, rank=2, noise_multiplier=1.5)[0] == pytest.approx(0.174, abs=5e-4)


def test_gaussian_divergence_closed_form_matches_the_scalar_formula():
    # D_alpha(N(0, s1) || N(0, s2)) for scalars
    s1, s2, a = 1.0, 1.2, 3.0
    mixed = a * s2 + (1 - a) * s1
    expected = np.log(mixed / (s1 ** (1 - a) * s2 ** a)) / (2 * (1 - a))
    assert gaussian_renyi_divergence(np.array([[s1]]), np.array([[s2]]), a) == pytest.approx(expected, rel=1e-12)
    assert gaussian_renyi_divergence(np.eye(2), np.eye(2), 2.0) == pytest.approx(0.0, abs=1e-12)
    # alpha s2 + (1 - alpha) s1 <= 0: the divergence is infinite
    assert gaussian_renyi_divergence(np.array([[1.3]]), np.array([[0.8]]), 3.0) == np.inf


@pytest.mark.parametrize("m, r, b, z", [(30, 2, 12, 1.5), (64, 4, 16, 1.0), (40, 1, 8, 2.0), (50, 3, 25, 0.8)])
def test_per_message_curve_bounds_the_exact_divergence(m, r, b, z):
    rng = np.random.default_rng(0)
    tau, sigma = 1.0, z
    pairs = [(_unit(rng, (m, r)), np.zeros((m, r))) for _ in range(5)]  # X' = 0 (add/remove)
    pairs += [(_unit(rng, (m, r)), _unit(rng, (m, r))) for _ in range(5)]  # random replace-one pairs
    v = _unit(rng, (m, 1))
    pairs += [(np.hstack([v] + [np.zeros((m, 1))] * (r - 1)), np.zeros((m, r))),  # rank one, full norm
              (tau * np.eye(m, r) / np.sqrt(r), np.zeros((m, r)))]  # spread over r directions
    bound = sketched_rdp(ALPHAS, sketch_dim=b, rank=r, noise_multiplier=z)
    for x, x2 in pairs:
        for alpha, eps in zip(ALPHAS, bound):
            for p, q in ((x, x2), (x2, x)):
                exact = shared_sketch_divergence(p, q, sketch_dim=b, sigma=sigma, alpha=alpha)
                assert exact <= eps + 1e-12


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 64])
def test_shared_sketch_bound_holds_for_the_joint_release(n):
    """Other clients aligned with the target client (the worst case of PRIVACY.md) and random ones."""
    m, r, b, z = 30, 2, 12, 1.5
    rng = np.random.default_rng(n)
    x = _unit(rng, (m, r))
    aligned = np.hstack([x] * n)
    configurations = [(aligned, np.hstack([np.zeros((m, r))] + [x] * (n - 1))),  # target removed
                      (aligned, np.hstack([-x] + [x] * (n - 1)))]  # target replaced by its opposite
    for _ in range(3):
        others = [_unit(rng, (m, r)) for _ in range(n - 1)]
        configurations.append((np.hstack([_unit(rng, (m, r))] + others), np.hstack([_unit(rng, (m, r))] + others)))
    bound = sketched_rdp(ALPHAS, sketch_dim=b, rank=r, noise_multiplier=z, clients_per_round=n)
    for g, g2 in configurations:
        for alpha, eps in zip(ALPHAS, bound):
            for p, q in ((g, g2), (g2, g)):
                assert shared_sketch_divergence(p, q, sketch_dim=b, sigma=z, alpha=alpha) <= eps + 1e-12


def test_the_per_message_bound_fails_for_shared_sketches():
    """Why the joint bound exists: with N = 32 aligned clients the paper's per-message bound is exceeded."""
    m, r, b, z, alpha, n = 30, 2, 12, 1.5, 4.0, 32
    x = _unit(np.random.default_rng(1), (m, r))
    exact = shared_sketch_divergence(np.hstack([x] * n), np.hstack([np.zeros((m, r))] + [x] * (n - 1)),
                                     sketch_dim=b, sigma=z, alpha=alpha)
    assert exact > sketched_rdp([alpha], sketch_dim=b, rank=r, noise_multiplier=z)[0]


def test_multi_layer_messages_clipped_once_are_covered():
    """Two layers with independent sketches, one clip over both: divergences add, the curve still bounds."""
    rng = np.random.default_rng(3)
    m, r, b, z = 24, 2, 10, 1.2
    for split in (0.5, 0.9, 1.0):
        x1, x2 = np.sqrt(split) * _unit(rng, (m, r)), np.sqrt(1 - split) * _unit(rng, (m, r))
        bound = sketched_rdp(ALPHAS, sketch_dim=b, rank=r, noise_multiplier=z)
        for alpha, eps in zip(ALPHAS, bound):
            total = sum(shared_sketch_divergence(x, np.zeros_like(x), sketch_dim=b, sigma=z, alpha=alpha)
                        for x in (x1, x2))
            assert total <= eps + 1e-12


def test_curves_are_infinite_outside_their_domain_and_never_nan():
    curve = sketched_rdp([1.01, 2, 10, 100, 1e4, np.inf], sketch_dim=4, rank=2, noise_multiplier=0.5)
    assert not np.any(np.isnan(curve)) and np.isinf(curve[-1]) and np.isinf(curve[-2])
    assert np.all(np.isinf(sketched_rdp([2.0, 3.0], sketch_dim=150, rank=4, noise_multiplier=0.0)))


@pytest.mark.parametrize("kwargs, match", [
    (dict(sketch_dim=0, rank=1, noise_multiplier=1.0), "at least 1"),
    (dict(sketch_dim=4, rank=1, noise_multiplier=-1.0), "non-negative"),
    (dict(sketch_dim=4, rank=1, noise_multiplier=1.0, clients_per_round=0), "at least 1"),
])
def test_bad_curve_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sketched_rdp([2.0], **kwargs)
    with pytest.raises(ValueError, match="greater than 1"):
        sketched_rdp([1.0], sketch_dim=4, rank=1, noise_multiplier=1.0)


@pytest.mark.parametrize("variance, shift", [(8.0, 1), (50.0, 3), (400.0, 10)])
def test_the_skellam_curve_bounds_the_exact_divergence_of_a_shifted_skellam(variance, shift):
    """D_alpha(Sk + shift || Sk) summed over the pmf (one entry: D1 = D2 = shift), at integer and fractional orders;
    its Gaussian term alpha shift^2 / (2 V) is the leading one."""
    from scipy.stats import skellam

    k = np.arange(-int(60 * np.sqrt(variance)) - shift, int(60 * np.sqrt(variance)) + shift + 1)
    log_p, log_q = skellam.logpmf(k - shift, variance / 2, variance / 2), skellam.logpmf(k, variance / 2, variance / 2)
    kept = np.isfinite(log_p) & np.isfinite(log_q)  # the far tails underflow; their terms are negligible
    log_p, log_q = log_p[kept], log_q[kept]
    for alpha in ALPHAS + [2.5, 16.0]:
        exact = np.logaddexp.reduce(alpha * log_p + (1 - alpha) * log_q) / (alpha - 1)
        bound = skellam_rdp([alpha], l2_sensitivity=shift, variance=variance, dim=1)[0]
        assert exact <= bound + 1e-12
        assert bound >= alpha * shift ** 2 / (2 * variance)
    assert skellam_rdp([2.0], l2_sensitivity=1.0, variance=0.0, dim=1)[0] == np.inf
