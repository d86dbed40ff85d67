import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant as rdp

from fedlora.algorithms import ALGORITHMS, get_algorithm, make_mechanism
from fedlora.privacy import (GaussianRelease, NonPrivateRelease, Phase, PrivacyLedger, SamplingScheme,
                             SketchedRelease, calibrate, epsilon)
from fedlora.privacy.accounting import ORDERS, gaussian_event
from fedlora.secure_sum import SkellamSecureSum

FIXED = SamplingScheme("fixed", 625, clients_per_round=4)
POISSON = SamplingScheme("poisson", 625, rate=4 / 625)


def _gm(z, sampling, rounds):
    return [Phase("lora", (GaussianRelease(z),), sampling, rounds)]


def _sgmm(z, rounds, sampling=FIXED, b=150, r=4):
    return [Phase("lora", (SketchedRelease(z, b, r, sampling.clients_per_round),), sampling, rounds)]


@pytest.mark.parametrize("q", [0.001, 0.01, 0.1])
@pytest.mark.parametrize("rounds", [1, 50, 400])
@pytest.mark.parametrize("z", [0.8, 1.5, 3.0])
def test_gaussian_epsilons_equal_dp_accounting(q, rounds, z):
    delta = 1e-5
    poisson = SamplingScheme("poisson", 1000, rate=q)
    fixed = SamplingScheme("fixed", 1000, clients_per_round=int(q * 1000))
    # Poisson, add/remove: sensitivity tau, the event's multiplier is z
    acc = rdp.RdpAccountant(list(ORDERS), rdp.NeighborRel.ADD_OR_REMOVE_ONE)
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)), rounds)
    ours = epsilon(_gm(z, poisson, rounds), delta=delta, threat_model="known-sketch", use_pld=False)
    assert ours.epsilon == pytest.approx(acc.get_epsilon(delta), rel=1e-6) and ours.method == "RDP"
    pld = pld_privacy_accountant.PLDAccountant()
    pld.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)), rounds)
    best = epsilon(_gm(z, poisson, rounds), delta=delta, threat_model="known-sketch")
    assert best.epsilon == pytest.approx(min(acc.get_epsilon(delta), pld.get_epsilon(delta)), rel=1e-6)
    # Fixed size, replace-one: a message can move by 2 tau, so the event's multiplier is z / 2
    acc = rdp.RdpAccountant(list(ORDERS), rdp.NeighborRel.REPLACE_ONE)
    acc.compose(dp_event.SampledWithoutReplacementDpEvent(1000, int(q * 1000), dp_event.GaussianDpEvent(z / 2)),
                rounds)
    assert epsilon(_gm(z, fixed, rounds), delta=delta, threat_model="known-sketch").epsilon == pytest.approx(
        acc.get_epsilon(delta), rel=1e-6)


def test_gaussian_parts_compose_into_one_event():
    event = gaussian_event((GaussianRelease(2.0), GaussianRelease(2.0)), POISSON)
    assert event.event.noise_multiplier == pytest.approx(2.0 / math.sqrt(2))


@pytest.mark.parametrize("phases_at", [
    lambda z, t, s: _gm(z, s, t),
    lambda z, t, s: _sgmm(z, t, s),
])
def test_epsilon_is_monotone(phases_at):
    def eps(z=1.5, t=100, s=FIXED):
        threat = "secret-sketch" if isinstance(phases_at(1, 1, FIXED)[0].release[0], SketchedRelease) else "known-sketch"
        return epsilon(phases_at(z, t, s), delta=1e-5, threat_model=threat).epsilon

    assert eps(t=50) < eps(t=100) < eps(t=200)  # up in T
    assert eps(z=2.0) < eps(z=1.5) < eps(z=1.2)  # down in z
    assert eps(s=SamplingScheme("fixed", 625, clients_per_round=2)) < eps() < eps(
        s=SamplingScheme("fixed", 625, clients_per_round=8))  # up in q
    assert eps(t=0) == 0.0
    assert math.isinf(eps(z=0.0))


def test_poisson_rate_monotone_and_non_private_is_infinite():
    e = [epsilon(_gm(1.5, SamplingScheme("poisson", 625, rate=q), 100), delta=1e-5, threat_model="known-sketch").epsilon
         for q in (0.001, 0.01, 0.1)]
    assert e[0] < e[1] < e[2]
    report = epsilon([Phase("lora", (NonPrivateRelease(),), FIXED, 10)], delta=1e-5, threat_model="known-sketch")
    assert math.isinf(report.epsilon) and "not private" in report.describe()


