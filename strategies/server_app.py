"""The fedlora ServerApp: take (or calibrate) the noise, run the strategy, evaluate, account, checkpoint, write the
run directory. With ``resume`` in the run config it continues from the run directory's checkpoint.

This module imports only Flower: in a simulation, the first thing the ServerApp does is to ask the nodes' Ray workers
to load their model and data (``warm_up``), which they then do while the server imports torch and fedlora and builds
its own, instead of in round 1.
"""

from __future__ import annotations

import time
from logging import INFO, WARNING
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from fedlora.run_keys import NODES_KEY, NOISE_KEY, OUT_DIR_KEY, RESUME_KEY, SIMULATION_KEY, WARM_UP
from fedlora.strategies.replies import error_line

app = ServerApp()


def run_federation(grid: Grid, context: Context, *, echo=None, warming: list[str] = ()):
    """Runs (or resumes) the configured federation on ``grid``; returns the strategy (its state, ledger, rounds).
    ``warming``: the warm-up queries sent to the nodes, answered before the first round starts."""
    began = time.time()
    import psutil  # here, not above: see the module's docstring

    from fedlora.checkpoint import ENDED, STATE_FILE, Checkpoint
    from fedlora.config import run_config_of
    from fedlora.experiment import RunRecorder, load_run_config, noise_for, sampling_of
    from fedlora.server_round import ServerSide
    from fedlora.strategies.fedlora_strategy import FedLoRAStrategy, to_arrays

    imported = time.time()
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
    given = context.run_config.get(NOISE_KEY)  # calibrated by the launcher already
    plan = noise_for(config, calibrated=tuple(float(z) for z in str(given).split(",")) if given else None)
    calibrated = time.time()
    if saved and load_run_config(out_dir)[1:] != (plan.noise_multiplier, plan.probe_noise_multiplier):
        raise RuntimeError(f"The noise calibrated now differs from the one the run in {out_dir} used: it cannot be "
                           "resumed with this version.")
    if plan.phase_releases:  # the whole run accounted once before any release: a release it cannot account fails here
        plan.planned
    protocol = ServerSide(config, plan.noise_multiplier, plan.probe_noise_multiplier)
    # a round's evaluation overlaps the next round: on one torch thread where the clients' Ray workers hold the cores
    overlapping_workers = simulated and not getattr(grid, "synchronous", False)
    recorder = RunRecorder(config, protocol, out_dir, echo=echo or (lambda line: log(INFO, line)),
                           rows=saved.rows if saved else None, evaluation_threads=1 if overlapping_workers else None)
    # the initial state on the host: from the evaluation's model where that is on the host too (the same values)
    on_host = next(recorder.model.parameters()).device.type == "cpu"
    initial = protocol.initial_state(recorder.model if on_host else protocol.build_model())
    strategy = FedLoRAStrategy(protocol, initial, plan.new_ledger(config),
                               sampling_of(config), plan.phase_releases, save=lambda: recorder.save(strategy.checkpoint()),
                               simulated=simulated, progress=recorder.progress,
                               nodes=int(context.run_config.get(NODES_KEY, 0)) or None,
                               before_release=recorder.raise_if_failed)
    # what this launch did before its first round (the nodes' query is added by the strategy), in that round's row
    built = time.time()
    workers_ready(grid, list(warming), config.reply_timeout)
    strategy.startup = {"process": began - psutil.Process().create_time(), "imports": imported - began,
                        "noise calibration": calibrated - imported, "model": built - calibrated,
                        **({"workers": time.time() - built} if warming else {})}
    if saved:
        strategy.restore(saved)
        if len(recorder.rows) < strategy.rounds_done:  # the run stopped between a round and its metrics
            recorder.record(strategy.rounds_done, strategy.state, strategy.rounds.get(strategy.rounds_done, {}),
                            strategy.ledger)
            strategy.save()

    def evaluate_fn(server_round: int, _arrays) -> None:
        # evaluated while the next round trains (the server would idle through it): its row follows, in order; the
        # last round's, which nothing overlaps, here, on this thread's torch threads
        recorder.record(server_round, strategy.state, strategy.rounds.get(server_round, {}), strategy.ledger,
                        background=server_round < config.num_rounds)

    try:
        strategy.start(grid, to_arrays(strategy.state.broadcast), num_rounds=config.num_rounds,
                       timeout=config.reply_timeout, evaluate_fn=evaluate_fn)
        recorder.finish(strategy.state, status=strategy.status, reason=strategy.reason)  # after the last row
        strategy.save()  # the final status last: an ended run has its adapter
    finally:
        recorder.close()
    return strategy


def warm_up(grid: Grid, context: Context) -> list[str]:
    """In a simulation whose nodes each train several clients a message (one node per Ray worker), asks every node
    to load its model and data now (fedlora.clients.app answers the query), while the server loads its own; returns
    the queries' message ids, whose replies the first round waits for (``workers_ready``)."""
    config = context.run_config
    nodes = int(config.get(NODES_KEY, 0))
    if not config.get(SIMULATION_KEY, False) or not 0 < nodes < int(config["num-clients"]):
        return []
    deadline = time.monotonic() + 60  # the engine registers its nodes as the ServerApp starts
    while len(node_ids := sorted(grid.get_node_ids())) < nodes and time.monotonic() < deadline:
        time.sleep(0.1)
    return [i for i in grid.push_messages([Message(RecordDict({"config": ConfigRecord({WARM_UP: True})}),
                                                   message_type=MessageType.QUERY, dst_node_id=node)
                                           for node in node_ids[:nodes]]) if i]


def workers_ready(grid: Grid, queries: list[str], timeout: float) -> None:
    """Waits until every node answered its warm-up query, so that round 1 starts with workers that have loaded their
    model and data, or until ``timeout`` (a round's reply-timeout). A node that failed to warm up is logged and the
    run goes on: round 1 meets the same failure and handles it as a round does (a lost Ray worker restarts the
    simulation, a client's error is a failed reply)."""
    waiting, end = set(queries), time.monotonic() + timeout
    while waiting and time.monotonic() < end:
        for reply in grid.pull_messages(list(waiting)):
            waiting.discard(reply.metadata.reply_to_message_id)
            if reply.has_error():
                log(WARNING, "A simulation worker could not warm up: %s", error_line(reply.error))
        if waiting:
            time.sleep(getattr(grid, "pull_interval", 0.1))
    if waiting:
        log(WARNING, "%s simulation workers did not warm up within %.0f s; round 1 starts", len(waiting), timeout)


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_federation(grid, context, warming=warm_up(grid, context))
