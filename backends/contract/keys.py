"""Every Redis key, key prefix and hash field the fleet uses, in one place (table in
docs/ARCHITECTURE.md). RQ's own keys are named here too where the fleet reads or writes them
directly; they must match what RQ itself uses."""

from __future__ import annotations

from backends.contract.schema import DEFAULT_TENANT, PRIORITIES

# The one function a fleet job may name. Workers refuse (fail, never run) anything else.
JOB_FUNCTION = "dispatcher.jobs.generate"


def queue_name(pool: str, priority: str) -> str:
    """RQ queue name; RQ stores it at rq:queue:<pool>:<priority>."""
    return f"{pool}:{priority}"


def queue_names(pool: str) -> list[str]:
    """A pool's queues, highest priority first (the claim order)."""
    return [queue_name(pool, p) for p in PRIORITIES]


def tenant_queue_name(queue: str, tenant: str | None) -> str:
    """The RQ queue a tenant's jobs of pool queue `queue` wait in: that queue itself for the
    default tenant (and jobs naming none), `<queue>:<tenant>` for the others (claim.lua builds the
    same names)."""
    return queue if tenant in (None, DEFAULT_TENANT) else f"{queue}:{tenant}"


def pool_queue_of(origin: str, queues: list[str]) -> str:
    """The pool queue of a job whose RQ origin is `origin`: that queue, or the one whose tenant
    queue it is (`tenant_queue_name`'s inverse); the first of `queues` when none matches."""
    return next((q for q in queues if origin == q or origin.startswith(q + ":")), queues[0])


def fair_key(queue: str) -> str:
    """zset tenant -> virtual token counter of one priority queue's tenants with work (claim.lua's
    fair share, backends/contract/queue/fair.py; `<key>:clock` is the counter of the last pick).
    `queue`: the pool's own queue name."""
    return f"fleet:fair:{queue}"


def fair_spent_key(queue: str) -> str:
    """hash tenant -> the counter a tenant had when its work ran out (fair_key's), so a tenant
    that comes back never starts below what it was served: idle time earns no credit, and a
    short absence erases no debt."""
    return f"fleet:fair:{queue}:spent"


FAIR_TTL = 86400  # seconds the fair-share state outlives the last enqueue or claim
FAIR_NEWCOMER = -1  # a tenant's score as it joins a fair share: the claim lifts it (queue/fair.py)


# A tenant's admission state (dispatcher/tenants.py, tenant_admit.lua): zsets job id -> expiry (ms)
# of its jobs admitted and not ended, and admitted and not started; a hash per minute of requests
# admitted and tokens used (`<prefix>:<unix minute>`, TTL 120 s)
def tenant_open_key(tenant: str) -> str:
    return f"fleet:tenant:{tenant}:open"


def tenant_queued_key(tenant: str) -> str:
    return f"fleet:tenant:{tenant}:queued"


def tenant_rate_prefix(tenant: str) -> str:
    return f"fleet:tenant:{tenant}:rate"


# Usage: a hash per tenant and hour (`<hour>` = unix time // 3600) of requests, tokens, queue wait
# and refusals by limit, kept USAGE_TTL; the zset of tenants seen (tenant -> last hour)
def usage_prefix(tenant: str) -> str:
    return f"fleet:usage:{tenant}"


def usage_key(tenant: str, hour: int | str) -> str:
    """`hour`: unix time // 3600, or "total" (the same counts since the tenant was first seen:
    what Prometheus reads)."""
    return f"{usage_prefix(tenant)}:{hour}"


USAGE_TENANTS = "fleet:usage:tenants"
USAGE_TTL = 8 * 86400


# Spend: a hash per tenant and UTC day (`<day>` = unix time // 86400, Redis's clock) of the tokens
# of its ended jobs, what its budgets sum over a period; kept past the longest period (a calendar
# month, or 30 rolling days)
def spend_prefix(tenant: str, key: str | None = None) -> str:
    """`key`: one of the tenant's named keys (`gateway.tenants.<t>.keys`), whose own spend it is."""
    return f"fleet:spend:{tenant}" if key is None else f"fleet:spend:{tenant}:key:{key}"


