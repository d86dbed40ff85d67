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
           progress: Callable[[int, int], None] = lambda arrived, sent: None,
           clients: Callable[[int], int] = lambda node: 1) -> list[Message]:
    """Flower's send_and_receive, telling ``progress`` how many clients' replies (error replies included) have
    arrived of how many were sent, as they arrive: push, then pull until every message is answered or the timeout
    passes. ``clients``: how many clients the message to a node carries (several in a simulation's packed
    messages)."""
    weight = {message.metadata.dst_node_id: clients(message.metadata.dst_node_id) for message in messages}
    if getattr(grid, "synchronous", False):  # answers every message before it returns: nothing to watch
        progress(0, sum(weight.values()))
        replies = list(grid.send_and_receive(messages, timeout=timeout))
        progress(sum(weight.get(r.metadata.src_node_id, 1) for r in replies), sum(weight.values()))
        return replies
    # as Flower's own loop, at the grid's own pace; a message the grid could not push (no id) is not waited for
    pushed = {message_id for message_id in grid.push_messages(messages) if message_id}
    # a grid names each message it pushes (in the message too); one it could not push is not waited for
    waiting = {m.metadata.message_id: weight[m.metadata.dst_node_id] for m in messages
               if m.metadata.message_id in pushed}
    sent, replies, arrived_clients = sum(waiting.values()), [], 0
    interval = getattr(grid, "pull_interval", PULL_INTERVAL)
    progress(0, sent)
    end = time.monotonic() + (timeout if timeout is not None else float("inf"))
    while waiting and time.monotonic() < end:
        arrived = list(grid.pull_messages(list(waiting)))
        if arrived:
            replies += arrived
            arrived_clients += sum(waiting.pop(reply.metadata.reply_to_message_id, 0) for reply in arrived)
            progress(arrived_clients, sent)
        if waiting:
            time.sleep(interval)
    return replies
