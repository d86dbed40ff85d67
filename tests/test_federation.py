"""Whole federations in process (no Ray): every strategy's round trip, the ledger, and learning."""

import json

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from peft import PeftModel
from safetensors.torch import load_file

from fedlora.algorithms import ALGORITHMS, PRIVATE_ALGORITHMS
from fedlora.checkpoint import BUDGET_SPENT, Checkpoint
from fedlora.clients.app import app as client_app
from fedlora.config import RunConfig, run_config_of
from fedlora.run_keys import SIMULATION_KEY
from fedlora.data import load_split, to_torch
from fedlora.experiment import noise_for, reconstruct, sampling_of
from fedlora.client_round import overlapped
from fedlora.federation import Protocol
from fedlora.round_plan import DENSE
from fedlora.models import build_backbone
from fedlora.node import secret_fingerprint, write_sketch_secret
from fedlora.privacy import epsilon
from fedlora.sketch import Side, is_product, side_of
from fedlora.strategies.server_app import run_federation
from fedlora.strategies.inprocess_grid import InProcessGrid
from fedlora.training import evaluate
from tests.helpers import PAPER_FORM

SMALL = {**PAPER_FORM, "num-clients": 5, "clients-per-round": 3, "num-rounds": 2, "local-steps": 2, "batch-size": 8,
         "train-examples": 200, "test-examples": 60, "num-classes": 10, "sketch-dim": 16}


def _run(tmp_path, **overrides):
    config = {**SMALL, **{k.replace("_", "-"): v for k, v in overrides.items()}, "out-dir": str(tmp_path)}
    grid = InProcessGrid(client_app, config.get("simulation-nodes") or config["num-clients"], config)
    strategy = run_federation(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                            run_config=config), echo=lambda line: None)
    return strategy, grid, config


@pytest.mark.parametrize("strategy_name", ["sgmm-ffa-lora", "sgmv-ffa-lora", "sgmm-flexlora", "gm-ffa-lora",
                                           "gm-flexlora", "ffa-lora", "flexlora"])
def test_every_strategy_round_trips(tmp_path, strategy_name):
    strategy, grid, config = _run(tmp_path, strategy=strategy_name, target_epsilon=10.0)
    state, protocol = strategy.state, strategy.protocol
    assert len(grid.calls) == 2 * 3  # N of C clients per round
    sketched = protocol.algorithm.sketched
    assert state.produced_by == (2 if sketched else DENSE)
    for name, t in state.message.items():
        side = side_of(name)
        if side is Side.DENSE:
            assert name.startswith("classifier.")  # the head travels dense, with noise
        elif strategy_name.startswith("sgmv"):
            assert t.shape == (16,)  # h
        elif sketched:
            assert t.shape == ((16, 4) if side is Side.LEFT else (4, 16))  # R B, A R_A
        else:
            assert t.shape == ((192, 4) if side is Side.LEFT else (4, 192))
    assert any(side_of(n) is Side.RIGHT for n in state.message) == ("flex" in strategy_name)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    for key in ("round", "accuracy", "loss", "epsilon", "delta", "noise_multiplier", "threat_model", "bytes_up",
                "bytes_down", "seconds"):
        assert key in rows[-1]
    assert rows[-1]["bytes_up"] > 0 and rows[-1]["bytes_down"] > 0
    assert all(r["replies"] == 3 and r["rejected"] == 0 for r in rows)  # honest replies pass the server's checks
    assert (tmp_path / "accuracy.png").stat().st_size > 0
    # the PEFT adapter a user loads onto the same backbone is the run's final global model: its accuracy
    run_config = run_config_of(config)
    loaded = PeftModel.from_pretrained(build_backbone(run_config.model, num_classes=10), str(tmp_path / "adapter"))
    test = to_torch(load_split(run_config, "test"), 32)
    assert evaluate(loaded, test) == pytest.approx((rows[-1]["accuracy"], rows[-1]["loss"]), rel=1e-5)
    if protocol.algorithm.private:
        # the ledger after T rounds equals the accountant's epsilon for the same parameters, within the budget
        ledger = strategy.ledger
        expected = epsilon(ledger.phases, delta=1e-5, threat_model="known-sketch").epsilon
        assert rows[-1]["epsilon"] == pytest.approx(expected) and expected <= 10.0
        assert rows[-1]["noise_multiplier"] == pytest.approx(noise_for(run_config_of(config)).noise_multiplier)
    else:
        assert rows[-1]["epsilon"] == float("inf") and "not private" in rows[-1]["threat_model"]


def test_flexlora_with_heterogeneous_client_ranks(tmp_path):
    strategy, _, _ = _run(tmp_path, strategy="flexlora", client_ranks="4,2,1")
    b = next(t for n, t in strategy.state.message.items() if side_of(n) is Side.LEFT)
    assert b.shape == (192, 4)


def test_secret_sketch_run_accounts_the_joint_release(tmp_path):
    strategy, _, _ = _run(tmp_path, strategy="sgmm-ffa-lora", threat_model="secret-sketch", target_epsilon=10.0)
    parts = strategy.ledger.phases[0].release
    assert parts[0].clients_per_round == 3 and parts[0].sketch_dim == 16
    assert len(parts) == 2  # the dense head is composed as a Gaussian release


def test_non_private_ffa_lora_learns_above_chance(tmp_path):
    strategy, _, _ = _run(tmp_path, strategy="ffa-lora", num_clients=4, clients_per_round=4, num_rounds=4,
                          local_steps=8, batch_size=16, train_examples=800, test_examples=200, lr=0.1)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["accuracy"] > 0.3  # 10 classes: chance is 0.1


def test_the_quickstarts_private_setting_rises_above_chance(tmp_path):
    """The quickstart (sgmm-ffa-lora, pretrained tiny ViT, N = 50 updates with noise at the server) for 2 rounds,
    calibrated for epsilon 8 over those 2 rounds, fixed seed: a check that it learns, not a benchmark (its 10-round
    run reaches 0.86, the non-private one 0.99)."""
    config = {"num-rounds": 2, "eval-every": 2, "test-examples": 300, "out-dir": str(tmp_path)}
    grid = InProcessGrid(client_app, 500, config)
    run_federation(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config),
                   echo=lambda line: None)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["epsilon"] <= 8.0 and rows[-1]["threat_model"].startswith("known-sketch, noise at the server")
    assert rows[-1]["accuracy"] > 0.3  # 10 classes: chance is 0.1


