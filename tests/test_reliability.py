"""Faulty clients, crash-safe runs and the enforced budget, on whole federations in process (no Ray).

The real-process counterparts (kill -9 then `fedlora run --resume`, a Ray worker dying, a SuperNode
disconnecting) are in test_simulation.py and test_deployment.py.
"""

import json
import math

import pytest
import torch
from flwr.app import ArrayRecord, Context, RecordDict

from fedlora.clients.app import app as client_app
from fedlora.checkpoint import BUDGET_SPENT, FINISHED, STALLED, STATE_FILE, Checkpoint
from fedlora.config import RunConfig
from fedlora.run_keys import RESUME_KEY
from fedlora.experiment import noise_for
from fedlora.round_plan import packed_key
from fedlora.mechanisms import gaussian_mechanism, sgmm_mechanism, sgmv_mechanism
from fedlora.sketch import SketchKey, is_product
from fedlora.strategies.inprocess_grid import InProcessGrid
from fedlora.strategies.server_app import run_federation
from tests.helpers import PAPER_FORM

SMALL = {**PAPER_FORM, "num-clients": 5, "clients-per-round": 3, "num-rounds": 3, "local-steps": 2, "batch-size": 8,
         "train-examples": 200, "test-examples": 60, "num-classes": 10, "sketch-dim": 16,
         "strategy": "sgmm-ffa-lora", "target-epsilon": 10.0}


def _run(out_dir, client=client_app, **overrides):
    config = {**SMALL, **{k.replace("_", "-"): v for k, v in overrides.items()}, "out-dir": str(out_dir)}
    grid = InProcessGrid(client, config.get("simulation-nodes") or config["num-clients"], config)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config)
    return run_federation(grid, context, echo=lambda line: None), grid


