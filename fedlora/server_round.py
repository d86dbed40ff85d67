"""What the server does in a round, free of Flower: check each reply against what the mechanism allows, aggregate
(FFA: the mean; Flex: the top-r SVD of the mean product), add the noise where it is the server's, and apply the
mean update with the server optimizer. ``strategies`` is the thin Flower glue around this; the client's side is
``fedlora.client_round``; what both read, ``fedlora.round_plan``.

With message = "update" the server applies the (de-sketched) noisy mean with its optimizer: the global state then
stays dense. For FlexLoRA the server keeps the dense product W of every layer, applies the mean change to it, and
sends clients the top-r SVD of W (an update of the factors is not an update of their product). With noise at the
server, the server noises the sum of the clients' constrained messages before anything else sees it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fedlora.aggregation import mean_message, redistribute, sum_message, svd_of_mean_product
from fedlora.algorithms import LoRAMode
from fedlora.mechanisms import Message, Mechanism, NoisePlacement, message_norm
from fedlora.round_plan import DENSE, LORA, PROBE, GlobalState, RoundPlan, flex_norm_scale
from fedlora.server_optimizer import ServerOptimizer
from fedlora.sketch import NoSketch, Side, is_product, layer_of, side_of


class ServerSide(RoundPlan):
    """The server's part of a round, for one run configuration: validation, aggregation, the server's noise."""

    def new_optimizer(self) -> ServerOptimizer | None:
        """The server optimizer that applies mean updates (message = update), else None."""
        c = self.config
        return ServerOptimizer(c.server_optimizer, lr=c.server_lr, momentum=c.server_momentum) \
            if self.sends_updates else None

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
