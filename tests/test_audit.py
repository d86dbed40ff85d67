"""The privacy audit: its statistics against closed forms, the mechanism audit's attacks against theory, the canary
run end to end, and `fedlora audit`."""

import json
import math

import numpy as np
import pytest
import torch
from scipy import stats

from fedlora.audit import (audit_mechanism, audit_secure_sum, auc_interval, canary_epsilon, canary_scores, canary_signature,
                           epsilon_lower_bound, exposure, gaussian_pair_epsilon, roc_auc, tpr_at_fpr, tpr_interval)
from fedlora.cli import main
from fedlora.config import RunConfig, load_config, parse_assignment
from fedlora.federation import Protocol
from fedlora.mechanisms import Mechanism, gaussian_mechanism, sgmm_mechanism, sgmv_mechanism
from fedlora.sketch import MatrixSketch
from tests.helpers import PAPER_FORM

SMALL = (32, 2)


# -- statistics -------------------------------------------------------------------------------------
def test_auc_and_tpr_at_fpr_of_known_samples():
    assert roc_auc(np.array([2.0, 3.0]), np.array([0.0, 1.0])) == 1.0
    assert roc_auc(np.array([0.0, 1.0]), np.array([2.0, 3.0])) == 0.0
    assert roc_auc(np.array([1.0, 1.0]), np.array([1.0, 1.0])) == 0.5
    others = np.arange(100.0)  # threshold at FPR 10%: 90
    assert tpr_at_fpr(np.array([95.0, 91.0, 50.0, 10.0]), others, 0.1) == 0.5


def test_the_auc_interval_covers_chance_without_a_signal_and_leaves_it_with_one():
    rng = np.random.default_rng(0)
    covered = [auc_interval(rng.normal(size=60), rng.normal(size=60)) for _ in range(400)]
    assert 0.92 <= np.mean([lo <= 0.5 <= hi for lo, hi in covered]) <= 0.98  # about its 95%
    lo, hi = auc_interval(rng.normal(2, 1, 60), rng.normal(size=60))
    true_auc = stats.norm.cdf(2 / math.sqrt(2))  # P(X > Y) for X ~ N(2, 1), Y ~ N(0, 1)
    assert 0.5 < lo <= true_auc <= hi
    with pytest.raises(ValueError):
        auc_interval(np.array([1.0]), np.array([0.0, 1.0]))


def test_the_tpr_interval_is_clopper_pearsons_at_the_threshold():
    others = np.arange(100.0)  # threshold at FPR 10%: 90
    members = np.array([95.0, 91.0, 50.0, 10.0])
    lo, hi = tpr_interval(members, others, 0.1)
    assert lo == pytest.approx(stats.beta.ppf(0.025, 2, 3)) and hi == pytest.approx(stats.beta.ppf(0.975, 3, 2))
    assert tpr_interval(np.array([99.5, 99.9]), others, 0.1)[1] == 1.0
    assert tpr_interval(np.array([1.0, 2.0]), others, 0.1)[0] == 0.0


def test_exposure_is_full_above_every_candidate_and_about_log2_e_for_a_canary_never_seen():
    candidates = np.arange(1023.0)
    assert exposure(np.array([5000.0]), candidates)[0] == pytest.approx(10.0)  # log2(1024)
    assert exposure(np.array([-1.0]), candidates)[0] == pytest.approx(0.0)  # below all: rank 1024
    rng = np.random.default_rng(1)
    unseen = exposure(rng.normal(size=4000), rng.normal(size=1023))
    assert abs(unseen.mean() - math.log2(math.e)) < 0.1


def test_gaussian_pair_epsilon_matches_the_gaussian_dp_closed_form():
    # mu-GDP: delta(eps) = Phi(-eps / mu + mu / 2) - e^eps Phi(-eps / mu - mu / 2)
    for mu in (0.5, 1.0, 2.0):
        eps = gaussian_pair_epsilon((mu, 1.0), (0.0, 1.0), 1e-5)
        delta = stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)
        assert delta == pytest.approx(1e-5, rel=1e-3)
    assert gaussian_pair_epsilon((1.0, 1.0), (0.0, 1.0), 1e-5) == pytest.approx(4.377, abs=1e-3)
    assert gaussian_pair_epsilon((0.0, 1.0), (0.0, 1.0), 1e-5) == 0.0
    assert gaussian_pair_epsilon((0.0, 1.3), (0.0, 1.0), 1e-5) > 0  # a variance alone tells them apart
    assert gaussian_pair_epsilon((100.0, 1.0), (0.0, 1.0), 1e-5) == math.inf


