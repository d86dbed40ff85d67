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
MODEL = "against observers of the model (sample hidden)"
# where each reply carries its own noise (at the client, or shares under secure aggregation)
MODEL_NOT_CO_CLIENTS = ("against observers of the model who were in no round with the client (sample hidden, no "
                        "client colluding)")
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
    assert epsilon(_gm(z, fixed, rounds), delta=delta, threat_model="known-sketch", use_pld=False).epsilon == \
        pytest.approx(acc.get_epsilon(delta), rel=1e-6)
    # ... or, where tighter, the known-sample exact epsilon (replace-one too: it bounds the model's view as well)
    best = epsilon(_gm(z, fixed, rounds), delta=delta, threat_model="known-sketch")
    known = epsilon(_gm(z, fixed, rounds), delta=delta, threat_model="known-sketch", observer="server")
    assert best.epsilon == pytest.approx(min(acc.get_epsilon(delta), known.epsilon), rel=1e-6)
    assert best.method == ("known-sample exact" if known.epsilon < acc.get_epsilon(delta) else "RDP")


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
    assert ledger.rounds == 20
    assert ledger.epsilon == pytest.approx(epsilon(_gm(1.5, FIXED, 20), delta=1e-5, threat_model="known-sketch").epsilon)
    assert reports[-1].threat_model == \
        "known-sketch, noise at the client; against observers of the model who were in no round with the client " \
        "(sample hidden, no client colluding)"
    against_server = epsilon(_gm(1.5, FIXED, 20), delta=1e-5, threat_model="known-sketch", observer="server").epsilon
    by_observer = {o: r.epsilon for o, r in ledger.reports().items()}
    assert by_observer == {"model": ledger.epsilon, "server": against_server, "co-client": against_server}
    assert against_server > ledger.epsilon
    restored = PrivacyLedger.from_dict(ledger.to_dict())
    assert restored == ledger and restored.reports() == ledger.reports()


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
    client = epsilon(_gm(z, sampling, 30), delta=1e-5, threat_model="known-sketch", placement="client", use_pld=False)
    server = epsilon(_gm(z, sampling, 30), delta=1e-5, threat_model="known-sketch", placement="server", use_pld=False)
    assert server.epsilon == client.epsilon
    assert (client.threat_model, server.threat_model) == (f"known-sketch, noise at the client; {MODEL_NOT_CO_CLIENTS}",
                                                          f"known-sketch, noise at the server; {MODEL}")
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
    assert plan.planned.epsilon <= 8.0 and plan.phase_releases["lora"][-1] == GaussianRelease(4.0)
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
    server = epsilon(_gm(z, sampling, 10), delta=1e-5, threat_model="known-sketch", placement="server", use_pld=False)
    assert secure.epsilon >= server.epsilon and secure.epsilon == pytest.approx(server.epsilon, rel=1e-5)
    assert secure.threat_model == ("known-sketch, noise in client shares under secure aggregation; "
                                   f"{MODEL_NOT_CO_CLIENTS}")
    alone = epsilon([Phase("lora", (codec.message_release(),), sampling, 10)], delta=1e-5,
                    threat_model="known-sketch", placement="secagg")
    gaussian_alone = epsilon(_gm(z / 5, sampling, 10), delta=1e-5, threat_model="known-sketch", placement="server",
                             use_pld=False)
    assert alone.epsilon <= gaussian_alone.epsilon * (1 + 1e-3) and alone.epsilon > 10 * secure.epsilon
    # who knows whose reply it holds (the server that broke SecAgg+, sampling its target every round): no
    # amplification, at least the Gaussian's exact epsilon of ten replies at z / sqrt(N_min) (its RDP conversion is
    # loose at epsilons in the hundreds)
    from fedlora.privacy.accounting import known_sample_epsilon
    known = epsilon([Phase("lora", (codec.release(),), sampling, 10)], delta=1e-5, threat_model="known-sketch",
                    placement="secagg", observer="one-reply")
    exact, _ = known_sample_epsilon(_gm(z / 5, sampling, 10), 1e-5, every_round=True)
    assert exact <= known.epsilon <= 2 * exact and known.epsilon >= alone.epsilon  # RDP: loose here
    assert known.threat_model.endswith("against a server that breaks SecAgg+ (one reply alone, sample known, the "
                                       "target sampled every round)")


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


