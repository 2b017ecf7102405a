"""llama-server's /tokenize, /detokenize and /apply-template on `fleet serve`: a real redis-server,
one real worker on the embedded gemma-3-270m, a real gateway, and beside them a real llama-server
on the same model file, started with the `gemma` template the worker uses (the GGUF ships none;
without it llama-server falls back to chatml). The same requests go to both and the answers must
be equal: token ids, pieces (a character split across byte tokens comes as byte lists),
detokenized text, the rendered chat. Bad input is a 400 naming the field, after which the worker
still serves; a tenant's models apply as they do to a chat."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from backends.contract.observe_schema import PROMPT_SHOWN, short_params
from backends.contract.schema import MAX_PROMPT_CHARS
from backends.contract.text_ops import MAX_TEXT_TOKENS, TextRequest
from tests.gateway_harness import start_gateway, wait_until_healthy
from tests.harness import RedisServer, start_worker
from tests.ollama_api_server import serve
from tests.real_servers import llama_server, model_path
from tests.test_conformance_peer import Pair

pytestmark = pytest.mark.timeout(300)

TENANTS = {
    "allowed": {"api_keys": ["key-allowed"], "models": ["llm"]},
    "outsider": {"api_keys": ["key-outsider"], "models": ["other"]},  # a pool with no worker here
    "wide": {"api_keys": ["key-wide"]},
}
# llm: the in-process engine; peer: a worker on the llama-server backend (that llama-server);
# oll: a worker on the Ollama backend (the Ollama-API test server)
POOLS = {"llm": "llm", "peer": "peer", "oll": "oll", "other": "other"}
SETTINGS: dict[str, Any] = {"gateway__tenants": TENANTS, "gateway__models": POOLS}
ALLOWED = {"Authorization": "Bearer key-allowed"}
OUTSIDER = {"Authorization": "Bearer key-outsider"}
WIDE = {"Authorization": "Bearer key-wide"}
HIEROGLYPH = "\U00013000"  # 𓀀: no token of its own in gemma's vocabulary, four byte tokens
CHAT = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": " What is 2+2? "}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp("tokenize")
    with RedisServer.start(tmp / "redis") as redis_server, \
            llama_server(tmp / "llama-server", parallel=1, ctx=1024, wait=False,
                         extra_args=["--chat-template", "gemma", "--no-jinja"]) as peer:
        ollama = serve(str(model_path()), names=("gemma3:270m",))
        workers = [start_worker(redis_server.url, "tok-w1", tmp / "logs", backend__slots=2, **SETTINGS)]
        gateway = start_gateway(redis_server.url, tmp / "logs", name="tok-gateway", **SETTINGS)
        try:
            peer.wait_healthy(timeout=120)
            workers += [
                start_worker(redis_server.url, "tok-peer", tmp / "logs", pool="peer", **SETTINGS,
                             backend__type="llama-server", backend__endpoint=peer.url),
                start_worker(redis_server.url, "tok-oll", tmp / "logs", pool="oll", **SETTINGS,
                             backend__type="ollama", backend__endpoint=ollama.url,
                             backend__model="gemma3:270m"),
            ]
            wait_until_healthy(gateway)
            yield Pair(gateway, peer)
        finally:
            gateway.stop()
            for worker in workers:
                worker.kill()
            ollama.shutdown()


def both(pair: Pair, path: str, body: dict[str, Any]) -> tuple[Any, Any]:
    """The same body to the fleet (with the tenant's key, no model: llama-server's clients send
    none) and to llama-server; both answers' JSON, each checked to be a 200."""

    def send(base: str) -> Any:
        response = httpx.post(f"{base}{path}", content=json.dumps(body).encode(), timeout=120,
                              headers={"content-type": "application/json", **ALLOWED})
        assert response.status_code == 200, (base, path, body, response.text)
        return response.json()

    with ThreadPoolExecutor(2) as pool:
        fleet, peer = pool.map(send, (pair.fleet.url, pair.peer.url))
    return fleet, peer


def fleet_post(pair: Pair, path: str, body: dict[str, Any] | None = None, *, content: bytes | None = None,
               headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{pair.fleet.url}{path}", json=body, content=content, timeout=120,
                      headers=ALLOWED if headers is None else headers)


@pytest.mark.model
def test_tokenize_answers_what_llama_server_answers(pair: Pair) -> None:
    """Ids with and without BOS, control-token text read as the token or as text, pieces as text
    or, for the bytes of a character split across tokens, as byte lists; an empty content."""
    texts = ["Hello <start_of_turn> wörld 😀 日本", f"a{HIEROGLYPH}b", "tab\tnul\x00 end", ""]
    for content in texts:
        for flags in ({}, {"add_special": True}, {"parse_special": False}, {"with_pieces": True},
                      {"add_special": True, "parse_special": False, "with_pieces": True}):
            fleet, peer = both(pair, "/tokenize", {"content": content, **flags})
            assert fleet == peer, (content, flags)
    plain, _ = both(pair, "/tokenize", {"content": "Hello <start_of_turn>"})
    as_text, _ = both(pair, "/tokenize", {"content": "Hello <start_of_turn>", "parse_special": False})
    assert plain["tokens"][-1] == 105 and 105 not in as_text["tokens"]  # <start_of_turn>: one token
    assert both(pair, "/tokenize", {"content": "Hello", "add_special": True})[0] == {"tokens": [2, 9259]}
    pieces, _ = both(pair, "/tokenize", {"content": f"a{HIEROGLYPH}b", "with_pieces": True})
    assert [p["piece"] for p in pieces["tokens"]] == ["a", [0xF0], [0x93], [0x80], [0x80], "b"]


