"""Client training speed against client-batch: the clients of a message trained one at a time (M = 1) or M at a
time in one forward and backward per local step (fedlora.training.local_train_clients), through the product's
own path (ClientSide.train_clients, then release_clients, on a GPU on a thread of the host while the next group
trains, as a message's groups are: load the global state, K local steps, clip, sketch, noise), with the data
decoded once onto the device and transformed there (fedlora.data.DeviceImages) at the preset's precision (auto:
bf16-backbone on a GPU, fp32 on a CPU) or --precision's; a row names the precision that ran.

    python -m benchmarks.client_throughput                          # CPU: the quickstart's client (tiny ViT, 32 px)
    python -m benchmarks.client_throughput --preset bible --batches 1,4   # CPU: the text preset's (tiny GPT-2)
    python -m benchmarks.client_throughput --preset bible --model gpt2-random --batches 1,16   # GPU: GPT-2 small
    python -m benchmarks.client_throughput --batches 1,4 --threads 2
    python -m benchmarks.client_throughput --preset cifar100_private --model vit-b16-random --baseline   # GPU
    python -m benchmarks.client_throughput --preset cifar100_private --model vit-b16-random --profile 16
    python -m benchmarks.client_throughput --preset cifar100_private --model vit-b16-random --precision bf16-backbone
--baseline adds the path before this work in the same run: one client at a time in fp32, each image decoded and
transformed on the CPU when its batch is drawn. Each row runs in a fresh process (its peak memory is its own): a
warm-up group, then at least --clients clients in groups of M; images a second = clients x K x batch / seconds; a
group that does not fit the device's memory is a row saying so. Results: benchmarks/results/client_throughput.{json,md},
one row per (device, model, threads, path, precision, client-batch), rows of other devices and models kept.
--profile M instead profiles one group of M clients under torch.profiler: time by operator and how busy the device
was, and the model alone (on a GPU at both bf16 precisions: autocast alone and bf16-backbone), in
benchmarks/results/client_profile_<device>_m<M>_<precision that ran>.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from benchmarks.common import RESULTS, command_line, machine, provenance, revision
from fedlora.training import PRECISIONS

STORE = RESULTS / "client_throughput.json"


PATHS = {"device": "data on the device, at the row's precision", "host": "per-image CPU transforms, fp32 (before)"}
PRECISION_MEANS = {"bf16": "bf16 autocast alone, the residual stream float32",
                   "bf16-backbone": "the frozen backbone stored in bf16, its residual stream bf16"}


def host_images(dataset, image_size: int):
    """The data path before DeviceImages: each image decoded and transformed on the CPU as its batch is drawn."""
    import torch

    from fedlora.data import IMAGE_COLUMN, LABEL_COLUMN, image_transform

    transform = image_transform(image_size, train=True)
    return dataset.with_transform(lambda b: {"pixel_values": torch.stack([transform(i) for i in b[IMAGE_COLUMN]]),
                                             "labels": torch.as_tensor(b[LABEL_COLUMN], dtype=torch.int64)})


def _setup(preset: str, model: str | None, batch: int, threads: int, path: str, precision: str | None = None):
    """The preset's client on this machine's device: its config, device, image size, model, and a function that
    trains one group of ``batch`` clients through the product's path (as release ``release``)."""
    import numpy as np
    import torch

    from fedlora.config import load_config
    from fedlora.data import make_synthetic_cifar, to_torch
    from fedlora.experiment import noise_for
    from fedlora.client_round import TrainedClients, overlapped
    from fedlora.federation import Protocol
    from fedlora.lora import get_adapters
    from fedlora.models import model_spec
    from fedlora.text import to_device_tokens
    from fedlora.training import select_device

    torch.set_num_threads(threads)
    precision = "fp32" if path == "host" else precision
    text = model_spec(model or load_config(preset).model).task == "causal-lm"
    if text and path == "host":
        raise ValueError("--baseline is the image path before DeviceImages; a language model's rows have none.")
    data_keys = ['dataset="bible-kjv"', 'partitioner="natural"', 'head="frozen"'] if text else \
        ['dataset="synthetic"', "num-classes=100"]
    overrides = [*data_keys, *([f'model="{model}"'] if model else []),
                 *([f'precision="{precision}"'] if precision else [])]
    config = load_config(preset, overrides)
    protocol = Protocol(config, noise_for(config).noise_multiplier)
    device = select_device()
    net = protocol.build_model(config.rank, device)
    base, state = get_adapters(net), protocol.initial_state(net)
    if text:  # 64 blocks of random tokens a client: the speed does not depend on which tokens
        size = config.seq_len
        vocab = net.get_input_embeddings().num_embeddings
        data = [to_device_tokens([np.random.default_rng(p).integers(1, vocab, 64 * size)], size, 0, device=device)
                for p in range(batch)]
    else:
        size = model_spec(config.model).image_size
        raw = [make_synthetic_cifar(64, num_classes=config.classes, seed=p) for p in range(batch)]  # 32 px, as CIFAR
        data = [host_images(r, size) if path == "host" else to_torch(r, size, train=True, device=device) for r in raw]

    def groups(releases: list[int], profiled: bool = False) -> None:
        """One group of the clients per release, trained and released as a message's groups are (``overlapped``:
        on a GPU each group's release on the host while the next group trains); the path before, and a profiled
        group (torch.profiler does not see other threads), one after the other."""
        def train(release: int) -> TrainedClients:
            return protocol.train_clients(net, base, data, state, round_=1, release=release,
                                          partition_ids=list(range(batch)))

        def privatize(release: int, trained: TrainedClients) -> None:
            protocol.release_clients(trained, round_=1, release=release,
                                     noises=[protocol.client_noise(release, p) for p in range(batch)])

        overlapped(releases, train, privatize, background=path != "host" and not profiled and device.type == "cuda")

    return config, device, size, net, groups


