"""Can the Hugging Face hub be used now? Asked once before a download, so offline runs fail at once.

Without this check the hub clients retry with back-off (about 23 s for datasets, 100 s for model
weights) before giving up.
"""

from __future__ import annotations

import os
import socket
import urllib.parse
import urllib.request

PROBE_TIMEOUT_S = 2.0
_TRUE = {"1", "true", "yes", "on"}


def offline_requested() -> bool:
    """The user asked the HF libraries to use their local cache only (read now, not at import)."""
    return any(os.environ.get(v, "").lower() in _TRUE for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def unreachable_reason(timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the hub endpoint (HF_ENDPOINT, default huggingface.co) cannot be reached, or None when it may be."""
    if urllib.request.getproxies().get("https"):
        return None  # behind a proxy a direct connection proves nothing: let the library try
    endpoint = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    address = (endpoint.hostname, endpoint.port or (443 if endpoint.scheme == "https" else 80))
    try:
        socket.create_connection(address, timeout=timeout).close()
    except OSError:
        return f"{endpoint.hostname} is unreachable"
    return None
