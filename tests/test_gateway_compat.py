"""What clients expect beyond the plain requests: `x-request-id` on every response and one 400
naming every unsupported field (the gateway's app in process, a fake-engine worker: no model
needed); on the shared real fleet (`fleet serve`, a worker on the real model):
`min_tokens` / `ignore_eos` (llama-server's and vLLM's extensions, sent with the openai SDK's
`extra_body`), Ollama's `/api/show` through the official ollama client, and Ollama's `context`
refused by name."""

from __future__ import annotations

import re

import httpx
import ollama
import openai
import pytest

from tests.gateway_harness import wait_until_healthy
from tests.test_engine_min_tokens import STOPS_AT_ONCE

pytestmark = pytest.mark.timeout(300)
GENERATED_ID = re.compile(r"req_[0-9a-f]{32}")


def oai(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)


def test_every_response_carries_a_request_id(inprocess_gateway) -> None:
    gw = inprocess_gateway.start(gateway__max_body_bytes=4096)
    # before any worker: a 5xx (no live worker) and the health probe's 503 carry one too
    none = httpx.post(f"{gw.url}/v1/completions", json={"model": "llm", "prompt": "x"})
    assert none.status_code == 503 and GENERATED_ID.fullmatch(none.headers["x-request-id"])
    assert GENERATED_ID.fullmatch(httpx.get(f"{gw.url}/health").headers["x-request-id"])
    inprocess_gateway.worker("w1", backend__slots=2)
    wait_until_healthy(gw)
    client = oai(gw)
    # the SDK records it (what a user quotes in a bug report)
    done = client.completions.create(model="llm", prompt="Once upon a time", max_tokens=3)
    assert GENERATED_ID.fullmatch(done._request_id or "")
    with client.chat.completions.with_streaming_response.create(
            model="llm", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True) as stream:
        assert GENERATED_ID.fullmatch(stream.headers["x-request-id"])
        assert "[DONE]" in "".join(stream.iter_lines())
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        ids = set()
        generate = {"model": "llm", "prompt": "hi", "options": {"num_predict": 2}}
        chat = {"model": "llm", "stream": False, "options": {"num_predict": 2},
                "messages": [{"role": "user", "content": "x"}]}
        routes = [("POST", "/api/generate", generate), ("POST", "/api/chat", chat),
                  ("GET", "/api/tags", None), ("GET", "/v1/models", None),
                  ("GET", "/v1/models/nope", None),  # 404
                  ("POST", "/v1/completions", {"model": "llm", "prompt": "x", "foo": 1}),  # 400
                  ("POST", "/v1/completions", {"model": "llm", "prompt": "x" * 5000}),  # 413
                  ("GET", "/v1/files", None), ("GET", "/v1/batches", None),
                  ("GET", "/metrics", None), ("GET", "/dashboard/", None),
                  ("GET", "/nowhere", None)]  # Starlette's own 404
        for method, path, body in routes:
            response = http.request(method, path, json=body)
            request_id = response.headers.get("x-request-id", "")
            assert GENERATED_ID.fullmatch(request_id), (path, response.status_code, response.headers)
            ids.add(request_id)
        assert len(ids) == len(routes)  # a new one each time
        # a client's own id comes back; one that is not sane (too long, spaces, control bytes) is replaced
        mine = http.get("/api/tags", headers={"x-request-id": "trace-42:abc"})
        assert mine.headers["x-request-id"] == "trace-42:abc"
        for bad in ("x" * 200, "has space", "tab\there"):
            replaced = http.get("/api/tags", headers={"x-request-id": bad}).headers["x-request-id"]
            assert GENERATED_ID.fullmatch(replaced)


def test_one_400_names_every_unsupported_field(inprocess_gateway) -> None:
    inprocess_gateway.worker("w1", backend__slots=1)
    gw = inprocess_gateway.start()
    wait_until_healthy(gw)
    with pytest.raises(openai.BadRequestError) as refused:
        oai(gw).chat.completions.create(
            model="llm", messages=[{"role": "user", "content": "hi"}], modalities=["text"],
            extra_body={"mirostat": 2, "best_of": 3}, max_tokens=2)
    message = refused.value.message
    assert refused.value.param == "modalities" and refused.value.code == "unsupported_field"
    assert all(f"'{name}'" in message for name in ("modalities", "mirostat", "best_of")), message
    bad_message = httpx.post(f"{gw.url}/v1/chat/completions", json={
        "model": "llm", "suffix": "x", "stream_options": {"include_usage": True, "chunked": True},
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}],
                      "audio": {}}]})
    error = bad_message.json()["error"]
    assert bad_message.status_code == 400 and error["param"] == "suffix"
    for name in ("'suffix'", "'stream_options.chunked'", "'messages[0].audio'", "'messages[0].content[0]"):
        assert name in error["message"], error["message"]
    with pytest.raises(ollama.ResponseError) as options:
        ollama.Client(host=gw.url).generate(model="llm", prompt="x", suffix="tail",
                                            options={"mirostat": 2, "typical_p": 0.5})
    assert options.value.status_code == 400
    assert all(n in options.value.error for n in ("'suffix'", "'options.mirostat'", "'options.typical_p'"))


