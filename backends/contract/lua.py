"""Redis Lua scripts live in `.lua` files beside the code that runs them (shipped as package data:
pyproject's [tool.setuptools.package-data]); each file's header documents its KEYS, ARGV and reply."""

from __future__ import annotations

from collections.abc import Sequence
from importlib.resources import files
from typing import Any

from redis import Redis
from redis.client import Pipeline


def lua_script(package: str, *names: str) -> str:
    """The text of the named `.lua` files of `package`, joined in order (a file may define a Lua
    function that a later one calls)."""
    return "\n".join(files(package).joinpath(name).read_text() for name in names)


def queue_script(pipe: Pipeline | Redis, script: str, keys: Sequence[Any], args: Sequence[Any]) -> None:
    """Queue `script` on `pipe` as EVAL of its text. redis-py's `Script` on a pipeline sends
    SCRIPT EXISTS before every execute (a round trip per pipeline, ~12 % of a busy worker's
    loop); EVAL of a few hundred bytes costs Redis one SHA1 and finds the compiled script."""
    pipe.eval(script, len(keys), *keys, *args)


# Release a lock only while we still own it (the reaper's lock, a batch submitter's lock).
RELEASE_LOCK = lua_script("backends.contract", "release_lock.lua")
# Extend a lock only while we still own it (a model's loading lock, by its loader's heartbeat).
EXTEND_LOCK = lua_script("backends.contract", "extend_lock.lua")
