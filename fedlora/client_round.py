"""What a client does in a round, free of Flower: load the global state, K local steps of its task's loss, then
its message (or update) clipped, sketched and noised as the round's mechanism says. ``clients`` is the thin Flower
glue around this; the server's side is ``fedlora.server_round``; what both read, ``fedlora.round_plan``.

With message = "update" a client sends the change from the global state it started from; for FlexLoRA the change
is that of each layer's product, B_c A_c - B A (m x k, clipped with the rest of the message, so its sensitivity is
the clip norm). With noise at the server, clients send their constrained (clipped, sketched) messages without noise.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from fedlora.algorithms import LoRAMode
from fedlora.lora import LoRAFactors, message_parameters
from fedlora.mechanisms import Message, Mechanism, message_norm
from fedlora.round_plan import LORA, PROBE, GlobalState, RoundPlan, derive_seed
from fedlora.sketch import PRODUCT, Side, layer_of, side_of
from fedlora.training import local_train, local_train_clients, to_host

T, R = TypeVar("T"), TypeVar("R")


@dataclass(frozen=True)
class ClientRound:
    release: Message  # what the client sends
    train_loss: float
    train_seconds: float  # loading the global state and K local steps
    privatize_seconds: float  # clip + sketch + noise
    clip_bit: float | None = None  # adaptive clipping: [norm <= clip norm], noised when the noise is the client's


@dataclass(frozen=True)
class TrainedClients:
    """Clients of one group after their local training (``ClientSide.train_clients``), before their release."""
    messages: list[Message]  # each client's message, on the host
    start: Message  # the message they started from, on the host
    losses: list[float]  # each client's mean training loss
    train_seconds: float  # loading the global state and K local steps: each client's share of the group's


def overlapped(items: Sequence[T], train: Callable[[T], TrainedClients], release: Callable[[T, TrainedClients], R], *,
               background: bool = True) -> list[R]:
    """``release(item, train(item))`` for each item, in order. With ``background`` (a GPU), each release runs on one
    thread of the host while the next item trains: a group's release (clip, sketch, noise) is host work, and the
    device would idle through it; one release at a time is pending, so that a failed release stops the work after
    one more item and trained items do not pile up. Without (a CPU), one after the other: the thread would take a
    core that a Ray worker did not reserve. ``ClientSide.release_clients`` needs nothing of the device or of the
    model being trained."""
    if not background:
        return [release(item, train(item)) for item in items]
    released: list[R] = []
    with ThreadPoolExecutor(max_workers=1) as host:
        pending = None
        for item in items:
            trained = train(item)
            if pending is not None:
                released.append(pending.result())
            pending = host.submit(release, item, trained)
        if pending is not None:
            released.append(pending.result())
    return released


class ClientSide(RoundPlan):
    """A client's part of a round, for one run configuration: training, then the release."""

    def _set_trainable(self, model, phase: str) -> None:
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.requires_grad_(phase == LORA and (self.mode is LoRAMode.FLEX or "lora_B" in name))
            elif "modules_to_save" in name:
                param.requires_grad_(phase == PROBE or self.config.head == "message")

    def update_of(self, start: Message, end: Message) -> Message:
        """A client's update from the message it started from to the one it ended with: entry by entry, or for
        FlexLoRA's LoRA rounds the change of each layer's product B A (and of the head)."""
        if not self.sends_products or not any(side_of(n) is Side.RIGHT for n in end):
            return {n: t - start[n] for n, t in end.items()}
        out = {}
        for name in end:
            if side_of(name) is Side.LEFT:
                layer = layer_of(name)
                a0, a1 = start[f"{layer}.lora_A"].double(), end[f"{layer}.lora_A"].double()
                out[f"{layer}.{PRODUCT}"] = (end[name].double() @ a1 - start[name].double() @ a0).to(end[name].dtype)
            elif side_of(name) is Side.DENSE:
                out[name] = end[name] - start[name]
        return out

    def local_round(self, model, base: dict[str, LoRAFactors], dataset, state: GlobalState, *, round_: int,
                    partition_id: int, noise: torch.Generator | None, release: int | None = None,
                    clip_norm: float | None = None) -> ClientRound:
        """One client's round: load the global state, K local SGD steps, clip, privatize. ``release`` (default:
        the round) seeds the sketch and the batches; ``clip_norm`` is the round's (adaptive clipping)."""
        return self.local_rounds(model, base, [dataset], state, round_=round_, partition_ids=[partition_id],
                                 noises=[noise], release=release, clip_norm=clip_norm)[0]

    def local_rounds(self, model, base: dict[str, LoRAFactors], datasets: Sequence, state: GlobalState, *,
                     round_: int, partition_ids: Sequence[int], noises: Sequence[torch.Generator | None],
                     release: int | None = None, clip_norm: float | None = None) -> list[ClientRound]:
        """The rounds of several clients of one rank, each what ``local_round`` gives it alone: ``train_clients``,
        then ``release_clients``."""
        trained = self.train_clients(model, base, datasets, state, round_=round_, partition_ids=partition_ids,
                                     release=release)
        return self.release_clients(trained, round_=round_, noises=noises, release=release, clip_norm=clip_norm)

    def train_clients(self, model, base: dict[str, LoRAFactors], datasets: Sequence, state: GlobalState, *,
                      round_: int, partition_ids: Sequence[int], release: int | None = None) -> TrainedClients:
        """The local training of several clients of one rank, from the global state: together (one forward and
        backward per local step, ``local_train_clients``) when there are several. Their messages come back on
        the host, so that releasing them (``release_clients``) needs nothing of the device or the model."""
        started = time.perf_counter()
        release = round_ if release is None else release
        self.load_global(model, state, base)
        phase = self.phase(round_)
        self._set_trainable(model, phase)
        start = self.client_message_on_host(model, phase)
        generators = [torch.Generator().manual_seed(derive_seed(self.config.seed, "batches", release, p))
                      for p in partition_ids]
        # the training transform's random flips draw from torch's global generator: seeded per client round, or
        # runs with the same seed differ with the worker that happened to run the client
        augment = [derive_seed(self.config.seed, "augment", release, p) for p in partition_ids]
        train = dict(steps=self.config.local_steps, batch_size=self.config.batch_size, lr=self.config.lr,
                     optimizer=self.config.local_optimizer, precision=self.config.precision, task=self.config.task)
        if len(datasets) == 1:
            torch.manual_seed(augment[0])
            losses = [local_train(model, datasets[0], generator=generators[0], **train)]
            messages = [self.client_message_on_host(model, phase)]
        else:
            trained, losses = local_train_clients(model, datasets, generators=generators, augment_seeds=augment,
                                                  **train)
            messages = self.client_messages(model, phase, trained)
        return TrainedClients(messages, start, losses, (time.perf_counter() - started) / len(datasets))

    def release_clients(self, trained: TrainedClients, *, round_: int, noises: Sequence[torch.Generator | None],
                        release: int | None = None, clip_norm: float | None = None,
                        guard: Callable[[Message, Mechanism], Message] | None = None) -> list[ClientRound]:
        """Each trained client's round: its message (or update) clipped and privatized with its own noise, on the
        host; safe in another thread than the training's (its randomness is the ``noises`` and the round's seeded
        sketches). ``guard`` sees each message and its mechanism first, and gives the message to privatize, or
        refuses it by raising (a node's own budget)."""
        release = round_ if release is None else release
        rounds = []
        for message, loss, noise in zip(trained.messages, trained.losses, noises):
            privatizing = time.perf_counter()
            if not all(bool(torch.isfinite(t).all()) for t in message.values()):
                # that training diverged is a fact about the client's data: an error reply would tell the server
                # unnoised (and shrink the round's sum); the node's log says it, the reply is the message it started
                # from (an update of zero), privatized and counted as any reply
                logging.getLogger("fedlora").warning("round %s: a client's local training diverged (its message is "
                                                     "not finite); it replies with no change, privatized", round_)
                message = dict(trained.start)
            if self.sends_updates:
                message = self.update_of(trained.start, message)
            if guard is not None:
                message = guard(message, self.mechanism_for(round_, clip_norm))
            out, bit = self.privatize(message, round_=round_, release=release, noise=noise, clip_norm=clip_norm)
            rounds.append(ClientRound(out, loss, trained.train_seconds, time.perf_counter() - privatizing, bit))
        return rounds

    def client_message_on_host(self, model, phase: str) -> Message:
        """``client_message`` copied to the host in one copy."""
        message = self.client_message(model, phase)
        return dict(zip(message, to_host(message.values())))

    def client_messages(self, model, phase: str, trained: dict[str, torch.Tensor]) -> list[Message]:
        """Each client's ``client_message`` on the host, from the clients' trained parameters stacked (parameter
        name -> (M, ...), as ``local_train_clients`` gives them) and, for entries no client trained, the model's:
        one copy from the device for the group, not one per client and entry."""
        shared, behind = self.client_message(model, phase), message_parameters(model)
        own = [n for n in shared if behind[n] in trained]
        values = dict(zip([*own, *(n for n in shared if n not in own)],
                          to_host([*(trained[behind[n]] for n in own), *(shared[n] for n in shared if n not in own)])))
        clients = len(next(iter(trained.values())))
        return [{n: values[n][m] if n in own else values[n] for n in shared} for m in range(clients)]

    def privatize(self, message: Message, *, round_: int, release: int, noise: torch.Generator | None,
                  clip_norm: float | None = None) -> tuple[Message, float | None]:
        """A client's release of ``message`` in ``round_`` and, under adaptive clipping, its clip bit."""
        mechanism = self.mechanism_for(round_, clip_norm)
        out = mechanism.privatize(message, key=self.key(release), noise=noise)
        if self.clipping is None:
            return out, None
        return out, self.clipping.client_bit(message_norm(message), mechanism.clip_norm, noise)
