import pytest
import torch

from fedlora.mechanisms import (Mechanism, ThreatModel, clip_message, gaussian_mechanism, message_norm,
                                os_gaussian_like, sgmm_mechanism, sgmv_mechanism)
from fedlora.sketch import MatrixSketch, Side, SketchKey, gaussian_matrix

KEY = SketchKey(3, 1)


def _message(scale=1.0, m=64, r=4, k=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"l0.lora_A": scale * torch.randn(r, k, generator=g, dtype=torch.float64),
            "l0.lora_B": scale * torch.randn(m, r, generator=g, dtype=torch.float64),
            "l1.lora_B": scale * torch.randn(m, r, generator=g, dtype=torch.float64)}


def test_clipping_is_exact_on_the_whole_message():
    message = {"a.lora_B": torch.full((1, 1), 3.0, dtype=torch.float64),
               "b.lora_B": torch.full((1, 1), 4.0, dtype=torch.float64)}
    assert message_norm(message) == 5.0
    clipped = clip_message(message, 1.0)
    # one scale for the whole message (0.2), not a per-layer clip
    assert clipped["a.lora_B"].item() == pytest.approx(0.6, rel=1e-5)
    assert clipped["b.lora_B"].item() == pytest.approx(0.8, rel=1e-5)
    assert 1.0 - 1e-5 < message_norm(clipped) <= 1.0
    small = clip_message(message, 10.0)
    assert all(torch.equal(small[n], message[n]) for n in message)


def test_gaussian_noise_has_the_calibrated_std():
    mech = gaussian_mechanism(clip_norm=0.5, noise_multiplier=2.0)
    zero = {"w.lora_B": torch.zeros(400, 250, dtype=torch.float64)}
    out = mech.privatize(zero, key=KEY, noise=torch.Generator().manual_seed(0))["w.lora_B"]
    assert out.std().item() == pytest.approx(1.0, rel=0.02)  # sigma = z * tau
    assert out.mean().abs().item() < 0.01


def test_zero_noise_is_allowed_and_marked_not_private():
    mech = sgmm_mechanism(sketch_dim=8, clip_norm=1.0, noise_multiplier=0.0)
    assert not mech.private and "NOT private" in mech.describe()
    a = mech.privatize(_message(), key=KEY)
    b = mech.privatize(_message(), key=KEY)
    assert all(torch.equal(a[n], b[n]) for n in a)  # nothing random but the (seeded) sketch
    assert Mechanism().describe().endswith("NOT private (epsilon = inf)")
    assert gaussian_mechanism(clip_norm=1.0, noise_multiplier=1.0).private


def test_known_sketch_clips_after_sketching_and_secret_sketch_does_not():
    # Whoever knows R can pick X along R's top singular direction: ||R X|| ~ (1 + sqrt(m / b)) ||X||.
    m, b = 400, 4
    r = gaussian_matrix(b, m, std=b ** -0.5, key=KEY, name="w.lora_B", side=Side.LEFT, dtype=torch.float64)
    message = {"w.lora_B": torch.linalg.svd(r).Vh[0].reshape(m, 1)}  # norm 1 = the clip norm
    known = sgmm_mechanism(sketch_dim=b, clip_norm=1.0, noise_multiplier=0.0)
    secret = sgmm_mechanism(sketch_dim=b, clip_norm=1.0, noise_multiplier=0.0, threat_model="secret-sketch")
    assert 1.0 - 1e-5 < message_norm(known.privatize(message, key=KEY)) <= 1.0
    inflated = message_norm(secret.privatize(message, key=KEY))
    assert inflated > 0.8 * (1 + (m / b) ** 0.5)  # sensitivity given R far above the clip norm
    assert known.clips_after_sketch and not secret.clips_after_sketch
    assert not gaussian_mechanism(clip_norm=1.0, noise_multiplier=1.0).clips_after_sketch  # nothing to re-clip