def test_private_sgmm_flexlora_in_the_quickstarts_setting_rises_above_chance(tmp_path):
    """The quickstart's setting with sgmm-flexlora (clients send the sketched change of each product B A, noise at
    the server) for 2 rounds calibrated for epsilon 8 over them, fixed seed: its updates accumulate, where the
    adapter form sat at chance (docs/explanation/private-learning.md, FlexLoRA: updates of the product)."""
    config = {"strategy": "sgmm-flexlora", "num-rounds": 2, "eval-every": 2, "test-examples": 300,
              "out-dir": str(tmp_path)}
    grid = InProcessGrid(client_app, 500, config)
    run_federation(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config),
                   echo=lambda line: None)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["epsilon"] <= 8.0 and rows[-1]["threat_model"].startswith("known-sketch, noise at the server")
    assert rows[-1]["accuracy"] > 0.3, rows[-1]  # 10 classes: chance is 0.1


def test_linear_probe_then_lora_composes_two_phases(tmp_path):
    strategy, _, _ = _run(tmp_path, strategy="sgmm-ffa-lora", head="probe", num_rounds=3, probe_rounds=1,
                          target_epsilon=10.0)
    ledger = strategy.ledger
    assert [(p.name, p.rounds) for p in ledger.phases] == [("linear-probe", 1), ("lora", 2)]
    assert ledger.epsilon <= 10.0
    probe_alone = epsilon(ledger.phases[:1], delta=1e-5, threat_model="known-sketch").epsilon
    assert probe_alone == pytest.approx(0.2 * 10.0, rel=0.01)  # about 20% of the budget goes to the probe
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["linear-probe", "lora", "lora"]
    # after the probe the head is frozen: LoRA releases carry adapters only, the head stays in the global state
    head = {n: t for n, t in strategy.state.message.items() if n.startswith("classifier.")}
    assert head and all(torch.isfinite(t).all() for t in head.values())


def test_probe_phase_trains_only_the_head(tmp_path):
    strategy, _, _ = _run(tmp_path, strategy="ffa-lora", head="probe", num_rounds=2, probe_rounds=1)
    protocol = Protocol(strategy.protocol.config, strategy.protocol.noise_multiplier)  # a client's side too
    assert protocol.phase(1) == "linear-probe" and protocol.phase(2) == "lora"
    model = protocol.build_model()
    protocol._set_trainable(model, "linear-probe")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("modules_to_save" in n for n in trainable)
    protocol._set_trainable(model, "lora")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_B" in n for n in trainable)


def test_same_seed_same_run_whatever_the_worker_did_before(tmp_path):
    """Ray workers carry different global RNG states; a run must not depend on them."""
    def run(out, draws):
        def client(message, context):
            torch.rand(draws)  # what other clients of this worker drew before
            return client_app(message, context)

        config = {**SMALL, "strategy": "sgmm-ffa-lora", "target-epsilon": 10.0, "out-dir": str(out)}
        return run_federation(InProcessGrid(client, 5, config), Context(run_id=1, node_id=0, node_config={},
                                                                        state=RecordDict(), run_config=config),
                              echo=lambda line: None).state.message

    first, second = run(tmp_path / "a", 0), run(tmp_path / "b", 7)
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_sampling_follows_partitions_not_node_ids(tmp_path):
    """Simulated node ids are random per run: the same seed must pick the same partitions anyway."""
    def run(out, node_ids):
        config = {**SMALL, "strategy": "gm-ffa-lora", "target-epsilon": 10.0, "out-dir": str(out)}
        grid = InProcessGrid(client_app, 5, config, node_ids=node_ids)
        strategy = run_federation(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                                run_config=config), echo=lambda line: None)
        partition_of = {node: p for p, node in strategy.nodes.items()}
        return [partition_of[n] for n in grid.calls], strategy.state.message

    calls_a, state_a = run(tmp_path / "a", [2 ** 63 + 5, 17, 2 ** 40, 99, 3])
    calls_b, state_b = run(tmp_path / "b", [8, 2 ** 62, 1, 2 ** 64 - 1, 12345])
    assert calls_a == calls_b
    assert all(torch.equal(state_a[n], state_b[n]) for n in state_a)


def test_the_sample_comes_from_the_run_seed_only_with_seeded_noise(tmp_path):
    """Every SuperNode receives the run seed (0 unless set): a sample drawn from it would be known to every client,
    and the epsilon against observers of the model, amplified because they do not know who took part, would not
    hold against them. So with OS noise the sample comes from the OS too; seeded simulations stay reproducible."""
    def draws(noise_source):
        config = RunConfig.from_mapping({**SMALL, "num-clients": 100, "clients-per-round": 10,
                                         "noise-source": noise_source})
        protocol = Protocol(config, 1.0)
        return [sampling_of(config).draw(protocol.sampling_generator(release)) for release in range(1, 6)]

    assert draws("seeded") == draws("seeded") and draws("seeded")[0] == [6, 13, 18, 26, 33, 36, 51, 52, 63, 65]
    assert draws("os") != draws("os") and draws("os") != draws("seeded")


def test_a_simulation_names_each_client_s_partition_instead_of_asking_the_nodes(tmp_path):
    """Under the simulation engine the server sends partition p to the p-th node id, naming p in the message, without
    querying the nodes first: the run is the one that asks each node which partition it holds."""
    def run(out, simulated):
        config = {**SMALL, "strategy": "gm-ffa-lora", "target-epsilon": 10.0, "out-dir": str(out),
                  SIMULATION_KEY: simulated}
        queries = []

        def client(message, context):
            if message.metadata.message_type == "query":
                queries.append(context.node_id)
            return client_app(message, context)

        grid = InProcessGrid(client, 5, config, node_ids=[2 ** 63 + 5, 17, 2 ** 40, 99, 3])
        strategy = run_federation(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                                run_config=config), echo=lambda line: None)
        return strategy, queries

    (asked, queries), (named, none) = run(tmp_path / "asked", False), run(tmp_path / "named", True)
    assert len(queries) == 5 and none == []
    assert named.nodes == dict(enumerate(sorted(named.nodes.values())))
    assert all(torch.equal(asked.state.message[n], named.state.message[n]) for n in asked.state.message)
    row = json.loads((tmp_path / "named" / "metrics.jsonl").read_text().splitlines()[0])
    assert set(row["startup"]) == {"process", "imports", "noise calibration", "model", "nodes"}