@pytest.mark.model
def test_detokenize_round_trips_and_answers_what_llama_server_answers(pair: Pair) -> None:
    text = f"Hello <start_of_turn> wörld {HIEROGLYPH} 😀"
    ids, _ = both(pair, "/tokenize", {"content": text, "add_special": True})
    fleet, peer = both(pair, "/detokenize", ids)
    assert fleet == peer == {"content": "<bos>" + text}  # control tokens written out, as llama-server
    byte_ids, _ = both(pair, "/tokenize", {"content": HIEROGLYPH})
    assert len(byte_ids["tokens"]) == 4
    split = byte_ids["tokens"][:2]  # the first two of its four bytes: a broken character
    fleet, peer = both(pair, "/detokenize", {"tokens": [9259, *split, 9259]})
    assert fleet == peer == {"content": "Hello\ufffdHello"}
    assert both(pair, "/detokenize", {"tokens": []}) == ({"content": ""}, {"content": ""})


@pytest.mark.model
def test_apply_template_renders_the_chat_as_llama_server_does(pair: Pair) -> None:
    fleet, peer = both(pair, "/apply-template", {"messages": CHAT})
    assert fleet == peer
    assert fleet["prompt"] == ("<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"
                               "Hello! How can I help?<end_of_turn>\n<start_of_turn>user\nWhat is 2+2?"
                               "<end_of_turn>\n<start_of_turn>model\n")
    # a system message goes into the first user turn, as the template does it
    system = [{"role": "system", "content": "Be brief."}, CHAT[0]]
    fleet, peer = both(pair, "/apply-template", {"messages": system, "model": "llm", "max_tokens": 5})
    assert fleet == peer and fleet["prompt"].startswith("<start_of_turn>user\nBe brief.\n\nHi there")
    # tools: the prompt a chat completion with them gets (their instructions in the first turn)
    tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}
    with_tools = fleet_post(pair, "/apply-template", {"messages": CHAT, "tools": [tool]})
    assert with_tools.status_code == 200, with_tools.text
    prompt = with_tools.json()["prompt"]
    assert "get_weather" in prompt and prompt.endswith("What is 2+2?<end_of_turn>\n<start_of_turn>model\n")


