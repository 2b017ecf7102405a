"""`fleet worker`: pin, load the model once, register with RQ, serve until SIGTERM/SIGINT
(or, with --burst, until no job is queued or in flight)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from pathlib import Path

from redis import Redis
from redis.exceptions import ResponseError
from rq.serializers import JSONSerializer
from rq.worker import Worker

from backends.base import Backend, Described
from backends.contract.catalogue import model_pools
from backends.contract.connect import server_version
from backends.contract.keys import RQ_WORKERS_SET, queue_names, worker_key
from backends.contract.retry import OUTAGE_ERRORS
from backends.contract.settings import EngineSettings
from backends.llamacpp_settings import LlamaCppSettings
from backends.model import cached_digest, default_model_path, file_digest
from backends.registry import engine_threads, make_backend
from backends.shelf import ModelShelf
from worker.assembly import job_hooks
from worker.claiming.models import ModelClaims
from worker.liveness.heartbeat import Heartbeat, clear_status, static_status
from worker.liveness.reaper import Reaper, recover_own
from worker.liveness.watchdog import Watchdog
from worker.machine.pinning import pin
from worker.machine.priority import starting_gently
from worker.redis_link import RedisLink
from worker.serving.burst import BurstSummary
from worker.serving.loop import FleetWorker
from worker.settings import FleetSettings

log = logging.getLogger("fleet.worker")


class WorkerNameTaken(Exception):
    pass


def default_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def run_worker(settings: FleetSettings, redis: Redis, *, burst: bool = False) -> BurstSummary | None:
    """Serve until SIGTERM/SIGINT; with `burst`, until no job is queued or in flight (then the
    summary of what ended is returned)."""
    name = settings.name or default_name()
    server_version(redis, settings.redis_url)  # an older Redis stops the worker before the model loads
    if redis.exists(worker_key(name)):
        raise WorkerNameTaken(f"a live worker named {name!r} is already registered; pick another --name")
    # pin before the model loads: llama.cpp's threads inherit the mask and the memory policy
    report = pin(settings.cpu_set(), settings.numa_node)
    start = contextlib.ExitStack()  # until it serves, it yields the CPU to serving workers
    start.enter_context(starting_gently(settings.start_nice))
    log.info("worker %s: %s", name, report.summary())
    threads = engine_threads(settings.backend) or len(os.sched_getaffinity(0))
    backend = serving_backend(settings, threads)
    log.info("worker %s: backend %s ready, %d slots, %d threads", name, backend.name, backend.slots, threads)

    pools = list(backend.pool_model) if isinstance(backend, ModelShelf) else [settings.pool]
    queues = [q for pool in pools for q in queue_names(pool)]
    # not prepared by RQ: that finds our address with CLIENT LIST, which the documented ACL user
    # (`-@dangerous`) may not run; CLIENT INFO names this connection's address as well
    rq_worker = Worker(queues, name=name, connection=redis, serializer=JSONSerializer, prepare_for_work=False)
    rq_worker.hostname, rq_worker.pid = socket.gethostname(), os.getpid()
    rq_worker.ip_address = _address(redis)
    _register_rq(rq_worker, redis)
    link = RedisLink()  # one view of Redis for the loop, the heartbeat and the reaper
    hooks = job_hooks(settings)  # what job writes carry besides their own: the loop's and the reaper's
    reaper = Reaper(redis, name, settings.max_attempts, settings.result_ttl, link=link,
                    hold_off=settings.silent_for_dead, queues=queues, hooks=hooks)
    recover_own(redis, name, reaper)

    fw = FleetWorker(settings, backend, redis, name, link, hooks=hooks)
    if isinstance(fw.claims, ModelClaims):
        pools = fw.claims.pools  # the same list: the status shows the pools a live catalogue change gives
    fw.install_signal_handlers()
    card = model_card(backend, settings.backend)
    capabilities = (card or {}).get("capabilities")
    static = static_status(name, settings, backend.name, backend.slots,
                           {"threads": threads, **report.to_dict()},
                           model=str((card or {}).get("name") or ""), pools=pools,
                           thinks=isinstance(capabilities, list) and "thinking" in capabilities)
    hb = Heartbeat(fw, rq_worker, reaper, static, card)
    hb.beat()  # visible before the first job
    hb.start()
    watchdog = Watchdog(hb)  # a loop stuck in one engine call past stall_limit: the process goes
    watchdog.start()
    if card is not None and not card.get("digest"):
        learn_digest(hb, card, settings.backend)
    fw.claimer.require_live = True  # from now on a claim needs the status key the heartbeat keeps
    start.close()
    summary = None
    try:
        if burst:
            summary = fw.run_until_idle()
        else:
            fw.run()
    finally:
        watchdog.halt()
        hb.halt()
        hb.join(timeout=5)
        fw.requeue_all("worker exiting")
        with contextlib.suppress(*OUTAGE_ERRORS):  # Redis away: our key expires, the reaper cleans up
            fw.claims.forget()
            rq_worker.register_death()
            clear_status(redis, name)
        fw.texts.close()  # its thread may still read the engine's vocabulary
        backend.close()
        c = fw.counters
        log.info("worker %s: stopped (%d done, %d failed)", name, c.jobs_done, c.jobs_failed)
    return summary


def serving_backend(settings: FleetSettings, threads: int) -> Backend:
    """The worker's engine: its `backend`'s model, or a shelf of the catalogue's models it serves
    (backends/shelf.py), with its pinned ones loaded."""
    served = settings.catalogue_served()
    if not served:
        return make_backend(settings.backend, threads=threads)
    pools = model_pools(settings.models)
    shelf = ModelShelf({m: settings.models[m] for m in served}, {m: pools[m] for m in served},
                       settings.backend, lambda engine: make_backend(engine, threads=threads),
                       settings.memory_budget_mb)
    shelf.load_pinned()
    return shelf


def model_card(backend: object, engine: EngineSettings) -> dict[str, object] | None:
    """The engine's model card for Ollama's /api/show, /api/tags and /api/ps, when it can describe
    its model (a card that fails to build is only logged: it is no reason to stop serving), with
    what the worker's settings add: the tokens one job may hold, the file's digest if known."""
    described = getattr(backend, "inner", backend)  # backend.overlap wraps the engine
    if not isinstance(described, Described):
        return None
    try:
        card = dict(described.model_card())
    except Exception:
        log.exception("the engine could not describe its model; /api/show gets no details")
        return None
    if isinstance(engine, LlamaCppSettings):
        card["context_length"] = engine.n_ctx_per_seq
    path = model_file(engine)
    if path is not None and not card.get("digest"):
        card["digest"] = cached_digest(path) or ""
    return card


def model_file(engine: EngineSettings) -> Path | None:
    """The GGUF file the in-process engine runs (None for the HTTP engines)."""
    if not isinstance(engine, LlamaCppSettings):
        return None
    try:
        return engine.model_path or default_model_path()  # the engine has loaded it: no assembly here
    except OSError:
        return None


def learn_digest(hb: Heartbeat, card: dict[str, object], engine: EngineSettings) -> None:
    """Read the model file's sha256 on a thread (a large file takes seconds; the worker serves
    meanwhile) and publish the card with it; cached, so only a worker's first start on a file
    reads it."""
    path = model_file(engine)
    if path is None:
        return

    def digest() -> None:
        try:
            hb.publish_card({**card, "digest": file_digest(path)})
        except OSError as e:
            log.warning("cannot read the model file's digest (%s): listings show none", e)

    threading.Thread(target=digest, name="fleet-model-digest", daemon=True).start()


def _address(redis: Redis) -> str:
    """This client's address as Redis sees it (what RQ records as the worker's ip_address)."""
    try:
        return str(redis.client_info().get("addr") or "unknown")
    except ResponseError:
        return "unknown"


def _register_rq(rq_worker: Worker, redis: Redis) -> None:
    """Register the RQ way (so `rq info` lists us); a stale key from a killed namesake is cleared."""
    if redis.exists(rq_worker.key):
        with redis.pipeline() as pipe:
            pipe.delete(rq_worker.key)
            pipe.srem(RQ_WORKERS_SET, rq_worker.key)
            pipe.execute()
    rq_worker.register_birth()
