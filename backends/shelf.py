"""Several models in one worker: a Backend over one engine per loaded model of the catalogue
(backends/contract/catalogue.py), loaded when a job for it starts and unloaded when idle past its
keep_alive, or to make room for another (the least recently used one without running jobs; a
pinned model never). The worker's loop drives it as it drives one engine: `step()` steps every
loaded model that holds work, `cancel()` finds the job's model.

A job's model is its pool's: the loop asks `engine_for(queue)` for the engine of the job it is
starting (loading it first, in the loop's thread: the worker's running streams pause for the
load, which the status shows) and starts the job there, through a view that tells the shelf
which engine holds the job.

Memory: each model's RAM is its entry's `memory_mb`, else estimated before loading from its
file's size plus the KV its slots take (backends/gguf.py), and corrected by the RSS the load
really added; the models held never exceed the budget.

A load that fails is remembered for FAILED_LOAD_HOLD seconds while its file stays as it was:
the model's other waiting jobs fail with the same error at once rather than load it again each.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from backends.base import (
    Backend,
    BackendUnavailable,
    Bilingual,
    Done,
    Embedder,
    Embedding,
    Event,
    Failed,
    GenerateRequest,
    JobRejected,
    Resumable,
    Scorer,
    Scores,
    TextOps,
    TextRequest,
)
from backends.contract.catalogue import FOREVER, ModelEntry
from backends.contract.settings import EngineSettings
from backends.fetch import FetchError, fetch
from backends.gguf import GgufError, read_header

log = logging.getLogger("fleet.worker")
MIB = 2**20
COMPUTE_MB = 64  # llama.cpp's compute buffers and the sampler's state beside weights and KV
BUDGET_SHARE = 0.8  # of the host's RAM, when no budget is set
FAILED_LOAD_HOLD = 30.0  # seconds a failed load stands for its model's jobs while its file is unchanged
FileVersion = tuple[int, int, int] | None  # a file's inode, size and mtime; None: no file there


def default_budget_mb() -> int:
    return int(psutil.virtual_memory().total * BUDGET_SHARE / MIB)


def estimate_mb(entry: ModelEntry, n_ctx: int, slots: int) -> int:
    """RAM one loaded copy takes: the entry's own figure, else file + KV of every slot + compute."""
    if entry.memory_mb is not None:
        return entry.memory_mb
    try:
        size = entry.path.stat().st_size
        kv = read_header(entry.path).kv_bytes_per_token() * n_ctx * slots
    except (OSError, GgufError):
        return COMPUTE_MB  # the load will fail and say why; no reason to refuse it here
    return int((size + kv) / MIB) + COMPUTE_MB


def file_version(path: os.PathLike[str]) -> FileVersion:
    """What tells a replaced or rewritten file apart (a stat only: no read of a file that may block)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def why_not_loaded(name: str, entry: ModelEntry, error: Exception) -> str:
    """A failed load's reason: the file's own problem when its header shows one (llama.cpp's
    error only says it could not load the file), else the engine's."""
    if isinstance(error, RuntimeError):
        try:
            error = RuntimeError(read_header(entry.path).cut_short() or error)
        except (OSError, GgufError) as e:
            error = e
    return f"model {name!r} could not be loaded: {error}"


