"""Several models on one fleet, with real files: the embedded gemma-3-270m Q4_K_M and a Q8_0 made
from it by llama.cpp's own quantizer (backends/model.py requantized: another file, size and
speed), served from the catalogue (`models`) by real `fleet worker` processes and a real
`fleet serve`. What must hold: each job runs on the model its pool names; a worker loads a cold
model once for a burst, and only one worker does; loaded models are what the status says; an idle
model goes after its keep_alive and the worker's RSS comes back; listings are true with no
worker up."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis

from backends.contract.keys import WORKERS_SET, worker_key
from backends.gguf import file_card, read_header
from backends.model import default_model_path, requantized
from dispatcher.client import Fleet
from ecosystem.local.processes import wait_for, wait_until_healthy

pytestmark = pytest.mark.timeout(300)
Q4 = "gemma3:270m"
Q8 = "gemma3:270m-q8"


@pytest.fixture(scope="module")
def catalogue() -> dict[str, dict[str, Any]]:
    q4 = default_model_path()
    return {Q4: {"path": str(q4), "keep_alive": 600},
            Q8: {"path": str(requantized(q4, "Q8_0")), "keep_alive": 600}}


def status(redis: Redis, name: str) -> dict[str, Any]:
    raw = redis.hgetall(worker_key(name))
    return {k.decode(): json.loads(v) for k, v in raw.items()}


def a_beat(redis: Redis, *names: str) -> None:
    """Until each worker's status was taken after this call (its `updated_at`, this host's clock):
    what the status says then is what happened before (a fixed sleep was a beat on a quiet box)."""
    since = time.time()
    wait_for(lambda: all(status(redis, n).get("updated_at", 0) > since for n in names), 30,
             f"a beat of {', '.join(names)}")


def loaded(redis: Redis, name: str) -> list[str]:
    models = status(redis, name).get("backend_stats", {}).get("models", [])
    return sorted(m["name"] for m in models)


def fleet_status(redis_url: str) -> str:
    done = subprocess.run([sys.executable, "-m", "ecosystem.cli", "status", "--pool", "gemma3-270m"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "FLEET_REDIS_URL": redis_url, "COLUMNS": "120"})
    assert done.returncode == 0, done.stderr
    return done.stdout


def run(fleet: Fleet, n: int, tag: str) -> list[Any]:
    jobs = [fleet.submit(f"{tag} {i}: say something.", max_tokens=8, temperature=0.0) for i in range(n)]
    return [job.result(timeout=120) for job in jobs]


def test_the_file_card_matches_what_a_worker_publishes(catalogue: dict[str, dict[str, Any]]) -> None:
    """A listing from the file (no worker) says what the worker that loads the model says."""

    path = Path(catalogue[Q8]["path"])
    card = file_card(path)
    assert card["details"]["quantization_level"] == "Q8_0"
    assert card["size"] == path.stat().st_size
    header = read_header(default_model_path())
    assert header.n_params == 268_098_176  # what llama_model_n_params says of the embedded model
    assert file_card(default_model_path())["details"]["quantization_level"] == "Q4_K_M"


@pytest.mark.model
def test_one_worker_serves_two_models_and_unloads_the_idle_one(workers: Any, redis_url: str, redis: Redis,
                                                              catalogue: dict[str, dict[str, Any]]) -> None:
    models = {**catalogue, Q8: {**catalogue[Q8], "keep_alive": 3}}
    workers.start("w1", models=models, backend__slots=2)
    wait_for(lambda: status(redis, "w1").get("pools") == ["gemma3-270m", "gemma3-270m-q8"], 30, "pools")
    assert loaded(redis, "w1") == []  # nothing loads before a job asks
    rss_idle = status(redis, "w1")["rss_mb"]
    assert all(r["finish_reason"] == "length" for r in (x.model_dump() for x in
               run(Fleet(redis_url, pool="gemma3-270m"), 3, "q4")))
    wait_for(lambda: loaded(redis, "w1") == [Q4], 10, "q4 loaded")
    rss_q4 = status(redis, "w1")["rss_mb"]
    run(Fleet(redis_url, pool="gemma3-270m-q8"), 3, "q8")
    wait_for(lambda: loaded(redis, "w1") == [Q4, Q8], 10, "both loaded")
    stats = status(redis, "w1")["backend_stats"]
    assert stats["model_loads"] == 2, stats  # one load a model, not one a job
    shown = fleet_status(redis_url)
    assert "models loaded" in shown and Q4 in shown and Q8 in shown, shown
    rss_both = status(redis, "w1")["rss_mb"]
    # the Q8 copy is idle past its keep_alive of 3 s: unloaded, its RAM given back
    wait_for(lambda: loaded(redis, "w1") == [Q4], 20, "q8 unloaded")
    a_beat(redis, "w1")  # the RSS after the unload
    rss_after = status(redis, "w1")["rss_mb"]
    print(f"RSS MB: idle {rss_idle}, Q4 loaded {rss_q4}, both {rss_both}, Q8 unloaded {rss_after}")
    assert abs(rss_after - rss_q4) <= 0.05 * rss_q4, (rss_idle, rss_q4, rss_after)


@pytest.mark.model
def test_a_burst_for_a_cold_model_loads_it_on_one_worker(workers: Any, redis_url: str, redis: Redis,
                                                        catalogue: dict[str, dict[str, Any]]) -> None:
    for name in ("w1", "w2"):  # no second copy of a model whose jobs wait (the next test's subject)
        workers.start(name, models=catalogue, backend__slots=4, second_copy_after=600)
    run(Fleet(redis_url, pool="gemma3-270m-q8"), 8, "burst")
    a_beat(redis, "w1", "w2")
    holders = {name: loaded(redis, name) for name in ("w1", "w2")}
    assert sorted(holders.values()) == [[], [Q8]], holders  # one worker loaded it
    loads = sum(status(redis, n)["backend_stats"]["model_loads"] for n in ("w1", "w2"))
    assert loads == 1
    # the next burst goes to the worker holding the model, the other stays cold
    run(Fleet(redis_url, pool="gemma3-270m-q8"), 8, "again")
    a_beat(redis, "w1", "w2")
    assert sum(status(redis, n)["backend_stats"]["model_loads"] for n in ("w1", "w2")) == 1
    # bursts for both models at once: the cold one is loaded once too, and each job ran on a
    # worker holding its model
    q4 = [Fleet(redis_url, pool="gemma3-270m").submit(f"q4 {i}", max_tokens=8) for i in range(8)]
    q8 = [Fleet(redis_url, pool="gemma3-270m-q8").submit(f"q8 {i}", max_tokens=8) for i in range(8)]
    done4, done8 = [j.result(timeout=120) for j in q4], [j.result(timeout=120) for j in q8]
    a_beat(redis, "w1", "w2")
    holders = {name: loaded(redis, name) for name in ("w1", "w2")}
    assert sum(status(redis, n)["backend_stats"]["model_loads"] for n in ("w1", "w2")) == 2, holders
    assert {r["worker"] for r in done8} == {n for n, held in holders.items() if Q8 in held}
    assert {r["worker"] for r in done4} == {n for n, held in holders.items() if Q4 in held}


@pytest.mark.model
def test_a_model_that_stays_hot_gets_a_second_copy(workers: Any, redis_url: str, redis: Redis,
                                                   catalogue: dict[str, dict[str, Any]]) -> None:
    """Work for one model that keeps its holder full past `second_copy_after`: the idle worker
    loads another copy and takes a share; the burst above (drained within a few seconds) did not."""
    cores = sorted(os.sched_getaffinity(0))
    for i, name in enumerate(("w1", "w2")):  # a core each: the holder's steps stay short
        workers.start(name, models=catalogue, backend__slots=2, second_copy_after=1.0,
                      cpus=str(cores[i % len(cores)]))
    fleet = Fleet(redis_url, pool="gemma3-270m-q8")

    def submit(n: int) -> list[Any]:
        return [fleet.submit(f"hot {len(jobs) + i}: tell a long story.", max_tokens=96, temperature=0.0)
                for i in range(n)]

    # work keeps coming until a second copy is loaded (however fast this CPU drains it), then
    # more, which both copies share
    jobs: list[Any] = []
    deadline = time.monotonic() + 180
    while redis.hlen("fleet:copies:gemma3-270m-q8") < 2:
        assert time.monotonic() < deadline, "no second copy while the holder stayed full"
        if sum(job.status() == "queued" for job in jobs) < 4:
            jobs += submit(2)
        time.sleep(0.05)
    jobs += submit(10)
    done = [job.result(timeout=180) for job in jobs]
    a_beat(redis, "w1", "w2")
    assert {r["worker"] for r in done} == {"w1", "w2"}, [r["worker"] for r in done]
    assert {name: loaded(redis, name) for name in ("w1", "w2")} == {"w1": [Q8], "w2": [Q8]}
    assert sum(status(redis, n)["backend_stats"]["model_loads"] for n in ("w1", "w2")) == 2
    copies = redis.hgetall("fleet:copies:gemma3-270m-q8")
    assert sorted(copies) == [b"w1", b"w2"], copies


def test_listings_are_true_with_no_worker_up(gateways: Any, redis: Redis,
                                            catalogue: dict[str, dict[str, Any]]) -> None:
    assert not redis.smembers(WORKERS_SET)
    gw = gateways.start(models=catalogue)
    tags = wait_for(lambda: _get(f"{gw.url}/api/tags"), 30, "the gateway")["models"]
    by_name = {m["name"]: m for m in tags}
    assert set(by_name) == {Q4, Q8}
    assert by_name[Q8]["details"]["quantization_level"] == "Q8_0"
    assert by_name[Q8]["size"] == Path(catalogue[Q8]["path"]).stat().st_size
    shown = httpx.post(f"{gw.url}/api/show", json={"model": Q8}).json()
    assert shown["details"]["quantization_level"] == "Q8_0"
    assert httpx.get(f"{gw.url}/api/ps").json()["models"] == []  # nothing loaded anywhere


def _get(url: str) -> Any:
    try:
        return httpx.get(url, timeout=2).json()
    except httpx.TransportError:
        return None


def ps_models(url: str) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in httpx.get(f"{url}/api/ps").json()["models"]}


def router_states(url: str) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in httpx.get(f"{url}/models").json()["data"]}


@pytest.mark.model
def test_ollama_lifecycle_through_the_gateway(workers: Any, gateways: Any, redis: Redis,
                                              catalogue: dict[str, dict[str, Any]]) -> None:
    """The official ollama client and the router's endpoints against one catalogue worker:
    /api/ps and /models true at every step; a cold model's first answer says its load."""
    import ollama

    workers.start("w1", models=catalogue, backend__slots=2)
    gw = gateways.start(models=catalogue)
    wait_until_healthy(gw)
    client = ollama.Client(host=gw.url)
    assert ps_models(gw.url) == {}
    assert router_states(gw.url) == {Q4: "unloaded", Q8: "unloaded"}
    # a first request for a cold model: its load is in load_duration, apart from the answer
    answer = client.generate(model=Q8, prompt="Say hi.", options={"num_predict": 4, "temperature": 0})
    assert answer.load_duration and answer.load_duration > 50_000_000, answer  # > 50 ms: a real load
    again = client.generate(model=Q8, prompt="Say hi.", options={"num_predict": 4, "temperature": 0})
    assert again.load_duration < answer.load_duration / 2, (answer.load_duration, again.load_duration)
    wait_for(lambda: set(ps_models(gw.url)) == {Q8}, 5, "ps shows the loaded model")
    shown = ps_models(gw.url)[Q8]
    assert shown["workers"] == ["w1"] and shown["size"] > Path(catalogue[Q8]["path"]).stat().st_size
    assert router_states(gw.url) == {Q4: "unloaded", Q8: "loaded"}
    # an empty prompt loads (Ollama's preload); keep_alive 0 unloads
    client.generate(model=Q4, prompt="")
    wait_for(lambda: set(ps_models(gw.url)) == {Q4, Q8}, 5, "ps shows both")
    client.generate(model=Q8, prompt="", keep_alive=0)
    wait_for(lambda: set(ps_models(gw.url)) == {Q4}, 5, "the unloaded one gone from ps")
    assert router_states(gw.url) == {Q4: "loaded", Q8: "unloaded"}
    # the router's own calls
    assert httpx.post(f"{gw.url}/models/load", json={"model": Q8}).json()["success"] is True
    wait_for(lambda: router_states(gw.url)[Q8] == "loaded", 5, "loaded through the router")
    httpx.post(f"{gw.url}/models/unload", json={"model": Q4}).raise_for_status()
    wait_for(lambda: set(ps_models(gw.url)) == {Q8}, 5, "unloaded through the router")
    # a request's keep_alive: the model goes once idle that long
    client.generate(model=Q8, prompt="Say hi.", options={"num_predict": 2}, keep_alive="2s")
    expires = datetime.fromisoformat(ps_models(gw.url)[Q8]["expires_at"])
    assert abs((expires - datetime.now(UTC)).total_seconds() - 2) < 1.5, expires  # about now + 2 s
    wait_for(lambda: ps_models(gw.url) == {}, 10, "idle past keep_alive")
    assert status(redis, "w1")["backend_stats"]["model_loads"] == 3  # Q8, Q4, Q8 again
    bad = httpx.post(f"{gw.url}/api/generate", json={"model": Q4, "prompt": "x", "keep_alive": "soon"})
    assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]


