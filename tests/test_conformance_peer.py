"""The gateway held against llama-server field by field: the same requests to `fleet serve` (a real
worker on the embedded gemma-3-270m) and to a real llama-server on the same model file (started with
its defaults plus `peer_flags`, one for the module), their answers compared by SHAPE, not text:
chat completion and completion bodies (object, keys, finish_reason for a stop and for a cut, message
fields, usage keys), the streamed event sequence (role delta first, content deltas, the finish chunk,
the usage chunk with `stream_options.include_usage`, `data: [DONE]`), error shapes and status codes
for the same bad inputs, logprobs, the Responses object and the model listing.

Where the fleet differs on purpose, the test asserts the difference docs/gateway.md ("Against
llama-server") names, with its reason, instead of skipping it. Not compared here: tool calling (a
llama-server started with its defaults, without `--jinja`, offers none: it answers a `tools`
request with plain text) and embeddings (it needs `--embeddings`); the fleet's own tests cover both.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.gateway_harness import GatewayProcess, start_gateway, wait_until_healthy
from tests.harness import RedisServer, start_worker
from tests.real_servers import LlamaServer, llama_server

pytestmark = [pytest.mark.timeout(300), pytest.mark.model]

# an answer long on any CPU (greedy text follows the kernels), so 3 tokens cut it
HI = [{"role": "user", "content": "Tell me a story about a cat."}]
PROMPT = "The capital of France is"
USAGE_KEYS = {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
# llama-server's own additions to OpenAI's bodies: its timings, and a token's id in logprobs
PEER_ONLY = {"timings"}


@dataclass
class Pair:
    fleet: GatewayProcess
    peer: LlamaServer


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """A private redis-server, one worker, one `fleet serve`; beside them one llama-server."""
    tmp = tmp_path_factory.mktemp("peer")
    with RedisServer.start(tmp / "redis") as redis_server, \
            llama_server(tmp / "llama-server", parallel=2, ctx=4096, wait=False) as peer:
        worker = start_worker(redis_server.url, "peer-w1", tmp / "logs", backend__slots=2)
        gateway = start_gateway(redis_server.url, tmp / "logs", name="peer-gateway")
        try:
            peer.wait_healthy(timeout=120)
            wait_until_healthy(gateway)
            yield Pair(gateway, peer)
        finally:
            gateway.stop()
            worker.kill()


def both(pair: Pair, path: str, body: dict[str, Any] | bytes) -> tuple[httpx.Response, httpx.Response]:
    """The same request to the fleet and to llama-server, at once (JSON, or raw bytes as JSON)."""

    def send(base: str) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(f"{base}{path}", content=content, timeout=180,
                          headers={"content-type": "application/json"})

    with ThreadPoolExecutor(2) as pool:
        fleet, peer = pool.map(send, (pair.fleet.url, pair.peer.url))
    return fleet, peer


def ok(fleet: httpx.Response, peer: httpx.Response) -> tuple[dict[str, Any], dict[str, Any]]:
    assert fleet.status_code == 200, fleet.text
    assert peer.status_code == 200, peer.text
    return fleet.json(), peer.json()


def events(response: httpx.Response) -> list[Any]:
    """An SSE body's data lines, in order: JSON objects, and "[DONE]" as the string."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    out: list[Any] = []
    for line in response.text.splitlines():
        if line.startswith("data: "):
            out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
        else:
            assert not line.strip(), f"not an SSE data line: {line!r}"
    return out


def check_usage(fleet: dict[str, Any], peer: dict[str, Any]) -> None:
    """The same usage keys on both (llama-server reports prompt_tokens_details.cached_tokens, and so
    does the fleet), every count an integer, total = prompt + completion."""
    assert set(fleet) == set(peer) == USAGE_KEYS, (fleet, peer)
    for usage in (fleet, peer):
        assert set(usage["prompt_tokens_details"]) == {"cached_tokens"}
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        counts = [usage["prompt_tokens"], usage["completion_tokens"], cached]
        assert all(isinstance(c, int) and c >= 0 for c in counts), usage
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert cached <= usage["prompt_tokens"]


# -- whole bodies ------------------------------------------------------------------------------------