SPEND_TTL = 33 * 86400

QUEUE_PREFIX = "rq:queue:"  # worker/claiming/claim.py's script strips these 9 characters to name the queue
RQ_WORKERS_SET = "rq:workers"  # RQ's set of registered worker keys
RQ_QUEUES_SET = "rq:queues"  # RQ's set of queue keys (every enqueue adds its queue)


def queue_key(name: str) -> str:
    return f"{QUEUE_PREFIX}{name}"


def job_key(job_id: str) -> str:
    return f"rq:job:{job_id}"


def started_registry_key(queue: str) -> str:
    """RQ's StartedJobRegistry (`wip`): executions of jobs now running."""
    return f"rq:wip:{queue}"


def finished_registry_key(queue: str) -> str:
    return f"rq:finished:{queue}"


def failed_registry_key(queue: str) -> str:
    return f"rq:failed:{queue}"


def canceled_registry_key(queue: str) -> str:
    return f"rq:canceled:{queue}"


def rq_worker_key(name: str) -> str:
    """RQ's worker hash (what `rq info` lists)."""
    return f"rq:worker:{name}"


def stream_key(job_id: str) -> str:
    """Token stream of one job (Redis Stream, capped, expires with the result)."""
    return f"fleet:stream:{job_id}"


def cancel_key(job_id: str) -> str:
    """Set by a producer to cancel a running job; the worker holding it checks every step."""
    return f"fleet:cancel:{job_id}"


WORKER_PREFIX = "fleet:worker:"


def worker_key(name: str) -> str:
    """Worker status hash; its TTL is the liveness signal (3 heartbeats)."""
    return f"{WORKER_PREFIX}{name}"


def worker_name_of(key: str) -> str:
    """The worker name in a status key (worker_key's inverse)."""
    return key[len(WORKER_PREFIX):]


def model_card_key(name: str) -> str:
    """A worker's model card (backends/model_card.py, JSON): written with its status, same TTL."""
    return f"fleet:model:{name}"


# hash pool -> unix time: pools an operator unloaded through Ollama's API (keep_alive 0), which the
# gateway's /api/ps leaves out until the pool's next request (the gateway deletes the field then)
UNLOADED_KEY = "fleet:unloaded"


def inflight_key(name: str) -> str:
    """Job ids a worker holds; claimed by atomic move so the reaper sees them if it dies."""
    return f"fleet:inflight:{name}"


WORKERS_SET = "fleet:workers"  # names of workers that registered (live or dead, until reaped)
REAPER_LOCK = "fleet:reaper:lock"


def wake_key(pool: str) -> str:
    """Producers LPUSH here after enqueueing so idle workers wake at once (they also poll)."""
    return f"fleet:wake:{pool}"


def worker_wake_key(pool: str, worker: str) -> str:
    """One worker's own wake-up: a claim that leaves a job to the worker holding its prefix
    pushes here (the queue model's placement.lua builds it), so an idle holder claims it at once
    rather than at its next poll. At most one token, TTL WORKER_WAKE_TTL."""
    return f"fleet:wake:{pool}:{worker}"


WORKER_WAKE_TTL = 10  # seconds


def capacity_key(pool: str) -> str:
    """hash worker name -> "free|slots|ms[|store]": each worker's free slots after its last claim
    (and when), so a claim takes only its share of a burst (claim.lua: balance), and the id of
    its KV store, if it has one (placement.lua: a busy holder's jobs go to its store's workers)."""
    return f"fleet:capacity:{pool}"


CAPACITY_LIVE_MS = 2000  # an entry older than this is a worker that is full, busy or gone


