"""The queue model's Lua: one prelude of key names and helpers, rendered from
backends/contract/keys.py, loaded before every queue script.

A script never spells a key name: `KEY.<name>(...)` builds it with the same text keys.py builds,
because the prelude's key functions are rendered from keys.py's own functions (each is called
with a marker argument and split around it). Field names, TTLs and the priorities come from the
contract the same way. The helpers every script shares (which tenant a queue belongs to, how a
tenant's job joins its queue and the fair share, what a tenant's admission places are) are
written once, in prelude.lua.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.resources import files

from backends.contract import keys
from backends.contract.affinity import held_key
from backends.contract.schema import DEFAULT_TENANT, PRIORITIES

_MARK = "\x00"

# Lua name -> the contract's key function of one argument
_KEY_FUNCTIONS: dict[str, Callable[[str], str]] = {
    "queue": keys.queue_key,
    "job": keys.job_key,
    "inflight": keys.inflight_key,
    "stream": keys.stream_key,
    "cancel": keys.cancel_key,
    "fair": keys.fair_key,
    "fair_spent": keys.fair_spent_key,
    "wip": keys.started_registry_key,
    "canceled": keys.canceled_registry_key,
    "execution": keys.execution_key,
    "executions": keys.executions_key,
    "worker": keys.worker_key,
    "tenant_open": keys.tenant_open_key,
    "tenant_queued": keys.tenant_queued_key,
    "tenant_rate": keys.tenant_rate_prefix,
    "usage": keys.usage_prefix,
    "capacity": keys.capacity_key,
}
# two-argument key functions
_KEY_FUNCTIONS_2: dict[str, Callable[[str, str], str]] = {
    "held": held_key,
    "worker_wake": keys.worker_wake_key,
}
_FIELDS = {
    "attempt": keys.ATTEMPT_FIELD, "died_on": keys.DIED_ON_FIELD, "owner": keys.OWNER_FIELD,
    "final": keys.FINAL_FIELD, "drains": keys.DRAINS_FIELD, "execution": keys.EXECUTION_FIELD,
    "suspect": keys.SUSPECT_FIELD, "size": keys.SIZE_FIELD, "charged": keys.CHARGED_FIELD,
}
_NUMBERS = {
    "FAIR_TTL": keys.FAIR_TTL, "FAIR_NEWCOMER": keys.FAIR_NEWCOMER, "USAGE_TTL": keys.USAGE_TTL,
    "CAPACITY_LIVE_MS": keys.CAPACITY_LIVE_MS, "CAPACITY_TTL": keys.CAPACITY_TTL,
    "WORKER_WAKE_TTL": keys.WORKER_WAKE_TTL, "SPEND_TTL": keys.SPEND_TTL,
}


def _lua_string(text: str) -> str:
    assert "'" not in text and "\\" not in text and "\n" not in text, text
    return f"'{text}'"


def _key_function(name: str, fn: Callable[..., str], arity: int) -> str:
    parts = fn(*[_MARK] * arity).split(_MARK)
    assert len(parts) == arity + 1, (name, parts)
    args = [f"a{i}" for i in range(arity)]
    body = " .. ".join(p for pair in zip([_lua_string(s) for s in parts], [*args, ""], strict=True)
                       for p in pair if p and p != "''")
    return f"  {name} = function({', '.join(args)}) return {body} end,"


def render_header() -> str:
    """The Lua tables KEY, FIELD, the numbers and PRIORITIES, from the contract."""
    lines = ["-- rendered from backends/contract/keys.py by backends/contract/queue/scripts.py",
             "local KEY = {"]
    lines += [_key_function(n, f, 1) for n, f in _KEY_FUNCTIONS.items()]
    lines += [_key_function(n, f, 2) for n, f in _KEY_FUNCTIONS_2.items()]
    lines += [f"  QUEUE_PREFIX_LEN = {len(keys.QUEUE_PREFIX)},", "}", "local FIELD = {"]
    lines += [f"  {n} = {_lua_string(v)}," for n, v in _FIELDS.items()]
    lines += ["}"]
    lines += [f"local {n} = {v}" for n, v in _NUMBERS.items()]
    lines += [f"local DEFAULT_TENANT = {_lua_string(DEFAULT_TENANT)}",
              "local PRIORITIES = {" + ", ".join(f"[{_lua_string(p)}] = true" for p in PRIORITIES) + "}",
              f"local TENANT_PATTERN = {_lua_string(TENANT_LUA_PATTERN)}"]
    return "\n".join(lines)


# The tenant names a queue may carry (schema.TENANT_PATTERN's characters, as a Lua pattern)
TENANT_LUA_PATTERN = "^[%w_%.%-]+$"

PRELUDE = render_header() + "\n" + files(__package__).joinpath("prelude.lua").read_text()


def queue_script(*names: str) -> str:
    """The prelude, then the named `.lua` files of this package in order (a file may define a
    function a later one calls)."""
    return "\n".join([PRELUDE, *(files(__package__).joinpath(n).read_text() for n in names)])