def test_chat_completion_bodies_have_llama_servers_shape(pair: Pair) -> None:
    """A chat answer cut by max_tokens ends `length`, one ended by a stop string `stop`, on both;
    the same top-level keys (less llama-server's `timings`), the same usage keys. The fleet adds
    what OpenAI's body has and llama-server leaves out: `logprobs: null` on a choice and
    `refusal: null` on the message; `model` is the name asked for (a pool), not the file's path."""
    cut_f, cut_p = ok(*both(pair, "/v1/chat/completions",
                            {"model": "llm", "messages": HI, "max_tokens": 3, "temperature": 0}))
    stop_f, stop_p = ok(*both(pair, "/v1/chat/completions", {"model": "llm", "messages": HI, "max_tokens": 8,
                                                              "temperature": 0, "stop": [" "]}))
    for (fleet, peer), finish in (((cut_f, cut_p), "length"), ((stop_f, stop_p), "stop")):
        assert fleet["object"] == peer["object"] == "chat.completion"
        assert set(fleet) == set(peer) - PEER_ONLY, (sorted(fleet), sorted(peer))
        assert fleet["id"].startswith("chatcmpl-") and peer["id"].startswith("chatcmpl-")
        assert isinstance(fleet["created"], int) and isinstance(peer["created"], int)
        assert fleet["model"] == "llm" and peer["model"].endswith(".gguf")  # a pool's name; the file
        assert len(fleet["choices"]) == len(peer["choices"]) == 1
        fc, pc = fleet["choices"][0], peer["choices"][0]
        assert fc["finish_reason"] == pc["finish_reason"] == finish, (fc, pc)
        assert set(fc) - set(pc) == {"logprobs"} and set(pc) <= set(fc)
        assert fc["logprobs"] is None and fc["index"] == pc["index"] == 0
        fm, pm = fc["message"], pc["message"]
        assert set(fm) - set(pm) == {"refusal"} and set(pm) <= set(fm) and fm["refusal"] is None
        assert fm["role"] == pm["role"] == "assistant"
        assert isinstance(fm["content"], str) and isinstance(pm["content"], str)
        check_usage(fleet["usage"], peer["usage"])
    assert cut_f["usage"]["completion_tokens"] == cut_p["usage"]["completion_tokens"] == 3
    assert " " not in stop_f["choices"][0]["message"]["content"]
    assert " " not in stop_p["choices"][0]["message"]["content"]


def test_completion_bodies_and_logprobs(pair: Pair) -> None:
    """/v1/completions: the same keys, finish reasons and usage, and (same tokenizer, same BOS) the
    same prompt token count. Differences, on purpose: the fleet's id is `cmpl-` (llama-server
    reuses `chatcmpl-`), and its `logprobs` are OpenAI's legacy completions shape (`tokens`,
    `token_logprobs`, `top_logprobs` as token -> logprob maps, `text_offset`) where llama-server
    answers the chat shape (`content: [...]`)."""
    common = {"model": "llm", "prompt": PROMPT, "temperature": 0}
    cut_f, cut_p = ok(*both(pair, "/v1/completions", {**common, "max_tokens": 3, "logprobs": 2}))
    stop_f, stop_p = ok(*both(pair, "/v1/completions", {**common, "max_tokens": 8, "stop": [" of"]}))
    for (fleet, peer), finish in (((cut_f, cut_p), "length"), ((stop_f, stop_p), "stop")):
        assert fleet["object"] == peer["object"] == "text_completion"
        assert set(fleet) == set(peer) - PEER_ONLY, (sorted(fleet), sorted(peer))
        assert fleet["id"].startswith("cmpl-") and peer["id"].startswith("chatcmpl-")
        fc, pc = fleet["choices"][0], peer["choices"][0]
        assert set(fc) == set(pc) == {"text", "index", "logprobs", "finish_reason"}
        assert fc["finish_reason"] == pc["finish_reason"] == finish
        assert isinstance(fc["text"], str) and isinstance(pc["text"], str)
        check_usage(fleet["usage"], peer["usage"])
        assert fleet["usage"]["prompt_tokens"] == peer["usage"]["prompt_tokens"]
    assert stop_f["choices"][0]["logprobs"] is None and stop_p["choices"][0]["logprobs"] is None

    legacy, chat_shaped = cut_f["choices"][0]["logprobs"], cut_p["choices"][0]["logprobs"]
    assert set(legacy) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(legacy["tokens"]) == len(legacy["token_logprobs"]) == len(legacy["text_offset"]) == 3
    assert "".join(legacy["tokens"]) == cut_f["choices"][0]["text"]
    assert all(isinstance(t, dict) and len(t) == 2 for t in legacy["top_logprobs"])
    assert all(lp <= 0 for lp in legacy["token_logprobs"])
    assert set(chat_shaped) == {"content"} and len(chat_shaped["content"]) == 3
    assert all(len(t["top_logprobs"]) == 2 for t in chat_shaped["content"])


