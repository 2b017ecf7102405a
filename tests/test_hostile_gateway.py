"""Hostile input against the gateway: every refusal is a 4xx that names the problem (or a closed
connection for a head that never ends), never a 5xx, a hang or a Python type name.

A real `fleet serve` with raw sockets where the process's socket is the subject (an announced 1 GB
body, a trickle, a head that never ends); the gateway's app in process with the fake backend where
only its answers matter; the real model where the job must run (a failing schema, a request that
outlives gateway.request_timeout: the shared real fleet's worker)."""

from __future__ import annotations

import contextlib
import json
import re
import select
import socket
import time

import httpx
import pytest

from dispatcher import Fleet
from tests.gateway_harness import GatewayProcess, wait_until_healthy
from tests.gateway_inprocess import InProcessFleet

pytestmark = pytest.mark.timeout(300)
FAKE = {"backend__type": "fake", "backend__slots": 4}
PROMPT = "Once upon a time"
JSON = {"content-type": "application/json"}
OLLAMA_BODY = json.dumps({"model": "llm", "prompt": PROMPT, "stream": False, "options": {"num_predict": 2}})
PYTHON_TYPE = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception)\b|Traceback")


def clean_4xx(response: httpx.Response, status: int, *words: str) -> str:
    """The response is `status`, JSON, and names `words`, with no Python internals in it."""
    text = response.text
    assert response.status_code == status, (response.status_code, text[:500])
    response.json()
    assert not PYTHON_TYPE.search(text), text
    for word in words:
        assert word in text, (word, text)
    return text


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    return int(answer.split(b" ", 2)[1])


def exchange(gw: GatewayProcess, head: bytes, body: bytes = b"", *, wait: float) -> tuple[bytes, float]:
    """Send a raw request (head, then the start of a body); what comes back within `wait` s, and
    after how long (b"" if the gateway closed the connection without a word)."""
    sock = socket.create_connection(("127.0.0.1", gw.port))
    try:
        with contextlib.suppress(OSError):  # refused before all was read: the answer is still there
            sock.sendall(head + body)
        sock.settimeout(wait)
        started = time.monotonic()
        return read_answer(sock), time.monotonic() - started
    finally:
        sock.close()


def read_answer(sock: socket.socket) -> bytes:
    """Everything the gateway writes until it closes (or goes quiet past the socket's timeout)."""
    answer = b""
    try:
        while part := sock.recv(65536):
            answer += part
    except TimeoutError:
        return answer or b"<no answer>"
    except ConnectionResetError:
        pass
    return answer


def post_head(path: str, ctype: str, length: int | None = None, extra: str = "") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: {ctype}\r\n{size}{extra}\r\n".encode()


def test_malformed_json_bodies_get_a_named_400_never_a_500(inprocess_gateway: InProcessFleet) -> None:
    gw = inprocess_gateway.start()  # no worker: every body here is refused before any job exists
    deep = b"[" * 100_000 + b"]" * 100_000  # past the C scanner's recursion: RecursionError
    nested = b"[" * 200 + b"]" * 200  # parses, then nests past gateway.max_json_depth
    routes = {"/v1/completions": b'"model":"llm","prompt":"x"', "/v1/chat/completions": b'"model":"llm"',
              "/api/generate": b'"model":"llm","prompt":"x"', "/api/chat": b'"model":"llm"',
              "/v1/batches": b'"endpoint":"/v1/completions","completion_window":"24h"'}
    with httpx.Client(base_url=gw.url, headers=JSON, timeout=30) as http:
        for path, fields in routes.items():
            for value in (deep, nested):
                clean_4xx(http.post(path, content=b"{" + fields + b',"stop":' + value + b"}"), 400,
                          "gateway.max_json_depth")
            # a lone surrogate, sent as the JSON escape, as a value that is echoed and as a field name
            clean_4xx(http.post(path, content=b'{"model":"\\ud800","prompt":"x","input_file_id":"\\udfff"}'),
                      400, "surrogate")
            clean_4xx(http.post(path, content=b"{" + fields + b',"\\ud800x":1}'), 400, "surrogate")
            clean_4xx(http.post(path, content=b'{"model":"llm","prompt":"\xff\xfe"}'), 400, "UTF-8")
            clean_4xx(http.post(path, content=b"[1, 2]"), 400, "JSON object")
            clean_4xx(http.post(path, content=b'{"model": NaN}'), 400, "not JSON")
        # a surrogate pair is text: it reaches the model check (404 naming the model, as ASCII JSON)
        pair = http.post("/v1/completions", content=b'{"model":"\\ud83d\\ude00","prompt":"x"}')
        clean_4xx(pair, 404, "model")
        assert "\U0001f600" in pair.json()["error"]["message"] and pair.content.isascii()
        weird = http.post("/v1/completions", content=b'{"model":"llm","prompt":"x","\\u0000\\u001b[31m":1}')
        clean_4xx(weird, 400, "is not supported")
        assert weird.json()["error"]["param"] == "\\x00\\x1b[31m"
    assert gw.alive() and "Traceback" not in gw.output()


