"""A run, free of Flower: its data, its calibrated noise, its ledger, and what it writes to the run directory
(the resolved config, metrics.jsonl, the checkpoint, the final adapter in PEFT format, accuracy.png).
"""

from __future__ import annotations

import json
import math
import resource
import textwrap
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import psutil
import torch

from fedlora.checkpoint import BUDGET_SPENT, FINISHED, Checkpoint
from fedlora.config import RunConfig
from fedlora.round_plan import LORA, PROBE, GlobalState, RoundPlan
from fedlora.lora import get_adapters, save_adapters
from fedlora.mechanisms import gaussian_mechanism
from fedlora.privacy import PrivacyLedger, PrivacyReport, SamplingScheme, calibrate, epsilon
from fedlora.privacy.accounting import other_convention
from fedlora.privacy.events import Phase, observers, other_observers
from fedlora.tracking import clear_progress, tracker_for, write_progress
from fedlora.training import select_device

def test_data(config: RunConfig):
    """The run's test split on this process's device, as its task feeds the model (the server evaluates on it)."""
    return config.task.test_data(config, select_device())


def sampling_of(config: RunConfig) -> SamplingScheme:
    if config.sampling == "fixed":
        return SamplingScheme("fixed", config.num_clients, clients_per_round=config.clients_per_round)
    return SamplingScheme("poisson", config.num_clients, rate=config.clients_per_round / config.num_clients)


def labels_of(config: RunConfig) -> dict:
    """What every epsilon of a run says besides its threat model and placement: seeded noise (a simulation), a
    secret sketch the server derives."""
    return {"seeded": config.noise_source == "seeded",
            "server_derives_sketch": config.threat_model == "secret-sketch" and config.sketch_secret == "run-seed",
            "fixed_sampling_pld": config.accountant == "pld"}


@dataclass(frozen=True)
class NoisePlan:
    """The noise of a run and what each phase releases per round (for the strategy's ledger); what the noise
    guarantees after all rounds is computed when asked for (the ServerApp needs only the releases)."""

    noise_multiplier: float  # LoRA rounds
    probe_noise_multiplier: float  # linear-probe rounds (head = probe)
    phase_releases: dict  # phase -> one round's release ({} if not private)
    phases: tuple[Phase, ...] = ()  # every round the run plans, by phase
    where: dict = field(default_factory=dict)  # the accounting's setting: delta, threat model, placement, labels
    target_observer: str = "model"  # whose epsilon target-epsilon calibrates

    @cached_property
    def reports(self) -> dict:
        """observer -> the guarantee after all rounds ({} if not private)."""
        if not self.phases:
            return {}
        return {o.value: epsilon(list(self.phases), **self.where, observer=o)
                for o in observers(self.where["placement"])}

    @cached_property
    def other_convention(self) -> PrivacyReport | None:
        """The same noise in the field's other convention, to compare tools."""
        return other_convention(list(self.phases), self.where["delta"]) if self.phases else None

    @property
    def planned(self) -> PrivacyReport | None:
        """The guarantee against the target observer after all rounds; None if not private."""
        return self.reports.get(self.target_observer)

    def new_ledger(self, config: RunConfig) -> PrivacyLedger | None:
        if not self.phase_releases:
            return None
        return PrivacyLedger(config.delta, config.threat_model, config.target_epsilon or None,
                             placement=config.noise_placement, target_observer=config.target_observer,
                             **labels_of(config))