def test_chat_logprobs_shape(pair: Pair) -> None:
    """Chat logprobs: `choices[].logprobs.content`, one entry per token with token, logprob, bytes
    and top_logprobs (top_logprobs entries alike) on both; llama-server adds each token's `id`, the
    fleet OpenAI's `refusal: null` beside `content`. Streamed, llama-server sends each token's
    logprobs on its delta; the fleet sends them all on the choice's last chunk (they travel with the
    job's result)."""
    body = {"model": "llm", "messages": HI, "max_tokens": 3, "temperature": 0, "logprobs": True,
            "top_logprobs": 2}
    fleet, peer = ok(*both(pair, "/v1/chat/completions", body))
    fl, pl = fleet["choices"][0]["logprobs"], peer["choices"][0]["logprobs"]
    assert set(fl) == {"content", "refusal"} and set(pl) == {"content"} and fl["refusal"] is None
    assert len(fl["content"]) == len(pl["content"]) == 3
    for f, p in zip(fl["content"], pl["content"], strict=True):
        assert set(f) == {"token", "logprob", "bytes", "top_logprobs"} and set(p) - set(f) == {"id"}
        assert f["bytes"] == list(f["token"].encode()) and p["bytes"] == list(p["token"].encode())
        assert len(f["top_logprobs"]) == len(p["top_logprobs"]) == 2
        for ft, pt in zip(f["top_logprobs"], p["top_logprobs"], strict=True):
            assert set(ft) == {"token", "logprob", "bytes"} and set(pt) - set(ft) == {"id"}
        assert f["top_logprobs"][0]["logprob"] >= f["top_logprobs"][1]["logprob"]

    streamed_f, streamed_p = (events(r) for r in both(pair, "/v1/chat/completions", {**body, "stream": True}))
    chunks_f = [e for e in streamed_f if e != "[DONE]"]
    chunks_p = [e for e in streamed_p if e != "[DONE]"]
    with_logprobs_f = [c for c in chunks_f if c["choices"][0].get("logprobs")]
    assert [c["choices"][0]["finish_reason"] for c in with_logprobs_f] == ["length"]
    assert len(with_logprobs_f[0]["choices"][0]["logprobs"]["content"]) == 3
    per_delta = [t for c in chunks_p if c["choices"][0].get("logprobs")
                 for t in c["choices"][0]["logprobs"]["content"]]
    assert len(per_delta) == 3 and all(c["choices"][0]["finish_reason"] is None for c in chunks_p
                                       if c["choices"][0].get("logprobs"))


# -- streams -----------------------------------------------------------------------------------------


def check_chat_stream(stream: list[Any], finish: str, usage: bool) -> list[dict[str, Any]]:
    """The sequence OpenAI streams: the role delta, content deltas, one finish chunk (empty delta),
    the usage chunk (`choices: []`) when asked for, then [DONE]; one id and object throughout."""
    assert stream[-1] == "[DONE]" and stream.count("[DONE]") == 1
    chunks: list[dict[str, Any]] = stream[:-1]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    if usage:
        assert chunks[-1]["choices"] == [] and "usage" in chunks[-1]
        chunks = chunks[:-1]
    assert all(c.get("usage") is None for c in chunks)  # only the usage chunk carries it
    first, *deltas, last = [c["choices"][0] for c in chunks]
    assert first["delta"]["role"] == "assistant" and first["finish_reason"] is None
    assert all(set(d["delta"]) == {"content"} and d["finish_reason"] is None for d in deltas)
    # the finish chunk's delta is empty, unless text held back for a stop string ends with it
    assert set(last["delta"]) <= {"content"} and last["finish_reason"] == finish
    assert any(d["delta"].get("content") for d in [*deltas, last]), chunks
    return chunks


