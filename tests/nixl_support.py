"""What the nixl tests share: whether nixl is importable (and why not), and the UCX settings for
this machine (TCP over loopback unless the environment already chose)."""

from __future__ import annotations

import importlib.util
import os

__all__ = ["NIXL_SKIP_REASON", "NIXL_TEST_CONFIG", "REQUIRE_VAR", "nixl_missing"]

NIXL_SKIP_REASON = (
    "nixl is not installed in this interpreter: pip install 'kvferry[nixl]' (CPU-only: "
    "pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1); .ci/run runs these tests in the vLLM venv"
)

#: UCX transports and device: TCP over loopback (the environment wins when it sets them).
NIXL_TEST_CONFIG = {
    "ucx_tls": os.environ.get("UCX_TLS", "tcp,self"),
    "ucx_net_devices": os.environ.get("UCX_NET_DEVICES", "lo"),
}


#: Set to 1 where the nixl tests must run (.ci/run's nixl step): a missing nixl then fails them.
REQUIRE_VAR = "KVFERRY_REQUIRE_NIXL"


def nixl_missing() -> str | None:
    """None when ``nixl._api`` with a backend package imports here (or where it is required:
    the tests then run and fail), else the skip reason."""
    if os.environ.get(REQUIRE_VAR) == "1":
        return None
    try:
        if importlib.util.find_spec("nixl") is None:
            return NIXL_SKIP_REASON
    except (ImportError, ValueError):
        return NIXL_SKIP_REASON
    try:
        from nixl import _api

        _api.nixl_agent  # noqa: B018
    except (ImportError, OSError, AttributeError) as exc:
        return f"{NIXL_SKIP_REASON} ({type(exc).__name__}: {exc})"
    return None