def _secret_run(tmp_path, secrets_by_partition):
    """An in-process secret-sketch run whose nodes read the sketch secret from files, as deployed ones do."""
    config = {**SMALL, "strategy": "sgmm-ffa-lora", "threat-model": "secret-sketch", "sketch-secret": "node-file",
              "target-epsilon": 10.0, "out-dir": str(tmp_path)}
    grid = InProcessGrid(client_app, config["num-clients"], config)
    for partition, node_id in enumerate(grid.node_ids):
        if secrets_by_partition[partition] is not None:
            grid.contexts[node_id].node_config["sketch-secret-file"] = str(secrets_by_partition[partition])
    return run_federation(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config),
                          echo=lambda line: None)


def test_nodes_must_share_one_sketch_secret(tmp_path):
    a, b = write_sketch_secret(tmp_path / "a"), write_sketch_secret(tmp_path / "b")
    with pytest.raises(RuntimeError, match="different sketch secrets"):
        _secret_run(tmp_path / "differ", [a, a, a, b, a])
    with pytest.raises(RuntimeError, match=r"partitions \[2\] have no sketch-secret-file"):
        _secret_run(tmp_path / "missing", [a, a, None, a, a])
    strategy = _secret_run(tmp_path / "ok", [a] * 5)
    assert strategy.secret_fingerprint == secret_fingerprint(a)
    with pytest.raises(ValueError, match="is not the sketch secret this run's nodes held"):
        reconstruct(tmp_path / "ok", b, echo=lambda line: None)
    accuracy = reconstruct(tmp_path / "ok", a, echo=lambda line: None)["accuracy"]
    assert 0 <= accuracy <= 1 and (tmp_path / "ok" / "adapter" / "adapter_config.json").exists()


# -- the levers: noise placement, update form, adaptive clipping -------------------------------------
LEVERS = {"noise-placement": "server", "message": "update", "server-optimizer": "momentum", "clip-quantile": 0.5,
          "clip-count-stddev": 2.0, "target-epsilon": 30.0}


@pytest.mark.parametrize("strategy_name", ["sgmm-ffa-lora", "sgmv-ffa-lora", "gm-ffa-lora", "sgmm-flexlora",
                                           "gm-flexlora"])
def test_every_private_strategy_runs_with_noise_at_the_server(tmp_path, strategy_name):
    ffa = "ffa" in strategy_name
    levers = LEVERS if ffa else {"noise-placement": "server", "clip-quantile": 0.5, "clip-count-stddev": 2.0,
                                 "target-epsilon": 30.0}  # FlexLoRA keeps the adapter form
    strategy, _, config = _run(tmp_path, strategy=strategy_name, **{k.replace("-", "_"): v for k, v in levers.items()})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["threat_model"].startswith("known-sketch, noise at the server") and r["replies"] == 3 for r in rows)
    assert rows[-1]["epsilon"] <= 30.0 and rows[0]["clip_norm"] == 1.0 and rows[1]["clip_norm"] != 1.0
    assert strategy.state.produced_by == (DENSE if ffa or not strategy.protocol.algorithm.sketched else 2)
    if ffa:  # updates keep the global state dense, and the optimizer's momentum for every entry sent
        assert all(side_of(n) is not Side.LEFT or t.shape == (192, 4) for n, t in strategy.state.message.items())
        assert set(strategy.optimizer.state) == {f"momentum/{n}" for n in strategy.state.message
                                                 if side_of(n) is Side.LEFT or n.startswith("classifier.")}


def test_updates_at_server_lr_1_without_noise_are_fedavg_of_the_local_adapters(tmp_path):
    adapters, _, _ = _run(tmp_path / "adapter", strategy="ffa-lora", num_rounds=3)
    updates, _, _ = _run(tmp_path / "update", strategy="ffa-lora", message="update", server_optimizer="sgd",
                         server_lr=1.0, num_rounds=3)
    for name, t in adapters.state.message.items():
        torch.testing.assert_close(updates.state.message[name], t, rtol=0, atol=1e-6)


@pytest.mark.parametrize("placement", ["client", "server"])
@pytest.mark.parametrize("strategy_name", ["gm-ffa-lora", "sgmm-ffa-lora"])
def test_the_noise_on_the_aggregate_has_the_stated_deviation(placement, strategy_name):
    """All clients send zero: the aggregate is pure noise, with std z tau / N at the server and z tau / sqrt(N)
    at the client, per entry (of the sketched space for SGMM). Fixed seed; 3% tolerance (several thousand entries:
    the sample std's own error is under 1.5%)."""
    from fedlora.federation import Protocol
    from fedlora.config import RunConfig

    n, z = 8, 1.5
    config = RunConfig.from_mapping({"strategy": strategy_name, "noise-placement": placement, "noise-multiplier": z,
                                     "target-epsilon": 0, "clients-per-round": n, "sketch-dim": 32,
                                     "message": "adapter"})  # the aggregate itself, in the sketch space
    protocol = Protocol(config, z)
    initial = protocol.initial_state(protocol.build_model())
    shapes = protocol.mechanism.released_shapes(protocol.expected_message(initial.message, 1, config.rank))
    zeros = {name: torch.zeros(shape) for name, shape in shapes.items()}
    releases = [protocol.privatize(zeros, round_=1, release=1, noise=torch.Generator().manual_seed(c))[0]
                for c in range(n)]
    state = protocol.aggregate(releases, 1, initial, clip_norm=config.clip_norm,
                               noise=torch.Generator().manual_seed(99))
    noise = torch.cat([state.message[name].reshape(-1) for name in shapes])
    expected = z * config.clip_norm / (n if placement == "server" else n ** 0.5)
    assert noise.numel() > 2000 and float(noise.std()) == pytest.approx(expected, rel=0.03)
    assert abs(float(noise.mean())) < 4 * expected / noise.numel() ** 0.5


