"""Conformance with the reference servers, through the gateway's app and a worker:
Ollama's own curl examples (no Content-Type: curl sends a form's), with cross-site form posts
still refused; how a Responses answer cut by max_output_tokens ends (OpenAI: `incomplete`, not
`completed`), and a failed one; OpenAI's default `parallel_tool_calls` (true) with repeated calls
dropped; the Ollama version clients gate features on; OpenAI's `logit_bias`.

The fake engine (`backend__type: fake`, which answers with the words of the last message) on the
gateway in process where only the gateway's behaviour matters; the shared real fleet (`fleet serve`
and `fleet worker` on the real model) where the engine must do the work (embeddings, tool calls
under the answer grammar, logit_bias)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from dispatcher import Fleet
from tests.gateway_harness import wait_until_healthy
from tests.real_servers import llama_server
from tests.test_gateway_tools import ASK, BOTH, check_call

pytestmark = pytest.mark.timeout(300)
FAKE = {"backend__type": "fake", "backend__slots": 4}
# what `curl URL -d '<json>'` sends: no Content-Type of its own, so a form's
CURL = {"user-agent": "curl/8.5.0", "accept": "*/*", "content-type": "application/x-www-form-urlencoded"}
WORDS = "one two three four five six seven eight"
# what a web page can post to another site without a CORS preflight
FORM_TYPES = ("application/x-www-form-urlencoded", "text/plain", "multipart/form-data; boundary=x")


def oai(gw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)


def curl(http: httpx.Client, path: str, data: dict[str, Any] | None = None) -> httpx.Response:
    """`curl <gateway><path>` (GET), or with `-d '<data>'` (POST), headers as curl sends them."""
    if data is None:
        return http.get(path, headers={k: v for k, v in CURL.items() if k != "content-type"})
    return http.post(path, content=json.dumps(data).encode(), headers=CURL)


def ndjson(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) for line in response.text.splitlines() if line.strip()]


# -- Ollama's curl examples ---------------------------------------------------------------------------


def test_ollama_curl_examples_without_content_type(inprocess_gateway) -> None:
    """The examples of Ollama's API reference, as curl sends them (application/x-www-form-urlencoded),
    each a 200 with Ollama's body; OpenAI's routes keep taking JSON only (their reference's rule)."""
    inprocess_gateway.worker("w1", **FAKE)
    gw = inprocess_gateway.start()
    wait_until_healthy(gw)
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        generate = curl(http, "/api/generate", {"model": "llm", "prompt": "Why is the sky blue?"})
        assert generate.status_code == 200, generate.text
        lines = ndjson(generate)  # streamed by default, as Ollama's
        assert "".join(x["response"] for x in lines) == "Why is the sky blue?" and lines[-1]["done"]

        chat = curl(http, "/api/chat", {"model": "llm", "messages": [
            {"role": "user", "content": "why is the sky blue?"}]})
        assert chat.status_code == 200, chat.text
        lines = ndjson(chat)
        assert "".join(x["message"]["content"] for x in lines) == "why is the sky blue?" and lines[-1]["done"]
        whole = curl(http, "/api/chat", {"model": "llm", "stream": False, "messages": [
            {"role": "user", "content": "why is the sky blue?"}]})
        assert whole.status_code == 200 and whole.json()["message"]["content"] == "why is the sky blue?"

        show = curl(http, "/api/show", {"model": "llm"})
        assert show.status_code == 200, show.text
        assert show.json()["details"]["format"] == "gguf" and "completion" in show.json()["capabilities"]

        for path in ("/api/tags", "/api/ps"):
            listed = curl(http, path)
            assert listed.status_code == 200 and [m["name"] for m in listed.json()["models"]] == ["llm"]
        assert curl(http, "/api/version").status_code == 200

        # the fake engine does not embed: the job fails, a 422 naming why in Ollama's shape
        # (docs/gateway.md, "Embeddings": a failure other than bad input); the real model's 200
        # is test_ollama_embed_curl_example_on_the_real_model
        embed = curl(http, "/api/embed", {"model": "llm", "input": "Why is the sky blue?"})
        assert embed.status_code == 422, embed.text
        assert embed.json() == {"error": "embedding failed: this worker's engine (fake) does not embed"}

        # a body that is not JSON is still refused as such, whatever the Content-Type said
        form = http.post("/api/generate", content=b"model=llm&prompt=x", headers=CURL)
        assert form.status_code == 400 and "not JSON" in form.json()["error"]

        # OpenAI's routes take JSON only, as OpenAI does; the 415 says how curl sends it
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses"):
            refused = curl(http, path, {"model": "llm", "prompt": "x"})
            assert refused.status_code == 415, (path, refused.text)
            assert "--json" in refused.json()["error"]["message"]


@pytest.mark.model
def test_ollama_embed_curl_example_on_the_real_model(real_fleet) -> None:
    with httpx.Client(base_url=real_fleet.url, timeout=120) as http:
        embed = curl(http, "/api/embed", {"model": "llm", "input": "Why is the sky blue?"})
        assert embed.status_code == 200, embed.text
        vectors = embed.json()["embeddings"]
        assert len(vectors) == 1 and len(vectors[0]) == 640  # gemma-3-270m's embedding size
        assert abs(sum(v * v for v in vectors[0]) - 1) < 1e-3  # normalised, as Ollama's /api/embed
        legacy = curl(http, "/api/embeddings", {"model": "llm", "prompt": "Why is the sky blue?"})
        assert legacy.status_code == 200 and len(legacy.json()["embedding"]) == 640


def test_cross_site_form_posts_are_still_refused_on_ollama_routes(inprocess_gateway) -> None:
    """What a web page of another site can send without a CORS preflight (a <form>'s or
    fetch(no-cors)'s Content-Types, a body that reads as JSON) runs nothing: the Origin and
    Sec-Fetch-Site check refuses it, now that Ollama's routes take any Content-Type."""
    inprocess_gateway.worker("w1", **FAKE)
    gw = inprocess_gateway.start()
    wait_until_healthy(gw)
    body = json.dumps({"model": "llm", "prompt": "x", "input": "x", "messages": [{"role": "user",
                                                                                  "content": "x"}]}).encode()
    browsers = (
        {"origin": "https://evil.example", "sec-fetch-site": "cross-site"},  # today's browsers
        {"origin": "https://evil.example"},  # a browser that sends no Sec-Fetch-Site
        {"origin": "null", "sec-fetch-site": "cross-site"},  # a sandboxed frame
    )
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        for path in ("/api/generate", "/api/chat", "/api/embed", "/api/embeddings", "/api/show"):
            for ctype in FORM_TYPES:
                for browser in browsers:
                    refused = http.post(path, content=body, headers={"content-type": ctype, **browser})
                    assert refused.status_code == 403, (path, ctype, browser, refused.text)
                    assert "cross" in refused.json()["error"]
        # the same request from curl (no Origin, no Sec-Fetch-Site) runs
        assert curl(http, "/api/generate", {"model": "llm", "prompt": "x"}).status_code == 200


# -- /api/version ----------------------------------------------------------------------------------


def test_ollama_version_is_the_ollama_release_served(inprocess_gateway) -> None:
    """Clients gate features on /api/version (the ollama CLI, Open WebUI): it names the Ollama
    release whose API is served, at least the one that added logprobs (0.12.11), which is served."""
    gw = inprocess_gateway.start()
    version = httpx.get(f"{gw.url}/api/version", timeout=10)
    assert version.status_code == 200
    parts = tuple(int(p) for p in version.json()["version"].split("."))
    assert len(parts) == 3 and parts >= (0, 12, 11), version.json()


# -- Responses cut short or failed ---------------------------------------------------------------------


def sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]


