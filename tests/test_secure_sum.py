"""The distributed Skellam encoding of secure aggregation (fedlora.secure_sum)."""

import math

import numpy as np
import pytest
import torch

from fedlora.secure_sum import ROUNDING_BETA, SkellamSecureSum


def _release(rng, norm=1.0):
    message = {"layer.lora_B": torch.tensor(rng.normal(size=(6, 4)), dtype=torch.float32),
               "classifier.weight": torch.tensor(rng.normal(size=(3, 5)), dtype=torch.float32)}
    total = math.sqrt(sum(float(t.double().pow(2).sum()) for t in message.values()))
    return {n: t * (norm * 0.999 / total) for n, t in message.items()}


def _sum(messages):
    return {n: sum(m[n].double() for m in messages) for n in messages[0]}


def test_the_decoded_sum_is_the_plain_sum_within_the_rounding_and_the_noise():
    rng = np.random.default_rng(0)
    releases = [_release(rng) for _ in range(5)]
    codec = SkellamSecureSum(noise_multiplier=1e-4, clip_norm=1.0, clients=5, min_replies=3, dim=39)
    encodings = [codec.encode(r, np.random.default_rng(i)) for i, r in enumerate(releases)]
    total = {n: sum(e[n] for e in encodings) for n in encodings[0]}  # what SecAgg+ gives, up to multiples of 2c
    decoded, plain = codec.decode(total, torch.float64), _sum(releases)
    noise_std = 1e-4 * math.sqrt(5 / 3)
    for name in plain:
        error = (decoded[name] - plain[name]).abs().max().item()
        assert error <= 5 / codec.scale + 8 * noise_std  # each client's rounding moves an entry by < 1 / gamma
    assert all(e[n].dtype == np.int64 and e[n].min() >= -codec.half_range and e[n].max() < codec.half_range
               for e in encodings for n in e)


def test_decoding_is_modular():
    """SecAgg+ sums modulo 2^32 and shifts every vector by c: any integer congruent modulo 2c decodes the same."""
    codec = SkellamSecureSum(1.0, 1.0, clients=4, min_replies=3, dim=3)
    c = codec.half_range
    total = {"x": np.array([5, -7, c - 1], dtype=np.int64)}
    shifted = {"x": total["x"] + np.array([2 * c, -6 * c, 4 * c]) + 2 ** 32}
    assert torch.equal(codec.decode(total, torch.float64)["x"], codec.decode(shifted, torch.float64)["x"])


def test_the_sum_carries_the_noise_of_the_server_placement():
    """N_min shares of variance V / N_min add up to V = (z gamma tau)^2: the decoded noise has std z tau."""
    codec = SkellamSecureSum(noise_multiplier=2.0, clip_norm=0.5, clients=4, min_replies=4, dim=20_000)
    zero = {"w": torch.zeros(20_000)}
    encodings = [codec.encode(zero, np.random.default_rng(i)) for i in range(4)]
    noise = codec.decode({"w": sum(e["w"] for e in encodings)}, torch.float64)["w"]
    assert noise.std().item() == pytest.approx(2.0 * 0.5, rel=0.03)
    assert abs(noise.mean().item()) < 0.05


def test_at_the_quickstarts_scale_the_decoded_noise_is_the_servers_gaussian_scaled_by_n_over_n_min():
    """Shares of Poisson rate ~1e12 (epsilon 4 at the quickstart: z 2.16, N = 50, N_min = 45): the sum of N shares
    is Gaussian in shape (Kolmogorov-Smirnov) with variance N / N_min times the server's (z tau)^2."""
    from scipy import stats

    z, n, n_min, dim = 2.16015625, 50, 45, 11_136
    codec = SkellamSecureSum(z, 1.0, clients=n, min_replies=n_min, dim=dim)
    assert codec.share_variance / 2 > 1e12
    zero = {"w": torch.zeros(dim)}
    noise = codec.decode({"w": sum(codec.encode(zero, np.random.default_rng(i))["w"] for i in range(n))},
                         torch.float64)["w"].numpy()
    std = z * math.sqrt(n / n_min)
    assert noise.std() == pytest.approx(std, rel=0.03) and abs(noise.mean()) < 4 * std / math.sqrt(dim)
    assert stats.kstest(noise / std, "norm").pvalue > 0.01


def test_rounding_moves_each_entry_less_than_one_nearly_unbiased_and_its_bound_holds_for_most_draws():
    """The bound B is the sensitivity the noise is calibrated to: the rounding is redrawn until it holds, so what can
    fail is B itself, too tight (it must hold for at least 1 - beta of the unconditioned draws) or too loose (no
    better than the triangle inequality's)."""
    codec = SkellamSecureSum(1.0, 1.0, clients=3, min_replies=3, dim=39, bits=12)  # coarse: rounding matters
    rng = np.random.default_rng(1)
    scaled = np.concatenate([t.double().numpy().ravel() for t in _release(rng).values()]) * codec.scale
    low, fraction = np.floor(scaled), scaled - np.floor(scaled)
    unconditioned = low + (rng.random((20000, scaled.size)) < fraction)
    assert (np.linalg.norm(unconditioned, axis=1) > codec.norm_bound).mean() <= ROUNDING_BETA
    assert codec.norm_bound < np.linalg.norm(scaled) + math.sqrt(scaled.size) - 1  # Thm 2's, not the loose one
    rounded = np.stack([codec._round(scaled, np.random.default_rng(i)) for i in range(4000)])
    assert np.abs(rounded - scaled).max() < 1
    assert np.abs(rounded.mean(axis=0) - scaled).max() < 0.1  # the conditioning biases it by about 0.04 here


@pytest.mark.parametrize("kwargs, message", [
    ({"min_replies": 1}, "fewest replies summed"),
    ({"min_replies": 2}, "32-bit mask seeds"),
    ({"min_replies": 5}, "fewest replies summed"),
    ({"noise_multiplier": 0.0}, "must be positive"),
    ({"bits": 32}, r"2\^8 to 2\^30"),
])
def test_bad_parameters_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SkellamSecureSum(**{"noise_multiplier": 1.0, "clip_norm": 1.0, "clients": 4, "min_replies": 3, "dim": 3,
                            **kwargs})


def test_only_a_clipped_release_is_encoded():
    codec = SkellamSecureSum(1.0, 1.0, clients=4, min_replies=3, dim=39)
    with pytest.raises(ValueError, match="clipped to the clip norm"):
        codec.encode(_release(np.random.default_rng(0), norm=2.0), np.random.default_rng(0))