@pytest.mark.parametrize("overrides", [
    {"strategy": "sgmm-ffa-lora", "noise-placement": "server", "message": "update", "clip-quantile": 0.5,
     "clip-count-stddev": 2.0},
    {"strategy": "sgmm-flexlora", "client-ranks": "2,4"},  # the paper's round: each client noises its own
])
def test_several_clients_per_message_make_the_same_run(tmp_path, overrides):
    """simulation-nodes deals a round's clients over a few nodes, several per message: the same releases, so the
    same global state, ledger and metrics as one message per client."""
    overrides = {**overrides, "target-epsilon": 10.0, "num-clients": 7, "clients-per-round": 5}
    one, _, _ = _run(tmp_path / "one", **overrides)
    packed, grid, _ = _run(tmp_path / "packed", simulation_nodes=2, **overrides)
    assert len(grid.node_ids) == 2 and len(grid.calls) == 2 * 2  # two messages a round
    assert all(torch.equal(one.state.message[n], packed.state.message[n]) for n in one.state.message)
    assert packed.ledger.report().epsilon == one.ledger.report().epsilon
    keep = ("accuracy", "epsilon", "replies", "failed", "rejected", "bytes_up", "clip_norm")
    rows = [[{k: r[k] for k in keep} for r in map(json.loads, (tmp_path / d / "metrics.jsonl").read_text().splitlines())]
            for d in ("one", "packed")]
    assert rows[0] == rows[1] and all(r["replies"] == 5 for r in rows[1])
    if "client-ranks" in overrides:  # FlexLoRA's SVD truncation can turn on float-level differences: see below
        return
    # and trained together, client-batch at a time: each client computes what it did alone, so the run ends the same
    batched, _, _ = _run(tmp_path / "batched", simulation_nodes=2, client_batch=8, **overrides)
    for name, value in one.state.message.items():
        assert (batched.state.message[name] - value).norm() <= 1e-4 * value.norm(), name
    assert batched.ledger.report().epsilon == one.ledger.report().epsilon
    rows = [list(map(json.loads, (tmp_path / d / "metrics.jsonl").read_text().splitlines())) for d in ("one", "batched")]
    assert [r["accuracy"] for r in rows[0]] == [r["accuracy"] for r in rows[1]]


def test_a_run_with_its_backbone_stored_in_bf16_ends_as_near_the_fp32_run_as_autocast_alone(tmp_path):
    """precision = "bf16-backbone", clients trained together and the server evaluating: the same epsilon as fp32 and
    bf16 autocast, and a final state about as near fp32's as autocast's (the residual stream's rounding
    costs about what the products' rounding costs)."""
    from fedlora.clients.rounds import _model
    from fedlora.config import run_config_of

    overrides = {"strategy": "sgmm-ffa-lora", "target-epsilon": 10.0, "simulation-nodes": 2, "client-batch": 3,
                 "noise-placement": "server", "message": "update"}
    runs = {p: _run(tmp_path / p, precision=p, **overrides) for p in ("fp32", "bf16", "bf16-backbone")}
    states = {p: strategy.state.message for p, (strategy, _, _) in runs.items()}
    assert len({strategy.ledger.report().epsilon for strategy, _, _ in runs.values()}) == 1

    def gap(p: str) -> float:
        return max(float((states[p][n] - t).norm() / t.norm()) for n, t in states["fp32"].items())

    assert 0 < gap("bf16") and 0 < gap("bf16-backbone") < 2 * gap("bf16")
    client_model, _ = _model(run_config_of(runs["bf16-backbone"][2]), 4)  # the one the run's clients trained
    assert {p.dtype for n, p in client_model.named_parameters() if "lora_" not in n and not p.requires_grad} == {
        torch.bfloat16}
    rows = [list(map(json.loads, (tmp_path / p / "metrics.jsonl").read_text().splitlines())) for p in runs]
    assert len(rows[2]) == 2 and all(abs(a["accuracy"] - b["accuracy"]) <= 0.1 for a, b in zip(rows[0], rows[2]))


def test_clients_trained_together_release_what_each_releases_alone():
    """FlexLoRA with mixed ranks (A and B trained; no noise, so the release is the update itself): the clients of one
    rank trained in one pass release, each, what it releases trained alone (within 1e-4), and a message's clients
    are grouped by rank. A whole FlexLoRA run is not compared: the server's truncated SVD of a noisy sum may pick
    other directions on float-level differences, where singular values nearly tie."""
    from fedlora.clients.rounds import client_groups
    from fedlora.config import RunConfig
    from fedlora.data import make_synthetic_cifar, to_torch
    from fedlora.federation import Protocol
    from fedlora.lora import get_adapters

    config = RunConfig.from_mapping({**SMALL, "strategy": "flexlora", "client-ranks": "2,4", "num-clients": 7})
    protocol = Protocol(config, 0.0)
    assert client_groups([0, 1, 2, 3, 4, 6], protocol, 2) == [[0, 2], [4, 6], [1, 3]]  # rank 2: even partitions
    model = protocol.build_model(2)
    base, state = get_adapters(model), protocol.initial_state(model)
    data = [to_torch(make_synthetic_cifar(40, num_classes=10, seed=p), 32, train=True) for p in (0, 2, 4)]
    rounds = dict(round_=1, release=1, clip_norm=None)
    together = protocol.local_rounds(model, base, data, state, partition_ids=[0, 2, 4], noises=[None] * 3, **rounds)
    assert any("lora_A" in n for n in together[0].release)
    for i, p in enumerate((0, 2, 4)):
        alone = protocol.local_round(model, base, data[i], state, partition_id=p, noise=None, **rounds)
        released = together[i].release
        assert released.keys() == alone.release.keys()
        error = sum((released[n] - alone.release[n]).norm() ** 2 for n in released) ** 0.5
        assert error <= 1e-4 * sum(t.norm() ** 2 for t in alone.release.values()) ** 0.5


@pytest.mark.parametrize("strategy_name", ["sgmv-ffa-lora", "sgmm-flexlora"])
def test_describe_gives_the_bytes_a_client_sends(tmp_path, capsys, strategy_name):
    """`fedlora describe --config` of a run's setting predicts the upload each client's release measured."""
    from fedlora.cli import main

    _, _, config = _run(tmp_path / "run", strategy=strategy_name, num_rounds=1, target_epsilon=10.0)
    preset = tmp_path / "preset.toml"
    preset.write_text("".join(f"{key} = {json.dumps(value)}\n" for key, value in config.items() if key != "out-dir"))
    assert main(["describe", "--config", str(preset), "--json"]) == 0
    predicted = {row["strategy"].split(" ")[0]: row["upload_bytes"]
                 for row in json.loads(capsys.readouterr().out)["mechanisms"]}
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["bytes_up"] == predicted[strategy_name]


def test_describe_gives_the_masked_vector_a_client_sends_under_secure_aggregation(tmp_path, capsys):
    """Under SecAgg+ the upload is the masked vector describe predicts, plus the protocol's keys and shares."""
    from fedlora.cli import main

    _, _, config = _run(tmp_path / "run", strategy="sgmm-flexlora", num_rounds=1, target_epsilon=10.0,
                        noise_placement="secagg", min_replies=3)
    preset = tmp_path / "preset.toml"
    preset.write_text("".join(f"{key} = {json.dumps(value)}\n" for key, value in config.items() if key != "out-dir"))
    assert main(["describe", "--config", str(preset), "--json"]) == 0
    vector = next(row["upload_bytes_secagg_vector"] for row in json.loads(capsys.readouterr().out)["mechanisms"]
                  if row["strategy"].startswith("sgmm-flexlora"))
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert vector < row["bytes_up"] < vector + 2048 * config["clients-per-round"], (vector, row["bytes_up"])


