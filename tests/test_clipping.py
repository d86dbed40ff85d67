"""Private adaptive clipping (fedlora.clipping): the clip norm converges to the target quantile, privately."""

import math
import re

import numpy as np
import pytest
import torch

from fedlora.clipping import QuantileClipping


@pytest.mark.parametrize("placement", ["client", "server"])
@pytest.mark.parametrize("quantile", [0.5, 0.8])
def test_the_clip_norm_converges_to_the_target_quantile(placement, quantile):
    """Norms log-normal around 1 (known quantiles); 100 clients a round, Andrew et al.'s defaults (step 0.2,
    count noise N / 20 on the sum: at the client each bit gets 1/sqrt(N) of it); the clip norm starts 10x off
    and its median over rounds 200-300 lies within 15% of the true quantile."""
    clipping = QuantileClipping(quantile, 0.2, 5.0 if placement == "server" else 0.5, placement)
    rng, noise = np.random.default_rng(0), torch.Generator().manual_seed(0)
    true = math.exp(0.5 * _normal_quantile(quantile))
    clip, late = 0.1, []
    for round_ in range(300):
        norms = np.exp(0.5 * rng.standard_normal(100))
        bits = [clipping.client_bit(n, clip, noise) for n in norms]
        clip = clipping.next_clip_norm(clip, clipping.noisy_fraction(bits, 100, noise))
        if round_ >= 200:
            late.append(clip)
    assert np.median(late) == pytest.approx(true, rel=0.15)


def _normal_quantile(q: float) -> float:
    from scipy import stats

    return float(stats.norm.ppf(q))


def test_bits_and_their_allowance():
    server = QuantileClipping(0.5, 0.2, 1.0, "server")
    assert server.client_bit(0.5, 1.0, None) == 1.0 and server.client_bit(2.0, 1.0, None) == 0.0
    assert server.bit_allowance() == 0.5  # exactly 0 or 1
    client = QuantileClipping(0.5, 0.2, 1.0, "client")
    noisy = [client.client_bit(0.5, 1.0, torch.Generator().manual_seed(s)) for s in range(200)]
    assert np.std(noisy) == pytest.approx(1.0, rel=0.15) and client.bit_allowance() > 6
    assert client.release().noise_multiplier == 2.0  # centred bits: sensitivity 1 = 2 x 1/2


def test_bad_settings_are_refused():
    for args, message in (((0.0, 0.2, 1.0), "quantile must lie in (0, 1), got 0.0"),
                          ((1.0, 0.2, 1.0), "quantile must lie in (0, 1), got 1.0"),
                          ((0.5, 0.0, 1.0), "needs a positive learning rate"),
                          ((0.5, 0.2, 0.0), "needs a positive learning rate and count noise")):
        with pytest.raises(ValueError, match=re.escape(message)):
            QuantileClipping(*args)
