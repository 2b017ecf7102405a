"""Prometheus metrics, read from Redis on every scrape by one custom Collector (no state in the
exporter: any number of exporters / gateways show the same numbers, and a restarted worker never
makes a counter go backwards because counters live in Redis, written with HINCRBY).

Serve with `fleet metrics --port 9400`, or mount `metrics_route(redis, pool)` (a Starlette
Route) / `metrics_app(redis, pool)` (plain ASGI) in the gateway at GET /metrics. A scrape is one
plan (`scrape_plan`, dispatcher/plans.py): the sync collector runs it on a sync client, the route
on whichever client it is given (the gateway's async one).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import make_asgi_app, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector, CollectorRegistry
from redis import Redis

from backends.contract import observe_schema
from backends.contract.keys import histogram_key
from dispatcher.observe import snapshot
from dispatcher.plans import ClientSource, Plan, cmd, gather, run, run_on
from dispatcher.tenants import LIMIT_NAMES, Usage, totals_plan

P = "llama_fleet_"
# every metric family this exporter writes (the Grafana dashboard test checks against the output)
COUNTERS = {
    "tokens_generated": ("Tokens generated (completion tokens of ended jobs)", observe_schema.TOKENS),
    "prompt_tokens": ("Prompt tokens of ended jobs", observe_schema.PROMPT_TOKENS),
    "cached_prompt_tokens": ("Prompt tokens of ended jobs found in the KV cache (not prefilled)",
                             observe_schema.CACHED_TOKENS),
    "kv_store_restores": ("Ended jobs whose prompt's KV was read from the host's KV store",
                          observe_schema.STORE_RESTORES),
    "kv_store_restored_tokens": ("Prompt tokens of ended jobs read from the host's KV store (of the cached)",
                                 observe_schema.STORE_RESTORED_TOKENS),
    "kv_store_restore_milliseconds": ("Milliseconds ended jobs spent reading their KV from the store",
                                      observe_schema.STORE_RESTORE_MS),
    "jobs_reaped": ("Jobs recovered from dead workers (requeued or failed for good)", observe_schema.REAPED),
    "worker_starts": ("Worker processes started (restarts included)", observe_schema.STARTS),
}


TENANT_COUNTERS = [  # usage field, metric name, help
    ("requests", "requests", "Jobs of a tenant that ended"),
    ("prompt_tokens", "prompt_tokens", "Prompt tokens of a tenant's ended jobs"),
    ("completion_tokens", "completion_tokens", "Completion tokens of a tenant's ended jobs"),
    ("cached_tokens", "cached_prompt_tokens", "Prompt tokens of a tenant's ended jobs found in the KV cache"),
    ("failed", "jobs_failed", "A tenant's jobs that failed"),
    ("queue_ms", "queue_wait_seconds", "Seconds a tenant's ended jobs waited in the queue"),
    ("over_budget", "over_budget_requests", "Requests of a tenant served past a soft budget"),
]


@dataclass
class PoolReading:
    pool: str
    queues: list[dict[str, Any]]
    counters: dict[str, int]
    workers: list[dict[str, Any]]
    histograms: dict[str, dict[str, Any]]


@dataclass
class Scrape:
    pools: list[PoolReading]
    tenants: Usage  # tenant -> counts since first seen


def scrape_plan(default_pool: str) -> Plan[Scrape]:
    """Workers, queues, counters and histograms of every known pool; every tenant's usage."""
    pools = yield from snapshot.pools_plan(default_pool)
    everyone = yield from snapshot.workers_plan(with_counters=True, include_dead=True)
    out = []
    for pool in pools:
        counters = yield from snapshot.pool_counters_plan(pool)
        queues = yield from snapshot.queues_plan(pool)
        replies = yield from gather([cmd("hgetall", histogram_key(m, pool))
                                     for m in observe_schema.HISTOGRAMS])
        histograms = {m: {(k.decode() if isinstance(k, bytes) else k): v for k, v in raw.items()}
                      for m, raw in zip(observe_schema.HISTOGRAMS, replies, strict=True)}
        ws = [w for w in everyone if w.get("pool", default_pool) == pool]
        out.append(PoolReading(pool, queues, counters, ws, histograms))
    tenants = yield from totals_plan()
    return Scrape(out, tenants)


def metric_families(scrape: Scrape) -> list[Metric]:
    families = Families()
    for r in scrape.pools:
        families.add_pool(r.pool, r.queues, r.counters)
        families.add_workers(r.pool, r.workers)
        families.add_histograms(r.pool, r.histograms)
    families.add_tenants(scrape.tenants)
    return list(families.all())


