"""fedlora.shamir against Flower's own Shamir: the same secret from the same shares, on every input."""

import os
import random

import pytest
from flwr.common.secure_aggregation.crypto.shamir import combine_shares as flower_combine
from flwr.common.secure_aggregation.crypto.shamir import create_shares

from fedlora.shamir import combine_shares, gf_inverse, gf_mul, lagrange_at_zero


def _outcome(combine, shares):
    try:
        return combine(shares)
    except ValueError:
        return ValueError


@pytest.mark.parametrize(("threshold", "num", "length"), [(2, 3, 32), (5, 8, 7), (3, 3, 16), (45, 50, 32), (2, 2, 0)])
def test_any_threshold_of_the_shares_gives_the_secret_flower_split(threshold, num, length):
    rng = random.Random(threshold * num + length)
    secret = rng.randbytes(length)
    shares = create_shares(secret, threshold, num)
    assert combine_shares(shares) == secret
    for size in (threshold, num):
        assert combine_shares(rng.sample(shares, size)) == secret


def test_below_the_threshold_it_fails_or_errs_exactly_as_flower_s():
    """Too few shares give a wrong secret or an unpadding error: the same one either way."""
    for seed in range(40):
        rng = random.Random(seed)
        secret = rng.randbytes(32)
        shares = rng.sample(create_shares(secret, 5, 8), 4)
        ours = _outcome(combine_shares, shares)
        assert ours == _outcome(flower_combine, shares) and ours != secret


def test_the_field_is_pycryptodome_s():
    """x^128 = x^7 + x^2 + x + 1, a a^-1 = 1, and the coefficients interpolate a line through (1, 3), (2, 5)."""
    assert gf_mul(1 << 127, 2) == 0b10000111
    for a in (1, 2, 0x87, int.from_bytes(os.urandom(16), "big") | 1):
        assert gf_mul(a, gf_inverse(a)) == 1
    # the line f(x) = b + s x through (1, 3) and (2, 5): (1 + 2) s = 3 + 5, addition being xor
    slope = gf_mul(3 ^ 5, gf_inverse(1 ^ 2))
    c1, c2 = lagrange_at_zero((1, 2))
    assert gf_mul(3, c1) ^ gf_mul(5, c2) == 3 ^ slope


def test_shares_that_are_not_of_one_secret_are_refused():
    shares = create_shares(b"k" * 32, 2, 3)
    with pytest.raises(ValueError, match="distinct"):
        combine_shares([shares[0], shares[0]])
    with pytest.raises(ValueError, match="not shares of one secret"):
        combine_shares([shares[0], shares[1][:-1]])
    with pytest.raises(ValueError, match="not shares of one secret"):
        combine_shares([])
