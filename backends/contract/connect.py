"""Redis clients from a URL, the one place the project turns a configured URL into a client.

    redis_from_url("redis://:pw@10.0.0.5:6379/0")              # plain TCP (redis-py's own parser)
    redis_from_url("rediss://10.0.0.5:6380/0?ssl_ca_certs=ca.pem")     # TLS
    redis_from_url("unix:///run/redis.sock?db=0")               # local socket
    redis_from_url("redis+sentinel://:pw@s1:26379,s2:26379,s3/fleet/0")

A Sentinel URL names the Sentinels and the service (`sentinel monitor <service> ...`), not the
primary: the client asks the Sentinels which server is the primary whenever it opens a
connection, and redis-py turns a reply from a demoted primary (READONLY) into a ConnectionError.
Every caller already treats ConnectionError as "Redis is away for now" and retries on a backoff,
so producers, workers and the gateway follow a failover without a restart.

Sentinel URL grammar:
    redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db][?options]
    rediss+sentinel://...   TLS to the Sentinels and to the data servers
- user/password: for the data servers (the primary and replicas);
- `sentinel_username` / `sentinel_password` query options: for the Sentinels themselves
  (Sentinel `requirepass`); none by default;
- TLS options (rediss+sentinel): `ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`,
  `ssl_cert_reqs` (none|optional|required), `ssl_check_hostname` (true|false);
- `db` may also be a query option; the port defaults to 26379.

The server must be Redis >= 7.0 (`EXPIRE ... GT` and `EXPIRETIME`, which batches use). Workers
and the gateway check at start with `HELLO` (no arguments: it changes nothing on the connection),
since `INFO` is in the `@dangerous` ACL category that the documented fleet user
(`+@all -@dangerous`) lacks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, unquote, urlsplit

from redis import Redis
from redis.exceptions import NoPermissionError, ResponseError
from redis.sentinel import Sentinel

from backends.contract.redact import redact_url
from backends.contract.settings import SettingsError

if TYPE_CHECKING:
    import redis.asyncio

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
DEFAULT_SENTINEL_PORT = 26379
_SOCKET_OPTIONS = ("socket_timeout", "socket_connect_timeout", "socket_keepalive", "retry",
                   "retry_on_timeout", "health_check_interval")
_TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")
_KNOWN_OPTIONS = ("db", "sentinel_username", "sentinel_password", *_TLS_OPTIONS)
MIN_REDIS_VERSION = (7, 0, 0)
_NEEDS = "llama-fleet needs Redis >= 7.0"
Version = tuple[int, int, int]


@dataclass(frozen=True)
class SentinelURL:
    """A parsed `redis+sentinel://` URL."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)
    tls: dict[str, Any] = field(default_factory=dict)  # ssl=True and ssl_* options; {} without TLS

    def data_kwargs(self, **kw: Any) -> dict[str, Any]:
        """Connection options for the primary/replica connections."""
        return {**kw, **self.tls, "db": self.db, "username": self.username, "password": self.password}

    def sentinel_kwargs(self, **kw: Any) -> dict[str, Any]:
        """Connection options for the Sentinels: the caller's socket options, TLS, their own auth."""
        socket = {k: v for k, v in kw.items() if k in _SOCKET_OPTIONS}
        return {**socket, **self.tls, "username": self.sentinel_username, "password": self.sentinel_password}


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelURL:
    """Parse a Sentinel URL; a ValueError names what is wrong."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in SENTINEL_SCHEMES:
        raise ValueError(f"not a Sentinel URL (expected {' or '.join(s + '://' for s in SENTINEL_SCHEMES)})")
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, sep, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if sep else None
    sentinels = tuple(_host_port(item) for item in hostlist.split(",") if item)
    if not sentinels:
        raise ValueError("Sentinel URL names no Sentinel host (redis+sentinel://host:26379,.../service/db)")
    path = [unquote(p) for p in parts.path.split("/") if p]
    if not path:
        raise ValueError("Sentinel URL names no service (redis+sentinel://hosts/<service>/<db>)")
    if len(path) > 2:
        raise ValueError(f"Sentinel URL path must be /<service>/<db>, not {parts.path!r}")
    options = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = sorted(set(options) - set(_KNOWN_OPTIONS))
    if unknown:
        raise ValueError(f"unknown Sentinel URL option(s): {', '.join(unknown)} "
                         f"(known: {', '.join(_KNOWN_OPTIONS)})")
    db_text = path[1] if len(path) == 2 else options.get("db", "0")
    try:
        db = int(db_text)
    except ValueError:
        raise ValueError(f"Sentinel URL database must be a number, not {db_text!r}") from None
    tls: dict[str, Any] = {}
    if parts.scheme.lower() == "rediss+sentinel":
        tls["ssl"] = True
        for key in _TLS_OPTIONS:
            if key in options:
                tls[key] = _bool(options[key]) if key == "ssl_check_hostname" else options[key]
    elif any(key in options for key in _TLS_OPTIONS):
        raise ValueError("TLS options need the rediss+sentinel:// scheme")
    return SentinelURL(sentinels, path[0], db, username, password,
                       options.get("sentinel_username") or None, options.get("sentinel_password") or None,
                       tls)


def _host_port(item: str) -> tuple[str, int]:
    if item.startswith("["):  # [IPv6]:port
        host, _, rest = item[1:].partition("]")
        port_text = rest.removeprefix(":")
    else:
        host, _, port_text = item.partition(":")
    if not host:
        raise ValueError(f"Sentinel URL host {item!r} has no host name")
    try:
        port = int(port_text) if port_text else DEFAULT_SENTINEL_PORT
    except ValueError:
        raise ValueError(f"Sentinel URL host {item!r} has a bad port") from None
    return host, port


def _bool(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


def redis_from_url(url: str, **kw: Any) -> Redis:
    """A redis-py client for any configured URL (see the module doc); `kw` are connection options
    (socket_timeout, health_check_interval, ...) for the data connections, and their socket
    options for the Sentinels too."""
    if not is_sentinel_url(url):
        return Redis.from_url(url, **kw)
    target = parse_sentinel_url(url)
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=target.sentinel_kwargs(**kw))
    return sentinel.master_for(target.service, redis_class=Redis, **target.data_kwargs(**kw))


def async_redis_from_url(url: str, **kw: Any) -> redis.asyncio.Redis:
    """The redis.asyncio twin of `redis_from_url` (for the gateway and AsyncFleet)."""
    import redis.asyncio as aioredis
    from redis.asyncio.sentinel import Sentinel as AsyncSentinel

    if not is_sentinel_url(url):
        return aioredis.Redis.from_url(url, **kw)
    target = parse_sentinel_url(url)
    sentinel = AsyncSentinel(list(target.sentinels), sentinel_kwargs=target.sentinel_kwargs(**kw))
    return sentinel.master_for(target.service, redis_class=aioredis.Redis, **target.data_kwargs(**kw))


class RedisTooOld(SettingsError):
    """The configured Redis cannot serve the fleet (a SettingsError: the fix is in the config or
    the server, and the CLI prints it in one line)."""


def parse_hello(reply: Any) -> tuple[str, Version]:
    """(server, version) from a HELLO reply: a flat list of pairs (RESP2) or a map (RESP3)."""
    if isinstance(reply, dict):
        pairs = list(reply.items())
    elif isinstance(reply, (list, tuple)) and len(reply) % 2 == 0:
        pairs = list(zip(reply[::2], reply[1::2], strict=True))
    else:
        raise ValueError(f"not a HELLO reply: {reply!r}")
    fields = {_text(k): v for k, v in pairs}
    if "version" not in fields:
        raise ValueError(f"HELLO reply without a version: {reply!r}")
    return _text(fields.get("server", "redis")), parse_version(_text(fields["version"]))


def parse_version(text: str) -> Version:
    """'7.0.15' -> (7, 0, 15); missing parts are 0, a suffix after the digits is ignored."""
    numbers = []
    for part in text.strip().split(".")[:3]:
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        numbers.append(int(digits))
    if not numbers:
        raise ValueError(f"not a version: {text!r}")
    numbers += [0] * (3 - len(numbers))
    return numbers[0], numbers[1], numbers[2]


def check_version(version: Version | None, url: str, server: str = "redis") -> None:
    """RedisTooOld when `version` is known and below MIN_REDIS_VERSION."""
    if version is not None and version < MIN_REDIS_VERSION:
        raise RedisTooOld(f"{server} {'.'.join(map(str, version))} at {redact_url(url)} is too old: {_NEEDS}")


def _hello_refused(error: ResponseError, url: str) -> Version | None:
    if isinstance(error, NoPermissionError):
        return None  # an ACL without @connection: the version cannot be known, nothing to check
    # HELLO without arguments exists from Redis 6.2 on; before that it is unknown or needs one
    raise RedisTooOld(f"the Redis server at {redact_url(url)} does not answer HELLO ({error}), so it "
                      f"is older than 6.2: {_NEEDS}") from None


def server_version(redis: Redis, url: str) -> Version | None:
    """The server's version, checked (RedisTooOld below 7.0); None when an ACL refuses HELLO.
    `url` is for the message (printed redacted)."""
    try:
        server, version = parse_hello(redis.execute_command("HELLO"))
    except ResponseError as e:
        return _hello_refused(e, url)
    check_version(version, url, server)
    return version


async def async_server_version(redis: redis.asyncio.Redis, url: str) -> Version | None:
    """`server_version` on redis.asyncio."""
    try:
        server, version = parse_hello(await redis.execute_command("HELLO"))
    except ResponseError as e:
        return _hello_refused(e, url)
    check_version(version, url, server)
    return version


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