class FleetCollector(Collector):
    """Reads every known pool on each collect() (a sync client)."""

    def __init__(self, redis: Redis, pool: str) -> None:
        self.redis = redis
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        yield from metric_families(run(self.redis, scrape_plan(self.pool)))


class Scraped(Collector):
    """Metrics already read (one exposition of an async scrape)."""

    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        yield from self.metrics


class Families:
    """The metric families of one scrape, filled pool by pool."""

    def __init__(self) -> None:
        w = ["pool", "worker"]
        self.counters = {name: CounterMetricFamily(P + name, doc, labels=["pool"])
                         for name, (doc, _field) in COUNTERS.items()}
        self.jobs = CounterMetricFamily(P + "jobs", "Jobs ended, by outcome", labels=["pool", "outcome"])
        self.restarts = CounterMetricFamily(P + "job_restarts", "Job attempts lost and run again, by reason",
                                            labels=["pool", "reason"])
        self.worker_tokens = CounterMetricFamily(P + "worker_tokens_generated",
                                                 "Tokens generated by a worker name", labels=w)
        self.worker_jobs = CounterMetricFamily(P + "worker_jobs", "Jobs ended by a worker name, by outcome",
                                               labels=[*w, "outcome"])
        q = ["pool", "priority"]
        self.depth = GaugeMetricFamily(P + "queue_depth", "Jobs waiting", labels=q)
        self.oldest = GaugeMetricFamily(P + "queue_oldest_age_seconds", "Age of the oldest waiting job",
                                        labels=q)
        self.running = GaugeMetricFamily(P + "jobs_running", "Jobs running (RQ started registry)", labels=q)
        self.failed_1h = GaugeMetricFamily(P + "jobs_failed_last_hour", "Jobs failed in the last hour",
                                           labels=q)
        self.up = GaugeMetricFamily(P + "worker_up", "1 while the worker's heartbeat is fresh", labels=w)
        self.busy = GaugeMetricFamily(P + "slots_busy", "Jobs a worker holds", labels=w)
        self.slots = GaugeMetricFamily(P + "slots", "Sequences a worker decodes together", labels=w)
        self.tok_s = GaugeMetricFamily(P + "worker_tokens_per_second", "Recent tokens per second",
                                       labels=[*w, "phase"])
        self.cpu = GaugeMetricFamily(P + "worker_cpu_percent", "Worker process CPU %", labels=w)
        self.rss = GaugeMetricFamily(P + "worker_rss_bytes", "Worker process resident memory", labels=w)
        self.started = GaugeMetricFamily(P + "worker_start_time_seconds", "Unix time the worker started",
                                         labels=w)
        self.store_writes = CounterMetricFamily(
            P + "kv_store_entries", "KV store entries a worker process wrote, dropped (queue full), failed "
            "to write (disk), evicted (budget) or removed as bad, since it started", labels=[*w, "outcome"])
        self.store_bytes = CounterMetricFamily(P + "kv_store_written_bytes",
                                               "Bytes of KV store entries a worker process wrote", labels=w)
        self.health = GaugeMetricFamily(P + "backend_healthy",
                                        "1 ok, 0.5 degraded (serving from a fallback), 0 down",
                                        labels=[*w, "backend"])
        self.tenant_counters = {
            field: CounterMetricFamily(P + f"tenant_{name}", doc, labels=["tenant"])
            for field, name, doc in TENANT_COUNTERS}
        self.tenant_rejected = CounterMetricFamily(P + "tenant_rejected", "Requests a tenant limit refused",
                                                   labels=["tenant", "limit"])
        self.histograms = {
            "queue_wait": HistogramMetricFamily(P + "queue_wait_seconds", "Enqueue to first claim",
                                                labels=["pool"]),
            "ttft": HistogramMetricFamily(P + "ttft_seconds", "Claim to first token", labels=["pool"]),
            "job_duration": HistogramMetricFamily(P + "job_duration_seconds", "Claim to end of a job",
                                                  labels=["pool"]),
        }

    def add_pool(self, pool: str, queues: list[dict[str, Any]], counters: dict[str, int]) -> None:
        for name, (_doc, field) in COUNTERS.items():
            self.counters[name].add_metric([pool], counters.get(field, 0))
        for outcome in observe_schema.OUTCOMES:
            self.jobs.add_metric([pool, outcome], counters.get(observe_schema.jobs_field(outcome), 0))
        for kind in observe_schema.RESTART_KINDS:
            self.restarts.add_metric([pool, kind], counters.get(observe_schema.restarts_field(kind), 0))
        for q in queues:
            labels = [pool, q["priority"]]
            self.depth.add_metric(labels, q["depth"])
            self.oldest.add_metric(labels, q["oldest_age_s"] or 0.0)
            self.running.add_metric(labels, q["running"])
            self.failed_1h.add_metric(labels, q["failed_1h"])

    def add_workers(self, pool: str, workers: list[dict[str, Any]]) -> None:
        for w in workers:
            labels = [pool, str(w["name"])]
            self.up.add_metric(labels, 1 if w["up"] else 0)
            counters = w.get("counters") or {}
            self.worker_tokens.add_metric(labels, counters.get(observe_schema.TOKENS, 0))
            for outcome in observe_schema.OUTCOMES:
                self.worker_jobs.add_metric([*labels, outcome],
                                            counters.get(observe_schema.jobs_field(outcome), 0))
            if not w["up"]:
                continue
            self.busy.add_metric(labels, float(w.get("inflight") or 0))
            self.slots.add_metric(labels, float(w.get("slots") or 0))
            self.tok_s.add_metric([*labels, "decode"], float(w.get("tok_s") or 0))
            self.tok_s.add_metric([*labels, "prefill"], float(w.get("tok_s_prefill") or 0))
            self.cpu.add_metric(labels, float(w.get("cpu_pct") or 0))
            self.rss.add_metric(labels, float(w.get("rss_mb") or 0) * 2**20)
            self.started.add_metric(labels, float(w.get("started_at") or 0))
            health = {"ok": 1.0, "degraded": 0.5}.get(str(w.get("backend_health") or "ok"), 0.0)
            self.health.add_metric([*labels, str(w.get("backend", ""))], health)
            stats = w.get("backend_stats") or {}
            if "store_written" in stats:  # an engine with a KV store
                for outcome in observe_schema.STORE_WRITE_OUTCOMES:
                    count = float(stats.get(f"store_{outcome}") or 0)
                    self.store_writes.add_metric([*labels, outcome], count)
                self.store_bytes.add_metric(labels, float(stats.get("store_written_bytes") or 0))

    def add_tenants(self, usage: Usage) -> None:
        for tenant, counts in usage.items():
            for field, family in self.tenant_counters.items():
                family.add_metric([tenant], counts.get(field, 0) / (1000 if field == "queue_ms" else 1))
            for limit in LIMIT_NAMES:
                self.tenant_rejected.add_metric([tenant, limit], counts.get(f"rejected_{limit}", 0))

    def add_histograms(self, pool: str, raw: dict[str, dict[str, Any]]) -> None:
        for metric, family in self.histograms.items():
            buckets, total = observe_schema.cumulative_buckets(metric, raw.get(metric, {}))
            family.add_metric([pool], buckets, total)

    def all(self) -> Iterator[Metric]:
        yield from self.counters.values()
        yield from (self.jobs, self.restarts, self.worker_tokens, self.worker_jobs, self.depth,
                    self.oldest, self.running, self.failed_1h, self.up, self.busy, self.slots, self.tok_s,
                    self.cpu, self.rss, self.started, self.health, self.store_writes, self.store_bytes)
        yield from self.tenant_counters.values()
        yield self.tenant_rejected
        yield from self.histograms.values()


def registry(redis: Redis, pool: str) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FleetCollector(redis, pool))
    return reg


def metrics_app(redis: Redis, pool: str) -> Any:
    """A plain ASGI app answering GET with the exposition (OpenMetrics when asked for)."""
    return make_asgi_app(registry(redis, pool))


def metrics_route(redis: ClientSource, pool: str, path: str = "/metrics") -> Any:
    """A Starlette Route for the gateway: `routes.append(metrics_route(redis, pool))`, on a sync or
    an async client (or a callable returning one). Sync reads and the encoding run in Starlette's
    thread pool, off the event loop."""
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def endpoint(request: Request) -> Response:
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        reg = CollectorRegistry(auto_describe=False)
        reg.register(Scraped(metric_families(await run_on(redis, scrape_plan(pool)))))
        body = await run_in_threadpool(encoder, reg)
        return Response(body, media_type=content_type)

    return Route(path, endpoint, methods=["GET"])


def serve(redis: Redis, pool: str, host: str, port: int) -> None:
    """`fleet metrics`: prometheus_client's own HTTP server, until interrupted."""
    import threading

    server, thread = start_http_server(port, addr=host, registry=registry(redis, pool))
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.shutdown()
        thread.join(timeout=5)
