"""The ``fedlora`` command line. Bad input: one error line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from importlib import metadata
from pathlib import Path

from fedlora.algorithms import ALGORITHMS, LoRAMode, check_layer_sizes, get_algorithm
from fedlora.config import HEAD_MODES, MAX_CLASSES, MESSAGE_FORMS, parse_assignment
from fedlora.models import MODELS, TARGETS, adapted_layer_shapes, model_spec

# bytes per value on the wire (float32)
_BYTES = 4
_SECAGG_BYTES = 8  # SecAgg+ sends each entry as a masked 64-bit integer (measured: benchmarks/results/secagg_cost.md)
DEFAULT_TRIALS = 5000  # releases per hypothesis in `fedlora audit`'s mechanism level


class CLIError(ValueError):
    """Bad command-line input, reported as one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: one line, exit 2
        raise CLIError(message)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _classes(text: str) -> int:
    value = _positive(text)
    if value > MAX_CLASSES:
        raise argparse.ArgumentTypeError(f"at most {MAX_CLASSES} classes, got {value}")
    return value


def _path_arg(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path")
    return text


def _output_dir(path, flag: str):
    """``path``, once it is known that the command can write there (a directory, or one it can make): a CLIError
    before any work if not. Nothing is made here, so a run refused later leaves no empty directory."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CLIError(f"{flag} '{path}' is a file, not a directory.")
    existing = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise CLIError(f"{flag} '{path}' cannot be made: '{existing}' is a file.")
    if not os.access(existing, os.W_OK | os.X_OK):
        if existing == path.absolute():
            raise CLIError(f"{flag} '{path}' is not writable.")
        raise CLIError(f"{flag} '{path}' cannot be made: '{existing}' is not writable.")
    return path


_HELD: list = []  # (lock file, directories made) per run directory this command holds: released as main returns
# (how to continue the run this command started, its directory), once it has a directory
_RESUME_HINT: list[tuple[str, Path]] = []


def _claim(out_dir, command: str, *, default_name: bool):
    """Makes the run directory and locks it for as long as this command runs, so that a second run or resume of it
    is refused in one line instead of writing into the same files. A default name (the strategy and the second)
    taken already gets a suffix: two runs started in the same second get two directories. What it makes is removed
    again if the command ends without writing there (``_release``)."""
    import fcntl
    import itertools

    base = out_dir
    for n in itertools.count(2):
        made = [p for p in (out_dir.absolute(), *out_dir.absolute().parents) if not p.exists()]  # deepest first
        try:
            out_dir.mkdir(parents=True, exist_ok=not default_name)
            break
        except FileExistsError:
            out_dir = base.with_name(f"{base.name}-{n}")
        except OSError as error:  # what _output_dir could not foresee (/proc lets root pass its check)
            raise CLIError(f"The run directory '{out_dir}' cannot be made: {error.strerror or error}.") from None
    lock = open(out_dir / ".lock", "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise CLIError(f"'{out_dir}' is in use by another fedlora command (a run or resume of it has not ended): "
                       "wait for it, or choose another --out.") from None
    _HELD.append((lock, made))
    _RESUME_HINT[:] = [(f"fedlora {command} --resume {out_dir}", out_dir)]
    return out_dir


def _release() -> None:
    """Unlocks the run directories this command claimed; where it wrote nothing else, removes the lock file and the
    directories it made (a command refused after its claim, e.g. for credentials it lacks, leaves nothing behind)."""
    while _HELD:
        lock, made = _HELD.pop()
        lock.close()
        if os.listdir(os.path.dirname(lock.name)) == [".lock"]:
            os.unlink(lock.name)
            for directory in made:
                with contextlib.suppress(OSError):  # a parent another command writes into stays
                    os.rmdir(directory)


def _trials(text: str) -> int:
    value = _positive(text)
    if value < 100:
        raise argparse.ArgumentTypeError(f"an audit needs at least 100 trials per hypothesis, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = _float_arg(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _float_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"'{text}' is not a finite number")
    return value


def describe(args: argparse.Namespace) -> dict:
    """What one client uploads per round under each mechanism, and what its sketch costs, for a real model: the
    shapes the run's own RoundPlan expects of a client's message and its mechanism releases."""
    from fedlora.config import RunConfig
    from fedlora.round_plan import RoundPlan  # PEFT: imported only where needed
    from fedlora.lora import build_lora_model, get_head

    spec = model_spec(args.model)
    if (spec.family, args.targets) not in TARGETS:
        raise CLIError(f"Unknown LoRA targets '{args.targets}'; choose 'qv' or 'all'.")
    model = build_lora_model(args.model, num_classes=args.num_classes, rank=args.rank, alpha=2.0 * args.rank,
                             targets=args.targets, mode=LoRAMode.FLEX, train_head=True)
    head = sum(t.numel() for t in get_head(model).values())  # sent dense, never sketched
    b, h, r = args.sketch_dim, args.vector_sketch_dim or args.sketch_dim * args.rank, args.rank
    layers = list(adapted_layer_shapes(args.model, targets=args.targets).values())
    check_layer_sizes(get_algorithm("sgmm-flexlora"), layers, rank=r, sketch_dim=b)  # b sketches both sides
    check_layer_sizes(get_algorithm("sgmv-ffa-lora"), layers, rank=r, sketch_dim=h)
    adapter = args.message == "adapter"
    rows = {  # row -> (the strategy whose messages it shows, its sketch dimension)
        f"ffa-lora / gm-ffa-lora (dense {'B' if adapter else 'change of B'})": ("gm-ffa-lora", 0),
        f"flexlora / gm-flexlora (dense {'A, B' if adapter else 'change of B A'})": ("gm-flexlora", 0),
        f"sgmm-ffa-lora ({'R B' if adapter else 'R dB'}, b={b})": ("sgmm-ffa-lora", b),
        f"sgmv-ffa-lora ({'R_v vec(B)' if adapter else 'R_v vec(dB)'}, h={h})": ("sgmv-ffa-lora", h),
        f"sgmm-flexlora ({'R B, A R_A' if adapter else 'R d(B A)'}, b={b})": ("sgmm-flexlora", b),
    }
    mechanisms = []
    # a language model's message does not depend on its text: any text dataset gives its shapes
    data = {"causal-lm": {"dataset": "bible-kjv", "partitioner": "natural", "head": "frozen"},
            "text-classification": {"dataset": "folder:.", "num-classes": args.num_classes, "head": args.head}}.get(
        spec.task, {"num-classes": args.num_classes, "head": args.head})
    for row, (strategy, dim) in rows.items():
        config = RunConfig.from_mapping({"strategy": strategy, "model": args.model, "rank": r, "targets": args.targets,
                                         "sketch-dim": dim, "message": args.message, **data})
        protocol = RoundPlan(config, 1.0)
        lora_round = config.linear_probe_rounds() + 1
        shapes = protocol.expected_message(protocol.initial_state(model).message, lora_round, r)
        released = protocol.mechanism.released_shapes(shapes)
        # under SecAgg+ FlexLoRA's clients send what the server's SVD sums: their products B A (b x b sketched)
        values, secure = (sum(math.prod(s) for s in entries.values())
                          for entries in (released, RoundPlan.secure_shapes(released)))
        mechanisms.append({"strategy": row, "upload_values": values, "upload_bytes": values * _BYTES,
                           "sketch_multiply_adds": sum(protocol.mechanism.sketch.multiply_adds(n, s)
                                                       for n, s in shapes.items()),
                           "upload_bytes_secagg_vector": secure * _SECAGG_BYTES})
    return {
        "clients_per_round": getattr(args, "clients_per_round", None),
        "model": args.model, "family": spec.family, "source": spec.source, "image_size": spec.image_size,
        "task": spec.task,
        "pretrained": spec.pretrained, "rank": r, "targets": args.targets, "adapted_layers": len(layers),
        "head": args.head if spec.head else "none", "head_values": head, "preset_model": getattr(args, "preset_model", None),
        "message": args.message,
        "layer_shapes": sorted({f"B {m}x{r}, A {r}x{k}" for m, k in layers}),
        "backbone_parameters": sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n),
        "mechanisms": mechanisms,
    }


def _print_describe(report: dict) -> None:
    preset = report.get("preset_model")
    weights = (f"the shapes of the preset's {preset}" if preset not in (None, report["model"])
               else "pretrained" if report["pretrained"] else "random init")
    kind = f"{report['image_size']} px" if report["image_size"] else {"causal-lm": "causal language model"}.get(
        report["task"], "text classifier")
    print(f"{report['model']}: {report['family']} '{report['source']}', {kind}, {weights}, "
          f"{report['backbone_parameters'] / 1e6:.1f}M backbone parameters")
    print(f"LoRA rank {report['rank']} on {report['adapted_layers']} layers ({report['targets']}): "
          f"{'; '.join(report['layer_shapes'])}")
    head = f"classifier head: {report['head_values']:,} values ({report['head_values'] * _BYTES / 1024:.1f} KiB)"
    print({"message": f"{head}, sent dense in every message: included below",
           "probe": f"{head}, sent alone in the linear-probe rounds; the LoRA rounds below do not send it",
           "frozen": "classifier head: frozen, never sent",
           "none": "no classifier head: the output layer is the input embedding, tied and frozen"}[report["head"]])
    print("clients send " + ("their adapters (the paper's form)" if report["message"] == "adapter" else
                             "updates: FFA the change of B, FlexLoRA the change of each product B A"))
    print(f"\n{'strategy (mechanism)':<46}{'upload/client/round':>22}{'under SecAgg+':>16}{'sketch multiply-adds':>24}")
    for row in report["mechanisms"]:
        print(f"{row['strategy']:<46}{row['upload_bytes'] / 1024:>18.1f} KiB"
              f"{row['upload_bytes_secagg_vector'] / 1024:>12.1f} KiB{row['sketch_multiply_adds']:>24,}")
    print("under SecAgg+ (noise-placement = secagg): the masked vector alone, 64-bit integers (FlexLoRA: its products "
          "B A, or with updates their change); the protocol adds two public keys and one encrypted share pair per other client "
          "(benchmarks/results/secagg_cost.md)")
    if report.get("clients_per_round"):
        n = report["clients_per_round"]
        print(f"\nper round, {n} clients: " + "; ".join(
            f"{row['strategy'].split(' ')[0]} {n * row['upload_bytes'] / 2 ** 20:.2f} MiB up"
            for row in report["mechanisms"]))


def _from_config(args: argparse.Namespace, command: str) -> None:
    """`--config FILE`: the preset's values replace the flags (`fedlora privacy` and `describe` of a run's setting)."""
    from fedlora.config import load_config

    config = load_config(args.config)
    replaced = (("strategy", "target_epsilon", "noise_multiplier", "delta", "num_clients", "clients_per_round",
                 "sampling_rate", "rounds", "rank", "sketch_dim", "model", "threat_model", "noise_placement",
                 "clip_count_stddev", "sampling", "head", "target_observer", "min_replies", "accountant")
                if command == "privacy" else
                ("model", "rank", "targets", "sketch_dim", "vector_sketch_dim", "num_classes", "head", "message"))
    defaults = vars(build_parser().parse_args([command]))
    if given := [key for key in replaced if getattr(args, key) != defaults[key]]:
        raise CLIError(f"--config takes every value from the preset; drop --{given[0].replace('_', '-')}.")
    if command == "privacy":
        return
    args.model = model_spec(config.model).random_twin or config.model  # shapes only: no hub, no weights
    args.preset_model = config.model
    args.rank, args.targets, args.num_classes, args.head, args.message = config.rank, config.targets, \
        config.classes, config.head, config.message
    algorithm = get_algorithm(config.strategy)
    if algorithm.sketched:
        b = config.effective_sketch_dim()
        args.sketch_dim, args.vector_sketch_dim = (b, None) if algorithm.mechanism == "sgmm" else (b // config.rank, b)
    args.clients_per_round = config.clients_per_round



def _config_privacy(args: argparse.Namespace) -> dict:
    """`fedlora privacy --config`: the run's own accounting (``noise_for``, what `fedlora run` calibrates and its
    ledger spends), at the preset's shapes, for every observer its noise placement tells apart."""
    from dataclasses import replace

    from fedlora.config import load_config
    from fedlora.experiment import noise_for, sampling_of
    from fedlora.privacy.events import Phase, observer_label

    _from_config(args, "privacy")  # refuses flags the preset would override
    config = load_config(args.config, args.set)
    config = replace(config, model=model_spec(config.model).random_twin or config.model)  # shapes only, no hub
    plan = noise_for(config)
    if plan.planned is None:
        raise CLIError(f"{config.strategy} adds no noise: it is not private (epsilon = inf).")
    sampled = (f"{config.clients_per_round} of {config.num_clients} clients per round" if config.sampling == "fixed"
               else f"each of {config.num_clients} clients with rate {config.clients_per_round / config.num_clients:.4g}")
    setting = f"{config.strategy}: {config.num_rounds} rounds, {sampled} ({config.sampling} sampling), head {config.head}"
    if config.noise_placement == "client":
        setting += _summed_note([Phase("lora", plan.phase_releases["lora"], sampling_of(config), 1)],
                                plan.noise_multiplier)
    if config.noise_placement == "secagg":
        n_min = config.required_replies()
        setting += (f", secure aggregation of at least {n_min} replies (each client adds z / sqrt({n_min}) = "
                    f"{plan.noise_multiplier / n_min ** 0.5:.4g})")
    how = (f"calibrated for target epsilon {config.target_epsilon:g} "
           f"{observer_label(config.target_observer, config.threat_model, config.noise_placement)}"
           if not config.noise_multiplier else "given")
    return _privacy_result(plan.reports, noise_multiplier=plan.noise_multiplier, target_observer=config.target_observer,
                           setting=setting, how=how, other=plan.other_convention, strategy=config.strategy, delta=config.delta,
                           noise_placement=config.noise_placement, rounds=config.num_rounds, clients_per_round=config.clients_per_round,
                           num_clients=config.num_clients, min_replies=config.required_replies()
                           if config.noise_placement == "secagg" else None,
                           probe_noise_multiplier=plan.probe_noise_multiplier if config.linear_probe_rounds() else None)


