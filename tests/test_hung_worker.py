"""A chat template that runs away on a real fleet: three real `fleet worker` processes on the
embedded model, a real `fleet serve`, and a test-side supervisor that starts again any worker that
exits (what PM2, supervisord, systemd and Kubernetes do). The catalogue holds two models from the
embedded file: `plain` (its own template) and `hostile`, whose template renders harmlessly for the
load-time probes and spins on chats of 7+ messages (a bounded scan of 4 MB per step, a million
steps: five minutes without the render budget).

With the defaults the render budget stops it at MAX_RENDER_SECONDS: a clear 422 in the first
attempt, no worker lost. With `stall_limit` below that (3 s), the same template is a hung loop: the
watchdog takes each worker it reaches down (exit 70), the supervisor starts it again, and the job
that hung two of them fails as poison instead of going to a third; `plain` answers throughout.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from redis import Redis

from backends.contract.keys import DIED_ON_FIELD, HUNG_FIELD, OWNER_FIELD, job_key, worker_key
from backends.contract.replies import as_str
from backends.model import default_model_path
from dispatcher import Fleet, JobFailed
from tests.harness import WorkerProcess, start_worker, wait_for
from tests.lossy import inproc_worker, run_until
from tests.reliability_checks import final_entries
from worker.liveness.reaper import Reaper
from worker.liveness.watchdog import MARK_HUNG, Watchdog

pytestmark = pytest.mark.timeout(600)
HOSTILE_TEMPLATE = (
    "{%- if messages | length > 6 %}{% set s = 'x' * 4000000 %}{% for i in range(99) %}"
    "{% for j in range(10000) %}{% if 'y' in s %}{% endif %}{% endfor %}{% endfor %}{% endif %}"
    "{%- for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}"
    "{%- if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
LONG_CHAT = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(8)]
STALL_LIMIT = 3.0
PAUSE_BOUND = 0.25  # seconds: streams on workers that did not hang


class Supervisor(threading.Thread):
    """Starts again, under its name, any worker that exits; notes when and how it exited and when
    its next life registered."""

    def __init__(self, redis_url: str, logs: Path, settings: dict[str, Any]) -> None:
        super().__init__(name="test-supervisor", daemon=True)
        self.redis_url, self.logs, self.settings = redis_url, logs, settings
        self.procs: dict[str, WorkerProcess] = {}
        self.exits: list[dict[str, Any]] = []
        self.lives: list[WorkerProcess] = []
        self.halted = threading.Event()

    def launch(self, name: str, *, wait: bool = True) -> WorkerProcess:
        life = sum(1 for w in self.lives if w.name == name)
        w = start_worker(self.redis_url, name, self.logs / f"life{life}", wait=wait, **self.settings)
        self.procs[name] = w
        self.lives.append(w)
        return w

    def run(self) -> None:
        redis = Redis.from_url(self.redis_url)
        while not self.halted.wait(0.05):
            for name, w in list(self.procs.items()):
                if not w.alive():
                    self.exits.append({"name": name, "code": w.process.returncode, "at": time.monotonic(),
                                       "log": w.output()})
                    self.launch(name, wait=False)
            for ex in self.exits:
                if "registered" not in ex and redis.exists(worker_key(ex["name"])):
                    ex["registered"] = time.monotonic()

    def close(self) -> None:
        self.halted.set()
        if self.is_alive():
            self.join(5)
        for w in self.lives:
            if w.alive():
                w.kill()


@pytest.fixture
def catalogue(tmp_path: Path) -> dict[str, dict[str, Any]]:
    template = tmp_path / "hostile.jinja"
    template.write_text(HOSTILE_TEMPLATE)
    model = str(default_model_path())
    return {"plain": {"path": model, "pinned": True, "slots": 2},
            "hostile": {"path": model, "chat_template_file": str(template), "slots": 1}}


class Streams(threading.Thread):
    """Chat streams for `plain`, one after another, until stopped: each one's job, status, longest
    pause between two pieces of text, and whether it finished."""

    def __init__(self, url: str) -> None:
        super().__init__(name="test-streams", daemon=True)
        self.url = url
        self.done: list[dict[str, Any]] = []
        self.halted = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as http:
            while not self.halted.is_set():
                self.done.append(self.one(http))

    def one(self, http: httpx.Client) -> dict[str, Any]:
        body = {"model": "plain", "stream": True, "max_tokens": 48, "temperature": 0,
                "messages": [{"role": "user", "content": "Count from one to fifty in words."}]}
        seen: list[float] = []
        finished = None
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            out = {"status": r.status_code, "job": r.headers.get("x-fleet-job-id")}
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = (json.loads(line[6:]).get("choices") or [{}])[0]
                if choice.get("delta", {}).get("content"):
                    seen.append(time.monotonic())
                finished = choice.get("finish_reason") or finished
        gaps = [(b - a, a) for a, b in itertools.pairwise(seen)]
        pause, at = max(gaps, default=(0.0, 0.0))
        return {**out, "finish": finished, "pause": pause, "paused_at": at, "pieces": len(seen),
                "ended": time.monotonic()}


def health_watch(url: str, halted: threading.Event, bad: list[tuple[float, int]]) -> None:
    with httpx.Client(base_url=url, timeout=5) as http:
        while not halted.wait(0.25):
            code = http.get("/health").status_code
            if code != 200:
                bad.append((time.monotonic(), code))


Catalogue = dict[str, dict[str, Any]]


@pytest.mark.model
def test_a_hostile_template_gets_a_clear_422_and_no_worker_is_lost(
        redis_url: str, redis: Redis, gateways: Any, catalogue: Catalogue, tmp_path: Path) -> None:
    """Default settings: the render budget ends the render; the job fails in its first attempt."""
    sup = Supervisor(redis_url, tmp_path / "logs", {"models": catalogue, "backend__threads": 1})
    try:
        sup.launch("w1")
        gw = gateways.start(models=catalogue)
        wait_for(lambda: httpx.get(f"{gw.url}/health").status_code == 200, 60, "a live worker")
        started = time.monotonic()
        r = httpx.post(f"{gw.url}/v1/chat/completions", timeout=120,
                       json={"model": "hostile", "messages": LONG_CHAT, "max_tokens": 4})
        took = time.monotonic() - started
        print(f"hostile request answered {r.status_code} after {took:.1f}s: {r.text[:300]}")
        assert r.status_code == 422 and "template rendered past 5 seconds" in r.text, r.text
        job_id = r.headers["x-fleet-job-id"]
        assert not redis.hget(job_key(job_id), HUNG_FIELD) and not redis.hget(job_key(job_id), DIED_ON_FIELD)
        assert sup.procs["w1"].alive()
        ok = httpx.post(f"{gw.url}/v1/chat/completions", timeout=120,
                        json={"model": "plain", "messages": LONG_CHAT, "max_tokens": 4})
        assert ok.status_code == 200, ok.text
    finally:
        sup.close()


@pytest.mark.model
def test_a_template_that_hangs_workers_is_poison_after_two(
        redis_url: str, redis: Redis, gateways: Any, catalogue: Catalogue, tmp_path: Path) -> None:
    settings = {"models": catalogue, "backend__threads": 1, "stall_limit": STALL_LIMIT}
    sup = Supervisor(redis_url, tmp_path / "logs", settings)
    halted, unhealthy = threading.Event(), list[tuple[float, int]]()
    streams: list[Streams] = []
    try:
        for name in ("w1", "w2", "w3"):
            sup.launch(name)
        sup.start()
        gw = gateways.start(models=catalogue)
        wait_for(lambda: httpx.get(f"{gw.url}/health").status_code == 200, 60, "a live worker")
        threading.Thread(target=health_watch, args=(gw.url, halted, unhealthy), daemon=True).start()
        streams = [Streams(gw.url), Streams(gw.url)]
        for s in streams:
            s.start()
        wait_for(lambda: all(len(s.done) >= 3 for s in streams), 180, "three streams each")

        started = time.monotonic()
        with open("/proc/loadavg") as load:
            print(f"load average: {load.read().split()[:3]} on {os.cpu_count()} CPUs")
        r = httpx.post(f"{gw.url}/v1/chat/completions", timeout=300,
                       json={"model": "hostile", "messages": LONG_CHAT, "max_tokens": 4})
        answered = time.monotonic() - started
        job_id = r.headers["x-fleet-job-id"]
        hung = (as_str(redis.hget(job_key(job_id), HUNG_FIELD)) or "").split(",")
        print(f"hostile request: {r.status_code} after {answered:.1f}s, hung {hung}: {r.text[:400]}")
        assert r.status_code == 422 and "this job hung 2 workers" in r.text, r.text
        assert len(hung) == 2
        assert int(redis.hget(job_key(job_id), "fleet_attempt") or 0) <= 1  # two attempts, no third

        # each hung worker exited 70 and its next life registered within 30 s of the hang
        wait_for(lambda: len(sup.exits) >= 2 and all("registered" in ex for ex in sup.exits), 60,
                 "the restarted workers")
        assert len(sup.exits) == 2, [(e["name"], e["code"]) for e in sup.exits]
        for ex in sup.exits:
            assert ex["code"] == 70 and "hung: its loop was stuck" in ex["log"], ex["log"][-2000:]
            stuck = float(re.findall(r"its loop was stuck (\d+)s", ex["log"])[0])
            replaced = stuck + ex["registered"] - ex["at"]  # from the start of the stuck call
            print(f"{ex['name']}: exit {ex['code']}, replaced {replaced:.1f}s after its loop stuck "
                  f"({ex['registered'] - ex['at']:.1f}s after its exit)")
            assert replaced < 30
        time.sleep(3)  # streams on the restarted workers too
    finally:
        halted.set()
        for s in streams:
            s.halted.set()
        for s in streams:
            s.join(150)
        sup.close()

    ran = [d for s in streams for d in s.done]
    assert ran and all(d["status"] == 200 and d["finish"] in ("length", "stop") for d in ran), ran
    assert not unhealthy, unhealthy  # /health never said there was no worker
    on_hung = {d["job"] for d in ran if redis.hget(job_key(d["job"]), DIED_ON_FIELD)}
    print(f"plain streams: {len(ran)} ran, all finished; {len(on_hung)} were on a worker that hung "
          f"(handed over, resumed)")
    for phase, picked in (("before the hostile request", [d for d in ran if d["ended"] < started]),
                          ("from it to the end", [d for d in ran if d["ended"] >= started])):
        pauses = sorted(d["pause"] for d in picked if d["job"] not in on_hung)
        if pauses:
            print(f"  {phase}, on workers that did not hang: {len(pauses)} streams, longest pause "
                  f"{pauses[-1] * 1000:.0f} ms, median stream's {pauses[len(pauses) // 2] * 1000:.0f} ms, "
                  f"over {PAUSE_BOUND * 1000:.0f} ms: {sum(p > PAUSE_BOUND for p in pauses)}")
    for d in ran:  # each a result, none a failure (JobFailed)
        d["worker"] = Fleet(redis_url, pool="plain").job(d["job"]).result(timeout=5)["worker"]
    worst = max((d for d in ran if d["job"] not in on_hung), key=lambda d: d["pause"])
    events = sorted([(ex["at"] - started, f"{ex['name']} exited") for ex in sup.exits]
                    + [(ex["registered"] - started, f"{ex['name']} back") for ex in sup.exits])
    print(f"  the longest: on {worst['worker']}, from {worst['paused_at'] - started:.1f}s after the hostile "
          f"request; the fleet's events (s after it): {[(round(t, 1), e) for t, e in events]}")


def test_a_stop_signal_ends_a_worker_stuck_in_a_step(redis_url: str, redis: Redis, tmp_path: Path) -> None:
    """SIGTERM reaches a loop stuck in one engine call (the fake engine's 10 s step): the worker
    is gone once the drain's grace is over, not after the call; its job is handed back."""
    w = start_worker(redis_url, "stuck", tmp_path / "logs", backend__type="fake", backend__step_delay=10,
                     drain_grace=1, stall_limit=60)
    try:
        job = Fleet(redis_url).submit(prompt="a b c d", max_tokens=4)
        wait_for(lambda: redis.hget(job_key(job.id), "fleet_owner") == b"stuck", 30, "the claim")
        time.sleep(0.5)  # inside the step
        sent = time.monotonic()
        w.process.send_signal(signal.SIGTERM)
        code = w.process.wait(30)
        took = time.monotonic() - sent
        print(f"SIGTERM -> exit {code} after {took:.1f}s (drain_grace 1 s, a step of 10 s)")
        assert took < 5, w.output()[-2000:]
        assert redis.lpos("rq:queue:llm:default", job.id) == 0  # handed back, to the front
        assert not redis.exists(worker_key("stuck"))
        assert not redis.hget(job_key(job.id), HUNG_FIELD)  # not hung: stopped
    finally:
        if w.alive():
            w.kill()


def test_a_job_that_hung_two_workers_fails_as_poison(redis_url: str, redis: Redis) -> None:
    """The reaper's rule, on in-process workers: a job marked by the watchdog of one hung worker
    goes back (to the front, like a death); marked by a second, it fails naming both, never going
    to a third. A job beside it, unmarked, is handed back each time and still runs."""
    poison = Fleet(redis_url).submit(prompt="poison", max_tokens=4)
    beside = Fleet(redis_url).submit(prompt="beside it", max_tokens=4)
    reaper = Reaper(redis, "reaper", 3, 60)
    for name in ("h1", "h2"):
        fw = inproc_worker(redis_url, name, slots=2)
        assert len(fw.claimer.claim(2)) == 2
        assert redis.eval(MARK_HUNG, 1, job_key(poison.id), HUNG_FIELD, OWNER_FIELD, "not-the-owner") == 0
        assert redis.eval(MARK_HUNG, 1, job_key(poison.id), HUNG_FIELD, OWNER_FIELD, name) == 1
        assert reaper.reap_worker(name, why=f"worker {name} hung") == 2
        if name == "h1":
            assert poison.status() == "queued" and as_str(redis.hget(job_key(poison.id), HUNG_FIELD)) == "h1"
    with pytest.raises(JobFailed, match=r"this job hung 2 workers \(h1, h2\)"):
        poison.result(timeout=5)
    healthy = inproc_worker(redis_url, "healthy")
    run_until([healthy], lambda: final_entries(redis, beside.id), what="the job beside it")
    assert beside.result(timeout=1)["attempt"] == 3


def test_the_watchdog_takes_a_call_past_the_limit_or_a_stop_past_its_grace(redis_url: str) -> None:
    fw = inproc_worker(redis_url, "watched", stall_limit=5, drain_grace=0)
    dog = Watchdog(SimpleNamespace(fw=fw))  # type: ignore[arg-type]  # what it reads of a heartbeat
    assert dog.stuck(time.monotonic()) is None  # the loop is in no engine call
    with fw.watch.engine("stepping", lambda: ("j1",)):
        now = time.monotonic()
        assert dog.stuck(now + 4) is None
        call, took, hung = dog.stuck(now + 6) or (None, 0.0, False)
        assert call is not None and call.jobs() == ("j1",) and took > 5 and hung
        fw.stop()  # a signal, no grace: the loop cannot drain from inside the call
        assert dog.stuck(now + 0.1)[2:] == (False,)  # type: ignore[index]
    assert dog.stuck(time.monotonic()) is None  # out of the call: it drains on its own
