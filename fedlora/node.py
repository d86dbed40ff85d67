"""What a SuperNode's operator tells its client through ``--node-config``, and the shared sketch secret.

In simulation Flower sets ``partition-id`` and ``num-partitions``. On a device the operator sets them
too (``partition-id`` names the client to the server's sampler and seeds), and may add the device's
own images (``data-dir``), the file holding the federation's sketch secret
(``sketch-secret-file``), which the clients share out of band and the server never sees, and the node's
own privacy budget against the server (``privacy-ledger``, ``privacy-budget``, ``privacy-delta``:
fedlora.privacy.node_budget), which holds whatever the server sends.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

NODE_KEYS = ("partition-id", "num-partitions", "data-dir", "sketch-secret-file", "privacy-ledger", "privacy-budget",
             "privacy-delta")
DEFAULT_NODE_DELTA = 1e-5
SECRET_BYTES = 32  # 256 bits; at least MIN_SECRET_BYTES are required of a secret we did not write
MIN_SECRET_BYTES = 16


@dataclass(frozen=True)
class NodeSettings:
    partition_id: int
    num_partitions: int
    data_dir: str = ""  # the device's own images; empty: partition partition-id of the run's dataset
    sketch_secret_file: str = ""
    privacy_ledger: str = ""  # the node's own record of its replies; empty: none kept
    privacy_budget: float | None = None  # the epsilon against the server its replies may spend; None: record only
    privacy_delta: float = DEFAULT_NODE_DELTA

    @classmethod
    def from_node_config(cls, node_config) -> NodeSettings:
        values = dict(node_config)
        unknown = sorted(set(values) - set(NODE_KEYS))
        if unknown:
            raise ValueError(f"Unknown node-config key '{unknown[0]}'; node-config takes {', '.join(NODE_KEYS)}.")
        for key in ("partition-id", "num-partitions"):
            if key not in values:
                raise ValueError(f"node-config needs {key} (e.g. --node-config \"partition-id=0 num-partitions=2\").")
        try:
            partition_id, num_partitions = int(values["partition-id"]), int(values["num-partitions"])
        except (TypeError, ValueError):
            raise ValueError("node-config's partition-id and num-partitions must be whole numbers.") from None
        if not 0 <= partition_id < num_partitions:
            raise ValueError(f"node-config's partition-id must lie in [0, num-partitions = {num_partitions}), "
                             f"got {partition_id}.")
        ledger = str(values.get("privacy-ledger", ""))
        budget, delta = _number(values, "privacy-budget"), _number(values, "privacy-delta")
        if (budget is not None or delta is not None) and not ledger:
            raise ValueError("node-config's privacy-budget and privacy-delta need privacy-ledger, the file where the "
                             "node records its replies (e.g. privacy-ledger=\"/var/lib/fedlora/ledger.jsonl\").")
        if budget is not None and not budget > 0:
            raise ValueError(f"node-config's privacy-budget must be a positive epsilon, got {budget:g}.")
        if delta is not None and not 0 < delta < 1:
            raise ValueError(f"node-config's privacy-delta must lie in (0, 1), got {delta:g}.")
        return cls(partition_id, num_partitions, str(values.get("data-dir", "")),
                   str(values.get("sketch-secret-file", "")), ledger, budget,
                   DEFAULT_NODE_DELTA if delta is None else delta)

    def budget(self):
        """The node's ledger and budget (fedlora.privacy.node_budget.NodeBudget), or None where it keeps none."""
        if not self.privacy_ledger:
            return None
        from fedlora.privacy.node_budget import NodeBudget  # the accountants, only where a node keeps a ledger

        return NodeBudget(Path(self.privacy_ledger).expanduser(), self.privacy_budget, self.privacy_delta)


def _number(values: dict, key: str) -> float | None:
    if key not in values:
        return None
    try:
        return float(values[key])
    except (TypeError, ValueError):
        raise ValueError(f"node-config's {key} must be a number, got '{values[key]}'.") from None


def write_sketch_secret(path: str | os.PathLike[str]) -> Path:
    """A new 256-bit secret from the OS's secure randomness, as hex, readable by its owner only."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(SECRET_BYTES) + "\n")
    return path


def _read_secret(path: str | os.PathLike[str]) -> bytes:
    path = Path(path).expanduser()
    try:
        text = path.read_text().strip()
    except OSError as err:
        raise ValueError(f"Cannot read the sketch secret '{path}': {err.strerror}.") from None
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"The sketch secret '{path}' must be hex (write one with `fedlora credentials`).") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"The sketch secret '{path}' has {8 * len(secret)} bits; at least {8 * MIN_SECRET_BYTES} "
                         "are needed.")
    return secret


def read_sketch_seed(path: str | os.PathLike[str]) -> int:
    """The sketch seed of a secret file: the whole secret (hashed), so no bit of it is dropped."""
    return int.from_bytes(hashlib.sha256(b"fedlora-sketch" + _read_secret(path)).digest(), "big")


def secret_fingerprint(path: str | os.PathLike[str]) -> int:
    """48 bits of a separate hash of the secret: lets the server check that every node holds the same secret
    (and `fedlora reconstruct` that a file is the run's) while revealing nothing usable about it."""
    return int.from_bytes(hashlib.sha256(b"fedlora-fingerprint" + _read_secret(path)).digest()[:6], "big")