def noise_for(config: RunConfig, *, calibrated: tuple[float, float] | None = None) -> NoisePlan:
    """Noise multipliers calibrated for target-epsilon over num-rounds (or noise-multiplier as given).

    With a linear probe the probe phase alone is calibrated to ``probe-budget`` of the target, then
    the LoRA phase to what the composition of both leaves. With adaptive clipping each LoRA round also
    releases the clip count, and the update's multiplier is raised until the pair spends the target.
    ``calibrated``: the (LoRA, probe) multipliers this config calibrated to before (the launcher's, passed to the
    ServerApp), taken as they are: the ledger accounts whatever noise a run adds, so this saves time, not privacy.
    """
    protocol = RoundPlan(config, 1.0, 1.0)
    if not protocol.algorithm.private:
        return NoisePlan(0.0, 0.0, {})
    with torch.device("meta"):  # the message's shapes, without the weights' memory and their reading
        model = protocol.build_model()
    sampling = sampling_of(config)
    probe_rounds = config.linear_probe_rounds()
    head, message = protocol.client_message(model, PROBE), protocol.client_message(model, LORA)

    def probe_release(z: float):
        return protocol.release_of(head, gaussian_mechanism(clip_norm=config.clip_norm, noise_multiplier=z,
                                                            placement=protocol.placement))

    count = (protocol.clipping.release(),) if protocol.clipping is not None else ()

    def lora_release(z: float):
        at_z = RoundPlan(config, z)
        return at_z.release_of(message, at_z.mechanism) + count

    def phases(z_probe: float, z_lora: float) -> list[Phase]:
        probe = [Phase(PROBE, probe_release(z_probe), sampling, probe_rounds)] if probe_rounds else []
        return [*probe, Phase(LORA, lora_release(z_lora), sampling, config.num_rounds - probe_rounds)]

    where = {"delta": config.delta, "threat_model": config.threat_model, "placement": config.noise_placement,
             **labels_of(config)}
    target = {**where, "observer": config.target_observer}
    if count and config.target_epsilon:
        alone = epsilon([Phase(LORA, count, sampling, config.num_rounds - probe_rounds)], **target).epsilon
        if alone >= config.target_epsilon:
            raise ValueError(f"The clip count's noise alone (clip-count-stddev {config.count_stddev():g}) spends "
                             f"epsilon {alone:.3g} of the target {config.target_epsilon:g}: raise clip-count-stddev.")
    if calibrated is not None:
        z_lora, z_probe = calibrated
    elif config.noise_multiplier == 0:  # calibrated to spend target-epsilon in num-rounds
        z_probe = calibrate(lambda z: phases(z, 1.0)[:1], target_epsilon=config.probe_budget * config.target_epsilon,
                            **target).noise_multiplier if probe_rounds else 0.0
        z_lora = calibrate(lambda z: phases(z_probe, z), target_epsilon=config.target_epsilon,
                           **target).noise_multiplier
    else:
        z_probe = z_lora = config.noise_multiplier
    return NoisePlan(z_lora, z_probe, {PROBE: probe_release(z_probe), LORA: lora_release(z_lora)},
                     tuple(phases(z_probe, z_lora)), where, config.target_observer)


