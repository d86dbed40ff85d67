"""Shamir's secret sharing for secure aggregation, free of Flower, in Flower's format (PyCryptodome's Shamir over
GF(2^128), each share a 4-byte little-endian index then 16 bytes per chunk of the PKCS#7-padded secret):
``create_shares`` for the clients' split of their key and mask seed, ``combine_shares`` for the server's unmask stage.
Each is interchangeable with Flower's function of the same name (tested both ways), stricter on bad input: a threshold
outside 1..num, or shares Flower never writes (index 0, stray bytes), raise ValueError.

Why not Flower's split: PyCryptodome evaluates each 16-byte chunk's polynomial at every index with a Python
multiplication of 128 masked steps, O(N N_min) of them per chunk; a client's 306-byte key and 32-byte seed are 23
chunks: 1.9 to 5.6 s a client and round at N = 100 on the 2-core machines here. Horner's method multiplies by the index, a public number of a few bits, and
carry-less arithmetic lets one Python integer hold every chunk's running value, so each step serves all 23.

Why not Flower's combine: the server rebuilds every summed client's secret from the same survivors' shares, and
PyCryptodome computes each secret's Lagrange coefficients anew with that multiplication, O(k^2) of them per
16 bytes: 0.7 s per 32-byte secret from 100 shares on this machine, a minute a round at N = 100. The coefficients
depend only on the share indices, which every secret of a round shares: computed once per set of indices, each secret
then costs k multiplications. The multiplication loops over the bits of the public coefficient, not of the share.
"""

from __future__ import annotations

import secrets
from functools import lru_cache

MASK = (1 << 128) - 1
BLOCK = 16  # bytes of one GF(2^128) element: a chunk of the padded secret


def gf_mul(a: int, b: int) -> int:
    """a b in GF(2^128) modulo x^128 + x^7 + x^2 + x + 1 (PyCryptodome's field: bit i the coefficient of x^i)."""
    product = 0
    while b:
        if b & 1:
            product ^= a
        a <<= 1
        b >>= 1
    for _ in range(2):  # x^128 = x^7 + x^2 + x + 1: fold the high half down twice (255 bits, then 134)
        high = product >> 128
        product = (product & MASK) ^ high ^ (high << 1) ^ (high << 2) ^ (high << 7)
    return product


def gf_inverse(a: int) -> int:
    """a^-1 = a^(2^128 - 2) in GF(2^128), by squaring and multiplying."""
    if a == 0:
        raise ValueError("0 has no inverse")
    result, power = 1, a
    exponent = (1 << 128) - 2
    while exponent:
        if exponent & 1:
            result = gf_mul(result, power)
        power = gf_mul(power, power)
        exponent >>= 1
    return result


@lru_cache(maxsize=16)
def lagrange_at_zero(indices: tuple[int, ...]) -> tuple[int, ...]:
    """The coefficients c_j with f(0) = sum_j c_j f(x_j) for any polynomial f of degree below len(indices); in
    characteristic 2 subtraction is addition: c_j = prod_{m != j} x_m / (x_j + x_m)."""
    if len(set(indices)) != len(indices) or 0 in indices:
        raise ValueError("the shares' indices must be distinct and non-zero")
    coefficients = []
    for j, x_j in enumerate(indices):
        numerator = denominator = 1
        for m, x_m in enumerate(indices):
            if m != j:
                numerator = gf_mul(numerator, x_m)
                denominator = gf_mul(denominator, x_j ^ x_m)
        coefficients.append(gf_mul(numerator, gf_inverse(denominator)))
    return tuple(coefficients)


def combine_shares(shares: list[bytes]) -> bytes:
    """The secret the shares were split from (with at least the threshold of them); ValueError where they do not
    decode to a padded secret, as with Flower's."""
    if not shares or (len(shares[0]) - 4) % BLOCK or any(len(s) != len(shares[0]) for s in shares):
        raise ValueError("Failed to combine shares: they are not shares of one secret")
    coefficients = lagrange_at_zero(tuple(int.from_bytes(s[:4], "little") for s in shares))
    padded = b"".join(
        _combine_chunk(coefficients, [int.from_bytes(s[start:start + BLOCK], "big") for s in shares])
        for start in range(4, len(shares[0]), BLOCK))
    padding = padded[-1] if padded else 0
    if not 1 <= padding <= BLOCK or padded[-padding:] != bytes([padding]) * padding:
        raise ValueError("Failed to combine shares")
    return padded[:-padding]


def _combine_chunk(coefficients: tuple[int, ...], values: list[int]) -> bytes:
    secret = 0
    for c, y in zip(coefficients, values, strict=True):
        secret ^= gf_mul(y, c)  # the loop runs over c's bits: public, as the indices are
    return secret.to_bytes(BLOCK, "big")


INDEX_BITS = 32  # a share's index is 4 bytes: multiplying by it adds at most 31 bits to a 128-bit value
SLOT = 128 + INDEX_BITS  # bits one chunk's running value takes in the packed integer: products never reach the next


def create_shares(secret: bytes, threshold: int, num: int) -> list[bytes]:
    """``num`` shares of ``secret``, any ``threshold`` of which give it back (through this module's combine_shares or
    Flower's): each 16-byte chunk of the padded secret the constant term of its own polynomial of degree threshold - 1
    with random coefficients (the secrets module's), evaluated at the share's index 1..num."""
    if not 1 <= threshold <= num < 1 << INDEX_BITS:
        raise ValueError(f"Shamir needs 1 <= threshold <= num < 2^32, not threshold {threshold} of {num}")
    padding = BLOCK - len(secret) % BLOCK
    padded = secret + bytes([padding]) * padding
    chunks = range(len(padded) // BLOCK)

    def packed(values) -> int:  # one value per chunk, chunk c in bits SLOT c .. SLOT c + 127
        return sum(value << (SLOT * c) for c, value in zip(chunks, values, strict=True))

    low = packed([MASK] * len(chunks))
    # Highest degree first, the secret last (the constant term), as PyCryptodome's Horner loop reads them.
    coefficients = [packed([secrets.randbits(128) for _ in chunks]) for _ in range(threshold - 1)]
    coefficients.append(packed(int.from_bytes(padded[c * BLOCK:(c + 1) * BLOCK], "big") for c in chunks))
    shares = []
    for index in range(1, num + 1):
        value = 0
        for coefficient in coefficients:
            value = _times_index(value, index, low) ^ coefficient
        shares.append(index.to_bytes(4, "little")
                      + b"".join(((value >> (SLOT * c)) & MASK).to_bytes(BLOCK, "big") for c in chunks))
    return shares


def _times_index(packed: int, index: int, low: int) -> int:
    """Each slot's element times ``index`` in GF(2^128), ``low`` the mask of every slot's 128 bits: a carry-less
    product, whose bits above 128 in a slot (at most 31) fold down once by x^128 = x^7 + x^2 + x + 1 (to at most 38
    bits). The loop runs over the index's bits: public."""
    product, shift = 0, 0
    while index:
        if index & 1:
            product ^= packed << shift
        index >>= 1
        shift += 1
    high = (product & ~low) >> 128  # each slot's overflow, moved to the slot's bottom
    return (product & low) ^ high ^ (high << 1) ^ (high << 2) ^ (high << 7)