def test_secret_sketch_composes_a_dense_gaussian_part():
    alone = epsilon(_sgmm(1.5, 100), delta=1e-5, threat_model="secret-sketch").epsilon
    with_head = epsilon([Phase("lora", (SketchedRelease(1.5, 150, 4, 4), GaussianRelease(1.5)), FIXED, 100)],
                        delta=1e-5, threat_model="secret-sketch").epsilon
    assert with_head > alone


def test_phases_compose():
    probe = Phase("linear-probe", (GaussianRelease(3.0),), FIXED, 50)
    lora = Phase("lora", (GaussianRelease(1.5),), FIXED, 200)
    both = epsilon([probe, lora], delta=1e-5, threat_model="known-sketch").epsilon
    assert both > epsilon([lora], delta=1e-5, threat_model="known-sketch").epsilon
    assert both > epsilon([probe], delta=1e-5, threat_model="known-sketch").epsilon


@pytest.mark.parametrize("threat_model, phases_for", [
    ("known-sketch", lambda z: _gm(z, FIXED, 400)),
    ("known-sketch", lambda z: _gm(z, POISSON, 400)),
    ("secret-sketch", lambda z: _sgmm(z, 400)),
])
def test_calibration_round_trip(threat_model, phases_for):
    target = 1.7
    result = calibrate(phases_for, target_epsilon=target, delta=1e-5, threat_model=threat_model)
    z = result.noise_multiplier
    assert result.report.epsilon <= target
    assert epsilon(phases_for(z), delta=1e-5, threat_model=threat_model).epsilon <= target
    assert epsilon(phases_for(0.99 * z), delta=1e-5, threat_model=threat_model).epsilon > target  # within 1%


def test_calibration_reports_an_unreachable_target():
    with pytest.raises(ValueError, match="unreachable"):
        calibrate(lambda z: [Phase("lora", (NonPrivateRelease(),), FIXED, 10)], target_epsilon=1.0, delta=1e-5,
                  threat_model="known-sketch")


