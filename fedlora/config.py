"""The run configuration: one vocabulary for TOML files, `--set key=value`, Flower's run config and the CLIs.

Every option is declared once below with its type, default and check. ``RunConfig.from_mapping``
rejects unknown keys (suggesting the nearest valid one), converts types, and checks ranges and
cross-constraints (including rank and sketch dimension against the model's layers), raising a
``ConfigError`` that lists every problem, one sentence per line, before any work starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

from fedlora.run_keys import LAUNCH_KEYS
from fedlora.algorithms import ALGORITHMS, LoRAMode, check_layer_sizes, get_algorithm
from fedlora.data import PARTITIONER_KINDS
from fedlora.models import HUB_MODEL_PREFIX, MODELS, adapted_layer_shapes, model_spec
from fedlora.tasks import task_of
from fedlora.text import TEXT_DATASETS
from fedlora.tracking import TRACKERS
from fedlora.training import LOCAL_OPTIMIZERS, PRECISIONS

MAX_CLASSES = 10 ** 5  # ImageNet-21k has 21,843; a head of 10^9 classes would fill the memory before it failed
# `fedlora deploy` without --config: two SuperNodes on this machine, two rounds, OS noise.
# Noise at the client (the paper's round): the server of a deployment is a remote party, not trusted with messages.
DEPLOY_PRESET = {"num-clients": 2, "clients-per-round": 2, "num-rounds": 2, "train-examples": 400,
                 "test-examples": 200, "noise-source": "os", "noise-placement": "client", "message": "adapter"}
# `fedlora audit` without --config: the quickstart (enough clients per round for canaries), evaluation at the end only
AUDIT_PRESET = {"eval-every": 10}
HEAD_MODES = ("message", "probe", "frozen")
PLACEMENTS = ("client", "server", "secagg")
OBSERVERS = ("model", "server")  # target-observer; under secure aggregation "server" is one that follows SecAgg+
MIN_SECURE_REPLIES = 3  # Flower folds mask seeds to 32 bits: at N_min = 2 the one pairwise seed can be brute-forced
MESSAGE_FORMS = ("adapter", "update")
SERVER_OPTIMIZERS = ("sgd", "momentum", "adam")


class ConfigError(ValueError):
    """Every problem of a configuration, one sentence each (``str`` puts one per line)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def _bound(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _opt(default: Any, help: str, *, choices: tuple | None = None, low: float | None = None,
         high: float | None = None, low_open: bool = False, high_open: bool = False):
    return field(default=default, metadata={"help": help, "choices": choices, "low": low, "high": high,
                                            "low_open": low_open, "high_open": high_open})


@dataclass(frozen=True)
class RunConfig:
    strategy: str = _opt("sgmm-ffa-lora", "the algorithm", choices=tuple(ALGORITHMS))
    num_clients: int = _opt(500, "C, clients in the federation", low=1, high=10 ** 7)
    clients_per_round: int = _opt(50, "N, clients sampled per round (fixed sampling; Poisson uses N / C)", low=1)
    sampling: str = _opt("fixed", "client sampling: exactly N, or each client with rate N / C (poisson: with noise at "
                                  "the server only)", choices=("fixed", "poisson"))
    num_rounds: int = _opt(10, "T, federated rounds", low=1, high=10 ** 5)
    local_steps: int = _opt(2, "K, local steps per round", low=1)
    batch_size: int = _opt(16, "B, local mini-batch size", low=1)
    lr: float = _opt(0.05, "local learning rate", low=0.0, low_open=True)
    local_optimizer: str = _opt("sgd", "the clients' optimizer, fresh each round: sgd, or adam (steps that do not "
                                       "scale with the gradient; lr about 1e-3)", choices=LOCAL_OPTIMIZERS)
    rank: int = _opt(4, "LoRA rank r", low=1)
    lora_alpha: float = _opt(8.0, "LoRA alpha (the update is alpha / r * B A)", low=0.0, low_open=True)
    targets: str = _opt("qv", "adapted linears: attention query/value, or all attention and MLP linears",
                        choices=("qv", "all"))
    client_ranks: str = _opt("", "FlexLoRA: comma-separated client ranks, cycled over partition ids (empty: all r)")
    svd_split: str = _opt("into-b", "FlexLoRA: singular values into B, or split as square roots",
                          choices=("into-b", "sqrt"))
    sketch_dim: int = _opt(0, "b for SGMM, h for SGMV (0: b = 64, h = 64 r)", low=0)
    target_epsilon: float = _opt(8.0, "privacy budget epsilon: the noise is calibrated to spend it in num-rounds (or, "
                                      "with a noise-multiplier, the run stops before passing it; 0: no budget)",
                                 low=0.0)
    delta: float = _opt(1e-5, "delta", low=0.0, high=1.0, low_open=True, high_open=True)
    noise_multiplier: float = _opt(0.0, "z = sigma / clip-norm as given (0: calibrated to target-epsilon)", low=0.0)
    clip_norm: float = _opt(1.0, "tau, Frobenius clip of each client's whole message (where float32 carries it)",
                            low=1e-30, high=1e30)
    threat_model: str = _opt("known-sketch", "who may know the sketch", choices=("known-sketch", "secret-sketch"))
    accountant: str = _opt("rdp", "fixed-size sampling's accountant for the model's observers: RDP (and the "
                                  "known-sample bound), or also the PLD of a proven dominating pair (Dong, Roth and "
                                  "Su Thm 4.2), tighter (quickstart's z: 5.55 where RDP gives 8.0; "
                                  "docs/explanation/threat-models.md)", choices=("rdp", "pld"))
    noise_placement: str = _opt("server", "where the noise is added: by each client to its own message (the paper; the "
                                          "server sees each noisy message and knows whose it is, so against it the "
                                          "epsilon is the known-sample one, without amplification), or by the server "
                                          "to the sum of the round's messages (central DP: the guarantee holds against "
                                          "everyone who sees the model, not against the server), or by the clients in "
                                          "shares of a sum the server only sees through secure aggregation (SecAgg+: "
                                          "against a server that follows the protocol, the known-sample epsilon of the "
                                          "sum). Against observers of the model, who do not know the sample, every "
                                          "placement's epsilon is amplified by sampling",
                                 choices=PLACEMENTS)
    target_observer: str = _opt("model", "whose epsilon target-epsilon calibrates (and the budget limits): observers of "
                                         "the model, who do not know which clients took part (amplified by sampling), "
                                         "or the server, which draws the sample (no amplification; not with noise at "
                                         "the server, which sees every message before its noise). Both are reported",
                                choices=OBSERVERS)
    message: str = _opt("update", "what a client sends: its whole local adapter (the paper), or its update, the "
                                   "change from the global adapter it started from (DP-FedAvg; FlexLoRA: the change "
                                   "of each layer's product B A), which the server applies with server-optimizer",
                        choices=MESSAGE_FORMS)
    server_optimizer: str = _opt("sgd", "message = update: how the server applies the noisy mean update",
                                 choices=SERVER_OPTIMIZERS)
    server_lr: float = _opt(1.0, "message = update: the server optimizer's learning rate", low=0.0, low_open=True)
    server_momentum: float = _opt(0.9, "message = update: momentum (beta1 for adam)", low=0.0, high=1.0,
                                high_open=True)
    clip_quantile: float = _opt(0.0, "private adaptive clipping (Andrew et al. 2021): the quantile of the clients' "
                                     "message norms the clip norm tracks, clip-norm being its start (0: clip-norm "
                                     "fixed)", low=0.0, high=1.0, high_open=True)
    clip_lr: float = _opt(0.2, "adaptive clipping: the geometric step of the clip norm per round", low=0.0,
                          low_open=True)
    clip_count_stddev: float = _opt(0.0, "adaptive clipping: the noise on the count of clients under the clip norm "
                                         "(0: clients-per-round / 20, Andrew et al.'s default); accounted, and the "
                                         "update's noise is raised to pay for it", low=0.0)
    sketch_secret: str = _opt("run-seed", "secret-sketch: the sketch seed derived from the run seed (simulation only: the "
                                          "server knows it, and evaluates; every epsilon says so, and the one against "
                                          "the server is inf), or read by every SuperNode from its sketch-secret-file "
                                          "(deployment: the server never sees it)",
                              choices=("run-seed", "node-file"))
    head: str = _opt("message", "classifier head: trained inside the private message; trained first in a "
                                "private linear-probe phase, then frozen; or frozen at its seeded init",
                     choices=HEAD_MODES)
    probe_rounds: int = _opt(0, "head = probe: linear-probe rounds before LoRA (0: 20% of num-rounds)", low=0)
    probe_budget: float = _opt(0.2, "head = probe: share of target-epsilon spent by the probe phase", low=0.0,
                               high=1.0, low_open=True)
    dataset: str = _opt("synthetic", "images: synthetic CIFAR-like data (offline), CIFAR-100 from the hub, "
                                     "Fashion-MNIST (offline from `apt-get install dataset-fashion-mnist`, else the "
                                     "hub), any Hugging Face image-classification dataset as hf:<id>, or a folder with "
                                     "one subfolder of images per class as folder:<path>. Text (a language model): "
                                     f"{', '.join(TEXT_DATASETS)} (the King James Bible, offline from `apt-get install "
                                     "bible-kjv`, one unit per chapter), a hub dataset as hf:<id>, or folder:<path> of "
                                     ".txt files (one unit each) or JSON-lines files (one unit per client-column "
                                     "value). Labelled text (a text classifier): hf:<id>, or folder:<path> with a "
                                     "subfolder of .txt files per class (a file an example) or JSON-lines files (a row "
                                     "an example, with a text and a label field)")
    image_column: str = _opt("", "an hf: or folder: dataset's image column (empty: its one Image feature)")
    unreadable: str = _opt("refuse", "an hf: or folder: dataset's images that do not decode, or its text files not "
                                     "UTF-8 and JSON lines not JSON: refuse (one line naming the first, before any "
                                     "work) or skip (left out, and counted where the run starts)",
                           choices=("refuse", "skip"))
    label_column: str = _opt("", "an hf: or folder: dataset's label column (empty: its one ClassLabel, else label; "
                                 "text: label, labels, class or category)")
    text_column: str = _opt("", "text: an hf: or JSON-lines dataset's text column (empty: text, content, sentence "
                                "or document, else its one string column)")
    client_column: str = _opt("", "text: the column whose values are the natural units, one writer each (empty: "
                                  "user, client, author, ... if present, else one unit per row; a text classifier's "
                                  "natural partition needs one)")
    seq_len: int = _opt(64, "text: tokens per block (texts are packed, each followed by an end-of-text token)",
                        low=2, high=10 ** 6)
    tokenizer: str = _opt("", "text: a tokenizer.json file or a hub id (empty: the model's own)")
    num_classes: int = _opt(0, "classes (0: the data's; synthetic data has 10 unless set)", low=0, high=MAX_CLASSES)
    # synthetic images are made in memory, 3 KiB each: 10^6 is 3 GiB
    train_examples: int = _opt(20000, "synthetic train-split size", low=1, high=10 ** 6)
    test_examples: int = _opt(1000, "synthetic test-split size", low=1, high=10 ** 6)
    model: str = _opt("vit-tiny-public", "backbone (vit-tiny-public: the tiny ViT pretrained offline on public "
                                         "synthetic classes; vit-tiny-fashion-public: on Fashion-MNIST's public "
                                         "split; vit-tiny: the same at random init; hf:<hub id or folder>: a "
                                         "transformers checkpoint of a family fedlora adapts: GPT-2, LLaMA-style "
                                         "(LLaMA, Mistral, Qwen2/3, Gemma), BERT, RoBERTa, DistilBERT)",
                       choices=tuple(MODELS))
    partitioner: str = _opt("iid", "how data is split over clients: iid; dirichlet or pathological by label; or "
                                   "natural, each writer's data together (a chapter, a file, a client-column value), "
                                   "writers dealt to clients in order, one each when there are as many clients as "
                                   "writers (a language model's text: natural or iid over its units)",
                            choices=PARTITIONER_KINDS)
    dirichlet_alpha: float = _opt(0.5, "Dirichlet concentration (smaller: more skew)", low=0.0, low_open=True)
    min_replies: int = _opt(0, "valid replies a round needs to be aggregated, else it is retried (0: half of "
                                "clients-per-round, rounded up; under secure aggregation, where it is N_min, the "
                                "fewest replies a sum is released with: 90% of clients-per-round, at least 3)",
                            low=0)
    round_retries: int = _opt(2, "retries of a round with too few valid replies before the run stops (every try is "
                                 "a release and counts in epsilon)", low=0)
    reply_timeout: float = _opt(600.0, "seconds a round waits for its clients' replies", low=0.0, low_open=True)
    eval_every: int = _opt(1, "evaluate the global model every this many rounds", low=1)
    tracker: str = _opt("tensorboard", "where each round's metrics go besides metrics.jsonl: TensorBoard event files in "
                                       "the run directory (`tensorboard --logdir runs/`), or nowhere else",
                        choices=TRACKERS)
    seed: int = _opt(0, "seed of the model init, data, sketches and, in seeded simulations, the noise and the sampling",
                     low=0, high=2 ** 63 - 1)
    noise_source: str = _opt("seeded", "the noise and each round's sample of clients: seeded from the run seed "
                                       "(reproducible simulations only: anyone with the seed removes the noise and "
                                       "knows who took part, so every epsilon says so, and a run outside a simulation "
                                       "refuses it) or the OS's secure randomness (anything released)",
                             choices=("seeded", "os"))
    client_cpus: int = _opt(1, "CPUs per simulated client (Ray)", low=1)
    client_gpus: float = _opt(0.0, "GPU fraction per simulated client (Ray)", low=0.0, high=1.0)
    simulation_nodes: int = _opt(0, "simulation: Flower nodes that run the clients, each round's sampled clients "
                                     "dealt over them, several per message (0: one per Ray worker, as many as train "
                                     "at once, where every client may share a node, else one per client; "
                                     "num-clients: one per client, each sampled client a message, as in a "
                                     "deployment, whose thousands of nodes Flower's engine polls). On a CPU the "
                                     "same run, bit for bit, either way; on a GPU a message's clients train "
                                     "client-batch at a time, each as alone up to floating-point summation order",
                             low=0)
    precision: str = _opt("auto", "the clients' and the server's forward and backward passes: bf16 autocast (the "
                                  "matrix products in bfloat16; the parameters, their gradients, the loss, clipping, "
                                  "sketches and noise in float32), bf16-backbone (bf16, and the frozen backbone "
                                  "stored in bfloat16, so that its residual stream is bfloat16 too), fp32, or auto: "
                                  "bf16-backbone on a GPU that supports bf16 (the fastest there), fp32 elsewhere",
                          choices=PRECISIONS)
    client_batch: int = _opt(0, "clients a simulation node trains together, in one forward and backward per local step "
                                "(a simulation message's clients: see simulation-nodes); each computes what it would "
                                "alone, up to floating-point summation order. 0: 16 on a GPU (ViT-B/16 at 224 px: "
                                "2.7x one at a time, 12 GiB), 1 on a CPU (no faster there)", low=0)

    @staticmethod
    def key(name: str) -> str:
        """The vocabulary's spelling of a field: dashes, as in TOML and Flower's run config."""
        return name.replace("_", "-")

    @classmethod
    def keys(cls) -> list[str]:
        return [cls.key(f.name) for f in fields(cls)]

    @classmethod
    def from_mapping(cls, values: dict[str, Any], base: RunConfig | None = None) -> RunConfig:
        """A validated config from vocabulary keys; unspecified keys come from ``base`` (default: defaults)."""
        by_key = {cls.key(f.name): f for f in fields(cls)}
        current = dataclasses.asdict(base) if base is not None else {}
        problems = []
        for key, value in values.items():
            if key not in by_key:
                near = difflib.get_close_matches(key, by_key, n=1)
                problems.append(f"Unknown key '{key}'" + (f"; did you mean '{near[0]}'?" if near else "."))
                continue
            try:
                current[by_key[key].name] = _convert(key, value, by_key[key].type)
            except ValueError as error:
                problems.append(str(error))
        config = cls(**current)  # a value that did not convert keeps its default: its problem is named above
        problems += config.problems()
        if problems:
            raise ConfigError(problems)
        return config

    @property
    def task(self):
        """What the model does (fedlora.tasks): its data, loss and metrics."""
        return task_of(self.model)

    @property
    def classes(self) -> int:
        """The run's number of classes: num-classes, else the data's (read off the data for hf: and folder:); 0 for
        a language model."""
        return self.task.classes(self)

    def problems(self) -> list[str]:
        """Every range and cross-constraint this configuration breaks, one sentence each."""
        problems = []
        for f in fields(self):
            value, meta, key = getattr(self, f.name), f.metadata, self.key(f.name)
            if key == "model" and value.startswith(HUB_MODEL_PREFIX):  # any checkpoint of a family fedlora adapts
                try:
                    model_spec(value)
                except ValueError as error:
                    problems.append(str(error))
                continue
            if meta["choices"] and value not in meta["choices"]:
                problems.append(_choice_problem(key, value, meta["choices"]))
                continue
            low, high = meta["low"], meta["high"]
            if isinstance(value, float) and not math.isfinite(value):  # NaN passes every comparison
                problems.append(f"{key} must be a finite number, got {value}.")
            elif low is not None and (value < low or (meta["low_open"] and value == low)):
                problems.append(f"{key} must be {'>' if meta['low_open'] else '>='} {_bound(low)}, got {value}.")
            elif high is not None and (value > high or (meta["high_open"] and value == high)):
                problems.append(f"{key} must be {'<' if meta['high_open'] else '<='} {_bound(high)}, got {value}.")
        if problems:  # the task's checks and the cross-constraints below assume every field is in range
            return problems
        problems += self.task.problems(self)
        if problems:
            return problems
        algorithm = get_algorithm(self.strategy)
        if self.clients_per_round > self.num_clients:
            problems.append(f"clients-per-round ({self.clients_per_round}) cannot exceed num-clients "
                            f"({self.num_clients}).")
        if self.simulation_nodes > self.num_clients:
            problems.append(f"simulation-nodes ({self.simulation_nodes}) cannot exceed num-clients "
                            f"({self.num_clients}).")
        if self.client_batch > 1 and (self.simulation_nodes == self.num_clients or self.noise_placement == "secagg"):
            problems.append(f"client-batch = {self.client_batch} trains together the clients one message carries: "
                            "with a node per client (simulation-nodes = num-clients, or noise-placement = \"secagg\") "
                            "each message carries one.")
        if self.min_replies > self.clients_per_round:
            problems.append(f"min-replies ({self.min_replies}) cannot exceed clients-per-round "
                            f"({self.clients_per_round}).")
        if self.client_ranks and algorithm.family is not LoRAMode.FLEX:
            problems.append("client-ranks (heterogeneous ranks) needs a FlexLoRA strategy: FFA averages B, "
                            "which needs one rank.")
        try:
            ranks = self.parsed_client_ranks()
        except ValueError as error:
            problems.append(str(error))
            ranks = []
        problems += [f"Every client rank must lie in [1, rank = {self.rank}], got {r}." for r in ranks
                     if not 1 <= r <= self.rank]
        if algorithm.private and self.target_epsilon == 0 and self.noise_multiplier == 0:
            problems.append(f"{self.strategy} is private: set target-epsilon > 0, or a noise-multiplier > 0.")
        if self.threat_model == "secret-sketch" and algorithm.sketched and self.sampling == "poisson":
            problems.append("Secret-sketch accounting supports fixed-size sampling only: set sampling = \"fixed\".")
        elif algorithm.private and self.sampling == "poisson" and self.noise_placement == "client":
            problems.append("sampling = \"poisson\" with noise-placement = \"client\" is refused: each client adds its "
                            "own noise, so the model's noise grows with the number of participants and reveals it, "
                            "which Poisson accounting assumes hidden; use sampling = \"fixed\" or noise-placement = "
                            "\"server\".")
        if self.sketch_secret == "node-file" and not (self.threat_model == "secret-sketch" and algorithm.sketched):
            problems.append("sketch-secret = \"node-file\" is for sketched strategies under threat-model = "
                            "\"secret-sketch\"; under known-sketch the server broadcasts the sketch seeds.")
        if self.head == "probe" and self.num_rounds < 2:
            problems.append(f"head = \"probe\" needs num-rounds >= 2 (the linear-probe phase, then LoRA rounds), got "
                            f"{self.num_rounds}.")
        elif self.head == "probe" and not 1 <= self.linear_probe_rounds() < self.num_rounds:
            problems.append(f"The linear-probe phase needs 1 to {self.num_rounds - 1} rounds (probe-rounds), leaving "
                            "LoRA rounds after it.")
        problems += self._lever_problems(algorithm)
        try:  # rank <= every adapted layer's sides; b <= m (SGMM), h <= m r (SGMV)
            check_layer_sizes(algorithm, adapted_layer_shapes(self.model, targets=self.targets).values(),
                              rank=self.rank, sketch_dim=self.effective_sketch_dim())
        except ValueError as error:
            problems.append(str(error))
        return problems

    def _lever_problems(self, algorithm) -> list[str]:
        """Noise placement, update form and adaptive clipping: the combinations the design does not support."""
        problems = []
        defaults = {f.name: f.default for f in fields(self)}
        # noise-placement is allowed (and moot) for a non-private strategy: `--set strategy=ffa-lora` then runs
        # the same config without noise, the reference a private run is compared with
        if self.noise_placement == "server" and algorithm.private:
            if algorithm.sketched and self.threat_model == "secret-sketch":
                problems.append('noise-placement = "server" needs threat-model = "known-sketch": the secret-sketch '
                                "bound is derived for noise on every client's message, not on their sum (set "
                                'noise-placement = "client" for secret-sketch).')
        if self.noise_placement == "secagg":
            problems += self._secagg_problems(algorithm)
        if self.target_observer == "server" and self.noise_placement == "server" and algorithm.private:
            problems.append('target-observer = "server" needs the noise away from the server (noise-placement = '
                            '"client" or "secagg"): with noise at the server it sees every message before the noise, '
                            "and no epsilon holds against it.")
        elif self.target_observer == "server" and self.noise_source == "seeded" and algorithm.private:
            problems.append('target-observer = "server" needs noise-source = "os": the server holds the run seed '
                            "that seeded noise is drawn from, and no epsilon holds against it.")
        if self.message == "update":
            if algorithm.family is LoRAMode.FLEX and algorithm.sketched and self.threat_model == "secret-sketch":
                problems.append('message = "update" with sgmm-flexlora needs threat-model = "known-sketch": the '
                                "secret-sketch bound (the paper's) is derived for sketched factors of rank r, not "
                                'for the m x k change of their product (set message = "adapter" for it).')
            if self.sketch_secret == "node-file":
                problems.append('message = "update" needs the server to de-sketch the mean update, which it cannot '
                                'with sketch-secret = "node-file".')
        elif self.server_optimizer != defaults["server_optimizer"] or self.server_lr != defaults["server_lr"]:
            problems.append('server-optimizer and server-lr apply to message = "update"; the adapter form replaces '
                            "the global adapter with the mean.")
        if self.clip_quantile:
            if not algorithm.private:
                problems.append(f"{self.strategy} clips nothing: adaptive clipping (clip-quantile) applies to "
                                "private strategies.")
            if self.head == "probe":
                problems.append('Adaptive clipping (clip-quantile) is not supported with head = "probe": use '
                                '"message" or "frozen".')
        elif self.clip_lr != defaults["clip_lr"] or self.clip_count_stddev != defaults["clip_count_stddev"]:
            problems.append("clip-lr and clip-count-stddev apply to adaptive clipping: set clip-quantile > 0.")
        return problems

    def _secagg_problems(self, algorithm) -> list[str]:
        """What secure aggregation (noise-placement = "secagg") needs."""
        if not algorithm.private:
            return [f'noise-placement = "secagg" adds the noise in shares: {self.strategy} adds none (choose a '
                    'private strategy, or noise-placement = "server" for the non-private reference).']
        problems = []
        if algorithm.sketched and self.threat_model == "secret-sketch":
            problems.append('noise-placement = "secagg" needs threat-model = "known-sketch": the secret-sketch bound '
                            "is derived for noise on every client's message, not on their sum.")
        if self.sampling != "fixed":
            problems.append('noise-placement = "secagg" needs sampling = "fixed": with Poisson sampling the number '
                            "of noise shares in the sum changes with who takes part, which the accountant does not "
                            "cover.")
        if self.required_replies() < MIN_SECURE_REPLIES:
            problems.append(f"noise-placement = \"secagg\" needs min-replies >= {MIN_SECURE_REPLIES} (it is "
                            f"{self.required_replies()}; clients-per-round >= {MIN_SECURE_REPLIES}): Flower's SecAgg+ "
                            "folds each mask seed to 32 bits, so in a sum of 2 the server can brute-force the one "
                            "pairwise seed and hold each reply alone.")
        if self.clip_quantile:
            problems.append('noise-placement = "secagg" does not support adaptive clipping (clip-quantile) yet: the '
                            "clip count would need its own secure sum.")
        if self.simulation_nodes not in (0, self.num_clients):
            problems.append('noise-placement = "secagg" needs one Flower node per client (simulation-nodes = 0 or '
                            "num-clients): every client is its own party in SecAgg+.")
        return problems

    def ignored_keys(self) -> dict[str, str]:
        """The keys this configuration's strategy does not read, each with why. They are allowed, not refused: a
        private config run with `--set strategy=ffa-lora` is the non-private reference it is compared with."""
        algorithm = get_algorithm(self.strategy)
        if not algorithm.private:
            return dict.fromkeys(("target-epsilon", "noise-multiplier", "delta", "clip-norm", "noise-placement",
                                  "target-observer", "probe-budget", "threat-model", "sketch-dim", "sketch-secret",
                                  "accountant"),
                                 f"{self.strategy} adds no noise and clips nothing")
        if not algorithm.sketched:
            return dict.fromkeys(("threat-model", "sketch-dim", "sketch-secret"),
                                 f"{self.strategy} sends its message unsketched")
        return {}

    def outside_simulation_problems(self) -> list[str]:
        """What a run that no simulation engine runs (a deployment, `flwr run .` on real SuperNodes) must not do:
        take its noise or its secret sketch from the run seed, which the server holds."""
        problems = []
        algorithm = get_algorithm(self.strategy)
        if self.noise_source == "seeded" and algorithm.private:
            problems.append('noise-source = "seeded" derives every noise draw from the run seed, and the sample of '
                            'clients, so anyone who holds it removes the noise and knows who took part: outside a '
                            'simulation set noise-source = "os" (for a simulation federation of `flwr run .`, set '
                            "simulation = true).")
        if self.threat_model == "secret-sketch" and algorithm.sketched and self.sketch_secret == "run-seed":
            problems.append('sketch-secret = "run-seed" lets the server derive the secret sketch: outside a simulation '
                            'set sketch-secret = "node-file" (each SuperNode reads it from its sketch-secret-file).')
        return problems

    def count_stddev(self) -> float:
        """Adaptive clipping: the standard deviation of the noise on the count of clients under the clip norm."""
        return self.clip_count_stddev or self.clients_per_round / 20

    def flower_nodes(self, workers: int | None = None) -> int:
        """The Flower nodes a simulation runs: simulation-nodes; else, given the ``workers`` that train at once, one
        per worker, unless each client must be a party of its own (SecAgg+); else one per client."""
        if self.simulation_nodes:
            return self.simulation_nodes
        if workers and self.noise_placement != "secagg":
            return max(1, min(workers, self.num_clients))
        return self.num_clients

    def required_replies(self) -> int:
        """Valid replies a round needs to be aggregated: min-replies, or half of N rounded up; under secure
        aggregation, where it is N_min, 90% of N rounded down and at least 3 (docs: tutorials/secure-aggregation.md)."""
        if self.min_replies:
            return self.min_replies
        if self.noise_placement == "secagg":  # each reply carries 1 / N_min of the noise: a full sum N / N_min of it
            return min(max(int(0.9 * self.clients_per_round), MIN_SECURE_REPLIES), self.clients_per_round)
        return -(-self.clients_per_round // 2)

    def budget(self) -> float | None:
        """The epsilon the run must not pass (None: no budget)."""
        return self.target_epsilon or None

    def linear_probe_rounds(self) -> int:
        """Rounds of the private linear-probe phase (head = probe), else 0."""
        if self.head != "probe":
            return 0
        return self.probe_rounds or max(1, round(0.2 * self.num_rounds))

    def parsed_client_ranks(self) -> list[int]:
        try:
            return [int(r) for r in self.client_ranks.split(",") if r.strip()]
        except ValueError:
            raise ValueError(f"client-ranks must be comma-separated whole numbers, got '{self.client_ranks}'.") from None

    def effective_sketch_dim(self) -> int:
        """b (SGMM) or h (SGMV); 0 means the defaults b = 64 and h = 64 r."""
        if self.sketch_dim:
            return self.sketch_dim
        return 64 * self.rank if get_algorithm(self.strategy).mechanism == "sgmv" else 64

    def to_mapping(self) -> dict[str, Any]:
        return {self.key(f.name): getattr(self, f.name) for f in fields(self)}


def _choice_problem(key: str, value: Any, choices: tuple) -> str:
    if key == "strategy" and str(value).startswith("sgmv-flex"):
        return ("SGMV cannot be used with FlexLoRA: the server multiplies B A, which a vectorized sketch of B does "
                "not allow (paper Remark 3.2); use sgmm-flexlora or sgmv-ffa-lora.")
    near = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    hint = f"; did you mean '{near[0]}'?" if near else "."
    return f"{key} must be one of {', '.join(map(str, choices))}, got '{value}'{hint}"


def _convert(key: str, value: Any, kind: Any) -> Any:
    kind = {"int": int, "float": float, "str": str, int: int, float: float, str: str}[kind]
    if kind is str:
        return str(value)
    if isinstance(value, bool):
        raise ValueError(f"{key} must be a number, got {value}.")
    try:
        converted = kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be {'a whole number' if kind is int else 'a number'}, got '{value}'.") from None
    if kind is int and isinstance(value, float) and value != converted:
        raise ValueError(f"{key} must be a whole number, got {value}.")
    return converted


def parse_assignment(text: str) -> tuple[str, Any]:
    """`key=value` as given to --set: the value is read as TOML when it parses, else as a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set takes key=value, got '{text}'.")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.strip(), value


def packaged_presets() -> dict[str, Path]:
    """The presets that come with fedlora (configs/*.toml, installed as fedlora/configs), by name."""
    import fedlora.configs

    return {p.stem: p for folder in fedlora.configs.__path__ for p in sorted(Path(folder).glob("*.toml"))}


def preset_path(path: str | Path) -> Path:
    """A preset file: the file at ``path``, or for a bare name (``quickstart``) the packaged preset of that name."""
    if not str(path).strip():
        raise ValueError("The config file's name is empty.")
    path = Path(path)
    if path.is_file():
        return path
    presets = packaged_presets()
    if path.parent == Path(".") and path.stem in presets and path.suffix in ("", ".toml"):
        return presets[path.stem]
    if path.is_dir():
        raise ValueError(f"Config file '{path}' is a directory: name a TOML file in it.")
    raise ValueError(f"Config file '{path}' does not exist (or give a packaged preset by name: "
                     f"{', '.join(presets)}).")


def load_config(path: str | Path | None = None, assignments: list[str] | None = None) -> RunConfig:
    """A TOML preset (its top-level keys, or its [tool.flwr.app.config] table) plus `--set` overrides."""
    values: dict[str, Any] = {}
    if path is not None:
        path = preset_path(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"Config file '{path}' is not valid TOML ({error}).") from None
        values = table = data  # the top-level keys, or a Flower app's [tool.flwr.app.config] table
        for name in ("tool", "flwr", "app", "config"):
            table = table.get(name)
            if table is None:
                break
            if not isinstance(table, dict):
                raise ValueError(f"Config file '{path}': '{name}' must be a table of the [tool.flwr.app.config] "
                                 f"path, got {type(table).__name__}.")
        else:
            values = table
    for assignment in assignments or []:
        key, value = parse_assignment(assignment)
        values[key] = value
    return RunConfig.from_mapping(values)


def run_config_of(values: dict[str, Any]) -> RunConfig:
    """The validated RunConfig of a Flower run config (which may also carry the launch keys above)."""
    return RunConfig.from_mapping({k: v for k, v in values.items() if k not in LAUNCH_KEYS})
