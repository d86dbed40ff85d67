"""The privacy ledger of one run: the releases so far, the epsilon they spend, and the stop before the budget
breaks.

Strategies record every round in which clients were sampled (whether or not their replies
arrived: a sampled client counts as a release). The ledger is plain data, so checkpoints can
save and restore it, and every epsilon it holds names its threat model and whom it holds against:
it reports one epsilon per observer the noise placement tells apart (``observers``), and the budget
is on ``target_observer``'s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fedlora.privacy.accounting import PrivacyReport, epsilon
from fedlora.privacy.events import (Observer, Phase, Release, SamplingScheme, observers, release_from_dict,
                                    release_to_dict, trust_label)


@dataclass
class PrivacyLedger:
    delta: float
    threat_model: str
    target_epsilon: float | None = None  # the budget; None: record without a limit
    phases: list[Phase] = field(default_factory=list)
    placement: str = "client"  # where the noise is added: part of every epsilon's label
    target_observer: str = Observer.MODEL.value  # whose epsilon the budget limits
    seeded: bool = False  # noise drawn from the run seed (a simulation): said in every label
    server_derives_sketch: bool = False  # secret-sketch with R from the run seed: not secret from the server
    fixed_sampling_pld: bool = False  # accountant = "pld": the proven PLD of fixed-size sampling beside RDP

    @property
    def trust_model(self) -> str:
        """The label of the budget's epsilon: threat model, noise placement, seeded or not, observer."""
        return trust_label(self.threat_model, self.placement, self.target_observer, seeded=self.seeded,
                           server_derives_sketch=self.server_derives_sketch and self.threat_model == "secret-sketch")

    @property
    def observers(self) -> tuple[Observer, ...]:
        return observers(self.placement)

    def _epsilon(self, phases: list[Phase], observer: Observer | str | None) -> PrivacyReport:
        return epsilon(phases, delta=self.delta, threat_model=self.threat_model, placement=self.placement,
                       observer=observer or self.target_observer, seeded=self.seeded,
                       server_derives_sketch=self.server_derives_sketch, fixed_sampling_pld=self.fixed_sampling_pld)

    def _with_release(self, name: str, release: tuple[Release, ...], sampling: SamplingScheme) -> list[Phase]:
        """The phases with one more release of phase ``name`` (a new phase if the last one is another)."""
        if self.phases and self.phases[-1].name == name:
            *done, current = self.phases
            if current.release != tuple(release) or current.sampling != sampling:
                raise ValueError(f"Phase '{name}' was recorded with another release or sampling; a changed "
                                 "mechanism starts a new phase.")
            return [*done, dataclasses.replace(current, rounds=current.rounds + 1)]
        return [*self.phases, Phase(name, tuple(release), sampling, 1)]

    def report(self, observer: Observer | str | None = None) -> PrivacyReport:
        """The guarantee after the releases recorded so far, against ``observer`` (default: the budget's)."""
        if not self.phases:
            raise ValueError("The ledger has recorded nothing yet.")
        return self._epsilon(self.phases, observer)

    def reports(self) -> dict[str, PrivacyReport]:
        """The guarantee against every observer the placement tells apart, by observer."""
        return {o.value: self.report(o) for o in self.observers}

    def report_after(self, name: str, release: tuple[Release, ...], sampling: SamplingScheme) -> PrivacyReport:
        """The budget's guarantee if one more release of phase ``name`` were recorded (nothing is recorded)."""
        return self._epsilon(self._with_release(name, release, sampling), None)

    @property
    def epsilon(self) -> float:
        return self.report().epsilon if self.phases else 0.0

    @property
    def rounds(self) -> int:
        """Releases recorded (rounds in which clients were sampled, retries included)."""
        return sum(p.rounds for p in self.phases)

    def would_exceed_budget(self, name: str, release: tuple[Release, ...], sampling: SamplingScheme) -> bool:
        """Whether one more release would push epsilon past the target: the run must stop before it."""
        return (self.target_epsilon is not None
                and self.report_after(name, release, sampling).epsilon > self.target_epsilon)

    def record(self, name: str, release: tuple[Release, ...], sampling: SamplingScheme) -> PrivacyReport:
        """Counts one more release of phase ``name`` (e.g. "linear-probe", then "lora"; phases compose) and
        returns the guarantee after it."""
        self.phases = self._with_release(name, release, sampling)
        return self.report()

    def to_dict(self) -> dict:
        """JSON-ready state, for checkpoints."""
        return {"delta": self.delta, "threat_model": self.threat_model, "target_epsilon": self.target_epsilon,
                "placement": self.placement, "target_observer": self.target_observer, "seeded": self.seeded,
                "server_derives_sketch": self.server_derives_sketch, "fixed_sampling_pld": self.fixed_sampling_pld,
                "phases": [{"name": p.name, "rounds": p.rounds,
                            "sampling": {**dataclasses.asdict(p.sampling), "kind": p.sampling.kind.value},
                            "release": [release_to_dict(r) for r in p.release]}
                           for p in self.phases]}

    @classmethod
    def from_dict(cls, state: dict) -> PrivacyLedger:
        phases = [Phase(p["name"],
                        tuple(release_from_dict(r) for r in p["release"]),
                        SamplingScheme(**p["sampling"]), p["rounds"]) for p in state["phases"]]
        return cls(state["delta"], state["threat_model"], state["target_epsilon"], phases,
                   state.get("placement", "client"), state.get("target_observer", Observer.MODEL.value),
                   state.get("seeded", False), state.get("server_derives_sketch", False),
                   state.get("fixed_sampling_pld", False))