def test_json_routes_take_only_application_json(inprocess_gateway: InProcessFleet) -> None:
    inprocess_gateway.worker("w1", **FAKE)
    gw = inprocess_gateway.start()
    wait_until_healthy(gw)
    body = json.dumps({"model": "llm", "prompt": PROMPT, "max_tokens": 2}).encode()
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        # what a web page's plain <form> or fetch(no-cors) can send without a CORS preflight: not
        # on OpenAI's routes (Ollama's read JSON whatever the type, as Ollama does, and rely on the
        # cross-site check alone: tests/test_conformance.py)
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            for path in ("/v1/completions", "/v1/chat/completions", "/v1/batches"):
                clean_4xx(http.post(path, content=body, headers={"content-type": ctype}), 415,
                          "application/json", ctype.split(";")[0])
            ollama = http.post("/api/generate", content=OLLAMA_BODY, headers={"content-type": ctype})
            assert ollama.status_code == 200, ollama.text
        clean_4xx(http.post("/v1/completions", content=body), 415, "none")
        clean_4xx(http.post("/v1/completions", content=body, headers={"content-type": "application/json; "
                                                                        "charset=latin-1"}), 415)
        clean_4xx(http.post("/v1/files", content=body, headers=JSON), 415, "multipart/form-data")
        utf8 = {"content-type": "application/json; charset=utf-8"}
        ok = http.post("/v1/completions", content=body, headers=utf8)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"]


def test_oversized_bodies_get_413_at_once(gateways) -> None:
    gw = gateways.start(gateway__max_body_bytes=64 * 1024, gateway__max_upload_bytes=256 * 1024)
    # announced: answered before a byte of the body is read
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/batches", "/api/generate", "/v1/files"):
        ctype = "multipart/form-data; boundary=b" if path == "/v1/files" else "application/json"
        answer, took = exchange(gw, post_head(path, ctype, 1_000_000_000), b'{"model":', wait=10)
        assert status_of(answer) == 413 and took < 10, (path, answer[:300])
        assert b"larger than" in answer and b"Traceback" not in answer
    # not announced (chunked): refused as soon as the bytes read pass the limit
    for path, limit in (("/v1/completions", 64 * 1024), ("/v1/files", 256 * 1024)):
        ctype = "multipart/form-data; boundary=b" if path == "/v1/files" else "application/json"
        sock = socket.create_connection(("127.0.0.1", gw.port))
        sock.sendall(post_head(path, ctype))
        if path == "/v1/files":  # a well-formed part, so that only the size is wrong
            part = (b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n'
                    b"Content-Type: application/jsonl\r\n\r\n")
            sock.sendall(b"%x\r\n%s\r\n" % (len(part), part))
        chunk = b"x" * 8192
        sent, answered = 0, False
        while sent < 8 * limit and not answered:
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:
                break  # the gateway closed after answering
            sent += len(chunk)
            answered = bool(select.select([sock], [], [], 0)[0])
        sock.settimeout(10)
        answer = read_answer(sock)
        sock.close()
        assert status_of(answer) == 413 and b"larger than" in answer, (path, sent, answer[:300])
    assert gw.alive() and "Traceback" not in gw.output()


