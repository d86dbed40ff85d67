"""fedlora.shamir against Flower's own Shamir: the same secret from the same shares, on every input, whichever of the
two split it."""

import os
import random

import pytest
from flwr.common.secure_aggregation.crypto.shamir import combine_shares as flower_combine
from flwr.common.secure_aggregation.crypto.shamir import create_shares

from fedlora import shamir
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


@pytest.mark.parametrize(("threshold", "num", "length"), [(2, 3, 32), (5, 8, 306), (3, 3, 16), (45, 50, 32), (1, 1, 0)])
def test_fedlora_s_split_combines_through_flower_s_from_any_threshold_of_its_shares(threshold, num, length):
    rng = random.Random(threshold * num + length)
    secret = rng.randbytes(length)
    shares = shamir.create_shares(secret, threshold, num)
    assert [len(s) for s in shares] == [len(s) for s in create_shares(secret, threshold, num)]  # Flower's layout
    assert [int.from_bytes(s[:4], "little") for s in shares] == list(range(1, num + 1))
    for size in (threshold, num):
        subset = rng.sample(shares, size)
        assert flower_combine(subset) == secret and combine_shares(subset) == secret


def test_fedlora_s_split_is_pycryptodome_s_byte_for_byte_given_the_same_coefficients(monkeypatch):
    """Each chunk's polynomial, fed the same random coefficients, gives PyCryptodome's Shamir.split's shares (Flower's
    split) to the byte; a fresh 128-bit draw for every coefficient of every chunk."""
    from Crypto.Protocol import SecretSharing

    threshold, num, secret = 4, 9, os.urandom(40)  # 48 padded bytes: 3 chunks
    draws = [[int.from_bytes(os.urandom(16), "big") for _ in range(3)] for _ in range(threshold - 1)]  # [degree][chunk]
    stream = iter(value for row in draws for value in row)
    monkeypatch.setattr(shamir.secrets, "randbits", lambda bits: next(stream) if bits == 128 else pytest.fail(bits))
    ours = shamir.create_shares(secret, threshold, num)
    assert next(stream, None) is None  # every draw used, none reused
    padded = secret + bytes([8]) * 8
    for chunk in range(3):
        coefficients = iter(draws[degree][chunk].to_bytes(16, "big") for degree in range(threshold - 1))
        monkeypatch.setattr(SecretSharing, "rng", lambda size: next(coefficients))
        theirs = SecretSharing.Shamir.split(threshold, num, padded[16 * chunk:16 * (chunk + 1)], ssss=False)
        ours_of_chunk = [(index, share[4 + 16 * chunk:4 + 16 * (chunk + 1)]) for index, share in enumerate(ours, 1)]
        assert ours_of_chunk == theirs


def test_fedlora_s_split_is_random_and_its_shares_below_the_threshold_miss_the_secret():
    """Two splits of one secret share no share; threshold - 1 shares decode to something else (or nothing)."""
    secret = b"s" * 32
    first, second = shamir.create_shares(secret, 5, 8), shamir.create_shares(secret, 5, 8)
    assert not set(first) & set(second)
    for seed in range(20):
        assert _outcome(flower_combine, random.Random(seed).sample(shamir.create_shares(secret, 5, 8), 4)) != secret


def test_the_packed_product_is_the_field_s_in_every_chunk():
    """Horner by a 32-bit index in one packed integer gives, slot by slot, gf_mul's product."""
    values = [int.from_bytes(os.urandom(16), "big") for _ in range(4)] + [shamir.MASK]
    packed = sum(v << (shamir.SLOT * c) for c, v in enumerate(values))
    low = sum(shamir.MASK << (shamir.SLOT * c) for c in range(len(values)))
    for index in (1, 2, 3, 100, (1 << 32) - 1):
        product = shamir._times_index(packed, index, low)
        assert [(product >> (shamir.SLOT * c)) & shamir.MASK for c in range(len(values))] == [
            gf_mul(v, index) for v in values]
        assert product == product & low


@pytest.mark.parametrize(("threshold", "num"), [(0, 3), (4, 3), (2, 1 << 32)])
def test_the_split_refuses_a_threshold_it_cannot_honour(threshold, num):
    with pytest.raises(ValueError, match="threshold"):
        shamir.create_shares(b"k", threshold, num)