def _delta_by_integration(eps: float, mu: float) -> float:
    """The Gaussian mechanism's delta(eps) by numerical integration of the privacy loss, not its closed form:
    E over x ~ N(mu, 1) of (1 - e^(eps - L(x)))_+, L(x) = mu x - mu^2 / 2."""
    from scipy import integrate, stats

    if mu == 0:
        return 0.0
    start = (eps + mu * mu / 2) / mu  # where L(x) = eps: below it the integrand is 0
    value, _ = integrate.quad(lambda x: stats.norm.pdf(x, loc=mu) * -math.expm1(eps - (mu * x - mu * mu / 2)),
                              start, math.inf, epsabs=1e-14, limit=200)
    return value


@pytest.mark.parametrize("z, clients, per_round, rounds", [(1.895, 625, 4, 400), (1.4707, 500, 50, 10),
                                                           (2.046, 20, 4, 10)])
def test_the_servers_epsilon_is_the_mixture_over_participations_computed_independently(z, clients, per_round, rounds):
    """Against the server, who knows the rounds a client took part in (k ~ Bin(T, q)): delta(eps) = E_k of the
    Gaussian's delta at mu = sqrt(k) 2 / z. Checked by integrating each k's privacy loss numerically and solving for
    eps by bisection; the three settings are the paper's preset, the quickstart and small_cohort (PRIVACY.md 3b)."""
    from scipy import stats

    sampling = SamplingScheme("fixed", clients, clients_per_round=per_round)
    ours = epsilon(_gm(z, sampling, rounds), delta=1e-5, threat_model="known-sketch", observer="server")
    pmf = stats.binom.pmf(np.arange(rounds + 1), rounds, per_round / clients)

    def delta_at(eps):
        return sum(p * _delta_by_integration(eps, math.sqrt(k) * 2 / z) for k, p in enumerate(pmf) if p > 1e-18)

    lo, hi = 0.0, 50.0
    for _ in range(40):
        lo, hi = (lo, (lo + hi) / 2) if delta_at((lo + hi) / 2) <= 1e-5 else ((lo + hi) / 2, hi)
    assert ours.epsilon == pytest.approx(hi, rel=1e-4) and ours.method == "known-sample exact"
    assert ours.observer == "server" and ours.threat_model.endswith("against the server (sample known, drawn as the protocol says)")
    model = epsilon(_gm(z, sampling, rounds), delta=1e-5, threat_model="known-sketch")
    assert model.epsilon < ours.epsilon  # sampling amplifies against whoever does not know the sample


def test_reference_values_of_privacy_md():
    """../shared/design/PRIVACY.md, 3b: what each setting prints amplified and holds against the server."""
    for (z, clients, per_round, rounds), (amplified, known) in {(1.895, 625, 4, 400): (1.70, 13.25),
                                                                (1.4707, 500, 50, 10): (8.00, 12.35),
                                                                (2.046, 20, 4, 10): (8.00, 9.89)}.items():
        phases = _gm(z, SamplingScheme("fixed", clients, clients_per_round=per_round), rounds)
        assert round(epsilon(phases, delta=1e-5, threat_model="known-sketch").epsilon, 2) == amplified
        assert round(epsilon(phases, delta=1e-5, threat_model="known-sketch", observer="server").epsilon, 2) == known