def _rows(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _first_client_of_each_round(tamper):
    """A ClientApp whose first training reply of every round goes through ``tamper`` (or that raises, if
    tamper is None); every other reply is honest."""
    seen = set()

    def app(message, context):
        if message.metadata.message_type == "train":
            round_ = int(message.content["config"]["server-round"])
            if round_ not in seen:
                seen.add(round_)
                if tamper is None:
                    raise RuntimeError("injected client failure")
                reply = client_app(message, context)
                arrays = {n: t.clone() for n, t in reply.content["arrays"].to_torch_state_dict().items()}
                reply.content["arrays"] = ArrayRecord(tamper(arrays))
                return reply
        return client_app(message, context)
    return app


def _first(arrays, change):
    name = next(iter(arrays))
    return {**arrays, name: change(arrays[name])}


def _one_nan(t):
    t.view(-1)[0] = float("nan")
    return t


FAULTS = {
    "nan": lambda a: _first(a, _one_nan),
    "inf": lambda a: _first(a, lambda t: t * float("inf")),
    "wrong shape": lambda a: _first(a, lambda t: t[:-1]),
    "wrong dtype": lambda a: _first(a, lambda t: t.double()),
    "missing entry": lambda a: dict(list(a.items())[1:]),
    "extra entry": lambda a: {**a, "intruder.lora_B": torch.zeros(16, 4)},
    "oversized norm": lambda a: {n: t * 1000 for n, t in a.items()},
}


def test_faulty_replies_are_rejected_and_never_aggregated(tmp_path):
    """Each fault leaves exactly the run in which that client raised instead: same state, same epsilon."""
    baseline, _ = _run(tmp_path / "raises", _first_client_of_each_round(None), min_replies=1, num_rounds=2)
    assert [r["replies"] for r in _rows(tmp_path / "raises")] == [2, 2]
    for fault, tamper in FAULTS.items():
        out = tmp_path / fault.replace(" ", "-")
        strategy, _ = _run(out, _first_client_of_each_round(tamper), min_replies=1, num_rounds=2)
        rows = _rows(out)
        assert [(r["replies"], r["rejected"]) for r in rows] == [(2, 1)] * 2, fault
        for name, t in baseline.state.message.items():
            assert torch.equal(strategy.state.message[name], t), fault
        assert strategy.ledger.epsilon == baseline.ledger.epsilon


def test_honest_releases_are_within_the_norm_allowance():
    """The allowance holds for honest releases, and the post-sketch clip makes the known-sketch one tighter."""
    shapes = {"layer.lora_B": (192, 4), "classifier.weight": (10, 192)}
    message = {name: torch.randn(shape) * 10 for name, shape in shapes.items()}  # clipped to 1 by the mechanism
    for mechanism in (gaussian_mechanism(clip_norm=1.0, noise_multiplier=2.0),
                      sgmm_mechanism(sketch_dim=16, clip_norm=1.0, noise_multiplier=2.0),
                      sgmm_mechanism(sketch_dim=16, clip_norm=1.0, noise_multiplier=2.0, threat_model="secret-sketch"),
                      sgmv_mechanism(sketch_dim=64, clip_norm=1.0, noise_multiplier=0.5, threat_model="secret-sketch")):
        allowance = mechanism.norm_allowance(shapes)
        for seed in range(20):
            release = mechanism.privatize(message, key=SketchKey(1, seed), noise=torch.Generator().manual_seed(seed))
            assert math.sqrt(sum(float(t.pow(2).sum()) for t in release.values())) <= allowance
    known = sgmm_mechanism(sketch_dim=16, clip_norm=1.0, noise_multiplier=0.0).norm_allowance(shapes)
    secret = sgmm_mechanism(sketch_dim=16, clip_norm=1.0, noise_multiplier=0.0,
                            threat_model="secret-sketch").norm_allowance(shapes)
    assert known == 1.0 and secret > 1.0  # R may grow an unclipped sketch by about 1 + sqrt(m / b)


def test_too_few_replies_retry_the_round_with_new_releases_that_all_count(tmp_path):
    failed = set()

    def app(message, context):  # round 2's first try: every client fails
        config = message.content["config"] if message.metadata.message_type == "train" else None
        if config is not None and int(config["server-round"]) == 2 and int(config["release"]) == 2:
            failed.add(int(context.node_config["partition-id"]))
            raise RuntimeError("injected")
        return client_app(message, context)

    strategy, _ = _run(tmp_path, app, noise_multiplier=1.0, target_epsilon=0.0)  # no budget to stop it
    rows = _rows(tmp_path)
    assert [r["round"] for r in rows] == [1, 2, 3] and [r["releases"] for r in rows] == [1, 3, 4]
    assert len(failed) == 3 and strategy.ledger.rounds == 4  # the failed try counts
    assert strategy.state.produced_by == 4  # every release has its own sketch


def _query_failing(times):
    """A ClientApp whose node of partition 1 answers its first ``times`` partition queries with an error."""
    failed = []

    def app(message, context):
        if message.metadata.message_type == "query" and context.node_config["partition-id"] == 1 \
                and len(failed) < times:
            failed.append(1)
            raise RuntimeError("node busy")
        return client_app(message, context)
    return app


def test_a_node_that_fails_the_partition_query_once_is_asked_again(tmp_path):
    strategy, _ = _run(tmp_path, _query_failing(1))
    assert strategy.status == FINISHED and sorted(strategy.nodes) == [0, 1, 2, 3, 4]


def test_a_node_that_never_answers_the_partition_query_stops_the_run_in_one_line(tmp_path):
    with pytest.raises(RuntimeError, match=r"reported \[0, 2, 3, 4\], 1 did not answer in 3 tries \(.*node busy\)"):
        _run(tmp_path, _query_failing(99))


def test_a_run_without_replies_stalls_after_its_retries_and_counts_every_try(tmp_path):
    grid_failures = {1, 2, 3, 4, 5}
    config = {**SMALL, "out-dir": str(tmp_path), "round-retries": 1}
    grid = InProcessGrid(client_app, 5, config, fail=grid_failures)
    strategy = run_federation(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                            run_config=config), echo=lambda line: None)
    assert strategy.status == STALLED and strategy.ledger.rounds == 2  # two tries of round 1, both counted
    saved = Checkpoint.load(tmp_path)
    assert saved.status == STALLED and saved.rounds_done == 0 and saved.releases == 2
    assert not (tmp_path / "adapter").exists()


