"""The ``fedlora`` command line. Bad input: one error line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import argparse
import json
import sys

from fedlora.lora import TARGETS, LoRAMode, build_lora_model, get_adapters
from fedlora.models import MODELS, model_spec

# bytes per value on the wire (float32)
_BYTES = 4


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


def describe(args: argparse.Namespace) -> dict:
    """What one client uploads per round under each mechanism, and what its sketch costs, for a real model."""
    spec = model_spec(args.model)
    if (spec.family, args.targets) not in TARGETS:
        raise CLIError(f"Unknown LoRA targets '{args.targets}'; choose 'qv' or 'all'.")
    model = build_lora_model(args.model, num_classes=args.num_classes, rank=args.rank, alpha=2.0 * args.rank,
                             targets=args.targets, mode=LoRAMode.FLEX)
    adapters = get_adapters(model)
    b, h, r = args.sketch_dim, args.vector_sketch_dim or args.sketch_dim * args.rank, args.rank
    shapes = [(tuple(a.shape), tuple(bb.shape)) for a, bb in adapters.values()]
    for (_, k), (m, _) in shapes:
        if b > min(m, k):
            raise CLIError(f"Sketch dimension {b} must lie in [1, {min(m, k)}] for this model's adapted layers.")
        if h > m * r:
            raise CLIError(f"Vector sketch dimension {h} must lie in [1, {m * r}] (m r) for this model's layers.")
    dense_b = sum(m * r for _, (m, r) in shapes)
    dense_a = sum(r * k for (r, k), _ in shapes)
    rows = {  # values uploaded per client per round, and multiply-adds of the sketch
        "ffa-lora / gm-ffa-lora (dense B)": (dense_b, 0),
        "flexlora / gm-flexlora (dense A, B)": (dense_a + dense_b, 0),
        f"sgmm-ffa-lora (R B, b={b})": (len(shapes) * b * r, sum(b * m * r for _, (m, r) in shapes)),
        f"sgmv-ffa-lora (R_v vec(B), h={h})": (len(shapes) * h, sum(h * m * r for _, (m, r) in shapes)),
        f"sgmm-flexlora (R B, A R_A, b={b})": (2 * len(shapes) * b * r,
                                               sum(b * (m + k) * r for (_, k), (m, _) in shapes)),
    }
    return {
        "model": args.model, "family": spec.family, "source": spec.source, "image_size": spec.image_size,
        "pretrained": spec.pretrained, "rank": r, "targets": args.targets, "adapted_layers": len(shapes),
        "layer_shapes": sorted({f"B {m}x{r}, A {r}x{k}" for (r, k), (m, _) in shapes}),
        "backbone_parameters": sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n),
        "mechanisms": [{"strategy": name, "upload_values": values, "upload_bytes": values * _BYTES,
                        "sketch_multiply_adds": flops} for name, (values, flops) in rows.items()],
    }


def _print_describe(report: dict) -> None:
    print(f"{report['model']}: {report['family']} '{report['source']}', {report['image_size']} px, "
          f"{'pretrained' if report['pretrained'] else 'random init'}, "
          f"{report['backbone_parameters'] / 1e6:.1f}M backbone parameters")
    print(f"LoRA rank {report['rank']} on {report['adapted_layers']} layers ({report['targets']}): "
          f"{'; '.join(report['layer_shapes'])}")
    print(f"\n{'strategy (mechanism)':<42}{'upload/client/round':>22}{'sketch multiply-adds':>24}")
    for row in report["mechanisms"]:
        print(f"{row['strategy']:<42}{row['upload_bytes'] / 1024:>18.1f} KiB{row['sketch_multiply_adds']:>24,}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fedlora", description="Differentially private federated LoRA with sketched Gaussian mechanisms.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    d = commands.add_parser("describe", help="what each mechanism uploads and costs for a model's LoRA adapters")
    d.add_argument("--model", default="vit-b16-random", choices=list(MODELS),
                   help="backbone (default: ViT-B/16 shapes with random weights, works offline)")
    d.add_argument("--rank", type=_positive, default=4, help="LoRA rank r (default 4, the paper's)")
    d.add_argument("--targets", default="qv", choices=["qv", "all"], help="adapted linears (default: query/value)")
    d.add_argument("--sketch-dim", type=_positive, default=150, help="SGMM sketch dimension b (default 150)")
    d.add_argument("--vector-sketch-dim", type=_positive, default=None, help="SGMV sketch dimension h (default b r)")
    d.add_argument("--num-classes", type=_positive, default=100)
    d.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.command == "describe":
            report = describe(args)
            print(json.dumps(report, indent=2)) if args.json else _print_describe(report)
        return 0
    except ValueError as error:  # every bad input the package detects is a ValueError with one sentence
        print(f"fedlora: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
