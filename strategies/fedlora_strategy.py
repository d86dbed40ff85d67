"""One Flower strategy (Message API) for all seven algorithms: the server's side of the round in ``fedlora.server_round``
decides FFA vs Flex aggregation and the mechanism; this class samples, talks to the grid, checks the
replies, retries short rounds, accounts, and stops before the privacy budget would break.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from logging import INFO, WARNING

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore import log

from fedlora.checkpoint import BUDGET_SPENT, FINISHED, RESTART, RUNNING, STALLED, Checkpoint
from fedlora.mechanisms import NoisePlacement
from fedlora.round_plan import ASSIGNED, LORA, PACKED, GlobalState, num_bytes, packed_key
from fedlora.server_round import ServerSide
from fedlora.privacy import PrivacyLedger, SamplingScheme
from fedlora.privacy.node_budget import REFUSED
from fedlora.strategies.replies import error_line, gather
from fedlora.strategies.secure_aggregation import secure_sum


def to_arrays(message: dict[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord({name: t.detach().cpu().contiguous() for name, t in message.items()})


def _mean_telemetry(metrics: list) -> dict[str, float]:
    """The round's mean client telemetry (train loss only where a non-private client reports it); NaN if none."""
    return {key.replace("-", "_"): float(np.mean([float(m.get(key, np.nan)) for m in metrics])) if metrics else np.nan
            for key in ("train-loss", "train-seconds", "privatize-seconds", "startup-seconds")}


# what a round's info holds that its metrics row reads (fedlora.experiment.RunRecorder._accounted)
ROUND_TELEMETRY = ("release", "sampled", "replies", "failed", "rejected", "nodes", "bytes_up", "bytes_down",
                   "aggregation_seconds", "train_seconds", "privatize_seconds", "startup_seconds", "train_loss",
                   "clip_norm", "clip_fraction", "startup", "first_failure")
NODE_WAIT_SECONDS = 300.0  # how long the first round waits for every SuperNode to connect
PARTITION_QUERY_TRIES = 3  # asks to the nodes that have not told their partition before the run gives up


