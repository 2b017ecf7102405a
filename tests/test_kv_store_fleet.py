"""The KV store across real `fleet worker` processes: a chat's turn runs on worker A, A is
stopped (SIGTERM: it drains, and its engine's last act puts the conversations in the store);
the next turn, on worker B sharing the store's directory, restores the history instead of
prefilling it."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from dispatcher import Fleet
from tests.reliability_checks import fleet_workers
from tests.test_kv_store import FACTS

pytestmark = pytest.mark.timeout(600)


def test_the_next_turn_on_another_worker_restores_the_history_from_the_store(
        redis_url: str, tmp_path: Path) -> None:
    store = tmp_path / "kv"
    settings = {"backend__slots": 2, "backend__kv_store__path": str(store),
                "backend__kv_store__min_tokens": 64, "drain_grace": 60}
    fleet = Fleet(redis_url)
    history = [{"role": "user", "content": FACTS + "\nName the town of river 3."}]
    with fleet_workers(redis_url, tmp_path / "logs") as workers:
        a = workers.start("kv-a", **settings)
        first = fleet.submit(messages=history, max_tokens=16, temperature=0.0, tenant="t1").result(300)
        assert first["worker"] == "kv-a"
        assert a.stop(signal.SIGTERM, timeout=120) == 0, a.output()
        assert len(list(store.rglob("*.kv"))) == 1, workers.logs()
        workers.start("kv-b", **settings)
        turn = [*history, {"role": "assistant", "content": first["text"]},
                {"role": "user", "content": "And of river 7? One word."}]
        second = fleet.submit(messages=turn, max_tokens=8, temperature=0.0, tenant="t1").result(300)
    assert second["worker"] == "kv-b"
    timings, usage = second["timings"], second["usage"]
    restored = timings.get("kv_restored_tokens", 0)
    assert restored > first["usage"]["prompt_tokens"], (timings, usage)
    assert timings["kv_restored_ms"] > 0
    assert usage["cached_tokens"] == restored
    assert usage["prompt_tokens"] - usage["cached_tokens"] < 40  # only the new turn was prefilled