def test_gaussian_pair_epsilon_with_unequal_variances_and_far_tails():
    from scipy import integrate

    from fedlora.audit import _gaussian_delta

    for p, q in (((0.5, 1.3), (0.0, 1.0)), ((0.0, 1.0), (0.5, 1.3)), ((1.0, 0.7), (0.0, 1.0))):
        def excess(x):
            return max(0.0, stats.norm.pdf(x, *p) - math.exp(2.0) * stats.norm.pdf(x, *q))
        numeric = integrate.quad(excess, -40, 40, points=[-5, 0, 5], limit=500)[0]
        assert _gaussian_delta(2.0, p, q) == pytest.approx(numeric, rel=1e-6)
    mu = 12.0  # far in the tails: the mu-GDP closed form in log space
    eps = gaussian_pair_epsilon((mu, 1.0), (0.0, 1.0), 1e-5)
    delta = math.exp(stats.norm.logcdf(-eps / mu + mu / 2)) - math.exp(eps + stats.norm.logcdf(-eps / mu - mu / 2))
    assert delta == pytest.approx(1e-5, rel=1e-3)


def test_lower_bound_finds_members_scored_low_and_either_hypothesis_as_positive():
    low = epsilon_lower_bound(np.zeros(2000), np.ones(2000), delta=1e-5)
    assert low > 5.0
    rng = np.random.default_rng(1)  # members spread wide, others narrow: the others' side is the informative one
    wide = epsilon_lower_bound(rng.normal(size=4000) * 5, rng.normal(size=4000) * 0.01, delta=1e-5)
    assert wide > 1.0


def test_covariance_statistic_is_the_gaussian_log_likelihood_ratio():
    from fedlora.audit import _covariance_scores

    rng = np.random.default_rng(2)
    b, sigma = 8, 0.7
    x, neighbour = rng.normal(size=(5, 2)), rng.normal(size=(5, 2))
    rows = {1: [rng.normal(size=(b, 4)) for _ in range(3)], 0: [rng.normal(size=(b, 4)) for _ in range(3)]}
    scores = _covariance_scores(rows, x, neighbour, vectorized=False, colluders=3, sketch_dim=b, sigma=sigma, tau=1.0)

    def covariance(target):
        g = np.concatenate([target, x], axis=1)  # the target, then the colluders' mean (noise sigma^2 / 3)
        return g.T @ g / b + np.diag([sigma ** 2] * 2 + [sigma ** 2 / 3] * 2)

    exact = {h: np.array([stats.multivariate_normal(np.zeros(4), covariance(x)).logpdf(y).sum()
                          - stats.multivariate_normal(np.zeros(4), covariance(neighbour)).logpdf(y).sum()
                          for y in rows[h]]) for h in rows}
    offset = exact[1][0] - scores[1][0]  # equal up to the log-determinant constant
    for h in (1, 0):
        assert np.allclose(scores[h] + offset, exact[h])


def test_canary_epsilon_refuses_degenerate_scores():
    with pytest.raises(ValueError, match="finite"):
        canary_epsilon(np.ones(10), np.random.default_rng(0).normal(size=10), 1e-5)
    with pytest.raises(ValueError, match="finite"):
        canary_epsilon(np.array([np.nan, 1.0]), np.random.default_rng(0).normal(size=10), 1e-5)


def test_lower_bound_is_zero_for_one_distribution_and_capped_by_the_trials():
    rng = np.random.default_rng(0)
    same = epsilon_lower_bound(rng.normal(size=4000), rng.normal(size=4000), delta=1e-5)
    assert same < 0.3
    apart = epsilon_lower_bound(np.full(2000, 1.0), np.zeros(2000), delta=1e-5)
    assert 5.0 < apart < math.log(1000)  # 1000 held-out trials per side cannot certify more than ln 1000