# (path, body, the field the 400 names, a word of its message)
BAD: list[tuple[str, dict[str, Any], str, str]] = [
    ("/tokenize", {}, "content", "required"),
    ("/tokenize", {"content": 5}, "content", "string"),
    ("/tokenize", {"content": ["a", 5]}, "content", "string"),
    ("/tokenize", {"content": "x" * (MAX_PROMPT_CHARS + 1)}, "content", "1000000"),
    ("/tokenize", {"content": "x", "add_special": "yes"}, "add_special", "boolean"),
    ("/tokenize", {"content": "x", "with_piece": True}, "with_piece", "not supported"),
    # under the character limit, over the token limit: the worker counts and refuses it
    ("/tokenize", {"content": HIEROGLYPH * (MAX_TEXT_TOKENS // 4 + 1)}, "content", f"{MAX_TEXT_TOKENS:,}"),
    ("/detokenize", {}, "tokens", "required"),
    ("/detokenize", {"tokens": "abc"}, "tokens", "list"),
    ("/detokenize", {"tokens": [5, -1]}, "tokens", "item 1"),
    ("/detokenize", {"tokens": [1.5]}, "tokens", "item 0"),
    ("/detokenize", {"tokens": [True]}, "tokens", "item 0"),
    ("/detokenize", {"tokens": [2**31]}, "tokens", "item 0"),
    ("/detokenize", {"tokens": [9259, 262_144]}, "tokens", "262,144"),  # the model's vocabulary size
    ("/detokenize", {"tokens": [1] * (MAX_TEXT_TOKENS + 1)}, "tokens", "at most"),
    ("/apply-template", {}, "messages", "messages"),
    ("/apply-template", {"messages": [{"role": "narrator", "content": "x"}]}, "messages[0].role", "role"),
]


@pytest.mark.model
def test_bad_input_is_a_400_naming_the_field_and_the_worker_serves_on(pair: Pair) -> None:
    for path, body, field, word in BAD:
        response = fleet_post(pair, path, body)
        assert response.status_code == 400, (path, field, response.status_code, response.text[:300])
        error = response.json()["error"]
        assert error["param"] == field and error["type"] == "invalid_request_error", (path, error)
        assert word in error["message"] and field.split("[")[0] in error["message"], (path, error)
    json_type = {**ALLOWED, "content-type": "application/json"}
    not_json = fleet_post(pair, "/tokenize", content=b"{nope", headers=json_type)
    assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "invalid_json"
    # the worker took every rejection as an answer, not a crash: it still tokenizes and generates
    assert fleet_post(pair, "/tokenize", {"content": "Hello"}).json() == {"tokens": [9259]}
    chat = fleet_post(pair, "/v1/chat/completions", {"model": "llm", "messages": CHAT, "max_tokens": 4,
                                                     "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] > 0 and chat.json()["choices"][0]["message"]["content"]


@pytest.mark.model
def test_routes_as_llama_server_has_them_and_keys_apply(pair: Pair) -> None:
    """No /v1 aliases (llama-server has none); a key is needed; a tenant's models apply as they do
    to a chat: the same 404 for a model it may not use, and without `model` its own model (here a
    pool without a worker: the request never reaches the pool it may not use)."""
    for path in ("/v1/tokenize", "/v1/detokenize", "/v1/apply-template"):
        assert fleet_post(pair, path, {"content": "x"}).status_code == 404
        assert httpx.post(f"{pair.peer.url}{path}", json={"content": "x"}).status_code == 404
    assert fleet_post(pair, "/tokenize", {"content": "x"}, headers={}).status_code == 401
    bodies: dict[str, dict[str, Any]] = {"/tokenize": {"content": "x"}, "/detokenize": {"tokens": [9259]},
              "/apply-template": {"messages": CHAT}}
    chat = fleet_post(pair, "/v1/chat/completions", {"model": "llm", "messages": CHAT}, headers=OUTSIDER)
    assert chat.status_code == 404 and chat.json()["error"]["code"] == "model_not_found"
    for path, body in bodies.items():
        refused = fleet_post(pair, path, {**body, "model": "llm"}, headers=OUTSIDER)
        assert (refused.status_code, refused.json()) == (chat.status_code, chat.json()), path
        own = fleet_post(pair, path, body, headers=OUTSIDER)
        assert own.status_code == 503 and own.json()["error"]["code"] == "no_workers", (path, own.text)
        allowed = fleet_post(pair, path, {**body, "model": "llm"})
        assert allowed.status_code == 200 and allowed.headers["x-fleet-job-id"], (path, allowed.text)


@pytest.mark.model
def test_the_llama_server_backend_forwards_and_the_ollama_backend_refuses(pair: Pair) -> None:
    """A worker on the llama-server backend answers with its server's own routes: what the
    in-process worker answers; ids outside the vocabulary are refused before they reach the
    server (which would answer a 500). Ollama has no such routes: a 400 that says so."""
    tokenize = {"content": f"Hi <start_of_turn> {HIEROGLYPH}", "with_pieces": True, "add_special": True}
    requests: list[tuple[str, dict[str, Any]]] = [
        ("/tokenize", tokenize), ("/detokenize", {"tokens": [2, 9259, 478, 385, 366, 366]}),
        ("/apply-template", {"messages": CHAT})]
    for path, body in requests:
        ours, forwarded = (fleet_post(pair, path, {**body, "model": pool}, headers=WIDE)
                           for pool in ("llm", "peer"))
        assert ours.status_code == forwarded.status_code == 200, (path, ours.text, forwarded.text)
        assert ours.json() == forwarded.json(), path
    refused = fleet_post(pair, "/detokenize", {"tokens": [9259, 262_144], "model": "peer"}, headers=WIDE)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens", refused.text
    assert "262,144" in refused.json()["error"]["message"]
    for path, body in requests:
        ollama = fleet_post(pair, path, {**body, "model": "oll"}, headers=WIDE)
        assert ollama.status_code == 400, (path, ollama.text)
        assert "not supported by the ollama backend" in ollama.json()["error"]["message"]
    chat = fleet_post(pair, "/v1/chat/completions", {"model": "peer", "messages": CHAT, "max_tokens": 2},
                      headers=WIDE)
    assert chat.status_code == 200, chat.text


def test_the_job_history_keeps_a_text_job_short() -> None:
    """A text job's params as the worker records them: the content shortened, ids counted, a
    chat as a chat's (not a megabyte of text per job in Redis)."""
    def params(**fields: Any) -> dict[str, Any]:
        return short_params(TextRequest.model_validate({"kind": "text", **fields}))

    assert len(params(op="tokenize", content="x" * 100_000)["content"]) == PROMPT_SHOWN
    assert params(op="detokenize", tokens=[1] * 1000)["tokens"] == 1000
    chat = params(op="apply_template", chat={"messages": CHAT})
    assert (chat["messages"], chat["last_message"], chat["op"]) == (3, CHAT[-1]["content"], "apply_template")
    assert "chat" not in chat
