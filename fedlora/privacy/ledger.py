"""The privacy ledger of one run: epsilon spent after every round, and the stop before the budget breaks.

Strategies record every round in which clients were sampled (whether or not their replies
arrived: a sampled client counts as a release). The ledger is plain data, so checkpoints can
save and restore it, and every epsilon it holds names its threat model.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from fedlora.privacy.accounting import PrivacyReport, epsilon
from fedlora.privacy.events import Phase, Release, SamplingScheme, trust_label

_RELEASES = {cls.__name__: cls for cls in typing.get_args(Release)}  # every kind a checkpoint can hold


@dataclass
class PrivacyLedger:
    delta: float
    threat_model: str
    target_epsilon: float | None = None  # the budget; None: record without a limit
    phases: list[Phase] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)  # one entry per recorded round
    placement: str = "client"  # where the noise is added: part of every epsilon's label

    @property
    def trust_model(self) -> str:
        """The label of every epsilon this ledger reports: threat model and noise placement."""
        return trust_label(self.threat_model, self.placement)

    def _with_release(self, name: str, release: tuple[Release, ...], sampling: SamplingScheme) -> list[Phase]:
        """The phases with one more release of phase ``name`` (a new phase if the last one is another)."""
        if self.phases and self.phases[-1].name == name:
            *done, current = self.phases
            if current.release != tuple(release) or current.sampling != sampling:
                raise ValueError(f"Phase '{name}' was recorded with another release or sampling; a changed "
                                 "mechanism starts a new phase.")
            return [*done, dataclasses.replace(current, rounds=current.rounds + 1)]
        return [*self.phases, Phase(name, tuple(release), sampling, 1)]

    def report(self) -> PrivacyReport:
        """The guarantee after the releases recorded so far."""
        if not self.phases:
            raise ValueError("The ledger has recorded nothing yet.")
        return epsilon(self.phases, delta=self.delta, threat_model=self.threat_model, placement=self.placement)

    def report_after(self, name: str, release: tuple[Release, ...], sampling: SamplingScheme) -> PrivacyReport:
        """The guarantee if one more release of phase ``name`` were recorded (nothing is recorded)."""
        return epsilon(self._with_release(name, release, sampling), delta=self.delta, threat_model=self.threat_model,
                       placement=self.placement)

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
        report = self.report()
        self.history.append({"phase": name, "round": self.rounds, "epsilon": report.epsilon,
                             "delta": self.delta, "threat_model": report.threat_model, "method": report.method})
        return report

    def to_dict(self) -> dict:
        """JSON-ready state, for checkpoints."""
        return {"delta": self.delta, "threat_model": self.threat_model, "target_epsilon": self.target_epsilon,
                "placement": self.placement, "history": list(self.history),
                "phases": [{"name": p.name, "rounds": p.rounds,
                            "sampling": {**dataclasses.asdict(p.sampling), "kind": p.sampling.kind.value},
                            "release": [{"type": type(r).__name__, **dataclasses.asdict(r)} for r in p.release]}
                           for p in self.phases]}

    @classmethod
    def from_dict(cls, state: dict) -> PrivacyLedger:
        phases = [Phase(p["name"],
                        tuple(_RELEASES[r["type"]](**{k: v for k, v in r.items() if k != "type"}) for r in p["release"]),
                        SamplingScheme(**p["sampling"]), p["rounds"]) for p in state["phases"]]
        return cls(state["delta"], state["threat_model"], state["target_epsilon"], phases, list(state["history"]),
                   state.get("placement", "client"))
