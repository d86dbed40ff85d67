"""fedlora: differentially private federated LoRA with sketched Gaussian mechanisms."""

from pathlib import Path

# The source tree keeps the product's layout: strategies/, clients/ and configs/ beside this package. A wheel installs
# them inside it (setuptools' package-dir), so that site-packages gains `fedlora` alone. In the source tree (an
# editable install, or a Flower app bundle built from it, whose copy of this package shadows the installed one) the
# same names, fedlora.strategies, fedlora.clients and fedlora.configs, resolve to the folders beside it.
_TREE = Path(__file__).resolve().parent.parent
if not (Path(__file__).resolve().parent / "strategies").is_dir() and (_TREE / "strategies" / "__init__.py").is_file():
    __path__.append(str(_TREE))  # noqa: F821 (a package's __path__)
