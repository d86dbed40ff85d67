"""Side by side with Flower's own DP: the quickstart's task trained by a minimal Flower app, FedAvg wrapped in
Flower's DifferentialPrivacyServerSideFixedClipping with its RDP accountant, and by `fedlora run` with the same
mechanism (gm-ffa-lora: updates clipped to tau, Gaussian noise of z tau on their sum, added by the server, the mean
applied), the same model, data, partitions, cohort, local training and z, each through a SuperLink in simulation
mode with Ray clients on this machine.

    python -m benchmarks.flower_peer                # the quickstart's task, 10 rounds
    python -m benchmarks.flower_peer --rounds 3     # shorter

Three runs: fedlora (z calibrated by its accountant for epsilon 8, subsampling amplification against observers of
the model), Flower at the same z (its accountant, without amplification, prints its own epsilon), and Flower at the
z its accountant needs for the same epsilon. Each reports seconds a round (the median after the first), seconds
before the first round and after the last (from the command's start to its end), the wall time, the final accuracy
and the epsilon it prints. Flower's FedAvg samples its own nodes (Python's random), so the two frameworks train other
clients of the same cohort size: accuracies compare as runs of one seed each, not client for client.
Results: benchmarks/results/flower_peer.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import psutil
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg
from flwr.supercore.privacy_accounting import NeighboringRelation, PrivacyConfig, SamplingMethod
from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

from benchmarks.common import RESULTS, command_line, machine, revision
from fedlora.config import RunConfig, load_config, run_config_of
from fedlora.run_keys import OUT_DIR_KEY
from fedlora.experiment import test_data
from fedlora.federation import Protocol
from fedlora.round_plan import DENSE, GlobalState
from fedlora.training import evaluate, select_device

ROOT = Path(__file__).resolve().parent.parent
STORE = RESULTS / "flower_peer.json"
TASK = ['strategy="gm-ffa-lora"']  # the quickstart's task with the mechanism Flower's wrapper implements

peer_server = ServerApp()
peer_client = ClientApp()


def trainer(config: RunConfig) -> Protocol:
    """The clients' local training without fedlora's privatization: Flower's wrapper clips on the server."""
    return Protocol(RunConfig.from_mapping({"strategy": "ffa-lora"}, base=config), 0.0)


@peer_client.train()
def peer_train(msg: Message, context: Context) -> Message:
    """fedlora's client training (the same seeds per round and partition), the trained adapters and head back."""
    from fedlora.clients.rounds import _local_data, _model
    from fedlora.node import NodeSettings

    config = run_config_of(context.run_config)
    node = NodeSettings.from_node_config(context.node_config)
    protocol = trainer(config)
    model, base = _model(config, config.rank)
    state = GlobalState(dict(msg.content["arrays"].to_torch_state_dict()), DENSE)
    round_ = int(msg.content["config"]["server-round"])
    out = protocol.local_round(model, base, _local_data(config, node), state, round_=round_,
                               partition_id=node.partition_id, noise=None)
    trained = {n: (state.message[n] + out.release[n]).contiguous() for n in state.message}  # the update on the start
    return Message(RecordDict({"arrays": ArrayRecord(trained), "metrics": MetricRecord({"num-examples": 1})}),
                   reply_to=msg)


