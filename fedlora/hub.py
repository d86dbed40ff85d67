"""Is the Hugging Face hub reachable? Asked once before a download, so offline runs fail at once.

Without this check the hub clients retry with back-off for minutes before giving up.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

_TRUE = {"1", "true", "yes", "on"}


def hub_offline_requested() -> bool:
    """The user asked the HF libraries to use their local cache only."""
    return any(os.environ.get(v, "").lower() in _TRUE for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub endpoint (HF_ENDPOINT, default huggingface.co) opens in time."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def offline_reason() -> str | None:
    """Why a hub download cannot work here, or None when it may."""
    if hub_offline_requested():
        return None  # the libraries will read their cache and fail fast on a miss
    if not hub_reachable():
        return "the hub is unreachable; set HF_HUB_OFFLINE=1 to use weights already in your HF cache"
    return None