@pytest.mark.parametrize("call, match", [
    (lambda: epsilon(_gm(1.0, FIXED, 10), delta=0.0, threat_model="known-sketch"), "Delta must lie"),
    (lambda: epsilon(_gm(1.0, FIXED, 10), delta=1e-5, threat_model="nobody"), "Unknown threat model"),
    (lambda: epsilon(_sgmm(1.0, 10), delta=1e-5, threat_model="known-sketch"), "cannot be accounted"),
    (lambda: epsilon([Phase("l", (SketchedRelease(1.0, 150, 4, 4),), POISSON, 10)], delta=1e-5,
                     threat_model="secret-sketch"), "fixed-size sampling only"),
    (lambda: calibrate(lambda z: _gm(z, FIXED, 10), target_epsilon=0.0, delta=1e-5, threat_model="known-sketch"),
     "must be positive"),
    (lambda: SamplingScheme("fixed", 10, clients_per_round=11), r"\[1, 10\]"),
    (lambda: SamplingScheme("poisson", 10, rate=1.5), r"\(0, 1\]"),
    (lambda: Phase("l", (GaussianRelease(1.0),), FIXED, -1), "non-negative"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_ledger_after_t_rounds_equals_the_accountant():
    ledger = PrivacyLedger(delta=1e-5, threat_model="known-sketch")
    reports = [ledger.record("lora", (GaussianRelease(1.5),), FIXED) for _ in range(20)]
    assert [r.epsilon for r in reports] == sorted(r.epsilon for r in reports)
    assert ledger.rounds == 20 and len(ledger.history) == 20
    assert ledger.epsilon == pytest.approx(epsilon(_gm(1.5, FIXED, 20), delta=1e-5, threat_model="known-sketch").epsilon)
    assert ledger.history[-1]["threat_model"] == "known-sketch, noise at the client"
    restored = PrivacyLedger.from_dict(ledger.to_dict())
    assert restored.epsilon == ledger.epsilon and restored.history == ledger.history


def test_ledger_stops_before_the_budget():
    budget = epsilon(_gm(1.5, FIXED, 10), delta=1e-5, threat_model="known-sketch").epsilon
    ledger = PrivacyLedger(delta=1e-5, threat_model="known-sketch", target_epsilon=budget)
    rounds = 0
    while not ledger.would_exceed_budget("lora", (GaussianRelease(1.5),), FIXED):
        ledger.record("lora", (GaussianRelease(1.5),), FIXED)
        rounds += 1
    assert rounds == 10 and ledger.epsilon <= budget


def test_ledger_refuses_a_changed_release_within_a_phase():
    ledger = PrivacyLedger(delta=1e-5, threat_model="known-sketch")
    ledger.record("lora", (GaussianRelease(1.5),), FIXED)
    with pytest.raises(ValueError, match="another release"):
        ledger.record("lora", (GaussianRelease(1.4),), FIXED)


def test_ledger_composes_phases_and_round_trips_sketched_releases():
    ledger = PrivacyLedger(delta=1e-5, threat_model="secret-sketch")
    for _ in range(5):
        ledger.record("linear-probe", (GaussianRelease(3.0),), FIXED)
    probe_only = ledger.epsilon
    ledger.record("lora", (SketchedRelease(1.5, 150, 4, 4),), FIXED)
    assert ledger.epsilon > probe_only
    assert PrivacyLedger.from_dict(ledger.to_dict()).epsilon == pytest.approx(ledger.epsilon)


@pytest.mark.parametrize("name", list(ALGORITHMS))
@pytest.mark.parametrize("threat_model", ["known-sketch", "secret-sketch"])
def test_every_mechanism_describes_its_release(name, threat_model):
    algorithm = get_algorithm(name)
    mech = make_mechanism(algorithm, clip_norm=1.0, noise_multiplier=0.0 if not algorithm.private else 1.2,
                          sketch_dim=16, threat_model=threat_model)
    release = mech.release(rank=4, clients_per_round=4, dense=False)
    if not algorithm.private:
        assert release == (NonPrivateRelease(),)
    elif algorithm.sketched and threat_model == "secret-sketch":
        rank = 1 if algorithm.mechanism == "sgmv" else 4  # SGMV: (b, r) -> (h, 1)
        assert release == (SketchedRelease(1.2, 16, rank, 4),)
    else:
        assert release == (GaussianRelease(1.2),)  # GM, or any sketch whose R is known


def test_zero_noise_private_strategy_releases_are_not_private():
    mech = make_mechanism(get_algorithm("sgmm-ffa-lora"), clip_norm=1.0, noise_multiplier=0.0, sketch_dim=8)
    assert mech.release(rank=4, clients_per_round=4, dense=False) == (NonPrivateRelease(),)
    assert np.isinf(epsilon([Phase("l", mech.release(rank=4, clients_per_round=4, dense=False), FIXED, 1)], delta=1e-5,
                            threat_model="known-sketch").epsilon)


def test_release_of_a_message_counts_its_head():
    mech = make_mechanism(get_algorithm("sgmm-ffa-lora"), clip_norm=1.0, noise_multiplier=1.2, sketch_dim=16,
                          threat_model="secret-sketch")
    adapters_only = {"l.lora_B": np.zeros((32, 4))}
    with_head = {**adapters_only, "classifier.weight": np.zeros((10, 32))}
    import torch
    as_torch = lambda m: {k: torch.as_tensor(v) for k, v in m.items()}
    assert mech.release_of(as_torch(adapters_only), clients_per_round=4) == (SketchedRelease(1.2, 16, 4, 4),)
    assert mech.release_of(as_torch(with_head), clients_per_round=4) == (SketchedRelease(1.2, 16, 4, 4),
                                                                          GaussianRelease(1.2))


def test_mixed_sampling_kinds_and_unsound_per_message_releases_are_refused():
    with pytest.raises(ValueError, match="cannot be composed"):
        epsilon([*_gm(1.0, FIXED, 5), *_gm(1.0, POISSON, 5)], delta=1e-5, threat_model="known-sketch")
    per_message = [Phase("l", (SketchedRelease(1.0, 150, 4, 1),), FIXED, 10)]  # N = 4 share the sketch
    with pytest.raises(ValueError, match="unsound"):
        epsilon(per_message, delta=1e-5, threat_model="secret-sketch")
    report = epsilon(per_message, delta=1e-5, threat_model="secret-sketch", allow_unsound_per_message=True)
    assert "UNSOUND" in report.threat_model and "UNSOUND" in report.describe()


def test_curves_stay_non_negative_for_huge_noise():
    from fedlora.privacy.curves import sketched_rdp
    assert np.all(sketched_rdp(ORDERS, sketch_dim=150, rank=4, noise_multiplier=1e4) >= 0)
    eps = [epsilon(_sgmm(z, 10), delta=1e-5, threat_model="secret-sketch").epsilon for z in (10.0, 100.0, 1e3)]
    assert eps[0] >= eps[1] >= eps[2] >= 0


@pytest.mark.parametrize("z", [0.7, 2.0])
def test_noise_at_the_server_has_the_client_epsilon_and_matches_dp_accounting(z):
    """The same z, q and T give the same epsilon under either placement (the sum's Gaussian has the client's
    sensitivity and noise); only the label says who it holds against. Both equal dp-accounting's own number."""
    sampling = SamplingScheme("fixed", 200, clients_per_round=20)
    client = epsilon(_gm(z, sampling, 30), delta=1e-5, threat_model="known-sketch", placement="client")
    server = epsilon(_gm(z, sampling, 30), delta=1e-5, threat_model="known-sketch", placement="server")
    assert server.epsilon == client.epsilon
    assert (client.threat_model, server.threat_model) == ("known-sketch, noise at the client",
                                                          "known-sketch, noise at the server")
    acc = rdp.RdpAccountant(list(ORDERS), rdp.NeighborRel.REPLACE_ONE)
    acc.compose(dp_event.SampledWithoutReplacementDpEvent(200, 20, dp_event.GaussianDpEvent(z / 2)), 30)
    assert server.epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=1e-6)
    with pytest.raises(ValueError, match="not for noise on their sum"):
        epsilon(_sgmm(z, 10), delta=1e-5, threat_model="secret-sketch", placement="server")
    with pytest.raises(ValueError, match="Unknown noise placement"):
        epsilon(_gm(z, sampling, 3), delta=1e-5, threat_model="known-sketch", placement="nowhere")


def test_the_clip_count_raises_the_update_noise_as_andrew_et_al():
    """With adaptive clipping the calibrated update multiplier is (z^-2 - (2 sigma_b)^-2)^(-1/2), z the multiplier
    without the count, to the calibration's tolerance."""
    from fedlora.config import RunConfig
    from fedlora.experiment import noise_for

    base = {"num-clients": 200, "clients-per-round": 20, "noise-placement": "server", "message": "update"}
    z = noise_for(RunConfig.from_mapping(base)).noise_multiplier
    plan = noise_for(RunConfig.from_mapping({**base, "clip-quantile": 0.5, "clip-count-stddev": 2.0}))
    assert plan.noise_multiplier == pytest.approx((z ** -2 - 4.0 ** -2) ** -0.5, rel=5e-3)
    assert plan.planned.epsilon <= 8.0 and plan.releases["lora"][-1] == GaussianRelease(4.0)
    with pytest.raises(ValueError, match="clip count's noise alone"):
        noise_for(RunConfig.from_mapping({**base, "clip-quantile": 0.5, "clip-count-stddev": 0.3}))


@pytest.mark.parametrize("z", [1.0, 1.5])
def test_secure_aggregation_has_the_server_placements_epsilon_when_n_min_replies_arrive(z):
    """Fine quantization (the default modulus): the distributed Skellam sum of N_min shares is accounted within a
    millionth of the Gaussian at the same z (the quickstart's C, N, T); one reply alone has noise z / sqrt(N_min)."""
    sampling = SamplingScheme("fixed", 500, clients_per_round=50)
    codec = SkellamSecureSum(z, 1.0, clients=50, min_replies=25, dim=5002)
    secure = epsilon([Phase("lora", (codec.release(),), sampling, 10)], delta=1e-5, threat_model="known-sketch",
                     placement="secagg")
    server = epsilon(_gm(z, sampling, 10), delta=1e-5, threat_model="known-sketch", placement="server")
    assert secure.epsilon >= server.epsilon and secure.epsilon == pytest.approx(server.epsilon, rel=1e-5)
    assert secure.threat_model == "known-sketch, noise in client shares under secure aggregation"
    alone = epsilon([Phase("lora", (codec.message_release(),), sampling, 10)], delta=1e-5,
                    threat_model="known-sketch", placement="secagg")
    gaussian_alone = epsilon(_gm(z / 5, sampling, 10), delta=1e-5, threat_model="known-sketch", placement="server")
    assert alone.epsilon == pytest.approx(gaussian_alone.epsilon, rel=1e-3) and alone.epsilon > 10 * secure.epsilon


def test_coarse_quantization_costs_privacy_and_poisson_is_refused():
    sampling = SamplingScheme("fixed", 500, clients_per_round=50)
    fine = SkellamSecureSum(1.5, 1.0, clients=50, min_replies=25, dim=5002)
    coarse = SkellamSecureSum(1.5, 1.0, clients=50, min_replies=25, dim=5002, bits=12)
    fine_eps, coarse_eps = (epsilon([Phase("lora", (c.release(),), sampling, 10)], delta=1e-5,
                                    threat_model="known-sketch", placement="secagg").epsilon for c in (fine, coarse))
    assert coarse_eps > 1.05 * fine_eps  # rounding grows one client's norm bound by about sqrt(d) / 2
    with pytest.raises(ValueError, match="fixed-size sampling only"):
        epsilon([Phase("lora", (fine.release(),), POISSON, 10)], delta=1e-5, threat_model="known-sketch",
                placement="secagg")