def test_slow_bodies_get_408_and_slow_or_huge_heads_end(gateways) -> None:
    gw = gateways.start(gateway__body_timeout=2, gateway__header_timeout=2, gateway__max_header_bytes=16384)
    # a body that stops: 408 once gateway.body_timeout has passed
    answer, took = exchange(gw, post_head("/v1/completions", "application/json", 100), b"{", wait=8)
    assert status_of(answer) == 408 and 1.5 < took < 6, (answer[:300], took)
    assert b"gateway.body_timeout" in answer
    # a head that never ends: 408, the connection closes
    answer, took = exchange(gw, b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n", wait=8)
    assert status_of(answer) == 408 and took < 6, (answer[:300], took)
    # a connection that never says anything is closed
    answer, took = exchange(gw, b"", wait=8)
    assert answer == b"" and took < 6, (answer[:300], took)
    # a head larger than gateway.max_header_bytes: refused at once
    huge = b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n" + b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000)
                                                              for i in range(200)) + b"\r\n"
    answer, took = exchange(gw, huge, wait=8)
    assert status_of(answer) == 431 and took < 6, (answer[:300], took)
    # a body trickling below gateway.body_min_rate (1 KiB/s after 5 s) ends too, timeout or not
    slow = gateways.start(gateway__body_timeout=120)
    sock = socket.create_connection(("127.0.0.1", slow.port))
    sock.sendall(post_head("/v1/completions", "application/json", 100_000))
    started, answer = time.monotonic(), b""
    while time.monotonic() - started < 20 and not answer:
        with contextlib.suppress(OSError):
            sock.sendall(b" " * 10)
        if select.select([sock], [], [], 0.5)[0]:
            sock.settimeout(5)
            answer = read_answer(sock)
    sock.close()
    assert status_of(answer) == 408 and b"gateway.body_min_rate" in answer, answer[:300]
    assert time.monotonic() - started < 10
    # both still serve
    assert httpx.get(f"{gw.url}/api/version").status_code == 200
    assert httpx.get(f"{slow.url}/api/version").status_code == 200


def test_cross_site_browser_requests_are_refused(inprocess_gateway: InProcessFleet) -> None:
    inprocess_gateway.worker("w1", **FAKE)
    gw = inprocess_gateway.start(gateway__trusted_origins=["https://ui.example:8443"])
    wait_until_healthy(gw)
    body = {"model": "llm", "prompt": PROMPT, "max_tokens": 2}
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        host = http.base_url.netloc.decode()
        for headers, why in (({"sec-fetch-site": "cross-site"}, "Sec-Fetch-Site"),
                             ({"sec-fetch-site": "same-site"}, "Sec-Fetch-Site"),
                             ({"origin": "http://evil.example"}, "Origin"),
                             ({"origin": f"http://{host.split(':')[0]}:1"}, "Origin"),
                             ({"origin": "null"}, "Origin")):
            for method, path in (("POST", "/v1/completions"), ("POST", "/api/generate"),
                                 ("POST", "/v1/batches/batch_0123456789abcdef01234567/cancel"),
                                 ("DELETE", "/v1/files/file-0123456789abcdef01234567"),
                                 ("POST", "/v1/files")):
                refused = http.request(method, path, json=body, headers=headers)
                clean_4xx(refused, 403, why, "refused")
        # the gateway's own origin, a browser's direct navigation, a trusted origin, and SDKs pass
        for headers in ({"origin": f"http://{host}", "sec-fetch-site": "same-origin"},
                        {"sec-fetch-site": "none"},
                        {"origin": "https://ui.example:8443", "sec-fetch-site": "cross-site"}, {}):
            ok = http.post("/v1/completions", json=body, headers=headers)
            assert ok.status_code == 200, (headers, ok.text)
        reads = http.get("/v1/models", headers={"sec-fetch-site": "cross-site"})
        assert reads.status_code == 200  # reading is not refused


