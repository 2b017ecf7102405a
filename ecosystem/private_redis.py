"""`fleet up`'s own Redis: started when the configured Redis URL is local and nothing answers there.

The server listens where the URL says (loopback host, port, password / ACL user) so that workers
and producers need no other setting, and keeps an append-only file in the run directory: jobs
still queued when the fleet stops (or requeued by a drain) are there again on the next `fleet up`.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from redis.exceptions import AuthenticationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from backends.contract.connect import redis_from_url
from backends.contract.redact import redact_url

LOOPBACK = ("localhost", "127.0.0.1", "::1")


class RedisSetupError(Exception):
    """The configured Redis is unusable and fleet up will not stand in for it; says why."""


@dataclass(frozen=True)
class PrivateRedis:
    host: str
    port: int
    username: str | None = None
    password: str | None = None
    # everysec: a Redis crash (or a power cut) can lose up to ~1 s of acknowledged writes, enqueues
    # included; always: fsync before every reply, nothing acknowledged is lost, several times
    # slower writes (docs/reliability.md, "Redis outages"). `fleet up --redis-fsync always`.
    appendfsync: str = "everysec"

    def config(self, data_dir: Path) -> str:
        """redis.conf text (written 0600: it may hold the password)."""
        bind = "127.0.0.1" if self.host == "localhost" else self.host
        lines = [
            "# written by `fleet up`: the fleet's private Redis",
            f"bind {bind}",
            f"port {self.port}",
            f"dir {_quote(str(data_dir))}",
            "daemonize no",
            'logfile ""',
            'save ""',
            "appendonly yes",
            f"appendfsync {self.appendfsync}",
        ]
        if self.password is not None:
            lines.append(f"requirepass {_quote(self.password)}")
            if self.username and self.username != "default":
                lines.append(f"user {_quote(self.username)} on {_quote('>' + self.password)} ~* &* +@all")
        return "\n".join([*lines, ""])


def _quote(value: str) -> str:
    """A redis.conf argument: double-quoted, with backslash escapes."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def redis_server_binary() -> str:
    for found in (shutil.which("redis-server"), "/usr/bin/redis-server"):
        if found and Path(found).exists():
            return found
    raise RedisSetupError(
        "redis-server is not installed (Debian: apt-get install redis-server; or run scripts/setup)"
    )


def reachable(url: str, timeout: float = 1.0) -> bool:
    """True when a Redis answers at `url`. A server that refuses our credentials is reported, not
    replaced: starting a second one on its port would fail anyway."""
    client = redis_from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        return bool(client.ping())
    except (RedisConnectionError, RedisTimeoutError, OSError):
        return False
    except (AuthenticationError, ResponseError) as e:
        raise RedisSetupError(
            f"a Redis answers at {redact_url(url)} but refuses the configured credentials: {e}"
        ) from None
    finally:
        client.close()


def private_redis_for(url: str, appendfsync: str = "everysec") -> PrivateRedis | None:
    """None when a Redis answers at `url`; the server to start when it is local and silent."""
    if reachable(url):
        return None
    parts = urlsplit(url)
    if parts.scheme != "redis":
        raise RedisSetupError(
            f"nothing answers at {redact_url(url)}, and fleet up starts a private Redis only for "
            "redis:// URLs on this machine (not rediss:// or unix://)"
        )
    host = parts.hostname or "localhost"
    if host not in LOOPBACK and not host.startswith("127."):
        raise RedisSetupError(
            f"nothing answers at {redact_url(url)}; it is not on this machine, so fleet up will not "
            "start one: start it, or point FLEET_REDIS_URL / redis_url at 127.0.0.1"
        )
    return PrivateRedis(
        host=host,
        port=parts.port or 6379,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password is not None else None,
        appendfsync=appendfsync,
    )
