"""Gateway answers that misled clients, through the gateway's app in process and a worker on the
fake engine in process (real redis-server; a real `fleet serve` for the 413 a client reads while
it is still sending, which is the process's socket): embeddings of a non-text `input`, model
listings that ignored a tenant's allow-list, 429s for requests no wait can admit and their OpenAI
error type, what the Responses API let through, the interpreter's words about a huge number, and
a 413 that clients never read because the connection was closed while they were still sending."""

from __future__ import annotations

import time
from collections.abc import Iterator
from http.client import HTTPConnection
from typing import Any

import httpx
import openai
import pytest
from redis import Redis

from backends.contract.keys import tenant_queued_key
from tests.gateway_harness import Gateways, wait_until_healthy
from tests.gateway_inprocess import InProcessFleet
from tests.test_hostile_batch import auth, create, upload
from tests.test_hostile_gateway import clean_4xx

pytestmark = pytest.mark.timeout(300)
FAKE = {"backend__type": "fake", "backend__slots": 8}
TENANTS = {
    "narrow": {"api_keys": ["key-narrow"], "models": ["llm"]},
    "wide": {"api_keys": ["key-wide"]},
    "rpm": {"api_keys": ["key-rpm"], "requests_per_minute": 3},
    "tpm": {"api_keys": ["key-tpm"], "tokens_per_minute": 1},
    "conc": {"api_keys": ["key-conc"], "max_concurrent": 2},
    "queue": {"api_keys": ["key-queue"], "max_queued": 1},
}
SETTINGS = {"gateway__tenants": TENANTS, "gateway__models": {"llm": "llm", "other": "llm"}}


def started(fleet: InProcessFleet, *, gateways: Gateways | None = None, **settings: Any) -> str:
    """A fake-engine worker and a gateway with `settings` (a `fleet serve` process when `gateways`
    is given); the gateway's URL once it is healthy."""
    fleet.worker("w1", **FAKE, **settings)
    gw = gateways.start(**settings) if gateways is not None else fleet.start(**settings)
    wait_until_healthy(gw)
    return gw.url


def openai_error(response: httpx.Response, status: int, *words: str) -> dict[str, Any]:
    clean_4xx(response, status, *words)
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def test_embeddings_refuse_an_input_that_is_not_text_with_a_400_naming_input(
        inprocess_gateway: InProcessFleet) -> None:
    url = started(inprocess_gateway)
    with httpx.Client(base_url=url, timeout=60) as http:
        for value in (5, True, 5.5, {"a": "b"}, [[1, 2]], [3]):
            body = {"model": "llm", "input": value}
            error = openai_error(http.post("/v1/embeddings", json=body), 400, "input")
            assert error["param"] == "input" and error["type"] == "invalid_request_error", (value, error)
            ollama = http.post("/api/embed", json=body)
            clean_4xx(ollama, 400, "input")
            assert set(ollama.json()) == {"error"} and isinstance(ollama.json()["error"], str), ollama.text
        # token arrays stay refused in words that say what to send (as before)
        assert "send text" in http.post("/v1/embeddings", json={"model": "llm", "input": [3]}).text
        # text still passes the gateway and reaches the worker (whose fake engine embeds nothing)
        for text in ("one text", ["one", "two"]):
            for path in ("/v1/embeddings", "/api/embed"):
                reached = http.post(path, json={"model": "llm", "input": text})
                assert reached.status_code == 422 and "does not embed" in reached.text, (path, reached.text)