def test_a_round_whose_clients_all_fail_is_a_stall_naming_their_error_even_where_the_budget_stops_a_retry(tmp_path):
    """Calibrated for one round, a retry would pass the budget: the run still stalls (a failure, not a normal end),
    and says what the clients said, which otherwise only flower.log holds."""
    def broken(message, context):
        if message.metadata.message_type == "train":
            raise RuntimeError("Cannot split 3 examples into 5 partitions.")
        return client_app(message, context)

    strategy, _ = _run(tmp_path, broken, num_rounds=1)
    assert strategy.status == STALLED and strategy.ledger.rounds == 1
    assert strategy.reason.startswith("round 1 got 0 valid replies of 3 sampled, 2 needed; 3 failed, 0 were "
                                      "rejected (the first: the client of partition ")
    assert "Cannot split 3 examples into 5 partitions." in strategy.reason
    assert ", and a retry of round 1 would bring epsilon to " in strategy.reason


def test_a_short_round_where_the_budget_leaves_no_retry_ends_the_run_as_the_budget_does(tmp_path):
    """Some replies arrived, too few: dropouts, not a broken client; the rounds before it stand, with their adapter."""
    trained = []

    def one_then_broken(message, context):
        if message.metadata.message_type == "train":
            trained.append(1)
            if len(trained) > 1:
                raise RuntimeError("out of memory")
        return client_app(message, context)

    strategy, _ = _run(tmp_path, one_then_broken, num_rounds=1)
    assert strategy.status == BUDGET_SPENT and strategy.reason.startswith("round 1 would bring epsilon to ")
    assert strategy.reason.endswith("(after round 1 got 1 valid replies of 3 sampled, 2 needed; 2 failed, 0 were "
                                    "rejected (the first: the client of partition 1 failed: RuntimeError: out of "
                                    "memory))")


def test_the_budget_stops_the_run_before_it_is_passed(tmp_path):
    three_rounds = noise_for(RunConfig.from_mapping({**SMALL, "noise-multiplier": 1.0})).planned.epsilon
    strategy, _ = _run(tmp_path, noise_multiplier=1.0, num_rounds=6, target_epsilon=three_rounds * 1.0001)
    rows = _rows(tmp_path)
    assert [r["round"] for r in rows] == [1, 2, 3] and rows[-1]["epsilon"] <= three_rounds * 1.0001
    assert strategy.status == BUDGET_SPENT and "past the budget" in strategy.reason
    assert Checkpoint.load(tmp_path).status == BUDGET_SPENT
    assert (tmp_path / "adapter").exists()  # a budget stop is a normal end


def _resume(out_dir, client=client_app, **overrides):
    return _run(out_dir, client, **{RESUME_KEY: True, **overrides})


class Crash(Exception):
    pass


class CrashingGrid(InProcessGrid):
    """The server dies as round ``crash_round``'s messages go out: after its release was recorded and
    checkpointed, before any reply."""

    crash_round = 3

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        if messages and messages[0].metadata.message_type == "train" and \
                int(messages[0].content["config"]["server-round"]) == self.crash_round:
            raise Crash()
        return super().send_and_receive(messages, timeout=timeout)


# FlexLoRA's updates: the server's dense products and their momentum are state the checkpoint must hold
FLEX_UPDATES = {"strategy": "gm-flexlora", "noise-placement": "server", "message": "update",
                "server-optimizer": "momentum", "server-lr": 0.5}


@pytest.mark.parametrize("crash_at, form", [("after round 2", {}), ("mid round 3", {}),
                                            ("after round 2", FLEX_UPDATES)],
                         ids=["after round 2", "mid round 3", "flexlora updates"])
