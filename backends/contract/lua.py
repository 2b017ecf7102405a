"""Redis Lua scripts live in `.lua` files beside the code that runs them (shipped as package data:
pyproject's [tool.setuptools.package-data]); each file's header documents its KEYS, ARGV and reply."""

from __future__ import annotations

from importlib.resources import files


def lua_script(package: str, *names: str) -> str:
    """The text of the named `.lua` files of `package`, joined in order (a file may define a Lua
    function that a later one calls)."""
    return "\n".join(files(package).joinpath(name).read_text() for name in names)


# Release a lock only while we still own it (the reaper's lock, a batch submitter's lock).
RELEASE_LOCK = lua_script("backends.contract", "release_lock.lua")