def test_chat_stream_event_sequence(pair: Pair) -> None:
    """Streamed chat, cut (`length`, with stream_options.include_usage) and stopped (`stop`, without):
    the same sequence on both, the same usage keys. Differences, on purpose (OpenAI's stream): the
    role delta's `content` is "" (llama-server: null), and with include_usage every chunk before the
    usage chunk carries `usage: null` (llama-server leaves the key out)."""
    cut = {"model": "llm", "messages": HI, "max_tokens": 3, "temperature": 0, "stream": True,
           "stream_options": {"include_usage": True}}
    fleet, peer = (events(r) for r in both(pair, "/v1/chat/completions", cut))
    chunks_f, chunks_p = check_chat_stream(fleet, "length", True), check_chat_stream(peer, "length", True)
    assert chunks_f[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks_p[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert all("usage" in c and c["usage"] is None for c in chunks_f)
    assert not any("usage" in c for c in chunks_p)
    check_usage(fleet[-2]["usage"], peer[-2]["usage"])
    assert fleet[-2]["usage"]["completion_tokens"] == peer[-2]["usage"]["completion_tokens"] == 3
    assert set(fleet[-2]) == set(peer[-2]) - PEER_ONLY

    stopped = {"model": "llm", "messages": HI, "max_tokens": 8, "temperature": 0, "stream": True,
               "stop": [" "]}
    fleet, peer = (events(r) for r in both(pair, "/v1/chat/completions", stopped))
    for stream in (fleet, peer):
        chunks = check_chat_stream(stream, "stop", False)
        assert not any("usage" in c for c in chunks)  # not asked for: no usage anywhere
        assert " " not in "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)


def test_completion_stream_event_sequence(pair: Pair) -> None:
    """Streamed completions with include_usage: text chunks, a finish chunk, [DONE] on
    both, the same usage. Difference, on purpose: the fleet sends the usage as OpenAI does, in a
    chunk of its own with `choices: []` just before [DONE]; llama-server puts it on the finish
    chunk."""
    body = {"model": "llm", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    fleet, peer = (events(r) for r in both(pair, "/v1/completions", body))
    for stream in (fleet, peer):
        assert stream[-1] == "[DONE]" and all(c["object"] == "text_completion" for c in stream[:-1])
        assert len({c["id"] for c in stream[:-1]}) == 1
    *texts_f, finish_f, usage_f, _ = fleet
    *texts_p, finish_p, _ = peer
    for texts, finish in ((texts_f, finish_f), (texts_p, finish_p)):
        assert texts and all(t["choices"][0]["finish_reason"] is None and t["choices"][0]["text"]
                             for t in texts)
        last = finish["choices"][0]
        assert last["finish_reason"] == "length" and isinstance(last["text"], str)
        assert set(last) == {"text", "index", "logprobs", "finish_reason"}
    assert usage_f["choices"] == [] and finish_f["usage"] is None
    check_usage(usage_f["usage"], finish_p["usage"])
    assert usage_f["usage"]["prompt_tokens"] == finish_p["usage"]["prompt_tokens"]
    assert usage_f["usage"]["completion_tokens"] == finish_p["usage"]["completion_tokens"] == 3


# -- errors ------------------------------------------------------------------------------------------


def error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, (status, response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    return err


def test_error_shapes_and_status_codes(pair: Pair) -> None:
    """The same bad inputs to both: `{"error": {"message", "type", ...}}` on both. Missing
    messages or prompt and a max_tokens of the wrong type: 400 `invalid_request_error` on both.
    Differences, on purpose: the fleet's `code` is a string naming the problem (OpenAI's; `param`
    beside it) where llama-server's is the HTTP status as a number; a body that is not JSON is the
    client's fault, a 400 (llama-server answers 500 `server_error`, which SDKs retry); an unknown
    model is the fleet's 404 `model_not_found` (a model names a pool), while llama-server serves
    its one model whatever `model` says."""
    cases: list[tuple[str, dict[str, Any] | bytes, int, int, str | None]] = [
        ("/v1/chat/completions", b'{"model": "llm", "messages":', 400, 500, None),
        ("/v1/chat/completions", {"model": "llm"}, 400, 400, "messages"),
        ("/v1/chat/completions", {"model": "llm", "messages": HI, "max_tokens": "ten"}, 400, 400,
         "max_tokens"),
        ("/v1/completions", {"model": "llm"}, 400, 400, "prompt"),
        ("/v1/completions", {"model": "llm", "prompt": PROMPT, "max_tokens": "ten"}, 400, 400, "max_tokens"),
    ]
    for path, body, fleet_status, peer_status, param in cases:
        fleet, peer = both(pair, path, body)
        ef, ep = error(fleet, fleet_status), error(peer, peer_status)
        assert set(ef) == {"message", "type", "param", "code"} and set(ep) == {"message", "type", "code"}
        assert isinstance(ef["code"], str) and ep["code"] == peer_status
        assert ef["param"] == param and (param is None or param in ep["message"])
        assert ef["type"] == "invalid_request_error"
        assert ep["type"] == ("server_error" if peer_status == 500 else "invalid_request_error")
        if param is None:
            assert ef["code"] == "invalid_json" and "not JSON" in ef["message"]

    unknown = {"model": "no-such-model", "messages": HI, "max_tokens": 1, "temperature": 0}
    fleet, peer = both(pair, "/v1/chat/completions", unknown)
    ef = error(fleet, 404)
    assert ef["code"] == "model_not_found" and ef["param"] == "model" and "no-such-model" in ef["message"]
    assert peer.status_code == 200 and peer.json()["choices"][0]["finish_reason"] == "length"


# -- the Responses API and the model listing -----------------------------------------------------------


def test_responses_object_shape(pair: Pair) -> None:
    """POST /v1/responses (both serve it): a Response with one `message` item holding one
    `output_text` part, usage as input/output/total tokens with input_tokens_details.cached_tokens,
    on both. Difference, on purpose: cut by max_output_tokens, the fleet's Response is
    `incomplete` with `incomplete_details.reason: "max_output_tokens"` and its item `incomplete`, as
    OpenAI's (openai-agents' streamed runs depend on it); llama-server says `completed`."""
    fleet, peer = ok(*both(pair, "/v1/responses",
                           {"model": "llm", "input": "Say hi", "max_output_tokens": 3, "temperature": 0}))
    for r in (fleet, peer):
        assert r["object"] == "response" and r["id"].startswith("resp_")
        assert [item["type"] for item in r["output"]] == ["message"]
        item = r["output"][0]
        assert item["role"] == "assistant" and item["id"].startswith("msg_")
        assert [part["type"] for part in item["content"]] == ["output_text"]
        assert {"text", "annotations", "logprobs"} <= set(item["content"][0])
        usage = r["usage"]
        assert {"input_tokens", "output_tokens", "total_tokens", "input_tokens_details"} <= set(usage)
        assert set(usage["input_tokens_details"]) == {"cached_tokens"}
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
        assert usage["output_tokens"] == 3
    # completed_at: "only present when the status is `completed`" (OpenAI's), which llama-server's is
    assert set(peer) - set(fleet) == {"completed_at"}, sorted(set(peer) - set(fleet))
    assert fleet["status"] == "incomplete" and fleet["incomplete_details"] == {"reason": "max_output_tokens"}
    assert fleet["output"][0]["status"] == "incomplete"
    assert peer["status"] == "completed" and peer["output"][0]["status"] == "completed"


def test_model_listing_shape(pair: Pair) -> None:
    """GET /v1/models: `{object: "list", data: [{id, object: "model", created, owned_by}]}` on
    both; llama-server adds its own keys (a `models` list in Ollama's shape, each entry's `meta`),
    the fleet lists names, the pool's among them."""
    fleet, peer = (httpx.get(f"{url}/v1/models", timeout=30) for url in (pair.fleet.url, pair.peer.url))
    listed_f, listed_p = ok(fleet, peer)
    assert listed_f["object"] == listed_p["object"] == "list"
    required = {"id", "object", "created", "owned_by"}
    for model in listed_f["data"] + listed_p["data"]:
        assert required <= set(model) and model["object"] == "model" and isinstance(model["created"], int)
    assert all(set(m) == required for m in listed_f["data"])
    assert "llm" in [m["id"] for m in listed_f["data"]]
    assert set(listed_f) == {"object", "data"} and set(listed_p) - set(listed_f) == {"models"}
