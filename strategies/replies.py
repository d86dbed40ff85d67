"""Collecting a round's replies from the grid while telling how many have arrived."""

from __future__ import annotations

import time
from collections.abc import Callable

from flwr.app import Message
from flwr.serverapp import Grid

PULL_INTERVAL = 0.5  # seconds between the pulls of a round's replies (Flower's own loop waits 3 on a SuperLink)


def gather(grid: Grid, messages: list[Message], *, timeout: float | None,
           progress: Callable[[int, int], None] = lambda arrived, sent: None) -> list[Message]:
    """Flower's send_and_receive, telling ``progress`` how many replies have arrived of how many were sent as
    they arrive: push, then pull until every message is answered or the timeout passes."""
    progress(0, len(messages))
    if getattr(grid, "synchronous", False):  # answers every message before it returns: nothing to watch
        replies = list(grid.send_and_receive(messages, timeout=timeout))
        progress(len(replies), len(messages))
        return replies
    waiting = set(grid.push_messages(messages))
    sent, replies = len(waiting), []
    end = time.monotonic() + (timeout if timeout is not None else float("inf"))
    while waiting and time.monotonic() < end:
        arrived = list(grid.pull_messages(waiting))
        if arrived:
            replies += arrived
            waiting -= {reply.metadata.reply_to_message_id for reply in arrived}
            progress(len(replies), sent)
        elif waiting:
            time.sleep(PULL_INTERVAL)
    return replies
