"""One round of SecAgg+ (noise-placement = "secagg"), driven from the Message-API strategy.

Flower 1.41's ``SecAggPlusWorkflow`` runs only under the legacy context, so the strategy drives the same four stages
itself: setup (public keys), share keys (Shamir shares of each client's mask seed and key, encrypted per neighbour),
collect masked vectors (the round's training; each client's integers arrive masked), unmask (the survivors' shares
remove the masks). The clients run Flower's own ``secaggplus_mod`` (its Shamir split fedlora.shamir's, in Flower's
format: fedlora.clients.app); every cryptographic step on this side is Flower's
(``flwr.common.secure_aggregation``: key agreement, mask generation) but Shamir's reconstruction: fedlora.shamir gives
the same secrets from the same shares, a hundred times faster at N = 100. Every client is every other's neighbour
(the SecAgg case of SecAgg+), and the reconstruction threshold is the round's min-replies.

The server only ever holds masked vectors, summed as they arrive, and the unmasked sum: never one client's message.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ConfigRecord, Error, Message, MessageType, RecordDict
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
from flwr.serverapp import Grid
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

from fedlora.shamir import combine_shares
from fedlora.strategies.replies import gather

MASK_MODULUS = 2 ** 32  # Flower's SecAgg+ masks modulo 2^32; the encoding's modulus 2c divides it
METRICS = "fitres.metrics"  # the record of a client's telemetry beside its masked vector (the mod's reply layout)


@dataclass
class SecureSum:
    """What a SecAgg+ round gave the server."""

    total: dict[str, np.ndarray] | None  # congruent to the sum of the summed clients' encodings modulo 2c; None: none
    summed: list[int] = field(default_factory=list)  # node ids whose vectors are in the sum
    failed: dict[int, Error | str] = field(default_factory=dict)  # node id -> its error, or why it was left out
    metrics: dict[int, dict] = field(default_factory=dict)  # node id -> its telemetry (timings; nothing private)
    bytes_up: dict[int, int] = field(default_factory=dict)  # node id -> bytes it sent over the four stages
    bytes_down: dict[int, int] = field(default_factory=dict)  # node id -> protocol bytes sent to it (keys, shares)
    reason: str = ""  # why nothing was released


def _stage_messages(nodes, config_for, group_id: str, contents: Mapping[int, RecordDict] | None = None) -> list[Message]:
    messages = []
    for node in nodes:
        content = RecordDict(dict(contents[node])) if contents is not None else RecordDict()
        content[RECORD_KEY_CONFIGS] = ConfigRecord(config_for(node))
        messages.append(Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN, group_id=group_id))
    return messages


def _configs(reply: Message) -> ConfigRecord:
    return reply.content.config_records[RECORD_KEY_CONFIGS]


def secure_sum(grid: Grid, contents: Mapping[int, RecordDict], *, shapes: Mapping[str, tuple[int, ...]],
               threshold: int, half_range: int, timeout: float | None, group_id: str,
               progress: Callable[[int, int], None] = lambda arrived, sent: None) -> SecureSum:
    """Runs the four stages with the nodes of ``contents`` (each node's training message) and returns the sum of
    their encoded releases (entries ``shapes``, in that order), or ``total = None`` if fewer than ``threshold``
    vectors were summed or could be unmasked: such a sum would carry less noise than accounted, and is not released.
    """
    out = SecureSum(None)
    sampled = list(contents)
    n = len(sampled)

    def exchange(messages: list[Message], counted: bool = False) -> dict[int, Message]:
        for message in messages:
            node = message.metadata.dst_node_id
            out.bytes_down[node] = out.bytes_down.get(node, 0) + _payload_bytes(_configs(message))
        replies = {}
        # the collect stage, where clients train, is the round's long wait: its replies are the ones counted
        for reply in gather(grid, messages, timeout=timeout, progress=progress if counted else lambda *_: None):
            node = reply.metadata.src_node_id
            if reply.has_error():
                out.failed[node] = reply.error
            elif node in contents and RECORD_KEY_CONFIGS in reply.content.config_records:
                replies[node] = reply
                out.bytes_up[node] = out.bytes_up.get(node, 0) + _payload_bytes(_configs(reply))
        for message in messages:
            node = message.metadata.dst_node_id
            if node not in replies and node not in out.failed:
                out.failed[node] = "no reply (dropped out)"
        return replies

    def stop(why: str) -> SecureSum:
        out.reason = why
        return out

    # Stage 0, setup: the protocol's parameters out, two public keys per client back
    setup = {Key.STAGE: Stage.SETUP, Key.SAMPLE_NUMBER: n, Key.SHARE_NUMBER: n, Key.THRESHOLD: threshold,
             Key.CLIPPING_RANGE: float(half_range), Key.TARGET_RANGE: 2 * half_range, Key.MOD_RANGE: MASK_MODULUS,
             Key.MAX_WEIGHT: 1.0}  # weight 1 per client: the mod's weighting is then exactly 1
    keys = {node: (bytes(_configs(r)[Key.PUBLIC_KEY_1]), bytes(_configs(r)[Key.PUBLIC_KEY_2]))
            for node, r in exchange(_stage_messages(sampled, lambda _: dict(setup), group_id)).items()}
    if len(keys) < threshold:
        return stop(f"{len(keys)} of {n} clients answered the setup, {threshold} needed")

    # Stage 1, share keys: every client gets the others' public keys, returns its shares encrypted per neighbour
    def share_keys(node: int) -> dict:
        return {Key.STAGE: Stage.SHARE_KEYS, **{str(other): list(pair) for other, pair in keys.items()}}

    forwarded: dict[int, tuple[list[int], list[bytes]]] = {node: ([], []) for node in keys}
    keyed = exchange(_stage_messages(list(keys), share_keys, group_id))
    for node, reply in keyed.items():
        for destination, ciphertext in zip(_configs(reply)[Key.DESTINATION_LIST], _configs(reply)[Key.CIPHERTEXT_LIST],
                                           strict=True):
            if destination in keyed:
                forwarded[destination][0].append(node)
                forwarded[destination][1].append(bytes(ciphertext))
    keyed = sorted(keyed)  # the clients whose shares went out: their masks are in the others' vectors
    if len(keyed) < threshold:
        return stop(f"{len(keyed)} of {n} clients shared their keys, {threshold} needed")

    # Stage 2, collect masked vectors: each client trains and sends its encoded release, masked; summed on arrival
    def collect(node: int) -> dict:
        sources, ciphertexts = forwarded[node]
        return {Key.STAGE: Stage.COLLECT_MASKED_VECTORS, Key.SOURCE_LIST: sources, Key.CIPHERTEXT_LIST: ciphertexts}

    expected = [(1,), *shapes.values()]  # the mod puts its weight first
    masked, summed = None, []
    for node, reply in exchange(_stage_messages(keyed, collect, group_id, contents), counted=True).items():
        vector = [bytes_to_ndarray(b) for b in _configs(reply)[Key.MASKED_PARAMETERS]]
        if [tuple(v.shape) for v in vector] != [tuple(s) for s in expected] \
                or any(v.dtype.kind not in "iu" or v.min() < 0 or v.max() >= MASK_MODULUS for v in vector):
            out.failed[node] = "its masked vector is not the expected integers"  # left out: unmasked as a dropout
            continue
        masked = vector if masked is None else [np.mod(a + b, MASK_MODULUS) for a, b in zip(masked, vector)]
        summed.append(node)
        if METRICS in reply.content.config_records:
            out.metrics[node] = dict(reply.content.config_records[METRICS])
    out.summed = sorted(summed)
    if len(summed) < threshold:  # do not unmask: the sum would carry less noise than accounted
        return stop(f"{len(summed)} masked vectors arrived, {threshold} needed")

    # Stage 3, unmask: the survivors' shares of each summed client's mask seed and of each dropout's key
    dead = [node for node in keyed if node not in summed]

    def unmask(node: int) -> dict:
        return {Key.STAGE: Stage.UNMASK, Key.ACTIVE_NODE_ID_LIST: list(summed),
                Key.DEAD_NODE_ID_LIST: list(dead)}

    shares: dict[int, list[bytes]] = {node: [] for node in keyed}
    for reply in exchange(_stage_messages(summed, unmask, group_id)).values():
        for owner, share in zip(_configs(reply)[Key.NODE_ID_LIST], _configs(reply)[Key.SHARE_LIST], strict=True):
            if owner in shares:
                shares[owner].append(bytes(share))
    if short := [node for node, s in shares.items() if len(s) < threshold]:
        return stop(f"too few shares to unmask {len(short)} clients' vectors")
    dims = [tuple(s) for s in expected]
    for node in keyed:
        try:
            secret = combine_shares(shares[node])
        except ValueError as error:  # a survivor's malformed share: no mask to remove, so no sum
            return stop(f"the shares of client {node}'s {'mask seed' if node in summed else 'key'} do not combine "
                        f"({error})")
        if node in summed:  # its own mask, from its seed
            masked = [np.mod(a - b, MASK_MODULUS) for a, b in zip(masked, pseudo_rand_gen(secret, MASK_MODULUS, dims))]
            continue
        for other in keyed:  # a dropout's pairwise masks, from its key (two dropouts' masks cancel)
            if other == node:
                continue
            pairwise = pseudo_rand_gen(generate_shared_key(bytes_to_private_key(secret),
                                                           bytes_to_public_key(keys[other][0])), MASK_MODULUS, dims)
            sign = 1 if node > other else -1
            masked = [np.mod(a + sign * b, MASK_MODULUS) for a, b in zip(masked, pairwise)]
    # each summed client's integers were shifted by c into [0, 2c) by the mod's quantization
    out.total = {name: (a - len(summed) * half_range) for name, a in zip(shapes, masked[1:])}
    return out


def _payload_bytes(record: ConfigRecord) -> int:
    total = 0
    for value in record.values():
        values = value if isinstance(value, list) else [value]
        total += sum(len(v) if isinstance(v, bytes) else 8 for v in values)
    return total