def test_responses_cut_by_max_output_tokens_end_incomplete(inprocess_gateway) -> None:
    """OpenAI ends a Response cut by max_output_tokens with `response.incomplete`, its message item
    `incomplete`; whole, streamed raw, and through the official SDK's two ways of streaming."""
    inprocess_gateway.worker("w1", **FAKE)
    gw = inprocess_gateway.start()
    wait_until_healthy(gw)
    client = oai(gw)
    cut: dict[str, Any] = {"model": "llm", "input": WORDS, "max_output_tokens": 3}

    whole = client.responses.create(**cut)
    assert whole.status == "incomplete" and whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert [(o.type, o.status) for o in whole.output] == [("message", "incomplete")]
    assert whole.output_text == "one two three"

    raw = httpx.post(f"{gw.url}/v1/responses", json={**cut, "stream": True}, timeout=60)
    events = sse_events(raw)
    kinds = [e["type"] for e in events]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"], kinds
    assert "response.completed" not in kinds
    assert events[-2]["item"]["status"] == "incomplete" and events[-2]["item"]["content"][0]["text"] == (
        "one two three")
    last = events[-1]["response"]
    assert last["status"] == "incomplete" and last["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["output"][0]["status"] == "incomplete" and last["usage"]["output_tokens"] == 3

    with client.responses.stream(**cut) as stream:
        streamed = list(stream)
    assert streamed[-1].type == "response.incomplete"
    assert streamed[-1].response.output[0].status == "incomplete"
    assert streamed[-1].response.output_text == "one two three"
    created = list(client.responses.create(**cut, stream=True))
    assert [e.type for e in created] == kinds
    assert [e.sequence_number for e in created] == list(range(len(created)))

    # an answer that ends by itself still ends completed
    done = list(client.responses.create(model="llm", input="one two", max_output_tokens=16, stream=True))
    assert done[-1].type == "response.completed" and done[-1].response.output[0].status == "completed"
    assert client.responses.create(model="llm", input="one two").output[0].status == "completed"


def test_a_failed_responses_stream_ends_with_response_failed(inprocess_gateway) -> None:
    inprocess_gateway.worker("w1", **FAKE, backend__step_delay=0.5)
    gw = inprocess_gateway.start(gateway__request_timeout=2)
    wait_until_healthy(gw)
    raw = httpx.post(f"{gw.url}/v1/responses", json={"model": "llm", "input": WORDS, "stream": True},
                     timeout=60)
    events = sse_events(raw)
    assert events[-1]["type"] == "response.failed", [e["type"] for e in events]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "request_timeout" in failed["error"]["message"]
    assert failed["output"] and failed["output"][0]["status"] == "incomplete"  # the words so far
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    with oai(gw).responses.stream(model="llm", input=WORDS) as stream:
        assert [e.type for e in stream][-1] == "response.failed"


# -- parallel tool calls -------------------------------------------------------------------------------


def call_answer(*calls: tuple[str, dict[str, Any]]) -> str:
    """A generic-format answer; the fake engine repeats it as the model's (words joined by spaces)."""
    return json.dumps({"tool_calls": [{"name": name, "arguments": args} for name, args in calls]})


def test_repeated_tool_calls_are_dropped(inprocess_gateway) -> None:
    """One answer holding the same call twice (keys in another order too) gives it once; ids
    count the calls kept, the same whole and streamed. The fake engine answers with the user's
    text, so the answer is exactly the one written here."""
    inprocess_gateway.worker("w1", **FAKE)
    gw = inprocess_gateway.start()
    wait_until_healthy(gw)
    client = oai(gw)
    paris = {"city": "Paris", "unit": "celsius"}
    answer = call_answer(("get_weather", paris), ("get_weather", {"unit": "celsius", "city": "Paris"}),
                         ("get_time", {"timezone": "CET"}), ("get_weather", paris),
                         ("get_weather", {"city": "Rome", "unit": "celsius"}))
    asked: dict[str, Any] = {"model": "llm", "messages": [{"role": "user", "content": answer}], "tools": BOTH}
    whole = client.chat.completions.create(**asked)
    calls = whole.choices[0].message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", paris), ("get_time", {"timezone": "CET"}),
        ("get_weather", {"city": "Rome", "unit": "celsius"})]
    assert len({c.id for c in calls}) == 3 and whole.choices[0].finish_reason == "tool_calls"
    streamed = [d.id for chunk in client.chat.completions.create(**asked, stream=True)
                for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices and d.id]
    assert len(streamed) == 3
    ollama = httpx.post(f"{gw.url}/api/chat", json={**asked, "stream": False}, timeout=60).json()
    assert len(ollama["message"]["tool_calls"]) == 3
    responses = client.responses.create(model="llm", input=answer, tools=[
        {"type": "function", **t["function"]} for t in BOTH])
    assert [o.type for o in responses.output] == ["function_call"] * 3
    assert responses.parallel_tool_calls is True  # OpenAI's default, echoed


