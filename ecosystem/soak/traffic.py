"""The randomized client mix: several client threads, each with its own seeded random source,
sending what users send (kinds.py) as random tenants at random priorities to random gateways,
until told to stop. Every request is recorded (client.py); batches are remembered for the checks.

The choice of kinds, tenants, priorities and gateways is a function of the seed and the client's
number; when the answers come depends on the fleet, so two runs of one seed send the same mix,
not the same timeline.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from redis import Redis

from backends.contract.keys import OWNER_FIELD, job_key
from backends.contract.replies import as_str
from ecosystem.soak.client import Call, Clock, Record, send
from ecosystem.soak.kinds import Kinds
from ecosystem.soak.plan import DEFAULT_TENANT, SoakPlan, named_tenants, tenant_key

KIND_WEIGHTS = {
    "chat": 10, "chat_stream": 10, "completion": 5, "completion_stream": 5, "ollama_chat": 6, "responses": 6,
    "tools": 5, "structured": 5, "embeddings": 4, "multiturn": 5, "long_stream": 5, "batch": 2,
    "cancel_mid_stream": 3, "cancel_early": 3, "client_timeout": 2, "gateway_timeout": 2, "bad_input": 6,
    "hostile_input": 2,
}
TENANT_WEIGHTS = {DEFAULT_TENANT: 3, **{t: 2 for t in named_tenants()}}


@dataclass
class BatchRef:
    id: str
    tenant: str
    gateway: int
    lines: int
    cancelled: bool = False


class Traffic:
    def __init__(self, plan: SoakPlan, urls: Callable[[int], str], deadlines: Callable[[int], float],
                 redis: Callable[[], Redis], clock: Clock, phase: str) -> None:
        self.plan = plan
        self.urls = urls  # gateway index -> base URL
        self.deadlines = deadlines  # gateway index -> a client's deadline there
        self.redis = redis
        self.clock = clock
        self.phase = phase
        self.kinds = Kinds(plan.fake)
        self.records: list[Record] = []
        self.batches: list[BatchRef] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ids = 0

    # -- recording ------------------------------------------------------------------------------------

    def new_record(self, call: Call, client: int, gateway: int) -> Record:
        with self._lock:
            self._ids += 1
            record = Record(self._ids, client, call.kind, call.tenant, gateway, call.priority,
                            call.stream is not None, started=self.clock.now())
            self.records.append(record)
        return record

    def run(self, http: httpx.Client, call: Call, gateway: int, client: int,
            on_headers: Callable[[Record], bool] | None = None) -> Record:
        record = self.new_record(call, client, gateway)
        if call.leave == "after_headers" and on_headers is None:
            on_headers = self.leave_if_queued
        return send(http, self.urls(gateway), call, record, self.clock, self.deadlines(gateway), on_headers)

    def leave_if_queued(self, record: Record) -> bool:
        """A cancel's moment: notes whether its job is still queued, then leaves (always)."""
        record.queued_when_left = self.queued(record.job_ids[0]) if record.job_ids else None
        return True

    def queued(self, job_id: str) -> bool | None:
        with contextlib.suppress(Exception):
            status, owner = self.redis().hmget(job_key(job_id), ["status", OWNER_FIELD])
            return as_str(status) == "queued" and not as_str(owner)
        return None

    def spawn(self, call: Call, gateway: int, on_headers: Callable[[Record], bool] | None = None,
              client: int = -1) -> tuple[Record, threading.Thread]:
        """One request on its own thread (the fault scenarios' requests), recorded like any: its
        record (filled as the answer comes) and its thread."""
        record = self.new_record(call, client, gateway)
        if call.leave == "after_headers" and on_headers is None:
            on_headers = self.leave_if_queued

        def go() -> None:
            with httpx.Client() as http:
                send(http, self.urls(gateway), call, record, self.clock, self.deadlines(gateway), on_headers)

        thread = threading.Thread(target=go, daemon=True, name=f"soak-{call.kind}")
        thread.start()
        return record, thread

    # -- the clients ----------------------------------------------------------------------------------

    def start(self) -> None:
        for i in range(self.plan.clients):
            t = threading.Thread(target=self._client, args=(i,), daemon=True, name=f"soak-client-{i}")
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float) -> list[str]:
        """Wait for the clients to finish their last request; the names of any still running."""
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        return [t.name for t in self._threads if t.is_alive()]

    def _client(self, index: int) -> None:
        rng = random.Random(f"{self.plan.seed}:{self.phase}:client:{index}")
        hostile = itertools.count(index)  # the cases a client sends in turn, client i from the i-th
        with httpx.Client() as http:
            kind: str | None = "hostile_input"  # each client opens with one: a short run meets every case
            while not self._stop.is_set():
                kind = kind or rng.choices(list(KIND_WEIGHTS), weights=list(KIND_WEIGHTS.values()))[0]
                tenant = rng.choices(list(TENANT_WEIGHTS), weights=list(TENANT_WEIGHTS.values()))[0]
                gateway = rng.randrange(self.plan.gateways)
                try:
                    self._one(http, rng, kind, tenant, gateway, index, hostile)
                except Exception as e:  # a bug of the soak's own: recorded, the client goes on
                    call = Call(kind, tenant, None, "")
                    record = self.new_record(call, index, gateway)
                    record.outcome, record.exception = "soak_error", f"{type(e).__name__}: {e}"
                kind = None
                self._stop.wait(rng.uniform(0.0, 0.3))

    def _one(self, http: httpx.Client, rng: random.Random, kind: str, tenant: str, gateway: int,
             client: int, hostile: Iterator[int]) -> None:
        k = self.kinds
        if kind == "multiturn":
            self._conversation(http, rng, tenant, gateway, client)
        elif kind == "batch":
            self._batch(http, rng, tenant, gateway, client)
        elif kind == "gateway_timeout":
            call = k.gateway_timeout(rng, tenant, self.plan.short_timeout)
            self.run(http, call, 1 % self.plan.gateways, client)
        else:
            builders: dict[str, Callable[[], Call]] = {
                "chat": lambda: k.chat(rng, tenant),
                "chat_stream": lambda: k.chat(rng, tenant, stream=True, kind="chat_stream"),
                "completion": lambda: k.completion(rng, tenant),
                "completion_stream": lambda: k.completion(rng, tenant, stream=True),
                "ollama_chat": lambda: k.ollama_chat(rng, tenant),
                "responses": lambda: k.responses(rng, tenant),
                "tools": lambda: k.tools(rng, tenant),
                "structured": lambda: k.structured(rng, tenant),
                "embeddings": lambda: k.embeddings(rng, tenant),
                "long_stream": lambda: k.long_stream(rng, tenant),
                "cancel_mid_stream": lambda: k.cancel_mid_stream(rng, tenant),
                "cancel_early": lambda: k.cancel_early(rng, tenant),
                "client_timeout": lambda: k.client_timeout(rng, tenant),
                "bad_input": lambda: k.bad_input(rng, tenant),
                "hostile_input": lambda: k.hostile_input(tenant, next(hostile)),
            }
            self.run(http, builders[kind](), gateway, client)

    def _conversation(self, http: httpx.Client, rng: random.Random, tenant: str, gateway: int,
                      client: int) -> None:
        """Two to four turns, each with the whole history so far (placement sends it back to the
        worker holding its prefix)."""
        history: list[dict[str, str]] = []
        for _ in range(rng.randint(2, 4)):
            call = self.kinds.turn(rng, tenant, history)
            record = self.run(http, call, gateway, client)
            if record.outcome != "ok" or record.body is None:
                return
            answer = str(((record.body.get("choices") or [{}])[0].get("message") or {}).get("content") or "")
            history = [*call.body["messages"], {"role": "assistant", "content": answer}]

    def _batch(self, http: httpx.Client, rng: random.Random, tenant: str, gateway: int, client: int) -> None:
        """Upload a file and create a batch from it through the gateway, as the tenant; now and then
        cancel it a moment later."""
        lines = rng.randint(3, 8)
        key = tenant_key(tenant)
        upload = Call("batch_upload", tenant, key, "/v1/files", data={"purpose": "batch"},
                      files={"file": ("soak.jsonl", self.kinds.batch_lines(rng, lines))})
        up = self.run(http, upload, gateway, client)
        if up.outcome != "ok" or not up.object_id:
            return
        body: dict[str, Any] = {"input_file_id": up.object_id, "endpoint": "/v1/chat/completions",
                                "completion_window": "24h"}
        made = self.run(http, Call("batch_create", tenant, key, "/v1/batches", body), gateway, client)
        if made.outcome != "ok" or not made.object_id:
            return
        batch = BatchRef(made.object_id, tenant, gateway, lines)
        with self._lock:
            self.batches.append(batch)
        if rng.random() < 0.35:
            self._stop.wait(rng.uniform(0.0, 1.5))
            cancel = Call("batch_cancel", tenant, key, f"/v1/batches/{batch.id}/cancel")
            if self.run(http, cancel, gateway, client).outcome == "ok":
                batch.cancelled = True
