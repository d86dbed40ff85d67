"""The fedlora ServerApp: calibrate the noise, run the strategy, evaluate, account, checkpoint, write the run
directory. With ``resume`` in the run config it continues from the run directory's checkpoint."""

from __future__ import annotations

import math
import time
from logging import INFO
from pathlib import Path

import psutil
from flwr.app import Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from fedlora.checkpoint import ENDED, STATE_FILE, Checkpoint
from fedlora.config import OUT_DIR_KEY, RESUME_KEY, SIMULATION_KEY, run_config_of
from fedlora.experiment import RunRecorder, load_run_config, noise_for, sampling_of
from fedlora.server_round import ServerSide
from fedlora.strategies.fedlora_strategy import FedLoRAStrategy, to_arrays

app = ServerApp()


def run_federation(grid: Grid, context: Context, *, echo=None) -> FedLoRAStrategy:
    """Runs (or resumes) the configured federation on ``grid``; returns the strategy (its state, ledger, rounds)."""
    began = time.time()
    config = run_config_of(dict(context.run_config))
    simulated = bool(context.run_config.get(SIMULATION_KEY, False))  # by the simulation engine (`fedlora run`)
    if not (simulated or getattr(grid, "simulation", False)) and (problems := config.outside_simulation_problems()):
        raise RuntimeError(problems[0])
    out_dir = Path(str(context.run_config.get(OUT_DIR_KEY, "runs/latest")))
    saved = None
    if context.run_config.get(RESUME_KEY, False) and (out_dir / STATE_FILE).is_file():
        saved = Checkpoint.load(out_dir)
        if saved.status in ENDED:
            raise RuntimeError(f"The run in {out_dir} has ended ({saved.status}): there is nothing to resume.")
    plan = noise_for(config)
    calibrated = time.time()
    if saved and load_run_config(out_dir)[1:] != (plan.noise_multiplier, plan.probe_noise_multiplier):
        raise RuntimeError(f"The noise calibrated now differs from the one the run in {out_dir} used: it cannot be "
                           "resumed with this version.")
    protocol = ServerSide(config, plan.noise_multiplier, plan.probe_noise_multiplier)
    recorder = RunRecorder(config, protocol, out_dir, echo=echo or (lambda line: log(INFO, line)),
                           rows=saved.rows if saved else None)
    strategy = FedLoRAStrategy(protocol, protocol.initial_state(protocol.build_model()), plan.new_ledger(config),
                               sampling_of(config), plan.phase_releases, save=lambda: recorder.save(strategy.checkpoint()),
                               simulated=simulated, progress=recorder.progress)
    # what this launch did before its first round (the nodes' query is added by the strategy), in that round's row
    strategy.startup = {"process": began - psutil.Process().create_time(), "noise calibration": calibrated - began,
                        "model and test data": time.time() - calibrated}
    if saved:
        strategy.restore(saved)
        if len(recorder.rows) < strategy.rounds_done:  # the run stopped between a round and its metrics
            recorder.record(strategy.rounds_done, strategy.state, strategy.rounds.get(strategy.rounds_done, {}),
                            strategy.ledger)
            strategy.save()

    def evaluate_fn(server_round: int, _arrays) -> MetricRecord | None:
        row = recorder.record(server_round, strategy.state, strategy.rounds.get(server_round, {}), strategy.ledger)
        strategy.save()
        values = {"accuracy": row["accuracy"], "loss": row["loss"], f"epsilon ({row['threat_model']})": row["epsilon"],
                  **{f"epsilon against {observer}": value for observer, value in row["epsilon_by_observer"].items()}}
        return MetricRecord({k: float(v) for k, v in values.items() if v is not None and math.isfinite(v)})

    try:
        strategy.start(grid, to_arrays(strategy.state.broadcast), num_rounds=config.num_rounds,
                       timeout=config.reply_timeout, evaluate_fn=evaluate_fn)
        recorder.finish(strategy.state, status=strategy.status, reason=strategy.reason)
        strategy.save()  # the final status last: an ended run has its adapter
    finally:
        recorder.close()
    return strategy


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_federation(grid, context)