def give_back_heap() -> None:
    """Return the freed heap to the OS (glibc's malloc_trim): a model's buffers freed by llama.cpp
    otherwise stay in malloc's arenas, and the worker's RSS would not come back after an unload."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: its allocator decides
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@dataclass
class Loaded:
    """One model held by the shelf."""

    name: str
    pool: str
    engine: Backend
    memory_mb: int
    loaded_at: float  # wall clock
    load_seconds: float
    keep_alive: float  # seconds idle before it goes; FOREVER: never
    pinned: bool
    last_used: float = field(default_factory=time.monotonic)
    jobs: set[str] = field(default_factory=set)

    def expires_in(self, now: float) -> float | None:
        """Seconds until it is unloaded when idle; None: never."""
        if self.pinned or self.keep_alive == FOREVER:
            return None
        return self.keep_alive - (now - self.last_used)


class ModelShelf:
    """The Backend of a worker that serves catalogue models (worker/main.py builds it)."""

    def __init__(self, models: Mapping[str, ModelEntry], pools: Mapping[str, str], engine: EngineSettings,
                 make: Callable[[EngineSettings], Backend], budget_mb: int | None = None) -> None:
        self.name = engine.type
        self.entries = dict(models)
        self.pool_model = {pool: name for name, pool in pools.items()}
        self.base = engine
        self.make = make
        self.budget_mb = budget_mb or default_budget_mb()
        self.held: dict[str, Loaded] = {}  # model name -> loaded copy
        self.owner: dict[str, Loaded] = {}  # job id -> its model's copy
        self.load_ms: dict[str, float] = {}  # job id -> the load its start waited for
        self.settings = {name: self._settings_of(entry) for name, entry in self.entries.items()}
        self.slots = max(s.slots for s in self.settings.values())
        self.loads = 0
        self.unloads = 0
        self.proc = psutil.Process()
        self._needs: dict[str, tuple[FileVersion, int]] = {}  # model -> (its file then, its need)
        self._failed: dict[str, tuple[FileVersion, float, str]] = {}  # model -> (its file, when, why)
        self.on_fetch: Callable[[str, int, int], None] | None = None  # (model, bytes done, total)

    def adopt(self, models: Mapping[str, ModelEntry], pools: Mapping[str, str]) -> list[str]:
        """The catalogue changed live: serve `models` from now on. A model gone (or changed) is
        unloaded once idle; one with running jobs stays until they end (its names, to try again)."""
        kept = []
        for name in list(self.entries):
            if models.get(name) == self.entries[name] and pools.get(name) == self.entries[name].pool_of(name):
                continue
            held = self.held.get(name)
            if held is not None and held.jobs:
                kept.append(name)
                continue
            if held is not None:
                self.unload(name, "the catalogue changed")
            del self.entries[name], self.settings[name]
            self._needs.pop(name, None)
            self._failed.pop(name, None)
        for name, entry in models.items():
            if name not in self.entries:
                self.entries[name] = entry
                self.settings[name] = self._settings_of(entry)
        self.pool_model = {pools[n] if n in pools else e.pool_of(n): n for n, e in self.entries.items()}
        self.slots = max((s.slots for s in self.settings.values()), default=self.base.slots)
        return kept

    # -- what a model's copy is -------------------------------------------------------------------

    def _settings_of(self, entry: ModelEntry) -> EngineSettings:
        wanted = {"model_path": entry.path, "n_ctx_per_seq": entry.n_ctx_per_seq, "slots": entry.slots,
                  "chat_template_file": entry.chat_template_file}
        fields = type(self.base).model_fields
        return self.base.model_copy(update={k: v for k, v in wanted.items() if v is not None and k in fields})

    def need_mb(self, name: str) -> int:
        """The RAM a copy of `name` takes, estimated once per version of its file (reading a
        header takes a few hundred ms: not on every claim)."""
        entry, s = self.entries[name], self.settings[name]
        version = file_version(entry.path)
        known = self._needs.get(name)
        if known is None or known[0] != version:
            known = version, estimate_mb(entry, int(getattr(s, "n_ctx_per_seq", 0) or 0), s.slots)
            self._needs[name] = known
        return known[1]

    def used_mb(self) -> int:
        return sum(m.memory_mb for m in self.held.values())

    def model_of(self, queue: str) -> str:
        name = self.pool_model.get(queue.split(":", 1)[0])
        if name is None:
            raise JobRejected(f"queue {queue!r} is not a pool of this worker's models")
        return name

    # -- loading and unloading --------------------------------------------------------------------

    def room_mb(self, name: str) -> int:
        """The most RAM `name` could ever have here: the budget less what pinned models hold."""
        return self.budget_mb - sum(m.memory_mb for m in self.held.values() if m.pinned and m.name != name)

    def fits(self, name: str) -> bool:
        """Whether `name` could ever load here."""
        return self.need_mb(name) <= self.room_mb(name)

    def cannot_hold(self) -> dict[str, dict[str, Any]]:
        """pool -> the model, its need and this worker's room, for every model that could never
        load here: what the worker publishes, so that the gateway refuses a model no live worker
        could hold rather than leave its requests waiting."""
        return {pool: {"model": name, "need_mb": self.need_mb(name), "room_mb": self.room_mb(name)}
                for pool, name in self.pool_model.items() if not self.fits(name)}

    def can_load(self, name: str) -> bool:
        """Whether `name` fits in the budget now, counting what idle unpinned models would free."""
        if name in self.held:
            return True
        freeable = sum(m.memory_mb for m in self.held.values() if not m.pinned and not m.jobs)
        return self.need_mb(name) <= self.budget_mb - self.used_mb() + freeable

    def load(self, name: str) -> Loaded:
        if name in self.held:
            return self.held[name]
        entry = self.entries[name]
        failed = self._failed.get(name)
        if (failed is not None and failed[0] == file_version(entry.path)
                and time.monotonic() - failed[1] < FAILED_LOAD_HOLD):
            raise JobRejected(failed[2])
        if entry.url is not None and entry.sha256 is not None and not entry.path.exists():
            self._fetch(name, entry.url, entry.sha256, entry.path)
        need = self.need_mb(name)
        for victim in sorted(self.held.values(), key=lambda m: m.last_used):  # least recently used first
            if self.used_mb() + need <= self.budget_mb:
                break
            if not victim.pinned and not victim.jobs:
                self.unload(victim.name, "to make room for " + name)
        if self.used_mb() + need > self.budget_mb:
            raise BackendUnavailable(f"model {name!r} needs ~{need} MB; {self.used_mb()} of this worker's "
                                     f"{self.budget_mb} MB are held by models with running jobs or pinned")
        version = file_version(entry.path)
        rss, started = self.proc.memory_info().rss, time.monotonic()
        try:
            engine = self.make(self.settings[name])
        except (OSError, ValueError, RuntimeError) as e:
            why = why_not_loaded(name, entry, e)
            self._failed[name] = version, time.monotonic(), why
            raise JobRejected(why) from e
        took = time.monotonic() - started
        grown = int((self.proc.memory_info().rss - rss) / MIB)
        model = Loaded(name, entry.pool_of(name), engine, max(need, grown), time.time(), round(took, 3),
                       entry.keep_alive, entry.pinned)
        self.held[name] = model
        self._failed.pop(name, None)
        self.loads += 1
        log.info("loaded model %s in %.2fs (~%d MB)", name, took, model.memory_mb)
        return model

    def _fetch(self, name: str, url: str, sha256: str, path: Path) -> None:
        """The model's file from its URL into this host's cache (in the loop's thread: the
        worker's other streams pause for it, as for a load); a failure fails its jobs with why,
        held FAILED_LOAD_HOLD seconds like a failed load."""
        log.info("fetching model %s from its url into %s", name, path)
        started = time.monotonic()
        try:
            hook = self.on_fetch
            fetch(url, sha256, path, None if hook is None else functools.partial(hook, name))
        except (FetchError, OSError) as e:
            why = f"model {name!r} could not be fetched: {e}"
            self._failed[name] = file_version(path), time.monotonic(), why
            raise JobRejected(why) from e
        log.info("fetched model %s in %.1fs", name, time.monotonic() - started)

    def unload(self, name: str, why: str) -> None:
        self.held[name].engine.close()
        give_back_heap()
        del self.held[name]  # after: a status that no longer lists the model shows its RAM given back
        self.unloads += 1
        log.info("unloaded model %s (%s)", name, why)

    def unload_idle(self, now: float | None = None) -> list[str]:
        """Unload every model idle past its keep_alive; their names."""
        now = time.monotonic() if now is None else now
        gone = [m.name for m in self.held.values()
                if not m.jobs and (left := m.expires_in(now)) is not None and left <= 0]
        for name in gone:
            self.unload(name, "idle past its keep_alive")
        return gone

    def unload_asked(self, pool: str, at: float) -> None:
        """An operator unloaded the pool's model at `at` (wall clock): a copy loaded before goes
        now, or once its running jobs end."""
        model = self.held.get(self.pool_model.get(pool, ""))
        if model is None or model.loaded_at > at or model.pinned:
            return
        if model.jobs:
            model.keep_alive = 0.0
        else:
            self.unload(model.name, "an operator unloaded it")

    def load_pinned(self) -> None:
        for name, entry in self.entries.items():
            if entry.pinned:
                self.load(name)

    # -- the loop's side --------------------------------------------------------------------------

    def engine_for(self, queue: str) -> ModelView | Unloadable:
        """The engine of the model whose pool `queue` is, loaded now if it is not; a model that
        cannot load gives an engine refusing the job with the reason (the loop ends or requeues it
        as it does any job the engine refuses)."""
        loads = self.loads
        try:
            model = self.load(self.model_of(queue))
        except (JobRejected, BackendUnavailable) as e:
            log.warning("%s", e)
            return Unloadable(e)
        model.last_used = time.monotonic()
        return ModelView(self, model, model.load_seconds * 1000 if self.loads > loads else None)

    def free_slots(self) -> int:
        return self.slots - len(self.owner)

    def free_for(self, pool: str) -> int:
        """Free slots of the model whose pool this is: its copy's, or a fresh copy's if not loaded."""
        name = self.pool_model[pool]
        model = self.held.get(name)
        return model.engine.free_slots() if model is not None else self.settings[name].slots

    def holds(self, pool: str) -> bool:
        return self.pool_model.get(pool) in self.held

    def admit(self, job_id: str, request: GenerateRequest) -> None:
        raise JobRejected("a job for a catalogue model starts through its model's engine (engine_for)")

    def step(self, timeout: float) -> list[Event]:
        events: list[Event] = []
        busy = [m for m in self.held.values() if m.jobs]
        for model in busy:
            events.extend(model.engine.step(timeout / len(busy)))
        for ev in events:
            if isinstance(ev, Done) and ev.job_id in self.load_ms:  # its start loaded the model
                ev.extra["load_ms"] = self.load_ms.pop(ev.job_id)
            if isinstance(ev, Done | Failed) and ev.job_id in self.owner:
                self.load_ms.pop(ev.job_id, None)
                model = self.owner.pop(ev.job_id)
                model.jobs.discard(ev.job_id)
                model.last_used = time.monotonic()
        if not busy and timeout > 0:
            time.sleep(min(timeout, 0.01))
        return events

    def cancel(self, job_id: str) -> None:
        model = self.owner.get(job_id)
        if model is not None:
            model.engine.cancel(job_id)

    def probe(self) -> bool:
        return all(m.engine.probe() for m in self.held.values())

    def stats(self) -> dict[str, object]:
        now = time.monotonic()
        # read by the heartbeat thread while the loop loads and unloads: a copy taken at once
        return {"models": [self.described(m, now) for m in list(self.held.values())],
                "memory_budget_mb": self.budget_mb, "model_loads": self.loads, "model_unloads": self.unloads}

    def described(self, model: Loaded, now: float) -> dict[str, Any]:
        left = model.expires_in(now)
        return {"name": model.name, "pool": model.pool, "memory_mb": model.memory_mb,
                "loaded_at": round(model.loaded_at, 3), "load_seconds": model.load_seconds,
                "expires_at": None if left is None else round(time.time() + max(left, 0.0), 3),
                "running": len(model.jobs), "pinned": model.pinned,
                "context_length": int(getattr(self.settings[model.name], "n_ctx_per_seq", 0) or 0)}

    def close(self) -> None:
        for name in list(self.held):
            self.unload(name, "worker exiting")


class ModelView:
    """One loaded model's engine as the loop starts a job on it: the job is the shelf's to route."""

    def __init__(self, shelf: ModelShelf, model: Loaded, load_ms: float | None) -> None:
        self.shelf, self.model, self.engine, self.load_ms = shelf, model, model.engine, load_ms
        self.name, self.slots = model.engine.name, model.engine.slots
        self.embeds_only = shelf.entries[model.name].embedding
        if isinstance(self.engine, Embedder):  # only then is the view an Embedder
            self.embed_batch = self.engine.embed_batch
        if isinstance(self.engine, Scorer):  # only then is the view a Scorer
            self.score_batch = self.engine.score_batch

    def embed(self, texts: Sequence[str], truncate: Sequence[bool]) -> list[Embedding]:
        if self.model.name not in self.shelf.held or not isinstance(self.engine, Embedder):
            raise BackendUnavailable(f"model {self.model.name!r} was unloaded")  # the job goes again
        self.model.last_used = time.monotonic()
        return self.engine.embed(texts, truncate)

    def score(self, query: str, instruction: str, documents: Sequence[str]) -> Scores:
        if self.model.name not in self.shelf.held or not isinstance(self.engine, Scorer):
            raise BackendUnavailable(f"model {self.model.name!r} was unloaded")  # the job goes again
        if self.embeds_only:
            raise JobRejected(f"model {self.model.name!r} is an embedding model: it cannot judge documents")
        self.model.last_used = time.monotonic()
        return self.engine.score(query, instruction, documents)

    def _held(self, job_id: str) -> None:
        self.model.jobs.add(job_id)
        self.shelf.owner[job_id] = self.model
        if self.load_ms is not None:
            self.shelf.load_ms[job_id] = self.load_ms

    def admit(self, job_id: str, request: GenerateRequest) -> None:
        if self.embeds_only:
            raise JobRejected(f"model {self.model.name!r} is an embedding model: it embeds (/v1/embeddings, "
                              "/api/embed) and generates nothing")
        self.engine.admit(job_id, request)
        self._held(job_id)
        if request.keep_alive is not None:  # Ollama's rule: the last request's keep_alive holds
            self.model.keep_alive = request.keep_alive

    def resume(self, job_id: str, request: GenerateRequest, delivered: str) -> bool:
        resumed = (not self.embeds_only and isinstance(self.engine, Resumable)
                   and self.engine.resume(job_id, request, delivered))
        if resumed:
            self._held(job_id)
        return resumed

    def speaks(self, request: GenerateRequest) -> bool:
        return isinstance(self.engine, Bilingual) and self.engine.speaks(request)

    def text_op(self, request: TextRequest) -> dict[str, object]:
        if not isinstance(self.engine, TextOps):
            raise JobRejected(f"model {self.model.name!r}'s engine does not answer text jobs")
        return self.engine.text_op(request)

    def hold(self, job_id: str) -> None:
        """A text job of this model runs beside the loop (on the worker's text thread): the model
        is not unloaded under it. Called by the loop, as `release` is."""
        self.model.jobs.add(job_id)

    def release(self, job_id: str) -> None:
        self.model.jobs.discard(job_id)
        self.model.last_used = time.monotonic()


class Unloadable:
    """The engine of a model that could not be loaded: every job it is given fails with why (a
    bad file: JobRejected) or goes back to its queue (no room now: BackendUnavailable)."""

    embed_batch = score_batch = 1  # an embedding or rerank job fails (or goes back) with why, too

    def __init__(self, error: JobRejected | BackendUnavailable) -> None:
        self.error, self.name, self.slots = error, "unloaded", 0

    def admit(self, job_id: str, request: GenerateRequest) -> None:
        raise self.error

    def embed(self, texts: Sequence[str], truncate: Sequence[bool]) -> list[Embedding]:
        raise self.error

    def score(self, query: str, instruction: str, documents: Sequence[str]) -> Scores:
        raise self.error

    def resume(self, job_id: str, request: GenerateRequest, delivered: str) -> bool:
        return False

    def speaks(self, request: GenerateRequest) -> bool:
        return False

    def text_op(self, request: TextRequest) -> dict[str, object]:
        raise self.error
