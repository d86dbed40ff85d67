"""The fedlora ClientApp: de-sketch the global adapters, train K local SGD steps, clip, privatize, reply.

A SuperNode starts a process for every message, so this module imports only Flower: a query or a stage of SecAgg+
is answered without torch, PEFT or the data libraries, and the first message that trains imports the round's work
(fedlora.clients.rounds). Ray workers live across messages and import it once, when the ServerApp's warm-up query
asks them to before round 1. A simulation sends each node (one per Ray worker) several clients in one message: it
trains them (client-batch at a time) and replies with one release per client.
"""

from __future__ import annotations

import os
import sys
import time

import psutil
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from fedlora import shamir
from fedlora.run_keys import SIMULATION_KEY, WARM_UP

# Flower's mod splits a client's key and mask seed with PyCryptodome, 1.9 to 5.6 s a round at N = 100 here;
# fedlora.shamir writes the same shares (same format, any threshold of them combine through Flower's) 100 times faster. Every other step of
# the mod stays Flower's. A Flower that no longer looks the name up in the mod's module keeps its own split (a test
# fails).
_mod_module = sys.modules[secaggplus_mod.__module__]
if hasattr(_mod_module, "create_shares"):
    _mod_module.create_shares = shamir.create_shares

app = ClientApp()
_fresh_process = True  # a SuperNode starts a process per message; Ray workers live across messages


def _startup_seconds() -> float:
    """Seconds from this process's start to now if it has handled no message before, else 0 (called once the
    round's work is imported: its imports are part of a fresh process's start)."""
    global _fresh_process
    fresh, _fresh_process = _fresh_process, False
    return time.time() - psutil.Process().create_time() if fresh else 0.0


@app.query()
def identify(msg: Message, context: Context) -> Message:
    """Which partition this node holds (the server samples partitions, so a seed fixes a seeded run), when the
    nodes hold the sketch secret its fingerprint, and with a data-dir what stops the node's own data being read; or, asked to warm up (a simulation's ServerApp asks first thing),
    nothing once the round's work is loaded."""
    if "config" in msg.content.config_records and msg.content["config"].get(WARM_UP):
        if not context.run_config.get(SIMULATION_KEY, False):  # a device trains its own data: nothing to warm
            raise ValueError("Only a simulation's workers warm up: this node is not one.")
        from fedlora.clients import rounds

        rounds.warm_up(context)
        _startup_seconds()  # the worker's start is the warm-up's, reported by the server as its wait for workers
        return Message(RecordDict(), reply_to=msg)
    from fedlora.config import run_config_of
    from fedlora.node import NodeSettings, secret_fingerprint

    node = NodeSettings.from_node_config(context.node_config)
    metrics = {"partition-id": node.partition_id}
    if run_config_of(context.run_config).sketch_secret == "node-file":  # the server checks all nodes share it
        metrics["secret-fingerprint"] = secret_fingerprint(node.sketch_secret_file) if node.sketch_secret_file else -1
    records = {"metrics": MetricRecord(metrics)}
    if node.data_dir:  # a device's own data is read now, before round 1: a bad file stops the run in one line
        from fedlora.clients import rounds

        records["node"] = ConfigRecord({"data-problem": rounds.own_data_problem(context, node)})
    return Message(RecordDict(records), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    if RECORD_KEY_CONFIGS in msg.content.config_records:  # a stage of SecAgg+ (noise-placement = "secagg")
        return secaggplus_mod(msg, context, _secure_train)
    from fedlora.clients import rounds

    reply = rounds.train_round(msg, context, _startup_seconds())
    return _garbled(reply) if os.environ.get(GARBAGE_ENV) == _partition(msg, context) else reply


GARBAGE_ENV = "FEDLORA_REPLY_GARBAGE"  # benchmarks/chaos.py: the partition whose node replies NaN (faults on purpose)


def _partition(msg: Message, context: Context) -> str:
    """The partition a one-client message trains: the one the server assigns (simulation), else the node's own."""
    config = msg.content["config"]
    return str(config["partition"] if "partition" in config else context.node_config.get("partition-id"))


def _garbled(reply: Message) -> Message:
    """A reply whose every released array is NaN, as a broken or hostile device might send: the server must reject
    it and aggregate the others (the node's ledger still counts the release it made)."""
    import numpy as np
    from flwr.app import Array, ArrayRecord

    for name, record in list(reply.content.array_records.items()):
        if name.split("/")[0] == "arrays":
            reply.content[name] = ArrayRecord({key: Array(np.full(array.shape, np.nan, dtype=np.float32))
                                               for key, array in record.items()})
    return reply


def _secure_train(msg: Message, context: Context) -> Message:
    """The stage of SecAgg+ that asks for this client's round (the other stages are the mod's alone)."""
    from fedlora.clients import rounds

    return rounds.secure_train(msg, context, _startup_seconds())
