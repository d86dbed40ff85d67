"""SecAgg+ driven from the strategy (strategies/secure_aggregation.py) against Flower's secaggplus_mod, in process, the
mod splitting with fedlora.shamir as the ClientApp has it."""

import sys

import numpy as np
import pytest
from flwr.app import RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from fedlora import shamir
from fedlora.clients import app as client_app  # its import gives the mod fedlora's split, as in every client process
from fedlora.clients.rounds import secure_reply
from fedlora.strategies.inprocess_grid import InProcessGrid
from fedlora.strategies.secure_aggregation import MASK_MODULUS, secure_sum

SHAPES = {"a": (3, 2), "b": (4,)}
HALF_RANGE = 2 ** 20


def _vectors(nodes):
    rng = np.random.default_rng(0)
    return {n: {name: rng.integers(-HALF_RANGE, HALF_RANGE, shape) for name, shape in SHAPES.items()} for n in nodes}


def _client_app(vectors, drop: set = frozenset()):
    """Each node's round returns its fixed integers; (node, stage) in ``drop``: the node dies at that stage."""
    def app(msg, context):
        if (context.node_id, msg.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE]) in drop:
            raise RuntimeError("the device went offline")
        return secaggplus_mod(msg, context, lambda m, c: secure_reply(m, vectors[c.node_id], {"partition-id": 0}))
    return app


class RecordingGrid(InProcessGrid):
    """Keeps every reply the server side receives."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.received = []

    def send_and_receive(self, messages, *, timeout=None):
        replies = super().send_and_receive(messages, timeout=timeout)
        self.received += replies
        return replies


def _run(nodes, drop=frozenset(), threshold=3):
    vectors = _vectors(nodes)
    grid = RecordingGrid(_client_app(vectors, drop), len(nodes), {})
    contents = {n: RecordDict() for n in nodes}
    return secure_sum(grid, contents, shapes=SHAPES, threshold=threshold, half_range=HALF_RANGE, timeout=None,
                      group_id="1"), vectors, grid


def _congruent(total, vectors, nodes):
    return all(not np.mod(total[name] - sum(vectors[n][name] for n in nodes), 2 * HALF_RANGE).any() for name in SHAPES)


def test_the_client_app_s_secaggplus_mod_splits_with_fedlora_shamir(monkeypatch):
    """In a round through Flower's mod every client's key and seed are split by fedlora.shamir's arithmetic."""
    assert client_app._mod_module is sys.modules[secaggplus_mod.__module__]
    splits = []
    horner = shamir._times_index
    monkeypatch.setattr(shamir, "_times_index", lambda *args: splits.append(args[1]) or horner(*args))
    nodes = [1, 2, 3, 4]
    result, vectors, _ = _run(nodes)
    assert result.summed == nodes and _congruent(result.total, vectors, nodes)
    # each client's 2 secrets, shared among all 4 clients (itself included: indices 1..4), by Horner's threshold = 3
    # steps per index
    assert sorted(splits) == sorted([1, 2, 3, 4] * 3 * 2 * len(nodes))


def test_the_secure_sum_is_the_plain_sum_and_the_server_sees_no_single_vector():
    nodes = [1, 2, 3, 4, 5]
    result, vectors, grid = _run(nodes)
    assert result.summed == nodes and _congruent(result.total, vectors, nodes)
    # what the server received: no arrays, and no masked vector equal to a client's shifted integers
    configs = [reply.content.config_records[RECORD_KEY_CONFIGS] for reply in grid.received]
    assert all(not any(len(record) for record in reply.content.array_records.values()) for reply in grid.received)
    masked = [c[Key.MASKED_PARAMETERS] for c in configs if Key.MASKED_PARAMETERS in c]
    assert len(masked) == len(nodes)
    for vector in masked:
        arrays = [bytes_to_ndarray(b) for b in vector][1:]
        for n in nodes:
            plain = [np.mod(vectors[n][name] + HALF_RANGE, MASK_MODULUS) for name in SHAPES]
            assert not any(np.array_equal(a, p) for a, p in zip(arrays, plain))


@pytest.mark.parametrize("stage", [Stage.COLLECT_MASKED_VECTORS, Stage.UNMASK])
def test_a_client_dropping_after_sharing_its_keys_does_not_break_the_round(stage):
    nodes = [1, 2, 3, 4, 5]
    result, vectors, _ = _run(nodes, drop={(2, stage)})
    kept = nodes if stage == Stage.UNMASK else [1, 3, 4, 5]  # a dropout at unmask already sent its vector
    assert result.summed == kept and _congruent(result.total, vectors, kept)
    assert 2 in result.failed


def test_a_client_dropping_at_setup_is_left_out():
    result, vectors, _ = _run([1, 2, 3, 4], drop={(4, Stage.SETUP)})
    assert result.summed == [1, 2, 3] and _congruent(result.total, vectors, [1, 2, 3])


def test_fewer_vectors_than_the_threshold_are_never_unmasked():
    nodes = [1, 2, 3, 4]
    result, _, grid = _run(nodes, drop={(3, Stage.COLLECT_MASKED_VECTORS), (4, Stage.COLLECT_MASKED_VECTORS)})
    assert result.total is None and "2 masked vectors arrived, 3 needed" in result.reason
    stages = [m.content.config_records[RECORD_KEY_CONFIGS] for m in grid.received if m.has_content()]
    assert not any(Key.SHARE_LIST in s for s in stages)  # the unmask stage never ran


def test_shares_that_do_not_combine_stop_the_round_with_the_reason():
    """A survivor's unmask reply whose shares are malformed (here a stray byte each) leaves a mask that cannot be
    removed: the round stops with the reason, as with too few shares, rather than ending the run in a traceback."""
    nodes = [1, 2, 3, 4]
    honest = _client_app(_vectors(nodes))

    def app(msg, context):
        reply = honest(msg, context)
        config = reply.content.config_records[RECORD_KEY_CONFIGS]
        if context.node_id == 2 and Key.SHARE_LIST in config:
            config[Key.SHARE_LIST] = [bytes(share) + b"\0" for share in config[Key.SHARE_LIST]]
        return reply

    result = secure_sum(InProcessGrid(app, len(nodes), {}), {n: RecordDict() for n in nodes}, shapes=SHAPES,
                        threshold=3, half_range=HALF_RANGE, timeout=None, group_id="1")
    assert result.total is None and "mask seed do not combine (Failed to combine shares" in result.reason
