"""The KV store: finished sequences' whole state in files that a host's workers share, so a
conversation finds its history after its worker restarted, unloaded its model or was busy.

An entry is what the host-RAM cache holds (kv.py: Stash), in one file: a sequence's state
(`llama_state_seq_get_data_ext`, every layer) and its windowed layers' checkpoints, behind a
header that says what it is for: the identity of the engine that wrote it (model file size and
sha256, the context settings that shape a sequence's state, the llama.cpp build), the tenant,
the prompt's token ids, and a CRC-32 of the payload (it finds a file damaged or cut short; the
directory is the fleet user's alone, so nobody forges one; a fraction of blake2b's cost).

Layout: `<path>/<bucket>/<entry>.kv`; the bucket is a hash of (identity, tenant), so an engine
only ever lists its own tenant's entries of its own identity, and the entry's name a hash of
(identity, tenant, tokens). Writers write a temp file in the bucket and rename it (readers see a
whole file or none), files 0600. Any writer evicts the least recently used entries (mtime,
touched when an entry is restored) past the byte budget. Another worker removing a file under
us is normal: every read and stat tolerates it.

A lookup lists the bucket and compares the job's tokens with each entry's (headers are read once
per file name: a name stands for its tokens); the longest common prefix wins, as in RAM. A file
that is truncated, corrupt or not what its name says is removed and never restored.

Writes happen on a thread of their own (`StoreWriter`), fed a bounded queue: a step never waits
for the disk; when the queue is full the entry is dropped (counted). Reads too (`StoreReader`):
the engine asks at admission and keeps stepping; the job starts once its entry is in RAM.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import struct
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

Bytes = bytes | bytearray | memoryview

log = logging.getLogger(__name__)

FORMAT = 2  # 2: the payload's CRC-32 (1: its blake2b)
MAGIC = b"FLKV"
_PREFIX = struct.Struct("<4sII")  # magic, format, header bytes
MAX_HEADER = 8 << 20  # a header holds token ids (~7 bytes each as JSON): far below this
SUFFIX = ".kv"
TEMP_PREFIX = ".part-"
QUEUE_ENTRIES = 4  # entries waiting for the writer (each a sequence's state: MBs)
READER_THREADS = 2
STORE_ID = ".store-id"


def store_id(root: Path) -> str:
    """The store's name: one random id written once in its directory, so every worker that opens
    the directory, on this host or another that mounts it, names the same store (the claim sends
    a job whose holder is busy or gone to a worker of the holder's store). Raises OSError when the
    directory cannot be made or read."""
    root = Path(root)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = root / STORE_ID
    found = _read_id(path)
    if found:
        return found
    fd, temp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=root)
    try:
        os.write(fd, uuid.uuid4().hex.encode())
        os.close(fd)
        if os.path.lexists(path):
            os.replace(temp, path)  # not an id: replaced whole
        else:
            with contextlib.suppress(FileExistsError):  # a link never replaces: the first writer wins
                os.link(temp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
    return _read_id(path) or ""


def _read_id(path: Path) -> str | None:
    with contextlib.suppress(OSError, UnicodeDecodeError):
        found = path.read_text().strip()
        if 0 < len(found) <= 64 and all(c in "0123456789abcdef" for c in found):
            return found
    return None


def _hash(*parts: object) -> str:
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True)
class Header:
    identity: dict[str, object]
    tenant: str
    tokens: list[int]
    n_prompt: int  # prompt length of the job that computed the state (batch invariance)
    oldest: int  # oldest position the windowed layers held (0: all, or no windowed layers)
    state_bytes: int
    checkpoints: list[tuple[int, int]]  # (position, bytes), after the state in the payload
    crc32: int

    def payload_bytes(self) -> int:
        return self.state_bytes + sum(size for _, size in self.checkpoints)

    def to_json(self) -> bytes:
        return json.dumps({"identity": self.identity, "tenant": self.tenant, "tokens": self.tokens,
                           "n_prompt": self.n_prompt, "oldest": self.oldest, "state_bytes": self.state_bytes,
                           "checkpoints": self.checkpoints, "crc32": self.crc32}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Header:
        """The header, or ValueError when any field is missing or of the wrong kind."""
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise ValueError("header is not an object")
        ints = [d.get(k) for k in ("n_prompt", "oldest", "state_bytes")]
        tokens, checkpoints = d.get("tokens"), d.get("checkpoints")
        if (not isinstance(d.get("identity"), dict) or not isinstance(d.get("tenant"), str)
                or not _is_int(d.get("crc32")) or not all(_is_int(v) for v in ints)
                or not isinstance(tokens, list) or not all(_is_int(t) for t in tokens)
                or not isinstance(checkpoints, list)
                or not all(isinstance(c, list) and len(c) == 2 and all(_is_int(v) for v in c)
                           for c in checkpoints)):
            raise ValueError("header fields missing or of the wrong kind")
        return cls(d["identity"], d["tenant"], tokens, d["n_prompt"], d["oldest"], d["state_bytes"],
                   [(p, n) for p, n in checkpoints], d["crc32"])


def _crc32(data: Bytes, start: int = 0) -> int:
    return zlib.crc32(data, start) & 0xFFFFFFFF


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


@dataclass(slots=True)
class Entry:
    """What goes in and comes out: a sequence's state and its checkpoints, for `tokens`."""

    tenant: str
    tokens: list[int]
    n_prompt: int
    oldest: int
    state: Bytes
    checkpoints: Sequence[tuple[int, Bytes]] = field(default_factory=list)


@dataclass(slots=True)
class StoreStats:
    """Counted by the store (read by the engine's stats from the heartbeat thread)."""

    written: int = 0
    written_bytes: int = 0
    write_ms: float = 0.0  # checksum, file written and renamed into place (the writer's thread)
    dropped: int = 0  # the writer's queue was full
    write_errors: int = 0  # the disk refused (full, gone, read-only)
    evicted: int = 0
    removed_bad: int = 0  # truncated, corrupt or foreign files removed
    restores: int = 0
    restored_tokens: int = 0
    restore_ms: float = 0.0


class KvStore:
    """One engine's view of the store: its identity, its buckets, the budget it evicts to."""

    def __init__(self, root: Path, identity: Mapping[str, object], *, budget_bytes: int,
                 fsync: bool = False) -> None:
        self.root = Path(root)
        self.identity = dict(identity)
        self.budget_bytes = budget_bytes
        self.fsync = fsync
        self.stats = StoreStats()
        self._headers: dict[Path, Header] = {}  # a name stands for its tokens: read once
        self._logged: set[str] = set()
        self._lock = threading.Lock()  # the writer thread and the engine's lookups share _headers

    # -- names -----------------------------------------------------------------------------------

    def bucket(self, tenant: str) -> Path:
        return self.root / _hash("bucket", self.identity, tenant)

    def path_of(self, tenant: str, tokens: Sequence[int]) -> Path:
        return self.bucket(tenant) / (_hash("entry", self.identity, tenant, list(tokens)) + SUFFIX)

    # -- reading ---------------------------------------------------------------------------------

    def find(self, tenant: str, tokens: Sequence[int], usable: Callable[[Header], int],
             better_than: int = 0) -> tuple[Entry, int] | None:
        """The tenant's entry that gives the most of `tokens` (`usable(header)`: how many, by the
        engine's reuse rule), if more than `better_than`, read whole and checked: (the entry, its
        usable length). A bad file found on the way is removed and the next best tried."""
        t0 = time.perf_counter()
        candidates = []
        listing = self._listing(self.bucket(tenant))
        self._prune(self.bucket(tenant), listing)
        for path in listing:
            header = self._header(path)
            if header is not None and (n := usable(header)) > better_than:
                candidates.append((n, path, header))
        for n, path, header in sorted(candidates, key=lambda c: -c[0]):
            entry = self._read(path, header)
            if entry is not None:
                with contextlib.suppress(OSError):
                    os.utime(path)  # recently used: the last to be evicted
                self.stats.restores += 1
                self.stats.restored_tokens += n
                self.stats.restore_ms += (time.perf_counter() - t0) * 1000
                return entry, n
        return None

    def _listing(self, bucket: Path) -> list[Path]:
        try:
            return [Path(e.path) for e in os.scandir(bucket)
                    if e.name.endswith(SUFFIX) and not e.name.startswith(TEMP_PREFIX)]
        except OSError:  # no bucket yet (nothing written for this tenant), or the store is gone
            return []

    def _header(self, path: Path) -> Header | None:
        with self._lock:
            known = self._headers.get(path)
        if known is not None:
            return known
        try:
            with path.open("rb") as f:
                header = self._parse_header(f.read(_PREFIX.size), f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            self._remove_bad(path, str(e))
            return None
        if header is None or not self._is_mine(path, header):
            return None
        with self._lock:
            self._headers[path] = header
        return header

    def _parse_header(self, prefix: bytes | bytearray, f: object) -> Header | None:
        if len(prefix) < _PREFIX.size:
            raise ValueError("shorter than its prefix")
        magic, fmt, size = _PREFIX.unpack(prefix)
        if magic != MAGIC or size > MAX_HEADER:
            raise ValueError("not a KV store entry")
        if fmt != FORMAT:
            raise ValueError(f"format {fmt}, this engine reads {FORMAT}")
        raw = f.read(size)  # type: ignore[attr-defined]
        if len(raw) < size:
            raise ValueError("truncated header")
        return Header.from_json(raw)

    def _is_mine(self, path: Path, header: Header) -> bool:
        """The header says what the file's name stands for (this identity, this tenant, these
        tokens); else it is foreign: removed."""
        if header.identity != self.identity or path != self.path_of(header.tenant, header.tokens):
            self._remove_bad(path, "written for another model, settings, build or tenant")
            return False
        return True

    def _read(self, path: Path, header: Header) -> Entry | None:
        try:
            with path.open("rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                del data[f.readinto(data):]  # shorter than its size said: caught below
        except FileNotFoundError:
            self._forget(path)
            return None
        except OSError as e:
            self._remove_bad(path, str(e))
            return None
        try:
            again = self._parse_header(data[:_PREFIX.size], _Reader(data, _PREFIX.size))
        except ValueError as e:
            self._remove_bad(path, str(e))
            return None
        start = _PREFIX.size + _PREFIX.unpack(bytes(data[:_PREFIX.size]))[2]
        payload = memoryview(data)[start:]
        if (again != header or len(payload) != header.payload_bytes()
                or _crc32(payload) != header.crc32):
            self._remove_bad(path, "truncated or corrupt payload")
            return None
        # views of the one buffer read (writable: llama.cpp reads them in place, no copy)
        checkpoints: list[tuple[int, Bytes]] = []
        at = header.state_bytes
        for pos, size in header.checkpoints:
            checkpoints.append((pos, payload[at:at + size]))
            at += size
        return Entry(header.tenant, header.tokens, header.n_prompt, header.oldest,
                     payload[:header.state_bytes], checkpoints)

    def _remove_bad(self, path: Path, why: str) -> None:
        """Never restored; removed so no reader meets it again; logged once per file."""
        self._forget(path)
        with contextlib.suppress(OSError):
            path.unlink()
            self.stats.removed_bad += 1
        if path.name not in self._logged:
            self._logged.add(path.name)
            log.warning("KV store: removed %s (%s)", path, why)

    def _prune(self, bucket: Path, listing: list[Path]) -> None:
        """Forget the headers of the bucket's files that are gone (other workers evict too): the
        cache holds at most what the directory does."""
        present = set(listing)
        with self._lock:
            for path in [p for p in self._headers if p.parent == bucket and p not in present]:
                del self._headers[path]

    def _forget(self, path: Path) -> None:
        with self._lock:
            self._headers.pop(path, None)

    # -- writing (the writer thread) ------------------------------------------------------------

    def write(self, entry: Entry) -> None:
        """Write `entry` atomically, drop the tenant's entries it holds all of, evict to the
        budget. OSError (a full or missing disk) is the caller's to count."""
        t0 = time.perf_counter()
        crc = _crc32(entry.state)
        for _, data in entry.checkpoints:
            crc = _crc32(data, crc)
        header = Header(self.identity, entry.tenant, list(entry.tokens), entry.n_prompt, entry.oldest,
                        len(entry.state), [(p, len(d)) for p, d in entry.checkpoints], crc)
        raw = header.to_json()
        path = self.path_of(entry.tenant, entry.tokens)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # 0600; not named *.kv: readers and other writers never list a file being written
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TEMP_PREFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_PREFIX.pack(MAGIC, FORMAT, len(raw)))
                f.write(raw)
                f.write(entry.state)
                for _, data in entry.checkpoints:
                    f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)  # whole or not at all; a racing writer of the same key: one wins
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if self.fsync:
            _fsync_dir(path.parent)
        with self._lock:
            self._headers[path] = header
        self.stats.written += 1
        self.stats.written_bytes += len(raw) + header.payload_bytes()
        self.stats.write_ms += (time.perf_counter() - t0) * 1000
        self._drop_held_by(path, header)
        self.evict()

    def _drop_held_by(self, path: Path, header: Header) -> None:
        """Entries of the tenant whose tokens the new one starts with: it serves all they did."""
        n = len(header.tokens)
        for other in self._listing(path.parent):
            held = self._header(other) if other != path else None
            if held is not None and len(held.tokens) <= n and header.tokens[:len(held.tokens)] == held.tokens:
                self._forget(other)
                with contextlib.suppress(OSError):
                    other.unlink()

    def evict(self) -> None:
        """Remove the least recently used entries (any identity, any tenant) past the budget;
        temp files left by a writer that died are removed after an hour."""
        files: list[tuple[float, int, Path]] = []
        now = time.time()
        for bucket in _scandir(self.root):
            for e in _scandir(Path(bucket.path)):
                with contextlib.suppress(OSError):
                    st = e.stat()
                    if e.name.startswith(TEMP_PREFIX):
                        if now - st.st_mtime > 3600:
                            os.unlink(e.path)
                        continue
                    files.append((st.st_mtime, st.st_size, Path(e.path)))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.budget_bytes:
                break
            self._forget(path)
            with contextlib.suppress(OSError):
                path.unlink()
                self.stats.evicted += 1
            total -= size  # gone, by us or another writer


class _Reader:
    """A file-like read over bytes already in memory (the header parser reads from either)."""

    def __init__(self, data: bytes | bytearray, at: int) -> None:
        self.data, self.at = data, at

    def read(self, n: int) -> bytes | bytearray:
        out = self.data[self.at:self.at + n]
        self.at += n
        return out


def _scandir(path: Path) -> list[os.DirEntry[str]]:
    try:
        return list(os.scandir(path))
    except OSError:
        return []


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class StoreWriter:
    """The store's writes on a thread of their own, from a bounded queue: `put` never blocks
    (a full queue drops the entry, counted); `flush` waits, bounded, for what is queued."""

    def __init__(self, store: KvStore, max_queued: int = QUEUE_ENTRIES) -> None:
        self.store = store
        self._queue: queue.Queue[Entry | None] = queue.Queue(max_queued)
        self._error_logged = False
        self._thread = threading.Thread(target=self._run, name="fleet-kv-store", daemon=True)
        self._thread.start()

    def put(self, entry: Entry) -> bool:
        try:
            self._queue.put_nowait(entry)
            return True
        except queue.Full:
            self.store.stats.dropped += 1
            return False

    def _run(self) -> None:
        # the lowest CPU priority (a Linux thread's own nice): a write's checksum and copies run
        # in the engine's idle moments, never taking a core from a step (ggml's threads wait for
        # each other: one of them preempted stalls them all)
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while (entry := self._queue.get()) is not None:
            try:
                self.store.write(entry)
            except OSError as e:
                self.store.stats.write_errors += 1
                if not self._error_logged:  # a full disk stays full: say it once
                    self._error_logged = True
                    log.warning("KV store: cannot write to %s (%s); entries are dropped while it lasts",
                                self.store.root, e)
            except Exception:
                log.exception("KV store: writing an entry failed")
            finally:
                self._queue.task_done()

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the queued entries to be written: all were."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    def close(self, timeout: float) -> bool:
        """Write what is queued (bounded by `timeout`), then stop the thread."""
        done = self.flush(timeout)
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        return done


@dataclass(slots=True)
class Read:
    """A lookup for a job (`find`'s arguments); `found` and `ms` are set by the reader thread."""

    job: object  # the caller's, handed back as it was
    tenant: str
    tokens: Sequence[int]
    usable: Callable[[Header], int]
    better_than: int
    found: tuple[Entry, int] | None = None
    ms: float = 0.0


class StoreReader:
    """The store's lookups on threads of their own: `submit` never blocks, `done` hands back the
    reads finished since the last call. Several at once: jobs that arrive together (a restart's
    queue) are read side by side, checksums and copies on every core. A read that fails finds
    nothing: its job starts cold."""

    def __init__(self, store: KvStore, threads: int = READER_THREADS) -> None:
        self.store = store
        self._todo: queue.Queue[Read | None] = queue.Queue()
        self._done: queue.Queue[Read] = queue.Queue()
        self._threads = [threading.Thread(target=self._run, name=f"fleet-kv-store-reader-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, read: Read) -> None:
        self._todo.put(read)

    def done(self) -> list[Read]:
        out: list[Read] = []
        with contextlib.suppress(queue.Empty):
            while True:
                out.append(self._done.get_nowait())
        return out

    def _run(self) -> None:
        while (read := self._todo.get()) is not None:
            t0 = time.perf_counter()
            try:
                read.found = self.store.find(read.tenant, read.tokens, read.usable, read.better_than)
            except Exception:  # a bug in a read must not stop the reads after it
                log.exception("KV store: reading an entry failed")
            read.ms = (time.perf_counter() - t0) * 1000
            self._done.put(read)

    def close(self) -> None:
        """Stop after the reads in flight (a read blocked on a dead mount: the threads are daemons)."""
        for _ in self._threads:
            self._todo.put(None)
