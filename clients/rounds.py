"""A client's round, away from the ClientApp's module: the model, the data, training, privatization and the reply.

fedlora.clients.app imports this module at the first message that trains, so that a process that only answers a
query or a stage of SecAgg+ (a SuperNode starts one for every message) starts without torch, PEFT and the data
libraries. The backbone and the partition are built once per worker process and reused across rounds and
partitions; per round only the adapters (and head) are loaded from the server's message.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from functools import lru_cache

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from fedlora.config import RunConfig, run_config_of
from fedlora.client_round import ClientSide, TrainedClients, overlapped
from fedlora.round_plan import ASSIGNED, PACKED, GlobalState, num_bytes, packed_key
from fedlora.lora import get_adapters
from fedlora.mechanisms import CLIP_MARGIN, Mechanism, NoisePlacement, check_carried
from fedlora.node import NodeSettings, read_sketch_seed
from fedlora.training import clients_at_once, select_device


@lru_cache(maxsize=4)
def _model(config: RunConfig, rank: int):
    """The client model of one rank, built once per process (same seeded backbone on every client)."""
    model = ClientSide(config, 0.0).build_model(rank, select_device())
    return model, get_adapters(model)


DATA_KEPT_BYTES = 1 << 30  # decoded partitions a process keeps for the rounds that sample them again
_decoded: OrderedDict[tuple, object] = OrderedDict()  # least recently used first


def _local_data(config: RunConfig, node: NodeSettings):
    """The node's training data as its task feeds the model (its own data-dir, else its partition of the run's
    dataset), put once onto this process's device; the last DATA_KEPT_BYTES of them are kept (CIFAR-100's 32 px
    partitions take 3 KiB an image; images stored at 224 px, 147 KiB; a token, 9 bytes)."""
    key = (config, node)
    if key in _decoded:
        _decoded.move_to_end(key)
        return _decoded[key]
    _decoded[key] = data = config.task.train_data(config, node, select_device())
    kept = sum(d.nbytes for d in _decoded.values())
    while kept > DATA_KEPT_BYTES and len(_decoded) > 1:
        kept -= _decoded.popitem(last=False)[1].nbytes
    return data


def own_data_problem(context: Context, node: NodeSettings) -> str:
    """Why the node's own data (data-dir) cannot be trained on, in one line ("" if it can): read as a round reads
    it, so the first round finds it decoded."""
    try:
        _local_data(run_config_of(context.run_config), node)
    except ValueError as error:
        return str(error)
    return ""


def warm_up(context: Context) -> None:
    """Everything a simulation's worker loads once, before its first round: the model of every client rank, and the
    run's data with one partition decoded (what every partition shares is read, split and cached on the way)."""
    config = run_config_of(context.run_config)
    for rank in sorted(set(config.parsed_client_ranks()) or {config.rank}):
        _model(config, rank)
    _local_data(config, NodeSettings(0, config.num_clients))


def round_setup(msg: Message, context: Context) -> tuple[RunConfig, ClientSide, NodeSettings]:
    """The run config, the round's protocol (its noise and sketch seed) and this node's settings."""
    config = run_config_of(context.run_config)
    round_config = msg.content["config"]
    noise = [float(round_config[key]) for key in ("noise-multiplier", "probe-noise-multiplier")]
    if not all(math.isfinite(z) and z >= 0 for z in noise):
        raise ValueError(f"The round's noise multipliers must be finite and non-negative, got {noise}.")
    protocol = ClientSide(config, *noise)
    node = NodeSettings.from_node_config(context.node_config)
    if node.privacy_ledger and (ASSIGNED in round_config or PACKED in round_config):
        raise ValueError("A node that keeps a privacy ledger (privacy-ledger) trains only its own client: the server "
                         "named other partitions, as only simulations do.")
    if ASSIGNED in round_config:  # a simulation's node trains the partition the server names
        if node.data_dir:
            raise ValueError("A node with its own data (data-dir) trains only itself: the server named another "
                             "partition, as it does only in simulations (simulation = true).")
        node = dataclasses.replace(node, partition_id=int(round_config[ASSIGNED]))
    if config.threat_model == "known-sketch":
        protocol.sketch_seed = int(round_config["sketch-seed"])  # public, broadcast by the server
    elif config.sketch_secret == "node-file":  # shared by the clients out of band, never seen by the server
        if not node.sketch_secret_file:
            raise ValueError("This run's sketch secret comes from the nodes: start the SuperNode with "
                             "--node-config \"... sketch-secret-file='PATH'\".")
        protocol.sketch_seed = read_sketch_seed(node.sketch_secret_file)
    return config, protocol, node


def global_state(msg: Message) -> GlobalState:
    """The global adapters the server sent, with the release whose sketches produced them."""
    return GlobalState({n: t for n, t in msg.content["arrays"].to_torch_state_dict().items()},
                       int(msg.content["config"]["produced-by"]))