def _summed_note(phases, z: float) -> str:
    """Where each reply's own noise is summed into the model (noise at the client, fixed-size sampling): how much."""
    shares = max((getattr(part, "shares", 1) for p in phases for part in p.release), default=1)
    if shares == 1:
        return ""
    return (f", noise at each client: the mean of at least {shares} replies carries z sqrt({shares}) = "
            f"{z * shares ** 0.5:.4g}")


def _privacy_result(reports: dict, *, noise_multiplier: float, target_observer: str, setting: str, how: str,
                    other, **fields) -> dict:
    """`fedlora privacy`'s answer: the target observer's epsilon, every observer's with its label, and the same
    noise's epsilon in the field's other convention (``other``, a PrivacyReport or None)."""
    target = reports[target_observer]
    return {**fields, "noise_multiplier": noise_multiplier, "target_observer": target_observer,
            "epsilon": target.epsilon, "threat_model": target.threat_model, "method": target.method,
            "rdp_order": target.order, "summary": target.describe(), "setting": setting, "how": how,
            "observers": {o: {"epsilon": r.epsilon, "threat_model": r.threat_model, "method": r.method}
                          for o, r in reports.items()},
            "other_convention": None if other is None else {
                "epsilon": other.epsilon, "delta": other.delta, "threat_model": other.threat_model,
                "method": other.method}}


def _validate_privacy(args: argparse.Namespace) -> None:
    """Every check before any computation; each failure is one sentence."""
    if args.strategy == "sgmv-flexlora":
        raise CLIError("SGMV cannot be used with FlexLoRA (paper Remark 3.2): use sgmm-flexlora or sgmv-ffa-lora.")
    algorithm = get_algorithm(args.strategy)
    if args.target_epsilon is not None and not algorithm.private:
        raise CLIError(f"{args.strategy} adds no noise and is not private: no noise multiplier reaches an epsilon "
                       "(choose a private strategy, e.g. gm-ffa-lora or sgmm-ffa-lora).")
    if args.target_epsilon is not None and not args.target_epsilon > 0:
        raise CLIError(f"Target epsilon must be positive, got {args.target_epsilon:g}.")
    if args.noise_multiplier is not None and not args.noise_multiplier >= 0:
        raise CLIError(f"Noise multiplier must be non-negative, got {args.noise_multiplier:g}.")
    if not 0 < args.delta < 1:
        raise CLIError(f"Delta must lie in (0, 1), got {args.delta:g}.")
    if args.clients_per_round > args.num_clients:
        raise CLIError(f"Clients per round ({args.clients_per_round}) cannot exceed the number of clients "
                       f"({args.num_clients}).")
    if args.sampling_rate is not None:
        if args.sampling != "poisson":
            raise CLIError("--sampling-rate goes with --sampling poisson; fixed sampling takes --clients-per-round.")
        if not 0 < args.sampling_rate <= 1:
            raise CLIError(f"Sampling rate must lie in (0, 1], got {args.sampling_rate:g}.")
    if algorithm.sketched:
        if args.sketch_dim is None:
            args.sketch_dim = 150 if algorithm.mechanism == "sgmm" else 150 * args.rank
        check_layer_sizes(algorithm, adapted_layer_shapes(args.model).values(), rank=args.rank,
                          sketch_dim=args.sketch_dim)
        if args.threat_model == "secret-sketch" and args.sampling == "poisson":
            raise CLIError("Secret-sketch accounting supports fixed-size sampling only (the shared-sketch bound "
                           "needs the number of clients per round): use --sampling fixed.")
        if args.threat_model == "secret-sketch" and args.noise_placement == "server":
            raise CLIError("--noise-placement server needs --threat-model known-sketch: the secret-sketch bound is "
                           "derived for noise on every client's message.")
    if algorithm.private and args.sampling == "poisson" and args.noise_placement == "client":
        raise CLIError("--sampling poisson needs --noise-placement server: with noise at the client the model's noise "
                       "grows with the number of participants and reveals it, which Poisson accounting assumes "
                       "hidden.")
    if args.target_observer == "server" and args.noise_placement == "server":
        raise CLIError("--target-observer server needs --noise-placement client: with noise at the server it sees "
                       "every message before the noise, and no epsilon holds against it.")
    if args.min_replies is not None and args.min_replies > args.clients_per_round:
        raise CLIError(f"--min-replies ({args.min_replies}) cannot exceed --clients-per-round "
                       f"({args.clients_per_round}).")
    if args.clip_count_stddev is not None and not args.clip_count_stddev > 0:
        raise CLIError(f"--clip-count-stddev must be positive, got {args.clip_count_stddev:g}.")