# -- mechanism level --------------------------------------------------------------------------------
def test_the_noise_free_sketch_is_caught():
    """Paper 001, Prop. 2 / App. F.1: a secret sketch without noise is not private (AUC > 0.99)."""
    result = audit_mechanism(Mechanism(MatrixSketch(16), 1.0, 0.0, "secret-sketch"), shape=SMALL, trials=500)
    assert result.auc > 0.99 and result.tpr_at_fpr_0_01 > 0.99
    assert result.accountant_epsilon == math.inf and result.empirical_epsilon > 4
    assert "covariance" in result.attack


def test_gaussian_mechanism_lower_bound_stays_below_its_known_epsilon_and_the_attack_is_optimal():
    z = 2.0
    result = audit_mechanism(gaussian_mechanism(clip_norm=1.0, noise_multiplier=z), shape=SMALL, trials=3000)
    assert 0 < result.empirical_epsilon < result.accountant_epsilon
    # the likelihood ratio test of N(X, s^2) vs N(-X, s^2), ||2 X|| = 2 tau: AUC = Phi(mu / sqrt 2), mu = 2 / z
    assert result.auc == pytest.approx(stats.norm.cdf(2 / z / math.sqrt(2)), abs=0.02)


def test_secret_vector_sketch_covariance_statistic_is_the_likelihood_ratio():
    """SGMV with a secret R: releases of X (norm tau) are N(0, (tau^2 / h + s^2) I_h), of 0 are N(0, s^2 I_h);
    the likelihood ratio test has AUC P(F(h, h) > 1 / kappa), kappa = 1 + tau^2 / (h s^2)."""
    h, z = 16, 0.25
    result = audit_mechanism(sgmv_mechanism(sketch_dim=h, clip_norm=1.0, noise_multiplier=z,
                                            threat_model="secret-sketch"), shape=SMALL, trials=2000)
    kappa = 1 + 1 / (h * z * z)
    assert result.auc == pytest.approx(stats.f.sf(1 / kappa, h, h), abs=0.02)


def test_colluding_clients_refute_the_papers_per_message_epsilon_not_ours():
    """Sixty-four clients share a secret R: those the attacker knows reveal R X. The paper's per-message epsilon
    is exceeded by a 95% lower bound; fedlora's joint-release bound is not."""
    mechanism = sgmm_mechanism(sketch_dim=150, clip_norm=1.0, noise_multiplier=0.8, threat_model="secret-sketch")
    result = audit_mechanism(mechanism, shape=(192, 4), trials=3000, clients_per_round=64)
    assert result.claimed_epsilon is not None
    assert result.claimed_epsilon < result.empirical_epsilon < result.accountant_epsilon


def test_the_audit_is_reproducible_from_its_seed():
    mechanism = sgmm_mechanism(sketch_dim=16, clip_norm=1.0, noise_multiplier=1.0)
    first, again = (audit_mechanism(mechanism, shape=SMALL, trials=300, seed=5).to_json() for _ in range(2))
    other = audit_mechanism(mechanism, shape=SMALL, trials=300, seed=6).to_json()
    first.pop("seconds"), again.pop("seconds"), other.pop("seconds")
    assert first == again
    assert first["auc"] != other["auc"]


def test_secure_aggregation_audit_sees_the_server_placements_gaussian_in_the_sum_and_one_reply_barely_noised():
    """SecAgg+ with N_min = 8 of 10 replies: the decoded sum of N_min replies carries the server placement's noise
    (AUC of the likelihood ratio test Phi(mu / sqrt 2), mu = 2 / z, as for GM); one reply decoded alone carries
    z / sqrt(N_min). Both lower bounds stay below their accountant's epsilon, and the reply alone is far less
    private."""
    z, n_min = 2.0, 8
    mechanism = gaussian_mechanism(clip_norm=1.0, noise_multiplier=z, placement="secagg")
    summed = audit_secure_sum(mechanism, clients_per_round=10, min_replies=n_min, shape=SMALL, trials=3000)
    alone = audit_secure_sum(mechanism, clients_per_round=10, min_replies=n_min, alone=True, shape=SMALL,
                             trials=3000)
    assert summed.auc == pytest.approx(stats.norm.cdf(2 / z / math.sqrt(2)), abs=0.02)
    assert alone.auc == pytest.approx(stats.norm.cdf(2 * math.sqrt(n_min) / z / math.sqrt(2)), abs=0.02)
    assert 0 < summed.empirical_epsilon < summed.accountant_epsilon < alone.empirical_epsilon < alone.accountant_epsilon
    assert summed.threat_model == ("known-sketch, noise in client shares under secure aggregation; against the server "
                                    "(sample known, drawn as the protocol says)")
    with pytest.raises(ValueError, match="private mechanism"):
        audit_secure_sum(gaussian_mechanism(clip_norm=1.0, noise_multiplier=0.0, placement="secagg"),
                         clients_per_round=10, min_replies=8, shape=SMALL)


