"""Collecting a round's replies from the grid while telling how many have arrived."""

from __future__ import annotations

import time
from collections.abc import Callable

from flwr.app import Error, Message
from flwr.serverapp import Grid

PULL_INTERVAL = 3.0  # seconds between pulls where the grid names none (Flower's loop on a SuperLink waits 3)


def error_line(error: Error, limit: int = 300) -> str:
    """Why a client failed, in one line: where the reason holds a traceback (under Ray it starts with the actor's
    name, and the client's own error is inside) its last exception line with a message, the one raised last (Ray's
    wrapper says nothing); else its first line."""
    from fedlora.launch import EXCEPTION_LINE  # only when a client failed: it loads the launcher's libraries

    lines = [line.strip() for line in (error.reason or "").splitlines() if line.strip()]
    told = [line for line in lines if EXCEPTION_LINE.match(line) and line.split(": ", 1)[1].strip()]
    return (told[-1:] or lines[:1] or [str(error.code)])[0][:limit]


def gather(grid: Grid, messages: list[Message], *, timeout: float | None,
           progress: Callable[[int, int], None] = lambda arrived, sent: None) -> list[Message]:
    """Flower's send_and_receive, telling ``progress`` how many replies (error replies included) have arrived of
    how many messages were sent, as they arrive: push, then pull until every message is answered or the timeout
    passes."""
    if getattr(grid, "synchronous", False):  # answers every message before it returns: nothing to watch
        progress(0, len(messages))
        replies = list(grid.send_and_receive(messages, timeout=timeout))
        progress(len(replies), len(messages))
        return replies
    # as Flower's own loop, at the grid's own pace; a message the grid could not push (no id) is not waited for
    waiting = {message_id for message_id in grid.push_messages(messages) if message_id}
    sent, replies, interval = len(waiting), [], getattr(grid, "pull_interval", PULL_INTERVAL)
    progress(0, sent)
    end = time.monotonic() + (timeout if timeout is not None else float("inf"))
    while waiting and time.monotonic() < end:
        arrived = list(grid.pull_messages(waiting))
        if arrived:
            replies += arrived
            waiting -= {reply.metadata.reply_to_message_id for reply in arrived}
            progress(len(replies), sent)
        if waiting:
            time.sleep(interval)
    return replies