@pytest.mark.parametrize("strategy_name, form", [
    ("sgmm-ffa-lora", {}), ("gm-flexlora", {}),
    ("gm-ffa-lora", {"message": "update", "server-optimizer": "momentum"}),  # server state across rounds
], ids=["sgmm-ffa-lora", "gm-flexlora", "gm-ffa-lora-update-momentum"])
def test_secure_aggregation_aggregates_what_noise_at_the_server_does(tmp_path, strategy_name, form):
    """Near-zero noise: the global model through SecAgg+ (integers, masks, Flower's mod; FlexLoRA's clients encode
    their products; updates applied by server momentum) is the server placement's to within the quantization and
    the noise; no training reply the server receives carries arrays."""
    common = {"strategy": strategy_name, "noise-multiplier": 1e-4, "target-epsilon": 0.0, "min-replies": 3,
              "noise-source": "seeded", **form}
    server, _, _ = _run(tmp_path / "server", noise_placement="server",
                        **{k.replace("-", "_"): v for k, v in common.items()})
    received = []

    class Recording(InProcessGrid):
        def send_and_receive(self, messages, *, timeout=None):
            replies = super().send_and_receive(messages, timeout=timeout)
            received.extend(r for r in replies if r.has_content())
            return replies

    config = {**SMALL, **common, "noise-placement": "secagg", "out-dir": str(tmp_path / "secagg")}
    secure = run_federation(Recording(client_app, 5, config), Context(run_id=1, node_id=0, node_config={},
                                                                      state=RecordDict(), run_config=config),
                            echo=lambda line: None)

    def model(state):  # FlexLoRA's factors are defined up to signs: compare their products
        return {n: (state[n] @ state[n.replace("lora_B", "lora_A")] if n.endswith("lora_B") and
                    n.replace("lora_B", "lora_A") in state else state[n]) for n in state if not n.endswith("lora_A")}

    expected, got = model(server.state.message), model(secure.state.message)
    for name, t in expected.items():
        assert torch.allclose(got[name], t, atol=2e-3), name
    rows = [json.loads(line) for line in (tmp_path / "secagg" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["replies"] == 3 and r["threat_model"].startswith("known-sketch, noise in client shares under secure "
                                                                  "aggregation") for r in rows)
    assert all(set(r["epsilon_by_observer"]) == {"model", "server", "one-reply", "co-client"} for r in rows)
    assert all(not any(len(a) for a in r.content.array_records.values()) for r in received if
               r.metadata.message_type == "train")
    # and it writes what the server placement writes: the aggregate state, nothing per client
    written = [sorted("events.out.tfevents" if p.name.startswith("events.out.tfevents") else p.name  # stamped
                      for p in (tmp_path / placement).iterdir()) for placement in ("secagg", "server")]
    assert written[0] == written[1]
    assert set(load_file(tmp_path / "secagg" / "global-state.safetensors")) == \
        set(load_file(tmp_path / "server" / "global-state.safetensors"))


def test_given_the_noise_its_sum_carried_secure_aggregation_is_the_server_placement(tmp_path, monkeypatch):
    """At a real noise multiplier: record the noise each SecAgg+ round's decoded sum carried (decoded sum minus the
    plain sum of the clients' releases; its size is z tau sqrt(n / N_min)), then run the server placement adding
    exactly that noise: the same global model, round for round. What is left between the placements is the noise's
    law, which tests/test_secure_sum.py checks."""
    from fedlora.mechanisms import Mechanism
    from fedlora.secure_sum import SkellamSecureSum

    common = {"strategy": "gm-ffa-lora", "noise-multiplier": 1.0, "target-epsilon": 0.0, "min-replies": 3,
              "noise-source": "seeded", "message": "update", "server-optimizer": "momentum"}
    pending, noises = [], []
    encode, decode = SkellamSecureSum.encode, SkellamSecureSum.decode

    def recording_encode(self, release, generator):
        pending.append({n: t.double() for n, t in release.items()})
        return encode(self, release, generator)

    def recording_decode(self, total, dtype=torch.float32):
        out = decode(self, total, dtype)
        noise = {n: t.double() - sum(p[n] for p in pending) for n, t in out.items()}
        flat = torch.cat([t.ravel() for t in noise.values()])
        assert abs(float(flat.std()) / (self.noise_multiplier * self.clip_norm * (len(pending) / self.min_replies) ** 0.5)
                   - 1) < 0.1
        noises.append(noise)
        pending.clear()
        return out

    monkeypatch.setattr(SkellamSecureSum, "encode", recording_encode)
    monkeypatch.setattr(SkellamSecureSum, "decode", recording_decode)
    secure, _, _ = _run(tmp_path / "secagg", noise_placement="secagg", **{k.replace("-", "_"): v for k, v in common.items()})
    assert len(noises) == SMALL["num-rounds"]
    replay = iter(noises)

    def replaying_noise_sum(self, total, noise, *, scale=1.0):  # the server placement's step, with that noise
        recorded = next(replay)
        return {n: t + recorded[n].to(t.dtype) for n, t in total.items()}

    monkeypatch.setattr(Mechanism, "noise_sum", replaying_noise_sum)
    server, _, _ = _run(tmp_path / "server", noise_placement="server", **{k.replace("-", "_"): v for k, v in common.items()})
    assert next(replay, None) is None  # every round's noise was replayed, once
    for name, t in secure.state.message.items():  # without the noise (z = 1) they would differ by far more
        assert torch.allclose(server.state.message[name], t, atol=1e-3), name


def test_seeded_noise_and_a_server_derived_secret_sketch_are_refused_outside_a_simulation(tmp_path, monkeypatch):
    """A ServerApp that no simulation runs (`flwr run .` against SuperNodes) refuses noise and a secret sketch that
    the run seed gives away, before any work; with OS noise it runs, and its epsilons are not labelled seeded."""

    class Deployed(InProcessGrid):
        simulation = False  # as Flower's own grid: nothing says the clients are simulated

    def run(**overrides):
        config = {**SMALL, **overrides, "out-dir": str(tmp_path / str(len(list(tmp_path.iterdir()))))}
        return run_federation(Deployed(client_app, config["num-clients"], config),
                              Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config),
                              echo=lambda line: None)

    with pytest.raises(RuntimeError, match='noise-source = "seeded" derives every noise draw from the run seed'):
        run()
    with pytest.raises(RuntimeError, match='sketch-secret = "run-seed" lets the server derive the secret sketch'):
        run(**{"noise-source": "os", "threat-model": "secret-sketch"})
    monkeypatch.setattr("fedlora.round_plan.os_generator", lambda: np.random.default_rng(2 ** 70))  # stands for the OS
    strategy = run(**{"noise-source": "os", "num-rounds": 1})
    assert strategy.rounds[1]["partitions"] == sampling_of(strategy.config).draw(np.random.default_rng(2 ** 70))
    assert strategy.rounds_done == 1 and "seeded" not in strategy.ledger.trust_model
    assert set(strategy.ledger.reports()) == {"model", "server", "co-client"}