class RunRecorder:
    """Evaluates the global model as clients reconstruct it, prints one line per round, writes the run directory.

    ``rows`` (a resumed run's metrics so far) keeps the run directory's config and rewrites metrics.jsonl
    with exactly those rows; otherwise both are written anew.
    """

    def __init__(self, config: RunConfig, protocol: RoundPlan, out_dir: Path, *, echo=print,
                 rows: list[dict] | None = None, evaluation_threads: int | None = None):
        self.config, self.protocol, self.out_dir, self.echo = config, protocol, Path(out_dir), echo
        self.evaluation_threads = evaluation_threads  # torch's threads for a background evaluation (None: as now)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if rows is None:
            (self.out_dir / "config.json").write_text(json.dumps(
                {**config.to_mapping(), "noise-multiplier (used)": protocol.noise_multiplier,
                 "probe-noise-multiplier (used)": protocol.probe_noise_multiplier}, indent=2) + "\n")
        self.rows: list[dict] = list(rows or [])  # as in metrics.jsonl: null where a round has no value
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.metrics_path.write_text("".join(json.dumps(row) + "\n" for row in self.rows))
        self.tracker = tracker_for(config.tracker, self.out_dir, rounds_kept=len(self.rows))
        clear_progress(self.out_dir)
        self.model = protocol.build_model(device=select_device())
        self.base = get_adapters(self.model)
        self.test = test_data(config)  # read before round 1: unreadable test data stops the run before a release
        self.started = time.time()
        self._evaluator: ThreadPoolExecutor | None = None  # evaluates a round while the next one trains
        self._pending: Future | None = None
        self._unwritten: tuple[int, dict] | None = None  # (round, its row's accounting) while it is evaluated

    @property
    def can_reconstruct(self) -> bool:
        """False when the sketch secret stays on the nodes: the server cannot de-sketch the global model."""
        return self.config.sketch_secret != "node-file"

    def evaluate(self, state: GlobalState) -> dict[str, float]:
        """The task's metrics of the global model ("accuracy", "loss", ...), reconstructed exactly as a client
        would."""
        self.protocol.load_global(self.model, state, self.base)
        return self.config.task.evaluate(self.model, self.test, precision=self.config.precision)

    def record(self, round_: int, state: GlobalState, info: dict, ledger: PrivacyLedger | None, *,
               background: bool = False) -> dict | None:
        """Round ``round_``'s row: its metrics (evaluated when due), the ledger's epsilon after it, its telemetry;
        appended to metrics.jsonl, the tracker and the progress lines. With ``background`` the evaluation runs on
        this recorder's thread while the caller goes on (the next round trains meanwhile; rows stay in order, one
        evaluation at a time): what the row says of the ledger and the round is taken now; None is returned, and
        ``wait`` gives the rows."""
        due = self.can_reconstruct and (round_ % self.config.eval_every == 0 or round_ == self.config.num_rounds)
        self.wait()  # the rows in order: the previous round's evaluation first
        # what the ledger said right after the round (a checkpoint keeps it until the row is written: a run resumed
        # after a later release was counted records the row as it was)
        accounted = info.get("accounted") or self._accounted(round_, info, ledger)
        if not background:
            return self._complete(round_, state if due else None, accounted)
        if self._evaluator is None:  # torch's intra-op threads are set per thread: the caller's stay as they are
            threads = self.evaluation_threads
            self._evaluator = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedlora-evaluation",
                                                 initializer=(lambda: torch.set_num_threads(threads)) if threads
                                                 else None)
        self._unwritten = (round_, accounted)
        self._pending = self._evaluator.submit(self._complete, round_, state if due else None, accounted)
        return None

    def _accounted(self, round_: int, info: dict, ledger: PrivacyLedger | None) -> dict:
        """A row's privacy and telemetry: what the ledger says now, what the round did."""
        reports = ledger.reports() if ledger is not None else {}
        report = reports.get(ledger.target_observer) if ledger is not None else None
        now = time.time()
        started = info.get("started", self.started)
        return {
            "epsilon": report.epsilon if report else math.inf, "delta": self.config.delta,
            "noise_multiplier": self.protocol.noise_multiplier,
            "threat_model": report.threat_model if report else f"{self.config.threat_model} (not private)",
            "observer": report.observer if report else None,
            "epsilon_by_observer": {o: r.epsilon for o, r in reports.items()},
            "clip_norm": info.get("clip_norm", self.protocol.mechanism.clip_norm),
            "releases": ledger.rounds if ledger is not None else info.get("release", round_),
            "train_loss": info.get("train_loss", math.nan), "sampled": info.get("sampled", 0),
            "replies": info.get("replies", 0), "failed": info.get("failed", 0),
            "rejected": info.get("rejected", 0), "first_failure": info.get("first_failure"),
            "nodes": info.get("nodes", 0),
            "bytes_up": info.get("bytes_up", 0), "bytes_down": info.get("bytes_down", 0),
            "aggregation_seconds": info.get("aggregation_seconds", 0.0),
            "client_train_seconds": info.get("train_seconds", math.nan),
            "client_privatize_seconds": info.get("privatize_seconds", math.nan),
            "client_startup_seconds": info.get("startup_seconds", math.nan),
            # the round's own seconds, from its start to its new global state (a row recorded after a restart
            # carries them from the checkpoint: its start was another launch's); its evaluation's are apart
            "seconds": info["seconds"] if "seconds" in info else now - started,
            "started": info["started"] if "started" in info and "seconds" not in info else None,
            "startup": info.get("startup")}  # seconds before this launch's first round, by part

    def _complete(self, round_: int, state: GlobalState | None, accounted: dict) -> dict:
        """The row, once ``state`` (None: not due) is evaluated; written where rows go."""
        evaluating = time.time()
        metrics = self.evaluate(state) if state is not None else {}
        if state is None and self.config.task.name == "causal-lm":
            metrics = {"perplexity": math.nan}  # the column every row of a language model's run has
        row = {"round": round_, "phase": self.protocol.phase(round_), "accuracy": math.nan, "loss": math.nan,
               **metrics, **accounted,
               "eval_seconds": time.time() - evaluating if state is not None else 0.0,
               # the peak since the process began (it only rises), and what the process holds now
               "server_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
               "server_rss_mib": psutil.Process().memory_info().rss / 2**20,
               "time": time.time()}
        row = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}  # null, not NaN
        self.rows.append(row)
        if self._unwritten is not None and self._unwritten[0] == round_:
            self._unwritten = None
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tracker is not None:
            self.tracker.log(row)
        self.echo(format_progress(row, self.config))
        return row

    def wait(self) -> list[dict]:
        """The rows, once the evaluation under way (if any) has written its own; raises what it raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
        return self.rows

    def raise_if_failed(self) -> None:
        """Raises what the evaluation under way raised if it has ended so (without waiting for one that runs): the
        strategy asks before each release, so that a run whose evaluation failed spends no further release."""
        if self._pending is not None and self._pending.done() and self._pending.exception() is not None:
            self.wait()

    def progress(self, round_: int, arrived: int, sent: int) -> None:
        """The replies of the round under way so far, for the launcher to show while the round runs."""
        write_progress(self.out_dir, round_, arrived, sent)

    def save(self, checkpoint: Checkpoint) -> None:
        """Writes the checkpoint with the metrics rows so far: every round's but (at most) the last's, whose
        evaluation may be under way (a resumed run records a missing last row from the checkpoint's state)."""
        if checkpoint.rounds_done > len(self.rows) + 1:
            self.wait()
        pending = self._unwritten  # before the rows: the evaluation's thread appends a row, then clears this
        checkpoint.rows = list(self.rows)
        if pending is not None and pending[0] == checkpoint.rounds_done and len(checkpoint.rows) < pending[0]:
            checkpoint.round_info = {**checkpoint.round_info, "accounted": pending[1]}
        checkpoint.save(self.out_dir)

    def close(self) -> None:
        """Flushes and closes the TensorBoard writer (its thread and file), however the run ended; ends the
        evaluation thread (an evaluation under way is waited for, its error left to the caller's)."""
        if self._evaluator is not None:
            self._evaluator.shutdown(wait=True)
            self._evaluator = None
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None

    def finish(self, state: GlobalState, *, status: str = FINISHED, reason: str = "") -> None:
        """After the last round (or an early stop): the adapter in PEFT format (if the server can de-sketch
        it) and accuracy.png. The checkpoint already holds the final state."""
        self.wait()
        if status not in (FINISHED, BUDGET_SPENT):
            self.echo(f"The run stopped early ({reason}); resume it with `fedlora run --resume {self.out_dir}`.")
            return
        if status == BUDGET_SPENT:
            self.echo(f"Stopped after round {len(self.rows)} of {self.config.num_rounds}: {reason}.")
        if self.can_reconstruct:
            self.protocol.load_global(self.model, state, self.base)
            save_adapters(self.model, self.out_dir / "adapter")
        else:
            self.echo(f"The server does not hold the sketch secret: reconstruct the adapter on a node with "
                      f"`fedlora reconstruct {self.out_dir} --sketch-secret-file PATH`.")
        epsilon = self.rows[-1]["epsilon"] if self.rows else 0.0
        label = self.rows[-1]["threat_model"] if self.rows else self.protocol.mechanism.trust_model
        privacy = (f"{label}, z = {self.protocol.noise_multiplier:.3g}, epsilon = {epsilon:.3g}"
                   if self.protocol.algorithm.private else "not private")
        column, label = self.config.task.plotted
        plot_accuracy(self.rows, self.out_dir / f"{column}.png", title=f"{self.config.strategy} ({privacy})",
                      chance=self.config.task.chance(self.config), column=column, label=label)


def reconstruct(run_dir: Path, sketch_secret_file: str | Path, *, echo=print) -> dict[str, float]:
    """De-sketches a run's global state with the federation's sketch secret (which only the nodes hold), writes
    the PEFT adapter to the run directory, and returns its task's test metrics ("accuracy", "loss", ...)."""
    from fedlora.node import read_sketch_seed, secret_fingerprint

    saved = Checkpoint.load(Path(run_dir))
    if saved.secret_fingerprint is None:
        raise ValueError(f"'{run_dir}' was not sketched with a node-held secret: its adapter/ is written by the run.")
    if secret_fingerprint(sketch_secret_file) != saved.secret_fingerprint:
        raise ValueError(f"'{sketch_secret_file}' is not the sketch secret this run's nodes held.")
    config, z, z_probe = load_run_config(run_dir)
    protocol = RoundPlan(config, z, z_probe)
    protocol.sketch_seed = read_sketch_seed(sketch_secret_file)
    model = protocol.build_model(device=select_device())
    protocol.load_global(model, saved.state, get_adapters(model))
    save_adapters(model, Path(run_dir) / "adapter")
    echo(f"Wrote {Path(run_dir) / 'adapter'} (after round {saved.rounds_done}).")
    return config.task.evaluate(model, test_data(config), precision=config.precision)


def load_run_config(run_dir: Path) -> tuple[RunConfig, float, float]:
    """A run directory's config and the noise multipliers it used (LoRA, linear probe)."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"'{run_dir}' holds no config.json: is it a fedlora run directory?")
    try:
        saved = json.loads(path.read_text())
        used = saved["noise-multiplier (used)"], saved["probe-noise-multiplier (used)"]
    except (ValueError, KeyError, TypeError) as error:  # ValueError: not JSON, or not UTF-8
        raise ValueError(f"'{path}' is damaged ({type(error).__name__}: {error}): it is not the config a fedlora run "
                         "wrote.") from None
    saved.setdefault("precision", "fp32")  # a run from before the key trained in fp32 everywhere: it resumes so
    config = RunConfig.from_mapping({k: v for k, v in saved.items() if not k.endswith("(used)")})
    return (config, *used)


def format_progress(row: dict, config: RunConfig) -> str:
    """One progress line: round, accuracy, epsilon spent (with its threat model and observer, then the other
    observers' where one holds), seconds."""
    measured = row["accuracy"] is not None and not math.isnan(row["accuracy"])
    accuracy = f"{row['accuracy']:6.3f}" if measured else "     -"
    eps = "inf (not private)" if math.isinf(row["epsilon"]) else f"{row['epsilon']:.3f} ({row['threat_model']})"
    eps += "".join(f", {value:.3f} {label}"
                   for value, label in other_observers(row.get("epsilon_by_observer", {}), row.get("observer"),
                                                       config.threat_model, config.noise_placement))
    line = f"round {row['round']:>3}/{config.num_rounds}  accuracy {accuracy}"
    if "perplexity" in row:  # a language model: next-token accuracy, and the perplexity of the test text
        line += f"  perplexity {row['perplexity']:7.2f}" if measured else "  perplexity       -"
    line += f"  epsilon {eps}  {row['seconds']:.1f} s"
    if row.get("replies", 0) < row.get("sampled", 0):
        line += f"  ({row['replies']} of {row['sampled']} replies)"
    if row.get("nodes", 0) > 1:
        line += f"  (replies from {row['nodes']} Ray nodes)"
    if row.get("releases", row["round"]) > row["round"]:
        line += f"  ({row['releases']} releases: retries count)"
    return line


def check_before_start(config: RunConfig) -> None:
    """What the config alone cannot tell and can be known before any process starts: data reachability, and what
    the task checks (a tokenizer that fits the model)."""
    config.task.check_before_start(config)


def plot_accuracy(rows: list[dict], path: Path, *, title: str, chance: float | None, column: str = "accuracy",
                  label: str = "test accuracy") -> None:
    """The global model's ``column`` by round (a task's headline metric), with chance where it means something."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(r["round"], r[column]) for r in rows if r.get(column) is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    if points:
        ax.plot(*zip(*points), marker="o", label="global model")
    if chance is not None:
        ax.axhline(chance, color="gray", linestyle="--", label="chance")
    ax.legend(loc="best")
    ax.set_xlabel("round")
    ax.set_ylabel(label)
    ax.set_title("\n".join(textwrap.wrap(title, 80)), fontsize=9)  # labels name threat model and observer: long
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