def test_against_the_server_noise_at_the_server_is_no_guarantee_and_a_derived_secret_sketch_neither():
    sampling = SamplingScheme("fixed", 20, clients_per_round=4)
    server = epsilon(_gm(2.0, sampling, 10), delta=1e-5, threat_model="known-sketch", placement="server",
                     observer="server")
    assert math.isinf(server.epsilon) and server.method == "none"
    sketched = _sgmm(2.0, 10, sampling, b=16, r=4)
    hidden = epsilon(sketched, delta=1e-5, threat_model="secret-sketch", observer="server")
    assert math.isfinite(hidden.epsilon) and hidden.method == "known-sample RDP"
    seeded = epsilon(_gm(2.0, sampling, 10), delta=1e-5, threat_model="known-sketch", observer="server", seeded=True)
    assert math.isinf(seeded.epsilon)  # the server holds the run seed
    derived = epsilon(sketched, delta=1e-5, threat_model="secret-sketch", observer="server", server_derives_sketch=True)
    assert math.isinf(derived.epsilon) and "the server derives R" in derived.threat_model
    model = epsilon(sketched, delta=1e-5, threat_model="secret-sketch", server_derives_sketch=True, seeded=True)
    assert model.epsilon <= hidden.epsilon and "seeded noise (a simulation)" in model.threat_model
    with pytest.raises(ValueError, match="no epsilon holds against it"):
        calibrate(lambda z: _gm(z, sampling, 10), target_epsilon=8, delta=1e-5, threat_model="known-sketch",
                  placement="server", observer="server")
    with pytest.raises(ValueError, match="'one-reply' is not an observer that noise placement 'client' tells apart"):
        epsilon(_gm(2.0, sampling, 10), delta=1e-5, threat_model="known-sketch", observer="one-reply")


@pytest.mark.parametrize("sampling", [SamplingScheme("fixed", 500, clients_per_round=50),
                                      SamplingScheme("poisson", 500, rate=0.1)])
def test_calibrating_for_the_server_meets_its_target_and_needs_more_noise(sampling):
    phases = lambda z: [Phase("probe", (GaussianRelease(z),), sampling, 2), *_gm(z, sampling, 8)]  # noqa: E731
    model = calibrate(phases, target_epsilon=8, delta=1e-5, threat_model="known-sketch")
    server = calibrate(phases, target_epsilon=8, delta=1e-5, threat_model="known-sketch", observer="server")
    assert server.report.epsilon <= 8 and server.report.epsilon == pytest.approx(8, rel=0.02)
    assert server.noise_multiplier > model.noise_multiplier and server.report.observer == "server"


def test_every_label_names_its_observer():
    from fedlora.privacy.events import OBSERVER_LABELS, observers

    sampling = SamplingScheme("fixed", 500, clients_per_round=50)
    for placement in ("client", "server", "secagg"):
        phases = (_gm(1.5, sampling, 3) if placement != "secagg" else
                  [Phase("lora", (SkellamSecureSum(1.5, 1.0, clients=50, min_replies=45, dim=100).release(),),
                         sampling, 3)])
        ledger = PrivacyLedger(delta=1e-5, threat_model="known-sketch", placement=placement)
        ledger.record(phases[0].name, phases[0].release, sampling)
        reports = ledger.reports()
        assert list(reports) == [o.value for o in observers(placement)]
        for observer, report in reports.items():
            label = MODEL_NOT_CO_CLIENTS if observer == "model" and placement != "server" else OBSERVER_LABELS[observer]
            assert report.threat_model.endswith(label) and report.observer == observer


def test_the_other_observers_are_the_finite_epsilons_besides_the_calibrated_one():
    from fedlora.privacy.events import OBSERVER_LABELS, Observer, other_observers

    secagg = {"model": 8.0, "server": 18.5, "one-reply": 830.0}
    assert other_observers(secagg, "model") == [(18.5, OBSERVER_LABELS[Observer.SERVER]),
                                                (830.0, OBSERVER_LABELS[Observer.ONE_REPLY])]
    assert other_observers(secagg, Observer.SERVER) == [(8.0, OBSERVER_LABELS[Observer.MODEL]),
                                                        (830.0, OBSERVER_LABELS[Observer.ONE_REPLY])]
    assert other_observers({"model": 8.0, "server": math.inf}, "model") == []  # noise added by the server


