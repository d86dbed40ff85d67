"""One round of the protocol, free of Flower: what a client does with the global adapters, and what the
server does with the replies. ``strategies`` and ``clients`` are thin Flower glue around this.

The global state is the aggregate of the last round, in sketched space when the mechanism sketches
(FFA: mean of R B_c; Flex: top-r SVD of the mean of (R B_c)(A_c R_A)), together with the release whose
sketches produced it. A client de-sketches it with that release's R before training.

With message = "update" a client sends the change from the global state it started from, and the server
applies the (de-sketched) noisy mean with its optimizer: the global state then stays dense. For FlexLoRA the
change is that of each layer's product, B_c A_c - B A (m x k, clipped with the rest of the message, so its
sensitivity is the clip norm): the server keeps the dense product W of every layer, applies the mean change to
it, and sends clients the top-r SVD of W (an update of the factors is not an update of their product). With noise at
the server, clients send their constrained (clipped, sketched) messages without noise and the server
noises their sum before anything else sees it.

Rounds are numbered 1..T; releases count every time clients were sampled, retries included. Without
retries the two are equal. Sketches, noise and batches are seeded by the release, so a retried round
never reuses a sketch or noise.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor

from fedlora.aggregation import mean_message, redistribute, sum_message, svd_of_mean_product, truncate
from fedlora.algorithms import LoRAMode, get_algorithm, make_mechanism
from fedlora.config import RunConfig
from fedlora.lora import (LoRAFactors, build_lora_model, from_message, get_adapters, get_head, message_parameters,
                          set_adapters, set_head, to_message)
from fedlora.clipping import QuantileClipping
from fedlora.mechanisms import Message, Mechanism, NoisePlacement, gaussian_mechanism, message_norm
from fedlora.privacy.events import GaussianRelease, NonPrivateRelease, Release, SketchedRelease, sum_of_replies
from fedlora.secure_sum import SkellamSecureSum, os_generator
from fedlora.server_optimizer import ServerOptimizer
from fedlora.sketch import PRODUCT, NoSketch, SketchKey, Side, is_product, layer_of, side_of
from fedlora.training import local_train, local_train_clients, store_backbone, to_host

T, R = TypeVar("T"), TypeVar("R")
DENSE = 0  # GlobalState.produced_by for a state that is not sketched
PROBE, LORA = "linear-probe", "lora"  # the phases of a run


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from named parts (run seed, purpose, round, client), stable across processes."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class GlobalState:
    message: Message  # "<layer>.lora_B", "<layer>.lora_A" (Flex), head entries; dense or sketched; FlexLoRA
    # updates: also the server's dense product "<layer>.lora_BA" of every layer, which clients never download
    produced_by: int  # the release whose sketches produced ``message``; DENSE if not sketched

    @property
    def broadcast(self) -> Message:
        """What clients download: everything but the server's dense products."""
        return {n: t for n, t in self.message.items() if not is_product(n)}


@dataclass(frozen=True)
class ClientRound:
    release: Message  # what the client sends
    train_loss: float
    train_seconds: float  # loading the global state and K local steps
    privatize_seconds: float  # clip + sketch + noise
    clip_bit: float | None = None  # adaptive clipping: [norm <= clip norm], noised when the noise is the client's


@dataclass(frozen=True)
class TrainedClients:
    """Clients of one group after their local training (``Protocol.train_clients``), before their release."""
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
    core that a Ray worker did not reserve. ``Protocol.release_clients`` needs nothing of the device or of the
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


