import json
import math

import pytest

from fedlora.config import ConfigError, RunConfig, load_config, packaged_presets, parse_assignment
from fedlora.run_keys import OUT_DIR_KEY, RESUME_KEY, SIMULATION_KEY


def test_defaults_are_valid_and_keys_use_the_vocabulary():
    assert RunConfig().problems() == []
    for key in ("strategy", "num-clients", "clients-per-round", "sampling", "num-rounds", "local-steps", "batch-size",
                "lr", "rank", "sketch-dim", "target-epsilon", "delta", "noise-multiplier", "clip-norm", "threat-model",
                "dataset", "model", "partitioner", "dirichlet-alpha", "eval-every", "seed"):
        assert key in RunConfig.keys()


def test_types_are_converted_and_assignments_parsed():
    config = RunConfig.from_mapping({"num-clients": "30", "clients-per-round": 4, "lr": 1, "strategy": "flexlora",
                                      "message": "adapter"})
    assert config.num_clients == 30 and config.lr == 1.0 and isinstance(config.lr, float)
    assert parse_assignment("lr=0.1") == ("lr", 0.1)
    assert parse_assignment("strategy=gm-ffa-lora") == ("strategy", "gm-ffa-lora")
    assert parse_assignment('model="vit-tiny"') == ("model", "vit-tiny")


def test_toml_files_and_flower_tables(tmp_path):
    plain = tmp_path / "plain.toml"
    plain.write_text('strategy = "gm-ffa-lora"\nnum-rounds = 3\n')
    assert load_config(plain, ["num-rounds=5"]).num_rounds == 5
    flower = tmp_path / "pyproject.toml"
    flower.write_text('[tool.flwr.app.config]\nstrategy = "flexlora"\nmessage = "adapter"\n')
    assert load_config(flower).strategy == "flexlora"


