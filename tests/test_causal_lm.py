"""Causal language models as a task: tiny GPT-2 (fused Conv1D attention) and LLaMA take private rounds of every
algorithm family, clients trained together equal clients trained alone, and the loss and metrics are those of
next-token prediction."""

import json
import math
import os

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from peft import PeftModel

from fedlora.algorithms import LoRAMode
from fedlora.clients.app import app as client_app
from fedlora.config import RunConfig, run_config_of
from fedlora.lora import build_lora_model
from fedlora.models import build_backbone
from fedlora.strategies.inprocess_grid import InProcessGrid
from fedlora.strategies.server_app import run_federation
from fedlora.tasks import task_named
from fedlora.text import bible_unavailable_reason, to_device_tokens
from tests.helpers import DEVICES, assert_trained_together_as_alone

LM = task_named("causal-lm")
WORDS = ("the lord said unto moses speak unto the children of israel and say unto them when any man of you bring an "
         "offering unto the lord ye shall bring your offering of the cattle even of the herd and of the flock").split()


def _text_folder(root, files: int = 12):
    rng = np.random.default_rng(0)
    for i in range(files):
        (root / f"{i:02d}.txt").parent.mkdir(parents=True, exist_ok=True)
        (root / f"{i:02d}.txt").write_text(" ".join(rng.choice(WORDS, 120)))
    return root


def _run(tmp_path, **overrides):
    config = {"model": "gpt2-tiny", "dataset": f"folder:{_text_folder(tmp_path / 'text')}", "partitioner": "natural",
              "head": "frozen", "num-clients": 5, "clients-per-round": 3, "num-rounds": 1, "local-steps": 2,
              "batch-size": 4, "seq-len": 16, "sketch-dim": 16, "target-epsilon": 10.0,
              **{k.replace("_", "-"): v for k, v in overrides.items()}, "out-dir": str(tmp_path / "run")}
    grid = InProcessGrid(client_app, config.get("simulation-nodes") or config["num-clients"], config)
    strategy = run_federation(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                            run_config=config), echo=lambda line: None)
    return strategy, grid, config


@pytest.mark.parametrize("model", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.parametrize("strategy_name, placement", [("sgmm-ffa-lora", "server"), ("gm-flexlora", "client")])
def test_a_tiny_language_model_takes_a_private_round(tmp_path, model, strategy_name, placement):
    strategy, grid, config = _run(tmp_path, model=model, strategy=strategy_name, noise_placement=placement)
    assert len(grid.calls) == 3 and strategy.ledger.report().epsilon <= 10.0 + 1e-9
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["replies"] == 3 and rows[-1]["rejected"] == 0
    assert rows[-1]["perplexity"] == pytest.approx(math.exp(rows[-1]["loss"]))
    assert 4.0 < rows[-1]["loss"] < 10.0 and 0.0 <= rows[-1]["accuracy"] <= 1.0  # a random model: about ln 4096
    assert (tmp_path / "run" / "perplexity.png").stat().st_size > 0
    assert not any(n.startswith(("lm_head", "classifier")) for n in strategy.state.message)  # no head travels
    # the PEFT adapter loads onto the same backbone built by transformers, and scores the run's last perplexity
    run_config = run_config_of(config)
    loaded = PeftModel.from_pretrained(build_backbone(model, num_classes=0), str(tmp_path / "run" / "adapter"))
    metrics = LM.evaluate(loaded, LM.test_data(run_config, "cpu"))
    assert metrics["loss"] == pytest.approx(rows[-1]["loss"], rel=1e-5)


def _blocks(seed: int, device) -> object:
    rng = np.random.default_rng(seed)
    return to_device_tokens([rng.integers(1, 4096, 150)], 16, 0, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_name, mode", [("gpt2-tiny", LoRAMode.FFA), ("gpt2-tiny", LoRAMode.FLEX),
                                              ("llama-tiny", LoRAMode.FLEX)])