def model_alone(net, config, device, size: int, clients: int, steps: int = 3) -> float:
    """Seconds of one local step of the model alone for a group of ``clients``: the forward and backward of their
    clients x batch random examples (images of ``size`` px, or blocks of ``size`` tokens) through the same stacked
    trainable linears at the config's precision (``net`` stored as it stores it), with no data, optimizer step,
    clipping or sketching; what the product's path would reach if it added nothing."""
    import torch

    from fedlora.training import autocast, compute_dtype, stacked_linears

    examples = clients * config.batch_size
    if config.task.name == "causal-lm":
        batch = {"input_ids": torch.randint(1, net.get_input_embeddings().num_embeddings, (examples, size),
                                            device=device),
                 "valid": torch.ones(examples, size, dtype=torch.bool, device=device)}
    else:
        batch = {"pixel_values": torch.randn(examples, 3, size, size, device=device),
                 "labels": torch.randint(config.classes, (examples,), device=device)}
    dtype = compute_dtype(config.precision, device)
    net.train()
    with stacked_linears(net, clients):
        def step() -> None:
            with autocast(device, dtype):
                loss = config.task.loss(net, batch)
            loss.backward()

        step()  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - started) / steps


def measure(preset: str, model: str | None, batch: int, clients: int, threads: int, path: str,
            precision: str | None = None) -> dict:
    """One M in this process: seconds for ``clients`` clients (rounded up to whole groups) after a warm-up group."""
    import torch

    from fedlora.training import resolved_precision

    config, device, size, _, run_groups = _setup(preset, model, batch, threads, path, precision)
    groups = -(-clients // batch)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    row = {"device": name, "model": config.model, "image-size": size, "client-batch": batch, "threads": threads,
           "path": path, "precision": resolved_precision(config.precision, device), "local-steps": config.local_steps,
           "batch-size": config.batch_size, "rank": config.rank, "machine": machine()}
    try:
        run_groups([0])  # warm-up: allocations, kernels
    except torch.OutOfMemoryError:
        return {**row, "images-per-second": None, "peak-memory-gib": None, "out-of-memory": True}
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    run_groups(list(range(1, groups + 1)))
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    trained = groups * batch
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # CPU: the process's peak RSS
    examples = trained * config.local_steps * config.batch_size / seconds
    tokens = {"tokens-per-second": examples * config.seq_len} if config.task.name == "causal-lm" else {}
    return {**row, "clients": trained, "seconds": seconds, "seconds-per-client": seconds / trained,
            "images-per-second": examples, **tokens,
            "peak-memory-gib": peak / 2 ** 30,
            "peak-memory-is": "device memory allocated" if device.type == "cuda" else "process peak RSS"}


