"""Fetching a catalogue model's file from its URL (backends/contract/catalogue.py `url`, `sha256`)
into this host's model cache, on a worker's first need or an operator's pull.

- One download of a file per host: an exclusive `flock` on `<file>.lock` beside it; a second
  process waits for the first, then finds the file there.
- The bytes go to `<file>.partial`; a cut transfer (the server gone, this worker killed) resumes
  from the partial's size with an HTTP Range request, here (a few tries) or on the next need.
- The disk's free space is checked against what is left to fetch before any byte is written.
- The whole file's sha256 is checked before it is renamed into place: a file at the final path
  is always a verified one. A wrong digest removes the partial and says expected vs got.

httpx (a dependency already) does the transfer: redirects (Hugging Face's resolve URLs answer
with one to their CDN), streaming, Range; huggingface_hub would add a dependency and its own
cache layout for nothing more here.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

log = logging.getLogger("fleet.fetch")
TRIES = 4  # transfers per fetch: the first and three resumes after cuts
RETRY_PAUSE = 0.5  # seconds before a resume, doubled each time
SPARE_MB = 64  # free space kept beyond the file
TIMEOUT = httpx.Timeout(30.0, connect=10.0)
Progress = Callable[[int, int], None]  # (bytes completed, total bytes)


class FetchError(Exception):
    """A model's file could not be fetched; the message says why (no secret in it)."""


def partial_of(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


@contextlib.contextmanager
def host_lock(path: Path) -> Iterator[None]:
    """The host's one fetch of `path`: an flock on `<path>.lock`, let go when the process ends."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fetch(url: str, sha256: str, path: Path, progress: Progress | None = None) -> Path:
    """`path`, fetched from `url` first unless already there; raises FetchError."""
    if path.exists():
        return path
    with host_lock(path):
        if path.exists():  # another process fetched it while this one waited
            return path
        partial = partial_of(path)
        pause = RETRY_PAUSE
        for attempt in range(1, TRIES + 1):
            try:
                _transfer(url, partial, progress)
                break
            except (httpx.TransportError, _Cut) as e:
                if attempt == TRIES:
                    raise FetchError(f"{_shown(url)}: transfer cut {TRIES} times ({e}); what came is kept "
                                     f"and the next fetch resumes from byte {_size(partial)}") from e
                log.warning("fetching %s: cut at byte %d (%s); resuming", _shown(url), _size(partial), e)
                time.sleep(pause)
                pause *= 2
        got = _digest(partial)
        if got != sha256:
            partial.unlink(missing_ok=True)
            raise FetchError(f"{_shown(url)}: sha256 mismatch: expected {sha256}, got {got}; the file "
                             "was removed")
        os.replace(partial, path)
    return path


class _Cut(Exception):
    """The body ended before its length."""


def _transfer(url: str, partial: Path, progress: Progress | None) -> None:
    have = _size(partial)
    headers = {"Range": f"bytes={have}-"} if have else {}
    with httpx.stream("GET", url, headers=headers, follow_redirects=True, timeout=TIMEOUT) as r:
        if r.status_code == 416 and have:  # the partial holds the whole file already
            return
        if r.status_code not in (200, 206):
            raise FetchError(f"{_shown(url)}: HTTP {r.status_code}")
        if r.status_code == 200:  # the server ignored the range: from the start
            have = 0
        length = r.headers.get("content-length")
        left = int(length) if length and length.isdigit() else None
        total = have + left if left is not None else 0
        if left is not None:
            free = shutil.disk_usage(partial.parent).free
            if left + SPARE_MB * 2**20 > free:
                raise FetchError(f"{_shown(url)}: not enough disk space in {partial.parent}: "
                                 f"{left // 2**20} MB to fetch, {free // 2**20} MB free "
                                 f"(keeping {SPARE_MB} MB spare)")
        with open(partial, "r+b" if have else "wb") as f:
            f.seek(have)
            f.truncate()
            done = have
            for chunk in r.iter_bytes():  # as they come: a cut keeps every byte received
                f.write(chunk)
                done += len(chunk)
                if progress is not None:
                    progress(done, total)
        if left is not None and done < total:
            raise _Cut(f"{done} of {total} bytes")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _shown(url: str) -> str:
    """The URL without its query (a signed URL's token) or userinfo: what an error may say."""
    parts = httpx.URL(url)
    return str(parts.copy_with(query=None, fragment=None, username=None, password=None))
