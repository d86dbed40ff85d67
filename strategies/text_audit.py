"""The text audit's runs (issue 66): the audited federation over the folder fedlora.text_audit writes (canaries in
chosen clients' text, an auxiliary split no client holds), and the reference federation over that auxiliary split,
both the product's ServerApp and ClientApp in process; then the attacks of fedlora.text_audit and fedlora.audit."""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from flwr.app import Context, RecordDict
from flwr.common.logger import LOGGER_NAME as FLOWER_LOGGER

from fedlora.algorithms import LoRAMode, get_algorithm
from fedlora.audit import (CONFIDENCE, auc_interval, exposure, one_run_lower_bound, roc_auc, tpr_at_fpr,
                           tpr_interval)
from fedlora.checkpoint import ENDED, FINISHED, STATE_FILE, Checkpoint
from fedlora.clients.app import app as client_app
from fedlora.config import RunConfig
from fedlora.experiment import load_run_config, sampling_of
from fedlora.lora import get_adapters
from fedlora.privacy.ledger import PrivacyLedger
from fedlora.round_plan import GlobalState, derive_seed
from fedlora.run_keys import OUT_DIR_KEY, RESUME_KEY, SIMULATION_KEY
from fedlora.server_round import ServerSide
from fedlora.strategies.inprocess_grid import InProcessGrid
from fedlora.strategies.server_app import run_federation
from fedlora.text import load_tokenizer, partition_units, text_splits, tokenized_units, tokenizer_of
from fedlora.text_audit import TextCanaries, sequence_losses, text_loss, write_audit_text, write_reference_text

MIN_TEXT_CANARIES = 20
# the keys of a run's noise and accounting, left at their defaults in the reference federation (which adds none)
NOISE_KEYS = ("target-epsilon", "delta", "noise-multiplier", "sketch-dim", "threat-model", "accountant",
              "noise-placement", "target-observer", "clip-quantile", "clip-lr", "clip-count-stddev", "sketch-secret",
              "noise-source", "probe-budget")


def check_text_audit(config: RunConfig, canaries: int, aux_units: int) -> None:
    """Every reason the text audit cannot run, before anything starts (one sentence each)."""
    problems = []
    if config.task.name != "causal-lm":
        problems.append(f"The text audit attacks a language model's federation; {config.model} is not a language "
                        "model (the canary audit, --canaries, audits any task).")
    if aux_units < 1:
        problems.append("Membership inference needs a reference model trained on an auxiliary split no client holds: "
                        "set --aux-units A (the last A units of the training text).")
    if not MIN_TEXT_CANARIES <= canaries <= config.num_clients:
        problems.append(f"Text canaries must number at least {MIN_TEXT_CANARIES} and at most num-clients "
                        f"({config.num_clients}), got {canaries}.")
    elif config.task.name == "causal-lm":
        units = len(text_splits(config.dataset, text_column=config.text_column,
                                client_column=config.client_column).train)
        if config.num_clients + aux_units > units:
            problems.append(f"{config.dataset} has {units} training units: {config.num_clients} clients and an "
                            f"auxiliary split of {aux_units} need {config.num_clients + aux_units} (lower "
                            "num-clients or --aux-units).")
    if config.noise_source != "seeded":  # who took part is read back from the run's seeded sampler
        problems.append('The text audit knows who took part from the run\'s seeded sampler: use noise-source = '
                        '"seeded" (the simulations\' default).')
    if config.sampling != "fixed":  # a canary client's text with or without its canary: a replaced client
        problems.append('The text audit compares with the replace-one accountant of fixed sampling: use sampling = '
                        '"fixed".')
    if problems:
        raise ValueError("\n".join(problems))


def _federate(values: dict, out_dir: Path, echo):
    """One federation in process; it continues the run ``out_dir`` holds if that is this one, stopped midway (an
    audit grid stopped mid-cell loses only the rounds since the last checkpoint)."""
    saved = Checkpoint.load(out_dir) if (out_dir / STATE_FILE).is_file() else None
    resume = saved is not None and saved.status not in ENDED and \
        load_run_config(out_dir)[0] == RunConfig.from_mapping(values)
    run_config = {**values, OUT_DIR_KEY: str(out_dir), SIMULATION_KEY: True, RESUME_KEY: resume}
    grid = InProcessGrid(client_app, int(run_config["num-clients"]), run_config)
    flower = logging.getLogger(FLOWER_LOGGER)
    level, _ = flower.level, flower.setLevel(logging.WARNING)
    try:
        return run_federation(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                            run_config=run_config), echo=echo)
    finally:
        flower.setLevel(level)