def test_a_crashed_run_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch, crash_at, form):
    reference, _ = _run(tmp_path / "reference", num_rounds=4, **{k.replace("-", "_"): v for k, v in form.items()})
    out = tmp_path / "crashed"
    config = {**SMALL, **form, "num-rounds": 4, "out-dir": str(out)}
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config)
    with monkeypatch.context() as patch:
        if crash_at == "after round 2":  # dies before round 3 is sampled
            from fedlora.strategies.fedlora_strategy import FedLoRAStrategy
            original = FedLoRAStrategy.configure_train

            def configure_train(self, server_round, *args):
                if server_round == 3:
                    raise Crash()
                return original(self, server_round, *args)
            patch.setattr(FedLoRAStrategy, "configure_train", configure_train)
        with pytest.raises(Crash):
            run_federation(CrashingGrid(client_app, 5, config), context, echo=lambda line: None)
    saved = Checkpoint.load(out)
    assert saved.rounds_done == 2 and saved.in_flight == (crash_at == "mid round 3")
    resumed, _ = _resume(out, num_rounds=4, **{k.replace("-", "_"): v for k, v in form.items()})
    assert [r["round"] for r in _rows(out)] == [1, 2, 3, 4]  # no round counted twice
    assert resumed.ledger.rounds == reference.ledger.rounds == 4
    assert resumed.ledger.epsilon == reference.ledger.epsilon
    assert set(resumed.state.message) == set(reference.state.message)
    assert any(is_product(n) for n in saved.state.message) == bool(form)
    for name, t in reference.state.message.items():
        torch.testing.assert_close(resumed.state.message[name], t, rtol=1e-5, atol=1e-6)
    assert Checkpoint.load(out).status == FINISHED


def test_a_run_stopped_between_a_round_and_its_metrics_row_records_that_round_s_own_telemetry(tmp_path, monkeypatch):
    """The checkpoint after a round holds what the round did: the row the resumed run writes for it has the round's
    replies, bytes and seconds (it read 0 sampled, 0 replies and 0 bytes before), not the next launch's."""
    from fedlora.experiment import RunRecorder

    reference, _ = _run(tmp_path / "reference", num_rounds=3)
    original = RunRecorder.record

    def record(self, round_, *args, **kwargs):
        if round_ == 2:
            raise Crash()
        return original(self, round_, *args, **kwargs)
    with monkeypatch.context() as patch:
        patch.setattr(RunRecorder, "record", record)
        with pytest.raises(Crash):
            _run(tmp_path / "crashed", num_rounds=3)
    cut = Checkpoint.load(tmp_path / "crashed")
    assert cut.rounds_done == 2 and len(_rows(tmp_path / "crashed")) == 1
    _resume(tmp_path / "crashed", num_rounds=3)
    rows, expected = _rows(tmp_path / "crashed"), _rows(tmp_path / "reference")
    assert [r["round"] for r in rows] == [1, 2, 3]
    for key in ("sampled", "replies", "bytes_up", "bytes_down", "releases", "epsilon"):
        assert rows[1][key] == expected[1][key], key
    assert rows[1]["replies"] == SMALL["clients-per-round"] and rows[1]["bytes_up"] > 0
    assert rows[1]["seconds"] == cut.round_info["seconds"] > 0  # the round's own, not since the crash


def test_a_crashed_secure_aggregation_run_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch):
    """Its checkpoint holds the secagg ledger (Skellam releases), and the round whose SecAgg+ protocol the crash
    stopped (released and counted, nothing summed yet) is run again without being counted twice."""
    secagg = {"num_rounds": 4, "noise_placement": "secagg", "min_replies": 3}
    reference, _ = _run(tmp_path / "reference", **secagg)
    from fedlora.strategies import fedlora_strategy
    original, calls = fedlora_strategy.secure_sum, []

    def crashing(*args, **kwargs):  # the server dies as round 3's SecAgg+ protocol starts
        calls.append(1)
        if len(calls) == 3:
            raise Crash()
        return original(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(fedlora_strategy, "secure_sum", crashing)
        with pytest.raises(Crash):
            _run(tmp_path / "crashed", **secagg)
    cut = Checkpoint.load(tmp_path / "crashed")
    assert cut.rounds_done == 2 and cut.in_flight
    resumed, _ = _resume(tmp_path / "crashed", **secagg)
    assert [r["round"] for r in _rows(tmp_path / "crashed")] == [1, 2, 3, 4]
    assert resumed.ledger.rounds == reference.ledger.rounds == 4
    assert resumed.ledger.epsilon == reference.ledger.epsilon
    assert "secure aggregation" in _rows(tmp_path / "crashed")[-1]["threat_model"]
    for name, t in reference.state.message.items():
        torch.testing.assert_close(resumed.state.message[name], t, rtol=1e-5, atol=1e-6)


def test_an_interrupted_release_with_os_noise_stays_counted(tmp_path):
    out = tmp_path / "run"
    unbudgeted = {"noise-multiplier": 1.0, "target-epsilon": 0.0}
    config = {**SMALL, **unbudgeted, "num-rounds": 3, "noise-source": "os", "out-dir": str(out)}
    grid = CrashingGrid(client_app, 5, config)
    grid.crash_round = 2
    with pytest.raises(Crash):
        run_federation(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config),
                       echo=lambda line: None)
    resumed, _ = _resume(out, noise_source="os", **unbudgeted)
    assert resumed.ledger.rounds == 4  # 3 rounds plus the release whose noise is gone
    assert [r["releases"] for r in _rows(out)] == [1, 3, 4]


