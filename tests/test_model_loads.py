"""Catalogue models that do not load, on real processes (redis-server, `fleet worker`, `fleet
serve`): a file that is missing, cut short or no GGUF fails every request for it at once, a
loader killed mid-load hands its model to another worker within a few beats, and a model no
live worker's memory budget could ever hold is refused at the gateway. The bounds below are far
above what the fleet needs (a second or two) and far below the 120 s a stuck loading lock held."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from redis import Redis

from backends.contract.keys import model_loading_key, queue_key, queue_names
from backends.model import default_model_path
from ecosystem.local.processes import wait_for, wait_until_healthy
from tests.test_model_catalogue import loaded, router_states

pytestmark = [pytest.mark.timeout(300), pytest.mark.model]
QUICK = 30.0  # seconds: every answer below comes within this (before the fix: 120 s and more)


def lists(redis: Redis, worker: str, models: list[str]) -> None:
    """The worker's status lists these models: as of its last beat (1 s), so an answer may come first."""
    wait_for(lambda: loaded(redis, worker) == models, 10, f"{worker}'s status to list {models}")


def chat(url: str, model: str, timeout: float = 2 * QUICK) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)


def broken_files(tmp_path: Path) -> dict[str, Path]:
    """A path with no file, the model cut in half (a download that stopped), a text file."""
    half = tmp_path / "half.gguf"
    with default_model_path().open("rb") as src, half.open("wb") as dst:
        dst.write(src.read(default_model_path().stat().st_size // 2))
    text = tmp_path / "notes.gguf"
    text.write_text("this is no model\n" * 100)
    return {"missing": tmp_path / "missing.gguf", "truncated": half, "not-gguf": text}


def test_a_model_file_that_cannot_load_fails_every_request_at_once(workers: Any, gateways: Any,
                                                                   tmp_path: Path) -> None:
    """Four requests at once for each bad file, on two workers of two slots: all four get the
    load's error (a 4xx naming the file and what is wrong with it) at once, not the two a first
    claim took; the router listing says unloaded, not loading; an embedding request gets the same
    error; a batch of six lines on one ends failed at once; the file put in place, it loads."""
    files = broken_files(tmp_path)
    models = {name: {"path": str(path)} for name, path in files.items()}
    for name in ("w1", "w2"):
        workers.start(name, models=models, backend__slots=2)
    gw = gateways.start(models=models)
    wait_until_healthy(gw)
    started = time.monotonic()
    with ThreadPoolExecutor(12) as pool:
        asked = [(model, pool.submit(chat, gw.url, model)) for model in files for _ in range(4)]
        answers = [(model, future.result()) for model, future in asked]
    took = time.monotonic() - started
    for model, answer in answers:
        assert answer.status_code == 422, (model, answer.status_code, answer.text)
        error = answer.json()["error"]["message"]
        assert "could not be loaded" in error and str(files[model]) in error, error
    by_model = {model: {a.json()["error"]["message"] for m, a in answers if m == model} for model in files}
    assert all(len(errors) == 1 for errors in by_model.values()), by_model  # the same error for all four
    problems = {"missing": "not found", "truncated": "cut short", "not-gguf": "not a GGUF file"}
    assert all(problem in next(iter(by_model[m])) for m, problem in problems.items()), by_model
    assert took < QUICK, took
    assert router_states(gw.url) == dict.fromkeys(files, "unloaded")
    # an embedding request gets the load's error too, not that "this engine does not embed"
    embedded = httpx.post(f"{gw.url}/v1/embeddings", json={"model": "missing", "input": "hi"}, timeout=QUICK)
    assert 400 <= embedded.status_code < 500, embedded.text
    why = next(iter(by_model["missing"])).removeprefix("generation failed: ")
    assert embedded.json()["error"]["message"] == f"embedding failed: {why}", embedded.text
    # a batch on one: every line fails with the same reason, at once
    client = OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    lines = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "truncated", "messages": [{"role": "user", "content": f"Item {i}"}],
                       "max_tokens": 2}} for i in range(6)]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("in.jsonl", data), purpose="batch")
    started = time.monotonic()
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    while batch.status not in ("completed", "failed", "cancelled") and time.monotonic() - started < QUICK:
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", (batch.status, time.monotonic() - started)
    assert batch.request_counts is not None and batch.request_counts.failed == 6, batch.request_counts
    assert batch.error_file_id is not None
    errors = client.files.content(batch.error_file_id).text
    assert errors.count("could not be loaded") == 6, errors
    # the failure is remembered only while the file stays as it was: put in place, it loads
    files["missing"].symlink_to(default_model_path())
    fixed = chat(gw.url, "missing", timeout=120)
    assert fixed.status_code == 200, fixed.text