@dataclass
class Federation:
    """What the attacks need of a finished federation: its protocol and final state, who each release drew, and
    its ledger (None without noise)."""
    protocol: object
    state: GlobalState
    draws: list[list[int]]
    ledger: PrivacyLedger | None


def federation(values: dict, out_dir: Path, echo) -> Federation:
    """The federation ``values`` describes: the one ``out_dir`` holds if it finished this very run (an audit scored
    again without training again), else run now, or the rest of one stopped there."""
    config = RunConfig.from_mapping(values)
    saved = Checkpoint.load(out_dir) if (out_dir / STATE_FILE).is_file() else None
    if saved is not None and saved.status == FINISHED and load_run_config(out_dir)[0] == config:
        echo(f"finished in {out_dir}")
        _, z, probe_z = load_run_config(out_dir)
        protocol, state, releases = ServerSide(config, z, probe_z), saved.state, saved.releases
        ledger = PrivacyLedger.from_dict(saved.ledger) if saved.ledger is not None else None
    else:
        run = _federate(values, out_dir, echo)
        protocol, state, releases, ledger = run.protocol, run.state, run.releases, run.ledger
    sampling = sampling_of(config)
    draws = [list(sampling.draw(protocol.sampling_generator(r))) for r in range(1, releases + 1)]
    return Federation(protocol, state, draws, ledger)


def _model_at(protocol, state: GlobalState):
    """The global model ``state`` holds, as a client loads it."""
    model = protocol.build_model()
    protocol.load_global(model, GlobalState(state.broadcast, state.produced_by), get_adapters(model))
    return model.eval()


def reference_recipe(config: RunConfig, aux_units: int, reference_dir: Path) -> RunConfig:
    """The reference federation's config: the audited recipe without its noise (ffa-lora or flexlora, as the audited
    strategy's family), over the auxiliary units written to reference_dir/text; every audit of one recipe, private
    or not, can share it."""
    return RunConfig.from_mapping({**{k: v for k, v in config.to_mapping().items() if k not in NOISE_KEYS},
                                   "strategy": "flexlora" if get_algorithm(config.strategy).family is LoRAMode.FLEX
                                   else "ffa-lora", "dataset": f"folder:{reference_dir.resolve() / 'text'}",
                                   "num-clients": min(aux_units, config.num_clients),
                                   "clients-per-round": min(config.clients_per_round, aux_units)})


def check_reference(config: RunConfig, aux_units: int, reference_dir: Path) -> None:
    """A reference directory holds this recipe's reference federation, or none (another one is not overwritten)."""
    run_dir = reference_dir / "run"
    if (run_dir / "config.json").is_file():
        held, recipe = load_run_config(run_dir)[0].to_mapping(), reference_recipe(config, aux_units,
                                                                                  reference_dir).to_mapping()
        differ = [f"{k} = {held.get(k)!r}, this audit's {recipe.get(k)!r}" for k in recipe if held.get(k) != recipe[k]]
        if differ:
            raise ValueError(f"{reference_dir} holds the reference federation of another recipe ({differ[0]}): "
                             "choose another reference directory.")


def _reference_model(config: RunConfig, splits, aux_units: int, reference_dir: Path, echo):
    """The reference federation's final model (``federation``: a finished one in reference_dir is not run again)."""
    recipe = reference_recipe(config, aux_units, reference_dir)
    write_reference_text(splits, reference_dir / "text", aux_units=aux_units)
    echo(f"the reference federation: {recipe.strategy} (no noise) over the {aux_units} auxiliary units")
    reference = federation(recipe.to_mapping(), reference_dir / "run", echo)
    return _model_at(reference.protocol, reference.state)


def _attack(members: np.ndarray, others: np.ndarray) -> dict:
    """The membership attack's AUC and TPR at FPR 10% and 1%, each with its 95% interval (two of each needed)."""
    if len(members) < 2 or len(others) < 2:
        return {}
    return {"auc": roc_auc(members, others), "auc_interval": auc_interval(members, others),
            **{f"tpr_at_fpr_{fpr}": tpr_at_fpr(members, others, fpr) for fpr in (0.1, 0.01)},
            **{f"tpr_at_fpr_{fpr}_interval": tpr_interval(members, others, fpr) for fpr in (0.1, 0.01)}}


