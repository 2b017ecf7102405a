"""What the commands share, declared once: --config, --json, the Redis connection from the
settings, and settings or Redis problems ending in one readable line."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import click
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from backends.contract.connect import redis_from_url
from backends.contract.redact import redact_url
from worker.settings import FleetSettings, SettingsError, load_settings

F = TypeVar("F", bound=Callable[..., Any])


def config_option(*, may_be_absent: bool = False) -> Callable[[F], F]:
    """--config. `may_be_absent`: the placement commands, which also render for another host,
    take defaults when the file is not there, and their help says so."""
    default = ", else ./worker-config.json if present)." if may_be_absent else " or ./worker-config.json)"
    return click.option("--config", "config", type=click.Path(dir_okay=False), default=None,
                        help=f"worker-config.json (default: $FLEET_CONFIG{default}")


def json_option(help: str | None = None) -> Callable[[F], F]:
    return click.option("--json", "as_json", is_flag=True, help=help)


def friendly_errors(func: F) -> F:
    """Settings and Redis problems end in one readable line, not a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except SettingsError as e:
            raise click.ClickException(str(e)) from None
        except (RedisConnectionError, RedisTimeoutError) as e:
            url = click.get_current_context().meta.get("redis_url", "?")
            raise click.ClickException(f"cannot reach Redis at {redact_url(url)}: {e}") from None

    return wrapper  # type: ignore[return-value]


def settings_and_redis(config: str | None, **overrides: Any) -> tuple[FleetSettings, Redis]:
    s = load_settings(config, **{k: v for k, v in overrides.items() if v is not None})
    click.get_current_context().meta["redis_url"] = s.redis_url
    # a socket timeout and keepalive so a half-open connection cannot block the worker loop
    redis = redis_from_url(s.redis_url, socket_connect_timeout=3, socket_timeout=10, socket_keepalive=True,
                           health_check_interval=30)
    redis.ping()
    return s, redis
