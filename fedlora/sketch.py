"""Seeded Gaussian sketches: SGMM (matrix) and SGMV (vectorized) sketch and de-sketch maps.

A sketch matrix is never stored. It is regenerated from (seed, round, entry name, side) wherever
it is needed, so every client of a round, and the server, can rebuild the same R from a few ints.

Entries are drawn with NumPy's PCG64 on the CPU and then moved to the tensor's device. NumPy
guarantees the same stream on every platform, whereas torch's CPU and CUDA generators give
different numbers for the same seed: a CPU client and a CUDA client must de-sketch with the
very same R, so bit-identity across devices wins over generating on the device.

Conventions:
- R has i.i.d. N(0, 1/b) entries (variance 1/b), so E[R^T R] = I.
- A message entry named ``*lora_B`` (m x r) is sketched from the left: R B, R in R^{b x m}; so is FlexLoRA's
  update, the change of a layer's product B A (``*lora_BA``, m x k): R (B A - B0 A0).
- A message entry named ``*lora_A`` (r x k) is sketched from the right: A R_A, R_A in R^{k x b}.
- Any other entry (e.g. a classifier head) is sent dense, never sketched.
- SGMV: R_v vec(B) with vec stacking columns and R_v in R^{h x (m r)}, generated in row blocks
  so that memory stays bounded on ViT-B shapes.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch
from torch import Tensor

# SGMV generates R_v in row blocks of at most this many entries (16 MiB of float32).
MAX_BLOCK_ENTRIES = 1 << 22


class Side(Enum):
    """Where a message entry is multiplied by its sketch."""

    LEFT = 0  # B (m x r) -> R B
    RIGHT = 1  # A (r x k) -> A R_A
    DENSE = 2  # not sketched


PRODUCT = "lora_BA"  # FlexLoRA's update form: the change of a layer's product B A, and the server's dense product


def is_product(name: str) -> bool:
    return name.endswith(PRODUCT)


def layer_of(name: str) -> str:
    """The adapted layer a LoRA entry ("<layer>.lora_A", "<layer>.lora_B", "<layer>.lora_BA") belongs to."""
    return name.rsplit(".", 1)[0]


def side_of(name: str) -> Side:
    """The sketch side of a message entry, from its name."""
    if name.endswith("lora_B") or is_product(name):
        return Side.LEFT
    if name.endswith("lora_A"):
        return Side.RIGHT
    return Side.DENSE


@dataclass(frozen=True)
class SketchKey:
    """Identifies the sketches of one round: every R of the round derives from these two ints."""

    seed: int
    round: int

    def __post_init__(self) -> None:
        if self.seed < 0 or self.round < 0:
            raise ValueError(f"Sketch seed and round must be non-negative, got seed={self.seed}, round={self.round}.")


def seeded_normal(rows: int, cols: int, *, std: float, seed_parts: tuple[int | str, ...],
                  device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
    """A (rows x cols) matrix of i.i.d. N(0, std^2) entries, a pure function of ``seed_parts``.

    Strings in ``seed_parts`` are hashed, so names can take part in a seed.
    """
    words = [int.from_bytes(hashlib.blake2b(p.encode(), digest_size=8).digest(), "little") if isinstance(p, str) else p
             for p in seed_parts]
    values = np.random.Generator(np.random.PCG64(np.random.SeedSequence(words))).standard_normal(
        (rows, cols), dtype=np.float32)
    values *= np.float32(std)
    return torch.from_numpy(values).to(device=device, dtype=dtype)


_SKETCH_CACHE_BYTES = 256 * 2 ** 20
_sketches: OrderedDict[tuple, Tensor] = OrderedDict()  # least recently used first
_sketches_bytes = 0  # their total, kept as they come and go: summing at every draw is quadratic in their number
_sketches_lock = threading.Lock()
_newest_round: dict[int, int] = {}  # per sketch seed, the latest round drawn


def gaussian_matrix(
    rows: int, cols: int, *, std: float, key: SketchKey, name: str, side: Side, block: int = 0,
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The sketch of entry ``name`` in the round ``key``: the same on every client and device. Drawing it costs most
    of a client's privatization (ViT-B/16: 26 of 33 ms), and every client of a round draws the same ones, as does
    the server: those of the latest two rounds of a seed drawn (the server reconstructs a round while the next one
    trains), at most 256 MiB, are kept in the process, and handed out as they are (float32, on the CPU) rather
    than copied, a copy costing about as much as the product it serves: read-only to the caller."""
    global _sketches_bytes
    parts = ("sketch", key.seed, key.round, name, side.value, block)
    with _sketches_lock:
        if key.round > _newest_round.get(key.seed, -1):  # an older round's are never drawn again: a long run kept
            _newest_round[key.seed] = key.round         # 256 MiB of them in every process (the soak found it)
            for old in [k for k in _sketches if k[3][1] == key.seed and k[3][2] < key.round - 1]:
                _sketches_bytes -= _sketches.pop(old).nbytes
        matrix = _sketches.get(cache_key := (rows, cols, std, parts))
        if matrix is not None:
            _sketches.move_to_end(cache_key)
    if matrix is None:
        matrix = seeded_normal(rows, cols, std=std, seed_parts=parts)
        with _sketches_lock:
            if (previous := _sketches.pop(cache_key, None)) is not None:  # another thread drew it meanwhile
                _sketches_bytes -= previous.nbytes
            _sketches[cache_key] = matrix
            _sketches_bytes += matrix.nbytes
            while _sketches_bytes > _SKETCH_CACHE_BYTES and len(_sketches) > 1:
                _sketches_bytes -= _sketches.popitem(last=False)[1].nbytes
    return matrix.to(device=device, dtype=dtype)


