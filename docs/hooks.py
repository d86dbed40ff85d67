"""MkDocs hooks: the pages generated from the repository, so the site cannot drift from it.

- reference/configuration.md: every key of the run configuration, from ``fedlora.config.RunConfig``'s fields
  (default, allowed values, help), the one place the keys are defined;
- benchmarks/results/: the committed benchmark results (tables, plots, CSV and JSON), as pages and files of
  the site, listed under Benchmarks in the navigation;
- configs/: the packaged presets, so pages can link to them;
- explanation/shared_sketch_bound.md: the derivation of the secret-sketch bound, kept beside its code.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path("benchmarks", "results")  # these paths are relative to the repository (mkdocs.yml's folder)
CONFIGS = Path("configs")
SKETCH_BOUND = Path("fedlora", "privacy", "shared_sketch_bound.md")  # the secret-sketch derivation
BENCHMARKS_SECTION = "Benchmarks"


def _allowed(field: dataclasses.Field) -> str:
    meta = field.metadata
    if meta.get("choices"):
        return ", ".join(f"`{c}`" for c in meta["choices"])
    bounds = []
    if meta.get("low") is not None:
        bounds.append(f"{'>' if meta['low_open'] else '>='} {meta['low']:g}")
    if meta.get("high") is not None:
        bounds.append(f"{'<' if meta['high_open'] else '<='} {meta['high']:g}")
    return " and ".join(bounds) if bounds else "any"


def configuration_page() -> str:
    from fedlora.config import RunConfig, packaged_presets

    rows = []
    for field in dataclasses.fields(RunConfig):
        default = field.default
        shown = f'`"{default}"`' if isinstance(default, str) else f"`{default}`"
        help_text = field.metadata["help"].replace("|", "\\|")
        rows.append(f"| `{RunConfig.key(field.name)}` | {shown} | {_allowed(field)} | {help_text} |")
    presets = ", ".join(f"[`{name}`](../configs/{path.name})" for name, path in sorted(packaged_presets().items()))
    return "\n".join([
        "# Run configuration",
        "",
        "Every key of a run, generated from `fedlora.config.RunConfig` when the site is built. The same keys serve",
        "the presets' TOML files (`--config NAME` or a path), `fedlora run --set key=value`, Flower's run config",
        "(`[tool.flwr.app.config]` in `pyproject.toml`, `flwr run . --run-config`) and `fedlora privacy --config`.",
        f"The packaged presets: {presets}. A bad key or value stops the run before it starts, one line each.",
        "",
        "| key | default | allowed | what it sets |",
        "|---|---|---|---|",
        *rows,
        "",
    ])


def _result_title(path: Path) -> str:
    first = path.read_text().splitlines()[0] if path.stat().st_size else path.stem
    return first.lstrip("# ").strip() or path.stem


def _root(config) -> Path:
    return Path(config.config_file_path).resolve().parent


def on_config(config):
    """Lists every committed result page under Benchmarks, after its overview."""
    for item in config["nav"]:
        if isinstance(item, dict) and BENCHMARKS_SECTION in item:
            item[BENCHMARKS_SECTION] += [{_result_title(p): f"benchmarks/results/{p.name}"}
                                         for p in sorted((_root(config) / RESULTS).glob("*.md"))]
    return config


def on_files(files, config):
    root = _root(config)
    files.append(File.generated(config, "reference/configuration.md", content=configuration_page()))
    for path in sorted((root / RESULTS).iterdir()):
        if path.is_file():
            files.append(File.generated(config, f"benchmarks/results/{path.name}", abs_src_path=str(path)))
    files.append(File.generated(config, "explanation/shared_sketch_bound.md", abs_src_path=str(root / SKETCH_BOUND)))
    for path in sorted((root / CONFIGS).glob("*.toml")):
        files.append(File.generated(config, f"configs/{path.name}", abs_src_path=str(path)))
    return files
