"""Client-level privacy accounting: release descriptions, RDP curves, accountants, calibration, the run ledger.

See ../shared/design/PRIVACY.md for the threat models and fedlora/privacy/shared_sketch_bound.md for the
secret-sketch joint-release bound.
"""

from fedlora.privacy.accounting import THREAT_MODELS, Calibration, PrivacyReport, calibrate, epsilon
from fedlora.privacy.events import (GaussianRelease, NonPrivateRelease, Phase, Sampling, SamplingScheme,
                                    SketchedRelease)
from fedlora.privacy.ledger import PrivacyLedger

__all__ = ["THREAT_MODELS", "Calibration", "GaussianRelease", "NonPrivateRelease", "Phase", "PrivacyLedger",
           "PrivacyReport", "Sampling", "SamplingScheme", "SketchedRelease", "calibrate", "epsilon"]
