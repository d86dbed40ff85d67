"""The references beside every federated number on real text (the text preset, configs/bible.toml): the models'
zero-shot test perplexity on the 118 held-out chapters of the King James Bible, and centralized LoRA fine-tuning of
the preset's model and recipe on all 1,071 training chapters.

- zero-shot: the public model (gpt2-tiny-public, pretrained on the fortunes package's text) and the same
  architecture at random init (gpt2-tiny), untouched: the perplexity a federation must bring down;
- the centralized ceiling: LoRA on the same layers at the same rank, the preset's local optimizer and lr, batches
  of 64 blocks drawn from all training chapters, for each step count (a fresh Adam at each, as every federated
  round starts one; the later counts continue the earlier), from the public model and from the random init.

    python -m benchmarks.text_ceiling                  # 300, then 600 and 1200 steps: about 25 min on 2 cores
    python -m benchmarks.text_ceiling --steps 100      # quicker, higher perplexities

Results: benchmarks/results/text_ceiling.{md,json}, with the command, commit and machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from benchmarks.common import RESULTS, command_line, machine, revision, step_counts
from fedlora.config import load_config
from fedlora.federation import Protocol
from fedlora.text import tokenizer_of
from fedlora.text import bible_unavailable_reason, load_tokenizer, to_device_tokens, tokenized_units
from fedlora.training import local_train

BATCH = 64
MODELS = {"gpt2-tiny-public": "pretrained on public text (fortunes)", "gpt2-tiny": "random init"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="300,600,1200", help="centralized LoRA steps at batch 64, increasing "
                                                                "(default 300,600,1200)")
    args = parser.parse_args(argv)
    steps = step_counts(args.steps)
    if steps is None:
        print(f"text_ceiling: error: --steps takes increasing positive step counts (e.g. 300,600), got "
              f"{args.steps!r}.", file=sys.stderr)
        return 2
    if (reason := bible_unavailable_reason()) is not None:
        print(f"text_ceiling: error: {reason}", file=sys.stderr)
        return 2
    preset = load_config("bible")
    rows = []
    for model, what in MODELS.items():
        config = load_config("bible", [f"model={model}", "strategy=ffa-lora"])
        net = Protocol(config, 0.0).build_model(device=torch.device("cpu"))  # FFA: B trains, A stays at its seed
        test = config.task.test_data(config, "cpu")
        eos = load_tokenizer(tokenizer_of(config)).eos_id
        train = to_device_tokens(tokenized_units(config.dataset, "train", tokenizer_of(config)), config.seq_len, eos)
        started = time.time()
        zero = config.task.evaluate(net, test)
        rows.append({"model": model, "what": what, "steps": 0, **zero, "seconds": time.time() - started})
        print(f"{model} zero-shot: perplexity {zero['perplexity']:.2f}", flush=True)
        generator, done = torch.Generator().manual_seed(0), 0
        for count in steps:
            started = time.time()
            local_train(net, train, steps=count - done, batch_size=BATCH, lr=preset.lr, generator=generator,
                        optimizer=preset.local_optimizer, task=config.task)
            done = count
            metrics = config.task.evaluate(net, test)
            rows.append({"model": model, "what": what, "steps": count, **metrics, "seconds": time.time() - started})
            print(f"{model} centralized LoRA, {count} steps: perplexity {metrics['perplexity']:.2f}", flush=True)
    _write(rows, preset, len(train), train.tokens, len(test), test.tokens)
    return 0


def _write(rows: list[dict], preset, train_blocks: int, train_tokens: int, test_blocks: int, test_tokens: int) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "text_ceiling.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["# The text preset's references: zero-shot and centralized LoRA fine-tuning", "",
             f"Command: `{command_line('benchmarks.text_ceiling')}` at {revision()} on {machine()}.", "",
             f"Text: the King James Bible, {train_tokens:,} training tokens in {train_blocks:,} blocks of "
             f"{preset.seq_len} (1,071 chapters), {test_tokens:,} test tokens in {test_blocks:,} blocks (118 held-out "
             f"chapters). Centralized LoRA: rank {preset.rank} on {preset.targets} (GPT-2's fused c_attn), "
             f"{preset.local_optimizer} at lr {preset.lr:g}, batches of {BATCH} blocks drawn with replacement.", "",
             "| model | steps | test perplexity | test loss (nats/token) | next-token accuracy | seconds |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        label = "zero-shot" if r["steps"] == 0 else f"{r['steps']}"
        lines.append(f"| {r['model']} ({r['what']}) | {label} | {r['perplexity']:.2f} | {r['loss']:.3f} | "
                     f"{r['accuracy']:.3f} | {r['seconds']:.0f} |")
    (RESULTS / "text_ceiling.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
