"""A run's checkpoint: one file, rewritten atomically whenever the run's state changes.

``global-state.safetensors`` in the run directory holds the global adapters as the server aggregated
them (sketched when the mechanism sketches) and, in its metadata, everything a resumed run needs: the
rounds done, the releases issued (retries included) and whether the last one's round was cut short, the
privacy ledger, the metrics rows so far and the last round's telemetry (for its row), the run's status,
the clip norm (adaptive clipping moves it), and the fingerprint of the nodes' sketch secret when the
nodes hold it. The server optimizer's state (message = update) is saved beside the adapters, as tensors
named ``server-optimizer/<slot>/<entry>``. Sampling, sketches and simulation noise are pure functions of
(seed, release, partition), so they need no state of their own.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from fedlora.round_plan import GlobalState

STATE_FILE = "global-state.safetensors"
# The layout of the file's metadata and tensors. Bumped whenever it changes: a run is resumed only by a fedlora that
# reads its checkpoint's format (files without the field are format 1, the first). Format 2 adds the last round's
# telemetry (round_info); a format-1 file reads as one without it. Format 3 drops the ledger's per-round history
# (metrics.jsonl has every round), which fedlora versions reading format 2 require; earlier files still read.
CHECKPOINT_FORMAT = 3
READABLE_FORMATS = (1, 2, 3)
OPTIMIZER_PREFIX = "server-optimizer/"

RUNNING, FINISHED, BUDGET_SPENT, STALLED, RESTART = "running", "finished", "budget-spent", "stalled", "restart"
ENDED = (FINISHED, BUDGET_SPENT)  # a run in any other status can be resumed


class UnreadableFormat(ValueError):
    """A checkpoint written by a fedlora whose format this one cannot read (not damage)."""


@dataclass
class Checkpoint:
    state: GlobalState
    rounds_done: int = 0
    releases: int = 0  # releases issued so far: rounds in which clients were sampled, retries included
    in_flight: bool = False  # the last release's round did not complete
    ledger: dict | None = None  # PrivacyLedger.to_dict(); None if not private
    rows: list[dict] = field(default_factory=list)  # metrics.jsonl's rows so far
    status: str = RUNNING
    reason: str = ""  # why the run stopped, when it stopped early
    simulated: bool = False  # run by the simulation engine (`fedlora run`), which can resume it
    secret_fingerprint: int | None = None
    clip_norm: float | None = None  # the next round's clip norm (None: files from before adaptive clipping)
    optimizer: dict = field(default_factory=dict)  # ServerOptimizer.state
    # what round rounds_done did (replies, bytes, seconds...): its metrics row, if the run stops before writing it
    round_info: dict = field(default_factory=dict)

    def save(self, run_dir: Path) -> None:
        """Writes the checkpoint next to its final place, then renames it over the old one: a crash at any
        moment leaves either the previous checkpoint or this one, never a torn file."""
        from safetensors.torch import save_file

        path = Path(run_dir) / STATE_FILE
        partial = path.with_name(path.name + ".partial")
        progress = {"rounds_done": self.rounds_done, "releases": self.releases, "in_flight": self.in_flight,
                    "ledger": self.ledger, "rows": self.rows, "status": self.status, "reason": self.reason,
                    "simulated": self.simulated, "clip_norm": self.clip_norm, "round_info": self.round_info}
        metadata = {"produced_by": str(self.state.produced_by), "progress": json.dumps(progress),
                    "format": str(CHECKPOINT_FORMAT)}
        if self.secret_fingerprint is not None:
            metadata["secret_fingerprint"] = str(self.secret_fingerprint)
        tensors = {**self.state.message, **{OPTIMIZER_PREFIX + n: t for n, t in self.optimizer.items()}}
        save_file({n: t.detach().cpu().contiguous() for n, t in tensors.items()}, str(partial), metadata=metadata)
        with open(partial, "rb") as f:
            os.fsync(f.fileno())
        os.replace(partial, path)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself survives a power cut
        finally:
            os.close(directory)

    @classmethod
    def load(cls, run_dir: Path) -> Checkpoint:
        from safetensors import SafetensorError

        path = Path(run_dir) / STATE_FILE
        if not path.is_file():
            raise ValueError(f"'{run_dir}' holds no {STATE_FILE}: is it a fedlora run directory?")
        try:
            return cls._read(path, run_dir)
        except UnreadableFormat:
            raise
        except (SafetensorError, KeyError, TypeError, ValueError) as error:  # ValueError: JSON, or a number that is not
            raise ValueError(f"'{path}' is damaged ({type(error).__name__}: {error}): restore it from a copy, or "
                             "start the run again.") from None

    @classmethod
    def _read(cls, path: Path, run_dir: Path) -> Checkpoint:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            if int(metadata.get("format", 1)) not in READABLE_FORMATS:
                raise UnreadableFormat(f"The checkpoint in '{run_dir}' has format {metadata['format']}; this "
                                       f"fedlora reads formats {', '.join(map(str, READABLE_FORMATS))}: continue the "
                                       "run with the fedlora that wrote it.")
            tensors = {n: f.get_tensor(n) for n in f.keys()}
        state = GlobalState({n: t for n, t in tensors.items() if not n.startswith(OPTIMIZER_PREFIX)},
                            int(metadata["produced_by"]))
        optimizer = {n[len(OPTIMIZER_PREFIX):]: t for n, t in tensors.items() if n.startswith(OPTIMIZER_PREFIX)}
        fingerprint = metadata.get("secret_fingerprint")
        # files from before checkpoints held only the final state of a finished run
        progress = json.loads(metadata.get("progress", json.dumps({"status": FINISHED})))
        return cls(state, secret_fingerprint=int(fingerprint) if fingerprint is not None else None,
                   optimizer=optimizer, **progress)