def test_the_real_data_preset_learns_in_a_few_rounds(monkeypatch, tmp_path):
    """configs/fashion_mnist.toml on the real Fashion-MNIST, shortened to 2 private rounds of 10 clients and
    evaluated on the first 2,000 test images: the public-pretrained backbone and the local Adam recipe lift the
    model far above chance (0.1) at once. CI installs the data (.ci/run); without it this fails there and is
    skipped elsewhere."""
    import os

    import fedlora.tasks.image
    from fedlora.config import load_config
    from fedlora.data import load_split
    from fedlora.data import fashion_mnist_unavailable_reason

    if (reason := fashion_mnist_unavailable_reason()) is not None:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(reason)
    monkeypatch.setattr(fedlora.tasks.image, "load_split", lambda config, split: load_split(config, split).select(
        range(2000)) if split == "test" else load_split(config, split))
    preset = load_config("fashion_mnist").to_mapping()
    config = {**preset, "num-clients": 100, "clients-per-round": 10, "num-rounds": 2, "eval-every": 2,
              "out-dir": str(tmp_path)}
    grid = InProcessGrid(client_app, config["num-clients"], config)
    run_federation(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config),
                   echo=lambda line: None)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["round"] == 2 and 0 < rows[-1]["epsilon"] < 8
    assert rows[-1]["accuracy"] > 0.3, rows[-1]


# -- FlexLoRA's update form: clients send the change of each layer's product B A ----------------------------------
def _products(message):
    """Each layer's product B A and the head: what FlexLoRA's factors mean (the SVD fixes them up to signs)."""
    return {**{n: t.double() @ message[n.replace("lora_B", "lora_A")].double() for n, t in message.items()
               if n.endswith("lora_B")}, **{n: t for n, t in message.items() if n.startswith("classifier.")}}


@pytest.mark.parametrize("clients_per_round, rounds", [(3, 1), (1, 3)])
def test_flexlora_updates_at_server_lr_1_without_noise_are_flexlora_of_the_local_products(tmp_path,
                                                                                         clients_per_round, rounds):
    """W + mean_c (B_c A_c - B A) = mean_c B_c A_c whenever the server's product W is the B A clients started from:
    in round 1, and in every round when one client a round leaves W of rank r."""
    common = {"strategy": "flexlora", "clients_per_round": clients_per_round, "num_rounds": rounds}
    adapters, _, _ = _run(tmp_path / "adapter", **common)
    updates, _, _ = _run(tmp_path / "update", message="update", server_optimizer="sgd", server_lr=1.0, **common)
    expected, got = _products(adapters.state.message), _products(updates.state.message)
    assert set(got) == set(expected)
    for name, t in expected.items():
        torch.testing.assert_close(got[name].double(), t.double(), rtol=0, atol=1e-5)
    dense = {n: t for n, t in updates.state.message.items() if is_product(n)}
    assert len(dense) == 12 and all(t.shape == (192, 192) for t in dense.values())  # the server's, q and v of 6 blocks
    assert not any(is_product(n) for n in updates.state.broadcast)  # clients download the factors only


@pytest.mark.parametrize("strategy_name", ["gm-flexlora", "sgmm-flexlora"])
def test_a_flexlora_update_is_bounded_by_the_clip_norm_and_accounted_as_one_gaussian_release(strategy_name):
    """Whatever the local training did, the clipped (and sketched, then clipped again) change of the products has
    norm <= tau: the sensitivity of the release, a Gaussian mechanism at z; the server refuses more."""
    from fedlora.config import RunConfig
    from fedlora.federation import Protocol
    from fedlora.lora import get_adapters, get_head, to_message
    from fedlora.mechanisms import message_norm
    from fedlora.privacy.events import GaussianRelease

    config = RunConfig.from_mapping({"strategy": strategy_name, "noise-multiplier": 1.3, "target-epsilon": 0,
                                     "message": "update", "noise-placement": "server", "sketch-dim": 32})
    protocol = Protocol(config, 1.3)
    model = protocol.build_model()
    initial = protocol.initial_state(model)
    start = {**to_message(get_adapters(model), mode=protocol.mode), **get_head(model)}
    generator = torch.Generator().manual_seed(0)
    for client in range(5):
        end = {n: t + torch.randn(t.shape, generator=generator) * (client + 1) for n, t in start.items()}
        update = protocol.update_of(start, end)
        assert all(t.shape == (192, 192) for n, t in update.items() if is_product(n))
        release, _ = protocol.privatize(update, round_=1, release=1, noise=None)
        assert message_norm(release) <= config.clip_norm
        assert protocol.release_problem(release, initial.message, round_=1, rank=config.rank) is None
        assert protocol.release_of(update, protocol.mechanism) == (GaussianRelease(1.3),)
    doubled = {n: 2 * t for n, t in release.items()}
    assert "norm exceeds" in protocol.release_problem(doubled, initial.message, round_=1, rank=config.rank)


@pytest.mark.parametrize("strategy_name", list(ALGORITHMS))
def test_every_strategy_runs_a_round_from_the_default_config(tmp_path, strategy_name):
    """`fedlora run --set strategy=X` on the quickstart's config (noise at the server, updates; FlexLoRA's of its
    products), made small."""
    from fedlora.config import load_config

    config = load_config(None, [f'strategy="{strategy_name}"']).to_mapping()
    small = {k: v for k, v in SMALL.items() if k not in PAPER_FORM}
    config = {**config, **small, "num-rounds": 1, "local-steps": 1, "target-epsilon": 10.0, "out-dir": str(tmp_path)}
    grid = InProcessGrid(client_app, config["num-clients"], config)
    run_federation(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config),
                   echo=lambda line: None)
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["round"] == 1 and row["replies"] == 3 and row["rejected"] == 0
    assert row["threat_model"].startswith("known-sketch, noise at the server") == (strategy_name in PRIVATE_ALGORITHMS)