def test_audit_refuses_bad_input():
    with pytest.raises(ValueError, match="clip norm"):
        audit_mechanism(Mechanism(), shape=SMALL)
    with pytest.raises(ValueError, match="at least 100 trials"):
        audit_mechanism(gaussian_mechanism(clip_norm=1.0, noise_multiplier=1.0), shape=SMALL, trials=10)


# -- federation level -------------------------------------------------------------------------------
def test_canary_scores_find_an_inserted_direction():
    rng = np.random.default_rng(0)
    d = 2000
    inserted, null = rng.normal(size=(50, d)), rng.normal(size=(1300, d))
    views = np.cumsum(rng.normal(size=(4, d)), axis=0)
    views[2:] += inserted.sum(axis=0) / 5  # every inserted canary enters the update of round 2
    scores_in, scores_null = canary_scores(views, inserted), canary_scores(views, null)
    assert roc_auc(scores_in, scores_null) > 0.99
    assert canary_epsilon(scores_in, scores_null, 1e-5) > 3
    assert canary_epsilon(scores_null[:300], scores_null[300:], 1e-5) < 1.0  # nothing inserted: near 0


def _randomized_response(eps: float, m: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Coins of m canaries and an eps-DP release of each: its coin, flipped with probability 1 / (1 + e^eps)."""
    rng = np.random.default_rng(seed)
    coins = rng.random(m) < 0.5
    said = coins ^ (rng.random(m) < 1 / (1 + math.exp(eps)))
    return said + 1e-3 * rng.random(m), coins  # the jitter only orders ties


def test_one_run_bound_stays_below_a_known_epsilon_and_finds_most_of_it():
    from fedlora.audit import one_run_lower_bound

    bounds = [one_run_lower_bound(*_randomized_response(1.0, 4000, seed), delta=0.0) for seed in range(10)]
    assert max(bounds) < 1.0 and min(bounds) > 0.6  # eps-DP randomized response is exactly 1-DP
    assert one_run_lower_bound(*_randomized_response(0.0, 4000, 0), delta=0.0) < 0.2  # nothing to find


def test_one_run_bound_grows_with_a_perfect_attack_and_its_delta_term_only_lowers_it():
    from fedlora.audit import one_run_lower_bound

    rng = np.random.default_rng(0)
    coins = rng.random(1000) < 0.5
    scores = coins + 1e-3 * rng.random(1000)  # the attacker is always right
    strict, loose = one_run_lower_bound(scores, coins, delta=0.0), one_run_lower_bound(scores, coins, delta=1e-5)
    assert 3.5 < strict < 4.5 and 3 < loose < strict  # 256 right guesses in a row certify no more than about 3.8
    with pytest.raises(ValueError, match="one finite score and one coin per canary"):
        one_run_lower_bound(scores, coins[:10], delta=0.0)


def test_flex_canary_signature_is_the_adapter_product():
    config = load_config(None, ["strategy=flexlora", 'message="adapter"'])
    b, a = torch.randn(6, 2), torch.randn(2, 5)
    head = torch.randn(3)
    signature = canary_signature(Protocol(config, 0.0), {"x.lora_B": b, "x.lora_A": a, "head.weight": head})
    assert np.allclose(signature, np.concatenate([head.double().numpy(), (b.double() @ a.double()).reshape(-1).numpy()]))


def test_flex_update_canaries_are_seen_through_the_factors_clients_download():
    """FlexLoRA's updates: a canary's signature is its product change itself, and a state's view is B A of the
    factors clients download (the top-r of the server's dense product, which observers of the model never see)."""
    from fedlora.audit import model_view
    from fedlora.round_plan import DENSE, GlobalState

    protocol = Protocol(load_config(None, ["strategy=flexlora"]), 0.0)
    b, a, w, head = torch.randn(6, 2), torch.randn(2, 5), torch.randn(6, 5), torch.randn(3)
    canary = {"x.lora_BA": w, "head.weight": head}
    assert np.allclose(canary_signature(protocol, canary),
                       np.concatenate([head.double().numpy(), w.double().reshape(-1).numpy()]))
    state = GlobalState({"x.lora_A": a, "x.lora_B": b, "x.lora_BA": w, "head.weight": head}, DENSE)
    view = model_view(protocol, state, state.message, list(canary))
    assert np.allclose(view, np.concatenate([head.double().numpy(), (b.double() @ a.double()).reshape(-1).numpy()]))


def _canary_config(strategy: str):
    return load_config(None, [f"strategy={strategy}", *[f"{k}={v}" for k, v in PAPER_FORM.items()], "num-clients=120",
                              "clients-per-round=20", "num-rounds=3",
                              "train-examples=1200", "test-examples=200", "eval-every=3", "local-steps=2"])


def test_canary_run_catches_a_non_private_strategy(tmp_path):
    from fedlora.strategies.canary_audit import audit_federation

    result = audit_federation(_canary_config("ffa-lora"), 100, tmp_path / "run", echo=lambda line: None)
    assert result.level == "federation" and 30 < result.trials < 70  # each of the 100 canaries in with probability 1/2
    assert result.auc > 0.6 and result.accountant_epsilon == math.inf  # the canaries never sampled score as null
    assert result.threat_model == "no noise: not private"  # no placement named for noise that is not added
    assert result.empirical_epsilon > 0.5  # a lower bound from this one run: provably not epsilon-DP for small epsilon
    assert (tmp_path / "run" / "metrics.jsonl").is_file()  # a real run, with its run directory


@pytest.mark.parametrize("levers", [[], ["noise-placement=server", "message=update", "server-optimizer=momentum",
                                          "clip-quantile=0.5"]], ids=["paper", "server-update-adaptive"])
def test_canary_run_of_a_private_strategy_estimates_below_its_accountant(tmp_path, levers):
    """Also with noise at the server and updates: the canaries are scored on the global model round by round,
    what that placement's adversary sees."""
    from fedlora.strategies.canary_audit import audit_federation

    config = RunConfig.from_mapping({**_canary_config("sgmm-ffa-lora").to_mapping(), **dict(map(parse_assignment, levers))})
    result = audit_federation(config, 100, tmp_path / "run", echo=lambda line: None)
    assert result.threat_model.startswith(f"known-sketch, noise at the {config.noise_placement}")
    from fedlora.privacy.events import observer_label
    assert result.threat_model.endswith(observer_label("model", "known-sketch", config.noise_placement))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert result.accountant_epsilon == pytest.approx(rows[-1]["epsilon"])  # the run's own ledger
    assert result.accountant_epsilon <= config.target_epsilon
    assert result.empirical_epsilon < result.accountant_epsilon and result.estimate_epsilon < result.accountant_epsilon


def test_canary_run_through_secure_aggregation_finds_weakly_noised_canaries_and_stays_below_its_accountant(tmp_path):
    """The canaries take part in SecAgg+ like any client (their noise shares, masks and all): at a small noise
    multiplier the sum shows them, and the one-run bound still stays below the run's own ledger."""
    from fedlora.strategies.canary_audit import audit_federation

    config = RunConfig.from_mapping({**_canary_config("gm-ffa-lora").to_mapping(), "noise-placement": "secagg",
                                     "message": "update", "target-epsilon": 0, "noise-multiplier": 0.05})
    result = audit_federation(config, 100, tmp_path / "run", echo=lambda line: None)
    assert result.threat_model.startswith("known-sketch, noise in client shares under secure aggregation")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["replies"] == config.clients_per_round and result.accountant_epsilon == pytest.approx(rows[-1]["epsilon"])
    assert result.auc > 0.6 and 0.5 < result.empirical_epsilon < result.accountant_epsilon


# -- the command line -------------------------------------------------------------------------------
def test_fedlora_audit_json_has_the_documented_keys(tmp_path, capsys):
    code = main(["audit", "--json", "--trials", "200", "--canaries", "100", "--out", str(tmp_path / "a"),
                 "--set", "num-clients=120", "--set", "clients-per-round=20", "--set", "num-rounds=2",
                 "--set", "train-examples=1200", "--set", "test-examples=200", "--set", "local-steps=2"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    for result in (printed, printed["federation"]):
        for key in ("auc", "tpr_at_fpr_0.01", "tpr_at_fpr_0.1", "empirical_epsilon", "accountant_epsilon",
                    "threat_model"):
            assert key in result
    assert printed["threat_model"].startswith("known-sketch, noise at the server") and printed["strategy"] == "sgmm-ffa-lora"
    assert json.loads((tmp_path / "a" / "audit.json").read_text()) == printed


@pytest.mark.parametrize("argv, message", [
    (["--canaries", "5"], "Canaries must number at least 100"),
    (["--canaries", "100", "--set", "head=probe"], 'use head = "message"'),
    (["--canaries", "100", "--set", "sampling=poisson"], 'use sampling = "fixed"'),
    (["--set", "strategy=nope"], "strategy must be one of"),
    (["--set", "target-epsilon=0.001"], "unreachable"),
    (["--canaries", "100", "--set", "simulation-nodes=4"], "leave simulation-nodes at 0"),
    (["--set", "noise-placement=secagg", "--set", "strategy=ffa-lora"], "adds the noise in shares"),
])
def test_fedlora_audit_bad_input_is_one_line_and_exit_2(argv, message, tmp_path, capsys):
    assert main(["audit", "--trials", "200", "--out", str(tmp_path / "a"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "a").exists()


def test_fedlora_audit_of_secure_aggregation_audits_the_sum_and_one_reply_alone(tmp_path, capsys):
    code = main(["audit", "--json", "--trials", "200", "--canaries", "0", "--out", str(tmp_path / "a"),
                 "--set", "noise-placement=secagg"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert "sum of N_min = 45 of 50" in printed["name"] and "one reply alone" in printed["one_reply"]["name"]
    assert printed["threat_model"].endswith("against the server (sample known, drawn as the protocol says)")
    assert printed["one_reply"]["threat_model"].endswith("against a server that breaks SecAgg+ (one reply alone, "
                                                         "sample known, the target sampled every round)")
    assert printed["accountant_epsilon"] < printed["one_reply"]["accountant_epsilon"]
    assert printed["federation"] is None


def test_a_run_audit_prints_its_estimate_even_when_infinite():
    from fedlora.cli import _audit_lines

    run = {"level": "federation", "name": "ffa-lora run", "attack": "cosine", "auc": 0.85, "tpr_at_fpr_0.01": 0.7,
           "tpr_at_fpr_0.1": 0.7, "empirical_epsilon": 2.42, "empirical_kind": "lower bound at 95% confidence, one run",
           "accountant_epsilon": None, "delta": 1e-5, "threat_model": "known-sketch", "claimed_epsilon": None,
           "estimate_epsilon": None, "null_epsilon": 0.39}
    lines = _audit_lines(run)
    assert "estimate inf" in lines and "0.390 (its noise floor)" in lines and "accountant epsilon inf" in lines


def test_verdict_refutes_by_the_lower_bound_never_by_the_estimate():
    """The estimate (a point value, no confidence) may exceed the accountant by chance; only the lower bound
    refutes it."""
    from fedlora.audit import verdict

    bound = {"claimed_epsilon": None, "estimate_epsilon": 5.0}
    assert verdict({**bound, "empirical_epsilon": 3.0, "accountant_epsilon": 2.0}) == "the accountant is refuted"
    assert verdict({**bound, "empirical_epsilon": 1.0, "accountant_epsilon": 2.0}) == "the accountant holds"
    assert "1.68 is refuted" in verdict({**bound, "empirical_epsilon": 3.3, "accountant_epsilon": 40.7,
                                         "claimed_epsilon": 1.68})
    assert verdict({**bound, "empirical_epsilon": 7.2, "accountant_epsilon": None}).startswith("not private")
