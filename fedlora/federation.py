"""Both sides of a round in one process, for what simulates a whole federation without Flower's processes: tests,
benchmarks, the CLI's shape reports. A deployment never holds both: its clients run ``fedlora.client_round`` and its
server ``fedlora.server_round``, over the plan they share (``fedlora.round_plan``)."""

from __future__ import annotations

from fedlora.client_round import ClientSide
from fedlora.server_round import ServerSide


class Protocol(ClientSide, ServerSide):
    """A client's and the server's parts of a round, for one run configuration (and its noise multipliers)."""