def test_a_secret_sketch_epsilon_names_the_observers_of_sketches_alone():
    """The secret-sketch bound covers the sketched releases only: the clients hold R, and a model de-sketched with R
    is not covered, so no secret-sketch number is labelled as holding against observers of the model."""
    from fedlora.privacy.events import SKETCHES_ONLY, other_observers

    secret = epsilon(_sgmm(1.5, 10), delta=1e-5, threat_model="secret-sketch")
    assert secret.threat_model.endswith(SKETCHES_ONLY) and MODEL not in secret.threat_model
    assert epsilon(_gm(1.5, FIXED, 10), delta=1e-5, threat_model="known-sketch").threat_model.endswith(
        MODEL_NOT_CO_CLIENTS)
    assert other_observers({"model": 1.0, "server": 9.0}, "server", "secret-sketch") == [(1.0, SKETCHES_ONLY)]


@pytest.mark.parametrize("scheme", [SamplingScheme("fixed", 5, clients_per_round=3), SamplingScheme("poisson", 5, rate=0.6)])
def test_a_draw_takes_each_client_with_probability_q(scheme):
    """The accountant assumes N of C uniformly (or each client with probability q), whoever is online."""
    rng = np.random.default_rng(0)
    draws = [scheme.draw(rng) for _ in range(300)]
    counts = np.bincount([c for d in draws for c in d], minlength=5)
    assert all(d == sorted(set(d)) for d in draws) and counts.min() > 130 and counts.max() < 230  # 180 expected each
    assert all(len(d) == 3 for d in draws) if scheme.kind.value == "fixed" else len({len(d) for d in draws}) > 2


def _quadrature_known_sample_epsilon(z: float, q: float, rounds: int, delta: float, *, every_round=False) -> float:
    """Epsilon against an observer who knows the sample, without fedlora's code: the hockey-stick divergence of
    N(mu, 1) from N(0, 1) by numerical integration, mu = sqrt(k) 2 / z, averaged over k ~ Bin(T, q)."""
    from scipy import integrate, optimize, stats

    def hockey(eps: float, mu: float) -> float:
        if mu == 0:
            return 0.0
        f = lambda x: max(stats.norm.pdf(x, mu) - math.exp(eps) * stats.norm.pdf(x), 0.0)  # noqa: E731
        return integrate.quad(f, eps / mu + mu / 2, mu + 40, epsabs=1e-14, epsrel=1e-10, limit=200)[0]

    weights = ({rounds: 1.0} if every_round else
               {k: stats.binom.pmf(k, rounds, q) for k in range(rounds + 1) if stats.binom.pmf(k, rounds, q) > 1e-16})
    total = lambda eps: sum(w * hockey(eps, math.sqrt(k) * 2 / z) for k, w in weights.items()) - delta  # noqa: E731
    return optimize.brentq(total, 1e-6, 200, xtol=1e-9)


@pytest.mark.parametrize("z, n, clients, rounds", [(1.4707, 25, 50, 10), (2.046, 2, 4, 10), (0.9, 10, 20, 30)])
def test_a_client_of_the_round_sees_the_sum_less_its_own_noise_without_amplification(z, n, clients, rounds):
    """Noise at each client: the model carries the noise of >= N_min replies (z sqrt(N_min)); a client of the round
    knows its own share, so against it the sum's other N_min - 1 shares count, sample known (quadrature)."""
    sampling = SamplingScheme("fixed", 10 * clients, clients_per_round=clients)
    summed = [Phase("lora", (GaussianRelease(z * math.sqrt(n), n),), sampling, rounds)]
    got = epsilon(summed, delta=1e-5, threat_model="known-sketch", placement="client", observer="co-client")
    expected = _quadrature_known_sample_epsilon(z * math.sqrt(max(n - 1, 1)), 0.1, rounds, 1e-5)
    assert got.epsilon == pytest.approx(expected, rel=1e-4) and got.method == "known-sample exact"
    assert "no other client colluding" in got.threat_model
    # the server sees each reply: one client's noise, as before
    server = epsilon(summed, delta=1e-5, threat_model="known-sketch", placement="client", observer="server")
    assert server.epsilon == pytest.approx(_quadrature_known_sample_epsilon(z, 0.1, rounds, 1e-5), rel=1e-4)


