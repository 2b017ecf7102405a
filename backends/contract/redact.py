"""URLs fit to print: logs, `fleet status` and error messages never show a Redis password."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def redact_url(url: str) -> str:
    """A Redis URL fit to print: the password of `user:password@host` and of a `password=` (or
    `sentinel_password=`) query parameter become ***; the rest, IPv6 brackets and a Sentinel
    URL's host list included, stays as is."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        if ":" in userinfo:
            netloc = userinfo.split(":", 1)[0] + ":***@" + host
    query = "&".join(_redact_param(kv) for kv in parts.query.split("&")) if parts.query else ""
    shown = urlunsplit(parts._replace(netloc=netloc, query=query))
    if not netloc and url.startswith(f"{parts.scheme}://"):  # urlunsplit drops unix:///path's //
        shown = shown.replace(":", "://", 1)
    return shown


def _redact_param(kv: str) -> str:
    key = kv.split("=", 1)[0]
    return f"{key}=***" if key.lower() in ("password", "sentinel_password") else kv
