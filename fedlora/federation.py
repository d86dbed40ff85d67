"""One round of the protocol, free of Flower: what a client does with the global adapters, and what the
server does with the replies. ``strategies`` and ``clients`` are thin Flower glue around this.

The global state is the aggregate of the last round, in sketched space when the mechanism sketches
(FFA: mean of R B_c; Flex: top-r SVD of the mean of (R B_c)(A_c R_A)), together with the release whose
sketches produced it. A client de-sketches it with that release's R before training.

Rounds are numbered 1..T; releases count every time clients were sampled, retries included. Without
retries the two are equal. Sketches, noise and batches are seeded by the release, so a retried round
never reuses a sketch or noise.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fedlora.aggregation import mean_message, redistribute, svd_of_mean_product, truncate
from fedlora.algorithms import LoRAMode, get_algorithm, make_mechanism
from fedlora.config import RunConfig
from fedlora.lora import (LoRAFactors, build_lora_model, from_message, get_adapters, get_head, set_adapters, set_head,
                          to_message)
from fedlora.mechanisms import Message, gaussian_mechanism, message_norm
from fedlora.sketch import NoSketch, SketchKey, Side, side_of
from fedlora.training import local_sgd

DENSE = 0  # GlobalState.produced_by for a state that is not sketched
PROBE, LORA = "linear-probe", "lora"  # the phases of a run


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from named parts (run seed, purpose, round, client), stable across processes."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class GlobalState:
    message: Message  # "<layer>.lora_B", "<layer>.lora_A" (Flex), head entries; dense or sketched
    produced_by: int  # the release whose sketches produced ``message``; DENSE if not sketched


@dataclass(frozen=True)
class ClientRound:
    release: Message  # what the client sends
    train_loss: float
    train_seconds: float  # loading the global state and K local steps
    privatize_seconds: float  # clip + sketch + noise


class Protocol:
    """The round logic of one run configuration (and its calibrated noise multiplier)."""

    def __init__(self, config: RunConfig, noise_multiplier: float, probe_noise_multiplier: float = 0.0):
        self.config = config
        self.algorithm = get_algorithm(config.strategy)
        self.mode = self.algorithm.family
        self.noise_multiplier = noise_multiplier
        self.probe_noise_multiplier = probe_noise_multiplier
        clip = config.clip_norm if self.algorithm.private else None
        self.mechanism = make_mechanism(
            self.algorithm, clip_norm=clip, noise_multiplier=noise_multiplier if self.algorithm.private else 0.0,
            sketch_dim=config.effective_sketch_dim(), threat_model=config.threat_model)
        # The linear probe releases the dense head: the Gaussian mechanism (or none, for non-private strategies).
        self.probe_mechanism = (gaussian_mechanism(clip_norm=clip, noise_multiplier=probe_noise_multiplier)
                                if self.algorithm.private else self.mechanism)
        self.sketch_seed = derive_seed(config.seed, "sketch", config.threat_model)

    # -- phases (head = probe: a private linear probe, then LoRA with the head frozen) -------------
    def phase(self, round_: int) -> str:
        return PROBE if round_ <= self.config.linear_probe_rounds() else LORA

    def mechanism_for(self, round_: int):
        return self.probe_mechanism if self.phase(round_) == PROBE else self.mechanism

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

    def build_model(self, rank: int | None = None):
        """A client's model: the shared seeded backbone with LoRA of ``rank`` (alpha scaled so alpha / r is fixed)."""
        rank = rank or self.config.rank
        return build_lora_model(self.config.model, num_classes=self.config.num_classes, rank=rank,
                                alpha=self.config.lora_alpha * rank / self.config.rank, targets=self.config.targets,
                                mode=self.mode, seed=self.config.seed, train_head=self.config.head != "frozen")

    def client_message(self, model, phase: str = LORA) -> Message:
        """What a client sends before privatizing: in LoRA rounds B (and A for Flex) of every layer, and the head
        if it trains with them; in linear-probe rounds the head alone."""
        if phase == PROBE:
            return get_head(model)
        adapters = to_message(get_adapters(model), mode=self.mode)
        return {**adapters, **get_head(model)} if self.config.head == "message" else adapters

    def initial_state(self, model) -> GlobalState:
        return GlobalState({**to_message(get_adapters(model), mode=self.mode), **get_head(model)}, DENSE)

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
            elif phase == LORA:
                shapes[name] = (t.shape[0], rank) if side is Side.LEFT else (rank, t.shape[1])
        return shapes

    def release_problem(self, release: Message, template: Message, *, round_: int, rank: int) -> str | None:
        """Why a client's release cannot be honest (wrong entries, shapes or dtype, NaN/Inf, a norm above what
        the mechanism allows), or None."""
        expected = self.expected_message(template, round_, rank)
        if set(release) != set(expected):
            odd = sorted(set(release) ^ set(expected))
            return f"its entries differ from the expected ones ({', '.join(odd[:3])}{', ...' if len(odd) > 3 else ''})"
        mechanism = self.mechanism_for(round_)
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
            return f"its norm {norm:.4g} exceeds what the mechanism allows ({allowance:.4g})"
        return None

    # -- client side -----------------------------------------------------------------------------
    def load_global(self, model, state: GlobalState, base: dict[str, LoRAFactors]) -> None:
        """De-sketches the global state with its round's R, truncates to the client's rank, loads it."""
        message = state.message
        if state.produced_by != DENSE:
            shapes = {}
            for name in message:
                layer = name.rsplit(".", 1)[0]
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
                    partition_id: int, noise: torch.Generator | None, release: int | None = None) -> ClientRound:
        """One client's round: load the global state, K local SGD steps, clip, privatize. ``release`` (default:
        the round) seeds the sketch and the batches."""
        started = time.perf_counter()
        release = round_ if release is None else release
        self.load_global(model, state, base)
        phase = self.phase(round_)
        self._set_trainable(model, phase)
        generator = torch.Generator().manual_seed(derive_seed(self.config.seed, "batches", release, partition_id))
        # the training transform's random flips draw from torch's global generator: seed it per client round,
        # or runs with the same seed differ with the worker that happened to run the client
        torch.manual_seed(derive_seed(self.config.seed, "augment", release, partition_id))
        loss = local_sgd(model, dataset, steps=self.config.local_steps, batch_size=self.config.batch_size,
                         lr=self.config.lr, generator=generator)
        trained = time.perf_counter()
        message = {n: t.detach().cpu() for n, t in self.client_message(model, phase).items()}
        out = self.mechanism_for(round_).privatize(message, key=self.key(release), noise=noise)
        return ClientRound(out, loss, trained - started, time.perf_counter() - trained)

    def simulation_noise(self, release: int, partition_id: int) -> torch.Generator:
        """Seeded client noise, for reproducible simulations only (deployed clients use OS randomness)."""
        return torch.Generator().manual_seed(derive_seed(self.config.seed, "noise", release, partition_id))

    # -- server side -----------------------------------------------------------------------------
    def aggregate(self, releases: Sequence[Message], round_: int, previous: GlobalState,
                  release: int | None = None) -> GlobalState:
        """FFA: the mean of the releases. Flex: the top-r SVD of the mean B A product, per layer, in the
        releases' space; dense entries (the head) are averaged. Entries no client sent (the adapters
        during a linear probe, the frozen head after it) stay as they were. ``release`` (default: the
        round) names the sketches the releases were made with."""
        if self.phase(round_) == PROBE:
            return GlobalState({**previous.message, **mean_message(releases)}, previous.produced_by)
        produced_by = DENSE if isinstance(self.mechanism.sketch, NoSketch) else (round_ if release is None else release)
        if self.mode is LoRAMode.FFA:
            return GlobalState({**previous.message, **mean_message(releases)}, produced_by)
        dense = mean_message([{n: t for n, t in r.items() if side_of(n) is Side.DENSE} for r in releases])
        out: Message = {}
        for name in releases[0]:
            if side_of(name) is not Side.LEFT:
                continue
            layer = name.rsplit(".", 1)[0]
            bs = [r[f"{layer}.lora_B"].double() for r in releases]
            as_ = [r[f"{layer}.lora_A"].double() for r in releases]
            u, s, vt = svd_of_mean_product(bs, as_)
            b, a = redistribute(u, s, vt, min(self.config.rank, s.numel()), self.config.svd_split)
            pad = self.config.rank - b.shape[1]  # fewer singular values than r: the rest are zero
            b, a = torch.nn.functional.pad(b, (0, pad)), torch.nn.functional.pad(a, (0, 0, 0, pad))
            dtype = releases[0][name].dtype
            out[f"{layer}.lora_A"], out[f"{layer}.lora_B"] = a.to(dtype), b.to(dtype)
        return GlobalState({**previous.message, **out, **dense}, produced_by)


def num_bytes(message: Message) -> int:
    return sum(t.numel() * t.element_size() for t in message.values())
