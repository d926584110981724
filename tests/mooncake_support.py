"""What the mooncake tests share: whether mooncake's transfer engine loads here, and why not."""

from __future__ import annotations

__all__ = ["mooncake_missing"]


def mooncake_missing() -> str | None:
    """None when ``mooncake.engine`` imports here, else the skip reason: the ``mooncake`` extra
    is not installed, or its system library (libibverbs1) is missing."""
    try:
        import mooncake.engine  # noqa: F401
    except (ImportError, OSError) as exc:
        return (
            f"mooncake transfer engine unavailable ({exc}): pip install 'kvferry[mooncake]' "
            "and apt-get install libibverbs1"
        )
    return None
