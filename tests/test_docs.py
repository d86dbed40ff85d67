"""The documentation site: it builds strictly (a broken link, anchor or docstring fails), its configuration
reference lists every key the code defines, and a real headless browser renders its pages with their navigation
and a figure."""

import html
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedlora.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
MATPLOTLIB_BLUE = (31, 119, 180)  # the first colour of matplotlib's cycle: the plots' own pixels, not the theme's


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_the_site_builds_strictly_with_every_page_of_the_nav(site):
    for page in ("index.html", "getting-started.html", "tutorials/real-data.html", "how-to/own-dataset.html",
                 "explanation/threat-models.html", "reference/configuration.html", "reference/mechanisms.html",
                 "benchmarks/results/privacy_utility.html"):
        assert (site / page).is_file(), page
    assert (site / "benchmarks" / "results" / "compare_cpu.png").is_file()  # results' figures travel with them


def test_a_strict_build_fails_on_a_broken_link(tmp_path):
    shutil.copytree(ROOT / "docs", tmp_path / "docs")  # the site's sources with one broken link; the rest linked
    shutil.copy(ROOT / "mkdocs.yml", tmp_path)
    for name in ("benchmarks", "configs", "fedlora", "strategies", "clients"):
        (tmp_path / name).symlink_to(ROOT / name)
    gpu = tmp_path / "docs" / "how-to" / "gpu.md"
    gpu.write_text(gpu.read_text() + "\n[gone](nowhere.md)\n")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode != 0 and "nowhere.md" in result.stderr


def test_the_configuration_reference_lists_every_key_with_its_default(site):
    page = html.unescape((site / "reference" / "configuration.html").read_text())
    rows = dict(re.findall(r"<tr>\s*<td><code>([a-z0-9-]+)</code></td>\s*<td><code>(.*?)</code></td>", page))
    defaults = RunConfig().to_mapping()
    assert rows.keys() == defaults.keys()  # every key once, no other
    for key, default in defaults.items():
        assert rows[key] == (f'"{default}"' if isinstance(default, str) else str(default)), key


def _browser() -> str:
    found = next((shutil.which(name) for name in BROWSERS if shutil.which(name)), None)
    if found is None:
        reason = "no Chromium for the browser check: `sudo apt-get install chromium` (CI installs it in .ci/run)"
        (pytest.fail if os.environ.get("CI") else pytest.skip)(reason)
    return found


def _render(page: Path, out: Path, height: int) -> tuple[str, np.ndarray]:
    """The page's DOM after its scripts ran, and a screenshot of its first ``height`` pixels."""
    browser = _browser()
    flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--virtual-time-budget=5000",
             f"--window-size=1280,{height}"]
    url = page.resolve().as_uri()
    dom = subprocess.run([browser, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    subprocess.run([browser, *flags, f"--screenshot={out}", url], capture_output=True, timeout=120, check=True)
    return dom, np.asarray(Image.open(out).convert("RGB")).astype(int)


def _plot_pixels(image: np.ndarray) -> int:
    return int((np.abs(image - MATPLOTLIB_BLUE).sum(axis=-1) < 40).sum())


def test_a_browser_renders_the_home_page_and_a_tutorial_with_navigation_and_a_figure(site, tmp_path):
    dom, shot = _render(site / "index.html", tmp_path / "home.png", 900)
    assert shot.shape == (900, 1280, 3)
    assert "md-nav--primary" in dom and "Getting started" in dom and "Tutorials" in dom
    assert len(np.unique(shot.reshape(-1, 3), axis=0)) > 50  # text and theme drawn, not a blank page
    dom, shot = _render(site / "tutorials" / "compare-strategies.html", tmp_path / "tutorial.png", 5000)
    assert shot.shape == (5000, 1280, 3) and (tmp_path / "tutorial.png").stat().st_size > 50_000
    active = re.search(r'<a href="compare-strategies\.html" class="md-nav__link md-nav__link--active">(.*?)</a>', dom,
                       re.S)
    assert active and "Comparing strategies" in active.group(1)  # the navigation marks the page open
    assert re.search(r'<img[^>]+src="\.\./benchmarks/results/compare_cpu\.png"', dom)
    assert _plot_pixels(shot) > 500  # the figure itself is on screen: its plotted lines' colour