@pytest.mark.model
def test_open_webui_call_sequence_with_two_models(workers: Any, gateways: Any,
                                                  catalogue: dict[str, dict[str, Any]]) -> None:
    """Open WebUI against an Ollama base URL, in its order, over a catalogue of two models that
    no worker has loaded yet: version, tags, show per model, ps, a streamed chat with keep_alive
    to each model, ps (both, with their expiries), the unload of one, ps again."""
    workers.start("w1", models=catalogue, backend__slots=2)
    gw = gateways.start(models=catalogue)
    wait_until_healthy(gw)
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        assert http.get("/api/version").json()["version"]
        wait_for(lambda: all(m["digest"] for m in http.get("/api/tags").json()["models"]), 60, "digests")
        tags = http.get("/api/tags").json()["models"]
        assert [m["name"] for m in tags] == [Q4, Q8] and all(m["digest"] for m in tags)
        assert tags[0]["details"]["quantization_level"] == "Q4_K_M"
        assert tags[1]["details"]["quantization_level"] == "Q8_0" and tags[0]["size"] < tags[1]["size"]
        for m in tags:
            show = http.post("/api/show", json={"model": m["model"]}).json()
            assert show["details"] == m["details"] and show["model_info"]["general.basename"] == "gemma-3"
        assert http.get("/api/ps").json()["models"] == []  # nothing loaded: a catalogue loads on demand
        for model, keep in ((Q4, "5m"), (Q8, "1h")):
            body = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "stream": True,
                    "keep_alive": keep, "options": {"num_predict": 6, "temperature": 0}}
            lines = [json.loads(x) for x in http.post("/api/chat", json=body).text.splitlines() if x.strip()]
            assert lines[-1]["done"] and all(x["model"] == model for x in lines)
            assert "".join(x["message"]["content"] for x in lines)
        ps = {m["name"]: m for m in http.get("/api/ps").json()["models"]}
        assert set(ps) == {Q4, Q8}
        left = {n: (datetime.fromisoformat(m["expires_at"]) - datetime.now(UTC)).total_seconds()
                for n, m in ps.items()}
        assert 240 < left[Q4] <= 300 and 3500 < left[Q8] <= 3600, left  # each request's keep_alive
        assert ps[Q8]["digest"] == tags[1]["digest"] and ps[Q8]["size_vram"] == 0
        unload = http.post("/api/generate", json={"model": Q8, "keep_alive": 0, "prompt": ""}).json()
        assert unload["done_reason"] == "unload"
        wait_for(lambda: [m["name"] for m in http.get("/api/ps").json()["models"]] == [Q4], 5, "unloaded")
        assert [m["name"] for m in http.get("/api/tags").json()["models"]] == [Q4, Q8]


