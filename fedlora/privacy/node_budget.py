"""A node's own privacy budget against a server it does not trust, kept in a ledger on the node.

The run's epsilon against the server assumes the server follows the protocol: its clients take the noise multiplier,
the clip norm, the noise placement and the noise source from the server's run and messages. A server that does not
could send z = 0, move the noise to itself or to seeds it holds, or sample one client every round. A node whose
operator sets a budget (node-config ``privacy-budget`` and ``privacy-ledger``, fedlora.node) counts instead what its
own replies release to a server that knows each reply was its own: only the noise the node adds itself
(``Protocol.release_to_server``), at the multiplier it used. Each reply is written to the ledger before it leaves, and
a reply that would take the node's epsilon past its budget is refused; the ledger spans every run the node serves.

With q = 1 (the node knows each of its replies) the accountant's known-sample epsilon is exact for Gaussian releases:
k replies at multipliers z_i compose to the Gaussian mechanism at mu = sqrt(sum 4 / z_i^2) (replace-one, sensitivity
2 tau), whatever the clip norms were.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from fedlora.privacy.accounting import known_sample_epsilon
from fedlora.privacy.events import (GaussianRelease, NonPrivateRelease, Phase, Release, Sampling, SamplingScheme,
                                    SkellamRelease, release_from_dict, release_to_dict)

_log = logging.getLogger(__name__)  # the node's own log (a SuperNode's output), not the reply
EVERY_TIME = SamplingScheme(Sampling.FIXED, num_clients=1, clients_per_round=1)  # the node knows its every reply


REFUSED = "Refused by this node's privacy budget"  # how the server tells a refusal from a failure in an error reply


class BudgetRefused(ValueError):
    """A reply the node's budget does not allow; nothing was recorded."""


def describe_release(release: tuple[Release, ...]) -> str:
    """One reply's release in words, as the ledger's refusals name it."""
    def part(r: Release) -> str:
        if isinstance(r, NonPrivateRelease):
            return "no noise of the node's own"
        kind = {GaussianRelease: "Gaussian noise", SkellamRelease: "a Skellam noise share"}.get(type(r), "noise")
        return f"{kind} at multiplier {r.noise_multiplier:.4g}"
    return " and ".join(part(r) for r in release)


@dataclass(frozen=True)
class NodeBudget:
    """The ledger file of one node's replies and its budget (epsilon None: record only) at ``delta``."""

    path: Path
    epsilon: float | None = None
    delta: float = 1e-5

    def records(self) -> list[dict]:
        """Every reply recorded so far (none if the ledger does not exist yet)."""
        if not self.path.exists():
            return []
        with open(self.path) as f:
            return self._parse(f.read())

    def spent(self, records: list[dict] | None = None) -> float:
        """Epsilon against the server of the replies ``records`` (default: the ledger's)."""
        return self.accounting(records)[0]

    def accounting(self, records: list[dict] | None = None) -> tuple[float, str]:
        """``spent`` and how it was computed: exact for Gaussian replies, the RDP conversion for Skellam shares."""
        records = self.records() if records is None else records
        counts = Counter(tuple(release_from_dict(part) for part in r["release"]) for r in records)
        phases = [Phase(f"replies {i}", release, EVERY_TIME, k) for i, (release, k) in enumerate(counts.items())]
        return known_sample_epsilon(phases, self.delta) if phases else (0.0, "none")

    def spend(self, reply: tuple[Release, ...], *, why_unprotected: str | None = None, **label) -> float:
        """Records what one reply releases, ``reply`` (with ``label``: run, round...), and returns the epsilon spent
        with it; refuses (BudgetRefused, nothing recorded) a reply that would pass the budget, saying
        ``why_unprotected`` a reply without noise of the node's own has none. Under a lock on the file: the
        processes of one node record one at a time."""
        with self._usable():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(fd, "r+") as f:
                fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
                records = self._parse(f.read())
                if "release" in label:  # the key of what the reply releases
                    raise ValueError("A ledger record's label cannot be named 'release': use release_id.")
                record = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **label,
                          "release": [release_to_dict(r) for r in reply]}
                after = self._check(reply, records, record, why_unprotected)
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
        return after

    def check(self, reply: tuple[Release, ...], *, why_unprotected: str | None = None) -> None:
        """Refuses now, before any work, a reply that ``spend`` would refuse later (nothing is recorded)."""
        with self._usable():
            self._check(reply, self.records(), {"release": [release_to_dict(r) for r in reply]}, why_unprotected)

    def _check(self, reply: tuple[Release, ...], records: list[dict], record: dict, why: str | None) -> float:
        after = self.spent([*records, record])
        if self.epsilon is not None and after > self.epsilon:
            raise BudgetRefused(self._refusal(reply, records, after, why))
        return after

    @contextlib.contextmanager
    def _usable(self):
        """A ledger the node cannot read or write stops it, telling the server nothing of the file (its path and
        contents go to the node's own log)."""
        try:
            yield
        except BudgetRefused:
            raise
        except (OSError, ValueError) as error:
            _log.error("The privacy ledger %s cannot be used: %s", self.path, error)
            raise ValueError("This node's privacy ledger cannot be used; the node's own log says why.") from None

    def _refusal(self, release: tuple[Release, ...], records: list[dict], after: float, why: str | None) -> str:
        """What the server is told (the reason; not what the ledger holds, which spans the node's other federations),
        after the whole of it goes to the node's own log."""
        reason = ", past the budget" if after < math.inf else f" ({why})" if why else ""
        told = f"{REFUSED} against the server: this reply would carry " \
               f"{describe_release(release)}{reason}."
        _log.warning("%s The ledger %s: %d replies spent epsilon %.3f at delta %g; this one would bring it to %.3f, "
                     "past the budget %g.", told, self.path, len(records), self.spent(records), self.delta, after,
                     self.epsilon)
        return told

    def _parse(self, text: str) -> list[dict]:
        records = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                [release_from_dict(part) for part in record["release"]]
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"The privacy ledger '{self.path}' has an unreadable line {number} ({err}); the "
                                 "node refuses to train until it is repaired.") from None
            records.append(record)
        return records