def test_a_tenant_lists_and_describes_only_the_models_it_may_use(inprocess_gateway: InProcessFleet) -> None:
    url = started(inprocess_gateway, **SETTINGS)
    with httpx.Client(base_url=url, timeout=30) as http:
        def names(path: str, key: str) -> list[str]:
            answer = http.get(path, headers=auth(key))
            assert answer.status_code == 200, answer.text
            body = answer.json()
            return [m["id"] for m in body["data"]] if "data" in body else [m["name"] for m in body["models"]]

        for path in ("/v1/models", "/api/tags", "/api/ps"):
            assert names(path, "key-narrow") == ["llm"], path
        # `other` is another name of the same pool: an id of its own to OpenAI's clients, the same
        # model (listed once) to Ollama's
        assert names("/v1/models", "key-wide") == ["llm", "other"]
        for path in ("/api/tags", "/api/ps"):
            assert names(path, "key-wide") == ["llm"], path
        hidden = openai_error(http.get("/v1/models/other", headers=auth("key-narrow")), 404, "other")
        assert hidden["code"] == "model_not_found" and "serves: llm)" in hidden["message"], hidden
        assert http.get("/v1/models/llm", headers=auth("key-narrow")).json()["id"] == "llm"
        assert http.get("/v1/models/other", headers=auth("key-wide")).json()["id"] == "other"
        shown = http.post("/api/show", json={"model": "other"}, headers=auth("key-narrow"))
        assert shown.status_code == 404 and shown.json() == {"error": "model 'other' not found"}
        assert http.post("/api/show", json={"model": "other"}, headers=auth("key-wide")).status_code == 200


def test_a_request_no_wait_can_admit_is_a_400_naming_the_limit_and_the_count(
        redis: Redis, inprocess_gateway: InProcessFleet) -> None:
    url = started(inprocess_gateway, **SETTINGS)
    with httpx.Client(base_url=url, timeout=60) as http:
        def ask(key: str, n: int) -> httpx.Response:
            return http.post("/v1/completions", headers=auth(key),
                             json={"model": "llm", "prompt": "one two", "max_tokens": 2, "n": n})

        for key, limit, allowed in (("key-conc", "max_concurrent", 2), ("key-queue", "max_queued", 1),
                                    ("key-rpm", "requests_per_minute", 3)):
            never = ask(key, allowed + 1)
            error = openai_error(never, 400, f"{allowed + 1} jobs at once", f"{limit} is {allowed}")
            assert error["param"] == "n" and "Retry-After" not in never.headers, (key, error)
            assert ask(key, allowed).status_code == 200, key  # as many as the limit allows: admitted
        # nothing was counted as a refusal: retrying would not have helped, waiting does not either
        assert not any(b"rejected" in field for key in redis.scan_iter("fleet:usage:*")
                       if redis.type(key) == b"hash" for field in redis.hkeys(key))


def test_tenant_429s_carry_openai_rate_limit_types(redis: Redis, inprocess_gateway: InProcessFleet) -> None:
    url = started(inprocess_gateway, **SETTINGS)
    # the rate counts are per minute of Redis's clock: start early in one, so the checks share it
    if (second := int(redis.time()[0]) % 60) > 45:
        time.sleep(61 - second)
    with httpx.Client(base_url=url, timeout=60) as http:
        def ask(key: str) -> httpx.Response:
            return http.post("/v1/completions", headers=auth(key),
                             json={"model": "llm", "prompt": "one two", "max_tokens": 2})

        assert ask("key-tpm").status_code == 200  # its tokens reach tokens_per_minute 1
        for _ in range(3):
            assert ask("key-rpm").status_code == 200
        # a job waits (as if no slot were free), so max_queued 1 is reached
        redis.zadd(tenant_queued_key("queue"), {"waiting-job": int(time.time() * 1000) + 60_000})
        for key, limit, kind in (("key-tpm", "tokens_per_minute", "tokens"),
                                 ("key-rpm", "requests_per_minute", "requests"),
                                 ("key-queue", "max_queued", "requests")):
            refused = ask(key)
            error = openai_error(refused, 429, limit)
            assert error["type"] == kind and error["code"] == "rate_limit_exceeded", (key, error)
            assert error["param"] == limit and int(refused.headers["Retry-After"]) >= 1