def _final_perplexity(run_dir: Path) -> float | None:
    """The test perplexity the run's last evaluated round recorded (its final model's)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return next((row["perplexity"] for row in reversed(rows) if row.get("perplexity") is not None), None)


def audit_text(config: RunConfig, *, canaries: int, aux_units: int, out_dir: Path, repeats: int = 4, length: int = 8,
               candidates: int = 1000, reference_dir: Path | None = None, echo=print) -> dict:
    """Runs the audited and the reference federations and attacks the audited model: membership by loss difference
    (members: the clients the sampler drew at least once; non-members: those it never drew; canary clients left
    out of both), and canary exposure with the one-run lower bound. ``reference_dir`` (default out_dir/reference)
    holds the reference federation: a finished one of the same recipe there is used, not run again."""
    check_text_audit(config, canaries, aux_units)
    reference_dir = reference_dir or out_dir / "reference"
    check_reference(config, aux_units, reference_dir)
    started = time.perf_counter()
    tokenizer = load_tokenizer(tokenizer_of(config))
    splits = text_splits(config.dataset, text_column=config.text_column, client_column=config.client_column)
    units = len(splits.train) - aux_units
    rng = np.random.default_rng(derive_seed(config.seed, "text-canary-clients"))
    canary_clients = sorted(rng.choice(config.num_clients, size=canaries, replace=False).tolist())
    drawn = TextCanaries.draw(tokenizer, canary_clients, length=length, candidates=candidates, repeats=repeats,
                              seed=derive_seed(config.seed, "text-canaries"))
    first_unit = {c: partition_units(config.partitioner, units=units, num_partitions=config.num_clients,
                                     partition_id=c, seed=config.seed)[0] for c in canary_clients}
    written = {first_unit[c]: text for c, text in drawn.written(tokenizer).items()}
    root = write_audit_text(splits, out_dir / "text", clients=config.num_clients, aux_units=aux_units,
                            written=written)
    echo(f"the audited federation: {config.strategy}, {canaries} canary clients ({int(drawn.included.sum())} with "
         f"their canary), {aux_units} units kept out as the auxiliary split")
    audited = federation({**config.to_mapping(), "dataset": f"folder:{root}"}, out_dir / "audited", echo)
    model = _model_at(audited.protocol, audited.state)
    reference_model = _reference_model(config, splits, aux_units, reference_dir, echo)

    last_drawn = {c: release for release, drawn_then in enumerate(audited.draws, 1) for c in drawn_then}
    client_units = tokenized_units(f"folder:{root}", "train", tokenizer_of(config))
    eos = tokenizer.eos_id

    def score(client: int) -> float:
        own = [client_units[i] for i in partition_units(config.partitioner, units=units,
                                                        num_partitions=config.num_clients, partition_id=client,
                                                        seed=config.seed)]
        return text_loss(reference_model, own, config.seq_len, eos) - text_loss(model, own, config.seq_len, eos)

    plain = [c for c in range(config.num_clients) if c not in set(canary_clients)]
    scores = {c: score(c) for c in plain}
    members = np.array([scores[c] for c in plain if c in last_drawn])
    others = np.array([scores[c] for c in plain if c not in last_drawn])
    membership = {"members": len(members), "non_members": len(others), **_attack(members, others)}
    # the members whose text the model saw last, in the final tenth of the releases: what forgetting leaves most of
    recent_from = len(audited.draws) - max(1, len(audited.draws) // 10) + 1
    recent = np.array([scores[c] for c in plain if last_drawn.get(c, 0) >= recent_from])
    membership["recent"] = {"from_release": recent_from, "members": len(recent), **_attack(recent, others)}

    canary_scores = -sequence_losses(model, list(drawn.sequences), eos)
    null = -sequence_losses(model, list(drawn.candidates), eos)
    bits = exposure(canary_scores, null)
    ledger = audited.ledger
    (out_dir / "scores.json").write_text(json.dumps({  # every score, to read again without scoring again
        "clients": {str(c): {"score": v, "last_drawn": last_drawn.get(c)} for c, v in scores.items()},
        "canaries": {"included": drawn.included.tolist(), "scores": canary_scores.tolist()},
        "candidates": null.tolist()}) + "\n")
    return {
        "strategy": config.strategy, "threat_model": ledger.trust_model if ledger else "not private",
        "accountant_epsilon": ledger.report().epsilon if ledger else math.inf, "delta": config.delta,
        "perplexity": _final_perplexity(out_dir / "audited"), "membership": membership,
        "canaries": {"count": canaries, "included": int(drawn.included.sum()), "repeats": repeats, "length": length,
                     "candidates": candidates, "exposure_included": float(bits[drawn.included].mean()),
                     "exposure_excluded": float(bits[~drawn.included].mean()),
                     "exposure_max": float(np.log2(candidates + 1)),
                     "one_run_lower_bound": one_run_lower_bound(canary_scores, drawn.included, delta=config.delta),
                     "confidence": CONFIDENCE},
        "seconds": time.perf_counter() - started,
    }