def test_gateway_limits_on_choices_and_max_tokens(inprocess_gateway: InProcessFleet) -> None:
    inprocess_gateway.worker("w1", **FAKE)
    gw = inprocess_gateway.start()
    wait_until_healthy(gw)
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        many = http.post("/v1/completions", json={"model": "llm", "prompt": PROMPT, "n": 16, "max_tokens": 2})
        clean_4xx(many, 400, "gateway.max_n")
        assert many.json()["error"]["param"] == "n"
        three_by_three = {"model": "llm", "prompt": [PROMPT] * 3, "n": 3, "max_tokens": 2}
        clean_4xx(http.post("/v1/completions", json=three_by_three), 400, "gateway.max_n")
        eight = http.post("/v1/completions", json={"model": "llm", "prompt": PROMPT, "n": 8, "max_tokens": 2})
        assert eight.status_code == 200 and len(eight.json()["choices"]) == 8
        long = http.post("/v1/completions", json={"model": "llm", "prompt": PROMPT, "max_tokens": 8000})
        clean_4xx(long, 400, "gateway.max_tokens", "4096")
        assert long.json()["error"]["param"] == "max_tokens"
        chat = {"model": "llm", "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 5000}
        clean_4xx(http.post("/v1/chat/completions", json=chat), 400, "gateway.max_tokens")
        ollama = {"model": "llm", "prompt": PROMPT, "options": {"num_predict": 8000}, "stream": False}
        clean_4xx(http.post("/api/generate", json=ollama), 400, "options.num_predict", "gateway.max_tokens")
        fits = http.post("/v1/completions", json={"model": "llm", "prompt": PROMPT, "max_tokens": 4096})
        assert fits.status_code == 200


BAD_SCHEMA = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}  # valid; no grammar


@pytest.mark.model
def test_failed_jobs_are_422_naming_the_jobs_without_python_internals(
        workers, inprocess_gateway: InProcessFleet) -> None:
    worker = workers.start("w1", backend__slots=2)  # its own: the test reads its log
    gw = inprocess_gateway.start()
    wait_until_healthy(gw)
    with httpx.Client(base_url=gw.url, timeout=120) as http:
        ollama = http.post("/api/generate", json={"model": "llm", "prompt": PROMPT, "format": BAD_SCHEMA,
                                                  "stream": False})
        clean_4xx(ollama, 422, "cannot be turned into a grammar")
        assert ollama.headers["x-fleet-job-id"] and set(ollama.json()) == {"error"}
        streamed = http.post("/api/chat", json={"model": "llm", "format": BAD_SCHEMA,
                                                "messages": [{"role": "user", "content": "hi"}]})
        last = json.loads(streamed.text.splitlines()[-1])
        assert streamed.status_code == 200 and "cannot be turned into a grammar" in last["error"]
        assert not PYTHON_TYPE.search(streamed.text), streamed.text
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}
        openai = http.post("/v1/completions", json={"model": "llm", "prompt": PROMPT, "response_format": fmt})
        clean_4xx(openai, 422, "cannot be turned into a grammar")
        assert openai.headers["x-fleet-job-id"] and openai.json()["error"]["code"] == "job_failed"
    gw.stop()
    assert "AssertionError" in worker.output()  # the converter's own words stay in the worker's log


@pytest.mark.model
def test_request_timeout_cancels_the_jobs_and_names_them(
        real_fleet, inprocess_gateway: InProcessFleet) -> None:
    gw = inprocess_gateway.start(over=real_fleet.redis_url, gateway__request_timeout=3)
    wait_until_healthy(gw)
    fleet = Fleet(real_fleet.redis_url)
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        started = time.monotonic()
        late = http.post("/v1/completions", json={"model": "llm", "prompt": PROMPT, "max_tokens": 4000,
                                                  "temperature": 0})
        assert time.monotonic() - started < 20
        assert late.status_code == 504 and late.json()["error"]["code"] == "timeout", late.text
        assert "gateway.request_timeout" in late.text and not PYTHON_TYPE.search(late.text)
        job_id = late.headers["x-fleet-job-id"]
        gone = fleet.job(job_id).result(timeout=30)
        assert gone["finish_reason"] == "cancelled" and gone["usage"]["completion_tokens"] < 4000
        assert fleet.job(job_id).status() == "canceled"
        # streaming: the NDJSON stream ends in an error line, and the job is cancelled as well
        stream = http.post("/api/generate", json={"model": "llm", "prompt": PROMPT, "options": {
            "num_predict": 4000, "temperature": 0}})
        lines = [json.loads(line) for line in stream.text.splitlines()]
        assert stream.status_code == 200 and "gateway.request_timeout" in lines[-1]["error"]
        streamed = fleet.job(stream.headers["x-fleet-job-id"]).result(timeout=30)
        assert streamed["finish_reason"] == "cancelled"