def gaussian_gain_bound(dim: int, n: int, x: float) -> float:
    """An upper bound on the operator norm of a (dim x n) matrix with N(0, 1/dim) entries that holds except with
    probability 2 exp(-x): (sqrt(n) + sqrt(dim) + sqrt(2 x)) / sqrt(dim) (Vershynin 2012, Cor. 5.35)."""
    return (math.sqrt(n) + math.sqrt(dim) + math.sqrt(2 * x)) / math.sqrt(dim)


def _largest_gain(dim: int, sides: list[int], x: float) -> float:
    """The gain bound over several sketch matrices (a union bound), at least 1 for the dense entries."""
    x += math.log(max(1, len(sides)))
    return max([1.0, *(gaussian_gain_bound(dim, n, x) for n in sides)])


def _check_matrix(x: Tensor, name: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"Message entry '{name}' must be a matrix, got shape {tuple(x.shape)}.")


def _check_dim(dim: int, limit: int, what: str, name: str) -> None:
    if not 1 <= dim <= limit:
        raise ValueError(f"Sketch dimension {dim} for '{name}' must lie in [1, {limit}] ({what}).")


def _thin(left_t: Tensor, right_t: Tensor) -> Tensor:
    """(left_t @ right_t)^T: a product with few columns (a rank's worth) computed transposed, few rows first, where
    CPU matrix products run 5-7x faster (ViT-B/16's (150 x 768) @ (768 x 4): 187 microseconds, and 25 as
    ((4 x 768) @ (768 x 150))^T, one thread); the sketch products are most of a client's privatization."""
    return (left_t @ right_t).T.contiguous()


class NoSketch:
    """The identity: the Gaussian mechanism (GM) and the non-private baselines send dense matrices."""

    def sketch(self, x: Tensor, *, key: SketchKey, name: str) -> Tensor:
        return x

    def desketch(self, s: Tensor, *, key: SketchKey, name: str, shape: torch.Size | tuple[int, ...]) -> Tensor:
        return s

    def released_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(shape)

    def gain_bound(self, shapes: Mapping[str, tuple[int, ...]], x: float) -> float:
        """How much sketching can grow a message's norm: not at all."""
        return 1.0

    def multiply_adds(self, name: str, shape: tuple[int, ...]) -> int:
        return 0

    def __repr__(self) -> str:
        return "NoSketch()"