TWO_THINGS = [{"role": "user", "content": "What is the weather in Paris, and what time is it in Tokyo?"}]


@pytest.mark.model
def test_parallel_tool_calls_default_to_true_on_the_real_model(real_fleet) -> None:
    """Without `parallel_tool_calls` an answer may hold several calls (OpenAI's default), each
    valid for its tool, none repeated; the answer ends where the model repeats a call (it would
    repeat it until max_tokens); `false` or a named function allow one call."""
    client = oai(real_fleet)
    common: dict[str, Any] = {"model": "llm", "max_tokens": 128, "temperature": 0, "tools": BOTH}
    several = client.chat.completions.create(messages=TWO_THINGS, tool_choice="required", **common).choices[0]
    calls = several.message.tool_calls or []
    assert len(calls) >= 2 and several.finish_reason == "tool_calls", several
    distinct = {(c.function.name, json.dumps(check_call(c), sort_keys=True)) for c in calls}
    assert len(distinct) == len(calls)

    # the small model repeats a call here: the answer ends at the repeat, which is dropped
    raw = client.chat.completions.with_raw_response.create(messages=ASK, tool_choice="auto", **common)
    repeated = raw.parse().choices[0]
    assert repeated.finish_reason == "tool_calls" and repeated.message.tool_calls
    result = Fleet(real_fleet.redis_url).job(raw.headers["x-fleet-job-id"]).result(timeout=10)
    written = json.loads(result.text.rstrip().rstrip(",") + "]}")["tool_calls"]  # the raw answer, cut
    assert written[-1] in written[:-1] and len(written) == len(repeated.message.tool_calls) + 1
    assert result.usage.completion_tokens < 128

    for one_call in ({"parallel_tool_calls": False, "tool_choice": "required"},
                     {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}):
        one = client.chat.completions.create(messages=TWO_THINGS, **common, **one_call).choices[0]
        assert len(one.message.tool_calls or []) == 1 and one.finish_reason == "tool_calls", one_call
        check_call((one.message.tool_calls or [])[0])


