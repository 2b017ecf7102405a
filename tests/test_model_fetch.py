"""A catalogue model fetched from its URL (backends/fetch.py) from a real HTTP server
(tests/model_server.py): a cut transfer resumed with Range, a wrong sha256 refused and removed,
a file larger than the disk's free space refused before any byte, one download of a file per
host, a slow server; and a real `fleet worker` that fetches the embedded model on a job's first
need and answers, or fails the job saying expected vs got."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis

from backends.contract.keys import CATALOGUE_KEY, worker_key
from backends.fetch import FetchError, fetch, partial_of
from backends.model import default_model_path, file_digest
from dispatcher.client import Fleet
from ecosystem.local.processes import wait_for, wait_until_healthy
from tests.model_server import model_server

pytestmark = pytest.mark.timeout(300)
SIZE = 3 * 2**20 + 12345


@pytest.fixture
def blob(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "served" / "model.gguf"
    path.parent.mkdir()
    path.write_bytes(os.urandom(SIZE))
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_cut_transfer_resumes_with_range(blob: tuple[Path, str], tmp_path: Path) -> None:
    src, digest = blob
    dest = tmp_path / "cache" / f"{digest}.gguf"
    with model_server({"/m.gguf": src}) as server:
        server.cut_after["/m.gguf"] = SIZE // 3
        seen: list[tuple[int, int]] = []
        fetch(f"{server.url}/m.gguf", digest, dest, lambda done, total: seen.append((done, total)))
    assert dest.read_bytes() == src.read_bytes()
    assert not partial_of(dest).exists()
    first, second = server.requests
    assert first.range is None and first.sent == SIZE // 3
    assert second.range == f"bytes={SIZE // 3}-" and second.sent == SIZE - SIZE // 3  # only the rest
    assert seen[-1] == (SIZE, SIZE) and all(total == SIZE for _, total in seen[-3:])


def test_a_partial_left_by_a_killed_fetch_is_resumed(blob: tuple[Path, str], tmp_path: Path) -> None:
    src, digest = blob
    dest = tmp_path / "cache" / f"{digest}.gguf"
    dest.parent.mkdir()
    partial_of(dest).write_bytes(src.read_bytes()[:1000])
    with model_server({"/m.gguf": src}) as server:
        fetch(f"{server.url}/m.gguf", digest, dest)
    assert [r.range for r in server.requests] == ["bytes=1000-"]
    assert dest.read_bytes() == src.read_bytes()


def test_a_wrong_sha256_is_refused_and_the_file_removed(blob: tuple[Path, str], tmp_path: Path) -> None:
    src, digest = blob
    wrong = "0" * 64
    dest = tmp_path / "cache" / f"{wrong}.gguf"
    with model_server({"/m.gguf": src}) as server, pytest.raises(FetchError) as err:
        fetch(f"{server.url}/m.gguf", wrong, dest)
    assert f"expected {wrong}, got {digest}" in str(err.value)
    assert not dest.exists() and not partial_of(dest).exists()


def test_a_file_the_disk_cannot_hold_is_refused_before_download(tmp_path: Path) -> None:
    dest = tmp_path / "cache" / "big.gguf"
    with model_server({}) as server, pytest.raises(FetchError) as err:
        fetch(f"{server.url}/huge.gguf", "0" * 64, dest)
    assert "not enough disk space" in str(err.value) and "MB free" in str(err.value)
    assert not partial_of(dest).exists()  # not one byte written


def test_one_download_of_a_file_per_host(blob: tuple[Path, str], tmp_path: Path) -> None:
    src, digest = blob
    dest = tmp_path / "cache" / f"{digest}.gguf"
    with model_server({"/m.gguf": src}) as server:
        server.pause = 0.005  # slow enough that the fetches overlap
        errors: list[BaseException] = []

        def one() -> None:
            try:
                fetch(f"{server.url}/m.gguf", digest, dest)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=one) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not errors, errors
    assert len(server.requests) == 1, server.requests  # the others waited and found the file
    assert dest.read_bytes() == src.read_bytes()


def test_a_redirect_as_hugging_face_answers_is_followed(blob: tuple[Path, str], tmp_path: Path) -> None:
    src, digest = blob
    dest = tmp_path / "cache" / f"{digest}.gguf"
    with model_server({"/m.gguf": src}) as server:
        fetch(f"{server.url}/redirect/m.gguf", digest, dest)
    assert dest.read_bytes() == src.read_bytes()


@pytest.fixture(scope="module")
def gguf() -> tuple[Path, str]:
    path = default_model_path()
    return path, file_digest(path)


@pytest.mark.model
def test_a_worker_fetches_its_model_on_first_need(workers: Any, redis_url: str, redis: Redis,
                                                  tmp_path: Path, gguf: tuple[Path, str]) -> None:
    path, digest = gguf
    cache = tmp_path / "models"
    with model_server({"/gemma.gguf": path}) as server:
        server.cut_after["/gemma.gguf"] = path.stat().st_size // 2
        models = {"pulled": {"url": f"{server.url}/gemma.gguf", "sha256": digest},
                  "bad": {"url": f"{server.url}/gemma.gguf", "sha256": "f" * 64}}
        workers.start("w1", models=models, model_cache_dir=str(cache), backend__slots=2)
        answer = Fleet(redis_url, pool="pulled").submit(prompt="Say hi.", max_tokens=4).result(timeout=240)
        assert answer.finish_reason in ("length", "stop") and answer.text, answer
        assert (cache / f"{digest}.gguf").stat().st_size == path.stat().st_size
        assert [r.range is not None for r in server.requests] == [False, True]  # cut, then resumed
        with pytest.raises(Exception) as err:
            Fleet(redis_url, pool="bad").submit(prompt="Say hi.", max_tokens=4).result(timeout=240)
    assert f"expected {'f' * 64}, got {digest}" in str(err.value), err.value
    assert not (cache / f"{'f' * 64}.gguf").exists()


# -- the live catalogue through the gateway: pull, copy, delete ------------------------------------------

KEYS = {"gateway__admin_keys": ["key-admin"], "gateway__tenants": {"acme": {"api_keys": ["key-acme"]}}}


def ndjson(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) for line in response.text.splitlines() if line.strip()]


def tags(url: str) -> set[str]:
    return {m["name"] for m in httpx.get(f"{url}/api/tags", timeout=30).json()["models"]}


def answering(url: str) -> bool:
    try:
        return httpx.get(f"{url}/api/version", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_only_an_operator_changes_the_catalogue_and_bad_bodies_are_named(gateways: Any, redis: Redis,
                                                                         tmp_path: Path) -> None:
    gw = gateways.start(**KEYS, model_cache_dir=str(tmp_path))
    wait_for(lambda: answering(gw.url), 30, "the gateway to answer")  # no worker: not healthy
    tenant, admin = {"Authorization": "Bearer key-acme"}, {"Authorization": "Bearer key-admin"}
    calls = [("POST", "/api/pull", {"model": "x", "url": "http://h/x.gguf", "sha256": "a" * 64}),
             ("POST", "/api/copy", {"source": "x", "destination": "y"}),
             ("DELETE", "/api/delete", {"model": "x"})]
    for method, path, body in calls:
        r = httpx.request(method, gw.url + path, json=body, headers=tenant, timeout=30)
        assert r.status_code == 403 and "operator" in r.json()["error"], (path, r.text)
    assert redis.hgetall(CATALOGUE_KEY) == {}
    bad = [({"model": "x", "url": "ftp://h/x", "sha256": "a" * 64}, "url"),
           ({"model": "x", "url": "http://h/x.gguf"}, "sha256"),
           ({"model": "x", "url": "http://h/x.gguf", "sha256": "../../etc/passwd"}, "sha256"),
           ({"model": "x", "url": "http://h/x.gguf", "sha256": "a" * 64, "slots": -1}, "slots"),
           ({"model": ""}, "model"), ({"model": "nope"}, "not in the catalogue")]
    for payload, named in bad:
        r = httpx.post(f"{gw.url}/api/pull", json=payload, headers=admin, timeout=30)
        assert 400 <= r.status_code < 500 and named in r.json()["error"], (payload, r.status_code, r.text)
    r = httpx.request("DELETE", f"{gw.url}/api/delete", json={"model": "nope"}, headers=admin, timeout=30)
    assert r.status_code == 404, r.text
    assert redis.hgetall(CATALOGUE_KEY) == {}


@pytest.mark.model
def test_pull_copy_delete_live_through_the_gateway(workers: Any, gateways: Any, redis: Redis,
                                                   tmp_path: Path, gguf: tuple[Path, str]) -> None:
    """The ollama client pulls a catalogue model from its URL (a cut transfer resumed on the way)
    with progress; an operator adds one by URL; copy and delete are seen by a second gateway too;
    a chat answers on the pulled model; a wrong sha256 is the pull's error; no process restarts."""
    import ollama

    path, digest = gguf
    size = path.stat().st_size
    with model_server({"/gemma.gguf": path}) as server:
        server.cut_after["/gemma.gguf"] = size // 3
        url = f"{server.url}/gemma.gguf"
        models = {"base": {"path": str(path)}, "remote": {"url": url, "sha256": digest}}
        cache = {"model_cache_dir": str(tmp_path / "models")}
        workers.start("w1", models=models, backend__slots=2, **cache)
        gw, other = gateways.start(models=models, **cache), gateways.start(models=models, **cache)
        wait_until_healthy(gw)
        wait_until_healthy(other)
        client = ollama.Client(host=gw.url)
        progress = list(client.pull("remote", stream=True))
        assert progress[0].status == "pulling manifest" and progress[-1].status == "success", progress
        sizes = [(p.completed, p.total) for p in progress if p.total]
        assert sizes and sizes[-1] == (size, size) and len(sizes) >= 2, sizes
        assert [r.range is not None for r in server.requests] == [False, True]  # cut, then resumed
        answer = client.chat(model="remote", messages=[{"role": "user", "content": "Say hi."}],
                             options={"num_predict": 4, "temperature": 0})
        assert answer.message.content, answer
        # added by URL: the same file, so no second download; stream false answers once
        r = httpx.post(f"{gw.url}/api/pull", json={"model": "added", "url": url, "sha256": digest,
                                                    "stream": False}, timeout=240)
        assert r.json() == {"status": "success"}, r.text
        assert len(server.requests) == 2
        wait_for(lambda: "added" in tags(other.url), 5, "the other gateway lists the added model")
        client.copy("added", "added-copy")
        wait_for(lambda: "added-copy" in tags(other.url), 5, "the other gateway lists the copy")
        chat = ollama.Client(host=other.url).chat(model="added-copy", options={"num_predict": 2},
                                                  messages=[{"role": "user", "content": "Hi"}])
        assert chat.message.content is not None
        client.delete("added-copy")
        client.delete("remote")  # a config file's model: gone from the live catalogue too
        assert {"added-copy", "remote"}.isdisjoint(tags(gw.url))
        wait_for(lambda: {"added-copy", "remote"}.isdisjoint(tags(other.url)), 5, "deleted everywhere")
        with pytest.raises(ollama.ResponseError) as gone:
            client.chat(model="added-copy", messages=[{"role": "user", "content": "Hi"}])
        assert gone.value.status_code == 404
        wrong = httpx.post(f"{gw.url}/api/pull", json={"model": "bad", "url": url, "sha256": "f" * 64},
                           timeout=240)
        lines = ndjson(wrong)
        assert "error" in lines[-1] and f"expected {'f' * 64}, got {digest}" in lines[-1]["error"], lines
        failed = httpx.post(f"{gw.url}/api/pull", json={"model": "bad", "stream": False}, timeout=240)
        assert failed.status_code == 400 and "sha256 mismatch" in failed.json()["error"], failed.text
        # the same through `fleet models`
        pulled = fleet_models(gw.url, "pull", "by-cli", "--from", url, "--sha256", digest)
        assert pulled.returncode == 0 and "success" in pulled.stderr, pulled.stderr
        assert fleet_models(gw.url, "cp", "by-cli", "by-cli-2").returncode == 0
        assert {"by-cli", "by-cli-2"} <= set(fleet_models(gw.url, "ls").stdout.split())
        assert fleet_models(gw.url, "rm", "by-cli-2").returncode == 0
        assert "by-cli-2" not in tags(gw.url)
        refused = fleet_models(gw.url, "pull", "bad-cli", "--from", url, "--sha256", "e" * 64)
        assert refused.returncode == 1, refused.stderr
        assert f"expected {'e' * 64}, got {digest}" in refused.stderr.replace("\n", ""), refused.stderr
        unknown = fleet_models(gw.url, "rm", "nothing-such")
        assert unknown.returncode == 1 and "not in the catalogue" in unknown.stderr, unknown.stderr