def has_room(entry: bytes | str | None, now_ms: int) -> bool:
    """Whether a capacity entry is a live worker with a free slot (placement.lua's has_room)."""
    if entry is None:
        return False
    parts = (entry.decode() if isinstance(entry, bytes) else entry).split("|")
    if len(parts) not in (3, 4) or not all(p.isdigit() for p in parts[:3]):
        return False
    free, at = int(parts[0]), int(parts[2])
    return free > 0 and now_ms - at <= CAPACITY_LIVE_MS
CAPACITY_TTL = 60  # seconds the hash outlives the pool's last claim


def model_copies_key(pool: str) -> str:
    """hash worker name -> JSON of its loaded copy of the pool's model (RAM, expiry, context,
    `until`: ms after which the entry is stale): who holds the model now, written by the holders'
    claims as they load, unload or every MODEL_HOLD_MS / 5 (worker/claiming/models.py); a worker
    that does not hold the model leaves its jobs to those that do. TTL MODEL_COPIES_TTL."""
    return f"fleet:copies:{pool}"


def model_loading_key(pool: str) -> str:
    """The worker loading the pool's model now (SET NX, PX three of its heartbeat intervals,
    extended by its heartbeat while it loads, released once the load is over, loaded or failed):
    a burst for a cold model loads it on one worker, not on every idle one, and a loader that
    dies keeps the others off it for no longer than it takes to look dead."""
    return f"fleet:loading:{pool}"


CATALOGUE_KEY = "fleet:catalogue"
"""hash model name -> JSON of its catalogue entry, or `null` for a config file's model deleted:
the catalogue's live changes (`/api/pull`, `/api/copy`, `/api/delete`, `fleet models`), over each
process's `models` setting (backends/contract/catalogue.py `live_models`). Configuration, kept
with no TTL like the config file it overrides; each entry goes with its model's delete."""


def model_fetch_key(pool: str) -> str:
    """hash of the pool's model's fetch on the worker fetching it now: `completed`, `total`
    (bytes), `worker`; what a pull streams as progress. TTL MODEL_FETCH_TTL, refreshed as bytes come."""
    return f"fleet:fetch:{pool}"


MODEL_FETCH_TTL = 30  # seconds
MODEL_COPIES_TTL = 10  # seconds
MODEL_HOLD_MS = 5000  # a copy's entry not refreshed this long is a worker that unloaded or died


def hub_wake_key(hub_id: str) -> str:
    """Private stream of one asyncio stream reader (dispatcher.stream_hub): an entry here ends
    its blocked XREAD so it starts over with a newly followed job. One entry, 60 s TTL."""
    return f"fleet:hub:{hub_id}"


# hash fields the fleet adds to RQ's job hash
ATTEMPT_FIELD = "fleet_attempt"  # restarts so far (the running attempt is this + 1)
DIED_ON_FIELD = "fleet_died_on"  # workers that died running the job, comma-separated
OWNER_FIELD = "fleet_owner"  # the worker whose in-flight list holds the job (set by the claim script)
FINAL_FIELD = "fleet_final"  # the attempt that got the job's final stream entry
DRAINS_FIELD = "fleet_drains"  # attempts handed back by a draining worker (not failures)
EXECUTION_FIELD = "fleet_execution"  # the RQ execution (rq:wip member) of the running attempt
# the worker whose engine is setting the job up in a step that could kill it (a grammar compile,
# the first constrained token); a worker that dies while named here fails the job, never re-runs it
SUSPECT_FIELD = "fleet_suspect"
# workers whose loop hung in this job's engine call (its admission, a step it was in) and were
# restarted, comma-separated; at POISON_HANGS the job fails instead of going to another worker
HUNG_FIELD = "fleet_hung"
# the producer's size of the job: "<prompt tokens> <max_tokens>" (0: not set), estimated
SIZE_FIELD = "fleet_size"
# what the job was charged to its tenant's fair share: "<weighted tokens> <tenant weight>" (the
# claim writes the estimate once, the ending the real usage: a job handed back is never charged twice)
CHARGED_FIELD = "fleet_charged"
POISON_HANGS = 2
ENQUEUED_MS_META = "fleet_enqueued_ms"  # job meta: Redis server time of the enqueue (ms)

