"""Client-level privacy accounting: release descriptions, RDP curves, accountants, calibration, the run ledger.

See docs/explanation/threat-models.md for the threat models and fedlora/privacy/shared_sketch_bound.md for the
secret-sketch joint-release bound.

Names load on first use: a client describing its release (``events``) never imports the accountants
(dp-accounting, autodp), which a SuperNode would otherwise pay for on every message.
"""

from importlib import import_module

_HOMES = {
    "THREAT_MODELS": "accounting", "Calibration": "accounting", "PrivacyReport": "accounting",
    "calibrate": "accounting", "epsilon": "accounting",
    "GaussianRelease": "events", "NonPrivateRelease": "events", "Observer": "events", "observers": "events", "Phase": "events", "Sampling": "events",
    "SamplingScheme": "events", "SkellamRelease": "events", "SketchedRelease": "events",
    "PrivacyLedger": "ledger",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'fedlora.privacy' has no attribute {name!r}")
    return getattr(import_module(f"fedlora.privacy.{_HOMES[name]}"), name)
