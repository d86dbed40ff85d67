"""One Flower strategy (Message API) for all seven algorithms: the protocol in ``fedlora.federation``
decides FFA vs Flex aggregation and the mechanism; this class samples, talks to the grid and accounts.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from logging import INFO, WARNING

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from fedlora.federation import GlobalState, Protocol, derive_seed, num_bytes
from fedlora.privacy import PrivacyLedger, SamplingScheme


def to_arrays(message: dict[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord({name: t.detach().cpu().contiguous() for name, t in message.items()})


def from_arrays(record: ArrayRecord) -> dict[str, torch.Tensor]:
    return dict(record.to_torch_state_dict())


NODE_WAIT_SECONDS = 300.0  # how long the first round waits for every SuperNode to connect


class FedLoRAStrategy(Strategy):
    """Samples N of C clients (or Poisson), sends them the global adapters, aggregates their releases.

    Every round in which clients are sampled is recorded in the privacy ledger, whether or not their
    replies arrive: a sampled client counts as a release.
    """

    def __init__(self, protocol: Protocol, state: GlobalState, ledger: PrivacyLedger | None,
                 sampling: SamplingScheme, releases: dict):
        self.protocol = protocol
        self.state = state
        self.ledger = ledger
        self.sampling = sampling
        self.releases = releases  # phase -> what one round releases, for the ledger
        self.nodes: dict[int, int] | None = None  # partition id -> node id, learned once
        self.secret_fingerprint: int | None = None  # of the nodes' shared sketch secret (sketch-secret = node-file)
        self.rounds: dict[int, dict] = {}  # what each round did, for the run's metrics

    def summary(self) -> None:
        c = self.protocol.config
        log(INFO, "\t├── %s: %s", c.strategy, self.protocol.mechanism.describe())
        log(INFO, "\t└── %s sampling of %s clients, q = %.4g", self.sampling.kind.value, c.num_clients,
            self.sampling.q)

    def _partition_nodes(self, grid: Grid, node_ids: list[int]) -> dict[int, int]:
        """Asks every node once which partition it holds. Node ids are random per run; sampling partitions
        (not node positions) makes a seed fix the run, in simulation and across restarts."""
        if self.nodes is None:
            ask = [Message(content=RecordDict(), message_type=MessageType.QUERY, dst_node_id=n) for n in node_ids]
            replies = [r for r in grid.send_and_receive(ask) if r.has_content()]
            self.nodes = {int(r.content["metrics"]["partition-id"]): r.metadata.src_node_id for r in replies}
            if sorted(self.nodes) != list(range(self.sampling.num_clients)):
                raise RuntimeError(f"Clients must hold partitions 0..{self.sampling.num_clients - 1} once each; "
                                   f"they reported {sorted(self.nodes)[:10]}...")
            if self.protocol.config.sketch_secret == "node-file":
                self.secret_fingerprint = self._shared_fingerprint(replies)
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
        """The federation's node ids once num-clients SuperNodes are connected (deployed ones connect over
        time), or as they are after NODE_WAIT_SECONDS."""
        deadline, told = time.time() + NODE_WAIT_SECONDS, -1
        while True:
            node_ids = sorted(grid.get_node_ids())
            if len(node_ids) >= self.sampling.num_clients or time.time() > deadline:
                return node_ids
            if len(node_ids) != told:
                log(INFO, "Waiting for SuperNodes: %s of %s connected", len(node_ids), self.sampling.num_clients)
                told = len(node_ids)
            time.sleep(1.0)

    def _sample(self, server_round: int, nodes: dict[int, int]) -> list[int]:
        """Node ids of the round's clients: a seeded draw of partitions."""
        rng = np.random.default_rng(derive_seed(self.protocol.config.seed, "sampling", server_round))
        c = self.sampling.num_clients
        if self.sampling.kind.value == "fixed":
            chosen = sorted(rng.choice(c, self.sampling.clients_per_round, replace=False).tolist())
        else:
            chosen = [p for p, u in enumerate(rng.random(c)) if u < self.sampling.rate]
        return [nodes[p] for p in chosen]

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        node_ids = self._wait_for_nodes(grid)
        if len(node_ids) != self.sampling.num_clients:  # the accountant's C must be the federation's
            raise RuntimeError(f"The federation has {len(node_ids)} SuperNodes but num-clients is "
                               f"{self.sampling.num_clients}; make them equal (e.g. --federation-config "
                               f"\"num-supernodes={self.sampling.num_clients}\").")
        sampled = self._sample(server_round, self._partition_nodes(grid, node_ids))
        phase = self.protocol.phase(server_round)
        if self.ledger is not None:
            if not self.ledger.phases or self.ledger.phases[-1].name != phase:
                self.ledger.begin_phase(phase, self.releases[phase], self.sampling)
            self.ledger.record_round()
        c = self.protocol
        round_config = ConfigRecord({
            **dict(config), "server-round": server_round, "produced-by": self.state.produced_by,
            "noise-multiplier": float(c.noise_multiplier),
            "probe-noise-multiplier": float(c.probe_noise_multiplier),
            # known-sketch: the round's sketch seed is public; secret-sketch: clients derive it themselves
            "sketch-seed": int(c.sketch_seed) if c.config.threat_model == "known-sketch" else -1,
        })
        self.rounds[server_round] = {"started": time.time(), "sampled": len(sampled),
                                     "bytes_down": num_bytes(self.state.message)}
        log(INFO, "configure_train: sampled %s of %s clients", len(sampled), len(node_ids))
        content = RecordDict({"arrays": to_arrays(self.state.message), "config": round_config})
        return [Message(content=content, message_type=MessageType.TRAIN, dst_node_id=n) for n in sampled]

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        good = [r for r in replies if r.has_content()]
        for r in replies:
            if r.has_error():
                log(WARNING, "A client failed in round %s: %s", server_round, r.error.reason)
        # a fixed order (by partition) makes runs reproducible bit for bit
        good.sort(key=lambda r: int(r.content["metrics"]["partition-id"]))
        info = self.rounds.setdefault(server_round, {"started": time.time(), "sampled": len(replies), "bytes_down": 0})
        info.update(replies=len(good), bytes_up=0, train_loss=float("nan"))
        if not good:
            log(WARNING, "Round %s: no client replied; the global adapters stay as they were.", server_round)
            return None, None
        releases = [from_arrays(r.content["arrays"]) for r in good]
        started = time.time()
        self.state = self.protocol.aggregate(releases, server_round, self.state)
        info.update(aggregation_seconds=time.time() - started,
                    bytes_up=sum(num_bytes(m) for m in releases) / len(releases),
                    **{key.replace("-", "_"): float(np.mean([float(r.content["metrics"][key]) for r in good]))
                       for key in ("train-loss", "train-seconds", "privatize-seconds", "startup-seconds")})
        metrics = MetricRecord({"train-loss": info["train_loss"], "replies": len(good)})
        return to_arrays(self.state.message), metrics

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return []  # the global model is evaluated on the server (see the ServerApp's evaluate_fn)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None