BAD_CONFIGS = [
    ({"num-client": 5}, "Unknown key 'num-client'; did you mean 'num-clients'?"),
    ({"frobnicate": 1}, "Unknown key 'frobnicate'."),
    ({"strategy": "fedavg"}, "strategy must be one of"),
    ({"strategy": "sgmm-flexlroa"}, "did you mean 'sgmm-flexlora'?"),
    ({"strategy": "sgmv-flexlora"}, "SGMV cannot be used with FlexLoRA"),
    ({"num-clients": 3, "clients-per-round": 4}, "clients-per-round (4) cannot exceed num-clients (3)"),
    ({"min-replies": 51}, "min-replies (51) cannot exceed clients-per-round (50)"),
    ({"num-clients": 8, "clients-per-round": 4, "simulation-nodes": 9}, "simulation-nodes (9) cannot exceed num-clients"),
    ({"num-clients": 8, "clients-per-round": 4, "simulation-nodes": 8, "client-batch": 4},
     "client-batch = 4 trains together the clients one message carries: with a node per client"),
    ({"rank": 0}, "rank must be >= 1"),
    ({"rank": 500}, "Rank 500 exceeds the smallest side (192)"),
    ({"sketch-dim": 500}, "Sketch dimension 500 must lie in [1, 192] for sgmm-ffa-lora"),
    ({"strategy": "sgmv-ffa-lora", "sketch-dim": 800}, "Sketch dimension 800 must lie in [1, 768]"),  # h <= m r
    ({"lr": 0}, "lr must be > 0"),
    ({"lr": "fast"}, "lr must be a number"),
    ({"lr": True}, "lr must be a number"),
    ({"delta": 1.5}, "delta must be < 1"),
    ({"delta": 1.0}, "delta must be < 1"),
    ({"num-rounds": 2.5}, "num-rounds must be a whole number"),
    ({"num-rounds": "many"}, "num-rounds must be a whole number"),
    ({"reply-timeout": 0}, "reply-timeout must be > 0"),
    ({"round-retries": -1}, "round-retries must be >= 0"),
    ({"target-epsilon": 0, "noise-multiplier": 0}, "is private: set target-epsilon"),
    ({"target-epsilon": -1}, "target-epsilon must be >= 0"),
    ({"strategy": "sgmm-ffa-lora", "client-ranks": "4,2"}, "needs a FlexLoRA strategy"),
    ({"strategy": "flexlora", "message": "adapter", "client-ranks": "8"}, "must lie in [1, rank = 4]"),
    ({"strategy": "flexlora", "message": "adapter", "client-ranks": "a,b"}, "comma-separated whole numbers"),
    ({"threat-model": "secret-sketch", "noise-placement": "client", "sampling": "poisson"}, "fixed-size sampling only"),
    ({"noise-placement": "client", "sampling": "poisson"}, "reveals it, which Poisson accounting assumes hidden"),
    ({"sketch-secret": "node-file", "message": "adapter"}, "is for sketched strategies under threat-model"),
    ({"head": "probe", "num-rounds": 1}, 'head = "probe" needs num-rounds >= 2 (the linear-probe phase, then LoRA '
                                         'rounds), got 1.'),
    ({"head": "probe", "num-rounds": 3, "probe-rounds": 3}, "The linear-probe phase needs 1 to 2 rounds"),
    ({"dataset": "cifar100", "num-classes": 10}, "cifar100 has 100 classes: set num-classes = 100 (or 0, the data's)."),
    ({"dataset": "cifar-100"}, "dataset must be one of synthetic, cifar100, fashion-mnist, hf:<id> or folder:<path>, "
                               "got 'cifar-100'; did you mean 'cifar100'?"),
    ({"dataset": "folder:"}, "dataset must be one of synthetic, cifar100, fashion-mnist, hf:<id> or folder:<path>, "
                             "got 'folder:'."),
    ({"label-column": "y"}, "image-column and label-column name the columns of an hf: or folder: dataset; synthetic "
                            "has its own."),
    ({"num-classes": 1}, "num-classes must be 0 (the data's) or at least 2, got 1."),
    ({"lr": float("nan")}, "lr must be a finite number, got nan."),  # NaN passes every comparison
    ({"noise-multiplier": float("inf")}, "noise-multiplier must be a finite number, got inf."),
    ({"seed": 2 ** 64}, f"seed must be <= {2 ** 63 - 1}, got {2 ** 64}."),
    ({"num-rounds": 10 ** 9}, "num-rounds must be <= 100000, got 1000000000."),  # the accountant would fill the memory
    ({"num-clients": 10 ** 20}, "num-clients must be <= 10000000, got 100000000000000000000."),
    ({"num-clients": 8, "clients-per-round": 4, "train-examples": 3},
     "train-examples (3) cannot be fewer than num-clients (8): every client needs at least one example."),
    ({"num-classes": 10 ** 9}, "num-classes must be <= 100000, got 1000000000."),  # the head would fill the memory
    ({"train-examples": 10 ** 7}, "train-examples must be <= 1000000, got 10000000."),  # made in memory
    ({"model": "vit-huge"}, "model must be one of"),
]


@pytest.mark.parametrize("values, message", BAD_CONFIGS)
def test_bad_configs_fail_with_one_sentence(values, message):
    with pytest.raises(ConfigError) as error:
        RunConfig.from_mapping(values)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_every_problem_is_named_at_once():
    with pytest.raises(ConfigError) as error:
        RunConfig.from_mapping({"num-client": 5, "lr": "fast", "rank": 0})
    assert len(error.value.problems) == 3 and str(error.value).count("\n") == 2
    with pytest.raises(ConfigError) as error:
        RunConfig.from_mapping({"num-clients": 3, "clients-per-round": 4, "min-replies": 5, "rank": 500})
    assert len(error.value.problems) == 3


def test_noise_multiplier_with_a_target_is_a_budget():
    config = RunConfig.from_mapping({"noise-multiplier": 1.0, "target-epsilon": 5.0})
    assert config.budget() == 5.0 and config.required_replies() == 25  # half of N = 50, rounded up
    assert RunConfig.from_mapping({"noise-multiplier": 1.0, "target-epsilon": 0}).budget() is None
    assert RunConfig.from_mapping({"clients-per-round": 5, "min-replies": 1}).required_replies() == 1