@peer_server.main()
def peer_main(grid: Grid, context: Context) -> None:
    """FedAvg in Flower's DP wrapper; one metrics.jsonl row a round (accuracy, the epsilon Flower's accountant
    prints, seconds) in the run directory, as fedlora's ServerApp writes its own."""
    began = time.time()
    config = run_config_of(dict(context.run_config))
    out_dir = Path(str(context.run_config[OUT_DIR_KEY]))
    z = float(config.noise_multiplier)
    accountant = RdpAccountant(PrivacyConfig(target_delta=config.delta, population_size=config.num_clients,
                                             neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                                             sampling_method=SamplingMethod.NO_AMPLIFICATION))
    strategy = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(fraction_train=config.clients_per_round / config.num_clients, fraction_evaluate=0.0,
               min_train_nodes=config.clients_per_round, min_available_nodes=config.num_clients),
        noise_multiplier=z, clipping_norm=config.clip_norm, num_sampled_clients=config.clients_per_round,
        accountant=accountant)
    protocol = trainer(config)
    model = protocol.build_model(device=select_device())
    base = protocol.initial_state(model)
    test = test_data(config)
    startup = {"process": began - psutil.Process().create_time(), "model and test data": time.time() - began}
    metrics, last = out_dir / "metrics.jsonl", [time.time()]

    def evaluate_round(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round == 0:  # Flower evaluates the initial model too
            last[0] = time.time()
            return None
        from fedlora.lora import get_adapters

        protocol.load_global(model, GlobalState(dict(arrays.to_torch_state_dict()), DENSE), get_adapters(model))
        accuracy, loss = evaluate(model, test, precision=config.precision)
        spent = strategy.privacy_spent()
        row = {"round": server_round, "accuracy": accuracy, "loss": loss, "epsilon": spent.epsilon,
               "threat_model": "Flower's RDP accountant: add-or-remove-one, no amplification by sampling", "seconds": time.time() - last[0],
               "time": time.time(), "startup": startup if server_round == 1 else None}
        last[0] = time.time()
        with metrics.open("a") as f:
            f.write(json.dumps(row) + "\n")
        return MetricRecord({"accuracy": accuracy})

    strategy.start(grid, ArrayRecord({n: t.contiguous() for n, t in base.broadcast.items()}),
                   num_rounds=config.num_rounds, evaluate_fn=evaluate_round)


def flower_z_for(epsilon: float, config: RunConfig) -> float:
    """The smallest z (to 1e-3) at which Flower's accountant prints at most ``epsilon`` after the run's rounds."""
    from flwr.supercore.privacy_accounting import GaussianPrivacyEvent

    def spent(z: float) -> float:
        accountant = RdpAccountant(PrivacyConfig(
            target_delta=config.delta, population_size=config.num_clients,
            neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=SamplingMethod.NO_AMPLIFICATION))
        accountant.compose(GaussianPrivacyEvent(z, config.clients_per_round, config.num_clients), config.num_rounds)
        return accountant.get_privacy_spent().epsilon

    low, high = 0.1, 100.0
    while high - low > 1e-3:
        low, high = (low, (low + high) / 2) if spent((low + high) / 2) <= epsilon else ((low + high) / 2, high)
    return high


def run_peer(config: RunConfig, out_dir: Path) -> list[dict]:
    """The Flower app on a SuperLink in simulation mode, as `fedlora run` starts fedlora's; its rows."""
    from fedlora.launch import CONNECTION, Flower, free_port, write_app

    out_dir = out_dir.resolve()  # the SuperLink and flwr run work inside it
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.jsonl").write_text("")
    app_dir = write_app(config, out_dir, simulation=True, client_app="benchmarks.flower_peer:peer_client",
                        server_app="benchmarks.flower_peer:peer_server")
    flower = Flower(out_dir)
    try:
        port = free_port()
        flower.connect(port, None)
        # the app's components live in this repository's benchmarks/, outside the installed package
        flower.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
        superlink = flower.start("superlink", [
            "flower-superlink", "--simulation", "--insecure", "--host", "127.0.0.1", "--port", str(port),
            "--disable-runtime-dependency-installation"], env={"RAY_ADDRESS": "local"})
        flower.wait_for_port(port, superlink, "superlink")
        runner = flower.start("flower", ["flwr", "run", str(app_dir), CONNECTION, "--stream", "--federation-config",
                                         f"num-supernodes={config.num_clients} client-resources-num-cpus="
                                         f"{config.client_cpus} client-resources-num-gpus={config.client_gpus}"])
        runner.wait()
    finally:
        flower.stop_all()
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if len(rows) != config.num_rounds:
        raise RuntimeError(f"The Flower app ran {len(rows)} of {config.num_rounds} rounds; see {out_dir}/flower.log.")
    return rows


def summary(name: str, rows: list[dict], began: float, ended: float, z: float, epsilon_label: str) -> dict:
    """A run's seconds: a round's from its start to the next one's (the last: to its row; fedlora evaluates a round
    while the next trains, Flower between them), the median after the first; before the first and after the last."""
    from fedlora.launch import round_start

    bounds = [*map(round_start, rows), rows[-1]["time"]]
    rounds = [b - a for a, b in zip(bounds, bounds[1:])]
    return {"run": name, "noise-multiplier": z, "rounds": len(rows),
            "seconds-per-round": statistics.median(rounds[1:]) if len(rows) > 1 else rounds[0],
            "first-round-seconds": rounds[0], "before-first-round-seconds": bounds[0] - began,
            "after-last-round-seconds": ended - rows[-1]["time"], "wall-seconds": ended - began,
            "accuracy": rows[-1]["accuracy"], "epsilon": rows[-1]["epsilon"], "epsilon-is": epsilon_label}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, help="rounds of each run (default: the quickstart's)")
    parser.add_argument("--out", type=Path, default=Path("runs/flower_peer"), help="the runs' directories")
    args = parser.parse_args()
    if args.rounds is not None and args.rounds < 1:
        print(f"flower_peer: error: --rounds must be at least 1, got {args.rounds}.", file=sys.stderr)
        sys.exit(2)
    from fedlora.experiment import noise_for
    from fedlora.launch import run_simulation

    from fedlora.cluster import check_local_resources

    config = load_config("quickstart", [*TASK, *([f"num-rounds={args.rounds}"] if args.rounds else [])])
    plan = noise_for(config)
    z = plan.noise_multiplier
    results = []
    began = time.time()
    # as `fedlora run` launches it: a node per Ray worker, the noise calibrated above
    rows = run_simulation(config, args.out / "fedlora", echo=lambda line: print("  fedlora:", line, flush=True),
                          workers=check_local_resources(config), noise=(z, plan.probe_noise_multiplier))
    results.append(summary("fedlora (gm-ffa-lora)", rows, began, time.time(), z, rows[-1]["threat_model"]))
    z_flower = flower_z_for(rows[-1]["epsilon"], config)
    for name, folder, noise in (("Flower at fedlora's z", "flower-same-z", z),
                                ("Flower at the z its accountant needs", "flower-same-epsilon", z_flower)):
        peer = RunConfig.from_mapping({"noise-multiplier": noise}, base=config)
        began = time.time()
        peer_rows = run_peer(peer, args.out / folder)
        results.append(summary(name, peer_rows, began, time.time(), noise, peer_rows[-1]["threat_model"]))
        print(f"  {name}: accuracy {peer_rows[-1]['accuracy']:.3f}, epsilon {peer_rows[-1]['epsilon']:.2f}", flush=True)
    record = {"results": results, "task": f"the quickstart with {TASK[0]} ({config.num_clients} clients, "
              f"{config.clients_per_round} a round, {config.num_rounds} rounds, delta {config.delta:g})",
              "command": command_line("benchmarks.flower_peer"), "commit": revision(), "machine": machine()}
    RESULTS.mkdir(exist_ok=True)
    STORE.write_text(json.dumps(record, indent=1) + "\n")
    write_table(record)