def fleet_models(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ecosystem.cli", "models", *args, "--url", url],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "COLUMNS": "200"})


@pytest.mark.model
def test_a_worker_left_with_no_model_stays_and_serves_one_pulled_later(workers: Any, gateways: Any,
                                                                        redis: Redis, tmp_path: Path,
                                                                        gguf: tuple[Path, str]) -> None:
    """Every model deleted: the worker lives on serving none (its status says so); a model pulled
    then is served by the same process."""
    import ollama

    path, digest = gguf
    models = {"base": {"path": str(path)}}
    w = workers.start("w1", models=models, model_cache_dir=str(tmp_path / "models"))
    gw = gateways.start(models=models)
    wait_until_healthy(gw)
    client = ollama.Client(host=gw.url)
    assert client.generate(model="base", prompt="Hi", options={"num_predict": 2}).done
    client.delete("base")
    wait_for(lambda: worker_pools(redis, "w1") == [], 10, "the worker serves no model")
    time.sleep(2)  # idle waits with no model to wake it
    assert w.alive() and worker_pools(redis, "w1") == []
    assert "worker loop error" not in w.log.read_text()  # its idle wait works with no model
    with model_server({"/gemma.gguf": path}) as server:
        r = httpx.post(f"{gw.url}/api/pull", json={"model": "back", "url": f"{server.url}/gemma.gguf",
                                                    "sha256": digest, "stream": False}, timeout=240)
        assert r.json() == {"status": "success"}, r.text
    assert worker_pools(redis, "w1") == ["back"]
    assert client.generate(model="back", prompt="Hi", options={"num_predict": 2}).done


def worker_pools(redis: Redis, name: str) -> list[str] | None:
    raw = redis.hget(worker_key(name), "pools")
    return None if raw is None else json.loads(raw)
