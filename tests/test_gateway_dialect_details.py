"""Details of the dialects that clients read, each through a `fleet serve` process over a real
redis-server and a fake-engine worker (the model is not the subject): names added by
`gateway.models` beside the pool's own and listed once per pool; the Responses stream's `event:`
lines; Anthropic's `request-id` header; Ollama's `keep_alive: 0` on a request that runs, and its
400 for `think` asked of a model that does not think."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.gateway_harness import wait_until_healthy
from tests.harness import wait_for
from tests.test_gateway_compat import GENERATED_ID

pytestmark = pytest.mark.timeout(300)
FAKE = {"backend__type": "fake", "backend__slots": 4}
WORDS = "one two three"


def started(workers: Any, gateways: Any, **settings: Any) -> Any:
    workers.start("w1", **FAKE, **settings)
    gw = gateways.start(**settings)
    wait_until_healthy(gw)
    return gw


def listed(http: httpx.Client, path: str, **kw: Any) -> list[str]:
    body = http.get(path, **kw).json()
    return [m["id"] for m in body["data"]] if "data" in body else [m["name"] for m in body["models"]]


def test_aliases_add_to_the_pools_own_name_and_the_pool_is_listed_once(workers, gateways) -> None:
    """An embeddings client's name and a chat alias for the one pool: `llm` stays, every name runs
    the pool, OpenAI's list has each id, Ollama's listings and llama-server's router one model
    (its workers' memory counted once), and the tokenizer routes need no `model`."""
    aliases = {"gateway__models": {"nomic-embed-text": "llm", "chat": "llm"}}
    gw = started(workers, gateways, **aliases)
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        assert sorted(listed(http, "/v1/models")) == ["chat", "llm", "nomic-embed-text"]
        for name in ("llm", "chat", "nomic-embed-text"):
            done = http.post("/v1/completions", json={"model": name, "prompt": WORDS, "max_tokens": 8})
            assert done.status_code == 200 and done.json()["choices"][0]["text"] == WORDS, (name, done.text)
        assert listed(http, "/api/tags") == ["llm"]
        wait_for(lambda: listed(http, "/api/ps") == ["llm"], 30, "the pool loaded, listed once")
        ps = http.get("/api/ps").json()["models"]
        assert ps[0]["workers"] == ["w1"] and ps[0]["size"] > 0
        router = http.get("/models").json()["data"]
        assert [(m["id"], m["aliases"]) for m in router] == [("llm", ["nomic-embed-text", "chat"])]
        # one pool, three names: llama-server's clients send no model, and reach the pool's worker
        # (whose fake engine has no tokenizer: its refusal, not the gateway's "'model' is required")
        for path, body in (("/tokenize", {"content": WORDS}),
                           ("/apply-template", {"messages": [{"role": "user", "content": WORDS}]})):
            reached = http.post(path, json=body)
            said = reached.json()["error"]["message"]
            assert said.startswith("this worker's engine (fake) does not "), (path, reached.text)


def events_of(raw: httpx.Response) -> list[tuple[str | None, dict[str, Any]]]:
    """(the `event:` line's name or None, the data) of each SSE event, as sent."""
    out = []
    for chunk in raw.text.split("\n\n"):
        if chunk.strip():
            lines = dict(line.split(": ", 1) for line in chunk.splitlines())
            out.append((lines.get("event"), json.loads(lines["data"])))
    return out


def test_a_responses_stream_names_each_event_as_openai_sends_it(workers, gateways) -> None:
    gw = started(workers, gateways)
    body = {"model": "llm", "input": WORDS, "max_output_tokens": 32, "stream": True}
    raw = httpx.post(f"{gw.url}/v1/responses", json=body, timeout=60)
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    events = events_of(raw)
    assert [name for name, _ in events] == [data["type"] for _, data in events]
    assert events[0][0] == "response.created" and events[-1][0] == "response.completed"
    # the official client's two ways of streaming read the same events
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    kinds = [data["type"] for _, data in events]
    created = list(client.responses.create(model="llm", input=WORDS, max_output_tokens=32, stream=True))
    assert [e.type for e in created] == kinds
    with client.responses.stream(model="llm", input=WORDS, max_output_tokens=32) as stream:
        assert [e.type for e in stream] == kinds
        assert stream.get_final_response().output_text == WORDS


def test_anthropic_answers_carry_the_request_id_the_sdk_reads(workers, gateways) -> None:
    gw = started(workers, gateways)
    client = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)
    ask: dict[str, Any] = {"model": "llm", "max_tokens": 8, "messages": [{"role": "user", "content": WORDS}]}
    message = client.messages.create(**ask)
    assert message.content[0].text == WORDS and GENERATED_ID.fullmatch(message._request_id or "")
    with client.messages.stream(**ask) as stream:
        assert "".join(stream.text_stream) == WORDS
        assert GENERATED_ID.fullmatch(stream.request_id or "")
    counted = client.messages.with_raw_response.count_tokens(model="llm", messages=ask["messages"])
    assert counted.headers["request-id"] == counted.headers["x-request-id"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(**{**ask, "model": "nope"})
    assert GENERATED_ID.fullmatch(missing.value.request_id or "")
    # a client's own id comes back under both names; the other APIs keep only theirs
    own = client.messages.with_raw_response.create(**ask, extra_headers={"x-request-id": "trace-7"})
    assert own.headers["request-id"] == own.headers["x-request-id"] == "trace-7"
    assert "request-id" not in httpx.get(f"{gw.url}/v1/models").headers


def test_ollama_keep_alive_zero_answers_then_unloads(workers, gateways) -> None:
    """Ollama's meaning: the request runs and answers, then its model is unloaded (no longer in
    `/api/ps`); whole and streamed, generate and chat. A tenant's keep_alive is only a hint: the
    model it shares stays."""
    tenants = {"gateway__tenants": {"t": {"api_keys": ["key-t"]}}, "gateway__admin_keys": ["key-admin"]}
    gw = started(workers, gateways, **tenants)
    client = ollama.Client(host=gw.url, headers={"Authorization": "Bearer key-admin"})
    tenant = ollama.Client(host=gw.url, headers={"Authorization": "Bearer key-t"})

    def loaded() -> list[str]:
        return [str(m.model) for m in client.ps().models]

    wait_for(lambda: loaded() == ["llm"], 30, "the pool listed in /api/ps")
    said = client.generate(model="llm", prompt=WORDS, keep_alive=0)
    assert said.response == WORDS and said.done_reason == "stop"
    assert loaded() == []
    assert client.generate(model="llm", prompt=WORDS).response == WORDS  # a request loads it again
    assert loaded() == ["llm"]
    chunks = list(client.chat(model="llm", messages=[{"role": "user", "content": WORDS}], keep_alive="0s",
                              stream=True))
    assert "".join(c.message.content or "" for c in chunks) == WORDS and chunks[-1].done
    assert loaded() == []
    assert tenant.generate(model="llm", prompt="").done_reason == "load"
    assert tenant.generate(model="llm", prompt=WORDS, keep_alive=0).response == WORDS
    assert loaded() == ["llm"]


def test_ollama_think_for_a_model_that_does_not_think_is_a_400(workers, gateways) -> None:
    gw = started(workers, gateways)
    messages = [{"role": "user", "content": WORDS}]
    chat = {"model": "llm", "messages": messages, "stream": False}
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        for think in (True, "high"):
            for path, body in (("/api/chat", chat), ("/api/generate", {"model": "llm", "prompt": WORDS})):
                refused = http.post(path, json={**body, "think": think})
                assert refused.status_code == 400, (path, think, refused.text)
                assert refused.json() == {"error": '"llm" does not support thinking'}  # Ollama's words
        assert http.post("/api/chat", json={**chat, "think": "bogus"}).status_code == 400
        off = http.post("/api/chat", json={**chat, "think": False})
        assert off.status_code == 200 and off.json()["message"]["content"] == WORDS
    client = ollama.Client(host=gw.url)
    with pytest.raises(ollama.ResponseError) as raised:
        client.chat(model="llm", messages=messages, think=True)
    assert raised.value.status_code == 400 and "does not support thinking" in raised.value.error