@pytest.mark.parametrize("z, n", [(1.4707, 25), (0.3, 25), (2.046, 2)])
def test_the_sum_of_client_noise_is_accounted_as_dp_accounting_accounts_a_gaussian_of_its_variance(z, n):
    sampling = SamplingScheme("fixed", 500, clients_per_round=50)
    got = epsilon([Phase("lora", (GaussianRelease(z * math.sqrt(n), n),), sampling, 10)], delta=1e-5,
                  threat_model="known-sketch", placement="client", use_pld=False)
    accountant = rdp.RdpAccountant(list(ORDERS), rdp.NeighborRel.REPLACE_ONE)
    accountant.compose(dp_event.SampledWithoutReplacementDpEvent(500, 50, dp_event.GaussianDpEvent(
        z * math.sqrt(n) / 2)), 10)
    assert got.epsilon == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-6)


def test_a_run_with_noise_at_each_client_accounts_its_required_replies_noise():
    from fedlora.config import RunConfig
    from fedlora.federation import Protocol
    from fedlora.mechanisms import gaussian_mechanism

    config = RunConfig.from_mapping({"strategy": "gm-ffa-lora", "noise-placement": "client", "noise-multiplier": 0.5,
                                     "target-epsilon": 0, "clients-per-round": 20, "min-replies": 12})
    protocol = Protocol(config, 0.5)
    release = protocol.release_of({"w": np.zeros(3)}, gaussian_mechanism(clip_norm=1.0, noise_multiplier=0.5))
    assert release == (GaussianRelease(0.5 * math.sqrt(12), 12),) and release[0].one_reply() == GaussianRelease(0.5)
    # FlexLoRA's adapter form: the model is the SVD of the mean of products of separately noised factors, no function
    # of the replies' sum: one reply's noise is what is accounted; its update form is a mean of product changes
    for message, shares in (("adapter", 1), ("update", 12)):
        flex = Protocol(RunConfig.from_mapping({**config.to_mapping(), "strategy": "gm-flexlora", "message": message}),
                        0.5)
        assert flex.release_of({"w": np.zeros(3)}, gaussian_mechanism(clip_norm=1.0, noise_multiplier=0.5))[0] \
            == GaussianRelease(0.5 * math.sqrt(shares), shares)


def test_a_server_that_breaks_secagg_may_take_its_target_every_round():
    """It deviates from the protocol, so it may sample as it likes: one reply alone, in every round (not k ~ Bin)."""
    from fedlora.privacy.accounting import known_sample_epsilon

    sampling = SamplingScheme("fixed", 500, clients_per_round=50)
    share = SkellamSecureSum(1.5, 1.0, clients=50, min_replies=45, dim=100).release()
    phases = [Phase("lora", (share,), sampling, 10)]
    got = epsilon(phases, delta=1e-5, threat_model="known-sketch", placement="secagg", observer="one-reply")
    alone = [Phase("lora", (share.one_reply(),), sampling, 10)]
    assert got.epsilon == pytest.approx(known_sample_epsilon(alone, 1e-5, every_round=True)[0], rel=1e-9)
    assert got.epsilon > known_sample_epsilon(alone, 1e-5)[0] and "the target sampled every round" in got.threat_model
    # independently: ten rounds of the share's RDP curve, converted by dp-accounting
    from fedlora.privacy.curves import skellam_rdp
    one = share.one_reply()
    curve = 10 * skellam_rdp(ORDERS, l2_sensitivity=2 * one.norm_bound, variance=one.variance, dim=one.dim)
    assert got.epsilon == pytest.approx(rdp.compute_epsilon(ORDERS, curve, 1e-5)[0], rel=0.02)