def test_language_model_clients_trained_together_compute_what_each_computes_alone(model_name, mode, device):
    """GPT-2's LoRA on its fused Conv1D (and LLaMA's on Linear): three clients in one pass per step change their
    adapters and lose what each does alone, within 1e-4."""
    model = build_lora_model(model_name, num_classes=0, rank=2, alpha=4.0, mode=mode).to(device)
    trainable = assert_trained_together_as_alone(model, [_blocks(s, device) for s in range(3)], LM)
    assert any("lora_A" in n for n in trainable) == (mode is LoRAMode.FLEX)


def test_the_loss_counts_real_tokens_only_and_evaluation_weighs_every_token_once():
    """Padding is neither predicted nor a context that predicts: a block's loss is the mean over its real next
    tokens, and the test loss over all blocks is the token-weighted mean, exp of it the perplexity."""
    model = build_backbone("gpt2-tiny", num_classes=0).eval()
    data = to_device_tokens([np.arange(1, 21)], 8, 0)  # 21 tokens with the end-of-text: blocks of 8, 8 and 5
    assert len(data) == 3 and data.tokens == 21
    batch = data[[0, 1, 2]]
    with torch.no_grad():
        scores = model(input_ids=batch["input_ids"]).logits.float()
        per_token = torch.nn.functional.cross_entropy(scores[:, :-1].reshape(-1, 4096),
                                                      batch["input_ids"][:, 1:].reshape(-1),
                                                      reduction="none").view(3, 7)
        losses = LM.example_losses(model, batch)
    assert losses[:2].tolist() == pytest.approx(per_token[:2].mean(1).tolist(), rel=1e-6)
    assert float(losses[2]) == pytest.approx(float(per_token[2, :4].mean()), rel=1e-6)  # 5 real tokens: 4 predictions
    metrics = LM.evaluate(model, data, batch_size=2)
    assert metrics["loss"] == pytest.approx(float(torch.cat([per_token[:2].reshape(-1), per_token[2, :4]]).mean()),
                                            rel=1e-6)
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["loss"]))


def test_the_text_preset_learns_in_a_short_run(tmp_path):
    """The real-text preset for three rounds of 10 clients without noise: the test loss falls from round 1 to
    round 3 (CI installs bible-kjv in .ci/run; without it this fails there and is skipped elsewhere)."""
    if reason := bible_unavailable_reason():
        (pytest.fail if os.environ.get("CI") else pytest.skip)(reason)
    from fedlora.config import load_config
    from fedlora.strategies.server_app import run_federation as run

    config = {**load_config("bible").to_mapping(), "strategy": "ffa-lora", "clients-per-round": 10, "num-rounds": 3,
              "eval-every": 1, "out-dir": str(tmp_path)}
    grid = InProcessGrid(client_app, config["num-clients"], config)
    run(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config),
        echo=lambda line: None)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[2]["loss"] < rows[0]["loss"] - 0.01, [r["loss"] for r in rows]


def test_the_task_follows_the_model():
    assert RunConfig.from_mapping({"model": "gpt2-tiny", "dataset": "bible-kjv", "partitioner": "natural"}).task is LM
    assert RunConfig().task.name == "image-classification" and RunConfig().classes == 10


def test_describe_and_privacy_report_the_text_preset(capsys):
    from fedlora.cli import main

    assert main(["describe", "--config", "bible"]) == 0
    out = capsys.readouterr().out
    assert "gpt2-tiny: gpt2 'gpt2-tiny', causal language model, the shapes of the preset's gpt2-tiny-public" in out
    assert "LoRA rank 4 on 4 layers (qv): B 384x4, A 4x128" in out and "no classifier head" in out
    assert main(["privacy", "--config", "bible"]) == 0
    assert "epsilon = 7.98" in capsys.readouterr().out


@pytest.mark.parametrize("strategy_name, placement", [
    ("ffa-lora", "server"), ("flexlora", "server"), ("gm-ffa-lora", "client"), ("sgmv-ffa-lora", "client"),
    ("sgmm-ffa-lora", "client"), ("gm-flexlora", "server"), ("sgmm-flexlora", "server"),
    ("sgmm-flexlora", "client")])