@pytest.mark.model
def test_a_memory_budget_evicts_the_idle_model(workers: Any, redis_url: str, redis: Redis,
                                               catalogue: dict[str, dict[str, Any]]) -> None:
    """A budget with room for one model (each ~450-500 MB with its slots' KV): the next model's
    load unloads the idle one; a file that is no model fails its job with the reason."""
    models = {**catalogue, "broken": {"path": __file__}}
    workers.start("w1", models=models, backend__slots=2, memory_budget_mb=700)
    run(Fleet(redis_url, pool="gemma3-270m"), 2, "q4")
    wait_for(lambda: loaded(redis, "w1") == [Q4], 10, "q4 loaded")
    run(Fleet(redis_url, pool="gemma3-270m-q8"), 2, "q8")
    wait_for(lambda: loaded(redis, "w1") == [Q8], 10, "q8 in place of q4")
    stats = status(redis, "w1")["backend_stats"]
    assert (stats["model_loads"], stats["model_unloads"]) == (2, 1)
    assert sum(m["memory_mb"] for m in stats["models"]) <= 700
    job = Fleet(redis_url, pool="broken").submit("hi", max_tokens=2)
    with pytest.raises(Exception, match="could not be loaded"):
        job.result(timeout=60)


@pytest.mark.model
def test_dedicated_workers_serve_only_their_models(workers: Any, redis_url: str, redis: Redis,
                                                   catalogue: dict[str, dict[str, Any]]) -> None:
    """serve_models: today's dedicated pools, from one catalogue."""
    workers.start("q4-only", models=catalogue, serve_models=[Q4], backend__slots=2)
    workers.start("q8-only", models=catalogue, serve_models=[Q8], backend__slots=2)
    q4 = run(Fleet(redis_url, pool="gemma3-270m"), 4, "q4")
    q8 = run(Fleet(redis_url, pool="gemma3-270m-q8"), 4, "q8")
    assert {r["worker"] for r in q4} == {"q4-only"} and {r["worker"] for r in q8} == {"q8-only"}
    assert status(redis, "q4-only")["pools"] == ["gemma3-270m"]