def profile(preset: str, model: str | None, batch: int, threads: int, precision: str | None = None,
            top: int = 30) -> str:
    """torch.profiler over one group of ``batch`` clients after a warm-up group: where the time goes, by operator
    (self time on the device where there is one, on the CPU otherwise), and how busy the device was; then the
    group without the profiler against the model alone (``model_alone``). Returns the
    Markdown it writes to benchmarks/results/client_profile_<device>_m<M>_<precision that ran>.md."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    import dataclasses

    from fedlora.federation import Protocol
    from fedlora.training import resolved_precision

    config, device, size, net, run_groups = _setup(preset, model, batch, threads, "device", precision)
    ran = resolved_precision(config.precision, device)
    run_groups([0])
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        run_groups([1], profiled=True)
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - started
    started = time.perf_counter()
    run_groups([2])  # the same without the profiler, against the model alone
    if cuda:
        torch.cuda.synchronize()
    plain = time.perf_counter() - started
    alone = model_alone(net, config, device, size, batch) * config.local_steps
    # the other way of computing in bf16: autocast alone, or the backbone stored in bf16 as well
    other = {"bf16": "bf16-backbone", "bf16-backbone": "bf16"}.get(ran)
    if other:
        other_config = dataclasses.replace(config, precision=other)
        other_net = Protocol(other_config, 0.0).build_model(config.rank, device)
        other_alone = model_alone(other_net, other_config, device, size, batch) * config.local_steps

    def self_time(e) -> float:  # microseconds
        if cuda:
            return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        return e.self_cpu_time_total

    # On a GPU each kernel is listed twice, as itself and in the self device time of the operator that launched
    # it: the operators are ranked, the kernels summed for the busy time.
    averages = prof.key_averages()
    events = sorted((e for e in averages if e.device_type == DeviceType.CPU), key=self_time, reverse=True)
    kernels = [e for e in averages if e.device_type != DeviceType.CPU] if cuda else events
    busy = sum(self_time(e) for e in kernels) / 1e6
    where = "device (kernels)" if cuda else "CPU"
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    images = batch * config.local_steps * config.batch_size
    lines = [f"# Where a group of M = {batch} clients spends its time: {config.model} ({size} px), "
             f"{name}", "",
             f"One group (K = {config.local_steps}, batch {config.batch_size}, rank {config.rank}, precision "
             f"{ran}) through the product's path, after a warm-up group, under torch.profiler: "
             f"{wall:.3f} s of wall clock ({images / wall:.0f} images/s with the profiler's overhead); the {where} "
             f"busy {busy:.3f} s of it ({100 * busy / wall:.0f}%)" + (", the rest waiting for the host (launches, "
             "Python, copies)." if cuda else "."), "",
             f"Without the profiler the group takes {plain:.3f} s ({images / plain:.0f} images/s); the model alone "
             f"(its K forwards and backwards of the group's {batch * config.batch_size} images a step, random "
             f"inputs, no data, optimizer, clipping or sketching) {alone:.3f} s ({images / alone:.0f} images/s): the "
             f"path reaches {100 * alone / plain:.0f}% of the model's speed." + (
                 f" The model alone at precision {other} ({PRECISION_MEANS[other]}): {other_alone:.3f} s "
                 f"({images / other_alone:.0f} images/s)." if other else ""), "",
             f"| operator | calls | self {where} ms | share of busy |", "|---|---:|---:|---:|"]
    for e in events[:top]:
        lines.append(f"| `{e.key}` | {e.count} | {self_time(e) / 1e3:.1f} | {100 * self_time(e) / 1e6 / busy:.1f}% |")
    lines += ["", *provenance("benchmarks.client_throughput"), ""]
    text = "\n".join(lines)
    RESULTS.mkdir(exist_ok=True)
    device_name = "cpu" if not cuda else name.replace(" ", "_").lower()
    (RESULTS / f"client_profile_{device_name}_m{batch}_{ran}.md").write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="quickstart", help="the config whose client is measured")
    parser.add_argument("--model", help="another model than the preset's (GPU: vit-b16-random, offline)")
    parser.add_argument("--batches", default="1,4,16,64", help="client-batch values M")
    parser.add_argument("--clients", type=int, default=64, help="clients measured per M (whole groups of M)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a Ray worker with 1 CPU has 1)")
    parser.add_argument("--baseline", action="store_true", help="also the path before this work (M = 1, fp32, "
                                                                   "per-image CPU transforms)")
    parser.add_argument("--profile", type=int, metavar="M", help="instead: profile one group of M clients (where "
                        "the time goes, by operator) into benchmarks/results/client_profile_<device>_m<M>_<precision>.md")
    parser.add_argument("--precision", choices=PRECISIONS, help="another precision than the preset's (auto)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process's single M
    parser.add_argument("--path", default="device", choices=sorted(PATHS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        batches = [int(b) for b in args.batches.split(",")]
        if any(b < 1 for b in batches) or args.clients < 1 or args.threads < 1:
            raise ValueError
    except ValueError:
        print("client_throughput: error: --batches takes positive integers (1,4,16,64); --clients and --threads "
              "must be at least 1.", file=sys.stderr)
        sys.exit(2)
    if args.profile is not None:
        if args.profile < 1:
            print("client_throughput: error: --profile takes a client-batch M of at least 1.", file=sys.stderr)
            sys.exit(2)
        print(profile(args.preset, args.model, args.profile, args.threads, args.precision))
        return
    if args.one:
        print(json.dumps(measure(args.preset, args.model, int(args.one), args.clients, args.threads, args.path,
                                 args.precision)))
        return
    rows = []
    for path, batch in [*([("host", 1)] if args.baseline else []), *(("device", b) for b in batches)]:
        child = [sys.executable, "-m", "benchmarks.client_throughput", "--preset", args.preset, "--clients",
                 str(args.clients), "--threads", str(args.threads), "--one", str(batch), "--path", path,
                 *(["--model", args.model] if args.model else []),
                 *(["--precision", args.precision] if args.precision else [])]
        out = subprocess.run(child, capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stderr[-2000:], file=sys.stderr)
            sys.exit(1)
        row = {**json.loads(out.stdout.strip().splitlines()[-1]), "command": command_line("benchmarks.client_throughput"),
               "commit": revision()}
        rows.append(row)
        if row.get("out-of-memory"):
            print(f"{path:>6} M = {batch:>3}: out of the device's memory", flush=True)
            continue
        tokens = f" ({row['tokens-per-second']:.0f} tokens/s)" if "tokens-per-second" in row else ""
        print(f"{path:>6} M = {batch:>3}: {row['images-per-second']:7.1f} examples/s{tokens}, "
              f"{row['seconds-per-client']:.3f} s "
              f"a client, peak {row['peak-memory-gib']:.2f} GiB", flush=True)

    def key(r: dict) -> tuple:
        return r["device"], r["model"], r["client-batch"], r["threads"], r.get("path", "host"), r["precision"]

    kept = [r for r in (json.loads(STORE.read_text()) if STORE.is_file() else []) if key(r) not in set(map(key, rows))]
    table = sorted(kept + rows, key=lambda r: (r["device"], r["model"], r["threads"], r.get("path", "host") != "host",
                                               r["precision"], r["client-batch"]))
    RESULTS.mkdir(exist_ok=True)
    STORE.write_text(json.dumps(table, indent=1) + "\n")
    write_table(table)


def _tokens(row: dict) -> str:
    return f"{row['tokens-per-second']:,.0f}" if "tokens-per-second" in row else "-"


def write_table(rows: list[dict]) -> None:
    lines = ["# Client training against client-batch", "",
             "One client's round through the product's path (load the global state, K local steps, clip, sketch, "
             "noise), M clients trained together in one forward and backward per local step; M = 1 is one at a time. "
             "Path: " + "; ".join(f"{k}: {v}" for k, v in PATHS.items()) + " (rows before the path column: the "
             "per-image CPU transforms, fp32). Examples a second (images, or blocks of seq-len tokens for a language "
             "model) = clients x K x batch / seconds; tokens a second, blocks x seq-len; speed-up against the "
             "first row of the same device, model and threads (the path before, where measured). Peak memory: the "
             "device's allocated memory on a GPU, the process's peak RSS on a CPU.", "",
             "| device | model (px, or tokens a block) | threads | K, batch, rank | path | precision | client-batch M | "
             "examples / s | tokens / s | s a client | speed-up | peak memory (GiB) | commit |",
             "|---|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        base = next(b for b in rows if (b["device"], b["model"], b["threads"]) == (r["device"], r["model"], r["threads"]))
        path = r.get("path", "host")
        if r.get("out-of-memory"):
            lines.append(f"| {r['device']} | {r['model']} ({r['image-size']}) | {r['threads']} | {r['local-steps']}, "
                         f"{r['batch-size']}, {r['rank']} | {path} | {r['precision']} | {r['client-batch']} | out of "
                         f"memory | - | - | - | - | {r['commit']} |")
            continue
        speed = f"{r['images-per-second'] / base['images-per-second']:.2f}x" if base.get("images-per-second") else "-"
        lines.append(f"| {r['device']} | {r['model']} ({r['image-size']}) | {r['threads']} | {r['local-steps']}, "
                     f"{r['batch-size']}, {r['rank']} | {path} | {r.get('precision', 'fp32')} | {r['client-batch']} | "
                     f"{r['images-per-second']:.1f} | {_tokens(r)} | "
                     f"{r['seconds-per-client']:.3f} | {speed} | "
                     f"{r['peak-memory-gib']:.2f} | {r['commit']} |")
    machines = sorted({r["machine"] for r in rows})
    commands = sorted({r["command"] for r in rows})
    lines += ["", "Commands: " + "; ".join(f"`{c}`" for c in commands) + "  ", "Machines: " + "; ".join(machines), ""]
    (RESULTS / "client_throughput.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