def test_a_progress_line_names_the_calibrated_epsilon_then_the_other_finite_ones():
    from fedlora.config import load_config
    from fedlora.experiment import format_progress

    row = {"round": 3, "accuracy": 0.5, "seconds": 1.0, "epsilon": 8.0, "observer": "model",
           "threat_model": "known-sketch, noise in client shares under secure aggregation; against observers of the "
                           "model (sample hidden)", "epsilon_by_observer": {"model": 8.0, "server": 18.5}}
    line = format_progress(row, load_config(None))
    assert "epsilon 8.000 (known-sketch, noise in client shares under secure aggregation; against observers of the " \
           "model (sample hidden)), 18.500 against the server (sample known, drawn as the protocol says)  1.0 s" in line
    server = {**row, "epsilon_by_observer": {"model": 8.0, "server": float("inf")}}
    assert "against the server" not in format_progress(server, load_config(None))  # noise the server adds


def test_overlapped_releases_each_item_on_another_thread_in_order_and_raises_what_they_raise():
    """On a GPU (background) each release runs on a thread of the host while the next item trains, one pending at a
    time: a failed release stops the work one item later. On a CPU, one after the other on the caller's thread."""
    import threading

    main = threading.get_ident()
    for background in (True, False):
        trained, released = [], []

        def train(item):
            trained.append((item, threading.get_ident()))
            return item * 10

        def release(item, value):
            released.append(threading.get_ident())
            return item, value

        assert overlapped([3, 1, 2], train, release, background=background) == [(3, 30), (1, 10), (2, 20)]
        assert [i for i, _ in trained] == [3, 1, 2] and all(t == main for _, t in trained)
        assert len(released) == 3 and (main not in released) == background

        def failing(item, value):
            if item == 1:
                raise ValueError(f"release {item} failed")
            return item

        trained.clear()
        with pytest.raises(ValueError, match="release 1 failed"):
            overlapped([1, 2, 3, 4], train, failing, background=background)
        assert [i for i, _ in trained] == ([1, 2] if background else [1])  # not the items after


def test_groups_released_on_the_host_s_thread_release_what_they_release_one_after_the_other():
    """A GPU's path (each group's release on a thread while the next group trains) on this CPU: the private releases
    (SGMM sketch, seeded noise at each client, adaptive clipping's noised bits) equal, bit for bit, those of the same
    groups released one after the other."""
    from fedlora.config import RunConfig
    from fedlora.data import make_synthetic_cifar, to_torch
    from fedlora.federation import Protocol
    from fedlora.lora import get_adapters

    config = RunConfig.from_mapping({**SMALL, "strategy": "sgmm-ffa-lora", "noise-placement": "client",
                                     "clip-quantile": 0.5, "clip-count-stddev": 2.0, "num-clients": 6})
    protocol = Protocol(config, 1.0)
    model = protocol.build_model(config.rank)
    base, state = get_adapters(model), protocol.initial_state(model)
    groups = [[0, 1], [2, 3], [4, 5]]
    data = {p: to_torch(make_synthetic_cifar(20, num_classes=10, seed=p), 32, train=True) for g in groups for p in g}

    def train(group):
        return protocol.train_clients(model, base, [data[p] for p in group], state, round_=1, release=1,
                                      partition_ids=group)

    def release(group, trained):
        return protocol.release_clients(trained, round_=1, release=1, clip_norm=config.clip_norm,
                                        noises=[protocol.client_noise(1, p) for p in group])

    threaded, sequential = (overlapped(groups, train, release, background=b) for b in (True, False))
    for one, other in zip((r for g in threaded for r in g), (r for g in sequential for r in g)):
        assert one.release.keys() == other.release.keys() and one.clip_bit == other.clip_bit
        assert all(torch.equal(one.release[n], other.release[n]) for n in one.release)


@pytest.mark.parametrize("overrides, expected", [
    ({"strategy": "sgmm-ffa-lora"}, "gaussian"),  # known-sketch: clipped after the sketch
    ({"strategy": "gm-flexlora", "threat-model": "secret-sketch"}, "gaussian"),  # no sketch to know
    ({"strategy": "sgmm-ffa-lora", "clip-quantile": 0.5}, "gaussian and bit"),
    ({"strategy": "sgmm-ffa-lora", "noise-placement": "secagg", "clients-per-round": 4}, "share"),
    ({"strategy": "sgmm-ffa-lora", "noise-source": "seeded"}, "run seed"),
    ({"strategy": "sgmm-ffa-lora", "noise-placement": "server"}, "added by the server"),
    ({"strategy": "sgmm-ffa-lora", "threat-model": "secret-sketch"}, "clipped before the sketch"),
    ({"strategy": "ffa-lora"}, "adds no noise"),
])
def test_a_reply_releases_to_a_server_only_the_noise_its_client_adds(overrides, expected):
    from fedlora.lora import get_adapters, get_head, to_message
    from fedlora.privacy.events import GaussianRelease, NonPrivateRelease, SkellamRelease

    config = RunConfig.from_mapping({**SMALL, "noise-source": "os", "noise-multiplier": 1.3, "target-epsilon": 0,
                                     **overrides})
    protocol = Protocol(config, 1.3)
    model = protocol.build_model()
    message = {**to_message(get_adapters(model), mode=protocol.mode), **get_head(model)}
    mechanism = protocol.mechanism_for(1)
    release, why = protocol.release_to_server(message, mechanism), protocol.unprotected_to_server(mechanism)
    if expected == "gaussian":
        assert release == (GaussianRelease(1.3),) and why is None
    elif expected == "gaussian and bit":
        assert release == (GaussianRelease(1.3), protocol.clipping.release()) and why is None
    elif expected == "share":  # its own share of the sum's noise: z / sqrt(N_min)
        (share,) = release
        assert isinstance(share, SkellamRelease) and why is None
        assert share.noise_multiplier == pytest.approx(1.3 / config.required_replies() ** 0.5)
        assert share == protocol.release_of(message, mechanism)[0].one_reply()
    else:
        assert release == (NonPrivateRelease(),) and expected in why