def test_bad_files_and_assignments(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("strategy = \n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(broken)
    with pytest.raises(ValueError, match="key=value"):
        load_config(None, ["lr"])
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"num-rounds = 3\n\xff\n")
    with pytest.raises(ValueError, match="binary.toml' is not valid TOML .'utf-8' codec"):
        load_config(binary)
    flat = tmp_path / "pyproject.toml"
    flat.write_text("[tool.flwr.app]\nconfig = 5\n")
    with pytest.raises(ValueError, match="'config' must be a table of the .tool.flwr.app.config. path, got int"):
        load_config(flat)
    with pytest.raises(ValueError, match="is a directory: name a TOML file in it"):
        load_config(tmp_path)
    with pytest.raises(ValueError, match="The config file's name is empty"):
        load_config("")


def test_one_vocabulary_everywhere():
    """pyproject's Flower run config and the quickstart preset are the defaults, key for key (beside the launch
    keys: where the ServerApp writes, and whether it resumes); the packaged presets are the configs/ files."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    flower = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert {k: v for k, v in flower.items() if k not in (OUT_DIR_KEY, RESUME_KEY, SIMULATION_KEY)} == \
        RunConfig().to_mapping()
    assert (flower[OUT_DIR_KEY], flower[RESUME_KEY], flower[SIMULATION_KEY]) == ("runs/flwr", False, False)
    assert load_config(root / "configs" / "quickstart.toml") == RunConfig() == load_config("quickstart")
    assert packaged_presets() == {p.stem: p for p in sorted((root / "configs").glob("*.toml"))}
    assert load_config(root / "configs" / "small_cohort.toml").clients_per_round == 4  # the first quickstart
    paper = load_config(root / "configs" / "paper_cifar100.toml")
    assert (paper.num_clients, paper.clients_per_round, paper.num_rounds, paper.sketch_dim) == (625, 4, 400, 150)


def test_the_quickstart_is_private_at_epsilon_8_and_calibrates_to_it():
    """The quickstart: a sketched strategy, epsilon <= 8, delta <= 1e-5 and below 1 / C, noise calibrated to spend
    the target, its trust model named."""
    from fedlora.experiment import noise_for

    config = RunConfig()
    assert config.strategy == "sgmm-ffa-lora" and config.target_epsilon <= 8
    assert config.delta <= 1e-5 and config.delta < 1 / config.num_clients
    plan = noise_for(config)
    assert plan.planned.epsilon == pytest.approx(config.target_epsilon, rel=0.01)
    assert plan.planned.epsilon <= config.target_epsilon
    assert plan.planned.threat_model == ("known-sketch, noise at the server, seeded noise (a simulation); against "
                                         "observers of the model (sample hidden)")
    assert math.isinf(plan.reports["server"].epsilon)  # the server sees each message before its noise
    assert config.model == "vit-tiny-public"
    assert RunConfig.from_mapping({"strategy": "ffa-lora"}).noise_placement == "server"  # the reference: moot


def test_cifar100_private_preset_runs_offline_with_the_tiny_model(tmp_path):
    """configs/cifar100_private.toml's code path (100 classes, the sketch of b = 150 on its levers) on the tiny
    pretrained ViT and synthetic data, one round in process: the preset itself needs the hub and a GPU."""
    from pathlib import Path

    from flwr.app import Context, RecordDict

    from fedlora.clients.app import app
    from fedlora.strategies.inprocess_grid import InProcessGrid
    from fedlora.strategies.server_app import run_federation

    preset = Path(__file__).resolve().parents[1] / "configs" / "cifar100_private.toml"
    gpu = load_config(preset)
    assert (gpu.model, gpu.dataset, gpu.noise_placement, gpu.message) == ("vit-b16", "cifar100", "server", "update")
    assert gpu.target_epsilon <= 8 and gpu.delta < 1 / gpu.num_clients
    offline = load_config(preset, ["model=vit-tiny-public", 'dataset="synthetic"', "num-clients=8",
                                   "clients-per-round=4", "num-rounds=1", "train-examples=400", "test-examples=100",
                                   "sketch-dim=150", "client-gpus=0", "simulation-nodes=2"])
    values = {**offline.to_mapping(), "out-dir": str(tmp_path)}
    run_federation(InProcessGrid(app, 2, values), Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                                           run_config=values), echo=lambda line: None)
    import json

    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["replies"] == 4 and row["epsilon"] <= 8 and row["threat_model"] == (
        "known-sketch, noise at the server, seeded noise (a simulation); against observers of the model (sample hidden)")
    assert row["observer"] == "model" and math.isinf(row["epsilon_by_observer"]["server"])


@pytest.mark.parametrize("values, message", [
    ({"noise-placement": "central"}, "noise-placement must be one of client, server, secagg, got 'central'"),
    ({"message": "delta"}, "message must be one of adapter, update"),
    ({"server-optimizer": "lamb", "message": "update"}, "server-optimizer must be one of sgd, momentum, adam"),
    ({"clip-quantile": 1.0}, "clip-quantile must be < 1, got 1.0"),
    ({"clip-quantile": -0.1}, "clip-quantile must be >= 0"),
    ({"server-momentum": 1.0, "message": "update"}, "server-momentum must be < 1"),
    ({"noise-placement": "server", "threat-model": "secret-sketch"}, 'noise-placement = "server" needs threat-model'),
    ({"message": "update", "strategy": "sgmm-flexlora", "threat-model": "secret-sketch", "noise-placement": "client"},
     'message = "update" with sgmm-flexlora needs threat-model = "known-sketch"'),
    ({"server-optimizer": "adam", "message": "adapter"}, 'server-optimizer and server-lr apply to message = "update"'),
    ({"clip-quantile": 0.5, "strategy": "flexlora", "message": "adapter"}, "flexlora clips nothing"),
    ({"clip-quantile": 0.5, "head": "probe"}, 'not supported with head = "probe"'),
    ({"clip-lr": 0.5}, "clip-lr and clip-count-stddev apply to adaptive clipping"),
    ({"noise-placement": "secagg", "strategy": "ffa-lora"}, 'noise-placement = "secagg" adds the noise in shares'),
    ({"noise-placement": "secagg", "sampling": "poisson"}, 'noise-placement = "secagg" needs sampling = "fixed"'),
    ({"noise-placement": "secagg", "min-replies": 1}, 'noise-placement = "secagg" needs min-replies >= 3'),
    ({"noise-placement": "secagg", "min-replies": 2}, "Flower's SecAgg+ folds each mask seed to 32 bits"),
    ({"noise-placement": "secagg", "clients-per-round": 1}, 'noise-placement = "secagg" needs min-replies >= 3'),
    ({"noise-placement": "secagg", "clip-quantile": 0.5}, "does not support adaptive clipping"),
    ({"noise-placement": "secagg", "simulation-nodes": 10}, "needs one Flower node per client"),
    ({"noise-placement": "secagg", "threat-model": "secret-sketch"}, 'noise-placement = "secagg" needs threat-model'),
])
def test_unsupported_levers_are_one_line_each(values, message):
    with pytest.raises(ConfigError) as error:
        RunConfig.from_mapping(values)
    assert len(error.value.problems) == 1 and message in error.value.problems[0]


def test_several_lever_problems_give_one_line_each():
    with pytest.raises(ConfigError) as error:
        RunConfig.from_mapping({"noise-placement": "everywhere", "clip-quantile": 2, "message": "update",
                                "strategy": "gm-flexlora"})
    assert len(error.value.problems) == 2  # values first; cross-constraints once every value is in range


def test_a_run_from_before_the_precision_key_resumes_in_fp32(tmp_path):
    from fedlora.experiment import load_run_config

    saved = {**RunConfig().to_mapping(), "noise-multiplier (used)": 1.0, "probe-noise-multiplier (used)": 0.0}
    del saved["precision"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert load_run_config(tmp_path)[0].precision == "fp32"
    (tmp_path / "config.json").write_text(json.dumps({**saved, "precision": "auto"}))
    assert load_run_config(tmp_path)[0].precision == "auto"