def client_records(release: dict, metrics: dict, clip_bit: float | None = None) -> dict:
    """One client's release (and, under adaptive clipping, its clip bit as one float64) with its telemetry."""
    records = {"arrays": ArrayRecord({n: t.contiguous() for n, t in release.items()}),
               "metrics": MetricRecord({"bytes-up": num_bytes(release), **metrics})}
    if clip_bit is not None:
        records["clip-bit"] = ArrayRecord({"bit": torch.tensor([clip_bit], dtype=torch.float64)})
    return records


def reply(msg: Message, release: dict, metrics: dict, clip_bit: float | None = None) -> Message:
    return Message(RecordDict(client_records(release, metrics, clip_bit)), reply_to=msg)


def round_clip_norm(msg: Message) -> float | None:
    """The round's clip norm, which adaptive clipping moves (None: the config's)."""
    config = msg.content["config"]
    if "clip-norm" not in config:
        return None
    clip_norm = float(config["clip-norm"])
    check_carried(clip_norm)  # a server's number that no float rounding can turn against the sensitivity
    return clip_norm


def train_round(msg: Message, context: Context, startup_seconds: float) -> Message:
    """The reply to a round's message: this node's client, or the clients the message names (simulation-nodes)."""
    config, protocol, node = round_setup(msg, context)
    round_config, state = msg.content["config"], global_state(msg)
    if protocol.placement is NoisePlacement.SECAGG:  # its noise comes with SecAgg+'s encoding, in its stages only
        raise ValueError('This run adds the noise in shares under secure aggregation (noise-placement = "secagg"), '
                         "but the round came without SecAgg+'s stages: a reply would carry no noise.")
    if PACKED not in round_config:  # this node's own client
        return reply(msg, *_client_round(msg, protocol, state, node, config, startup_seconds))
    if node.data_dir:
        raise ValueError("A node with its own data (data-dir) trains only itself: several clients per message "
                         "(simulation-nodes) are for simulations.")
    device, where = select_device(), _ray_node()
    size = clients_at_once(config.client_batch, device)
    groups = client_groups([int(p) for p in round_config[PACKED]], protocol, size)

    def train(group: list[int]) -> TrainedClients:
        datasets = [_local_data(config, NodeSettings(p, config.num_clients)) for p in group]
        return _train_clients(msg, protocol, state, group, datasets)

    def release(group: list[int], trained: TrainedClients) -> list[tuple[dict, dict, float | None]]:
        return _release_clients(msg, protocol, group, trained,
                                startup_seconds if group is groups[0] else 0.0, where)

    records = {}
    for group, results in zip(groups, overlapped(groups, train, release, background=device.type == "cuda")):
        for partition_id, one in zip(group, results):
            records.update({packed_key(key, partition_id): record for key, record in client_records(*one).items()})
    return Message(RecordDict(records), reply_to=msg)


def client_groups(partitions: list[int], protocol: ClientSide, size: int) -> list[list[int]]:
    """The clients of a message in groups that train together: of one rank each (a group shares one model),
    at most ``size`` (client-batch) each, in the message's order within a rank."""
    by_rank: dict[int, list[int]] = {}
    for partition in partitions:
        by_rank.setdefault(protocol.client_rank(partition), []).append(partition)
    return [clients[i:i + size] for clients in by_rank.values() for i in range(0, len(clients), size)]


def secure_train(msg: Message, context: Context, startup_seconds: float) -> Message:
    """The round under secure aggregation: the constrained release encoded as integers carrying this client's noise
    share (fedlora.secure_sum), in the reply layout secaggplus_mod masks (weight 1, telemetry beside it)."""
    config, protocol, node = round_setup(msg, context)
    if protocol.placement is not NoisePlacement.SECAGG:
        raise ValueError("A round under SecAgg+ for a run whose noise is not added in shares "
                         f"(noise-placement = \"{protocol.placement.value}\"): refused.")
    release, metrics, _ = _client_round(msg, protocol, global_state(msg), node, config, startup_seconds)
    return encoded_reply(msg, protocol, node.partition_id, release, metrics)


def encoded_reply(msg: Message, protocol: ClientSide, partition_id: int, release: dict, metrics: dict) -> Message:
    """A client's constrained ``release`` encoded with its noise share, as the reply secaggplus_mod masks."""
    started = time.perf_counter()
    round_config = msg.content["config"]
    mechanism = protocol.mechanism_for(int(round_config["server-round"]), round_clip_norm(msg))
    codec = protocol.secure_sum(mechanism, {n: tuple(t.shape) for n, t in release.items()})
    encoded = codec.encode(protocol.secure_message(release),
                           protocol.secure_noise(int(round_config["release"]), partition_id))
    metrics["privatize-seconds"] = metrics.get("privatize-seconds", 0.0) + time.perf_counter() - started
    return secure_reply(msg, encoded, metrics)


def secure_reply(msg: Message, encoded: dict, metrics: dict) -> Message:
    """A round's integers (by entry name, sent in name order) and telemetry, in the layout secaggplus_mod reads:
    weight 1, so that the mod's weighting leaves the integers as they are."""
    return Message(RecordDict({
        "fitres.parameters": ArrayRecord([encoded[name] for name in sorted(encoded)]),
        "fitres.num_examples": MetricRecord({"num_examples": 1}),
        "fitres.metrics": ConfigRecord(metrics),
        "fitres.status": ConfigRecord({"code": 0, "message": ""}),
    }), reply_to=msg)