@pytest.mark.model
def test_min_tokens_and_ignore_eos_through_the_openai_sdk(real_fleet) -> None:
    client = oai(real_fleet)

    def complete(**extra: object) -> openai.types.Completion:
        return client.completions.create(model="llm", prompt=STOPS_AT_ONCE, max_tokens=64, temperature=0,
                                         extra_body=extra or None)

    plain = complete()
    assert plain.usage is not None and plain.usage.completion_tokens == 0  # the model stops at once
    at_least = complete(min_tokens=16)
    # at least 16; whether the model then stops before 64 is its own business (speculation's
    # draft lengths follow measured timings, and a near tie may go either way)
    assert at_least.usage is not None and 16 <= at_least.usage.completion_tokens <= 64
    assert at_least.choices[0].finish_reason in ("stop", "length") and at_least.choices[0].text
    to_the_end = complete(ignore_eos=True)
    assert to_the_end.usage is not None and to_the_end.usage.completion_tokens == 64
    assert to_the_end.choices[0].finish_reason == "length"
    assert to_the_end.choices[0].text.startswith(at_least.choices[0].text)
    streamed = client.completions.create(model="llm", prompt=STOPS_AT_ONCE, max_tokens=64, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == to_the_end.choices[0].text
    chat = client.chat.completions.create(model="llm", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=12, temperature=0, extra_body={"ignore_eos": True,
                                                                                    "min_tokens": 12})
    assert chat.usage is not None and chat.usage.completion_tokens == 12
    with pytest.raises(openai.BadRequestError) as bounds:
        complete(min_tokens=65)
    assert bounds.value.param == "min_tokens" and "max_tokens" in bounds.value.message
    with pytest.raises(openai.BadRequestError) as typed:
        complete(ignore_eos="yes")
    assert typed.value.param == "ignore_eos"


@pytest.mark.model
def test_ollama_show_and_context(real_fleet) -> None:
    gw = real_fleet
    client = ollama.Client(host=gw.url)
    shown = client.show("llm")
    assert shown.details is not None and shown.details.format == "gguf" and shown.details.family == "gemma3"
    assert shown.details.families == ["gemma3"] and shown.details.quantization_level == "Q4_K_M"
    assert shown.details.parameter_size == "270M"
    info = shown.modelinfo or {}
    assert info["general.architecture"] == "gemma3" and info["general.parameter_count"] > 200_000_000
    assert info["gemma3.context_length"] == 32768 and info["gemma3.embedding_length"] == 640
    assert shown.capabilities == ["completion", "tools"]
    assert "<start_of_turn>user" in (shown.template or "") and "{{ .Prompt }}" in (shown.template or "")
    assert shown.parameters and "temperature" in shown.parameters
    modelfile = shown.modelfile or ""
    assert modelfile.startswith("# Modelfile") and "FROM gemma-3-270m" in modelfile
    assert shown.modified_at is not None
    # older clients send `name`; an unknown model is Ollama's 404
    assert httpx.post(f"{gw.url}/api/show", json={"name": "llm"}).json()["details"]["family"] == "gemma3"
    missing = httpx.post(f"{gw.url}/api/show", json={"model": "nope"})
    assert missing.status_code == 404 and missing.json() == {"error": "model 'nope' not found"}
    with pytest.raises(ollama.ResponseError) as unknown:
        client.show("nope")
    assert unknown.value.status_code == 404
    # `context`: never in an answer; sent back, a 400 naming it and saying what to do instead
    final = client.generate(model="llm", prompt="hi", options={"num_predict": 2})
    assert final.done and final.context is None
    with pytest.raises(ollama.ResponseError) as context:
        client.generate(model="llm", prompt="and then?", context=[2, 106, 1])
    assert context.value.status_code == 400 and "'context'" in context.value.error
    assert "/api/chat" in context.value.error
