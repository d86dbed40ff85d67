"""Where a run reports besides metrics.jsonl: TensorBoard event files in its directory (`tensorboard --logdir
runs/` shows every run side by side), and the in-round progress file the launcher shows while a round runs."""

from __future__ import annotations

import json
import math
import os
import logging
import time
from pathlib import Path

TRACKERS = ("tensorboard", "none")
PROGRESS_FILE = "progress.json"

# metrics.jsonl's key -> its TensorBoard tag (grouped by the part before the slash)
SCALARS = {"accuracy": "test/accuracy", "loss": "test/loss", "train_loss": "train/loss",
           "clip_norm": "privacy/clip norm", "noise_multiplier": "privacy/noise multiplier",
           "sampled": "clients/sampled", "replies": "clients/replies", "rejected": "clients/rejected",
           "nodes": "clients/Ray nodes",
           "bytes_up": "traffic/bytes up", "bytes_down": "traffic/bytes down", "seconds": "time/seconds"}


def epsilon_tag(observer: str) -> str:
    return f"privacy/epsilon against {observer}"


class TensorBoardTracker:
    """One metrics row a round as TensorBoard scalars: the row's numbers under SCALARS' tags, its epsilon against
    each observer under `privacy/epsilon against <observer>` and its threat model as the round's text."""

    def __init__(self, out_dir: Path, *, rounds_kept: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        # drops what an interrupted run wrote after its checkpoint's last round, as metrics.jsonl does
        self.writer = SummaryWriter(log_dir=str(out_dir), purge_step=rounds_kept + 1)

    def log(self, row: dict) -> None:
        step = row["round"]
        for key, tag in SCALARS.items():
            if isinstance(row.get(key), (int, float)) and math.isfinite(row[key]):
                self.writer.add_scalar(tag, row[key], step)
        for observer, value in row.get("epsilon_by_observer", {}).items():
            if math.isfinite(value):
                self.writer.add_scalar(epsilon_tag(observer), value, step)
        self.writer.add_text("privacy/threat model", row["threat_model"], step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def tracker_for(kind: str, out_dir: Path, *, rounds_kept: int = 0) -> TensorBoardTracker | None:
    return TensorBoardTracker(out_dir, rounds_kept=rounds_kept) if kind == "tensorboard" else None


def write_progress(out_dir: Path, round_: int, arrived: int, sent: int) -> None:
    """The round's replies so far, atomically (the launcher reads it while it changes). The count is a display:
    a failure to write it is logged and the round goes on."""
    path = Path(out_dir) / PROGRESS_FILE
    partial = path.with_suffix(".tmp")
    try:
        partial.write_text(json.dumps({"round": round_, "arrived": arrived, "sent": sent, "time": time.time()}))
        os.replace(partial, path)
    except OSError as error:
        logging.getLogger(__name__).warning("Could not write %s: %s", path, error)


def clear_progress(out_dir: Path) -> None:
    """No round under way (a run starting or resuming): an earlier run's counts are not this one's."""
    (Path(out_dir) / PROGRESS_FILE).unlink(missing_ok=True)


def read_progress(out_dir: Path) -> dict | None:
    try:
        progress = json.loads((Path(out_dir) / PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return progress if isinstance(progress, dict) and {"round", "arrived", "sent"} <= progress.keys() else None