# -- logit_bias ----------------------------------------------------------------------------------------


PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def vocab() -> Iterator[Any]:
    """The embedded model's vocabulary (the weights are mmap'd: cheap beside the worker's)."""
    import llama_cpp as ll

    from backends.llamacpp.model import load_weights
    from backends.model import default_model_path

    model = load_weights(default_model_path())
    yield ll.llama_model_get_vocab(model)
    ll.llama_model_free(model)


def token_id(vocab: Any, text: str) -> int:
    from backends.llamacpp.model import tokenize

    ids = tokenize(vocab, text, special=False, add_special=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


@pytest.mark.model
@pytest.mark.parametrize("backend", ["llama-cpp", "llama-server"])
def test_logit_bias_bans_and_forces_tokens_on_the_real_model(backend, request, vocab, tmp_path) -> None:
    """OpenAI's logit_bias (token id -> bias): -100 bans the token greedy decoding picks, 100
    makes one token the pick every time; on completions, chat and streams alike, on the
    in-process engine (the shared real fleet's worker) and on llama-server (which the backend
    passes it to: a worker on it in this process, the gateway's app in this process)."""
    if backend == "llama-cpp":
        check_logit_bias(oai(request.getfixturevalue("real_fleet")), vocab, in_process=True)
        return
    fleet = request.getfixturevalue("inprocess_gateway")
    with llama_server(tmp_path / "llama-server", parallel=2, ctx=2048) as server:
        fleet.worker("w1", backend__type="llama-server", backend__endpoint=server.url,
                     backend__connect_timeout=30)
        gw = fleet.start()
        wait_until_healthy(gw)
        check_logit_bias(oai(gw), vocab, in_process=False)


def check_logit_bias(client: openai.OpenAI, vocab: Any, in_process: bool) -> None:
    common: dict[str, Any] = {"model": "llm", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    plain = client.completions.create(**common, logprobs=1)
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.tokens
    first = plain.choices[0].logprobs.tokens[0]
    banned = token_id(vocab, first)
    biased = client.completions.create(**common, logprobs=1, logit_bias={str(banned): -100})
    assert biased.choices[0].logprobs is not None and biased.choices[0].logprobs.tokens
    assert biased.choices[0].logprobs.tokens[0] != first, (first, biased.choices[0].text)
    assert first not in biased.choices[0].logprobs.tokens
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        **common, logit_bias={str(banned): -100}, stream=True) if c.choices)
    assert streamed == biased.choices[0].text

    forced = token_id(vocab, " banana")
    again = client.completions.create(**common, logit_bias={str(forced): 100})
    assert again.choices[0].text == " banana" * 4 and again.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="llm", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3, temperature=0.7, seed=1,
                                          logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == " banana" * 3

    # refused with a 400 naming the field: not a token id, a bias out of range
    for bias in ({"hello": 5}, {"1": 101}, {"1": "x"}):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(**common, logit_bias=bias)
        assert refused.value.param == "logit_bias", refused.value.message
    if in_process:  # a token the model does not have fails the job (only the worker knows the vocabulary)
        with pytest.raises(openai.UnprocessableEntityError) as unknown:
            client.completions.create(**common, logit_bias={"999999999": 1})
        assert "vocabulary" in unknown.value.message