def test_responses_refuse_a_non_string_user_and_an_output_without_its_call(
        inprocess_gateway: InProcessFleet) -> None:
    url = started(inprocess_gateway)
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    with httpx.Client(base_url=url, timeout=60) as http:
        for user in (5, {"id": "u"}, ["u"], True):
            body = {"model": "llm", "input": "hi", "user": user}
            error = openai_error(http.post("/v1/responses", json=body), 400, "user")
            assert error["param"] == "user", error
        for items in ([ask, {"type": "function_call_output", "call_id": "call_2", "output": "sunny"}],
                      [ask, call, {"type": "function_call_output", "call_id": "call_9", "output": "sunny"}]):
            orphan = items[-1]["call_id"]
            error = openai_error(http.post("/v1/responses", json={"model": "llm", "input": items}), 400,
                                 f"No tool call found for function call output with call_id {orphan}")
            assert error["param"] == "input", error
        answered = [ask, call, {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
        ok = http.post("/v1/responses", json={"model": "llm", "input": answered, "user": "u-1"})
        assert ok.status_code == 200 and ok.json()["status"] == "completed", ok.text


def test_a_number_with_too_many_digits_is_a_400_in_the_clients_terms(
        inprocess_gateway: InProcessFleet) -> None:
    url = started(inprocess_gateway)
    huge = "9" * 4301
    with httpx.Client(base_url=url, timeout=60, headers={"content-type": "application/json"}) as http:
        for path, body in (("/v1/completions", '{"model": "llm", "prompt": "x", "max_tokens": %s}'),
                           ("/api/generate", '{"model": "llm", "prompt": "x", "options": {"seed": -%s}}'),
                           ("/v1/embeddings", '{"model": "llm", "input": "x", "dimensions": %s}')):
            text = clean_4xx(http.post(path, content=body % huge), 400, "too large", "4,301 digits")
            assert "int_max_str_digits" not in text and "sys." not in text, text
        # Python's own limit, and one digit less, are numbers like any other (max_tokens over the cap)
        clean_4xx(http.post("/v1/completions", content=b'{"model": "llm", "prompt": "x", "max_tokens": %s}'
                            % (b"9" * 4300)), 400, "gateway.max_tokens")
    # a batch line with such a number is a line error in the same words
    line = '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "llm", ' \
           f'"prompt": "x", "max_tokens": {huge}}}}}\n'
    made = create(url, upload(url, line.encode()).json()["id"])
    error = made.json()["errors"]["data"][0]
    assert "too large" in error["message"] and "int_max_str_digits" not in error["message"], error


def chunks(body: bytes, size: int = 65536) -> Iterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start:start + size]


def test_an_oversized_body_gets_its_413_read_by_python_clients(inprocess_gateway: InProcessFleet,
                                                               gateways: Gateways) -> None:
    limit = 8 * 1024 * 1024
    url = started(inprocess_gateway, gateways=gateways, gateway__max_body_bytes=limit)
    twice = b'{"model": "llm", "prompt": "' + b"x" * (2 * limit) + b'"}'
    # Python's own client sends the whole body before it reads the answer, and stops at the
    # first write error: a gateway that closes on unread bytes resets it mid-body
    for body in (twice, chunks(twice)):  # announced (Content-Length), then chunked
        conn = HTTPConnection("127.0.0.1", httpx.URL(url).port, timeout=60)
        try:
            conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            answer = conn.getresponse()
            assert answer.status == 413 and b"gateway.max_body_bytes" in answer.read()
        finally:
            conn.close()
    # httpx and the openai SDK (which read on after a write error: on this loopback they got the
    # 413 before too, over a network the reset can overtake it)
    with httpx.Client(base_url=url, timeout=60, headers={"content-type": "application/json"}) as client:
        for content in (twice, chunks(twice)):
            refused = client.post("/v1/completions", content=content)
            clean_4xx(refused, 413, "larger than", "gateway.max_body_bytes")
        fits = client.post("/v1/completions", json={"model": "llm", "prompt": "x", "max_tokens": 1})
        assert fits.status_code == 200, fits.text
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused_by_sdk:
        sdk.completions.create(model="llm", prompt="x" * (2 * limit), max_tokens=1)
    assert refused_by_sdk.value.status_code == 413, refused_by_sdk.value
