"""The gateway driven by the official `openai` and `ollama` Python clients (and raw HTTP where a
client hides the detail): the shared real fleet (`fleet serve` and a worker on the real model) where
the model answers; the gateway's app in process with a fake-engine worker where the subject is a
refusal, a header or the queue (no model needed to get there); a `fleet serve` process of its own
where the process is the subject (a restart).

The embedded model has no chat template of its own; the in-process engine formats chats with
llama.cpp's built-in `gemma` template (backend.chat_template), so chat works on the default setup.
The llama-server backend's chat: tests/test_gateway_llama_server.py."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dispatcher import Fleet
from tests.gateway_harness import start_gateway, wait_until_healthy
from tests.test_gateway_llama_server import ASK, PERSON

pytestmark = pytest.mark.timeout(300)
PROMPT = "Once upon a time"
LONG = " ".join(["word"] * 2000)  # the fake engine says it back a word a step: a job that lasts


def oai(gw, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)


def first_chunk(response: httpx.Response) -> tuple[str, Iterator[str]]:
    """Read a streaming response up to its first text chunk: (its job id, the rest of the lines)."""
    lines = response.iter_lines()
    while not next(lines).startswith("data: {"):
        pass
    return response.headers["x-fleet-job-id"], lines


@pytest.mark.model
def test_openai_completions_sync_async_stream_n_stop_usage(real_fleet) -> None:
    gw = real_fleet
    client = oai(gw)

    whole = client.completions.create(model="llm", prompt=PROMPT, max_tokens=12, temperature=0)
    text = whole.choices[0].text
    assert text and whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 0
    assert whole.object == "text_completion" and whole.model == "llm"

    # streaming, with usage: the same greedy text, delta by delta, then a usage chunk
    chunks = list(client.completions.create(model="llm", prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    # stop: the text ends before the stop string, finish_reason "stop"
    stop_word = text.strip().split()[1]
    cut = client.completions.create(model="llm", prompt=PROMPT, max_tokens=12, temperature=0,
                                    stop=[stop_word])
    assert cut.choices[0].finish_reason == "stop"
    assert text.startswith(cut.choices[0].text) and stop_word not in cut.choices[0].text

    # n=2: two jobs, two choices (seeded, so choice 1 uses seed + 1)
    two = client.completions.create(model="llm", prompt=PROMPT, max_tokens=8, temperature=0.9, seed=7, n=2)
    assert sorted(c.index for c in two.choices) == [0, 1] and all(c.text for c in two.choices)
    assert two.usage is not None and two.usage.completion_tokens == 16

    async def async_client() -> tuple[str, list[int]]:
        aclient = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        stream = await aclient.completions.create(model="llm", prompt=PROMPT, max_tokens=12, temperature=0,
                                                  stream=True)
        streamed = "".join([c.choices[0].text async for c in stream])
        pair = await aclient.completions.create(model="llm", prompt=[PROMPT, "The sea"], max_tokens=4,
                                                temperature=0)
        await aclient.close()
        return streamed, sorted(c.index for c in pair.choices)

    streamed, indices = asyncio.run(async_client())
    assert streamed == text and indices == [0, 1]

    models = client.models.list()  # the pool's name and its model's (docs/gateway.md, "Models and pools")
    assert [m.id for m in models.data] == ["gemma3:270m", "llm"] and client.models.retrieve("llm").id == "llm"
    assert client.models.retrieve("gemma3:270m").id == "gemma3:270m"


@pytest.mark.model
def test_openai_chat_stream_and_not_json_schema_and_logprobs_on_the_default_engine(real_fleet) -> None:
    gw = real_fleet
    client = oai(gw)
    hello: list[Any] = [{"role": "user", "content": "Say hello."}]
    whole = client.chat.completions.create(model="llm", messages=hello, max_tokens=8, temperature=0)
    text = whole.choices[0].message.content
    assert text and whole.choices[0].message.role == "assistant" and whole.object == "chat.completion"
    assert whole.usage is not None and whole.usage.prompt_tokens > 0

    structured = client.chat.completions.create(
        model="llm", messages=ASK, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert structured.choices[0].finish_reason == "stop"  # the grammar completed the object
    jsonschema.validate(json.loads(structured.choices[0].message.content or ""), PERSON)

    probs = client.chat.completions.create(model="llm", messages=hello, max_tokens=4, temperature=0,
                                           logprobs=True, top_logprobs=2)
    content = probs.choices[0].logprobs and probs.choices[0].logprobs.content
    assert content and len(content) == 4
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob <= 0 for t in content)

    async def streamed() -> str:
        aclient = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        stream: Any = await aclient.chat.completions.create(model="llm", messages=hello, max_tokens=8,
                                                            temperature=0, stream=True)
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        await aclient.close()
        return "".join(parts)

    assert asyncio.run(streamed()) == text


@pytest.mark.model
def test_ollama_client_generate_stream_and_not_tags_ps_version(real_fleet) -> None:
    gw = real_fleet
    client = ollama.Client(host=gw.url)
    options = {"num_predict": 10, "temperature": 0}
    whole = client.generate(model="llm", prompt=PROMPT, options=options)
    assert whole.response and whole.done and whole.done_reason == "length"
    assert whole.eval_count == 10 and whole.prompt_eval_count and whole.prompt_eval_count > 0
    assert whole.total_duration and whole.eval_duration and whole.total_duration >= whole.eval_duration > 0
    parts = list(client.generate(model="llm", prompt=PROMPT, options=options, stream=True))
    assert "".join(p.response or "" for p in parts) == whole.response
    assert parts[-1].done and not any(p.done for p in parts[:-1]) and parts[-1].eval_count == 10
    # an empty prompt only "loads the model", as with Ollama
    assert client.generate(model="llm", prompt="").done_reason == "load"
    # listed under the model's name from its GGUF; "llm" stays an alias (tests/test_ollama_models.py)
    assert [m.model for m in client.list().models] == ["gemma3:270m"]
    assert [m.model for m in client.ps().models] == ["gemma3:270m"]
    assert httpx.get(f"{gw.url}/api/version").json()["version"]
    with pytest.raises(ollama.ResponseError) as missing:
        client.generate(model="nope", prompt=PROMPT)
    assert missing.value.status_code == 404 and "nope" in missing.value.error
    chat = client.chat(model="llm", messages=[{"role": "user", "content": "hi"}], options=options)
    assert chat.message.content and chat.message.role == "assistant" and chat.done
    streamed = list(client.chat(model="llm", messages=[{"role": "user", "content": "hi"}], options=options,
                                stream=True))
    assert "".join(p.message.content or "" for p in streamed) == chat.message.content
    person = client.chat(model="llm", messages=ASK, format=PERSON,
                         options={"num_predict": 60, "temperature": 0})
    assert person.done_reason == "stop"
    jsonschema.validate(json.loads(person.message.content or ""), PERSON)
    with pytest.raises(ollama.ResponseError) as bad:
        client.generate(model="llm", prompt=PROMPT, options={"mirostat": 2})
    assert bad.value.status_code == 400 and "options.mirostat" in bad.value.error


def test_errors_404_400_401_and_keys_never_logged(inprocess_gateway, caplog) -> None:
    caplog.set_level(logging.DEBUG)  # every record the gateway and uvicorn write, at any level
    inprocess_gateway.worker("w1", backend__slots=2)
    gw = inprocess_gateway.start(gateway__api_keys=["sk-fleet-secret-1", "sk-fleet-secret-2"])
    wait_until_healthy(gw)
    client = oai(gw, "sk-fleet-secret-2")
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)
    assert unknown.value.code == "model_not_found" and "gpt-4o" in unknown.value.message
    with pytest.raises(openai.BadRequestError) as functions:  # the legacy form of tools
        client.chat.completions.create(model="llm", messages=[{"role": "user", "content": "hi"}], functions=[
            {"name": "f", "parameters": {"type": "object"}}])
    assert functions.value.param == "functions" and "'functions'" in functions.value.message
    with pytest.raises(openai.BadRequestError) as best_of:
        client.completions.create(model="llm", prompt=PROMPT, max_tokens=2, best_of=2)
    assert best_of.value.param == "best_of"
    with pytest.raises(openai.BadRequestError) as hot:
        client.completions.create(model="llm", prompt=PROMPT, max_tokens=2, temperature=9)
    assert hot.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as schema:
        client.completions.create(model="llm", prompt=PROMPT, max_tokens=2,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"schema": {"type": 5}}}})
    assert "JSON schema" in schema.value.message
    with pytest.raises(openai.AuthenticationError):
        oai(gw, "sk-wrong").completions.create(model="llm", prompt=PROMPT, max_tokens=2)
    no_key = httpx.post(f"{gw.url}/api/generate", json={"model": "llm", "prompt": "x"})
    assert no_key.status_code == 401 and "error" in no_key.json()
    assert client.completions.create(model="llm", prompt=PROMPT, max_tokens=2).choices[0].text
    authed = ollama.Client(host=gw.url, headers={"Authorization": "Bearer sk-fleet-secret-1"})
    assert authed.generate(model="llm", prompt=PROMPT, options={"num_predict": 2}).done
    assert httpx.get(f"{gw.url}/health").status_code == 200  # open: probes carry no key
    assert httpx.get(f"{gw.url}/metrics").status_code == 401  # with keys set, so are these
    assert httpx.get(f"{gw.url}/dashboard/api/status").status_code == 401
    bearer = {"Authorization": "Bearer sk-fleet-secret-1"}
    families = {f.name for f in text_string_to_metric_families(
        httpx.get(f"{gw.url}/metrics", headers=bearer).text)}
    assert {"llama_fleet_jobs", "llama_fleet_tokens_generated"} <= families, families
    status = httpx.get(f"{gw.url}/dashboard/api/status", headers=bearer).json()
    assert [w["name"] for w in status["workers"]] == ["w1"]
    gw.stop()
    assert caplog.records  # the check below reads what was logged
    assert "sk-fleet-secret" not in caplog.text and "sk-wrong" not in caplog.text


def test_503_without_workers_then_429_with_a_full_queue(inprocess_gateway, redis_url: str) -> None:
    gw = inprocess_gateway.start(gateway__max_queue=1, gateway__retry_after=3)
    health = httpx.get(f"{gw.url}/health")
    assert health.status_code == 503 and health.json()["reason"] == "no live worker"
    with pytest.raises(openai.InternalServerError) as none:
        oai(gw).completions.create(model="llm", prompt=PROMPT, max_tokens=2)
    assert none.value.status_code == 503 and none.value.code == "no_workers"
    inprocess_gateway.worker("w1", backend__slots=1, backend__step_delay=0.05)
    wait_until_healthy(gw)
    fleet = Fleet(redis_url)
    busy = [fleet.submit(prompt=LONG, max_tokens=400) for _ in range(3)]  # one runs, two wait
    full = httpx.post(f"{gw.url}/v1/completions", json={"model": "llm", "prompt": PROMPT, "max_tokens": 2})
    assert full.status_code == 429 and full.headers["retry-after"] == "3"
    assert full.json()["error"]["code"] == "queue_full"
    ollama_full = httpx.post(f"{gw.url}/api/generate", json={"model": "llm", "prompt": PROMPT})
    assert ollama_full.status_code == 429 and "retry later" in ollama_full.json()["error"]
    for job in busy:
        job.cancel()


def test_disconnect_mid_stream_frees_the_slot_for_the_next_job(inprocess_gateway, redis_url: str) -> None:
    inprocess_gateway.worker("w1", backend__slots=1, backend__step_delay=0.02)  # 1000 words: 20 s
    gw = inprocess_gateway.start()
    wait_until_healthy(gw)
    fleet = Fleet(redis_url)
    body = {"model": "llm", "prompt": LONG, "max_tokens": 1000, "temperature": 0.8, "stream": True}
    with httpx.stream("POST", f"{gw.url}/v1/completions", json=body, timeout=60) as response:
        first_job, _lines = first_chunk(response)
        waiting = fleet.submit(prompt=PROMPT, max_tokens=4)  # queued behind the one slot
        enqueued_at = time.time()
        time.sleep(0.5)
        assert fleet.job(waiting.id).status() == "queued"
        closed_at = time.time()
    # the client left: its job is cancelled and the queued job takes the slot at once
    gone = fleet.job(first_job).result(timeout=30)
    assert gone["finish_reason"] == "cancelled" and gone["usage"]["completion_tokens"] < 1000
    res = waiting.result(timeout=60)
    claimed_at = enqueued_at + res["timings"]["queue_ms"] / 1000
    # the cancelled job had hundreds of tokens to go; the slot was handed on within a step or so
    assert claimed_at - closed_at < 10.0, f"claimed {claimed_at - closed_at:.1f}s after the disconnect"


def test_a_gateway_restart_loses_no_acknowledged_job(inprocess_gateway, gateways, redis_url: str,
                                                     tmp_path) -> None:
    """The `fleet serve` process is the subject (SIGTERM mid-stream, a new one on its port); the
    worker, on the fake engine in this process, paces the 40 words at 0.1 s each."""
    inprocess_gateway.worker("w1", backend__slots=2, backend__step_delay=0.1)
    # a grace far shorter than the 39 tokens left take (with 0.5 s a fast box with prompt-lookup
    # drafts finished the stream inside the grace, and nothing broke)
    gw = gateways.start(gateway__shutdown_grace=0.05)
    wait_until_healthy(gw)
    body = {"model": "llm", "prompt": LONG, "max_tokens": 40, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{gw.url}/v1/completions", json=body, timeout=60) as response:
        job_id, lines = first_chunk(response)
        assert gw.stop(signal.SIGTERM) in (0, -signal.SIGTERM)  # the gateway goes away mid-stream
        with pytest.raises(httpx.HTTPError):
            for _ in lines:
                pass
    res = Fleet(redis_url).job(job_id).result(timeout=180)
    assert res["finish_reason"] == "length" and res["usage"]["completion_tokens"] == 40  # not cancelled
    again = start_gateway(redis_url, tmp_path / "logs", port=gw.port, name="gateway-again")
    try:
        wait_until_healthy(again)
        answer = httpx.post(f"{again.url}/v1/completions", timeout=180,
                            json={"model": "llm", "prompt": LONG, "max_tokens": 40, "temperature": 0})
        assert answer.json()["choices"][0]["text"] == res["text"]  # same greedy text, new gateway
    finally:
        again.stop(signal.SIGKILL)


def test_priority_header_and_sse_framing(inprocess_gateway, redis_url: str) -> None:
    inprocess_gateway.worker("w1", backend__slots=2)
    gw = inprocess_gateway.start()
    wait_until_healthy(gw)
    bad = httpx.post(f"{gw.url}/v1/completions", headers={"X-Fleet-Priority": "urgent"},
                     json={"model": "llm", "prompt": PROMPT})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Fleet-Priority"
    raw = httpx.post(f"{gw.url}/v1/completions", headers={"X-Fleet-Priority": "high"}, timeout=60,
                     json={"model": "llm", "prompt": PROMPT, "max_tokens": 3, "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = [e for e in raw.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    job_id = raw.headers["x-fleet-job-id"]
    assert Fleet(redis_url).job(job_id).result(timeout=5)["usage"]["completion_tokens"] == 3
    origin = httpx.get(f"{gw.url}/health").json()
    assert origin["workers"] == 1
    from redis import Redis

    assert Redis.from_url(redis_url).hget(f"rq:job:{job_id}", "origin") == b"llm:high"
    nd = httpx.post(f"{gw.url}/api/generate", timeout=60,
                    json={"model": "llm", "prompt": PROMPT, "options": {"num_predict": 3}})
    rows = [json.loads(line) for line in nd.text.splitlines()]
    assert nd.headers["content-type"].startswith("application/x-ndjson") and rows[-1]["done"] is True
