"""The KV store across real `fleet worker` processes: a chat's turn runs on worker A, A is
stopped (SIGTERM: it drains, and its engine's last act puts the conversations in the store);
the next turn, on worker B sharing the store's directory, restores the history instead of
prefilling it. And with kill -9 instead: the entry a finished turn left is already on disk.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from redis import Redis

from dispatcher import Fleet
from dispatcher.observe.snapshot import snapshot
from dispatcher.observe.tables import totals_text
from tests.observe_helpers import collect, value
from tests.reliability_checks import fleet_workers
from tests.test_kv_store import FACTS

pytestmark = [pytest.mark.timeout(600), pytest.mark.model]


def written_entries(redis_url: str, worker: str, deadline: float) -> dict[str, float]:
    """The worker's kv_store_entries counters by outcome, once it wrote one (or at the deadline)."""
    while True:
        samples = collect(Redis.from_url(redis_url))
        found = {dict(labels)["outcome"]: v for (name, labels), v in samples.items()
                 if name == "llama_fleet_kv_store_entries_total" and dict(labels).get("worker") == worker}
        if found.get("written") or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


@pytest.mark.parametrize("stop", ["SIGTERM", "kill -9 once its entry is written"])
def test_the_next_turn_on_another_worker_restores_the_history_from_the_store(
        redis_url: str, tmp_path: Path, stop: str) -> None:
    store = tmp_path / "kv"
    settings = {"backend__slots": 2, "backend__kv_store__path": str(store),
                "backend__kv_store__min_tokens": 64, "drain_grace": 60}
    fleet = Fleet(redis_url)
    history = [{"role": "user", "content": FACTS + "\nName the town of river 3."}]
    with fleet_workers(redis_url, tmp_path / "logs") as workers:
        a = workers.start("kv-a", **settings)
        first = fleet.submit(messages=history, max_tokens=16, temperature=0.0, tenant="t1").result(300)
        assert first["worker"] == "kv-a"
        if stop == "SIGTERM":  # the drain's engine close writes what is left
            assert a.stop(signal.SIGTERM, timeout=120) == 0, a.output()
        else:  # nothing runs after the kill: the idle worker must have written it already
            deadline = time.monotonic() + 60
            while not list(store.rglob("*.kv")) and time.monotonic() < deadline:
                time.sleep(0.1)
            a.stop(signal.SIGKILL)
        assert len(list(store.rglob("*.kv"))) == 1, workers.logs()
        workers.start("kv-b", **settings)
        turn = [*history, {"role": "assistant", "content": first["text"]},
                {"role": "user", "content": "And of river 7? One word."}]
        second = fleet.submit(messages=turn, max_tokens=8, temperature=0.0, tenant="t1").result(300)
        # the write side, per worker process, in Prometheus: kv-b, idle, stores the longer chat
        written = written_entries(redis_url, "kv-b", deadline=time.monotonic() + 60)
    assert written.get("written") == 1 and written.get("removed_bad") == 0, written
    assert second["worker"] == "kv-b"
    timings, usage = second["timings"], second["usage"]
    restored = timings.get("kv_restored_tokens", 0)
    assert restored > first["usage"]["prompt_tokens"], (timings, usage)
    assert timings["kv_restored_ms"] > 0
    assert usage["cached_tokens"] == restored
    assert usage["prompt_tokens"] - usage["cached_tokens"] < 40  # only the new turn was prefilled
    # counted for operators: the pool's counters (`fleet status`) and Prometheus
    redis = Redis.from_url(redis_url)
    totals = snapshot(redis, "llm")["totals"]
    assert (totals["store_restores"], totals["store_restored_tokens"]) == (1, restored), totals
    assert f"{restored} from the KV store in 1 restores" in totals_text({"totals": totals}).plain
    samples = collect(redis)
    assert value(samples, "llama_fleet_kv_store_restored_tokens_total", pool="llm") == restored
    assert value(samples, "llama_fleet_kv_store_restores_total", pool="llm") == 1
