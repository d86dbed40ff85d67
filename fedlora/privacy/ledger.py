"""The privacy ledger of one run: epsilon spent after every round, and the stop before the budget breaks.

Strategies record every round in which clients were sampled (whether or not their replies
arrived: a sampled client counts as a release). The ledger is plain data, so checkpoints can
save and restore it, and every epsilon it holds names its threat model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fedlora.privacy.accounting import PrivacyReport, epsilon
from fedlora.privacy.events import (GaussianRelease, NonPrivateRelease, Phase, Release, SamplingScheme,
                                    SketchedRelease)

_RELEASES = {cls.__name__: cls for cls in (GaussianRelease, SketchedRelease, NonPrivateRelease)}


@dataclass
class PrivacyLedger:
    delta: float
    threat_model: str
    target_epsilon: float | None = None  # the budget; None: record without a limit
    phases: list[Phase] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)  # one entry per recorded round

    def begin_phase(self, name: str, release: tuple[Release, ...], sampling: SamplingScheme) -> None:
        """Starts a phase (e.g. "linear-probe", then "lora"); its rounds compose with the earlier phases'."""
        self.phases.append(Phase(name, tuple(release), sampling, 0))

    def _with_rounds(self, extra: int) -> list[Phase]:
        if not self.phases:
            raise ValueError("The ledger has no phase: call begin_phase first.")
        *done, current = self.phases
        return [*done, dataclasses.replace(current, rounds=current.rounds + extra)]

    def report(self, extra_rounds: int = 0) -> PrivacyReport:
        """The guarantee after the rounds recorded so far, plus ``extra_rounds`` more of the current phase."""
        return epsilon(self._with_rounds(extra_rounds), delta=self.delta, threat_model=self.threat_model)

    @property
    def epsilon(self) -> float:
        return self.report().epsilon if self.phases else 0.0

    @property
    def rounds(self) -> int:
        return sum(p.rounds for p in self.phases)

    def would_exceed_budget(self) -> bool:
        """Whether one more round would push epsilon past the target: the run must stop before it."""
        return self.target_epsilon is not None and self.report(extra_rounds=1).epsilon > self.target_epsilon

    def record_round(self) -> PrivacyReport:
        """Counts one more round of the current phase and returns the guarantee after it."""
        self.phases = self._with_rounds(1)
        report = self.report()
        self.history.append({"phase": self.phases[-1].name, "round": self.rounds, "epsilon": report.epsilon,
                             "delta": self.delta, "threat_model": self.threat_model, "method": report.method})
        return report

    def to_dict(self) -> dict:
        """JSON-ready state, for checkpoints."""
        return {"delta": self.delta, "threat_model": self.threat_model, "target_epsilon": self.target_epsilon,
                "history": list(self.history),
                "phases": [{"name": p.name, "rounds": p.rounds,
                            "sampling": {**dataclasses.asdict(p.sampling), "kind": p.sampling.kind.value},
                            "release": [{"type": type(r).__name__, **dataclasses.asdict(r)} for r in p.release]}
                           for p in self.phases]}

    @classmethod
    def from_dict(cls, state: dict) -> PrivacyLedger:
        phases = [Phase(p["name"],
                        tuple(_RELEASES[r["type"]](**{k: v for k, v in r.items() if k != "type"}) for r in p["release"]),
                        SamplingScheme(**p["sampling"]), p["rounds"]) for p in state["phases"]]
        return cls(state["delta"], state["threat_model"], state["target_epsilon"], phases, list(state["history"]))
