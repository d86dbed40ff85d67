import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fedlora.cli import main

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.toml"


def test_describe_reports_real_shapes_and_upload_sizes(capsys):
    assert main(["describe", "--model", "vit-tiny", "--rank", "4", "--sketch-dim", "16", "--message", "adapter",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["adapted_layers"] == 12 and report["layer_shapes"] == ["B 192x4, A 4x192"]
    head = 192 * 100 + 100  # the 100-class head, sent dense in every message by default
    assert (report["head"], report["head_values"]) == ("message", head)
    uploads = {row["strategy"].split(" ")[0]: row for row in report["mechanisms"]}
    assert uploads["ffa-lora"]["upload_values"] == 12 * 192 * 4 + head  # dense B
    assert uploads["sgmm-ffa-lora"]["upload_values"] == 12 * 16 * 4 + head  # R B: b x r per layer
    assert uploads["sgmv-ffa-lora"]["upload_values"] == 12 * 64 + head  # h = b r
    # the vectorized sketch costs r times the matrix sketch (paper, Section 2)
    assert uploads["sgmv-ffa-lora"]["sketch_multiply_adds"] == 4 * uploads["sgmm-ffa-lora"]["sketch_multiply_adds"]
    # under SecAgg+ each entry is a 64-bit integer, and FlexLoRA's clients send their products B A (b x b sketched)
    assert uploads["ffa-lora"]["upload_bytes_secagg_vector"] == 8 * uploads["ffa-lora"]["upload_values"]
    assert uploads["flexlora"]["upload_bytes_secagg_vector"] == 8 * (12 * 192 * 192 + head)
    assert uploads["sgmm-flexlora"]["upload_bytes_secagg_vector"] == 8 * (12 * 16 * 16 + head)
    # updates (the default): FFA the same shapes; FlexLoRA the change of each product, m x k (b x k sketched)
    assert main(["describe", "--model", "vit-tiny", "--rank", "4", "--sketch-dim", "16", "--json"]) == 0
    updates = {row["strategy"].split(" ")[0]: row for row in json.loads(capsys.readouterr().out)["mechanisms"]}
    assert updates["ffa-lora"]["upload_values"] == uploads["ffa-lora"]["upload_values"]
    assert updates["flexlora"]["upload_values"] == 12 * 192 * 192 + head
    assert updates["sgmm-flexlora"]["upload_values"] == 12 * 16 * 192 + head
    assert updates["sgmm-flexlora"]["upload_bytes_secagg_vector"] == 8 * (12 * 16 * 192 + head)
    assert updates["sgmm-flexlora"]["sketch_multiply_adds"] == 12 * 16 * 192 * 192
    for mode in ("probe", "frozen"):  # the LoRA rounds' messages carry no head
        assert main(["describe", "--model", "vit-tiny", "--sketch-dim", "16", "--head", mode, "--json"]) == 0
        rows = {row["strategy"].split(" ")[0]: row for row in json.loads(capsys.readouterr().out)["mechanisms"]}
        assert rows["ffa-lora"]["upload_values"] == 12 * 192 * 4


@pytest.mark.parametrize("argv, message", [
    (["describe", "--rank", "0"], "--rank: must be at least 1"),
    (["describe", "--model", "vit-tiny", "--sketch-dim", "500"], "must lie in [1, 192]"),
    (["describe", "--model", "vit-huge"], "invalid choice"),
    (["frobnicate"], "invalid choice"),
    (["audit", "--trials", "10"], "argument --trials: an audit needs at least 100 trials per hypothesis, got 10"),
    (["audit", "--aux-units", "50"], "--aux-units is for the text audit's reference model: add --text"),
    (["audit", "--reference", "ref"], "--reference is for the text audit's reference model: add --text"),
    (["audit", "--text", "--aux-units", "50", "--trials", "200"], "--trials sets the mechanism level's releases"),
])
def test_bad_input_is_one_error_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("fedlora: error:")


def test_console_script_exits_2_without_traceback():
    result = subprocess.run([sys.executable, "-m", "fedlora.cli", "describe", "--rank", "-1"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1


def test_a_config_error_comes_before_the_data_and_simulation_libraries_load():
    """`fedlora run` with bad input: the line comes from the config's check, before torchvision, flwr-datasets
    (seaborn, scipy), Flower's simulation and Ray are imported (5 s of imports here)."""
    code = ("import sys\nfrom fedlora.cli import main\nassert main(['run', '--set', 'num-clients=-1']) == 2\n"
            "print(sorted(m for m in ('torchvision', 'flwr_datasets', 'seaborn', 'ray', 'flwr.simulation') "
            "if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "[]", result.stderr[-2000:]
    assert result.stderr.strip() == "fedlora: error: num-clients must be >= 1, got -1."


def test_a_reader_that_leaves_early_gets_no_traceback():
    """`fedlora describe | head -1`: here the reader (`true`) is gone before the first line is written."""
    result = subprocess.run(f"{sys.executable} -m fedlora.cli describe --model vit-tiny | true", shell=True,
                            capture_output=True, text=True)
    assert result.stderr == ""


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_privacy_epsilon_of_a_noise_multiplier(capsys):
    result = _json(capsys, ["privacy", "--strategy", "gm-ffa-lora", "--noise-multiplier", "1.5", "--json",
                            "--noise-placement", "server"])
    for key in ("epsilon", "delta", "noise_multiplier", "threat_model", "sampling"):
        assert key in result
    assert result["threat_model"].startswith("known-sketch, noise at the server;") and result["sampling"] == "fixed"
    assert result["epsilon"] == pytest.approx(3.028, abs=0.01)  # replace-one: sensitivity 2 tau
    # noise at each client: the model carries the noise of N_min = 2 of the 4 replies (z sqrt(2)); the server one's
    client = _json(capsys, ["privacy", "--strategy", "gm-ffa-lora", "--noise-multiplier", "1.5", "--json"])
    assert client["epsilon"] == pytest.approx(_json(capsys, [
        "privacy", "--strategy", "gm-ffa-lora", "--noise-multiplier", str(1.5 * 2 ** 0.5), "--json",
        "--noise-placement", "server"])["epsilon"], rel=1e-6)
    assert client["observers"]["server"]["epsilon"] > result["epsilon"]
    four = _json(capsys, ["privacy", "--strategy", "gm-ffa-lora", "--noise-multiplier", "1.5", "--json",
                          "--min-replies", "4"])
    assert four["epsilon"] < client["epsilon"]


def test_privacy_calibrates_for_a_target(capsys):
    result = _json(capsys, ["privacy", "--strategy", "sgmm-ffa-lora", "--target-epsilon", "2.0", "--rounds", "100",
                            "--threat-model", "secret-sketch", "--json"])
    assert result["epsilon"] <= 2.0 and result["noise_multiplier"] > 0 and result["sketch_dim"] == 150
    assert main(["privacy", "--strategy", "sgmm-ffa-lora", "--target-epsilon", "2.0", "--rounds", "100"]) == 0
    out = capsys.readouterr().out
    assert "calibrated for target epsilon 2" in out and "threat model: known-sketch, noise at the client" in out


def test_privacy_poisson_and_non_private(capsys):
    result = _json(capsys, ["privacy", "--strategy", "gm-flexlora", "--noise-multiplier", "1.5", "--sampling",
                            "poisson", "--sampling-rate", "0.0064", "--noise-placement", "server", "--json"])
    assert result["sampling"] == "poisson" and result["epsilon"] == pytest.approx(0.352, abs=0.005)  # PLD
    assert main(["privacy", "--strategy", "ffa-lora", "--noise-multiplier", "0"]) == 0
    assert "epsilon = inf (not private)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--target-epsilon", "0"], "Target epsilon must be positive"),
    (["--target-epsilon", "-1"], "Target epsilon must be positive"),
    (["--noise-multiplier", "1", "--delta", "1"], "Delta must lie in (0, 1)"),
    (["--noise-multiplier", "1", "--delta", "0"], "Delta must lie in (0, 1)"),
    (["--noise-multiplier", "1", "--clients-per-round", "700"], "cannot exceed the number of clients"),
    (["--noise-multiplier", "1", "--sampling", "poisson", "--sampling-rate", "1.5"], "Sampling rate must lie"),
    (["--noise-multiplier", "1", "--sampling", "poisson", "--sampling-rate", "0"], "Sampling rate must lie"),
    (["--noise-multiplier", "1", "--rounds", "0"], "--rounds: must be at least 1"),
    (["--noise-multiplier", "1", "--sketch-dim", "769"], "must lie in [1, 768]"),
    (["--noise-multiplier", "1", "--strategy", "sgmv-ffa-lora", "--sketch-dim", "3073"], "must lie in [1, 3072]"),
    (["--noise-multiplier", "1", "--strategy", "sgmv-flexlora"], "Remark 3.2"),
    (["--noise-multiplier", "1", "--strategy", "fedavg"], "Unknown strategy"),
    (["--noise-multiplier", "1", "--threat-model", "secret-sketch", "--sampling", "poisson"], "fixed-size sampling"),
    (["--noise-multiplier", "1", "--sampling", "poisson"], "--sampling poisson needs --noise-placement server"),
    (["--noise-multiplier", "1", "--target-epsilon", "1"], "not allowed with argument"),
    (["--target-epsilon", "1", "--strategy", "ffa-lora"], "ffa-lora adds no noise and is not private"),
    (["--noise-multiplier", "inf"], "argument --noise-multiplier: 'inf' is not a finite number"),
    ([], "Give --target-epsilon or --noise-multiplier"),
    (["--config", str(QUICKSTART), "--rounds", "5"], "--config takes every value from the preset; drop "
                                                               "--rounds"),
    (["--config", "missing.toml"], "Config file 'missing.toml' does not exist (or give a packaged preset by name: "
                                   "bible, cifar100_private, fashion_mnist, paper_cifar100, quickstart, small_cohort)"),
])
def test_privacy_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    assert main(["privacy", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("\n") == 1 and not captured.out


def test_the_version_and_a_packaged_preset_by_name_from_any_directory(capsys, monkeypatch, tmp_path):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out == f"fedlora {version('fedlora')}\n"
    monkeypatch.chdir(tmp_path)  # no configs/ here
    assert main(["privacy", "--config", "quickstart", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["noise_multiplier"] == pytest.approx(1.4707, abs=1e-3)


def test_paper_table(capsys):
    rows = {row["strategy"]: row for row in _json(capsys, ["privacy", "--paper-table", "--json"])}
    assert set(rows) == {"sgmm-ffa-lora", "sgmv-ffa-lora", "sgmm-flexlora", "gm-ffa-lora", "gm-flexlora"}
    assert rows["sgmm-ffa-lora"]["paper_noise_multiplier"] == 1.45
    known = {row["calibrated"]["known-sketch"] for row in rows.values()}
    assert len(known) == 1  # under known-sketch every strategy is the same Gaussian release
    for name in ("sgmm-ffa-lora", "sgmv-ffa-lora", "sgmm-flexlora"):
        z = rows[name]["calibrated"]
        # the unsound per-message analysis needs the least noise; the joint bound sits between it and known-sketch
        assert z["per-message"] < z["secret-sketch"] < z["known-sketch"]
    assert main(["privacy", "--paper-table"]) == 0
    assert "| sgmm-ffa-lora | 1.45 |" in capsys.readouterr().out


def test_privacy_names_the_noise_placement_and_accounts_the_clip_count(capsys):
    client = _json(capsys, ["privacy", "--strategy", "gm-ffa-lora", "--noise-multiplier", "1.5", "--json"])
    server = _json(capsys, ["privacy", "--strategy", "gm-ffa-lora", "--noise-multiplier", "1.5", "--json",
                            "--noise-placement", "server"])
    assert server["epsilon"] > client["epsilon"] and server["noise_placement"] == "server"  # N_min replies' noise
    assert "noise at the server" in server["summary"] and "noise at the client" in client["summary"]
    counted = _json(capsys, ["privacy", "--strategy", "gm-ffa-lora", "--noise-multiplier", "1.5", "--json",
                             "--noise-placement", "server", "--clip-count-stddev", "2"])
    assert counted["epsilon"] > server["epsilon"]  # the count is a release too
    assert main(["privacy", "--strategy", "sgmm-ffa-lora", "--noise-multiplier", "1", "--threat-model",
                 "secret-sketch", "--noise-placement", "server"]) == 2
    assert "needs --threat-model known-sketch" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["run", "cluster", "deploy", "audit", "privacy"])
def test_set_takes_several_assignments_at_once_or_one_at_a_time(command):
    """`--set a=1 b=2` (as the docs write it) and `--set a=1 --set b=2` give the same overrides, in order."""
    from fedlora.cli import build_parser

    parser = build_parser()
    together = parser.parse_args([command, "--set", "num-rounds=10", "seed=1", "--set", "strategy=ffa-lora"])
    apart = parser.parse_args([command, "--set", "num-rounds=10", "--set", "seed=1", "--set", "strategy=ffa-lora"])
    assert together.set == apart.set == ["num-rounds=10", "seed=1", "strategy=ffa-lora"]
    assert parser.parse_args([command]).set == []  # the default list is not shared between parses


@pytest.mark.parametrize("preset, sets", [
    ("quickstart", []), ("small_cohort", []), ("paper_cifar100", []), ("cifar100_private", []),
    ("small_cohort", ["noise-multiplier=2.0", 'head="probe"']),
    ("small_cohort", ["noise-multiplier=2.0", 'head="frozen"', 'threat-model="secret-sketch"', "sketch-dim=16"]),
    ("small_cohort", ["noise-multiplier=2.0", 'threat-model="secret-sketch"', "sketch-dim=16"]),
    ("quickstart", ['noise-placement="secagg"', 'strategy="gm-ffa-lora"', 'target-observer="server"',
                    'noise-source="os"']),
    ("quickstart", ['noise-placement="client"', "clip-quantile=0.5", 'target-observer="server"', 'noise-source="os"']),
    ("quickstart", ['noise-placement="client"', 'accountant="pld"']),
])
def test_privacy_of_a_preset_is_the_runs_plan_for_every_observer(capsys, preset, sets):
    """`fedlora privacy --config` is the run's own accounting (noise_for, at the preset's shapes): every preset, every
    head (the dense head entry under secret-sketch, the probe phase), the clip count, secure aggregation."""
    from dataclasses import replace

    from fedlora.config import load_config
    from fedlora.experiment import noise_for
    from fedlora.models import model_spec

    assert main(["privacy", "--config", preset, *[a for s in sets for a in ("--set", s)], "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    config = load_config(preset, sets)
    plan = noise_for(replace(config, model=model_spec(config.model).random_twin or config.model))
    assert result["noise_multiplier"] == plan.noise_multiplier and result["target_observer"] == config.target_observer
    assert {o: r["epsilon"] for o, r in result["observers"].items()} == {o: r.epsilon for o, r in plan.reports.items()}
    assert result["epsilon"] == plan.planned.epsilon and result["threat_model"] == plan.planned.threat_model
    if config.target_epsilon and not config.noise_multiplier:
        assert result["epsilon"] <= config.target_epsilon


def test_privacy_flags_take_the_head_and_the_target_observer(capsys):
    """Under secret-sketch the head inside the message is a dense Gaussian release beside the sketched one: it costs
    epsilon, which the flags-only mode now counts by default (--head message), as runs do."""
    common = ["privacy", "--strategy", "sgmm-ffa-lora", "--noise-multiplier", "1", "--threat-model", "secret-sketch",
              "--rounds", "50", "--json"]
    frozen = _json(capsys, [*common, "--head", "frozen"])
    message = _json(capsys, common)
    assert message["head"] == "message" and message["epsilon"] > frozen["epsilon"]
    model = _json(capsys, ["privacy", "--strategy", "gm-ffa-lora", "--target-epsilon", "4", "--rounds", "50", "--json"])
    server = _json(capsys, ["privacy", "--strategy", "gm-ffa-lora", "--target-epsilon", "4", "--rounds", "50", "--json",
                            "--target-observer", "server"])
    assert server["observers"]["server"]["epsilon"] <= 4 < model["observers"]["server"]["epsilon"]
    assert server["noise_multiplier"] > model["noise_multiplier"]
    assert main(["privacy", "--strategy", "gm-ffa-lora", "--target-epsilon", "4", "--noise-placement", "server",
                 "--target-observer", "server"]) == 2
    assert "no epsilon holds against it" in capsys.readouterr().err


def test_privacy_and_describe_of_a_preset(capsys):
    """`--config`: a preset's accounting equals `fedlora run`'s calibration; its upload per round is N times a
    client's."""
    from fedlora.config import load_config
    from fedlora.experiment import noise_for

    quickstart = QUICKSTART
    assert main(["privacy", "--config", str(quickstart), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    plan = noise_for(load_config(quickstart))
    assert result["noise_multiplier"] == pytest.approx(plan.noise_multiplier, rel=1e-3)
    assert result["epsilon"] == pytest.approx(plan.planned.epsilon, rel=1e-3)
    assert (result["noise_placement"], result["clients_per_round"], result["rounds"]) == ("server", 50, 10)
    assert set(result["observers"]) == {"model", "server"} and result["target_observer"] == "model"
    gpu = QUICKSTART.parent / "cifar100_private.toml"
    assert main(["describe", "--config", str(gpu), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "vit-b16-random" and report["clients_per_round"] == 500  # shapes, no hub
    assert main(["describe", "--config", str(gpu)]) == 0
    assert "per round, 500 clients: ffa-lora" in capsys.readouterr().out
    assert main(["describe", "--config", str(gpu), "--rank", "8"]) == 2
    assert capsys.readouterr().err == "fedlora: error: --config takes every value from the preset; drop --rank.\n"


def test_the_budget_line_names_whose_epsilon_it_limits(capsys, tmp_path):
    """The budget limits the target observer's epsilon: its line says whose, as the rounds' lines do."""
    from argparse import Namespace

    from fedlora.cli import _prepare
    from fedlora.config import load_config

    config = load_config("small_cohort", ["noise-multiplier=2.0", "target-epsilon=6", 'target-observer="server"',
                                          'noise-source="os"'])
    _prepare(Namespace(out=str(tmp_path / "run")), config, "run")
    budget = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  budget:"))
    assert "budget: epsilon = 6 (" in budget and "against the server (sample known, drawn as the protocol says)" in budget


@pytest.mark.parametrize("argv, message", [
    (["--set", "num-client=3"], "did you mean 'num-clients'"),  # the config's checks (test_config has them all)
    (["--set", "target-epsilon=1e-9"], "unreachable"),
    (["--set", "dataset=cifar100", "--set", "num-classes=100"], "synthetic"),
    (["--set", "clip-quantile=0.5", "--set", "num-clients=20", "--set", "clients-per-round=4"],
     "clip count's noise alone (clip-count-stddev 0.2) spends epsilon"),
    (["--config", "missing.toml"], "does not exist"),
    (["--set", "noise-multiplier=1", "--set", "target-epsilon=0.01"], "does not cover one round"),
    (["--resume", "nowhere"], "holds no config.json"),
])
def test_run_bad_input_is_one_line_and_exit_2_before_ray_starts(capsys, monkeypatch, tmp_path, argv, message):
    monkeypatch.setattr("fedlora.hub.unreachable_reason", lambda: "huggingface.co is unreachable")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()  # nothing started


def test_every_config_problem_is_one_line(capsys):
    assert main(["run", "--set", "num-client=3", "--set", "rank=0", "--set", "lr=fast"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("fedlora: error: ") for line in err)


@pytest.mark.parametrize("assignments, ignored", [
    (["strategy=ffa-lora", "target-epsilon=2", "lr=0.1", "clip-norm=0.5"],
     "  ignored: --set target-epsilon, clip-norm (ffa-lora adds no noise and clips nothing)"),
    (["strategy=gm-ffa-lora", "sketch-dim=32", 'threat-model="secret-sketch"', "noise-placement=client"],
     "  ignored: --set sketch-dim, threat-model (gm-ffa-lora sends its message unsketched)"),
    (["strategy=sgmm-ffa-lora", "sketch-dim=32", "target-epsilon=2"], None),
])
def test_a_set_key_the_strategy_does_not_read_is_named(capsys, tmp_path, assignments, ignored):
    """`--set strategy=ffa-lora target-epsilon=2` runs without noise, as the reference to a private run must; the
    banner says the epsilon is not read, so nobody takes the run for a private one."""
    from argparse import Namespace

    from fedlora.cli import _prepare
    from fedlora.config import load_config

    _prepare(Namespace(out=str(tmp_path / "run"), set=assignments), load_config("quickstart", assignments), "run")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  ignored:")]
    assert lines == ([ignored] if ignored else [])


def test_paths_it_cannot_write_numbers_not_finite_and_resources_it_lacks_are_refused_in_one_line(capsys, tmp_path):
    """Before any work: the run would otherwise start Flower and Ray and end in a traceback, or with no worker;
    pretraining would train first; credentials written over would lose the CA, the node keys and the sketch
    secret."""
    afile, full = tmp_path / "afile", tmp_path / "credentials"
    afile.write_text("")
    assert main(["credentials", str(full)]) == 0
    secret = sorted(p.read_bytes() for p in full.rglob("*") if p.is_file())
    capsys.readouterr()
    for argv, message in [(["run", "--out", str(afile)], f"--out '{afile}' is a file, not a directory."),
                          (["run", "--out", str(afile / "sub")], f"--out '{afile / 'sub'}' cannot be made: "),
                          (["run", "--resume", ""], "argument --resume: an empty path"),
                          (["deploy", "--out", str(afile)], "is a file, not a directory."),
                          (["audit", "--out", str(afile), "--canaries", "0", "--trials", "100"], "is a file"),
                          (["pretrain", "--out", str(afile / "x")], f"--out's folder '{afile}' is a file"),
                          (["pretrain", "--out", str(tmp_path)], "is a directory: name the weights file to write."),
                          (["credentials", str(afile)], "is a file: credentials are never written over"),
                          (["credentials", str(full)], "is not empty: credentials are never written over"),
                          (["credentials", str(tmp_path / "new"), "--host", "10.0.0.1:9092"],
                           "--host '10.0.0.1:9092' is not a host name or IP address"),
                          (["describe", "--num-classes", "1000000"], "--num-classes: at most 100000 classes, got"),
                          (["privacy", "--strategy", "gm-ffa-lora", "--noise-multiplier", "inf"], "not a finite"),
                          (["run", "--set", "lr=nan"], "lr must be a finite number, got nan."),
                          (["run", "--set", "client-cpus=100000"], "less than one client asks (client-cpus = 100000")]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)
    assert sorted(p.read_bytes() for p in full.rglob("*") if p.is_file()) == secret
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "credentials"]


def test_a_damaged_run_directory_is_named_in_one_line(capsys, tmp_path):
    from fedlora.checkpoint import STATE_FILE
    from fedlora.config import RunConfig

    config = tmp_path / "config.json"
    whole = {**RunConfig().to_mapping(), "noise-multiplier (used)": 1.0, "probe-noise-multiplier (used)": 0.0}
    for text, state, message in [("{bad", None, f"'{config}' is damaged (JSONDecodeError: "),
                                 (json.dumps(RunConfig().to_mapping()), None, f"'{config}' is damaged (KeyError: "),
                                 (json.dumps(whole), b"garbage", f"'{tmp_path / STATE_FILE}' is damaged ")]:
        config.write_text(text)
        if state is not None:
            (tmp_path / STATE_FILE).write_bytes(state)
        assert main(["run", "--resume", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("stop, code, why", [(KeyboardInterrupt, 130, "Ctrl-C"), (None, 143, "SIGTERM")])
def test_a_command_stopped_from_outside_says_how_to_continue_its_run(monkeypatch, capsys, tmp_path, stop, code, why):
    """Ctrl-C and SIGTERM end `fedlora run` through its clean-up, then one line names the resume command (no
    traceback), and the run directory's lock is released."""
    import fedlora.cli as cli

    def interrupted(args):
        cli._claim(tmp_path / "run", "run", default_name=False)
        if stop is None:
            cli._stop_on_sigterm()
            os.kill(os.getpid(), signal.SIGTERM)
        raise stop()

    monkeypatch.setitem(cli.COMMANDS, "run", interrupted)
    assert main(["run"]) == code
    err = capsys.readouterr().err
    assert err == f"fedlora: stopped by {why}: continue the run with `fedlora run --resume {tmp_path / 'run'}`\n"
    assert not cli._HELD


@pytest.mark.parametrize("status, offered", [(None, False), ("running", True), ("stalled", True), ("finished", False)])
def test_a_failed_launch_of_a_resumable_run_says_how_to_resume_it(monkeypatch, capsys, tmp_path, status, offered):
    """A launch that fails where its message cannot know the run (a SuperNode of a resume that could not start)
    still ends in one line that offers the resume, where the run has a checkpoint that has not ended; a message
    that offers it already is left alone."""
    import fedlora.cli as cli
    from fedlora.checkpoint import Checkpoint
    import torch

    from fedlora.launch import LaunchError
    from fedlora.round_plan import GlobalState

    def failed(message):
        def command(args):
            run = cli._claim(tmp_path / "run", "deploy", default_name=False)
            if status is not None:
                Checkpoint(GlobalState({"w": torch.zeros(2)}, 0), status=status).save(run)
            raise LaunchError(message)
        return command

    offer = f" Resume it with `fedlora deploy --resume {tmp_path / 'run'}`."
    monkeypatch.setitem(cli.COMMANDS, "deploy", failed("The supernode-1 exited at start-up; see x.log."))
    assert main(["deploy"]) == 1
    assert capsys.readouterr().err == \
        f"fedlora: error: The supernode-1 exited at start-up; see x.log.{offer if offered else ''}\n"
    said = f"The federation stopped after 1 of 3 rounds; resume it with `fedlora deploy --resume {tmp_path / 'run'}`."
    monkeypatch.setitem(cli.COMMANDS, "deploy", failed(said))
    assert main(["deploy"]) == 1
    assert capsys.readouterr().err == f"fedlora: error: {said}\n"


def test_ledger_says_what_a_node_spent_against_the_server(capsys, tmp_path):
    from fedlora.privacy.events import GaussianRelease
    from fedlora.privacy.node_budget import NodeBudget

    budget = NodeBudget(tmp_path / "ledger.jsonl")
    for run in (3, 3, 9):
        budget.spend((GaussianRelease(2.0),), run=run, round=1)
    assert main(["ledger", str(tmp_path / "ledger.jsonl"), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["replies"], shown["runs"]) == (3, ["3", "9"])
    assert shown["epsilon"] == pytest.approx(budget.spent()) and shown["epsilon"] > 0
    assert main(["ledger", str(tmp_path / "ledger.jsonl")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{tmp_path / 'ledger.jsonl'}: 3 replies in 2 runs, ")
    assert out[1] == (f"epsilon {shown['epsilon']:.3f} at delta 1e-05, against the server, counting only the noise "
                      "this node added (known-sample exact)")
    for argv, message in [([str(tmp_path / "missing")], "is not a file"),
                          ([str(tmp_path / "ledger.jsonl"), "--delta", "2"], "must lie in (0, 1)")]:
        assert main(["ledger", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


def test_a_resumed_run_whose_ledger_holds_releases_accounted_otherwise_is_refused_in_one_line(tmp_path):
    """A client-placement run checkpointed before noise at the client was accounted as the sum of the replies recorded
    GaussianRelease(z); today's plan accounts GaussianRelease(z sqrt(N_min), N_min): refused before any work."""
    from types import SimpleNamespace

    from fedlora.cli import CLIError, _check_recorded_releases
    from fedlora.config import load_config
    from fedlora.experiment import noise_for, sampling_of
    from fedlora.privacy import GaussianRelease, PrivacyLedger

    config = load_config("small_cohort", ["noise-multiplier=2.0"])
    plan = noise_for(config)
    ledger = PrivacyLedger(config.delta, config.threat_model, placement="client")
    ledger.record("lora", plan.phase_releases["lora"], sampling_of(config))
    _check_recorded_releases(SimpleNamespace(ledger=ledger.to_dict()), plan, tmp_path)  # today's: continues
    old = PrivacyLedger(config.delta, config.threat_model, placement="client")
    old.record("lora", (GaussianRelease(2.0),), sampling_of(config))
    with pytest.raises(CLIError, match="records the lora phase's rounds as another release than this fedlora accounts"):
        _check_recorded_releases(SimpleNamespace(ledger=old.to_dict()), plan, tmp_path)
