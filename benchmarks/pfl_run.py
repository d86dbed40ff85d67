"""fedlora's federation trained by Apple's pfl-research (PyPI pfl 0.6.0): the model, clients, batches, clip and server
step of `fedlora run --config NAME --set strategy=gm-ffa-lora`, on pfl's engine, for benchmarks/pfl_peer.py.

Run with the pfl venv's python (pfl pins dp-accounting < 0.6; a .pth file there adds fedlora's venv behind its own
site-packages), from the repository root, one process per pfl worker:

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m benchmarks.pfl_run --config quickstart \\
        --set strategy=gm-ffa-lora --noise-multiplier 1.4707 --out DIR [--rounds T] [--fedlora-noise]
    python -m benchmarks.pfl_run --config quickstart --set strategy=gm-ffa-lora --check-update

The run writes DIR/start.json ({"main_started"}) first, then DIR/metrics.jsonl, one row a round ("round",
"accuracy" and "loss" on the test split, null where fedlora does not evaluate, "seconds" from the round's sampling to
its row, "time"). --check-update trains round 1's first client through pfl's FedAvg and through fedlora's
ClientSide and prints one JSON line: whether the raw updates are bit-identical, their largest difference, the number
of message entries, and the same after each framework's clip.

pfl's pieces, as its benchmarks (benchmarks/image_classification/pytorch/train.py) build them: a PyTorchModel around
the PEFT model (``FedloraModule``), a FederatedDataset, a SimulatedBackend with WeightByUser and
CentrallyAppliedPrivacyMechanism(GaussianMechanism(clip, z)), FederatedAveraging with a fresh local SGD (or Adam) per
user and a central torch.optim.SGD (lr server-lr, momentum for server-optimizer = "momentum"), and
CentralEvaluationCallback. fedlora's: the model (``RoundPlan.build_model``, LoRA B and the head trained), each round's
cohort (its seeded fixed-size sample for the release) and each client's K batches, drawn with fedlora's seeds from
its partition and handed to pfl as a user dataset of exactly those K * batch examples in order, which pfl's local
loop walks one batch a step. Switched off, as work fedlora does not do: the central evaluation before round 1 and
every sampled user's evaluation before and after training in pfl's evaluation iterations (iteration 0).

Where pfl's work differs from fedlora's: pfl clips to exactly the clip norm in float32 (fedlora to (1 - 1e-6) times
it in float64, rounding toward zero), sums the clipped updates in float32 (fedlora in float64) and applies the mean
by its float32 SGD, so aggregates agree to float rounding, not bit for bit; its noise is its own draw, so runs
compare as runs of two seeds unless --fedlora-noise draws fedlora's seeded server noise for each release instead.
Measured on the quickstart (z 1.4707, CPU): round 1's first client's update bit-identical (SGD; Adam on
fashion_mnist too), the clipped one 7e-9 apart where the clip bites; with --fedlora-noise the global state after
round 1 1.5e-8 from fedlora's and round 2's test accuracy equal (0.714, loss equal to 7 digits); pfl's own noise
gives the same rows with 1 and 2 workers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from pfl.aggregate.simulate import SimulatedBackend
from pfl.aggregate.weighting import WeightByUser
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.central_evaluation import CentralEvaluationCallback
from pfl.context import UserContext
from pfl.data.dataset import Dataset
from pfl.data.federated_dataset import FederatedDataset
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.internal.ops import pytorch_ops
from pfl.metrics import Metrics, StringMetricName, Weighted
from pfl.model.pytorch import PyTorchModel
from pfl.privacy import CentrallyAppliedPrivacyMechanism, GaussianMechanism
from pfl.stats import MappedVectorStatistics
from torch import nn

from fedlora.algorithms import LoRAMode
from fedlora.cli import add_overrides
from fedlora.config import RunConfig, load_config
from fedlora.experiment import sampling_of
from fedlora.federation import Protocol
from fedlora.lora import get_adapters, message_parameters
from fedlora.mechanisms import NoisePlacement, gaussian_noise_like, message_norm
from fedlora.models import logits
from fedlora.node import NodeSettings
from fedlora.round_plan import LORA, derive_seed
from fedlora.sketch import NoSketch
from fedlora.training import autocast, compute_dtype, select_device

EVAL_BATCH = 256  # fedlora.training.evaluate's


class FedloraModule(nn.Module):
    """fedlora's PEFT model with the ``loss`` and ``metrics`` pfl's PyTorchModel calls: the task's loss under fedlora's
    autocast, and the test split's correct count and summed cross-entropy (fedlora.training.evaluate)."""

    def __init__(self, net: nn.Module, config: RunConfig, device: torch.device):
        super().__init__()
        self.net, self.task = net, config.task
        self.device, self.dtype = device, compute_dtype(config.precision, device)

    def loss(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.train()
        with autocast(self.device, self.dtype):
            return self.task.loss(self.net, {"pixel_values": pixel_values, "labels": labels})

    @torch.no_grad()
    def metrics(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict[str, Weighted]:
        self.eval()
        with autocast(self.device, self.dtype):
            out = logits(self.net, pixel_values).float()
        return {"accuracy": Weighted(int((out.argmax(dim=1) == labels).sum()), len(labels)),
                "loss": Weighted(float(F.cross_entropy(out, labels, reduction="sum")), len(labels))}


class FedloraCohorts(FederatedDataset):
    """pfl's FederatedDataset over fedlora's partitions: each cohort pfl asks for is fedlora's next release's sample,
    in its order (pfl deals position i to worker i mod the workers), and each user's dataset the K batches fedlora's
    client draws that release, with its seeds (batches; augmentation from torch's global generator)."""

    def __init__(self, protocol: Protocol, device: torch.device):
        self.protocol, self.config, self.device = protocol, protocol.config, device
        self.sampling = sampling_of(self.config)
        self.release, self.cohort, self.position, self.started = 0, [], 0, time.time()
        self.partitions: dict[int, object] = {}  # decoded once per process, as fedlora's workers keep them
        super().__init__(self.user_data, self.next_user)

    def get_cohort(self, cohort_size: int) -> Iterable[tuple[Dataset, int]]:
        self.release += 1
        self.started = time.time()
        self.cohort = self.sampling.draw(self.protocol.sampling_generator(self.release))
        if cohort_size != len(self.cohort):
            raise RuntimeError(f"pfl asked for {cohort_size} users; fedlora sampled {len(self.cohort)}.")
        self.position = 0
        return super().get_cohort(cohort_size)

    def next_user(self) -> int:
        """The user sampler: the cohort's users in order. pfl draws one user for every worker at a time, so where the
        cohort does not divide among the workers its last draw runs past the end: those users are never trained."""
        user = self.cohort[self.position % len(self.cohort)]
        self.position += 1
        return user

    def user_data(self, partition: int) -> Dataset:
        c = self.config
        if partition not in self.partitions:
            self.partitions[partition] = c.task.train_data(c, NodeSettings(partition, c.num_clients), self.device)
        data = self.partitions[partition]
        batches = torch.Generator().manual_seed(derive_seed(c.seed, "batches", self.release, partition))
        torch.manual_seed(derive_seed(c.seed, "augment", self.release, partition))
        draws = [data[torch.randint(len(data), (c.batch_size,), generator=batches).tolist()]
                 for _ in range(c.local_steps)]
        return Dataset((torch.cat([d["pixel_values"] for d in draws]), torch.cat([d["labels"] for d in draws])),
                       user_id=str(partition))


class FedAvgWithoutUserEvaluation(FederatedAveraging):
    """pfl's FedAvg without evaluating each sampled user before and after its training in evaluation iterations
    (iteration 0 whatever the frequency): fedlora's clients do not."""

    def get_next_central_contexts(self, *args, **kwargs):
        contexts, model, metrics = super().get_next_central_contexts(*args, **kwargs)
        if contexts is not None:
            contexts = tuple(dataclasses.replace(c, do_evaluation=False) for c in contexts)
        return contexts, model, metrics


class FedloraNoise(GaussianMechanism):
    """pfl's Gaussian mechanism drawing fedlora's seeded server noise for the round's release, entry by entry in the
    order of fedlora's message, added in float64 as fedlora adds it: the aggregate then equals fedlora's to float
    rounding."""

    def __init__(self, protocol: Protocol, cohorts: FedloraCohorts, entries: dict[str, str]):
        super().__init__(protocol.config.clip_norm, protocol.noise_multiplier)
        self.protocol, self.cohorts, self.entries = protocol, cohorts, entries

    def add_noise(self, statistics, cohort_size, name_formatting_fn=StringMetricName, seed=None):
        generator, std = self.protocol.server_noise(self.cohorts.release), self.protocol.mechanism.noise_std
        noised = {name: (statistics[name].double() + gaussian_noise_like(statistics[name].double(), std, generator))
                  .float() for name in self.entries.values()}
        return MappedVectorStatistics(noised, statistics.weight), Metrics()


class RoundRecorder(CentralEvaluationCallback):
    """pfl's central evaluation where fedlora evaluates (every eval-every rounds and after the last, not before round
    1), and on rank 0 one metrics row and progress line a round."""

    def __init__(self, test: Dataset, cohorts: FedloraCohorts, out_dir: Path | None):
        super().__init__(test, NNEvalHyperParams(local_batch_size=EVAL_BATCH), format_fn=StringMetricName)
        self.config, self.cohorts, self.out_dir = cohorts.config, cohorts, out_dir

    def on_train_begin(self, *, model: PyTorchModel) -> Metrics:
        # pfl learns from its first evaluation, the skipped one, that the model's metrics can be summed over workers
        model._allows_distributed_evaluation = True
        return Metrics()

    def after_central_iteration(self, aggregate_metrics, model, *, central_iteration: int):
        round_, c = central_iteration + 1, self.config
        due = round_ % c.eval_every == 0 or round_ == c.num_rounds
        metrics = self._eval(model)[1] if due else Metrics()
        if self.out_dir is not None:
            values = metrics.to_simple_dict(to_lowercase=True)
            row = {"round": round_, "accuracy": values.get("accuracy"), "loss": values.get("loss"),
                   "seconds": time.time() - self.cohorts.started, "time": time.time()}
            with (self.out_dir / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
            shown = f"accuracy {row['accuracy']:.4f}, loss {row['loss']:.4f}" if due else "not evaluated"
            print(f"pfl round {round_}/{c.num_rounds}: {shown}, {row['seconds']:.1f} s", flush=True)
        return False, metrics


@dataclasses.dataclass
class Federation:
    """The run's pfl pieces and fedlora's protocol behind them."""
    protocol: Protocol
    model: PyTorchModel
    cohorts: FedloraCohorts
    privacy: CentrallyAppliedPrivacyMechanism
    algorithm: FedAvgWithoutUserEvaluation
    params: NNAlgorithmParams
    train_params: NNTrainHyperParams
    entries: dict[str, str]  # fedlora's message entry -> pfl's statistic, in the message's order


def unsupported(config: RunConfig, protocol: Protocol) -> str | None:
    """Why this config's federation is not one pfl's pieces run as fedlora does, or None."""
    reasons = [
        (protocol.mode is not LoRAMode.FFA or not protocol.algorithm.private
         or not isinstance(protocol.mechanism.sketch, NoSketch),
         "strategy must be gm-ffa-lora: pfl's GaussianMechanism clips and noises FFA-LoRA's whole update, unsketched"),
        (protocol.placement is not NoisePlacement.SERVER,
         "noise-placement must be server: pfl's CentrallyAppliedPrivacyMechanism noises the sum"),
        (not protocol.sends_updates or config.head != "message",
         'message must be "update" and head "message": FedAvg sends the change of every trained parameter'),
        (config.sampling != "fixed", 'sampling must be "fixed": pfl averages over the users trained, fedlora divides '
                                     "a Poisson round's sum by the expected cohort"),
        (protocol.clipping is not None or bool(config.parsed_client_ranks()),
         "adaptive clipping and client-ranks have no pfl counterpart here"),
        (config.server_optimizer not in ("sgd", "momentum"),
         "server-optimizer must be sgd or momentum: torch's Adam is not fedlora's FedAdam"),
    ]
    return next((why for bad, why in reasons if bad), None)


def federation(config: RunConfig, noise_multiplier: float, *, fedlora_noise: bool = False) -> Federation:
    protocol = Protocol(config, noise_multiplier)
    if why := unsupported(config, protocol):
        raise ValueError(why)
    device = pytorch_ops.get_default_device()
    net = protocol.build_model(device=device)
    protocol._set_trainable(net, LORA)
    module = FedloraModule(net, config, device)
    behind = message_parameters(net)
    entries = {entry: f"net.{behind[entry]}" for entry in protocol.client_message(net, LORA)}
    central = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=config.server_lr,
                              momentum=config.server_momentum if config.server_optimizer == "momentum" else 0.0)
    local = torch.optim.Adam if config.local_optimizer == "adam" else torch.optim.SGD
    model = PyTorchModel(module, local_optimizer_create=local, central_optimizer=central)
    if set(model.variable_map) != set(entries.values()):
        raise RuntimeError("pfl's trained parameters are not fedlora's message entries.")
    cohorts = FedloraCohorts(protocol, device)
    mechanism = (FedloraNoise(protocol, cohorts, entries) if fedlora_noise
                 else GaussianMechanism(clipping_bound=config.clip_norm, relative_noise_stddev=noise_multiplier))
    privacy = CentrallyAppliedPrivacyMechanism(mechanism)
    params = NNAlgorithmParams(central_num_iterations=config.num_rounds, evaluation_frequency=config.eval_every,
                               train_cohort_size=config.clients_per_round, val_cohort_size=None)
    train_params = NNTrainHyperParams(local_learning_rate=config.lr, local_num_epochs=1,
                                      local_batch_size=config.batch_size)
    return Federation(protocol, model, cohorts, privacy, FedAvgWithoutUserEvaluation(), params, train_params, entries)


def run(config: RunConfig, noise_multiplier: float, out_dir: Path, *, fedlora_noise: bool) -> None:
    """The federation on pfl's simulated backend; every worker process runs this, rank 0 writes the rows."""
    fed = federation(config, noise_multiplier, fedlora_noise=fedlora_noise)
    test = config.task.test_data(config, fed.cohorts.device)
    everything = test[slice(None)]
    recorder = RoundRecorder(Dataset((everything["pixel_values"], everything["labels"])), fed.cohorts,
                             out_dir if pytorch_ops.distributed.global_rank == 0 else None)
    backend = SimulatedBackend(training_data=fed.cohorts, val_data=None,
                               postprocessors=[WeightByUser(), fed.privacy])
    fed.algorithm.run(algorithm_params=fed.params, backend=backend, model=fed.model,
                      model_train_params=fed.train_params, callbacks=[recorder], send_metrics_to_platform=False)


def check_update(config: RunConfig, noise_multiplier: float) -> dict:
    """Round 1's first client trained by pfl's FedAvg (simulate_one_user) and by fedlora's ClientSide from the initial
    state: the raw updates, then each framework's clipped one, compared entry by entry."""
    fed = federation(config, noise_multiplier)
    user, _ = next(iter(fed.cohorts.get_cohort(config.clients_per_round)))
    partition = fed.cohorts.cohort[0]
    context = fed.algorithm.get_next_central_contexts(fed.model, 0, fed.params, fed.train_params)[0][0]
    stats, _ = fed.algorithm.simulate_one_user(fed.model, user, context)
    raw = {name: t.detach().cpu().clone() for name, t in stats.items()}
    clipped, _ = fed.privacy.postprocess_one_user(stats=stats, user_context=UserContext(len(user), None))

    protocol, device = fed.protocol, select_device()
    model = protocol.build_model(device=device)  # a client's model (fedlora.clients.rounds._model)
    state = protocol.initial_state(protocol.build_model())  # the server's (fedlora.strategies.server_app)
    data = config.task.train_data(config, NodeSettings(partition, config.num_clients), device)
    trained = protocol.train_clients(model, get_adapters(model), [data], state, round_=1, partition_ids=[partition])
    update = protocol.update_of(trained.start, trained.messages[0])
    released, _ = protocol.privatize(update, round_=1, release=1, noise=protocol.client_noise(1, partition))

    def compare(pfl: dict, ours: dict) -> tuple[bool, float]:
        pairs = [(pfl[name].detach().cpu(), ours[entry]) for entry, name in fed.entries.items()]
        return (all(torch.equal(a, b) for a, b in pairs),
                max(float((a.double() - b.double()).abs().max()) for a, b in pairs))

    identical, diff = compare(raw, update)
    clipped_identical, clipped_diff = compare(dict(clipped.items()), released)
    return {"identical": identical, "max_abs_diff": diff, "entries": len(fed.entries),
            "values": sum(t.numel() for t in update.values()), "partition": partition, "norm": message_norm(update),
            "clip_norm": config.clip_norm, "clipped_identical": clipped_identical, "clipped_max_abs_diff": clipped_diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a fedlora preset (quickstart, fashion_mnist) or TOML file")
    add_overrides(parser, "override the preset's keys, as `fedlora run --set` does")
    parser.add_argument("--rounds", type=int, help="num-rounds (default: the preset's)")
    parser.add_argument("--noise-multiplier", type=float, help="z (default: the preset's noise-multiplier; fedlora "
                                                                "calibrates z when it is 0, this script cannot)")
    parser.add_argument("--out", type=Path, help="the run's directory (start.json, metrics.jsonl)")
    parser.add_argument("--fedlora-noise", action="store_true",
                        help="draw fedlora's seeded server noise instead of pfl's, to compare aggregates")
    parser.add_argument("--check-update", action="store_true",
                        help="compare one client's update from pfl's and fedlora's local training, then exit")
    args = parser.parse_args()
    if args.out is not None and os.environ.get("RANK", "0") == "0":
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "start.json").write_text(json.dumps({"main_started": time.time()}) + "\n")
        (args.out / "metrics.jsonl").write_text("")
    try:
        config = load_config(args.config, [*args.set, *([f"num-rounds={args.rounds}"] if args.rounds else [])])
    except ValueError as error:
        parser.error(str(error))
    z = config.noise_multiplier if args.noise_multiplier is None else args.noise_multiplier
    if not args.check_update and (args.out is None or not z > 0):
        parser.error("a run needs --out and a positive --noise-multiplier (fedlora's calibrated z; pfl's accountants "
                     "assume another sampling)")
    np.random.seed(config.seed)  # pfl's cohort, backend and algorithm seeds: the same on every worker
    torch.manual_seed(config.seed)
    try:
        if args.check_update:
            print(json.dumps(check_update(config, z)), flush=True)
        else:
            run(config, z, args.out, fedlora_noise=args.fedlora_noise)
    except ValueError as error:
        print(f"pfl_run: error: {error}", file=sys.stderr)
        sys.exit(2)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
