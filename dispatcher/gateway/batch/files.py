"""Files uploaded through the gateway (POST /v1/files), kept in Redis per creator and bounded:

    fleet:file:<id>          filename, purpose, bytes, created_at, owner, content     TTL file_ttl
    fleet:files:<creator>    file id -> bytes (what the creator keeps now)           TTL the newest file's

A creator is the hash of the caller's API key (`anonymous` without keys): a file is visible only
to its creator. The limits (files and bytes per creator) are checked in the script that stores the
file, so two uploads at once cannot both pass them. Each operation is a plan (dispatcher/plans.py)
the gateway runs on its async client; the plain functions run it on a sync one.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from redis import Redis

from backends.contract.keys import creator_files_key, file_key
from backends.contract.lua import lua_script
from backends.contract.replies import as_str
from dispatcher.plans import Eval, Plan, ask, cmd, run

FILE_ID_PATTERN = re.compile(r"file-[0-9a-f]{24}")  # what new_file_id makes
ANONYMOUS = "anonymous"
META_FIELDS = ("filename", "purpose", "bytes", "created_at", "owner")

# KEYS, ARGV and replies: each script's header.
_STORE = lua_script("dispatcher.gateway.batch", "store_file.lua")  # unless a limit would be passed
_DELETE = lua_script("dispatcher.gateway.batch", "delete_file.lua")  # only by its creator


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def creator_of(token: str | None) -> str:
    """Who made a request: a prefix of the sha256 of its API key (never the key), or `anonymous`
    when the gateway has no keys."""
    if token is None:
        return ANONYMOUS
    return "key-" + hashlib.sha256(token.encode()).hexdigest()[:20]


@dataclass
class FileLimits:
    ttl: int
    max_files: int
    max_bytes: int  # per creator, all files together


class FileLimitReached(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def store(redis: Redis, file_id: str, creator: str, filename: str, content: bytes,
          limits: FileLimits) -> dict[str, Any]:
    return run(redis, store_plan(file_id, creator, filename, content, limits))


def store_plan(file_id: str, creator: str, filename: str, content: bytes,
               limits: FileLimits) -> Plan[dict[str, Any]]:
    """Keep the file for `limits.ttl` seconds; returns its metadata. Raises FileLimitReached (429
    for the number of files, 413 for the bytes) without writing anything."""
    meta: dict[str, Any] = {"filename": filename, "purpose": "batch", "bytes": len(content),
                            "created_at": int(time.time()), "owner": creator}
    args: list[Any] = [limits.ttl, limits.max_files, limits.max_bytes, len(content), file_key(""), file_id]
    for name, value in [*meta.items(), ("content", content)]:
        args += [name, value]
    raw = yield from ask(Eval(_STORE, [file_key(file_id), creator_files_key(creator)], args))
    reply = [as_str(x) or "" for x in raw]
    if reply[0] == "files":
        raise FileLimitReached(429, f"you keep {reply[1]} files, the most allowed (gateway.max_files "
                               f"{limits.max_files}); delete some (DELETE /v1/files/<id>) or wait until "
                               "they expire")
    if reply[0] == "bytes":
        raise FileLimitReached(413, f"your files take {int(reply[1]):,} bytes; {len(content):,} more would "
                               f"pass gateway.max_file_storage ({limits.max_bytes:,} bytes); delete some "
                               "files (DELETE /v1/files/<id>) or wait until they expire")
    return meta


def read_meta(redis: Redis, file_id: str, creator: str) -> dict[str, Any] | None:
    return run(redis, read_meta_plan(file_id, creator))


def read_meta_plan(file_id: str, creator: str | None) -> Plan[dict[str, Any] | None]:
    """The file's metadata if `creator` made it (anyone else: None, as for an unknown id; creator
    None: an operator, any file)."""
    if not FILE_ID_PATTERN.fullmatch(file_id):
        return None
    raw = yield from ask(cmd("hmget", file_key(file_id), list(META_FIELDS)))
    meta = dict(zip(META_FIELDS, (as_str(v) for v in raw), strict=True))
    return meta if meta["filename"] is not None and creator in (None, meta["owner"]) else None


def read_content(redis: Redis, file_id: str, creator: str | None) -> bytes | None:
    return run(redis, read_content_plan(file_id, creator))


def read_content_plan(file_id: str, creator: str | None) -> Plan[bytes | None]:
    """The file's bytes if `creator` made it (None: an operator, any file)."""
    if not FILE_ID_PATTERN.fullmatch(file_id):
        return None
    owner, content = yield from ask(cmd("hmget", file_key(file_id), ["owner", "content"]))
    if creator not in (None, as_str(owner)) or content is None:
        return None
    return content if isinstance(content, bytes) else str(content).encode()


def delete(redis: Redis, file_id: str, creator: str) -> bool:
    return run(redis, delete_plan(file_id, creator))


def delete_plan(file_id: str, creator: str) -> Plan[bool]:
    if not FILE_ID_PATTERN.fullmatch(file_id):
        return False
    reply = yield from ask(Eval(_DELETE, [file_key(file_id), creator_files_key(creator)], [file_id, creator]))
    return bool(reply)