def _client_round(msg: Message, protocol: ClientSide, state: GlobalState, node: NodeSettings, config: RunConfig,
                  startup_seconds: float) -> tuple[dict, dict, float | None]:
    """One node's own client's round: its release, telemetry and clip bit."""
    guard = _budget_guard(msg, protocol, node)  # before any work: it may refuse the round
    trained = _train_clients(msg, protocol, state, [node.partition_id], [_local_data(config, node)])
    return _release_clients(msg, protocol, [node.partition_id], trained, startup_seconds, _ray_node(), guard)[0]


def _budget_guard(msg: Message, protocol: ClientSide, node: NodeSettings) -> Callable[[dict, Mechanism], dict] | None:
    """Where the node keeps a privacy ledger: records what each reply releases to the server before it leaves, and
    refuses a reply past the node's budget (fedlora.privacy.node_budget); a reply that would carry no noise of the
    node's own is refused here, before training."""
    budget = node.budget()
    if budget is None:
        return None
    round_config = msg.content["config"]
    mechanism = protocol.mechanism_for(int(round_config["server-round"]), round_clip_norm(msg))
    why = protocol.unprotected_to_server(mechanism)
    if why or protocol.placement is not NoisePlacement.SECAGG:  # what the reply releases needs no message here
        budget.check(protocol.release_to_server({}, mechanism), why_unprotected=why)

    def spend(message: dict, mechanism: Mechanism) -> dict:
        budget.spend(protocol.release_to_server(message, mechanism),
                     why_unprotected=protocol.unprotected_to_server(mechanism), run=msg.metadata.run_id,
                     round=int(round_config["server-round"]), release_id=int(round_config["release"]))
        return message

    return spend


def _train_clients(msg: Message, protocol: ClientSide, state: GlobalState,
                   partition_ids: list[int], datasets: list) -> TrainedClients:
    """Clients of one rank trained together, their messages on the host."""
    model, base = _model(protocol.config, protocol.client_rank(partition_ids[0]))
    round_config = msg.content["config"]
    return protocol.train_clients(model, base, datasets, state, round_=int(round_config["server-round"]),
                                  release=int(round_config["release"]), partition_ids=partition_ids)


def _release_clients(msg: Message, protocol: ClientSide, partition_ids: list[int],
                     trained: TrainedClients, startup_seconds: float, where: dict[str, int],
                     guard: Callable[[dict, Mechanism], dict] | None = None) -> list[tuple[dict, dict, float | None]]:
    """Each trained client's release, telemetry and clip bit."""
    round_config = msg.content["config"]
    release = int(round_config["release"])
    results = protocol.release_clients(trained, round_=int(round_config["server-round"]), release=release,
                                       clip_norm=round_clip_norm(msg), guard=guard,
                                       noises=[protocol.client_noise(release, p) for p in partition_ids])
    out = []
    for partition_id, result in zip(partition_ids, results):
        metrics = {"partition-id": partition_id, "train-seconds": result.train_seconds,
                   "privatize-seconds": result.privatize_seconds, "startup-seconds": startup_seconds, **where}
        if not protocol.algorithm.private:  # a private client's loss is a function of its data, and unprivatized
            metrics["train-loss"] = float(result.train_loss)
        out.append((result.release, metrics, result.clip_bit))
        startup_seconds = 0.0
    return out


def _ray_node() -> dict[str, int]:
    """In a simulation, the Ray node that trained the client (its id's first 48 bits): a round's row counts the
    machines its replies came from. Nothing outside Ray (a SuperNode)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return {}
    return {"ray-node": int(ray.get_runtime_context().get_node_id()[:12], 16)}


def canary_train(msg: Message, context: Context, direction: dict) -> Message:
    """A canary client of the privacy audit (fedlora.audit): instead of training, it sends its fixed unit
    ``direction`` (zero for a canary left out) scaled to the clip norm, through the round's mechanism like any
    client (under secure aggregation, through SecAgg+ with its noise share)."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, lambda m, c: _canary_round(m, c, direction))
    if run_config_of(context.run_config).noise_placement == NoisePlacement.SECAGG.value:
        raise ValueError("A canary round of a run that adds its noise in shares came without SecAgg+'s stages.")
    return _canary_round(msg, context, direction)


def _canary_round(msg: Message, context: Context, direction: dict) -> Message:
    config, protocol, node = round_setup(msg, context)
    round_config = msg.content["config"]
    round_, release = int(round_config["server-round"]), int(round_config["release"])
    clip_norm = round_clip_norm(msg) or config.clip_norm
    message = {name: t * clip_norm * (1 - CLIP_MARGIN) for name, t in direction.items()}
    out, bit = protocol.privatize(message, round_=round_, release=release, clip_norm=clip_norm,
                                  noise=protocol.client_noise(release, node.partition_id))
    metrics = {"partition-id": node.partition_id}
    if protocol.placement is NoisePlacement.SECAGG:
        return encoded_reply(msg, protocol, node.partition_id, out, metrics)
    return reply(msg, out, metrics, bit)