class Protocol:
    """The round logic of one run configuration (and its calibrated noise multiplier)."""

    def __init__(self, config: RunConfig, noise_multiplier: float, probe_noise_multiplier: float = 0.0):
        self.config = config
        self.algorithm = get_algorithm(config.strategy)
        self.mode = self.algorithm.family
        self.noise_multiplier = noise_multiplier
        self.probe_noise_multiplier = probe_noise_multiplier
        clip = config.clip_norm if self.algorithm.private else None
        # a strategy without noise has no placement: its clients' messages are aggregated as they come
        self.placement = NoisePlacement(config.noise_placement if self.algorithm.private else "client")
        self.mechanism = make_mechanism(
            self.algorithm, clip_norm=clip, noise_multiplier=noise_multiplier if self.algorithm.private else 0.0,
            sketch_dim=config.effective_sketch_dim(), threat_model=config.threat_model, placement=self.placement)
        # The linear probe releases the dense head: the Gaussian mechanism (or none, for non-private strategies).
        self.probe_mechanism = (gaussian_mechanism(clip_norm=clip, noise_multiplier=probe_noise_multiplier,
                                                   placement=self.placement)
                                if self.algorithm.private else self.mechanism)
        self.sends_updates = config.message == "update"
        self.sends_products = self.sends_updates and self.mode is LoRAMode.FLEX  # FlexLoRA: changes of B A
        self.clipping = (QuantileClipping(config.clip_quantile, config.clip_lr, config.count_stddev(), self.placement)
                         if config.clip_quantile and self.algorithm.private else None)
        self.sketch_seed = derive_seed(config.seed, "sketch", config.threat_model)

    def describe(self) -> str:
        """One line: the mechanism, then what clients send and how the clip norm is chosen, where not the paper's."""
        c, parts = self.config, [self.mechanism.describe()]
        if self.sends_updates:
            momentum = f", momentum {c.server_momentum:g}" if c.server_optimizer != "sgd" else ""
            what = "the change of each layer's product B A" if self.sends_products else "updates"
            parts.append(f"clients send {what}, applied by server {c.server_optimizer} (lr {c.server_lr:g}{momentum})"
                         + (f" to its dense products, whose top-{c.rank} SVD clients download"
                            if self.sends_products else ""))
        if self.clipping is not None:
            parts.append(f"adaptive clip norm from {c.clip_norm:g}, tracking the {c.clip_quantile:g} quantile (step "
                         f"{c.clip_lr:g}, count noise {self.clipping.count_stddev:g}, accounted)")
        return "; ".join(parts)

    # -- phases (head = probe: a private linear probe, then LoRA with the head frozen) -------------
    def phase(self, round_: int) -> str:
        return PROBE if round_ <= self.config.linear_probe_rounds() else LORA

    def mechanism_for(self, round_: int, clip_norm: float | None = None) -> Mechanism:
        """The mechanism of ``round_``'s phase, at ``clip_norm`` when adaptive clipping has moved it."""
        mechanism = self.probe_mechanism if self.phase(round_) == PROBE else self.mechanism
        return mechanism.with_clip_norm(clip_norm) if clip_norm and mechanism.clip_norm else mechanism

    def new_optimizer(self) -> ServerOptimizer | None:
        """The server optimizer that applies mean updates (message = update), else None."""
        c = self.config
        return ServerOptimizer(c.server_optimizer, lr=c.server_lr, momentum=c.server_momentum) \
            if self.sends_updates else None

    def _set_trainable(self, model, phase: str) -> None:
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.requires_grad_(phase == LORA and (self.mode is LoRAMode.FLEX or "lora_B" in name))
            elif "modules_to_save" in name:
                param.requires_grad_(phase == PROBE or self.config.head == "message")

    # -- models ----------------------------------------------------------------------------------
    def client_rank(self, partition_id: int) -> int:
        ranks = self.config.parsed_client_ranks()
        return ranks[partition_id % len(ranks)] if ranks else self.config.rank

    def build_model(self, rank: int | None = None, device: torch.device | None = None):
        """A client's model: the shared seeded backbone with LoRA of ``rank`` (alpha scaled so alpha / r is fixed);
        with a ``device``, on it and stored as the run's precision stores it (``store_backbone``)."""
        rank = rank or self.config.rank
        model = build_lora_model(self.config.model, num_classes=self.config.classes, rank=rank,
                                 alpha=self.config.lora_alpha * rank / self.config.rank, targets=self.config.targets,
                                 mode=self.mode, seed=self.config.seed, train_head=self.config.head != "frozen")
        return model if device is None else store_backbone(model.to(device), self.config.precision)

    def client_message(self, model, phase: str = LORA) -> Message:
        """What a client sends before privatizing: in LoRA rounds B (and A for Flex) of every layer, and the head
        if it trains with them; in linear-probe rounds the head alone."""
        if phase == PROBE:
            return get_head(model)
        adapters = to_message(get_adapters(model), mode=self.mode)
        return {**adapters, **get_head(model)} if self.config.head == "message" else adapters

    def initial_state(self, model) -> GlobalState:
        adapters = get_adapters(model)
        products = {f"{layer}.{PRODUCT}": b @ a for layer, (a, b) in adapters.items()} if self.sends_products else {}
        return GlobalState({**to_message(adapters, mode=self.mode), **products, **get_head(model)}, DENSE)

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

    def key(self, release: int) -> SketchKey:
        return SketchKey(self.sketch_seed, release)

    def expected_message(self, template: Message, round_: int, rank: int) -> dict[str, tuple[int, ...]]:
        """Entry shapes of a rank-``rank`` client's message (before privatizing) in ``round_``, from a dense,
        full-rank ``template`` such as the initial state."""
        phase, shapes = self.phase(round_), {}
        for name, t in template.items():
            side = side_of(name)
            if side is Side.DENSE:
                if phase == PROBE or self.config.head == "message":
                    shapes[name] = tuple(t.shape)
            elif phase == LORA and is_product(name) == self.sends_products:  # the products, or the factors
                shapes[name] = tuple(t.shape) if is_product(name) else \
                    (t.shape[0], rank) if side is Side.LEFT else (rank, t.shape[1])
        return shapes

    def release_problem(self, release: Message, template: Message, *, round_: int, rank: int,
                        clip_norm: float | None = None, clip_bit: Tensor | None = None) -> str | None:
        """Why a client's release cannot be honest (wrong entries, shapes or dtype, NaN/Inf, a norm above what
        the mechanism allows, a missing or impossible clip bit under adaptive clipping), or None."""
        expected = self.expected_message(template, round_, rank)
        if set(release) != set(expected):
            odd = sorted(set(release) ^ set(expected))
            return f"its entries differ from the expected ones ({', '.join(odd[:3])}{', ...' if len(odd) > 3 else ''})"
        mechanism = self.mechanism_for(round_, clip_norm)
        if self.clipping is not None and (problem := self._clip_bit_problem(clip_bit)):
            return problem
        for name, shape in mechanism.released_shapes(expected).items():
            t = release[name]
            if tuple(t.shape) != shape:
                return f"'{name}' has shape {tuple(t.shape)}, not {shape}"
            if t.dtype != template[name].dtype:
                return f"'{name}' has dtype {t.dtype}, not {template[name].dtype}"
            if not torch.isfinite(t).all():
                return f"'{name}' holds NaN or Inf"
        norm, allowance = message_norm(release), mechanism.norm_allowance(expected)
        if norm > allowance:
            if self.placement is NoisePlacement.SERVER:  # a single message's value stays out of the logs
                return f"its norm exceeds what the mechanism allows ({allowance:.4g})"
            return f"its norm {norm:.4g} exceeds what the mechanism allows ({allowance:.4g})"
        return None

    def _clip_bit_problem(self, bit: Tensor | None) -> str | None:
        if bit is None:
            return "it carries no clip bit (adaptive clipping)"
        if bit.numel() != 1 or bit.dtype != torch.float64 or not torch.isfinite(bit).all():
            return "its clip bit is not one finite float64"
        value = float(bit)
        if self.placement is NoisePlacement.SERVER and value not in (0.0, 1.0):
            return "its clip bit is neither 0 nor 1"
        if abs(value - 0.5) > self.clipping.bit_allowance():
            return "its clip bit lies outside what the count's noise allows"
        return None

    # -- client side -----------------------------------------------------------------------------
    def load_global(self, model, state: GlobalState, base: dict[str, LoRAFactors]) -> None:
        """De-sketches the global state with its round's R, truncates to the client's rank, loads it."""
        message = state.message
        if state.produced_by != DENSE:
            shapes = {}
            for name in message:
                layer = layer_of(name)
                if side_of(name) is Side.LEFT:
                    shapes[name] = (base[layer].B.shape[0], self.config.rank)
                elif side_of(name) is Side.RIGHT:
                    shapes[name] = (self.config.rank, base[layer].A.shape[1])
                else:
                    shapes[name] = message[name].shape
            message = self.mechanism.desketch(message, key=self.key(state.produced_by), shapes=shapes)
        client_rank = next(iter(base.values())).A.shape[0]
        device = next(model.parameters()).device
        loaded = {}
        for layer, (a, b) in from_message({n: t for n, t in message.items() if side_of(n) is not Side.DENSE},
                                          base).items():
            if b.shape[1] > client_rank:  # a weaker client takes the top components (FlexLoRA)
                b, a = truncate(b, a, client_rank)
            loaded[layer] = LoRAFactors(a.to(device), b.to(device))
        set_adapters(model, loaded)
        set_head(model, {n: t.to(device) for n, t in message.items() if side_of(n) is Side.DENSE})

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
                     optimizer=self.config.local_optimizer, precision=self.config.precision)
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

    # -- secure aggregation (noise-placement = "secagg") ------------------------------------------------
    def secure_sum(self, mechanism: Mechanism, released: dict[str, tuple[int, ...]]) -> SkellamSecureSum:
        """The integer encoding and noise shares, under SecAgg+, of a release with entry shapes ``released``: its
        ``secure_message``, of norm <= tau (kappa for FlexLoRA's products)."""
        tau = mechanism.clip_norm
        flex = any(side_of(n) is Side.RIGHT for n in released)
        norm = tau * flex_norm_scale(tau, any(side_of(n) is Side.DENSE for n in released)) if flex else tau
        return SkellamSecureSum(mechanism.noise_multiplier, norm, self.config.clients_per_round,
                                self.config.required_replies(),
                                sum(math.prod(shape) for shape in self.secure_shapes(released).values()))

    @staticmethod
    def secure_message(release: Message) -> Message:
        """What a client encodes under SecAgg+: its release, or for FlexLoRA's LoRA rounds what the server's SVD sums,
        its products B A per layer (keyed by the layer) and its head."""
        if not any(side_of(n) is Side.RIGHT for n in release):
            return dict(release)
        products = {layer: release[f"{layer}.lora_B"].double() @ release[f"{layer}.lora_A"].double()
                    for layer in (layer_of(n) for n in release if side_of(n) is Side.LEFT)}
        return {**products, **{n: t for n, t in release.items() if side_of(n) is Side.DENSE}}

    @staticmethod
    def secure_shapes(released: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The entry shapes of ``secure_message`` of a release with entry shapes ``released``."""
        if not any(side_of(n) is Side.RIGHT for n in released):
            return dict(released)
        return {**{layer_of(n): (shape[0], released[f"{layer_of(n)}.lora_A"][1])
                   for n, shape in released.items() if side_of(n) is Side.LEFT},
                **{n: shape for n, shape in released.items() if side_of(n) is Side.DENSE}}

    def release_of(self, message: Message, mechanism: Mechanism) -> tuple[Release, ...]:
        """What one round of ``mechanism`` on ``message`` releases, for the accountant. With noise at each client and
        fixed-size sampling, the model is the mean of at least N_min (required replies) noised replies, so its
        Gaussian parts carry N_min clients' noise (``GaussianRelease.shares``); what one reply carries stays
        ``one_reply()``. A secret sketch's release is accounted per message, as its bound is."""
        if self.placement is NoisePlacement.SECAGG and mechanism.private:
            return (self.secure_sum(mechanism, mechanism.released_shapes({n: tuple(t.shape)
                                                                          for n, t in message.items()})).release(),)
        release = mechanism.release_of(message, clients_per_round=self.config.clients_per_round)
        if self.placement is NoisePlacement.CLIENT and self.config.sampling == "fixed" and mechanism.private \
                and self.model_is_mean_of_replies and not any(isinstance(part, SketchedRelease) for part in release):
            return tuple(sum_of_replies(part, self.config.required_replies()) for part in release)
        return release

    @property
    def model_is_mean_of_replies(self) -> bool:
        """Whether the server's model is a function of the mean of the replies, so that it carries their noise summed:
        not FlexLoRA's adapter form, whose model is the SVD of the mean of products of separately noised factors."""
        return not (self.mode is LoRAMode.FLEX and not self.sends_updates)

    def unprotected_to_server(self, mechanism: Mechanism) -> str | None:
        """Why a client's reply under ``mechanism`` carries no noise of its own that a server not following the
        protocol could not remove or get around; None where it does."""
        if not mechanism.private:
            return f"{self.config.strategy} adds no noise"
        if self.config.noise_source == "seeded":
            return 'its noise is drawn from the run seed, which the server holds (noise-source = "seeded")'
        if self.placement is NoisePlacement.SERVER:
            return 'the noise is added by the server (noise-placement = "server")'
        if not (isinstance(mechanism.sketch, NoSketch) or mechanism.clips_after_sketch):
            return ("under the secret-sketch threat model the message is clipped before the sketch, which bounds "
                    "nothing against a server that learns R")
        return None

    def release_to_server(self, message: Message, mechanism: Mechanism) -> tuple[Release, ...]:
        """What one client's reply of ``message`` under ``mechanism`` releases to a server that knows the reply was its
        own and may not follow the protocol (a node's own budget, fedlora.privacy.node_budget): only the noise the
        client adds itself from the OS's randomness, at the multiplier it used; under secure aggregation its own
        share (the server may hold every other reply of the sum)."""
        if self.unprotected_to_server(mechanism):
            return (NonPrivateRelease(),)
        if self.placement is NoisePlacement.SECAGG:
            return tuple(part.one_reply() for part in self.release_of(message, mechanism))
        bit = (self.clipping.release(),) if self.clipping is not None else ()  # noised by the client too
        return (GaussianRelease(mechanism.noise_multiplier), *bit)

    def secure_noise(self, release: int, partition_id: int):
        """The generator of a client's integer noise share and rounding: seeded in simulations that ask for it,
        else seeded from the OS's secure randomness."""
        if self.config.noise_source != "seeded":
            return os_generator()
        return np.random.default_rng(derive_seed(self.config.seed, "secure-noise", release, partition_id))

    def sampling_generator(self, release: int) -> np.random.Generator:
        """The generator of a release's sample: seeded in simulations that ask for it, else seeded from the OS's
        secure randomness. Every SuperNode receives the run seed (and it defaults to 0), so a sample drawn from it
        would be known to every client, and the epsilon against observers of the model, amplified because they do
        not know who took part, would not hold against them."""
        if self.config.noise_source != "seeded":
            return os_generator()
        return np.random.default_rng(derive_seed(self.config.seed, "sampling", release))

    def client_noise(self, release: int, partition_id: int) -> torch.Generator | None:
        """A client's noise: seeded from the run seed in simulations that ask for it, else None, the OS's secure
        randomness (deployed clients)."""
        if self.config.noise_source != "seeded":
            return None
        return torch.Generator().manual_seed(derive_seed(self.config.seed, "noise", release, partition_id))

    # -- server side -----------------------------------------------------------------------------
    def server_noise(self, release: int) -> torch.Generator | None:
        """The server's noise (noise at the server): seeded from the run seed in simulations that ask for it,
        else None, the OS's secure randomness."""
        if self.config.noise_source != "seeded":
            return None
        return torch.Generator().manual_seed(derive_seed(self.config.seed, "server-noise", release))

    def denominator(self, replies: int) -> float:
        """What the sum of the releases is divided by. With noise at the server under Poisson sampling, the
        expected N: the number of participants is not released (McMahan et al. 2018's fixed denominator)."""
        if self.placement is NoisePlacement.SERVER and self.config.sampling == "poisson":
            return float(self.config.clients_per_round)
        return float(replies)

    def aggregate(self, releases: Sequence[Message], round_: int, previous: GlobalState,
                  release: int | None = None, *, clip_norm: float | None = None, noise: torch.Generator | None = None,
                  optimizer: ServerOptimizer | None = None, summed: int = 0) -> GlobalState:
        """FFA: the mean of the releases. Flex: the top-r SVD of the mean B A product, per layer, in the
        releases' space; dense entries (the head) are averaged. With noise at the server, the sum gets the
        noise (``noise``, for the round's ``clip_norm``) before it is divided. With updates, the mean update is
        de-sketched and applied by ``optimizer``. Entries no client sent (the adapters during a linear probe,
        the frozen head after it) stay as they were. ``release`` (default: the round) names the sketches the
        releases were made with. ``summed`` > 0: ``releases`` is one sum of that many releases, its noise in it
        (secure aggregation)."""
        release = round_ if release is None else release
        mechanism = self.mechanism_for(round_, clip_norm)
        phase = self.phase(round_)
        sketched = phase == LORA and not isinstance(self.mechanism.sketch, NoSketch)
        if self.mode is LoRAMode.FLEX and phase == LORA and not self.sends_updates:
            return GlobalState({**previous.message, **self._flex_mean(releases, mechanism, noise, previous, summed)},
                               release if sketched else DENSE)
        if mechanism.placement is NoisePlacement.CLIENT:
            mean = mean_message(releases)
        else:  # noise at the server: added to the sum here; under secure aggregation: already in it
            # summed and noised in float64, rounded after the noise (a decoded secure sum is float64 already)
            total, count = ((releases[0], summed) if summed
                            else (sum_message([{n: t.double() for n, t in r.items()} for r in releases]),
                                  len(releases)))
            denominator = self.denominator(count)
            mean = {n: (t / denominator).to(previous.message[n].dtype)
                    for n, t in mechanism.noise_sum(total, noise).items()}
        if not self.sends_updates:
            produced_by = previous.produced_by if phase == PROBE else release if sketched else DENSE
            return GlobalState({**previous.message, **mean}, produced_by)
        if sketched:
            mean = mechanism.desketch(mean, key=self.key(release),
                                      shapes={n: tuple(previous.message[n].shape) for n in mean})
        stepped = optimizer.step(previous.message, mean)
        return GlobalState({**previous.message, **stepped, **self._factors_of(stepped)}, DENSE)

    def _factors_of(self, message: Message) -> Message:
        """FlexLoRA's global factors from the server's dense products in ``message``: the top-r SVD of each."""
        out = {}
        for name, w in message.items():
            if is_product(name):
                layer = layer_of(name)
                b, a = redistribute(*torch.linalg.svd(w.double(), full_matrices=False), self.config.rank,
                                    self.config.svd_split)
                out[f"{layer}.lora_A"], out[f"{layer}.lora_B"] = a.to(w.dtype), b.to(w.dtype)
        return out

    def _flex_mean(self, releases: Sequence[Message], mechanism: Mechanism, noise, previous: GlobalState,
                   summed: int = 0) -> Message:
        """FlexLoRA's global factors: per layer the top-r SVD of the mean product B A, and the mean head.

        With noise at the server the noise goes on what the SVD sees, the sum of the products: a message of
        norm <= tau has ||B A||_F <= (||B||^2 + ||A||^2) / 2, so the products (and head) of one client have
        norm <= kappa = max(tau^2 / 2, tau) with a head, tau^2 / 2 without, and the sum gets N(0, (z kappa)^2):
        the same Gaussian release, in units of kappa, as the client's own noise in units of tau. Under secure
        aggregation (``summed``) ``releases`` is that sum (``secure_message``), its noise in it."""
        layers = [layer_of(name) for name in previous.message if side_of(name) is Side.LEFT]
        dtype = next(t for n, t in previous.message.items() if side_of(n) is Side.LEFT).dtype
        out: Message = {}
        if mechanism.placement is NoisePlacement.CLIENT:
            dense = [{n: t for n, t in r.items() if side_of(n) is Side.DENSE} for r in releases]
            factors = {}
            for layer in layers:
                bs = [r[f"{layer}.lora_B"].double() for r in releases]
                as_ = [r[f"{layer}.lora_A"].double() for r in releases]
                factors[layer] = svd_of_mean_product(bs, as_)
            head = mean_message(dense) if dense[0] else {}
        else:
            total, count = ((releases[0], summed) if summed
                            else (sum_message([self.secure_message(r) for r in releases]), len(releases)))
            tau = mechanism.clip_norm
            scale = flex_norm_scale(tau, any(n not in layers for n in total))
            noisy = {n: t / self.denominator(count) for n, t in mechanism.noise_sum(total, noise, scale=scale).items()}
            factors = {layer: torch.linalg.svd(noisy.pop(layer), full_matrices=False) for layer in layers}
            head = {n: t.to(dtype) for n, t in noisy.items()}
        for layer, (u, s, vt) in factors.items():
            b, a = redistribute(u, s, vt, min(self.config.rank, s.numel()), self.config.svd_split)
            pad = self.config.rank - b.shape[1]  # fewer singular values than r: the rest are zero
            b, a = torch.nn.functional.pad(b, (0, pad)), torch.nn.functional.pad(a, (0, 0, 0, pad))
            out[f"{layer}.lora_A"], out[f"{layer}.lora_B"] = a.to(dtype), b.to(dtype)
        return {**out, **head}


def flex_norm_scale(tau: float, head: bool) -> float:
    """kappa / tau for FlexLoRA's products (and head) of one client's message of norm <= tau: ||B A||_F <=
    (||B||^2 + ||A||^2) / 2 <= tau^2 / 2, and the head adds at most tau."""
    return max(tau / 2, 1.0) if head else tau / 2


PACKED = "partitions"  # round config of a simulation message that carries several clients: their partition ids
ASSIGNED = "partition"  # round config of a simulation message to one client: the partition its node trains


def packed_key(record: str, partition: int) -> str:
    """The key of one client's record ("arrays", "metrics", "clip-bit") in a reply that carries several."""
    return f"{record}/{partition}"


def num_bytes(message: Message) -> int:
    return sum(t.numel() * t.element_size() for t in message.values())
