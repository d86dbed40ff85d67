"""The text audit's runs (issue 66): the audited federation over the folder fedlora.text_audit writes (canaries in
chosen clients' text, an auxiliary split no client holds), and the reference federation over that auxiliary split,
both the product's ServerApp and ClientApp in process; then the attacks of fedlora.text_audit and fedlora.audit."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import numpy as np
from flwr.app import Context, RecordDict
from flwr.common.logger import LOGGER_NAME as FLOWER_LOGGER

from fedlora.audit import (CONFIDENCE, auc_interval, exposure, one_run_lower_bound, roc_auc, tpr_at_fpr,
                           tpr_interval)
from fedlora.clients.app import app as client_app
from fedlora.algorithms import LoRAMode, get_algorithm
from fedlora.checkpoint import ENDED, FINISHED, STATE_FILE, Checkpoint
from fedlora.config import RunConfig
from fedlora.experiment import load_run_config
from fedlora.lora import get_adapters
from fedlora.round_plan import GlobalState, derive_seed
from fedlora.server_round import ServerSide
from fedlora.run_keys import OUT_DIR_KEY, RESUME_KEY, SIMULATION_KEY
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
    """The reference federation's final model: the one a finished run in ``reference_dir`` left, else a run now (or
    the rest of one stopped there)."""
    recipe = reference_recipe(config, aux_units, reference_dir)
    write_reference_text(splits, reference_dir / "text", aux_units=aux_units)
    run_dir, what = reference_dir / "run", f"{recipe.strategy} (no noise) over the {aux_units} auxiliary units"
    if (run_dir / STATE_FILE).is_file() and (saved := Checkpoint.load(run_dir)).status == FINISHED:
        echo(f"the reference federation: {what}, finished in {run_dir}")
        return _model_at(ServerSide(recipe, 0.0, 0.0), saved.state)
    echo(f"the reference federation: {what}")
    reference = _federate(recipe.to_mapping(), run_dir, echo)
    return _model_at(reference.protocol, reference.state)


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
    audited = _federate({**config.to_mapping(), "dataset": f"folder:{root}"}, out_dir / "audited", echo)
    model = _model_at(audited.protocol, audited.state)
    reference_model = _reference_model(config, splits, aux_units, reference_dir, echo)

    sampled = set()
    for release in range(1, audited.releases + 1):
        sampled.update(audited.sampling.draw(audited.protocol.sampling_generator(release)))
    client_units = tokenized_units(f"folder:{root}", "train", tokenizer_of(config))
    eos = tokenizer.eos_id

    def score(client: int) -> float:
        own = [client_units[i] for i in partition_units(config.partitioner, units=units,
                                                        num_partitions=config.num_clients, partition_id=client,
                                                        seed=config.seed)]
        return text_loss(reference_model, own, config.seq_len, eos) - text_loss(model, own, config.seq_len, eos)

    plain = [c for c in range(config.num_clients) if c not in set(canary_clients)]
    members = np.array([score(c) for c in plain if c in sampled])
    others = np.array([score(c) for c in plain if c not in sampled])
    membership = {"members": len(members), "non_members": len(others)}
    if len(members) >= 2 and len(others) >= 2:
        membership |= {"auc": roc_auc(members, others), "auc_interval": auc_interval(members, others),
                       **{f"tpr_at_fpr_{fpr}": tpr_at_fpr(members, others, fpr) for fpr in (0.1, 0.01)},
                       **{f"tpr_at_fpr_{fpr}_interval": tpr_interval(members, others, fpr) for fpr in (0.1, 0.01)}}

    canary_scores = -sequence_losses(model, list(drawn.sequences), eos)
    null = -sequence_losses(model, list(drawn.candidates), eos)
    bits = exposure(canary_scores, null)
    ledger = audited.ledger
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
