"""A catalogue model fetched from its URL (backends/fetch.py) from a real HTTP server
(tests/model_server.py): a cut transfer resumed with Range, a wrong sha256 refused and removed,
a file larger than the disk's free space refused before any byte, one download of a file per
host, a slow server; and a real `fleet worker` that fetches the embedded model on a job's first
need and answers, or fails the job saying expected vs got."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from backends.fetch import FetchError, fetch, partial_of
from backends.model import default_model_path, file_digest
from dispatcher.client import Fleet
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