OWNERS_SET = "fleet:owners"  # names of workers that claimed jobs: what the reaper looks at


def results_key(job_id: str) -> str:
    """RQ's result stream of one job."""
    return f"rq:results:{job_id}"


def execution_key(execution_id: str) -> str:
    """One RQ execution (an attempt's run record) of a job."""
    return f"rq:execution:{execution_id}"


def executions_key(job_id: str) -> str:
    """RQ's per-job execution registry."""
    return f"rq:executions:{job_id}"


# RQ registries of ended jobs, trimmed by the workers' housekeeping (scores are expiry times)
ENDED_REGISTRIES = (finished_registry_key(""), failed_registry_key(""), canceled_registry_key(""))


# -- batches (dispatcher/gateway/batch, docs/batch.md) ----------------------------------------------------
BATCH_JOB_PREFIX = "fbatch-"  # a job id "fbatch-<batch id>-<16 hex>" is one line of a batch
BATCHES_INDEX = "fleet:batches"  # zset batch id -> created_at (for `fleet batch list`), TTL refreshed


def batch_key(batch_id: str) -> str:
    """Hash: the batch's state, counts, timestamps and settings. TTL = window + retention."""
    return f"fleet:batch:{batch_id}"


def batch_lines_key(batch_id: str) -> str:
    """Hash: 16-hex line key -> that line's compact state (queued, or its result). Same TTL."""
    return f"fleet:batch:{batch_id}:lines"


def batch_lock_key(batch_id: str) -> str:
    """One submitter at a time per batch (PX, refreshed per chunk)."""
    return f"fleet:batch:{batch_id}:lock"


def file_key(file_id: str) -> str:
    """Hash: a file uploaded through the gateway's POST /v1/files (content + metadata), TTL."""
    return f"fleet:file:{file_id}"


def creator_files_key(creator: str) -> str:
    """Hash: file id -> bytes of the files a creator keeps now (per-creator upload limits).
    TTL: the newest file's."""
    return f"fleet:files:{creator}"


def tenant_batches_key(tenant: str) -> str:
    """Hash: a tenant's open batches (id -> created_at), whose lines count against its
    `max_batch_lines` (create.lua). TTL: the longest batch's."""
    return f"fleet:tenant:{tenant}:batches"


def open_batches_key(pool: str) -> str:
    """Hash: the pool's open batches (id -> created_at), whose lines count against a cap on queued
    batch lines (create.lua); ended ones leave it at the next creation. TTL: the longest batch's."""
    return f"fleet:batches:open:{pool}"


# -- observability (docs/observability.md): monotonic counters, histograms, bounded job history --

POOLS_SET = "fleet:pools"  # pools that have had a worker (so readers know which queues to show)


def pool_counters_key(pool: str) -> str:
    """Fleet-wide monotonic counters of a pool (HINCRBY only: never reset by a worker restart)."""
    return f"fleet:counters:pool:{pool}"


def worker_counters_key(name: str) -> str:
    """Monotonic counters of one worker name (a worker restarted under its name continues them)."""
    return f"fleet:counters:worker:{name}"


def histogram_key(metric: str, pool: str) -> str:
    """Bucket counts (one field per upper bound) and the sum of one histogram of a pool."""
    return f"fleet:hist:{metric}:{pool}"


def history_key(job_id: str) -> str:
    """One job's history: params (prompt shortened), attempts, restart reasons, ending, timings."""
    return f"fleet:history:{job_id}"


HISTORY_RECENT = "fleet:history:recent"  # zset job id -> last change time (capped)


def history_failed_key(queue: str) -> str:
    """Failed jobs of one queue, zset job id -> end time (capped); `fleet status` counts the last hour."""
    return f"fleet:history:failed:{queue}"