def test_every_strategy_takes_a_round_of_a_language_model(tmp_path, strategy_name, placement):
    """The seven strategies (with the paper's placement, noise at each client, and the server's) on text: two rounds
    of a tiny GPT-2, each aggregated from every reply and counted."""
    strategy, grid, _ = _run(tmp_path, strategy=strategy_name, noise_placement=placement, num_rounds=2,
                             sketch_dim=32 if strategy_name.startswith("sgmv") else 16)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and all(r["replies"] == 3 and r["rejected"] == 0 for r in rows)
    assert all(math.isfinite(r["loss"]) for r in rows) and len(grid.calls) == 6
    private = strategy_name not in ("ffa-lora", "flexlora")
    assert (strategy.ledger is not None and strategy.ledger.rounds == 2) == private


def test_a_crashed_language_model_run_resumes_to_the_uninterrupted_result(tmp_path):
    """Resume on text: a run whose server dies as round 3's messages go out continues from its checkpoint to the
    model, ledger and rows of the run that never stopped."""
    from fedlora.checkpoint import Checkpoint
    from fedlora.run_keys import RESUME_KEY
    from tests.test_reliability import Crash, CrashingGrid

    reference, _, _ = _run(tmp_path / "reference", num_rounds=4)
    out = tmp_path / "crashed"
    config = {"model": "gpt2-tiny", "dataset": f"folder:{_text_folder(out / 'text')}", "partitioner": "natural",
              "head": "frozen", "num-clients": 5, "clients-per-round": 3, "num-rounds": 4, "local-steps": 2,
              "batch-size": 4, "seq-len": 16, "sketch-dim": 16, "target-epsilon": 10.0, "out-dir": str(out / "run")}
    context = lambda extra: Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),  # noqa: E731
                                    run_config={**config, **extra})
    with pytest.raises(Crash):
        run_federation(CrashingGrid(client_app, 5, config), context({}), echo=lambda line: None)
    assert Checkpoint.load(out / "run").rounds_done == 2
    resumed = run_federation(InProcessGrid(client_app, 5, config), context({RESUME_KEY: True}), echo=lambda line: None)
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert resumed.ledger.rounds == reference.ledger.rounds == 4 and resumed.ledger.epsilon == reference.ledger.epsilon
    for name, t in reference.state.message.items():
        torch.testing.assert_close(resumed.state.message[name], t, rtol=1e-5, atol=1e-6)


def test_the_canary_audit_runs_on_a_language_model_and_catches_a_non_private_strategy(tmp_path):
    """The audit's canaries live in the message (directions in LoRA's factors), which does not depend on the task:
    a text federation without noise shows them, one with noise stays below its own ledger."""
    from fedlora.config import RunConfig
    from fedlora.strategies.canary_audit import audit_federation

    text = _text_folder(tmp_path / "text", files=150)
    base = {"model": "gpt2-tiny", "dataset": f"folder:{text}", "partitioner": "natural", "head": "frozen",
            "num-clients": 120, "clients-per-round": 20, "num-rounds": 3, "eval-every": 3, "local-steps": 2,
            "batch-size": 4, "seq-len": 16, "sketch-dim": 16, "noise-placement": "client", "message": "adapter"}
    open_run = audit_federation(RunConfig.from_mapping({**base, "strategy": "ffa-lora"}), 100, tmp_path / "open",
                                echo=lambda line: None)
    assert open_run.auc > 0.6 and open_run.empirical_epsilon > 0.5 and open_run.accountant_epsilon == math.inf
    private = audit_federation(RunConfig.from_mapping({**base, "strategy": "sgmm-ffa-lora"}), 100, tmp_path / "dp",
                               echo=lambda line: None)
    assert private.empirical_epsilon < private.accountant_epsilon <= 8.0 + 1e-9
    rows = [json.loads(line) for line in (tmp_path / "dp" / "metrics.jsonl").read_text().splitlines()]
    assert "perplexity" in rows[-1]  # the run evaluated as a language model