def test_privatize_then_desketch_shapes_and_unbiasedness():
    message = _message(scale=0.01)  # below the clip norm, so the target is the message itself
    mech = sgmm_mechanism(sketch_dim=16, clip_norm=10.0, noise_multiplier=0.0, threat_model="secret-sketch")
    shapes = {n: t.shape for n, t in message.items()}
    trials = 1500
    mean = {n: torch.zeros_like(t) for n, t in message.items()}
    for t in range(trials):
        key = SketchKey(9, t)
        out = mech.desketch(mech.privatize(message, key=key), key=key, shapes=shapes)
        for n in mean:
            mean[n] += out[n] / trials
    for n in message:
        assert mean[n].shape == message[n].shape
        assert torch.linalg.norm(mean[n] - message[n]) / torch.linalg.norm(message[n]) < 0.15


def test_noise_is_seeded_in_simulation_and_secure_by_default():
    mech = sgmv_mechanism(sketch_dim=32, clip_norm=1.0, noise_multiplier=1.0)
    ffa = {n: t for n, t in _message().items() if n.endswith("lora_B")}
    a = mech.privatize(ffa, key=KEY, noise=torch.Generator().manual_seed(5))
    b = mech.privatize(ffa, key=KEY, noise=torch.Generator().manual_seed(5))
    assert all(torch.equal(a[n], b[n]) for n in a)
    c, d = mech.privatize(ffa, key=KEY), mech.privatize(ffa, key=KEY)
    assert not torch.equal(c["l0.lora_B"], d["l0.lora_B"])


def test_threat_model_values():
    assert sgmm_mechanism(sketch_dim=2, clip_norm=1, noise_multiplier=1).threat_model is ThreatModel.KNOWN_SKETCH
    assert Mechanism(MatrixSketch(2), 1.0, 1.0, "secret-sketch").threat_model is ThreatModel.SECRET_SKETCH


@pytest.mark.parametrize("make, match", [
    (lambda: gaussian_mechanism(clip_norm=0.0, noise_multiplier=1.0), "Clip norm must be positive"),
    (lambda: gaussian_mechanism(clip_norm=1.0, noise_multiplier=-1.0), "non-negative"),
    (lambda: Mechanism(noise_multiplier=1.0), "clip_norm"),
    (lambda: sgmm_mechanism(sketch_dim=0, clip_norm=1.0, noise_multiplier=1.0), "at least 1"),
    (lambda: sgmv_mechanism(sketch_dim=8, clip_norm=1.0, noise_multiplier=1.0).privatize(_message(), key=KEY),
     "FlexLoRA"),
    (lambda: Mechanism(MatrixSketch(2), 1.0, 1.0, "nobody-knows"), "valid ThreatModel"),
    (lambda: sgmm_mechanism(sketch_dim=4, clip_norm=1.0, noise_multiplier=0.0).desketch(
        {"x.lora_B": torch.zeros(4, 4)}, key=KEY, shapes={}), "No target shape"),
])
def test_bad_input_is_one_clear_value_error(make, match):
    with pytest.raises(ValueError, match=match) as error:
        make()
    assert "\n" not in str(error.value)


def test_clipping_refuses_non_finite_messages_and_never_exceeds_the_clip_in_low_precision():
    with pytest.raises(ValueError, match="NaN or infinite"):
        clip_message({"w.lora_B": torch.tensor([[float("nan"), 1.0]])}, 1.0)
    big = {"w.lora_B": torch.randn(300, 4, dtype=torch.bfloat16) * 50}
    clipped = clip_message(big, 1.0)
    assert clipped["w.lora_B"].dtype == torch.float32 and message_norm(clipped) <= 1.0


def test_os_noise_is_gaussian_and_unpredictable():
    from scipy import stats

    t = torch.zeros(100_001, dtype=torch.float32)  # odd: Box-Muller's pairs are cut to size
    a, b = os_gaussian_like(t, 2.0), os_gaussian_like(t, 2.0)
    assert a.shape == t.shape and a.dtype == torch.float32 and not torch.equal(a, b)
    assert stats.kstest(a.double().numpy() / 2.0, "norm").pvalue > 1e-4
    assert abs(float(a.std()) - 2.0) < 0.03