@dataclass(frozen=True)
class MatrixSketch:
    """SGMM's sketch (paper Def. 2.4): R B from the left for B, A R_A from the right for A. Cost Theta(b m r)."""

    dim: int

    def _matrix(self, n: int, *, key: SketchKey, name: str, side: Side, like: Tensor) -> Tensor:
        _check_dim(self.dim, n, "b must not exceed the sketched side of the matrix", name)
        return gaussian_matrix(self.dim, n, std=self.dim ** -0.5, key=key, name=name, side=side,
                               device=like.device, dtype=like.dtype)

    def sketch(self, x: Tensor, *, key: SketchKey, name: str) -> Tensor:
        side = side_of(name)
        if side is Side.DENSE:
            return x
        _check_matrix(x, name)
        if side is Side.LEFT:  # (b x m) @ (m x r), as ((r x m) @ (m x b))^T: see _thin
            return _thin(x.T, self._matrix(x.shape[0], key=key, name=name, side=side, like=x).T)
        return x @ self._matrix(x.shape[1], key=key, name=name, side=side, like=x).T  # (r x k) @ (k x b)

    def desketch(self, s: Tensor, *, key: SketchKey, name: str, shape: torch.Size | tuple[int, ...]) -> Tensor:
        side = side_of(name)
        if side is Side.DENSE:
            return s
        _check_matrix(s, name)
        if len(shape) != 2:
            raise ValueError(f"Message entry '{name}' must de-sketch to a matrix, got target shape {tuple(shape)}.")
        if side is Side.LEFT:
            expected = (self.dim, shape[1])
            if tuple(s.shape) != expected:
                raise ValueError(f"Sketched '{name}' must have shape {expected}, got {tuple(s.shape)}.")
            return _thin(s.T, self._matrix(shape[0], key=key, name=name, side=side, like=s))  # (m x b) @ (b x r)
        expected = (shape[0], self.dim)
        if tuple(s.shape) != expected:
            raise ValueError(f"Sketched '{name}' must have shape {expected}, got {tuple(s.shape)}.")
        return s @ self._matrix(shape[1], key=key, name=name, side=side, like=s)

    def released_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of entry ``name`` (of ``shape``) once sketched: (b x r) for B, (r x b) for A."""
        side = side_of(name)
        return tuple(shape) if side is Side.DENSE else (self.dim, shape[1]) if side is Side.LEFT else (shape[0], self.dim)

    def multiply_adds(self, name: str, shape: tuple[int, ...]) -> int:
        """What sketching entry ``name`` (of ``shape``) costs: b m r for R B (b x m by m x r), b r k for A R_A."""
        return 0 if side_of(name) is Side.DENSE else self.dim * math.prod(shape)

    def gain_bound(self, shapes: Mapping[str, tuple[int, ...]], x: float) -> float:
        """||sketch(X)|| <= gain ||X|| for a message of these entry shapes, except with probability 2 exp(-x)."""
        sides = [shape[0] if side_of(name) is Side.LEFT else shape[1]
                 for name, shape in shapes.items() if side_of(name) is not Side.DENSE]
        return _largest_gain(self.dim, sides, x)

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError(f"Sketch dimension must be at least 1, got {self.dim}.")


@dataclass(frozen=True)
class VectorSketch:
    """SGMV's sketch (paper Def. 2.3): R_v vec(B), R_v in R^{h x (m r)}. Cost Theta(h m r) = Theta(b m r^2).

    Only B can be sketched this way: FlexLoRA multiplies B A on the server, which the vectorized
    sketch does not allow (paper Remark 3.2).
    """

    dim: int

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError(f"Sketch dimension must be at least 1, got {self.dim}.")

    def _blocks(self, n: int, *, key: SketchKey, name: str, like: Tensor):
        """Yields (row slice, block of R_v) with bounded memory; every entry has variance 1/h."""
        _check_dim(self.dim, n, "h must not exceed m r, the length of vec(B)", name)
        rows_per_block = max(1, MAX_BLOCK_ENTRIES // n)
        for block, start in enumerate(range(0, self.dim, rows_per_block)):
            stop = min(start + rows_per_block, self.dim)
            yield slice(start, stop), gaussian_matrix(
                stop - start, n, std=self.dim ** -0.5, key=key, name=name, side=Side.LEFT, block=block,
                device=like.device, dtype=like.dtype)

    @staticmethod
    def _side(name: str) -> Side:
        side = side_of(name)
        if side is Side.RIGHT:
            raise ValueError(f"SGMV sketches only B; '{name}' is an A factor (SGMV cannot be used with FlexLoRA, paper Remark 3.2).")
        return side

    def sketch(self, x: Tensor, *, key: SketchKey, name: str) -> Tensor:
        if self._side(name) is Side.DENSE:
            return x
        _check_matrix(x, name)
        vec = x.T.reshape(-1)  # stack columns
        out = torch.empty(self.dim, device=x.device, dtype=x.dtype)
        for rows, block in self._blocks(vec.numel(), key=key, name=name, like=x):
            out[rows] = block @ vec
        return out

    def desketch(self, s: Tensor, *, key: SketchKey, name: str, shape: torch.Size | tuple[int, ...]) -> Tensor:
        if self._side(name) is Side.DENSE:
            return s
        if len(shape) != 2:
            raise ValueError(f"Message entry '{name}' must de-sketch to a matrix, got target shape {tuple(shape)}.")
        if tuple(s.shape) != (self.dim,):
            raise ValueError(f"Sketched '{name}' must have shape ({self.dim},), got {tuple(s.shape)}.")
        m, r = shape
        vec = torch.zeros(m * r, device=s.device, dtype=s.dtype)
        for rows, block in self._blocks(m * r, key=key, name=name, like=s):
            vec += block.T @ s[rows]
        return vec.reshape(r, m).T  # devec: every m coordinates form a column

    def released_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(shape) if self._side(name) is Side.DENSE else (self.dim,)

    def multiply_adds(self, name: str, shape: tuple[int, ...]) -> int:
        """h m r for R_v vec(B): r times SGMM's b m r at h = b r (paper, Section 2)."""
        return 0 if self._side(name) is Side.DENSE else self.dim * math.prod(shape)

    def gain_bound(self, shapes: Mapping[str, tuple[int, ...]], x: float) -> float:
        """||sketch(X)|| <= gain ||X|| for a message of these entry shapes, except with probability 2 exp(-x)."""
        sides = [shape[0] * shape[1] for name, shape in shapes.items() if self._side(name) is not Side.DENSE]
        return _largest_gain(self.dim, sides, x)


Sketch = NoSketch | MatrixSketch | VectorSketch