def test_resume_refuses_an_ended_run(tmp_path):
    _run(tmp_path, num_rounds=1)
    with pytest.raises(RuntimeError, match="has ended"):
        _resume(tmp_path, num_rounds=1)


def test_checkpoints_are_replaced_atomically(tmp_path, monkeypatch):
    """A crash while writing leaves the previous checkpoint whole."""
    strategy, _ = _run(tmp_path, num_rounds=1)
    before = (tmp_path / STATE_FILE).read_bytes()

    def torn(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", torn)
    with pytest.raises(OSError):
        strategy.checkpoint().save(tmp_path)
    assert (tmp_path / STATE_FILE).read_bytes() == before and Checkpoint.load(tmp_path).rounds_done == 1


def test_resume_and_run_directories_refuse_bad_input_with_one_line(tmp_path, capsys):
    from fedlora.cli import main

    _run(tmp_path, num_rounds=1)
    for argv, message in [(["--resume", str(tmp_path)], "has ended (finished, 1 rounds)"),
                          (["--resume", str(tmp_path), "--set", "lr=1"], "its own config, directory, security and node budget: drop --set."),
                          (["--out", str(tmp_path)], "holds a run that has ended (finished): choose another --out")]:
        assert main(["run", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, argv


def test_a_run_whose_checkpoint_is_lost_is_not_resumed_from_scratch(tmp_path, capsys):
    """The checkpoint is written before the first release: a run with rounds but no checkpoint lost it, and starting
    over would spend its clients' privacy a second time unaccounted."""
    from fedlora.cli import main

    _run(tmp_path, num_rounds=1)
    (tmp_path / STATE_FILE).unlink()
    assert main(["run", "--resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "has rounds in metrics.jsonl but no global-state.safetensors" in err and err.count("\n") == 1
    (tmp_path / STATE_FILE).mkdir()
    assert main(["run", "--resume", str(tmp_path)]) == 2
    assert "global-state.safetensors' is not a file" in capsys.readouterr().err


def test_the_privacy_a_cut_short_round_spent_is_reported(tmp_path, capsys):
    """A release whose round was cut short stays counted (OS noise cannot be replayed): the resume line and the end of
    the run report the ledger's epsilon, which metrics.jsonl's last row predates."""
    from fedlora.checkpoint import RUNNING
    from fedlora.cli import _done, _release, _resumable, _spent, build_parser

    _run(tmp_path, num_rounds=2)
    saved = Checkpoint.load(tmp_path)
    spent = _spent(saved)  # two releases
    assert spent.epsilon == pytest.approx(saved.rows[-1]["epsilon"])
    # as if round 2's release left and the run stopped before its round ended
    saved.rows, saved.rounds_done, saved.in_flight, saved.status = saved.rows[:1], 1, True, RUNNING
    saved.simulated = True  # as `fedlora run` leaves it
    saved.save(tmp_path)
    assert spent.epsilon > saved.rows[-1]["epsilon"]
    _done(saved.rows, tmp_path, RunConfig.from_mapping({**SMALL, "num-rounds": 2}))
    assert f"privacy spent: epsilon {spent.epsilon:.3f} ({spent.threat_model}) in 2 releases" in capsys.readouterr().out
    args = build_parser().parse_args(["run", "--resume", str(tmp_path)])
    try:
        _resumable(args, "run")
        assert f"resuming after round 1 of 2, epsilon {spent.epsilon:.3f}" in capsys.readouterr().out
        with pytest.raises(ValueError, match="is in use by another fedlora command"):  # this command holds it
            _resumable(args, "run")
    finally:
        _release()


def test_a_changed_config_is_refused_before_the_resumed_run_starts(tmp_path, capsys):
    from fedlora.checkpoint import RUNNING
    from fedlora.cli import main

    _run(tmp_path, num_rounds=2)
    saved = Checkpoint.load(tmp_path)
    saved.status, saved.simulated = RUNNING, True
    saved.save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num-rounds": 4}))
    assert main(["run", "--resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "config.json was changed, or this fedlora calibrates differently" in err and err.count("\n") == 1


def test_two_runs_started_in_the_same_second_get_two_directories(tmp_path):
    from fedlora.cli import _claim, _release

    try:
        first = _claim(tmp_path / "runs" / "sgmm-ffa-lora-20261128-140000", "run", default_name=True)
        second = _claim(tmp_path / "runs" / "sgmm-ffa-lora-20261128-140000", "run", default_name=True)
        assert (first.name, second.name) == ("sgmm-ffa-lora-20261128-140000", "sgmm-ffa-lora-20261128-140000-2")
    finally:
        _release()
    assert not (tmp_path / "runs").exists()  # a command that wrote nothing there leaves nothing behind
    _claim(tmp_path, "run", default_name=False)
    _release()
    assert tmp_path.is_dir() and not any(tmp_path.iterdir())  # nor a lock file in a directory it did not make


def test_a_state_file_from_before_checkpoints_counts_as_ended(tmp_path):
    from safetensors.torch import save_file

    save_file({"classifier.weight": torch.zeros(2, 2)}, str(tmp_path / STATE_FILE), metadata={"produced_by": "0"})
    assert Checkpoint.load(tmp_path).status == FINISHED


def test_a_format_1_checkpoint_resumes_without_the_last_round_s_telemetry(tmp_path):
    """Runs checkpointed before format 2 keep resuming: their progress has no round_info."""
    from safetensors.torch import save_file

    progress = {"rounds_done": 2, "releases": 2, "status": "running", "simulated": True}
    save_file({"classifier.weight": torch.zeros(2, 2)}, str(tmp_path / STATE_FILE),
              metadata={"produced_by": "2", "progress": json.dumps(progress), "format": "1"})
    saved = Checkpoint.load(tmp_path)
    assert (saved.rounds_done, saved.round_info) == (2, {})


def test_private_clients_report_no_training_loss(tmp_path):
    """A client's loss is a function of its data: sent in the clear it would escape the accountant."""
    _run(tmp_path / "private", num_rounds=1)
    _run(tmp_path / "open", num_rounds=1, strategy="ffa-lora")
    assert _rows(tmp_path / "private")[0]["train_loss"] is None
    assert _rows(tmp_path / "open")[0]["train_loss"] > 0


# -- the levers' replies and state ------------------------------------------------------------------
SERVER_UPDATES = {"noise_placement": "server", "message": "update", "server_optimizer": "adam", "server_lr": 0.01,
                  "clip_quantile": 0.5, "clip_count_stddev": 2.0, "target_epsilon": 30.0}


LEVER_FAULTS = {
    "update above the clip norm": lambda a: {n: t * 1000 for n, t in a.items()},  # no noise to hide in at the server
    "missing clip bit": None,
    "clip bit 0.5": 0.5,
    "clip bit 2": 2.0,
}


def _tamper_bit(value):
    """A ClientApp whose first training reply of every round loses its clip bit (None) or sends ``value``."""
    seen = set()

    def app(message, context):
        reply = client_app(message, context)
        if message.metadata.message_type == "train":
            round_ = int(message.content["config"]["server-round"])
            if round_ not in seen:
                seen.add(round_)
                del reply.content["clip-bit"]
                if value is not None:
                    reply.content["clip-bit"] = ArrayRecord({"bit": torch.tensor([value], dtype=torch.float64)})
        return reply
    return app


def test_faulty_updates_and_clip_bits_are_rejected(tmp_path):
    baseline, _ = _run(tmp_path / "raises", _first_client_of_each_round(None), min_replies=1, num_rounds=2,
                       **SERVER_UPDATES)
    for fault, change in LEVER_FAULTS.items():
        out = tmp_path / fault.replace(" ", "-")
        client = _first_client_of_each_round(change) if callable(change) else _tamper_bit(change)
        strategy, _ = _run(out, client, min_replies=1, num_rounds=2, **SERVER_UPDATES)
        assert [(r["replies"], r["rejected"]) for r in _rows(out)] == [(2, 1)] * 2, fault
        for name, t in baseline.state.message.items():
            assert torch.equal(strategy.state.message[name], t), fault
        assert strategy.clip_norm == baseline.clip_norm


def test_a_crashed_run_with_a_server_optimizer_and_adaptive_clip_resumes_to_the_uninterrupted_result(tmp_path):
    """The optimizer's moments and the clip norm are in the checkpoint: the resumed run is the same run."""
    reference, _ = _run(tmp_path / "reference", num_rounds=4, **SERVER_UPDATES)
    out = tmp_path / "crashed"
    config = {**SMALL, "num-rounds": 4, "out-dir": str(out), **{RunConfig.key(k): v for k, v in SERVER_UPDATES.items()}}
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config)
    with pytest.raises(Crash):
        run_federation(CrashingGrid(client_app, 5, config), context, echo=lambda line: None)
    saved = Checkpoint.load(out)
    assert saved.rounds_done == 2 and saved.in_flight and set(saved.optimizer) and saved.clip_norm != 1.0
    resumed, _ = _resume(out, num_rounds=4, **SERVER_UPDATES)
    assert [r["round"] for r in _rows(out)] == [1, 2, 3, 4]
    assert [r["clip_norm"] for r in _rows(out)] == [r["clip_norm"] for r in _rows(tmp_path / "reference")]
    assert resumed.ledger.epsilon == reference.ledger.epsilon and resumed.clip_norm == reference.clip_norm
    for name, t in reference.state.message.items():
        torch.testing.assert_close(resumed.state.message[name], t, rtol=1e-5, atol=1e-6)
    for name, t in reference.optimizer.state.items():
        torch.testing.assert_close(resumed.optimizer.state[name], t, rtol=1e-5, atol=1e-8)


def test_noise_at_the_server_keeps_single_messages_out_of_logs_and_checkpoints(tmp_path, caplog):
    strategy, _ = _run(tmp_path, _first_client_of_each_round(LEVER_FAULTS["update above the clip norm"]),
                       min_replies=1, num_rounds=2, **SERVER_UPDATES)
    rejected = [r.getMessage() for r in caplog.records if "rejected the reply" in r.getMessage()]
    assert rejected and all("its norm exceeds" in line for line in rejected)  # no norm of a single message
    saved = Checkpoint.load(tmp_path)
    assert set(saved.state.message) == set(strategy.template)  # the aggregate only
    assert all(name.startswith(("momentum/", "adam-")) for name in saved.optimizer)


def test_a_packed_message_that_fails_loses_each_of_its_clients(tmp_path):
    """With several clients per message, a node's failure is a failed reply for every client it carried; a
    forged reply for a client its node was not sent is ignored."""
    def app(message, context):
        if message.metadata.message_type == "train" and context.node_config["partition-id"] == 0:
            raise RuntimeError("injected")
        reply = client_app(message, context)
        if message.metadata.message_type == "train":  # node 1 also answers for a client it was not sent
            partitions = list(message.content["config"]["partitions"])
            stranger = next(p for p in range(5) if p not in partitions)
            reply.content[packed_key("arrays", stranger)] = reply.content[packed_key("arrays", partitions[0])]
        return reply

    strategy, grid = _run(tmp_path, app, simulation_nodes=2, min_replies=1, num_rounds=1)
    rows = _rows(tmp_path)
    assert len(grid.calls) == 2 and rows[0]["sampled"] == 3
    assert rows[0]["failed"] == 2 and rows[0]["replies"] == 1 and rows[0]["rejected"] == 0  # node 0 carried 2
    assert strategy.ledger.rounds == 1
    from fedlora.cli import _failures  # the run's last line says so

    assert _failures(rows, tmp_path) == (f"clients failed: 2 replies not aggregated in 1 of 1 rounds (2 failed); the "
                                         f"first, round 1: {rows[0]['first_failure']} (tracebacks: "
                                         f"{tmp_path / 'flower.log'})")
    assert "injected" in rows[0]["first_failure"] and _failures([{**rows[0], "failed": 0, "replies": 3}], tmp_path) is None
    silent = _failures([{**rows[0], "failed": 0, "first_failure": None}], tmp_path)  # a node that never answered
    assert silent.startswith("clients failed: 2 replies not aggregated in 1 of 1 rounds (2 past reply-timeout); the "
                             "first, round 1: no reply within reply-timeout")


def test_a_nodes_own_data_that_does_not_decode_stops_the_run_before_round_one(tmp_path):
    """A device's data-dir is read when the server first asks the nodes who they are: an image that does not decode
    (a text file named .png) stops the run there, in one line naming the node and the file; no round is trained."""
    from PIL import Image

    own = tmp_path / "own" / "0"
    own.mkdir(parents=True)
    for i in range(3):
        Image.new("RGB", (8, 8), (i, 0, 0)).save(own / f"{i}.png")
    (own / "bad.png").write_text("not an image")
    config = {**SMALL, "out-dir": str(tmp_path / "run")}
    grid = InProcessGrid(client_app, 5, config)
    grid.contexts[grid.node_ids[2]].node_config["data-dir"] = str(tmp_path / "own")
    with pytest.raises(RuntimeError) as stopped:
        run_federation(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config),
                       echo=lambda line: None)
    assert str(stopped.value).startswith("The node of partition 2 cannot train on its own data: data-dir ")
    assert "the first 0/bad.png" in str(stopped.value) and "\n" not in str(stopped.value)
    assert grid.calls == []  # no training message was sent


def test_a_failed_client_is_told_by_the_error_it_raised_last():
    """Under Ray a reply's reason is the actor's traceback, the client's errors inside it; fedlora's own, raised
    from a library's, comes last, and Ray's wrapper says nothing."""
    from flwr.app import Error

    from fedlora.strategies.replies import error_line

    ray = ("<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'ray::ClientAppActor.run() (pid=1)\n"
           "  File \"datasets/load.py\", line 9, in load\nFileNotFoundError: no such file: x.arrow\n\n"
           "The above exception was the direct cause of the following exception:\n\n"
           "ValueError: The dataset at hf:x cannot be read: download it first.\n"
           "flwr.clientapp.client_app.ClientAppException: \n"
           "Exception ClientAppException occurred. Message: The dataset at hf:x cannot be read'>")
    assert error_line(Error(code=0, reason=ray)) == "ValueError: The dataset at hf:x cannot be read: download it first."
    assert error_line(Error(code=0, reason="RuntimeError: out of memory")) == "RuntimeError: out of memory"
    assert error_line(Error(code=3, reason="node busy\nretry later")) == "node busy"


def test_an_evaluation_that_fails_stops_the_run_with_its_error_and_the_run_resumes_to_the_uninterrupted_result(
        tmp_path, monkeypatch):
    """A round is evaluated while the next one trains: an evaluation that raises stops the run with its error (no
    hang), having spent at most the release of the round under way, which the checkpoint counts; resumed, the run
    ends where the uninterrupted one ends, every row written once, in order."""
    from fedlora.experiment import RunRecorder

    reference, _ = _run(tmp_path / "reference", num_rounds=4)
    original, calls = RunRecorder.evaluate, []

    def evaluate(self, state):
        calls.append(1)
        if len(calls) == 2:
            raise Crash("the test split could not be read")
        return original(self, state)

    with monkeypatch.context() as patch:
        patch.setattr(RunRecorder, "evaluate", evaluate)
        with pytest.raises(Crash, match="the test split could not be read"):
            _run(tmp_path / "crashed", num_rounds=4)
    cut = Checkpoint.load(tmp_path / "crashed")
    assert cut.rounds_done in (2, 3) and cut.releases <= cut.rounds_done + 1
    resumed, _ = _resume(tmp_path / "crashed", num_rounds=4)
    rows, expected = _rows(tmp_path / "crashed"), _rows(tmp_path / "reference")
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert [r["epsilon"] for r in rows] == [r["epsilon"] for r in expected]
    assert [r["accuracy"] for r in rows] == [r["accuracy"] for r in expected]
    for name, t in reference.state.message.items():
        assert torch.equal(resumed.state.message[name], t), name
