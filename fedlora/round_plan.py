"""What both sides of a round read, free of Flower: the run's plan (its phases, each phase's mechanism, the layout of a
client's message, the release each round makes for the accountant), the global state and how it becomes a model,
and the seeds and randomness both sides derive. ``fedlora.client_round`` (what a client does) and
``fedlora.server_round`` (what the server does) each build on this and on nothing of the other.

The global state is the aggregate of the last round, in sketched space when the mechanism sketches
(FFA: mean of R B_c; Flex: top-r SVD of the mean of (R B_c)(A_c R_A)), together with the release whose
sketches produced it. A client de-sketches it with that release's R before training; the server does the same to
evaluate it.

Rounds are numbered 1..T; releases count every time clients were sampled, retries included. Without
retries the two are equal. Sketches, noise and batches are seeded by the release, so a retried round
never reuses a sketch or noise.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from fedlora.aggregation import truncate
from fedlora.algorithms import LoRAMode, get_algorithm, make_mechanism
from fedlora.clipping import QuantileClipping
from fedlora.config import RunConfig
from fedlora.lora import LoRAFactors, build_lora_model, from_message, get_adapters, get_head, set_adapters, set_head, \
    to_message
from fedlora.mechanisms import Message, Mechanism, NoisePlacement, gaussian_mechanism
from fedlora.privacy.events import GaussianRelease, NonPrivateRelease, Release, SketchedRelease, sum_of_replies
from fedlora.secure_sum import SkellamSecureSum, os_generator
from fedlora.sketch import PRODUCT, NoSketch, SketchKey, Side, is_product, layer_of, side_of
from fedlora.training import store_backbone

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


class RoundPlan:
    """The plan of one run configuration (and its calibrated noise multipliers) that both sides of a round share."""

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

    def key(self, release: int) -> SketchKey:
        return SketchKey(self.sketch_seed, release)

    # -- the model and the message ---------------------------------------------------------------
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

    # -- what a round releases, for the accountant -------------------------------------------------
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

    # -- randomness: seeded in simulations that ask for it, else the OS's -------------------------
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

    def server_noise(self, release: int) -> torch.Generator | None:
        """The server's noise (noise at the server): seeded from the run seed in simulations that ask for it,
        else None, the OS's secure randomness."""
        if self.config.noise_source != "seeded":
            return None
        return torch.Generator().manual_seed(derive_seed(self.config.seed, "server-noise", release))


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

