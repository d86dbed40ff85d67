"""The fedlora ServerApp: calibrate the noise, run the strategy, evaluate, account, write the run directory."""

from __future__ import annotations

import math
from logging import INFO
from pathlib import Path

from flwr.app import Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from fedlora.config import OUT_DIR_KEY, run_config_of
from fedlora.experiment import RunRecorder, noise_for, sampling_of
from fedlora.federation import Protocol
from strategies.fedlora_strategy import FedLoRAStrategy, to_arrays

app = ServerApp()


def run_federation(grid: Grid, context: Context, *, echo=None) -> FedLoRAStrategy:
    """Runs the configured federation on ``grid``; returns the strategy (its state, ledger and rounds)."""
    config = run_config_of(dict(context.run_config))
    out_dir = Path(str(context.run_config.get(OUT_DIR_KEY, "runs/latest")))
    plan = noise_for(config)
    ledger = plan.new_ledger(config)
    protocol = Protocol(config, plan.noise_multiplier, plan.probe_noise_multiplier)
    recorder = RunRecorder(config, protocol, out_dir, echo=echo or (lambda line: log(INFO, line)))
    strategy = FedLoRAStrategy(protocol, protocol.initial_state(protocol.build_model()), ledger, sampling_of(config),
                               plan.releases)

    def evaluate_fn(server_round: int, _arrays) -> MetricRecord | None:
        if server_round == 0:
            return None
        row = recorder.record(server_round, strategy.state, strategy.rounds.get(server_round, {}), ledger)
        values = {"accuracy": row["accuracy"], "loss": row["loss"], f"epsilon ({row['threat_model']})": row["epsilon"]}
        return MetricRecord({k: float(v) for k, v in values.items() if math.isfinite(v)})

    strategy.start(grid, to_arrays(strategy.state.message), num_rounds=config.num_rounds, evaluate_fn=evaluate_fn)
    recorder.finish(strategy.state, secret_fingerprint=strategy.secret_fingerprint)
    return strategy


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_federation(grid, context)