def test_noise_at_the_server_leaves_the_release_clean_and_noises_the_sum():
    """The client's release is only constrained (clipped, sketched, clipped); the server's step adds the noise."""
    message = _message(scale=5.0)
    for make in (lambda p: gaussian_mechanism(clip_norm=1.0, noise_multiplier=2.0, placement=p),
                 lambda p: sgmm_mechanism(sketch_dim=16, clip_norm=1.0, noise_multiplier=2.0, placement=p)):
        server, client = make("server"), make("client")
        clean = server.privatize(message, key=KEY, noise=torch.Generator().manual_seed(0))
        assert message_norm(clean) <= 1.0 and all(torch.equal(clean[n], t)
                                                  for n, t in server.constrain(message, key=KEY).items())
        assert message_norm(client.privatize(message, key=KEY)) > 5  # the client's own noise
        assert all(torch.equal(client.noise_sum(clean, None)[n], t) for n, t in clean.items())  # nothing added
        noisy = server.noise_sum(clean, torch.Generator().manual_seed(1))
        assert message_norm({n: noisy[n] - clean[n] for n in clean}) > 5
        # no noise in the reply: the allowance is the clip norm itself, so an unclipped reply is caught
        assert server.norm_allowance({n: tuple(t.shape) for n, t in message.items()}) == 1.0
        assert "noise at the server" in server.describe() and "noise at the client" in client.describe()


def test_noise_at_the_server_refuses_a_secret_sketch():
    with pytest.raises(ValueError, match="known-sketch"):
        sgmm_mechanism(sketch_dim=16, clip_norm=1.0, noise_multiplier=1.0, threat_model="secret-sketch",
                       placement="server")


@pytest.mark.parametrize("clip_norm", [7.3e-44, 1e-40, 1e-30, 1e-3, 1.0])
def test_a_clipped_float32_message_never_exceeds_its_clip_whatever_the_clip(clip_norm):
    """Round-to-nearest cast of a float64 message clipped at a subnormal-range clip norm lifted its norm to 1.92
    times the clip (7.3e-44, 10^4 entries): the cast now rounds toward zero, so no entry, and no norm, grows."""
    message = {"w.lora_B": torch.ones(100, 100), "v.lora_B": torch.randn(50, 7, generator=torch.Generator().manual_seed(1))}
    clipped = clip_message(message, clip_norm)
    assert all(t.dtype == torch.float32 for t in clipped.values())
    assert message_norm(clipped) <= clip_norm


def test_clip_norms_and_noise_a_float_cannot_carry_are_refused_at_every_placement():
    from fedlora.mechanisms import FLOAT_RANGE

    for placement in ("client", "server", "secagg"):
        for make in (lambda **k: gaussian_mechanism(**k), lambda **k: sgmm_mechanism(sketch_dim=8, **k)):
            with pytest.raises(ValueError, match="where a float32 message carries it"):
                make(clip_norm=7.3e-44, noise_multiplier=4.0, placement=placement)
            with pytest.raises(ValueError, match="where a float32 message carries it"):
                make(clip_norm=1.0, noise_multiplier=4.0, placement=placement).with_clip_norm(1e-31)
            with pytest.raises(ValueError, match="noise's standard deviation"):
                make(clip_norm=FLOAT_RANGE[0], noise_multiplier=0.5, placement=placement)


@pytest.mark.parametrize("placement", ["client", "server", "secagg"])
@pytest.mark.parametrize("make", [gaussian_mechanism, lambda **k: sgmm_mechanism(sketch_dim=16, **k)],
                         ids=["gm", "sgmm"])
def test_what_a_client_sends_is_bounded_by_the_clip_before_any_rounding_at_every_placement(placement, make):
    """The clip that bounds the sensitivity is followed by the noise in float64 (noise at the client: what is
    rounded is the noisy message, post-processing) or by a cast toward zero (noise added later, on the sum)."""
    from fedlora.mechanisms import NoisePlacement

    tau = 1e-30  # the smallest clip norm a run may use
    mechanism = make(clip_norm=tau, noise_multiplier=2.0, placement=placement)
    message = {n: t.float() for n, t in _message(scale=1.0).items()}
    exact = mechanism.constrain(message, key=KEY, exact=True)
    assert all(t.dtype == torch.float64 for t in exact.values()) and message_norm(exact) <= tau
    sent = mechanism.privatize(message, key=KEY, noise=torch.Generator().manual_seed(5))
    assert all(t.dtype == torch.float32 for t in sent.values())
    if mechanism.placement is NoisePlacement.CLIENT:
        noised = mechanism.add_noise(exact, torch.Generator().manual_seed(5))
        assert all(torch.equal(sent[n], noised[n].float()) for n in sent)
    else:
        assert message_norm(sent) <= tau