def test_nodes_with_a_privacy_budget_refuse_the_round_that_would_pass_it(tmp_path):
    """Every node keeps a ledger allowing two replies at the run's z: they reply twice, then refuse, and the server
    reports why; a seeded run is refused at once, whatever its z."""
    def with_ledgers(budget, **overrides):
        config = {**SMALL, "clients-per-round": 5, "num-rounds": 3, "noise-source": "os", "noise-multiplier": 4.0,
                  "target-epsilon": 0, "round-retries": 0, **overrides}
        grid = InProcessGrid(client_app, 5, config)
        for node, context in grid.contexts.items():
            context.node_config.update({"privacy-ledger": str(tmp_path / f"node{node}.jsonl"),
                                        "privacy-budget": budget})
        strategy = run_federation(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                                run_config=config), echo=lambda line: None)
        return strategy.reason

    from tests.test_node_budget import _gaussian_epsilon
    two = _gaussian_epsilon(np.sqrt(2) * 2 / 4.0, 1e-5)
    stopped = with_ledgers(two * 1.01, **{"out-dir": str(tmp_path / "run")})
    # every sampled node refused: a resume would meet the same refusals, so the run ends (not stalls)
    assert stopped.startswith("the nodes' own privacy budgets are spent: round 3 got 0 valid replies")
    assert "Refused by this node's privacy budget" in stopped
    assert Checkpoint.load(tmp_path / "run").status == BUDGET_SPENT
    for node in range(1, 6):
        records = [json.loads(line) for line in (tmp_path / f"node{node}.jsonl").read_text().splitlines()]
        assert [(r["round"], r["release_id"], r["release"]) for r in records] == [  # release_id: the server's count
            (1, 1, [{"type": "GaussianRelease", "noise_multiplier": 4.0, "shares": 1}]),
            (2, 2, [{"type": "GaussianRelease", "noise_multiplier": 4.0, "shares": 1}])]
    seeded = with_ledgers(100.0, **{"noise-source": "seeded"}, **{"out-dir": str(tmp_path / "seeded")})
    assert "drawn from the run seed" in seeded
    assert all(len((tmp_path / f"node{node}.jsonl").read_text().splitlines()) == 2 for node in range(1, 6))


def _a_round_message(tmp_path, **overrides):
    """A real round's training message (the first of a 1-round in-process run) and its run config."""
    seen = []

    def client(msg, context):
        if msg.metadata.message_type == "train":
            seen.append(msg)
        return client_app(msg, context)

    config = {**SMALL, "num-rounds": 1, "noise-source": "os", "noise-multiplier": 2.0, "target-epsilon": 0,
              **overrides, "out-dir": str(tmp_path / "run")}
    run_federation(InProcessGrid(client, 5, config), Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                                             run_config=config), echo=lambda line: None)
    return seen[0], config


def test_a_node_follows_only_the_paths_an_honest_server_uses(tmp_path):
    """A round whose run adds its noise in shares but that skips SecAgg+'s stages would get the clipped update
    unnoised: every node refuses it. Noise multipliers and clip norms that are not finite are refused too."""
    from fedlora.clients.rounds import canary_train, secure_train, train_round

    msg, config = _a_round_message(tmp_path)
    node = {"partition-id": 0, "num-partitions": 5}

    def context(**run):
        return Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config={**config, **run})

    secagg = {"noise-placement": "secagg", "clients-per-round": 4}
    with pytest.raises(ValueError, match="came without SecAgg\\+'s stages: a reply would carry no noise"):
        train_round(msg, context(**secagg), 0.0)
    with pytest.raises(ValueError, match="came without SecAgg\\+'s stages"):
        canary_train(msg, context(**secagg), {})
    with pytest.raises(ValueError, match='A round under SecAgg\\+ for a run whose noise is not added in shares'):
        secure_train(msg, context(), 0.0)  # the stages' own step, for a run with noise at the client
    for key, value, message in [("noise-multiplier", float("nan"), "noise multipliers must be finite"),
                                ("clip-norm", float("inf"), "Clip norm must lie in"),
                                ("clip-norm", 7.3e-44, "where a float32 message carries it")]:
        msg.content["config"][key] = value
        with pytest.raises(ValueError, match=message):
            train_round(msg, context(), 0.0)
        msg.content["config"][key] = 2.0


@pytest.mark.parametrize("message", ["update", "adapter"])
def test_a_diverged_client_replies_with_no_change_privatized_not_an_error(message, caplog):
    """Whether training diverged is a fact about the data, which an error reply would tell the server unnoised: every
    client (with a ledger or not) sends the message it started from (an update of zero), clipped and noised like any
    reply, and only the node's log says why."""
    from fedlora.client_round import TrainedClients

    config = RunConfig.from_mapping({**SMALL, "message": message, "noise-multiplier": 2.0, "target-epsilon": 0,
                                     "noise-source": "os"})
    protocol = Protocol(config, 2.0)
    start = protocol.client_message(protocol.build_model())
    diverged = {name: t.clone() + 1.0 for name, t in start.items()}
    next(iter(diverged.values())).view(-1)[0] = float("nan")
    trained = TrainedClients([diverged, {n: t + 0.01 for n, t in start.items()}], start, [float("nan"), 0.5], 0.0)
    with caplog.at_level("WARNING", logger="fedlora"):
        replies = protocol.release_clients(trained, round_=1, noises=[None, None])
    assert "diverged" in caplog.text
    for reply in replies:
        assert all(torch.isfinite(t).all() for t in reply.release.values())
    # what the diverged client privatized: no change (the noise alone at z 2, which is far from the data's +1)
    noiseless = Protocol(RunConfig.from_mapping({**SMALL, "message": message, "strategy": "ffa-lora"}), 0.0)
    unchanged = noiseless.release_clients(TrainedClients([diverged], start, [0.0], 0.0), round_=1, noises=[None])
    expected = {n: torch.zeros_like(t) for n, t in start.items()} if message == "update" else start
    assert all(torch.equal(unchanged[0].release[n], expected[n]) for n in expected)


def test_a_linear_probe_round_releases_to_a_server_at_the_probe_multiplier():
    from fedlora.lora import get_head
    from fedlora.privacy.events import GaussianRelease

    config = RunConfig.from_mapping({**SMALL, "noise-source": "os", "noise-multiplier": 1.3, "target-epsilon": 0,
                                     "head": "probe", "probe-rounds": 1})
    protocol = Protocol(config, 1.3, 2.5)
    head = get_head(protocol.build_model())
    assert protocol.release_to_server(head, protocol.mechanism_for(1)) == (GaussianRelease(2.5),)
    assert protocol.release_to_server(head, protocol.mechanism_for(2)) == (GaussianRelease(1.3),)