def test_a_loader_killed_mid_load_frees_its_model_within_a_few_beats(workers: Any, gateways: Any,
                                                                    redis: Redis, tmp_path: Path) -> None:
    """The model's file is a FIFO no one writes to: whoever loads it waits in llama.cpp's open
    (a load that takes as long as the test wants). Kill -9 that worker; once the file is a real
    model, the survivor takes the job within a few heartbeats of its hand-back, loads and answers."""
    path, lock = tmp_path / "slow.gguf", model_loading_key("slow")
    models = {"slow": {"path": str(path), "memory_mb": 600}}  # memory_mb: no header read before the load
    gw = gateways.start(models=models)  # before the FIFO: the gateway reads no header of it
    for name in ("w1", "w2"):
        workers.start(name, models=models, backend__slots=2)
    wait_until_healthy(gw)
    os.mkfifo(path)
    answer: list[httpx.Response] = []
    asking = threading.Thread(target=lambda: answer.append(chat(gw.url, "slow", timeout=200)))
    asking.start()
    loader = wait_for(lambda: redis.get(lock), 30, "a worker to start loading").decode()
    time.sleep(4)  # past the lock's first life (three beats): the loader's heartbeat extends it
    assert redis.get(lock) == loader.encode() and not answer  # still loading
    survivor = next(w for w in workers if w.name != loader)
    next(w for w in workers if w.name == loader).kill()
    killed = time.monotonic()
    # its lock goes with its heartbeat (three 1 s intervals), not after a fixed 120 s
    wait_for(lambda: redis.get(lock) != loader.encode(), QUICK / 2, "the lock to go")
    print(f"the dead loader's lock went {time.monotonic() - killed:.1f} s after the kill")
    path.unlink()
    path.symlink_to(default_model_path())
    # the reaper hands the job back (its heartbeat's expiry and a reap: ~6 s), the survivor loads
    wait_for(lambda: redis.get(lock) == survivor.name.encode() or loaded(redis, survivor.name), QUICK,
             "the survivor to load the model")
    print(f"the survivor took the job {time.monotonic() - killed:.1f} s after the kill")
    asking.join(timeout=200)  # its few tokens: as slow as a busy CPU makes them
    assert answer and answer[0].status_code == 200, answer and answer[0].text
    assert answer[0].json()["choices"][0]["message"]["content"]
    lists(redis, survivor.name, ["slow"])
    assert redis.get(lock) is None  # released once loaded


def test_a_model_no_live_worker_can_hold_is_refused_at_once(workers: Any, gateways: Any, redis: Redis,
                                                            tmp_path: Path) -> None:
    """A worker whose memory budget is below the model's need: the gateway says so at once (a
    4xx naming the model, its need and the largest room) rather than leaving the request queued;
    once a worker with room for it is up, the same request is served."""
    model = tmp_path / "model.gguf"
    shutil.copyfile(default_model_path(), model)
    models = {"m": {"path": str(model)}}
    workers.start("small", models=models, backend__slots=2, memory_budget_mb=100)
    gw = gateways.start(models=models)
    wait_until_healthy(gw)
    started = time.monotonic()
    refused = chat(gw.url, "m", timeout=QUICK)
    assert time.monotonic() - started < 5
    assert 400 <= refused.status_code < 500, (refused.status_code, refused.text)
    error = refused.json()["error"]
    assert error["code"] == "model_too_large", error
    assert "'m'" in error["message"] and "100 MB" in error["message"], error["message"]
    assert not any(redis.llen(queue_key(q)) for q in queue_names("m"))  # nothing left waiting
    workers.start("big", models=models, backend__slots=2)
    wait_for(lambda: chat(gw.url, "m", timeout=QUICK).status_code == 200, QUICK, "the big worker to serve it")
    lists(redis, "big", ["m"])
    assert loaded(redis, "small") == []