@pytest.mark.model
def test_the_dashboard_shows_each_workers_models(workers: Any, redis_url: str, redis: Redis, tmp_path: Path,
                                                catalogue: dict[str, dict[str, Any]]) -> None:
    """`fleet dashboard` over a catalogue fleet, rendered by headless Chromium: the worker's row
    names the model it holds, with its RAM."""
    from tests.observe_helpers import chromium
    from tests.real_servers import free_port

    workers.start("w1", models=catalogue, backend__slots=2)
    run(Fleet(redis_url, pool="gemma3-270m-q8"), 1, "q8")
    wait_for(lambda: loaded(redis, "w1") == [Q8], 10, "q8 loaded")
    port = free_port()
    env = {**os.environ, "FLEET_REDIS_URL": redis_url, "FLEET_MODELS": json.dumps(catalogue)}
    server = subprocess.Popen([sys.executable, "-m", "ecosystem.cli", "dashboard", "--port", str(port)],
                              env=env, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/"
        wait_for(lambda: _get(url + "api/status"), 30, "the dashboard")
        dom = chromium("--virtual-time-budget=4000", "--dump-dom", url, profile=tmp_path / "profile").stdout
        row = re.search(r'<tr data-worker="w1">.*?</tr>', dom, re.S)
        assert row is not None, dom[-2000:]
        assert re.search(rf'<div class="model">{re.escape(Q8)} \d+M</div>', row.group(0)), row.group(0)
    finally:
        server.terminate()
        server.wait(10)


@pytest.mark.model
def test_a_pinned_model_stays(workers: Any, gateways: Any, redis_url: str,
                              redis: Redis, catalogue: dict[str, dict[str, Any]]) -> None:
    """A pinned model: loaded before any job asks, past its keep_alive, an operator's unload and
    a budget's eviction; /api/ps says it stays for good."""
    models = {Q4: {**catalogue[Q4], "pinned": True, "keep_alive": 1}, Q8: catalogue[Q8]}
    workers.start("w1", models=models, backend__slots=2, memory_budget_mb=700)  # room for one more
    assert loaded(redis, "w1") == [Q4]
    gw = gateways.start(models=models)
    wait_until_healthy(gw)
    client = __import__("ollama").Client(host=gw.url)
    client.generate(model=Q4, prompt="", keep_alive=0)  # an operator's unload: a pinned model stays
    time.sleep(2.5)  # past its keep_alive of 1 s, and two beats
    assert loaded(redis, "w1") == [Q4]
    assert datetime.fromisoformat(ps_models(gw.url)[Q4]["expires_at"]).year > 2200  # Ollama's "Forever"
    # no room for Q8 beside the pinned Q4: its job waits (for a worker with room), Q4 is not evicted
    job = Fleet(redis_url, pool="gemma3-270m-q8").submit("Say hi.", max_tokens=2)
    time.sleep(2)
    assert loaded(redis, "w1") == [Q4] and job.status() == "queued"
    job.cancel()


@pytest.mark.model
def test_an_embedding_entry_beside_generation_models(workers: Any, gateways: Any, redis: Redis,
                                                     catalogue: dict[str, dict[str, Any]]) -> None:
    """An embedding-only catalogue entry on the same worker as a chat model: /v1/embeddings on it
    loads it and embeds (the official openai client), a chat for it is refused with the reason,
    and the chat model generates beside it."""
    import openai

    embed = "embed:270m"
    models = {**catalogue, embed: {"path": catalogue[Q4]["path"], "embedding": True}}
    workers.start("w1", models=models, backend__slots=2)
    gw = gateways.start(models=models)
    wait_until_healthy(gw)
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="none")
    vectors = client.embeddings.create(model=embed, input=["a cat", "a dog", "a cat"]).data
    assert len(vectors) == 3 and len(vectors[0].embedding) == 640  # gemma-3-270m's embedding length
    assert vectors[0].embedding == vectors[2].embedding != vectors[1].embedding
    wait_for(lambda: loaded(redis, "w1") == [embed], 5, "the embedding model loaded")  # the next beat
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.APIStatusError, match="embedding model") as refused:
        client.chat.completions.create(model=embed, messages=hi, max_tokens=4)  # type: ignore[arg-type]
    assert 400 <= refused.value.status_code < 500
    chat = client.chat.completions.create(model=Q4, messages=hi, max_tokens=4)  # type: ignore[arg-type]
    assert chat.choices[0].message.content
    wait_for(lambda: loaded(redis, "w1") == [embed, Q4], 5, "both loaded")
    show = httpx.post(f"{gw.url}/api/show", json={"model": embed}).json()
    assert show["capabilities"] == ["embedding"]
