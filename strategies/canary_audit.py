"""The federation-level privacy audit: a real run of the fedlora ServerApp and ClientApp, in process, in which
the last ``canaries`` partitions are canary clients, each included with probability 1/2 (Andrew et al. 2024;
Steinke, Nasr and Jagielski 2023). The math is in fedlora.audit."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import numpy as np
import torch
from flwr.app import Context, RecordDict
from flwr.common.logger import LOGGER_NAME as FLOWER_LOGGER

from fedlora.clients.app import app as client_app
from fedlora.clients.rounds import canary_train, global_state
from fedlora.audit import (CONFIDENCE, AuditResult, canary_epsilon, canary_scores, canary_signature, model_view,
                           one_run_lower_bound, summarize)
from fedlora.config import RunConfig
from fedlora.run_keys import OUT_DIR_KEY, SIMULATION_KEY
from fedlora.round_plan import ASSIGNED, GlobalState, RoundPlan, derive_seed
from fedlora.strategies.inprocess_grid import InProcessGrid
from fedlora.strategies.server_app import run_federation

MIN_CANARIES = 100
NULL_CANARIES = 1000  # directions never inserted beyond one per canary: the null scores (free: nobody sends them)


class CanaryGrid(InProcessGrid):
    """Partitions in ``canaries`` answer with their canary message (zero for an excluded canary); every state the
    server broadcasts is recorded."""

    def __init__(self, run_config: dict, canaries: dict[int, dict]):
        super().__init__(self._client, int(run_config["num-clients"]), run_config)
        self.canaries = canaries
        self.broadcasts: dict[int, GlobalState] = {}  # round -> the global state its clients start from

    def _client(self, message, context):
        if message.metadata.message_type == "train":
            if "arrays" in message.content.array_records:  # the training message (under SecAgg+, its third stage)
                self.broadcasts[int(message.content["config"]["server-round"])] = global_state(message)
            config = message.content.config_records.get("config", {})
            partition = int(config[ASSIGNED]) if ASSIGNED in config else context.node_config["partition-id"]
            if partition in self.canaries:
                return canary_train(message, context, self.canaries[partition])
        return client_app(message, context)


def _unit_direction(shapes: dict[str, tuple[int, ...]], generator: torch.Generator) -> dict[str, torch.Tensor]:
    parts = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    norm = math.sqrt(sum(float(t.pow(2).sum()) for t in parts.values()))
    return {name: t / norm for name, t in parts.items()}


def check_canary_audit(config: RunConfig, canaries: int) -> None:
    """Every reason the canary audit cannot run, before anything starts (one sentence each)."""
    problems = []
    if not MIN_CANARIES <= canaries < config.num_clients:
        problems.append(f"Canaries must number at least {MIN_CANARIES} (fewer leave the audit to chance) and "
                        f"fewer than num-clients ({config.num_clients}), got {canaries}.")
    if config.head == "probe":
        problems.append('The canary audit needs one message shape for every round: use head = "message" or '
                        '"frozen", not "probe".')
    if config.client_ranks:
        problems.append("The canary audit needs one rank for every client: leave client-ranks empty.")
    if config.sampling != "fixed":  # an excluded canary sends zero: a replaced message, not an absent client
        problems.append('The canary audit compares with the replace-one accountant of fixed sampling: use sampling = '
                        '"fixed".')
    if config.simulation_nodes:
        problems.append("The canary audit gives each canary a node of its own: leave simulation-nodes at 0.")
    if problems:
        raise ValueError("\n".join(problems))


def audit_federation(config: RunConfig, canaries: int, out_dir: Path, *, echo=print) -> AuditResult:
    """Runs the configured federation with the last ``canaries`` partitions as canaries; scores them."""
    check_canary_audit(config, canaries)
    started = time.perf_counter()
    shapes_of = RoundPlan(config, 0.0)
    template = shapes_of.initial_state(shapes_of.build_model()).message
    shapes = shapes_of.expected_message(template, config.num_rounds, config.rank)
    generator = torch.Generator().manual_seed(derive_seed(config.seed, "canaries"))
    directions = [_unit_direction(shapes, generator) for _ in range(canaries)]
    null = [_unit_direction(shapes, generator) for _ in range(canaries + NULL_CANARIES)]
    # the coins: fixed before the run, and nothing that scores the canaries reads them
    included = np.random.default_rng(derive_seed(config.seed, "canary-coins")).random(canaries) < 0.5
    sent = {config.num_clients - canaries + i: d if coin else {n: torch.zeros_like(t) for n, t in d.items()}
            for i, (d, coin) in enumerate(zip(directions, included))}
    run_config = {**config.to_mapping(), OUT_DIR_KEY: str(out_dir), SIMULATION_KEY: True}
    grid = CanaryGrid(run_config, sent)
    flower = logging.getLogger(FLOWER_LOGGER)
    level, _ = flower.level, flower.setLevel(logging.WARNING)  # the progress lines are ours; keep Flower's warnings
    try:
        strategy = run_federation(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                                run_config=run_config), echo=echo)
    finally:
        flower.setLevel(level)
    protocol = strategy.protocol
    states = [grid.broadcasts[r] for r in sorted(grid.broadcasts)] + [strategy.state]
    views = np.stack([model_view(protocol, s, template, list(shapes)) for s in states])
    scores = canary_scores(views, np.stack([canary_signature(protocol, d) for d in directions]))
    scores_null = canary_scores(views, np.stack([canary_signature(protocol, d) for d in null]))
    scores_in, inserted = scores[included], int(included.sum())
    accountant = strategy.ledger.report().epsilon if strategy.ledger is not None else math.inf
    return summarize(f"{config.strategy} run, {canaries} canaries ({inserted} included) of {config.num_clients} "
                     f"clients, {len(states) - 1} rounds", "federation", scores_in, scores_null,
                     threat_model=(strategy.ledger.trust_model if strategy.ledger is not None
                                   else protocol.mechanism.trust_model),
                     attack="largest cosine of a canary with a round's model update",
                     empirical_epsilon=one_run_lower_bound(scores, included, delta=config.delta),
                     empirical_kind=f"lower bound at {CONFIDENCE:.0%} confidence, one run (Steinke, Nasr and "
                     "Jagielski 2023)", accountant=accountant, delta=config.delta,
                     noise_multiplier=protocol.noise_multiplier,
                     estimate=canary_epsilon(scores_in, scores_null, config.delta),
                     null_epsilon=canary_epsilon(scores_null[:inserted], scores_null[inserted:], config.delta),
                     seconds=time.perf_counter() - started)