def privacy(args: argparse.Namespace) -> dict:
    from fedlora.privacy import GaussianRelease, Phase, SamplingScheme, calibrate, epsilon, observers
    from fedlora.privacy.accounting import other_convention
    from fedlora.privacy.events import SketchedRelease, observer_label, sum_of_replies
    from fedlora.privacy.paper import round_release

    analysis = args.threat_model
    clients = args.clients_per_round
    if args.sampling == "fixed":
        sampling = SamplingScheme("fixed", args.num_clients, clients_per_round=clients)
    else:
        sampling = SamplingScheme("poisson", args.num_clients, rate=args.sampling_rate or clients / args.num_clients)

    n_min = args.min_replies or -(-clients // 2)
    # the model carries N_min replies' noise; FlexLoRA's is conservatively one reply's (its adapter form, the SVD of
    # products of separately noised factors, is no function of their sum; runs of its update form, --config, are)
    summed = (args.noise_placement == "client" and args.sampling == "fixed"
              and get_algorithm(args.strategy).family.value != "flex")

    def phases(z: float):
        release = round_release(args.strategy, z, analysis, rank=args.rank, sketch_dim=args.sketch_dim,
                                clients_per_round=clients, head=args.head)
        if summed and not any(isinstance(part, SketchedRelease) for part in release):
            release = tuple(sum_of_replies(part, n_min) if isinstance(part, GaussianRelease) else part
                            for part in release)
        if args.clip_count_stddev:  # adaptive clipping's count: a Gaussian of multiplier 2 sigma_b (fedlora.clipping)
            release += (GaussianRelease(2 * args.clip_count_stddev),)
        return [Phase("lora", release, sampling, args.rounds)]

    where = {"delta": args.delta, "threat_model": analysis, "placement": args.noise_placement,
             "fixed_sampling_pld": args.accountant == "pld"}
    if args.target_epsilon is not None:
        z = calibrate(phases, target_epsilon=args.target_epsilon, observer=args.target_observer,
                      **where).noise_multiplier
        how = (f"calibrated for target epsilon {args.target_epsilon:g} "
               f"{observer_label(args.target_observer, analysis, args.noise_placement)}")
    else:
        z, how = args.noise_multiplier, "given"
    reports = {o.value: epsilon(phases(z), observer=o, **where) for o in observers(args.noise_placement)}
    other = other_convention(phases(z), args.delta)
    sampled = (f"{clients} of {args.num_clients} clients per round" if args.sampling == "fixed"
               else f"each of {args.num_clients} clients with rate {sampling.q:.4g}")
    sketch = f", sketch dimension {args.sketch_dim}" if args.sketch_dim else ""
    count = (f"; adaptive clipping's count noise {args.clip_count_stddev:g}, accounted with it"
             if args.clip_count_stddev else "")
    setting = (f"{args.strategy}: {args.rounds} rounds, {sampled} ({args.sampling} sampling), rank {args.rank}"
               f"{sketch}, head {args.head}{_summed_note(phases(z), z) if summed else ''}")
    return _privacy_result(reports, noise_multiplier=z, target_observer=args.target_observer, setting=setting,
                           how=how + count, other=other, strategy=args.strategy, delta=args.delta,
                           target_epsilon=args.target_epsilon, noise_placement=args.noise_placement,
                           clip_count_stddev=args.clip_count_stddev, sampling=args.sampling, sampling_rate=sampling.q,
                           num_clients=args.num_clients, clients_per_round=clients if args.sampling == "fixed" else None,
                           rounds=args.rounds, rank=args.rank, sketch_dim=args.sketch_dim, head=args.head)


def _print_privacy(result: dict) -> None:
    print(result["setting"])
    print(f"noise multiplier z = {result['noise_multiplier']:.4g} ({result['how']})")
    if result.get("probe_noise_multiplier"):
        print(f"linear-probe rounds: noise multiplier {result['probe_noise_multiplier']:.4g}")
    print(f"threat model: {result['threat_model'].split('; ')[0]}")
    for line in _observer_lines(result["observers"], result["delta"], result["target_observer"]):
        print(f"  {line}")
    if result["other_convention"] is not None:
        print(f"  {_other_convention_line(result['other_convention'])}")


def _observer_lines(reports: dict, delta: float, target_observer: str) -> list[str]:
    """One line per observer: whom the epsilon holds against (its label's last part), the number and its method (or
    why there is none)."""
    lines = []
    for observer, report in reports.items():
        report = report if isinstance(report, dict) else {"epsilon": report.epsilon, "method": report.method,
                                                          "threat_model": report.threat_model}
        target = ", target-observer" if observer == target_observer else ""  # whose epsilon the target limits
        why = _why_none(observer, report)
        value = (f"epsilon = {report['epsilon']:.4g} at delta = {delta:g} ({report['method']}{target})"
                 if math.isfinite(report["epsilon"]) else "epsilon = inf (not private)" if why == "no noise"
                 else f"none ({why})")
        lines.append(f"{report['threat_model'].split('; ', 1)[1]}: {value}")
    return lines


def _other_convention_line(report) -> str:
    """The same noise's epsilon against the model's observers in the field's other convention, labelled as such."""
    report = report if isinstance(report, dict) else {"epsilon": report.epsilon, "method": report.method,
                                                      "threat_model": report.threat_model, "delta": report.delta}
    return (f"the same noise in {report['threat_model']}, against observers of the model: epsilon = "
            f"{report['epsilon']:.4g} at delta = {report['delta']:g} ({report['method']})")


def _why_none(observer: str, report: dict) -> str:
    label = report["threat_model"]
    if "no noise" in label or "not private" in label:
        return "no noise"
    if "server derives R" in label:
        return "the server derives the secret sketch"
    if "noise at the server" in label and observer == "server":
        return "the server sees every message before it adds the noise"
    if "seeded noise" in label:  # the server and every node it starts hold the run seed
        return "it holds the run seed, which removes the noise"
    if observer == "co-client" and label.startswith("secret-sketch"):
        return "every client knows R, and the message is clipped before the sketch"
    return "no noise"


def _print_paper_table(rows) -> None:
    from fedlora.privacy import paper

    print("\n".join(paper.table_lines(rows)))


def _check_recorded_releases(saved, plan, out_dir) -> None:
    """A resumed run's ledger must hold the releases this fedlora accounts for its rounds: a run checkpointed by a
    fedlora that described them otherwise (before noise at the client was accounted as the sum of the replies,
    2026-11-29) would fail mid-round; it is refused here, in one line."""
    from fedlora.privacy import PrivacyLedger

    if not saved.ledger:
        return
    recorded = {phase.name: phase.release for phase in PrivacyLedger.from_dict(saved.ledger).phases}
    if changed := [name for name, release in recorded.items() if plan.phase_releases.get(name) != release]:
        raise CLIError(f"The privacy ledger in '{out_dir}' records the {changed[0]} phase's rounds as another release "
                       "than this fedlora accounts them (a run started by an earlier fedlora): it cannot continue "
                       "under one accounting; start a new run.")


def _prepare(args: argparse.Namespace, config, command: str, *, out_dir=None, used=None):
    """Checks and calibration before any process starts; prints what will run. Returns the run directory and the
    noise calibrated (a NoisePlan), which the ServerApp is given rather than calibrating it again.
    ``used``: the noise multipliers a resumed run used, which its config must calibrate again."""
    import time

    from fedlora.checkpoint import ENDED, STATE_FILE, Checkpoint
    from fedlora.experiment import check_before_start, noise_for, sampling_of
    from fedlora.round_plan import RoundPlan

    resuming, default_name = out_dir is not None, not (out_dir or args.out)
    out_dir = Path(out_dir or args.out or f"runs/{config.strategy}-{time.strftime('%Y%m%d-%H%M%S')}")
    if not resuming and (out_dir / STATE_FILE).is_file():
        saved = Checkpoint.load(out_dir)
        if saved.status in ENDED:
            raise CLIError(f"'{out_dir}' holds a run that has ended ({saved.status}): choose another --out.")
        raise CLIError(f"'{out_dir}' holds a run already: continue it with `fedlora {command} --resume {out_dir}`, "
                       "or choose another --out.")
    _output_dir(out_dir, "the run directory" if resuming else "--out")
    check_before_start(config)
    plan = noise_for(config)  # raises for an unreachable target epsilon
    if used is not None and (plan.noise_multiplier, plan.probe_noise_multiplier) != tuple(used):
        raise CLIError(f"The config in '{out_dir}' calibrates noise multiplier {plan.noise_multiplier:.6g} where the "
                       f"run used {used[0]:.6g}: config.json was changed, or this fedlora calibrates differently; "
                       "restore it, or start a new run.")
    if resuming and (out_dir / STATE_FILE).is_file():
        _check_recorded_releases(Checkpoint.load(out_dir), plan, out_dir)
    protocol = RoundPlan(config, plan.noise_multiplier, plan.probe_noise_multiplier)
    out_dir = _claim(out_dir, command, default_name=default_name and not resuming)
    print(f"fedlora {command}: {config.strategy} on {config.dataset} with {config.model}, {config.num_clients} "
          f"clients, {config.clients_per_round} per round, {config.num_rounds} rounds -> {out_dir}")
    if config.linear_probe_rounds():
        print(f"  linear probe, rounds 1-{config.linear_probe_rounds()}: {protocol.probe_mechanism.describe()}")
    print(f"  mechanism: {protocol.describe()}")
    if left_out := config.task.left_out(config):
        which = f"{len(left_out)} samples that do" if len(left_out) > 1 else "1 sample that does"
        print(f"  data: {which} not decode left out (unreadable = \"skip\"), the first {left_out[0]}")
    ignored = config.ignored_keys()
    if unread := [key for key, _ in map(parse_assignment, getattr(args, "set", None) or []) if key in ignored]:
        print(f"  ignored: --set {', '.join(unread)} ({ignored[unread[0]]})")
    if plan.planned is not None:
        print(f"  privacy after {config.num_rounds} rounds ({plan.planned.threat_model.split('; ')[0]}):")
        for line in _observer_lines(plan.reports, config.delta, config.target_observer):
            print(f"    {line}")
        if plan.other_convention is not None:
            print(f"    {_other_convention_line(plan.other_convention)}")
        if config.noise_source == "seeded":
            print('  noise: seeded from the run seed (a reproducible simulation: whoever holds the seed removes it; '
                  'set noise-source = "os" for anything released)')
        budget, ledger = config.budget(), plan.new_ledger(config)
        if budget is not None and plan.planned.epsilon > budget:
            if ledger.would_exceed_budget(protocol.phase(1), plan.phase_releases[protocol.phase(1)], sampling_of(config)):
                raise CLIError(f"The budget epsilon = {budget:g} does not cover one round at noise multiplier "
                               f"{plan.noise_multiplier:g}: raise target-epsilon or noise-multiplier.")
            print(f"  budget: epsilon = {budget:g} ({ledger.trust_model}); the run stops before the round that "
                  "would pass it")
    return out_dir, plan


REAL_DATA_NEXT = ("real images: `fedlora run --config fashion_mnist` (Fashion-MNIST, offline after `sudo apt-get install "
                  "dataset-fashion-mnist`; docs/tutorials/real-data.md)")


def _command_start() -> float:
    """When this command started: the fixed cost a run reports counts its imports too."""
    import psutil

    return psutil.Process().create_time()


def _spent(saved):
    """The budget's guarantee after every release a checkpoint counts (a cut-short round's included); None if the run
    is not private or has released nothing."""
    from fedlora.privacy import PrivacyLedger

    if saved is None or not saved.ledger or not saved.ledger["phases"]:
        return None
    return PrivacyLedger.from_dict(saved.ledger).report()


def _done(rows: list[dict], out_dir, config) -> None:
    from fedlora.checkpoint import BUDGET_SPENT, Checkpoint

    saved = Checkpoint.load(out_dir)
    if saved.status == BUDGET_SPENT:
        print(f"stopped after round {saved.rounds_done}: {saved.reason}")
    spent = _spent(saved)
    if spent is not None and rows and not math.isclose(spent.epsilon, rows[-1]["epsilon"]):
        print(f"privacy spent: epsilon {spent.epsilon:.3f} ({spent.threat_model}) in {saved.releases} releases: more "
              f"than round {rows[-1]['round']}'s row says, since a round cut short counts its release")
    if not rows:
        print(f"done: no round completed; see {out_dir}")
        return
    accuracy = rows[-1]["accuracy"]
    if accuracy is None:
        print(f"done: metrics.jsonl and global-state.safetensors in {out_dir}; the server does not hold the sketch "
              f"secret: on a node, `fedlora reconstruct {out_dir} --sketch-secret-file PATH` writes the adapter")
    else:
        events = " and TensorBoard events" if config.tracker == "tensorboard" else ""
        column = config.task.plotted[0]
        result = (f"perplexity {rows[-1]['perplexity']:.2f}, {config.task.metric} {accuracy:.3f}"
                  if column == "perplexity" else f"accuracy {accuracy:.3f}")
        print(f"done: {result}; metrics.jsonl, adapter/, {column}.png{events} in {out_dir}")
    if config.dataset == "synthetic":  # the quickstart's data: say where real images are
        print(REAL_DATA_NEXT)
    if failed := _failures(rows, out_dir):  # last: a hole in the data is not to be missed under the results
        print(failed)


def _failures(rows: list[dict], out_dir) -> str | None:
    """The sampled clients whose replies were not aggregated (they failed, were rejected, or did not come back within
    reply-timeout), in one line: how many, in how many rounds, and the first reason (tracebacks are in flower.log);
    None if every reply counted."""
    def lost(row: dict) -> int:
        return max(row.get("sampled", 0) - row.get("replies", 0), row.get("failed", 0) + row.get("rejected", 0))
    hit = [r for r in rows if lost(r)]
    if not hit:
        return None
    total, failed, rejected = (sum(f(r) for r in hit) for f in (lost, lambda r: r.get("failed", 0),
                                                                  lambda r: r.get("rejected", 0)))
    kinds = ", ".join(f"{n} {kind}" for n, kind in ((failed, "failed"), (rejected, "rejected"),
                                                    (total - failed - rejected, "past reply-timeout")) if n)
    first = next((r for r in hit if r.get("first_failure")), hit[0])
    return (f"clients failed: {total} repl{'ies' if total > 1 else 'y'} not aggregated in {len(hit)} of {len(rows)} "
            f"rounds ({kinds}); the first, round {first['round']}: "
            f"{first.get('first_failure') or 'no reply within reply-timeout'} "
            f"(tracebacks: {os.path.join(out_dir, 'flower.log')})")


def run(args: argparse.Namespace) -> None:
    """Validate, calibrate, then run (or continue) the simulated federation on a local SuperLink."""
    from fedlora.cluster import check_local_resources
    from fedlora.config import load_config

    if args.resume:
        return resume(args)
    config = load_config(args.config, args.set)
    if config.sketch_secret == "node-file":
        raise CLIError('sketch-secret = "node-file" needs SuperNodes that hold the secret: use `fedlora deploy`; '
                       "simulations derive it from the run seed.")
    address = _cluster_address(args)
    if address is None:
        workers = check_local_resources(config)
    out_dir, plan = _prepare(args, config, "run")
    if address is not None:
        workers = _check_cluster(address, config)
    from fedlora.launch import run_simulation  # Flower and Ray load after the checks, whose errors come at once

    _done(run_simulation(config, out_dir, ray_address=address, began=_command_start(), workers=workers,
                         noise=(plan.noise_multiplier, plan.probe_noise_multiplier)), out_dir, config)


def resume(args: argparse.Namespace) -> None:
    """Continues a simulation from its checkpoint, with its own config (on the cluster given now, if any)."""
    from fedlora.cluster import check_local_resources
    from fedlora.launch import run_simulation

    address = _cluster_address(args)
    here = (lambda out_dir, config: check_local_resources(config)) if address is None else (lambda *_: None)
    out_dir, config, workers, plan = _resumable(args, "run", check=here)
    if address is not None:
        workers = _check_cluster(address, config)
    _done(run_simulation(config, out_dir, resume=True, ray_address=address, began=_command_start(), workers=workers,
                         noise=(plan.noise_multiplier, plan.probe_noise_multiplier)), out_dir, config)


def _cluster_address(args: argparse.Namespace) -> str | None:
    """The Ray cluster the run joins (--ray-address, else RAY_ADDRESS), once it answers; None: Ray starts here."""
    from fedlora.cluster import check_address, ray_address

    if (address := ray_address(args.ray_address)) is not None:
        check_address(address)
    return address


def _check_cluster(address: str, config) -> int:
    """Every node of the cluster can run the run's clients (fedlora.cluster.check_cluster); prints the cluster.
    Returns the clients it trains at once."""
    from fedlora.cluster import check_cluster, cluster_summary

    nodes = check_cluster(address, config)
    print(cluster_summary(address, nodes, config))
    return sum(node.clients(config) for node in nodes)


def cluster(args: argparse.Namespace) -> None:
    """Every node of the cluster, checked as a run's start checks it, one line each."""
    from fedlora.cluster import check_cluster, cluster_summary
    from fedlora.config import load_config

    config = load_config(args.config, args.set)
    address = _cluster_address(args)
    if address is None:
        raise CLIError("No cluster to check: give --ray-address HOST:PORT or set RAY_ADDRESS.")
    nodes = check_cluster(address, config)
    for node in nodes:
        print(f"  node {node}: {node.cpus:g} CPUs, {node.gpus:g} GPUs, {node.clients(config)} clients at a time: "
              f"the same fedlora and libraries, the {config.dataset} data reachable")
    print(cluster_summary(address, nodes, config))


def _resumable(args: argparse.Namespace, command: str, check=lambda out_dir, config: None):
    """The run directory and config of the run `fedlora <command> --resume` continues, once it is known to be one
    that command can continue, and what ``check`` found (it raises if the run cannot continue); prints what will
    run."""
    from fedlora.checkpoint import ENDED, STATE_FILE, Checkpoint
    from fedlora.experiment import load_run_config
    from fedlora.launch import DEPLOYMENT_FILE

    given = [flag for flag in ("config", "set", "out", "credentials", "insecure", "node_budget")
             if getattr(args, flag, None)]
    if given:
        raise CLIError("--resume continues a run with its own config, directory, security and node budget: drop "
                       f"--{given[0].replace('_', '-')}.")
    out_dir = Path(args.resume)
    config, *used = load_run_config(out_dir)
    state, metrics = out_dir / STATE_FILE, out_dir / "metrics.jsonl"
    if state.exists() and not state.is_file():
        raise CLIError(f"'{state}' is not a file: restore the checkpoint from a copy, or start the run again.")
    if not state.is_file() and metrics.is_file() and metrics.read_text().strip():
        # the checkpoint is written before the first release, so rounds without it mean it was lost
        raise CLIError(f"'{out_dir}' has rounds in metrics.jsonl but no {STATE_FILE}: without its checkpoint the "
                       "privacy the run spent is unknown, so it cannot continue; restore the file from a copy, or "
                       "start a new run.")
    saved = Checkpoint.load(out_dir) if state.is_file() else None
    if saved is not None and saved.status in ENDED:
        raise CLIError(f"The run in '{out_dir}' has ended ({saved.status}, {saved.rounds_done} rounds): there is "
                       "nothing to resume.")
    deployed = (out_dir / DEPLOYMENT_FILE).is_file() or (saved is not None and not saved.simulated)
    if command == "run" and deployed:
        raise CLIError(f"The run in '{out_dir}' was a deployment: continue it with `fedlora deploy --resume "
                       f"{out_dir}`.")
    if command == "deploy" and not deployed:
        raise CLIError(f"The run in '{out_dir}' was a simulation: continue it with `fedlora run --resume {out_dir}`.")
    checked = check(out_dir, config)
    _, plan = _prepare(args, config, command, out_dir=out_dir, used=used)
    done = saved.rounds_done if saved else 0
    spent = _spent(saved)
    epsilon = (f", epsilon {spent.epsilon:.3f} ({spent.threat_model}) spent in {saved.releases} releases"
               if spent else "")
    print(f"  resuming after round {done} of {config.num_rounds}{epsilon}")
    return out_dir, config, checked, plan


def deploy(args: argparse.Namespace) -> None:
    """A SuperLink and one SuperNode per client on this machine (TLS and SuperNode authentication unless
    --insecure), one run, then every process stopped."""
    from fedlora.config import DEPLOY_PRESET, RunConfig, load_config
    from fedlora.credentials import Credentials, make_credentials
    from fedlora.launch import DEPLOYMENT_FILE, deploy_locally, deployment_credentials

    if args.resume:
        out_dir, config, credentials, plan = _resumable(args, "deploy", check=deployment_credentials)
        print(f"  security: {_security(credentials)}")
        if (budget := json.loads((Path(out_dir) / DEPLOYMENT_FILE).read_text()).get("node_budget")) is not None:
            print(_node_budget_line(budget, out_dir))
        _done(deploy_locally(config, out_dir, credentials=credentials, resume=True, began=_command_start(),
                             noise=(plan.noise_multiplier, plan.probe_noise_multiplier)), out_dir, config)
        return
    given = dict(parse_assignment(a) for a in args.set)
    preset = [] if args.config else [f"{k}={v}" for k, v in DEPLOY_PRESET.items()]
    config = load_config(args.config, preset + args.set)
    if config.noise_source != "os":
        raise CLIError('Deployments draw the noise and the sample of clients from the OS: set noise-source = "os" '
                       '(with "seeded" anyone who knows the run seed could remove the noise and know who took part).')
    if config.threat_model == "secret-sketch" and get_algorithm(config.strategy).sketched:
        if given.get("sketch-secret") == "run-seed":
            raise CLIError('sketch-secret = "run-seed" would give the server the secret sketch: deployments read it '
                           'from each SuperNode (sketch-secret = "node-file").')
        config = RunConfig.from_mapping({"sketch-secret": "node-file"}, base=config)
    if config.simulation_nodes:
        raise CLIError("simulation-nodes is for simulations: a deployment runs one SuperNode per client, each "
                       "training on its own data; leave it at 0.")
    if args.insecure and args.credentials:
        raise CLIError("--insecure and --credentials exclude each other.")
    if config.sketch_secret == "node-file" and args.insecure:
        raise CLIError("A secret-sketch deployment needs the nodes' credentials folders (they hold the sketch "
                       "secret): drop --insecure.")
    out_dir, plan = _prepare(args, config, "deploy")
    credentials = None
    if args.credentials:
        credentials = Credentials(Path(args.credentials), config.num_clients)
        if missing := credentials.missing(secret=config.sketch_secret == "node-file"):
            raise CLIError(f"--credentials lacks {missing[0]}: write them with `fedlora credentials DIR --nodes "
                           f"{config.num_clients}`.")
    elif not args.insecure:
        if (written := Path(out_dir) / "credentials").is_dir() and any(written.iterdir()):
            raise CLIError(f"'{written}' holds the credentials of an earlier start of this deployment: use them with "
                           f"`--credentials {written}`, or choose another --out.")
        credentials = make_credentials(written, nodes=config.num_clients)
    print(f"  security: {_security(credentials)}")
    if args.node_budget is not None:
        print(_node_budget_line(args.node_budget, out_dir))
    _done(deploy_locally(config, out_dir, credentials=credentials, began=_command_start(),
                         node_budget=args.node_budget, noise=(plan.noise_multiplier, plan.probe_noise_multiplier)),
          out_dir, config)


def _node_budget_line(budget: float, out_dir) -> str:
    return f"  node budgets: each SuperNode refuses replies past epsilon {budget:g} against the server by its own " \
           f"ledger ({os.path.join(out_dir, 'nodes')})"


def _security(credentials) -> str:
    return (f"TLS and SuperNode authentication, credentials in {credentials.root}" if credentials
            else "INSECURE (no TLS, no SuperNode authentication), as asked")


def audit(args: argparse.Namespace) -> dict:
    """The configured strategy's empirical privacy: its mechanism on one message, then (with canaries) a whole
    in-process run with canary clients. Everything is checked before either starts."""
    import time

    from fedlora.algorithms import make_mechanism
    from fedlora.audit import audit_mechanism, audit_secure_sum
    from fedlora.config import AUDIT_PRESET, load_config
    from fedlora.experiment import check_before_start, noise_for
    from fedlora.strategies.canary_audit import MIN_CANARIES, audit_federation, check_canary_audit

    preset = [] if args.config else [f"{k}={v}" for k, v in AUDIT_PRESET.items()]
    if (args.aux_units or args.reference) and not args.text:
        flag = "--aux-units" if args.aux_units else "--reference"
        raise CLIError(f"{flag} is for the text audit's reference model: add --text, or drop {flag}.")
    if args.text and args.trials is not None:
        raise CLIError("--trials sets the mechanism level's releases, which the text audit (--text) does not run: "
                       "drop --trials.")
    config = load_config(args.config, preset + args.set)
    if args.text:
        return _text_audit(args, config)
    trials = args.trials or DEFAULT_TRIALS
    if config.sketch_secret == "node-file":
        raise CLIError('The audit simulates the clients: use sketch-secret = "run-seed".')
    canaries = min(300, config.num_clients * 3 // 4) if args.canaries is None else args.canaries
    if args.canaries is None and canaries < MIN_CANARIES:  # too few clients for the run: the mechanism level only
        canaries = 0
    if canaries:
        check_canary_audit(config, canaries)
    check_before_start(config)
    plan = noise_for(config)  # raises for an unreachable target epsilon
    out_dir = Path(args.out or f"runs/audit-{config.strategy}-{time.strftime('%Y%m%d-%H%M%S')}")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise CLIError(f"'{out_dir}' is not empty: choose another --out.")
    _output_dir(out_dir, "--out")
    algorithm = get_algorithm(config.strategy)
    mechanism = make_mechanism(algorithm, clip_norm=config.clip_norm, noise_multiplier=plan.noise_multiplier,
                               sketch_dim=config.effective_sketch_dim(), threat_model=config.threat_model,
                               placement=config.noise_placement)
    m, k = next(iter(adapted_layer_shapes(config.model, targets=config.targets).values()))
    # what one client's message holds per layer: B, or with FlexLoRA's updates the change of the product B A
    shape, what = (((m, k), f"the change of one {m}x{k} product B A") if config.message == "update"
                   and algorithm.family is LoRAMode.FLEX else ((m, config.rank), f"one {m}x{config.rank} LoRA B"))
    say = (lambda line: None) if args.json else print
    say(f"fedlora audit: {config.strategy}, {mechanism.describe()}")
    say(f"mechanism level: {what} at clip norm {config.clip_norm:g}, {trials} releases of it and of its "
        "neighbour ...")
    common = {"shape": shape, "trials": trials, "delta": config.delta, "seed": config.seed,
              "clients_per_round": config.clients_per_round}
    if config.noise_placement == "secagg":  # what the server sees if it follows SecAgg+, and if it does not
        result = {"strategy": config.strategy, **audit_secure_sum(
            mechanism, min_replies=config.required_replies(), **common).to_json()}
        say(_audit_lines(result))
        result["one_reply"] = audit_secure_sum(mechanism, min_replies=config.required_replies(), alone=True,
                                               **common).to_json()
        say(_audit_lines(result["one_reply"]))
    else:
        result = {"strategy": config.strategy, **audit_mechanism(mechanism, **common).to_json()}
        say(_audit_lines(result))
    result["federation"] = None
    if not canaries:
        say(f"federation level: skipped ({'--canaries 0' if args.canaries == 0 else f'{config.num_clients} clients are too few for {MIN_CANARIES} canaries'})")
    else:
        say(f"federation level: {config.num_rounds} rounds of {config.strategy}, {canaries} of {config.num_clients} "
            f"clients are canaries, {config.clients_per_round} clients per round ...")
        result["federation"] = audit_federation(config, canaries, out_dir / "run", echo=say).to_json()
        say(_audit_lines(result["federation"]))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "audit.json").write_text(json.dumps(result, indent=2) + "\n")
    say(f"done: {out_dir / 'audit.json'}")
    return result


def _text_audit(args: argparse.Namespace, config) -> dict:
    """`fedlora audit --text`: the text attacks on a language model's federation (strategies.text_audit), checked
    before anything runs."""
    import time

    from fedlora.experiment import check_before_start, noise_for
    from fedlora.strategies.text_audit import MIN_TEXT_CANARIES, audit_text, check_text_audit

    # half the clients, up to 100, and never fewer than the least the audit takes
    canaries = max(MIN_TEXT_CANARIES, min(100, config.num_clients // 2)) if args.canaries is None else args.canaries
    check_text_audit(config, canaries, args.aux_units)
    check_before_start(config)
    noise_for(config)  # raises for an unreachable target epsilon
    out_dir = Path(args.out or f"runs/audit-text-{config.strategy}-{time.strftime('%Y%m%d-%H%M%S')}")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise CLIError(f"'{out_dir}' is not empty: choose another --out.")
    _output_dir(out_dir, "--out")
    say = (lambda line: None) if args.json else print
    say(f"fedlora audit --text: {config.strategy} on {config.dataset}, {config.num_rounds} rounds, "
        f"{config.clients_per_round} of {config.num_clients} clients a round")
    if args.reference:
        _output_dir(Path(args.reference), "--reference")
    result = audit_text(config, canaries=canaries, aux_units=args.aux_units, out_dir=out_dir,
                        reference_dir=args.reference and Path(args.reference), echo=say)
    m, c = result["membership"], result["canaries"]
    say(f"  the audited model's test perplexity {result['perplexity']:.2f}")
    if "auc" in m:
        say(f"  membership (a client whose text took part; its loss under the reference less under the model): AUC "
            f"{m['auc']:.3f} [{m['auc_interval'][0]:.3f}, {m['auc_interval'][1]:.3f}], TPR {m['tpr_at_fpr_0.1']:.3f} "
            f"at FPR 10%, {m['tpr_at_fpr_0.01']:.3f} at FPR 1% ({m['members']} members, {m['non_members']} not)")
        if "auc" in (recent := m["recent"]):
            say(f"  the {recent['members']} members drawn last in release {recent['from_release']} or later: AUC "
                f"{recent['auc']:.3f} [{recent['auc_interval'][0]:.3f}, {recent['auc_interval'][1]:.3f}], TPR "
                f"{recent['tpr_at_fpr_0.01']:.3f} at FPR 1%")
    else:
        say(f"  membership: not measured ({m['members']} members, {m['non_members']} not: two of each needed)")
    say(f"  canaries: {c['included']} of {c['count']} written {c['repeats']} times, exposure {c['exposure_included']:.2f} "
        f"bits (at most {c['exposure_max']:.2f}; {c['exposure_excluded']:.2f} for those left out, about 1.44 by "
        f"chance); one-run lower bound epsilon {c['one_run_lower_bound']:.3f} at {c['confidence']:.0%} confidence")
    say(f"  accountant epsilon {_epsilon_text(result['accountant_epsilon'] if math.isfinite(result['accountant_epsilon']) else None)} "
        f"at delta {result['delta']:g} ({result['threat_model']})")
    result["accountant_epsilon"] = result["accountant_epsilon"] if math.isfinite(result["accountant_epsilon"]) else None
    (out_dir / "audit.json").write_text(json.dumps(result, indent=2) + "\n")
    say(f"done: {out_dir / 'audit.json'}")
    return result


def _epsilon_text(value: float | None) -> str:
    return "inf" if value is None else f"{value:.3f}"


def _audit_lines(r: dict) -> str:
    """What one audit found, for people: the test's power, then the two epsilons side by side."""
    from fedlora.audit import verdict

    scope = "one release" if r["level"] == "mechanism" else "the run"
    lines = [f"  {r['name']}: {r['attack']}",
             f"  AUC {r['auc']:.3f}, TPR {r['tpr_at_fpr_0.01']:.3f} at FPR 1%, TPR {r['tpr_at_fpr_0.1']:.3f} at FPR 10%",
             f"  empirical epsilon {_epsilon_text(r['empirical_epsilon'])} ({r['empirical_kind']}); accountant "
             f"epsilon {_epsilon_text(r['accountant_epsilon'])} for {scope} at delta {r['delta']:g} "
             f"({r['threat_model']})"]
    if r["level"] == "federation":  # its estimate may be infinite (null), and is still worth a line
        lines.append(f"  Andrew et al.'s estimate {_epsilon_text(r['estimate_epsilon'])} (a Gaussian fit, not a bound); "
                     f"with no canary inserted it gives {_epsilon_text(r['null_epsilon'])} (its noise floor)")
    if r.get("claimed_epsilon") is not None:
        lines.append(f"  the paper's per-message analysis gives {r['claimed_epsilon']:.3f} for this release "
                     "(secret-sketch, ignoring the shared sketch)")
    lines.append(f"  verdict: {verdict(r)}")
    return "\n".join(lines)


def add_overrides(parser: argparse.ArgumentParser, help: str = "override config keys") -> None:
    """`--set KEY=VALUE [KEY=VALUE ...]`, repeatable: `--set a=1 b=2` and `--set a=1 --set b=2` are the same."""
    parser.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                        help=f"{help} (one or more KEY=VALUE; repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fedlora", description="Differentially private federated LoRA with sketched Gaussian mechanisms.")
    # pyproject.toml's, as installed; asked here, not on importing fedlora, which a Flower app bundle's copy of the
    # package does where no distribution is installed
    parser.add_argument("--version", action="version", version=f"fedlora {metadata.version('fedlora')}")
    commands = parser.add_subparsers(dest="command", parser_class=_Parser)
    d = commands.add_parser("describe", help="what each mechanism uploads and costs for a model's LoRA adapters")
    d.add_argument("--model", default="vit-b16-random", choices=list(MODELS),
                   help="backbone (default: ViT-B/16 shapes with random weights, works offline)")
    d.add_argument("--rank", type=_positive, default=4, help="LoRA rank r (default 4, the paper's)")
    d.add_argument("--targets", default="qv", choices=["qv", "all"], help="adapted linears (default: query/value)")
    d.add_argument("--sketch-dim", type=_positive, default=150, help="SGMM sketch dimension b (default 150)")
    d.add_argument("--vector-sketch-dim", type=_positive, default=None, help="SGMV sketch dimension h (default b r)")
    d.add_argument("--num-classes", type=_classes, default=100)
    d.add_argument("--head", default="message", choices=list(HEAD_MODES),
                   help="classifier head: trained in every message (default), in linear-probe rounds only, or frozen")
    d.add_argument("--message", default="update", choices=list(MESSAGE_FORMS),
                   help="what clients send: updates (default; FlexLoRA: the change of each product B A) or "
                        "their adapters (the paper's form)")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.add_argument("--config", help="a TOML preset: its model, rank, targets, sketch dimension and classes, and the "
                                    "upload of its N clients per round")

    r = commands.add_parser("run", help="run a simulated federation (default: the offline CPU quickstart)")
    r.add_argument("--config", help="a TOML preset file, or a packaged preset by name (quickstart, fashion_mnist, "
                                    "small_cohort, cifar100_private, paper_cifar100); default: the quickstart")
    add_overrides(r)
    r.add_argument("--out", type=_path_arg, help="run directory (default: runs/<strategy>-<time>)")
    r.add_argument("--resume", metavar="DIR", type=_path_arg, help="continue the run in DIR from its last checkpoint (after a crash, "
                                                   "a kill or a stop), with its own config")
    r.add_argument("--ray-address", metavar="HOST:PORT", help="run the clients on the Ray cluster whose head is there "
                                                             "(default: RAY_ADDRESS if set, else a Ray of its own on "
                                                             "this machine); run this on a node of the cluster")

    cl = commands.add_parser("cluster", help="check that every node of a Ray cluster can run a config's clients "
                                             "(as `fedlora run --ray-address` does first; for `flwr run` users)")
    cl.add_argument("--config", help="a TOML preset, or a packaged preset by name; default: the quickstart")
    add_overrides(cl)
    cl.add_argument("--ray-address", metavar="HOST:PORT", help="the cluster's head (default: RAY_ADDRESS)")

    dp = commands.add_parser("deploy", help="a SuperLink and one SuperNode per client on this machine, one run")
    dp.add_argument("--config", help="a TOML preset; default: two SuperNodes, two rounds of sgmm-ffa-lora, tiny ViT")
    add_overrides(dp)
    dp.add_argument("--out", type=_path_arg, help="run directory (default: runs/<strategy>-<time>)")
    dp.add_argument("--credentials", help="a folder written by `fedlora credentials` (default: new, in the run "
                                          "directory)")
    dp.add_argument("--insecure", action="store_true", help="no TLS and no SuperNode authentication")
    dp.add_argument("--resume", metavar="DIR", type=_path_arg, help="continue the deployment in DIR from its last checkpoint (after "
                                                    "its SuperLink or ServerApp died), with its config and security")
    dp.add_argument("--node-budget", metavar="EPSILON", type=_positive_float,
                    help="every SuperNode keeps its own privacy ledger (under DIR/nodes) and refuses replies that would "
                         "pass this epsilon against the server, counting only the noise it adds itself")

    nl = commands.add_parser("ledger", help="what a node's privacy ledger (node-config privacy-ledger) spent against "
                                            "the server")
    nl.add_argument("path", type=_path_arg)
    nl.add_argument("--delta", type=_float_arg, default=1e-5, help="default 1e-5, a node's default")
    nl.add_argument("--json", action="store_true", help="print one JSON object")

    cr = commands.add_parser("credentials", help="TLS certificates, SuperNode keys and the sketch secret, one "
                                                 "folder per machine")
    cr.add_argument("dir", type=_path_arg)
    cr.add_argument("--host", action="append", default=[], help="a name or IP the SuperNodes reach the SuperLink by "
                                                               "(repeatable; default 127.0.0.1 and localhost)")
    cr.add_argument("--nodes", type=_positive, default=2, help="SuperNodes (default 2, at most 10,000)")

    rc = commands.add_parser("reconstruct", help="de-sketch a secret-sketch run's global state into a PEFT adapter")
    rc.add_argument("run_dir")
    rc.add_argument("--sketch-secret-file", required=True, help="the federation's sketch secret (a node's copy)")

    au = commands.add_parser("audit", help="measure a strategy's empirical privacy: membership tests on its "
                                           "mechanism and canaries in a run")
    au.add_argument("--config", help="a TOML preset; default: the quickstart, evaluated every 10th round")
    add_overrides(au)
    au.add_argument("--trials", type=_trials, help="releases per hypothesis at the mechanism level (default "
                                                    f"{DEFAULT_TRIALS})")
    au.add_argument("--canaries", type=int, default=None, help="canary clients in the run (default: 3/4 of the "
                                                               "clients, at most 300, none if that is under 100; "
                                                               "0 skips the run)")
    au.add_argument("--text", action="store_true", help="a language model's federation at client level: membership "
                    "inference by loss against a reference federation on --aux-units, and text canaries' exposure "
                    "(--canaries of them, default half the clients, at least 20 and at most 100)")
    au.add_argument("--aux-units", type=int, default=0, help="--text: the last training units (chapters, files) kept "
                                                             "from every client, the reference model's data")
    au.add_argument("--reference", type=_path_arg, help="--text: the reference federation's directory, shared by "
                                                         "audits of one recipe (a finished reference of the same "
                                                         "recipe there is used, not run again; default: in --out)")
    au.add_argument("--out", type=_path_arg, help="audit directory (default: runs/audit-<strategy>-<time>)")
    au.add_argument("--json", action="store_true", help="print one JSON object")

    pt = commands.add_parser("pretrain", help="rebuild an offline public backbone (vit-tiny-public from synthetic "
                                              "public classes, vit-tiny-fashion-public from Fashion-MNIST's public "
                                              "split, gpt2-tiny-public and its tokenizer from the fortunes "
                                              "package's text) and print its sha256")
    pt.add_argument("--dataset", default="synthetic", choices=("synthetic", "fashion-mnist", "fortunes"),
                    help="the public data (default: synthetic, for vit-tiny-public)")
    pt.add_argument("--out", type=_path_arg, help="where to write it (default: the packaged file its model loads; "
                                                  "the language model's tokenizer goes beside it)")
    pt.add_argument("--steps", type=_positive, default=None, help="AdamW steps (default: the recipe's, 1000 on "
                                                                   "synthetic, 6000 on fashion-mnist, 1500 on "
                                                                   "fortunes)")

    p = commands.add_parser("privacy", help="epsilon of a strategy, or its noise multiplier for a target epsilon")
    p.add_argument("--strategy", default="sgmm-ffa-lora", help=f"one of {', '.join(ALGORITHMS)}")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--target-epsilon", type=_float_arg, help="calibrate the noise multiplier for this epsilon")
    budget.add_argument("--noise-multiplier", type=_float_arg, help="report the epsilon of this noise multiplier")
    p.add_argument("--delta", type=_float_arg, default=1e-5)
    p.add_argument("--num-clients", type=_positive, default=625, help="C (default 625, the paper's)")
    p.add_argument("--clients-per-round", type=_positive, default=4, help="N (default 4, the paper's)")
    p.add_argument("--sampling-rate", type=_float_arg, help="q for Poisson sampling (default N / C)")
    p.add_argument("--rounds", type=_positive, default=400, help="T (default 400, the paper's)")
    p.add_argument("--rank", type=_positive, default=4)
    p.add_argument("--sketch-dim", type=_positive, help="b for SGMM (default 150), h for SGMV (default 150 r)")
    p.add_argument("--model", default="vit-b16", choices=list(MODELS), help="whose layer sizes bound the sketch")
    p.add_argument("--threat-model", default="known-sketch", choices=["known-sketch", "secret-sketch"])
    p.add_argument("--noise-placement", default="client", choices=["client", "server", "secagg"],
                   help="noise on every client's message (default, the paper's), on their sum at the server, or in "
                        "shares under secure aggregation (with --config)")
    p.add_argument("--head", default="message", choices=["message", "frozen"],
                   help="the classifier head: trained inside the message (default, as runs do; under secret-sketch "
                        "it adds a dense Gaussian release) or frozen (the paper's accounting of the adapters alone)")
    p.add_argument("--target-observer", default="model", choices=["model", "server"],
                   help="whose epsilon --target-epsilon calibrates: observers of the model, who do not know the sample "
                        "(amplified; default), or the server, which draws it (no amplification)")
    p.add_argument("--clip-count-stddev", type=_float_arg, help="adaptive clipping: the noise on the clip count, "
                                                                "composed with the update's")
    p.add_argument("--sampling", default="fixed", choices=["fixed", "poisson"])
    p.add_argument("--min-replies", type=_positive, help="N_min, the fewest replies a round is aggregated from (default "
                                                         "half of N rounded up, as runs): with noise at each client the "
                                                         "model carries their noise summed")
    p.add_argument("--accountant", default="rdp", choices=["rdp", "pld"],
                   help="fixed-size sampling: RDP (default), or also the PLD of a proven dominating pair (tighter)")
    p.add_argument("--paper-table", action="store_true", help="the paper's noise table beside ours")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--config", help="a TOML preset: the run's own accounting (what `fedlora run` calibrates and "
                                    "spends) replaces the flags")
    add_overrides(p, "with --config: override keys of the preset, as `fedlora run --set` does")
    return parser


def _stop_on_sigterm() -> None:
    """SIGTERM (`kill`, systemd, a job scheduler) ends the command like Ctrl-C: through its `finally` blocks, which
    stop the SuperLink, SuperNodes and Ray it started, instead of leaving them running behind it."""
    import signal
    import threading

    def terminated(signum, frame):
        raise _Terminated(128 + signum)

    if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
        signal.signal(signal.SIGTERM, terminated)


class _Terminated(SystemExit):
    """SIGTERM, raised where the command is, so that its `finally` blocks run."""


def _stopped(why: str) -> None:
    """One line for a command stopped from outside: how to continue its run, if it started one."""
    hint = f": continue the run with `{_RESUME_HINT[0][0]}`" if _RESUME_HINT else ""
    print(f"fedlora: stopped by {why}{hint}", file=sys.stderr)


def _resume_offer(message: str) -> str:
    """How to continue the run a failed launch leaves, where its message does not say (a resume whose SuperNode
    could not start, say): only a run with a checkpoint that has not ended can be resumed."""
    from fedlora.checkpoint import ENDED, STATE_FILE, Checkpoint

    if not _RESUME_HINT or "--resume" in message:
        return ""
    hint, out_dir = _RESUME_HINT[0]
    try:
        resumable = (out_dir / STATE_FILE).is_file() and Checkpoint.load(out_dir).status not in ENDED
    except ValueError:  # a damaged checkpoint: its resume would say so
        return ""
    return f" Resume it with `{hint}`." if resumable else ""


def _credentials(args: argparse.Namespace) -> None:
    from fedlora.credentials import make_credentials

    creds = make_credentials(args.dir, hosts=tuple(args.host) or ("127.0.0.1", "localhost"), nodes=args.nodes)
    print(f"Wrote {creds.root}: superlink/ for the SuperLink, supernode-<i>/ for device i, ca/ to keep "
          "offline. The sketch secret is in every supernode-<i>/ and never goes to the server.")


def _pretrain(args: argparse.Namespace) -> None:
    from fedlora import pretrain
    from fedlora.data import fashion_mnist_unavailable_reason
    from fedlora.text import fortunes_unavailable_reason

    if args.dataset == "fashion-mnist" and (reason := fashion_mnist_unavailable_reason()):
        raise CLIError(reason)
    if args.dataset == "fortunes" and (reason := fortunes_unavailable_reason()):
        raise CLIError(reason)
    if args.out and Path(args.out).is_dir():
        raise CLIError(f"--out '{args.out}' is a directory: name the weights file to write.")
    if args.out:
        _output_dir(Path(args.out).parent, "--out's folder")
    pretrain.pretrain(args.dataset, Path(args.out) if args.out else None, steps=args.steps)


def _reconstruct(args: argparse.Namespace) -> None:
    from fedlora.experiment import reconstruct

    metrics = reconstruct(args.run_dir, args.sketch_secret_file)
    print("test " + ", ".join(f"{name} {value:.3f}" for name, value in metrics.items()))


def _audit(args: argparse.Namespace) -> None:
    result = audit(args)
    if args.json:
        print(json.dumps(result, indent=2))


def _describe(args: argparse.Namespace) -> None:
    if args.config:
        _from_config(args, "describe")
    report = describe(args)
    print(json.dumps(report, indent=2)) if args.json else _print_describe(report)


def _privacy(args: argparse.Namespace) -> None:
    if args.paper_table:
        from dataclasses import asdict

        from fedlora.privacy.paper import paper_table

        rows = paper_table()
        print(json.dumps([asdict(r) for r in rows], indent=2)) if args.json else _print_paper_table(rows)
        return
    if args.config:
        result = _config_privacy(args)
    else:
        if args.set:
            raise CLIError("--set overrides a preset's key: give --config too.")
        if args.noise_placement == "secagg":
            raise CLIError("--noise-placement secagg is accounted from a run's message size and min-replies: "
                           "give --config FILE with noise-placement = \"secagg\".")
        if args.target_epsilon is None and args.noise_multiplier is None:
            raise CLIError("Give --target-epsilon or --noise-multiplier (or --paper-table).")
        _validate_privacy(args)
        result = privacy(args)
    print(json.dumps(result, indent=2)) if args.json else _print_privacy(result)


def ledger(args: argparse.Namespace) -> dict:
    """A node's privacy ledger: its replies and the epsilon they spent against the server."""
    from fedlora.privacy.node_budget import NodeBudget

    if not 0 < args.delta < 1:
        raise CLIError(f"--delta must lie in (0, 1), got {args.delta:g}.")
    path = Path(args.path).expanduser()
    if not path.is_file():
        raise CLIError(f"'{path}' is not a file: give the node's privacy-ledger.")
    budget = NodeBudget(path, None, args.delta)
    records = budget.records()
    runs = sorted({str(r.get("run", "?")) for r in records})
    spent, method = budget.accounting(records)
    result = {"path": str(path), "replies": len(records), "runs": runs, "epsilon": spent, "method": method,
              "delta": args.delta, "first": records[0].get("time") if records else None,
              "last": records[-1].get("time") if records else None,
              "threat_model": f"against the server, counting only the noise this node added ({method})"}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        span = f", {result['first']} to {result['last']}" if records else ""
        print(f"{path}: {len(records)} replies in {len(runs)} runs{span}")
        print(f"epsilon {result['epsilon']:.3f} at delta {args.delta:g}, {result['threat_model']}")
    return result


COMMANDS = {"run": run, "deploy": deploy, "cluster": cluster, "credentials": _credentials, "pretrain": _pretrain,
            "reconstruct": _reconstruct, "audit": _audit, "describe": _describe, "privacy": _privacy,
            "ledger": ledger}


def main(argv: list[str] | None = None) -> int:
    _stop_on_sigterm()
    _RESUME_HINT.clear()
    try:
        args = build_parser().parse_args(argv if argv is not None else sys.argv[1:] or ["run"])
        COMMANDS[args.command](args)
        sys.stdout.flush()  # here, where a reader that left is caught
        return 0
    except ValueError as error:  # every bad input the package detects: a ValueError, one sentence per problem
        for line in str(error).splitlines():
            print(f"fedlora: error: {line}", file=sys.stderr)
        return 2
    except RuntimeError as error:  # a run that started and failed (SimulationError): its log is named
        print(f"fedlora: error: {error}{_resume_offer(str(error))}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader left (`fedlora describe | head -1`): stop quietly, as Python's docs advise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot raise again
        return 1
    except KeyboardInterrupt:
        _stopped("Ctrl-C")
        return 130
    except _Terminated as stop:
        _stopped("SIGTERM")
        return stop.code
    finally:
        _release()


if __name__ == "__main__":
    sys.exit(main())
