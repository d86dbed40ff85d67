"""A Grid that runs a ClientApp in this process: whole federations without Ray or a SuperLink.

For tests, benchmarks and debugging: the same ServerApp and ClientApp code as a real run, one process.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity


class InProcessGrid(Grid):
    simulation = True  # every client runs in this process: seeded noise and a run-seed sketch secret may run here
    synchronous = True  # send_and_receive answers every message before it returns (no replies to watch arrive)

    def __init__(self, client_app, num_nodes: int, run_config: dict, *, fail: set[int] = frozenset(),
                 node_ids: list[int] | None = None):
        self.client_app = client_app
        self.run_config = run_config
        self.node_ids = list(node_ids or range(1, num_nodes + 1))  # partition i lives on node_ids[i]
        self.contexts = {n: Context(run_id=1, node_id=n, node_config={"partition-id": i, "num-partitions": num_nodes},
                                    state=RecordDict(), run_config=run_config)
                         for i, n in enumerate(self.node_ids)}
        self.fail = set(fail)  # node ids whose client dies while training (no reply arrives)
        # client_app may be any (message, context) -> Message callable: tests wrap the ClientApp to inject faults
        self._ids = itertools.count(1)
        self._run = None
        self.calls: list[int] = []  # node ids sent a training message, in order
        self._as_server()

    def _as_server(self) -> None:
        TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0

    def set_run(self, run) -> None:
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:
        return Message(content=content, message_type=message_type, dst_node_id=dst_node_id, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.node_ids)

    def push_messages(self, messages):
        raise NotImplementedError("use send_and_receive")

    def pull_messages(self, message_ids):
        raise NotImplementedError("use send_and_receive")

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            message.metadata.__dict__["_message_id"] = f"m{next(self._ids)}"
            message.metadata.__dict__["_src_node_id"] = 0
            TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, next(self._ids), node
            if message.metadata.message_type == "train":
                self.calls.append(node)
                if node in self.fail:
                    continue
            try:
                replies.append(self.client_app(message, self.contexts[node]))
            except Exception as error:  # as Flower does: the client's exception becomes an error reply
                replies.append(Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{type(error).__name__}: {error}"),
                                       reply_to=message))
            self._as_server()
        return replies