def test_observers_of_secure_aggregation_need_its_shares_and_seeded_noise_holds_against_nobody_with_the_seed():
    sampling = SamplingScheme("fixed", 500, clients_per_round=50)
    with pytest.raises(ValueError, match="needs each release as a SkellamRelease"):
        epsilon(_gm(1.5, sampling, 3), delta=1e-5, threat_model="known-sketch", placement="secagg",
                observer="one-reply")
    with pytest.raises(ValueError, match="is not an observer that noise placement 'server' tells apart"):
        epsilon(_gm(1.5, sampling, 3), delta=1e-5, threat_model="known-sketch", placement="server",
                observer="co-client")
    for observer in ("server", "co-client"):
        seeded = epsilon(_gm(1.5, sampling, 3), delta=1e-5, threat_model="known-sketch", placement="client",
                         observer=observer, seeded=True)
        assert math.isinf(seeded.epsilon)
    assert math.isfinite(epsilon(_gm(1.5, sampling, 3), delta=1e-5, threat_model="known-sketch", placement="client",
                                 seeded=True).epsilon)  # the model's observers do not hold the seed


def test_a_secret_sketch_epsilon_against_the_server_says_r_must_stay_hidden_and_none_holds_against_a_client():
    server = epsilon(_sgmm(1.5, 10), delta=1e-5, threat_model="secret-sketch", observer="server")
    assert server.threat_model.endswith("(sample known, drawn as the protocol says, while R stays hidden from it)")
    assert math.isinf(epsilon(_sgmm(1.5, 10), delta=1e-5, threat_model="secret-sketch", observer="co-client").epsilon)


# Reference values of the composed dominating pair at delta 1e-5 (an independent script by a reviewer, discretization
# 1e-4): the quickstart's, small_cohort's and the paper's settings.
@pytest.mark.parametrize("z, clients, per_round, rounds, reference", [
    (1.4707, 500, 50, 10, 5.55), (2.046, 20, 4, 10, 4.91), (1.895, 625, 4, 400, 0.978)])
def test_the_fixed_sampling_pld_lies_between_a_lower_bound_that_occurs_and_rdp(z, clients, per_round, rounds,
                                                                                reference):
    """A data set where every other client equals the replaced one's substitute makes every round the pair A vs B
    (A = (1-q) N(0) + q N(2), B = N(0)) in either order: dp-accounting's optimistic PLD of that pair composed is a
    lower bound that occurs; RDP is the upper bound fedlora used alone."""
    from dp_accounting.pld import privacy_loss_distribution

    from fedlora.privacy.accounting import fixed_sampling_pld_epsilon

    sampling = SamplingScheme("fixed", clients, clients_per_round=per_round)
    phases = _gm(z, sampling, rounds)
    pld = fixed_sampling_pld_epsilon(phases, 1e-5)
    lower = privacy_loss_distribution.from_gaussian_mechanism(
        z, sensitivity=2.0, sampling_prob=per_round / clients, pessimistic_estimate=False).self_compose(
        rounds).get_epsilon_for_delta(1e-5)
    with_rdp = epsilon(phases, delta=1e-5, threat_model="known-sketch", placement="server")
    assert lower <= pld < with_rdp.epsilon and pld == pytest.approx(reference, abs=0.01)
    tighter = epsilon(phases, delta=1e-5, threat_model="known-sketch", placement="server", fixed_sampling_pld=True)
    assert tighter.epsilon == pytest.approx(pld) and tighter.method == "PLD (fixed-size sampling)"


@pytest.mark.parametrize("z, rounds", [(1.4707, 10), (0.8, 50), (3.0, 400)])
def test_the_other_convention_is_dp_accountings_poisson_pld(z, rounds):
    from fedlora.privacy.accounting import other_convention

    sampling = SamplingScheme("fixed", 500, clients_per_round=50)
    got = other_convention(_gm(z, sampling, rounds), 1e-5)
    accountant = pld_privacy_accountant.PLDAccountant()
    accountant.compose(dp_event.PoissonSampledDpEvent(0.1, dp_event.GaussianDpEvent(z)), rounds)
    assert got.epsilon == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)
    assert "Poisson sampling, add/remove neighbours; not this run's guarantee" in got.threat_model
    assert other_convention(_sgmm(1.5, 10), 1e-5) is None  # the secret-sketch bound needs fixed-size sampling
