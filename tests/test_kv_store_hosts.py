"""The KV store across hosts: two workers, each in a network namespace of its own (a host that
reaches Redis over its own link), open one store directory, as hosts mounting one NFS export
would. They name the same store in their capacity entries, so the claim sends a conversation
whose holder is gone to the other host, which restores the history from the shared directory
instead of prefilling it."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from redis import Redis

from backends.contract.keys import capacity_key
from backends.contract.replies import as_str
from backends.llamacpp.kv_store import store_id
from dispatcher import Fleet
from tests.multihost_checks import start_worker_in
from tests.netns import NetLab, RedisInNamespace
from tests.test_kv_store import FACTS

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]


def test_a_conversation_moves_to_another_host_that_mounts_the_store(tmp_path: Path) -> None:
    store, logs = tmp_path / "kv", tmp_path / "logs"
    engine = {"backend__type": "llama-cpp", "backend__slots": 2, "backend__kv_store__path": str(store),
              "backend__kv_store__min_tokens": 64}
    with NetLab(["h1", "h2"]) as lab:
        rs = RedisInNamespace(lab, tmp_path / "redis").start()
        watch = Redis.from_url(rs.unix_url)
        workers = {host: start_worker_in(lab, host, rs.url_from(host), f"kv-{host}", logs, watch,
                                         engine=engine, timeout=180, drain_grace=60)
                   for host in ("h1", "h2")}
        # both hosts name one store: the id written once in the shared directory
        deadline = time.monotonic() + 30
        while len(entries := watch.hgetall(capacity_key("llm"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        stores = {as_str(name): (as_str(raw) or "").rsplit("|", 1)[1] for name, raw in entries.items()}
        assert stores == {"kv-h1": store_id(store), "kv-h2": store_id(store)}, entries
        fleet = Fleet(rs.unix_url)
        history = [{"role": "user", "content": FACTS + "\nName the town of river 3."}]
        first = fleet.submit(messages=history, max_tokens=16, temperature=0.0, tenant="t1").result(300)
        holder = str(first["worker"])
        other = "kv-h2" if holder == "kv-h1" else "kv-h1"
        # the holder's host goes away (a drain: its engine's last act stores what it holds)
        assert workers[holder.removeprefix("kv-")].stop(signal.SIGTERM, timeout=120) == 0
        turn = [*history, {"role": "assistant", "content": first["text"]},
                {"role": "user", "content": "And of river 7? One word."}]
        second = fleet.submit(messages=turn, max_tokens=8, temperature=0.0, tenant="t1").result(300)
    assert second["worker"] == other
    restored = second["timings"].get("kv_restored_tokens", 0)
    assert restored > first["usage"]["prompt_tokens"], second
    assert second["usage"]["prompt_tokens"] - second["usage"]["cached_tokens"] < 40
