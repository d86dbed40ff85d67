"""How the server applies the round's noisy mean update (message = "update"): DP-FedAvg (McMahan et al.
2018) with the adaptive server optimizers of Reddi et al. (2021). Post-processing of the noisy mean, so
no privacy cost. The state (momentum, Adam moments) is plain tensors, saved in the run's checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

OPTIMIZERS = ("sgd", "momentum", "adam")
ADAM_BETA2, ADAM_EPSILON = 0.99, 1e-3  # Reddi et al.'s FedAdam defaults (their tau = 1e-3 keeps steps bounded)


class ServerOptimizer:
    """params <- params + step(mean update). sgd: lr u; momentum: m = beta m + u, lr m; adam (FedAdam, no bias
    correction, as in Reddi et al.): m = beta m + (1 - beta) u, v = beta2 v + (1 - beta2) u^2, lr m / (sqrt(v) + eps)."""

    def __init__(self, kind: str, *, lr: float, momentum: float = 0.9, state: Mapping[str, Tensor] | None = None):
        if kind not in OPTIMIZERS:
            raise ValueError(f"Unknown server optimizer '{kind}'; choose one of {', '.join(OPTIMIZERS)}.")
        if not lr > 0 or not 0 <= momentum < 1:
            raise ValueError(f"Server learning rate must be positive and momentum in [0, 1), got {lr} and {momentum}.")
        self.kind, self.lr, self.momentum = kind, lr, momentum
        self.state: dict[str, Tensor] = dict(state or {})  # "<slot>/<entry>" -> tensor

    def step(self, params: Mapping[str, Tensor], update: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The new values of the entries in ``update`` (float64 inside, ``params``' dtype out)."""
        out = {}
        for name, u in update.items():
            p, u = params[name], u.double()
            if self.kind == "sgd":
                step = u
            elif self.kind == "momentum":
                step = self._slot("momentum", name, u).mul_(self.momentum).add_(u)
            else:
                m = self._slot("adam-m", name, u).mul_(self.momentum).add_(u, alpha=1 - self.momentum)
                v = self._slot("adam-v", name, u).mul_(ADAM_BETA2).addcmul_(u, u, value=1 - ADAM_BETA2)
                step = m / (v.sqrt() + ADAM_EPSILON)
            out[name] = (p.double() + self.lr * step).to(p.dtype)
        return out

    def _slot(self, slot: str, name: str, like: Tensor) -> Tensor:
        return self.state.setdefault(f"{slot}/{name}", torch.zeros_like(like, dtype=torch.float64))