class FedLoRAStrategy(Strategy):
    """Samples N of C clients (or Poisson), sends them the global adapters, aggregates their valid releases.

    Every release (a round's sampling of clients, retries included) is recorded in the privacy ledger
    before the messages leave, whether or not replies arrive: a sampled client counts as a release.
    ``save`` is called whenever the progress changes, so that a checkpoint can be written.
    """

    def __init__(self, protocol: ServerSide, state: GlobalState, ledger: PrivacyLedger | None,
                 sampling: SamplingScheme, phase_releases: dict, *, save: Callable[[], None] = lambda: None,
                 simulated: bool = False, progress: Callable[[int, int, int], None] = lambda round_, arrived, sent: None,
                 nodes: int | None = None, before_release: Callable[[], None] = lambda: None):
        self.protocol = protocol
        self.config = protocol.config
        self.state = state
        self.template = state.message  # the dense initial state: names, full-rank shapes and dtypes
        self.ledger = ledger
        self.sampling = sampling
        self.phase_releases = phase_releases  # phase -> what one release of that phase is, for the ledger
        self.save = save
        self.progress = progress  # (round, clients' replies arrived, clients sent) while a round's replies come in
        self.before_release = before_release  # raises if the run must stop before its next release (a failed evaluation)
        self.simulated = simulated  # under the simulation engine a lost worker means a restart (see launch.py)
        # several clients per message, dealt over the nodes the launcher started (else a node per client)
        self.num_nodes = nodes or self.config.flower_nodes()
        self.packed = self.num_nodes != self.sampling.num_clients
        self.nodes: dict[int, int] | None = None  # the nodes' partition-id -> node id, learned once
        # Under the simulation engine every node can train any partition: the server names it in the message instead
        # of asking each node first which one it holds (500 nodes: 16 s before round 1). Not under SecAgg+ (its
        # stages keep Flower's own messages) nor with the sketch secret on the nodes (the query checks they share it).
        self.assigns = (simulated and protocol.placement is not NoisePlacement.SECAGG
                        and self.config.sketch_secret != "node-file")
        self.secret_fingerprint: int | None = None  # of the nodes' shared sketch secret (sketch-secret = node-file)
        self.rounds: dict[int, dict] = {}  # what each round did, for the run's metrics
        self.startup: dict[str, float] = {}  # seconds this launch spent before its first round, by part
        # progress (what a checkpoint holds)
        self.rounds_done = 0
        self.releases = 0
        self.in_flight = False
        self.replay = False  # resumed with seeded noise: the interrupted release is sent again, bit for bit
        self.status, self.reason = RUNNING, ""
        self.clip_norm = self.config.clip_norm  # moves each round under adaptive clipping
        self.optimizer = protocol.new_optimizer()  # message = update: applies the mean update

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoint(self) -> Checkpoint:
        return Checkpoint(self.state, self.rounds_done, self.releases, self.in_flight,
                          self.ledger.to_dict() if self.ledger is not None else None,
                          status=self.status, reason=self.reason, simulated=self.simulated,
                          secret_fingerprint=self.secret_fingerprint, clip_norm=self.clip_norm,
                          optimizer=dict(self.optimizer.state) if self.optimizer is not None else {},
                          round_info=self._telemetry(self.rounds.get(self.rounds_done, {})))

    @staticmethod
    def _telemetry(info: dict) -> dict:
        """What a round's metrics row reads of its info (not the partitions and nodes it was dealt), as JSON; its
        seconds are the round's own, since a row recorded by the next launch cannot time it."""
        kept = {k: v for k, v in info.items() if k in ROUND_TELEMETRY}
        if "round_seconds" in info:
            kept["seconds"] = info["round_seconds"]
        return json.loads(json.dumps(kept, default=float))

    def restore(self, saved: Checkpoint) -> None:
        """Continues from ``saved``.

        A release cut short is replayed under seeded noise: the noise is a function of the run seed, which
        the server knows, so seeded runs simulate the mechanism rather than protect anyone, and the replay
        simulates the same release as the uninterrupted run. With OS noise (real protection) the release
        cannot be replayed, so it stays counted and the round gets a new one.
        """
        if self.ledger is not None and saved.ledger is None:
            raise RuntimeError("The checkpoint holds no privacy ledger for this private run: it cannot be resumed.")
        self.state, self.rounds_done, self.releases = saved.state, saved.rounds_done, saved.releases
        if saved.round_info:
            self.rounds[saved.rounds_done] = dict(saved.round_info)
        self.ledger = PrivacyLedger.from_dict(saved.ledger) if saved.ledger is not None else None
        self.secret_fingerprint = saved.secret_fingerprint
        self.clip_norm = saved.clip_norm if saved.clip_norm is not None else self.config.clip_norm
        if self.optimizer is not None:
            self.optimizer.state = dict(saved.optimizer)
        self.replay = saved.in_flight and self.config.noise_source == "seeded"
        self.in_flight = saved.in_flight and not self.replay
        if saved.in_flight and not self.replay:
            log(WARNING, "Release %s was cut short and its OS noise cannot be replayed: it stays counted.",
                saved.releases)

    def summary(self) -> None:
        c = self.config
        log(INFO, "\t├── %s: %s", c.strategy, self.protocol.describe())
        if self.sampling.kind.value == "fixed":
            log(INFO, "\t├── fixed sampling: %s of %s clients a round (q = %.4g)", c.clients_per_round,
                c.num_clients, self.sampling.q)
        else:
            log(INFO, "\t├── Poisson sampling of %s clients, each with probability q = %.4g", c.num_clients,
                self.sampling.q)
        log(INFO, "\t└── a round needs %s valid replies, else it is retried (at most %s times)",
            c.required_replies(), c.round_retries)

    # -- the loop --------------------------------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Flower's round loop, from the first round not done yet, with retries, the budget stop and the
        run's status (Flower's own loop always starts at round 1 and knows neither)."""
        log(INFO, "Starting %s strategy:", self.__class__.__name__)
        self.summary()
        result = Result(arrays=initial_arrays)
        if self.rounds_done:
            log(INFO, "Resuming after round %s (%s releases so far)", self.rounds_done, self.releases)
        for server_round in range(self.rounds_done + 1, num_rounds + 1):
            log(INFO, "")
            log(INFO, "[ROUND %s/%s]", server_round, num_rounds)
            arrays = self._round(grid, server_round, timeout, train_config or ConfigRecord())
            if arrays is None:
                break
            result.arrays = arrays
            self.rounds_done = server_round
            info = self.rounds.setdefault(server_round, {})
            info["round_seconds"] = time.time() - info.get("started", time.time())  # for a recovered row
            self.save()  # the round is done: evaluating it must not be able to lose it
            if evaluate_fn:  # records the round's metrics (the next save has them, or their accounting)
                metrics = evaluate_fn(server_round, arrays)
                if metrics is not None:
                    result.evaluate_metrics_serverapp[server_round] = metrics
            if self.status == RESTART:
                break
        if self.status == RUNNING:
            self.status = FINISHED  # saved by the ServerApp once the adapter is written
        log(INFO, "Strategy stopped: %s%s", self.status, f" ({self.reason})" if self.reason else "")
        return result

    def _round(self, grid: Grid, server_round: int, timeout: float, config: ConfigRecord) -> ArrayRecord | None:
        """One round, retried with a new release while fewer valid replies than required arrive; None if the
        run must stop instead (budget, no progress, or a lost simulation worker)."""
        for attempt in range(self.config.round_retries + 1):
            if self.ledger is not None and not self.replay and self.ledger.would_exceed_budget(*self._release(server_round)):
                after = self.ledger.report_after(*self._release(server_round)).epsilon
                past = (f"round {server_round} would bring epsilon to {after:.3f} ({self.ledger.trust_model}), past "
                        f"the budget {self.ledger.target_epsilon:g}")
                if attempt and not self.rounds[server_round]["replies"]:  # no client got through, and the budget
                    # leaves no retry: what the clients said is the news, and the run failed (its rounds stay)
                    self._stop(STALLED, f"{self._shortfall(server_round)}, and a retry of {past}")
                else:  # a short round at the budget's end ends the run as the budget does
                    self._stop(BUDGET_SPENT, past + (f" (after {self._shortfall(server_round)})" if attempt else ""))
                return None
            messages = list(self.configure_train(server_round, ArrayRecord(), config, grid))
            if self.protocol.placement is NoisePlacement.SECAGG:
                arrays = self._secure_round(grid, server_round, messages, timeout)
            else:
                assigned = self.rounds[server_round]["assigned"]
                arrays, _ = self.aggregate_train(server_round, gather(
                    grid, messages, timeout=timeout, progress=lambda *counts: self.progress(server_round, *counts),
                    clients=lambda node: len(assigned[node])))
            if arrays is not None:
                return arrays
            if self.status == RESTART:
                return None
            log(WARNING, "%s%s", self._shortfall(server_round),
                "; retrying with new clients" if attempt < self.config.round_retries else "")
        tries = self.config.round_retries + 1
        shortfall = f"{self._shortfall(server_round)}, in " + (f"each of {tries} tries" if tries > 1 else "its one try")
        info = self.rounds[server_round]
        if info["failed"] and info.get("refused") == info["failed"] and info["replies"] + info["failed"] == \
                info["sampled"]:  # a resume would meet the same refusals: the nodes' budgets end the run
            self._stop(BUDGET_SPENT, f"the nodes' own privacy budgets are spent: {shortfall}")
        else:
            self._stop(STALLED, shortfall)
        return None

    def _shortfall(self, server_round: int) -> str:
        """What a round that got too few valid replies got, and the first failure's reason."""
        info = self.rounds[server_round]
        silent = info["sampled"] - info["replies"] - info["failed"] - info["rejected"]
        first = f" (the first: {info['first_failure']})" if info.get("first_failure") else ""
        return (f"round {server_round} got {info['replies']} valid replies of {info['sampled']} sampled, "
                f"{info['needed']} needed; {info['failed']} failed, {info['rejected']} were rejected"
                + (f", {silent} did not reply within reply-timeout" if silent > 0 else "") + first
                + (f"; SecAgg+ released nothing: {info['secagg']}" if info.get("secagg") else ""))

    def _stop(self, status: str, reason: str) -> None:
        self.status, self.reason = status, reason
        log(WARNING, "Stopping: %s.", reason)

    # -- nodes and sampling ----------------------------------------------------------------------
    def _partition_nodes(self, grid: Grid, node_ids: list[int]) -> dict[int, int]:
        """Asks every node once which partition it holds. Node ids are random per run; sampling partitions
        (not node positions) makes a seed fix the run, in simulation and across restarts."""
        if self.nodes is None:
            replies, unanswered, errors = [], list(node_ids), []
            for attempt in range(PARTITION_QUERY_TRIES):  # a loaded node may answer one query with an error
                if attempt:
                    time.sleep(attempt)
                ask = [Message(content=RecordDict(), message_type=MessageType.QUERY, dst_node_id=n) for n in unanswered]
                answers = list(grid.send_and_receive(ask))
                replies += [r for r in answers if r.has_content()]
                errors = [r.error.reason for r in answers if r.has_error()]
                answered = {r.metadata.src_node_id for r in replies}
                unanswered = [n for n in unanswered if n not in answered]
                if not unanswered:
                    break
            self.nodes = {int(r.content["metrics"]["partition-id"]): r.metadata.src_node_id for r in replies}
            if problems := sorted((int(r.content["metrics"]["partition-id"]), r.content["node"]["data-problem"])
                                  for r in replies if "node" in r.content.config_records
                                  and r.content["node"].get("data-problem")):
                raise RuntimeError(f"The node of partition {problems[0][0]} cannot train on its own data: "
                                   f"{problems[0][1]}" + (f" ({len(problems) - 1} other node(s) cannot either)"
                                                          if len(problems) > 1 else ""))
            if sorted(self.nodes) != list(range(self.num_nodes)):
                raise RuntimeError(f"Nodes must hold partition ids 0..{self.num_nodes - 1} once each; they reported "
                                   f"{sorted(self.nodes)[:10]}, {len(unanswered)} did not answer in "
                                   f"{PARTITION_QUERY_TRIES} tries{f' ({errors[0]})' if errors else ''}.")
            if self.config.sketch_secret == "node-file":
                fingerprint = self._shared_fingerprint(replies)
                if self.secret_fingerprint is not None and fingerprint != self.secret_fingerprint:
                    raise RuntimeError("The SuperNodes hold another sketch secret than the run they resume.")
                self.secret_fingerprint = fingerprint
        return self.nodes

    @staticmethod
    def _shared_fingerprint(replies: list[Message]) -> int:
        """The fingerprint of the sketch secret every node holds; an error if one has none or they differ (a
        client de-sketching with another R would corrupt the aggregate without a sound)."""
        prints = {int(r.content["metrics"]["partition-id"]): int(r.content["metrics"]["secret-fingerprint"])
                  for r in replies}
        missing = sorted(p for p, f in prints.items() if f < 0)
        if missing:
            raise RuntimeError(f"The SuperNodes of partitions {missing} have no sketch-secret-file in their "
                               "node config.")
        if len(set(prints.values())) > 1:
            raise RuntimeError("The SuperNodes hold different sketch secrets: give every device the same "
                               "sketch-secret file.")
        return next(iter(prints.values()))

    def _wait_for_nodes(self, grid: Grid) -> list[int]:
        """The federation's node ids once all its SuperNodes are connected (deployed ones connect over time), or
        as they are after NODE_WAIT_SECONDS."""
        deadline, told = time.time() + NODE_WAIT_SECONDS, -1
        while True:
            node_ids = sorted(grid.get_node_ids())
            if len(node_ids) >= self.num_nodes or time.time() > deadline:
                return node_ids
            if len(node_ids) != told:
                log(INFO, "Waiting for SuperNodes: %s of %s connected", len(node_ids), self.num_nodes)
                told = len(node_ids)
            time.sleep(1.0)

    # -- Flower's strategy interface -------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Samples the round's clients, records the release in the ledger and checkpoints it, then returns
        the messages (the global adapters and the round's public parameters)."""
        self.before_release()  # before anything is counted: a run that must stop spends nothing more
        startup = None
        if self.nodes is None:
            asked = time.time()
            node_ids = self._wait_for_nodes(grid)
            if len(node_ids) != self.num_nodes:  # the accountant's C must be the federation's
                wanted = f"simulation-nodes is {self.num_nodes}" if self.packed else f"num-clients is {self.num_nodes}"
                raise RuntimeError(f"The federation has {len(node_ids)} SuperNodes but {wanted}; make them equal "
                                   f"(e.g. --federation-config \"num-supernodes={self.num_nodes}\").")
            if self.assigns:
                self.nodes = dict(enumerate(sorted(node_ids)))
            else:
                self._partition_nodes(grid, node_ids)
            startup = {**self.startup, "nodes": time.time() - asked}
        if not self.replay:
            self.releases += 1
            if self.ledger is not None:
                self.ledger.record(*self._release(server_round))
        self.replay, self.in_flight = False, True
        self.save()  # before anything leaves: a crash from here on must not forget this release
        release = self.releases
        # independent of which nodes happen to be online (the accountant assumes exactly this sampling; a sampled
        # node that is gone is a lost reply)
        partitions = self.sampling.draw(self.protocol.sampling_generator(release))
        c = self.protocol
        round_config = ConfigRecord({
            **dict(config), "server-round": server_round, "release": release, "produced-by": self.state.produced_by,
            "noise-multiplier": float(c.noise_multiplier),
            "probe-noise-multiplier": float(c.probe_noise_multiplier),
            "clip-norm": float(self.clip_norm),
            # known-sketch: the release's sketch seed is public; secret-sketch: clients derive it themselves
            "sketch-seed": int(c.sketch_seed) if self.config.threat_model == "known-sketch" else -1,
        })
        if self.packed:  # the partitions dealt over the nodes in turn: equal work, since every client takes K steps
            assigned = {self.nodes[i]: partitions[i::self.num_nodes] for i in range(self.num_nodes)
                        if partitions[i::self.num_nodes]}
        else:
            assigned = {self.nodes[p]: [p] for p in partitions}
        self.rounds[server_round] = {"started": self.rounds.get(server_round, {}).get("started", time.time()),
                                     "release": release, "partitions": partitions, "sampled": len(partitions),
                                     "assigned": assigned, "needed": min(self.config.required_replies(), len(partitions)),
                                     "bytes_down": num_bytes(self.state.broadcast),
                                     "startup": startup or self.rounds.get(server_round, {}).get("startup")}
        log(INFO, "configure_train: release %s, sampled %s of %s clients", release, len(partitions),
            self.sampling.num_clients)
        arrays = to_arrays(self.state.broadcast)
        return [Message(content=RecordDict({"arrays": arrays, "config": ConfigRecord(
                            {**round_config, PACKED: clients}) if self.packed else ConfigRecord(
                            {**round_config, ASSIGNED: clients[0]}) if self.assigns else round_config}),
                        message_type=MessageType.TRAIN, dst_node_id=node) for node, clients in assigned.items()]

    def _release(self, server_round: int) -> tuple:
        """(phase, release, sampling) of one release in ``server_round``, as the ledger takes them."""
        phase = self.protocol.phase(server_round)
        return phase, self.phase_releases[phase], self.sampling

    @staticmethod
    def _client_replies(replies: list[Message], assigned: dict[int, list[int]],
                        packed: bool) -> list[tuple[int | None, RecordDict | None, Error | None]]:
        """(partition, records, error) of every client the replies speak for: a reply's node's clients this round
        (None for a node that was not sent any), each with its own records, or its node's error."""
        out = []
        for reply in replies:
            for partition in assigned.get(reply.metadata.src_node_id, [None]):
                if reply.has_error():
                    out.append((partition, None, reply.error))
                elif not packed:
                    out.append((partition, reply.content, None))
                else:
                    out.append((partition, RecordDict({key: reply.content[packed_key(key, partition)]
                                                       for key in ("arrays", "metrics", "clip-bit")
                                                       if packed_key(key, partition) in reply.content}), None))
        return out

    def _valid(self, partition: int | None, records: RecordDict | None, error: Error | None, server_round: int,
               pending: set[int]) -> tuple[int, dict, float | None, MetricRecord] | None:
        """(partition, release, clip bit, metrics) of a client's reply that may be aggregated; None (and a warning)
        for a failed or invalid one, which is never aggregated."""
        if error is not None:
            if self.simulated and error.code == ErrorCode.UNKNOWN:  # the engine lost the client's worker
                self.status, self.reason = RESTART, "a simulation worker died"
            who = f"the client of partition {partition}" if partition is not None else "a sampled client"
            why = error_line(error)
            log(WARNING, "Round %s: %s failed: %s", server_round, who, why)
            self.rounds[server_round].setdefault("first_failure", f"{who} failed: {why}")
            return None
        problem = None
        if partition not in pending:
            problem = "its node was not sampled, or replied already"
        elif "arrays" not in records.array_records:
            problem = "it carries no arrays"
        else:
            release = dict(records["arrays"].to_torch_state_dict())
            bits = records.array_records.get("clip-bit")
            bit = bits.to_torch_state_dict().get("bit") if bits is not None else None
            problem = self.protocol.release_problem(
                release, self.template, round_=server_round, rank=self.protocol.client_rank(partition),
                clip_norm=self.clip_norm, clip_bit=bit)
        if problem:
            log(WARNING, "Round %s: rejected the reply of partition %s: %s.", server_round, partition, problem)
            self.rounds[server_round].setdefault("first_failure", f"the reply of partition {partition} was rejected: "
                                                                  f"{problem}")
            return None
        pending.discard(partition)  # one reply per sampled client
        metrics = records.metric_records.get("metrics", MetricRecord())
        return partition, release, float(bit) if self.protocol.clipping is not None else None, metrics

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The new global adapters from the valid replies, if at least the required number arrived."""
        info = self.rounds[server_round]
        clients = self._client_replies(list(replies), info["assigned"], self.packed)
        pending = set(info["partitions"])
        valid = sorted((v for c in clients if (v := self._valid(*c, server_round, pending)) is not None),
                       key=lambda v: v[0])  # by partition
        failed = sum(error is not None for _, _, error in clients)
        info.update(replies=len(valid), failed=failed, rejected=len(clients) - failed - len(valid), bytes_up=0,
                    refused=sum(error is not None and REFUSED in (error.reason or "") for _, _, error in clients),
                    train_loss=float("nan"))
        if len(valid) < info["needed"]:
            self.save()  # the failed release stays counted
            return None, None
        self.in_flight = False
        info["clip_norm"] = self.clip_norm
        protocol = self.protocol
        server_noise = protocol.server_noise(info["release"])
        if not valid and protocol.placement is NoisePlacement.CLIENT:  # Poisson sampled nobody: nothing is released
            return to_arrays(self.state.broadcast), MetricRecord({"replies": 0})
        # noise at the server is released even for an empty round: an absent client must change nothing visible
        releases = [release for _, release, _, _ in valid] or [self._zero_release(server_round)]
        metrics = [m for _, _, _, m in valid]
        started = time.time()
        self.state = protocol.aggregate(releases, server_round, self.state, release=info["release"],
                                        clip_norm=self.clip_norm, noise=server_noise, optimizer=self.optimizer)
        if protocol.clipping is not None and protocol.phase(server_round) == LORA:
            fraction = protocol.clipping.noisy_fraction([bit for _, _, bit, _ in valid],
                                                        protocol.denominator(len(valid)), server_noise)
            self.clip_norm = protocol.clipping.next_clip_norm(self.clip_norm, fraction)
            info["clip_fraction"] = fraction
        info.update(aggregation_seconds=time.time() - started,
                    bytes_up=sum(num_bytes(m) for m in releases) / len(releases),
                    nodes=len({int(m["ray-node"]) for m in metrics if "ray-node" in m}), **_mean_telemetry(metrics))
        del releases, valid, clients  # with noise at the server, no single message outlives the aggregation
        return to_arrays(self.state.broadcast), MetricRecord({"train-loss": info["train_loss"], "replies": info["replies"]})

    def _secure_round(self, grid: Grid, server_round: int, messages: list[Message],
                      timeout: float) -> ArrayRecord | None:
        """The round through SecAgg+: the decoded noisy sum of the clients' integer releases, aggregated like noise
        at the server's; None if too few vectors were summed (the release stays counted, the round is retried)."""
        info, protocol = self.rounds[server_round], self.protocol
        partition_of = {node: clients[0] for node, clients in info["assigned"].items()}
        mechanism = protocol.mechanism_for(server_round, self.clip_norm)
        released = mechanism.released_shapes(protocol.expected_message(self.template, server_round, self.config.rank))
        codec, shapes = protocol.secure_sum(mechanism, released), protocol.secure_shapes(released)
        result = secure_sum(grid, {m.metadata.dst_node_id: m.content for m in messages},
                            shapes={name: shapes[name] for name in sorted(shapes)}, threshold=info["needed"],
                            half_range=codec.half_range, timeout=timeout, group_id=str(info["release"]),
                            progress=lambda *counts: self.progress(server_round, *counts))
        refused = 0
        for node, why in result.failed.items():
            refused += REFUSED in ((why.reason or "") if isinstance(why, Error) else str(why))
            if isinstance(why, Error):
                if self.simulated and why.code == ErrorCode.UNKNOWN:  # the engine lost the client's worker
                    self.status, self.reason = RESTART, "a simulation worker died"
                why = error_line(why)
            log(WARNING, "Round %s: the client of partition %s left SecAgg+: %s", server_round,
                partition_of.get(node), why)
            info.setdefault("first_failure", f"the client of partition {partition_of.get(node)} left SecAgg+: {why}")
        info.update(replies=len(result.summed), failed=len(result.failed), refused=refused, rejected=0,
                    train_loss=float("nan"),
                    bytes_up=float(np.mean(list(result.bytes_up.values()))) if result.bytes_up else 0.0,
                    bytes_down=info["bytes_down"] + float(np.mean(list(result.bytes_down.values()))))
        if result.total is None:
            log(WARNING, "Round %s: SecAgg+ released nothing: %s", server_round, result.reason)
            info["secagg"] = result.reason
            self.save()  # the release stays counted
            return None
        self.in_flight = False
        started = time.time()
        self.state = protocol.aggregate([codec.decode(result.total, torch.float64)], server_round, self.state,
                                        release=info["release"], clip_norm=self.clip_norm, optimizer=self.optimizer,
                                        summed=len(result.summed))
        info.update(clip_norm=self.clip_norm, aggregation_seconds=time.time() - started,
                    **_mean_telemetry(list(result.metrics.values())))
        return to_arrays(self.state.broadcast)

    def _zero_release(self, server_round: int) -> dict[str, torch.Tensor]:
        """The release of a round without clients: zeros in the released shapes."""
        mechanism = self.protocol.mechanism_for(server_round)
        shapes = mechanism.released_shapes(self.protocol.expected_message(self.template, server_round,
                                                                          self.config.rank))
        return {n: torch.zeros(shape, dtype=self.template[n].dtype) for n, shape in shapes.items()}

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return []  # the global model is evaluated on the server (see the ServerApp's evaluate_fn)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None
