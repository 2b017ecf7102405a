"""Typed reads of raw Redis replies (clients here return bytes; redis-py types them loosely)."""

from __future__ import annotations

from typing import Any

from redis.typing import EncodableT, FieldT

# What XADD / HSET take: one stream entry or hash mapping
Fields = dict[FieldT, EncodableT]


def as_str(raw: Any) -> str | None:
    """A bytes reply as text (None stays None); never raises on bad UTF-8."""
    if raw is None:
        return None
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


def as_int(raw: Any, default: int = 0) -> int:
    """A counter field: absent or not a number reads as `default`."""
    try:
        return int(raw) if raw is not None else default
    except (TypeError, ValueError):
        return default