# -- response_format beside tools ------------------------------------------------------------------

JOKE = {"type": "object", "properties": {"setup": {"type": "string", "maxLength": 200},
                                         "punchline": {"type": "string", "maxLength": 200}},
        "required": ["setup", "punchline"], "additionalProperties": False}


@pytest.mark.model
def test_response_format_beside_tools_shapes_the_answer_on_the_real_model(real_fleet) -> None:
    """OpenAI accepts response_format together with tools (openai-agents' output_type with tools
    sends both): an answer that calls no tool follows the format, plain and streamed; a call is
    still a valid call."""
    client = oai(real_fleet)
    talk = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me a short joke."}]
    shaped = {"type": "json_schema", "json_schema": {"name": "joke", "schema": JOKE}}
    for messages in (talk, ASK):
        answer = client.chat.completions.create(model="llm", messages=messages, tools=BOTH, max_tokens=160,
                                                temperature=0, response_format=shaped)  # type: ignore[arg-type]
        message = answer.choices[0].message
        if message.tool_calls:
            for call in message.tool_calls:
                check_call(call)
        else:
            assert answer.choices[0].finish_reason == "stop", answer
            jsonschema.validate(json.loads(message.content or ""), JOKE)
    same: dict[str, Any] = {"model": "llm", "messages": talk, "tools": BOTH, "max_tokens": 160,
                            "temperature": 0, "response_format": shaped}
    chunks = client.chat.completions.create(**same, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    plain = client.chat.completions.create(**same)
    assert streamed == (plain.choices[0].message.content or "")