def write_table(record: dict) -> None:
    lines = ["# fedlora against Flower's own DP", "",
             f"Task: {record['task']}. Both through a SuperLink in simulation mode with Ray clients on this machine, "
             "the same model, data, partitions, local training and mechanism (updates clipped to tau = 1, Gaussian "
             "noise of z tau on their sum added by the server, the mean applied); Flower: FedAvg in "
             "DifferentialPrivacyServerSideFixedClipping with its RDP accountant (no amplification by sampling, "
             "the only one its wrapper accepts). Flower samples its own clients, so accuracies compare as single "
             "runs. Seconds: a round's median after the first; before the first round and after the last, from the "
             "command's start to its end.", "",
             "| run | z | s a round | first round (s) | before first round (s) | after last round (s) | wall (s) | "
             "accuracy | epsilon printed |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in record["results"]:
        lines.append(f"| {r['run']} | {r['noise-multiplier']:.3f} | {r['seconds-per-round']:.1f} | "
                     f"{r['first-round-seconds']:.1f} | {r['before-first-round-seconds']:.1f} | "
                     f"{r['after-last-round-seconds']:.1f} | {r['wall-seconds']:.1f} | {r['accuracy']:.3f} | "
                     f"{r['epsilon']:.2f} ({r['epsilon-is']}) |")
    lines += ["", f"Command: `{record['command']}`  ", f"Commit: {record['commit']}  ", f"Machine: {record['machine']}",
              ""]
    (RESULTS / "flower_peer.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
