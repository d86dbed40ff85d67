import pytest
import torch

from fedlora.aggregation import mean_message, redistribute, svd_of_mean_product, truncate


def _factors(m, k, ranks, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(m, r, generator=g, dtype=torch.float64) for r in ranks],
            [torch.randn(r, k, generator=g, dtype=torch.float64) for r in ranks])


@pytest.mark.parametrize("m, k, ranks", [(64, 48, [4, 4, 4, 4]), (150, 150, [4, 2, 3]), (30, 200, [1]),
                                         (10, 12, [4, 4, 4, 4])])  # N r > m: QR is still exact
def test_qr_svd_equals_a_dense_svd(m, k, ranks):
    bs, as_ = _factors(m, k, ranks)
    w = sum(b @ a for b, a in zip(bs, as_)) / len(bs)
    u, s, vt = svd_of_mean_product(bs, as_)
    dense_s = torch.linalg.svdvals(w)
    assert torch.allclose(s, dense_s[:s.numel()], rtol=1e-5, atol=1e-10)
    assert torch.linalg.norm(u * s @ vt - w) <= 1e-5 * torch.linalg.norm(w)
    r = min(ranks)
    b, a = redistribute(u, s, vt, r)
    du, ds, dvt = torch.linalg.svd(w)
    best = du[:, :r] * ds[:r] @ dvt[:r]  # Eckart-Young: the best rank-r approximation
    assert torch.linalg.norm(b @ a - best) <= 1e-5 * torch.linalg.norm(best)


def test_both_splits_give_the_same_product():
    bs, as_ = _factors(40, 30, [4, 4, 4])
    u, s, vt = svd_of_mean_product(bs, as_)
    b1, a1 = redistribute(u, s, vt, 4, "into-b")
    b2, a2 = redistribute(u, s, vt, 4, "sqrt")
    assert torch.allclose(b1 @ a1, b2 @ a2)
    assert torch.allclose(torch.linalg.norm(a1, dim=1), torch.ones(4, dtype=torch.float64))  # A = V^T: orthonormal rows
    assert torch.allclose(torch.linalg.norm(b2, dim=0), torch.linalg.norm(a2, dim=1))  # balanced


def test_heterogeneous_ranks_take_the_top_components():
    bs, as_ = _factors(40, 30, [4, 2, 1])
    u, s, vt = svd_of_mean_product(bs, as_)
    b, a = redistribute(u, s, vt, 4)
    b2, a2 = truncate(b, a, 2)
    assert b2.shape == (40, 2) and a2.shape == (2, 30)
    assert torch.allclose(b2 @ a2, redistribute(u, s, vt, 2)[0] @ redistribute(u, s, vt, 2)[1])


def test_mean_message():
    a = {"x.lora_B": torch.ones(2, 2), "head": torch.zeros(3)}
    b = {"x.lora_B": 3 * torch.ones(2, 2), "head": torch.ones(3)}
    mean = mean_message([a, b])
    assert torch.equal(mean["x.lora_B"], 2 * torch.ones(2, 2)) and torch.equal(mean["head"], 0.5 * torch.ones(3))


@pytest.mark.parametrize("call, match", [
    (lambda: mean_message([]), "zero messages"),
    (lambda: mean_message([{"a": torch.ones(1)}, {"b": torch.ones(1)}]), "same entries"),
    (lambda: svd_of_mean_product([torch.ones(3, 2)], [torch.ones(3, 4)]), "Factors must be"),
    (lambda: svd_of_mean_product([], []), "at least one"),
    (lambda: redistribute(*svd_of_mean_product([torch.randn(5, 2)], [torch.randn(2, 5)]), 3), r"\[1, 2\]"),
    (lambda: truncate(torch.ones(4, 2), torch.ones(2, 4), 3), r"\[1, 2\]"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
