"""Server-side aggregation math, free of Flower: FFA's mean and FlexLoRA's SVD redistribution.

FlexLoRA forms W = (1/N) sum_c B_c A_c and keeps its top-r SVD. W is never built densely: with
P = [B_1 ... B_N] / N (m x Nr) and Q = [A_1^T ... A_N^T] (k x Nr), W = P Q^T. QR both sides
(P = Q_P R_P, Q = Q_Q R_Q), take the SVD of the small core R_P R_Q^T = U S V^T, and
W = (Q_P U) S (Q_Q V)^T exactly, in O((m + k)(Nr)^2) instead of a dense m x k SVD.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import Enum

import torch
from torch import Tensor


class SingularValueSplit(str, Enum):
    """How the top-r singular values are split between B and A (the paper's two options)."""

    INTO_B = "into-b"  # B = U_r S_r, A = V_r^T
    SQRT = "sqrt"  # B = U_r S_r^(1/2), A = S_r^(1/2) V_r^T


def _stacked(messages: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    if not messages:
        raise ValueError("Cannot aggregate zero messages.")
    names = list(messages[0])
    for message in messages[1:]:
        if list(message) != names:
            raise ValueError("Messages to aggregate must carry the same entries in the same order.")
    return {name: torch.stack([m[name] for m in messages]) for name in names}


def mean_message(messages: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Entry-wise mean of messages with identical names and shapes (FFA's aggregation, and dense heads)."""
    return {name: t.mean(dim=0) for name, t in _stacked(messages).items()}


def sum_message(messages: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Entry-wise sum of messages with identical names and shapes (what noise at the server is added to)."""
    return {name: t.sum(dim=0) for name, t in _stacked(messages).items()}


def svd_of_mean_product(bs: Sequence[Tensor], as_: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Thin SVD (U, S, V^T) of W = mean_c B_c A_c through QR of the stacked factors. Ranks may differ per client."""
    if not bs or len(bs) != len(as_):
        raise ValueError("Need as many B factors as A factors, and at least one of each.")
    for b, a in zip(bs, as_):
        if b.dim() != 2 or a.dim() != 2 or b.shape[1] != a.shape[0]:
            raise ValueError(f"Factors must be B (m x r) and A (r x k), got {tuple(b.shape)} and {tuple(a.shape)}.")
    p = torch.cat(list(bs), dim=1) / len(bs)  # m x sum(r_c)
    q = torch.cat([a.T for a in as_], dim=1)  # k x sum(r_c)
    q_p, r_p = torch.linalg.qr(p)
    q_q, r_q = torch.linalg.qr(q)
    u, s, vt = torch.linalg.svd(r_p @ r_q.T, full_matrices=False)
    return q_p @ u, s, vt @ q_q.T


def redistribute(u: Tensor, s: Tensor, vt: Tensor, rank: int,
                 split: SingularValueSplit | str = SingularValueSplit.INTO_B) -> tuple[Tensor, Tensor]:
    """The global (B, A) of rank ``rank`` from an SVD: the best rank-r approximation of W."""
    if not 1 <= rank <= s.numel():
        raise ValueError(f"Rank must lie in [1, {s.numel()}], got {rank}.")
    u, s, vt = u[:, :rank], s[:rank], vt[:rank]
    if SingularValueSplit(split) is SingularValueSplit.INTO_B:
        return u * s, vt
    root = s.sqrt()
    return u * root, root[:, None] * vt


def truncate(b: Tensor, a: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """A client of smaller rank takes the top ``rank`` components of the redistributed factors."""
    if not 1 <= rank <= b.shape[1]:
        raise ValueError(f"Client rank must lie in [1, {b.shape[1]}], got {rank}.")
    return b[:, :rank], a[:rank]
