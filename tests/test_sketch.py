import subprocess
import sys

import pytest
import torch

import fedlora.sketch as sketch_module
from fedlora.lora import LoRAMode, build_lora_model, get_adapters, to_message
from fedlora.sketch import MatrixSketch, NoSketch, SketchKey, Side, VectorSketch, gaussian_matrix, side_of


def test_sketch_is_an_isometry_in_expectation():
    """E[R^T R] = I for R (b x m) with N(0, 1/b) entries."""
    b, m, trials = 5, 20, 2000
    total = torch.zeros(m, m, dtype=torch.float64)
    for t in range(trials):
        r = gaussian_matrix(b, m, std=b ** -0.5, key=SketchKey(7, t), name="w.lora_B", side=Side.LEFT).double()
        total += r.T @ r
    mean = total / trials
    # each entry of the mean has std <= sqrt(2 / (b trials)) = 0.014
    assert torch.allclose(mean, torch.eye(m, dtype=torch.float64), atol=0.08)


@pytest.mark.parametrize("sketch, name, shape", [
    (MatrixSketch(6), "w.lora_B", (24, 3)),  # left:  R^T (R B)
    (MatrixSketch(6), "w.lora_A", (3, 24)),  # right: (A R_A) R_A^T
    (VectorSketch(18), "w.lora_B", (24, 3)),  # SGMV:  devec(R_v^T R_v vec(B))
])
def test_desketch_of_sketch_is_unbiased(sketch, name, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    trials = 3000
    mean = sum(sketch.desketch(sketch.sketch(x, key=SketchKey(1, t), name=name), key=SketchKey(1, t), name=name,
                               shape=shape) for t in range(trials)) / trials
    # relative error of the mean ~ sqrt(m / (b trials)) ~ 0.04
    assert torch.linalg.norm(mean - x) / torch.linalg.norm(x) < 0.12


def test_sketch_shapes_and_sides():
    key = SketchKey(0, 0)
    b, a = torch.randn(30, 4), torch.randn(4, 40)
    assert MatrixSketch(8).sketch(b, key=key, name="l.lora_B").shape == (8, 4)
    assert MatrixSketch(8).sketch(a, key=key, name="l.lora_A").shape == (4, 8)
    assert VectorSketch(12).sketch(b, key=key, name="l.lora_B").shape == (12,)
    head = torch.randn(10, 30)
    assert MatrixSketch(8).sketch(head, key=key, name="classifier.weight") is head  # dense entries pass through
    assert side_of("x.lora_B") is Side.LEFT and side_of("x.lora_A") is Side.RIGHT and side_of("head") is Side.DENSE
    assert NoSketch().sketch(b, key=key, name="l.lora_B") is b


@pytest.mark.parametrize("name, shape", [("w.lora_B", (768, 4)), ("w.lora_A", (4, 768))])
def test_matrix_sketch_is_the_papers_product_whatever_order_computes_it(name, shape):
    """R B and R^T S for B, A R_A^T and S R_A for A (paper Def. 2.4), contiguous, though B's are computed
    transposed (sketch._thin)."""
    key, side = SketchKey(3, 1), side_of(name)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    r = gaussian_matrix(150, 768, std=150 ** -0.5, key=key, name=name, side=side).double()
    s = MatrixSketch(150).sketch(x, key=key, name=name)
    expected = r @ x.double() if side is Side.LEFT else x.double() @ r.T
    assert s.is_contiguous() and s.dtype == torch.float32
    assert torch.allclose(s.double(), expected, rtol=1e-5, atol=1e-5)
    back = MatrixSketch(150).desketch(s, key=key, name=name, shape=shape)
    assert back.is_contiguous() and back.shape == shape
    assert torch.allclose(back.double(), r.T @ s.double() if side is Side.LEFT else s.double() @ r, rtol=1e-5,
                          atol=1e-5)


def test_same_seed_same_sketch_on_every_client_and_process():
    key, x = SketchKey(42, 3), torch.arange(60.0).reshape(20, 3)
    first = MatrixSketch(5).sketch(x, key=key, name="layer.lora_B")
    assert torch.equal(first, MatrixSketch(5).sketch(x.clone(), key=key, name="layer.lora_B"))
    code = ("import torch; from fedlora.sketch import *; "
            "print(MatrixSketch(5).sketch(torch.arange(60.0).reshape(20, 3), key=SketchKey(42, 3), "
            "name='layer.lora_B').flatten().tolist())")
    other_process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert torch.equal(torch.tensor(eval(other_process)), first.flatten())
    assert not torch.equal(first, MatrixSketch(5).sketch(x, key=SketchKey(42, 4), name="layer.lora_B"))  # round
    assert not torch.equal(first, MatrixSketch(5).sketch(x, key=SketchKey(43, 3), name="layer.lora_B"))  # seed
    assert not torch.equal(first, MatrixSketch(5).sketch(x, key=key, name="other.lora_B"))  # layer


def test_a_round_s_sketches_are_drawn_once_per_process_and_shared(monkeypatch):
    drawn = []
    original = sketch_module.seeded_normal
    monkeypatch.setattr(sketch_module, "seeded_normal", lambda *a, **kw: drawn.append(a) or original(*a, **kw))
    monkeypatch.setattr(sketch_module, "_sketches", type(sketch_module._sketches)())
    monkeypatch.setattr(sketch_module, "_sketches_bytes", 0)
    monkeypatch.setattr(sketch_module, "_newest_round", {})
    key = SketchKey(7, 1)
    first = gaussian_matrix(4, 6, std=0.5, key=key, name="l.lora_B", side=Side.LEFT)
    assert gaussian_matrix(4, 6, std=0.5, key=key, name="l.lora_B", side=Side.LEFT).data_ptr() == first.data_ptr()
    again = gaussian_matrix(4, 6, std=0.5, key=key, name="l.lora_B", side=Side.LEFT, dtype=torch.float64)
    assert len(drawn) == 1 and again.dtype == torch.float64
    assert torch.equal(again.float(), original(4, 6, std=0.5, seed_parts=("sketch", 7, 1, "l.lora_B", Side.LEFT.value, 0)))
    monkeypatch.setattr(sketch_module, "_SKETCH_CACHE_BYTES", 3 * 4 * 6 * 4)  # room for three
    for layer in range(5):  # a round's, more than fit
        gaussian_matrix(4, 6, std=0.5, key=SketchKey(7, 2), name=f"l{layer}.lora_B", side=Side.LEFT)
    assert len(sketch_module._sketches) == 3  # the least recently used went first
    assert sketch_module._sketches_bytes == sum(m.nbytes for m in sketch_module._sketches.values())
    gaussian_matrix(4, 6, std=0.5, key=key, name="l.lora_B", side=Side.LEFT)
    assert len(drawn) == 7


def test_a_long_run_keeps_the_sketches_of_its_latest_two_rounds_only(monkeypatch):
    monkeypatch.setattr(sketch_module, "_sketches", type(sketch_module._sketches)())
    monkeypatch.setattr(sketch_module, "_sketches_bytes", 0)
    monkeypatch.setattr(sketch_module, "_newest_round", {})
    for round_ in range(1, 51):
        for name in ("a.lora_B", "b.lora_B"):
            gaussian_matrix(4, 6, std=0.5, key=SketchKey(7, round_), name=name, side=Side.LEFT)
        gaussian_matrix(4, 6, std=0.5, key=SketchKey(8, 1), name="a.lora_B", side=Side.LEFT)  # another run's
    kept = sorted({key[3][1:3] for key in sketch_module._sketches})
    assert kept == [(7, 49), (7, 50), (8, 1)] and len(sketch_module._sketches) == 5
    assert sketch_module._sketches_bytes == sum(m.nbytes for m in sketch_module._sketches.values())


def test_sketch_follows_the_tensor_dtype_and_device():
    x = torch.randn(20, 3, dtype=torch.float64)
    out = MatrixSketch(5).sketch(x, key=SketchKey(0, 0), name="l.lora_B")
    assert out.dtype == torch.float64 and out.device == x.device


def test_sgmv_generates_its_matrix_in_bounded_blocks(monkeypatch):
    monkeypatch.setattr(sketch_module, "MAX_BLOCK_ENTRIES", 100)
    sizes = []
    original = sketch_module.gaussian_matrix

    def spy(rows, cols, **kw):
        sizes.append(rows * cols)
        return original(rows, cols, **kw)

    monkeypatch.setattr(sketch_module, "gaussian_matrix", spy)
    x, key, sk = torch.randn(10, 3, dtype=torch.float64), SketchKey(0, 1), VectorSketch(25)
    s = sk.sketch(x, key=key, name="l.lora_B")
    assert max(sizes) <= 100 and len(sizes) > 1
    # The blocks stacked are one matrix R_v: sketch and de-sketch agree with it.
    rv = torch.cat([original(r.stop - r.start, 30, std=25 ** -0.5, key=key, name="l.lora_B", side=Side.LEFT,
                             block=i, dtype=torch.float64)
                    for i, r in enumerate(slice(a, min(a + 3, 25)) for a in range(0, 25, 3))])
    vec = x.T.reshape(-1)
    assert torch.allclose(s, rv @ vec)
    assert torch.allclose(sk.desketch(s, key=key, name="l.lora_B", shape=(10, 3)), (rv.T @ s).reshape(3, 10).T)


@pytest.mark.parametrize("targets", ["qv", "all"])
def test_desketch_shapes_for_every_adapted_layer_of_vit_b(targets):
    model = build_lora_model("vit-b16-random", num_classes=100, rank=4, alpha=8, targets=targets, mode="flex")
    adapters = get_adapters(model)
    assert len(adapters) == (24 if targets == "qv" else 72)
    key = SketchKey(5, 1)
    flex = to_message(adapters, mode=LoRAMode.FLEX)
    ffa = to_message(adapters, mode=LoRAMode.FFA)
    for sketch, message in ((MatrixSketch(150), flex), (VectorSketch(600), ffa)):
        for name, x in message.items():
            s = sketch.sketch(x, key=key, name=name)
            assert s.shape == ({Side.LEFT: (150, 4), Side.RIGHT: (4, 150)}[side_of(name)]
                               if isinstance(sketch, MatrixSketch) else (600,))
            assert sketch.desketch(s, key=key, name=name, shape=x.shape).shape == x.shape


@pytest.mark.parametrize("make, match", [
    (lambda: MatrixSketch(0), "at least 1"),
    (lambda: VectorSketch(-3), "at least 1"),
    (lambda: MatrixSketch(31).sketch(torch.zeros(30, 4), key=SketchKey(0, 0), name="l.lora_B"), r"\[1, 30\]"),
    (lambda: MatrixSketch(41).sketch(torch.zeros(4, 40), key=SketchKey(0, 0), name="l.lora_A"), r"\[1, 40\]"),
    (lambda: VectorSketch(121).sketch(torch.zeros(30, 4), key=SketchKey(0, 0), name="l.lora_B"), r"\[1, 120\]"),
    (lambda: MatrixSketch(5).sketch(torch.zeros(30), key=SketchKey(0, 0), name="l.lora_B"), "must be a matrix"),
    (lambda: MatrixSketch(5).desketch(torch.zeros(6, 4), key=SketchKey(0, 0), name="l.lora_B", shape=(30, 4)),
     "must have shape"),
    (lambda: VectorSketch(5).desketch(torch.zeros(6), key=SketchKey(0, 0), name="l.lora_B", shape=(30, 4)),
     "must have shape"),
    (lambda: VectorSketch(5).sketch(torch.zeros(4, 30), key=SketchKey(0, 0), name="l.lora_A"), "FlexLoRA"),
    (lambda: SketchKey(-1, 0), "non-negative"),
])
def test_bad_input_is_one_clear_value_error(make, match):
    with pytest.raises(ValueError, match=match) as error:
        make()
    assert "\n" not in str(error.value)
