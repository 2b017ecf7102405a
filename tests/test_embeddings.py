"""Embeddings end to end: a real `fleet worker` on the embedded model (gemma-3-270m, 640
dimensions), a real `fleet serve`, the official `openai` and `ollama` clients, the Python
producers and a plain RQ producer; hostile requests get a 400 naming the problem and the worker
serves on; a generation job beside embedding jobs keeps its text. The engine's own embedding
path (the graph cut) is checked against llama.cpp's pooling at the end."""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import threading
import time
from typing import Any

import httpx
import ollama
import openai
import pytest
from redis import Redis
from rq import Queue
from rq.serializers import JSONSerializer

from backends.contract.keys import JOB_FUNCTION, usage_key
from dispatcher import Fleet, JobFailed
from dispatcher.aio import AsyncFleet
from tests.gateway_harness import wait_until_healthy

pytestmark = [pytest.mark.timeout(600), pytest.mark.model]
N_EMBD = 640  # gemma-3-270m's hidden size
SIMILAR = ("The cat sat on the mat.", "A kitten is sitting on a rug.")
UNRELATED = ("Quarterly revenue grew by twelve percent.", "The train to Berlin leaves at noon.")


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


def oai(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)


def test_openai_and_ollama_clients(workers, gateways) -> None:
    workers.start("e1", backend__slots=4)
    gw = gateways.start()
    wait_until_healthy(gw)
    client = oai(gw)

    texts = [*SIMILAR, *UNRELATED]
    first = client.embeddings.create(model="llm", input=texts)
    assert first.object == "list" and first.model == "llm"
    assert [d.index for d in first.data] == [0, 1, 2, 3] and all(d.object == "embedding" for d in first.data)
    vectors = [d.embedding for d in first.data]
    assert all(len(v) == N_EMBD for v in vectors)
    assert all(abs(norm(v) - 1) < 1e-5 for v in vectors)  # L2-normalised, as OpenAI's
    assert first.usage.prompt_tokens > len(texts) and first.usage.total_tokens == first.usage.prompt_tokens
    # similar sentences are nearer than unrelated ones, every pair
    similar = cosine(vectors[0], vectors[1])
    assert all(similar > cosine(vectors[i], vectors[j]) for i in (0, 1) for j in (2, 3))

    # deterministic: the same request gives the same floats
    again = client.embeddings.create(model="llm", input=texts)
    assert [d.embedding for d in again.data] == vectors
    # order kept: the list reversed gives the vectors reversed
    reverse = client.embeddings.create(model="llm", input=texts[::-1])
    assert [d.embedding for d in reverse.data] == vectors[::-1]

    # base64 decodes to the very same float32 values (the SDK decodes it when asked for floats;
    # raw HTTP shows the string)
    raw = httpx.post(f"{gw.url}/v1/embeddings", json={"model": "llm", "input": texts[0],
                                                      "encoding_format": "base64"}, timeout=60).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack(f"<{N_EMBD}f", packed)) == vectors[0]

    # dimensions: the first 256 values, normalised again (OpenAI's matryoshka cut)
    cut = client.embeddings.create(model="llm", input=texts[0], dimensions=256).data[0].embedding
    assert len(cut) == 256 and abs(norm(cut) - 1) < 1e-5
    scale = norm(vectors[0][:256])
    assert max(abs(c - v / scale) for c, v in zip(cut, vectors[0][:256], strict=True)) < 1e-6

    # Ollama's /api/embed (normalised, same vectors) and the legacy /api/embeddings (as pooled)
    oc = ollama.Client(host=gw.url)
    embedded = oc.embed(model="llm", input=list(SIMILAR))
    assert [len(e) for e in embedded.embeddings] == [N_EMBD, N_EMBD]
    assert max(abs(a - b) for a, b in zip(embedded.embeddings[0], vectors[0], strict=True)) < 1e-6
    assert embedded.prompt_eval_count and embedded.prompt_eval_count > 2 and embedded.total_duration
    single = oc.embed(model="llm", input=SIMILAR[1], dimensions=64)
    assert len(single.embeddings) == 1 and len(single.embeddings[0]) == 64
    legacy = oc.embeddings(model="llm", prompt=SIMILAR[0]).embedding
    assert len(legacy) == N_EMBD and norm(legacy) > 1.5  # not normalised, as Ollama's legacy route
    assert cosine(list(legacy), vectors[0]) > 0.99999


def test_hostile_requests_get_400s_and_the_worker_serves_on(workers, gateways) -> None:
    worker = workers.start("e2", backend__slots=4, backend__embed_n_ctx=256)
    gw = gateways.start()
    wait_until_healthy(gw)
    url = f"{gw.url}/v1/embeddings"

    def refused(body: dict[str, Any], says: str, route: str = url) -> None:
        r = httpx.post(route, json=body, timeout=120)
        assert r.status_code == 400, (body if len(str(body)) < 300 else "...", r.status_code, r.text[:300])
        message = r.json()["error"]["message"] if route == url else r.json()["error"]
        assert says in message, message

    refused({"model": "llm", "input": []}, "no inputs")
    refused({"model": "llm", "input": ["x"] * 5000}, "at most 2048")
    refused({"model": "llm", "input": ["ok", 7]}, "item 1 is a token array or number")
    refused({"model": "llm", "input": [[1, 2, 3]]}, "item 0 is a token array")
    refused({"model": "llm", "input": [["nested", "list"]]}, "item 0 is a token array")
    refused({"model": "llm", "input": ["fine", {"a": 1}]}, "item 1 is not a string")
    refused({"model": "llm", "input": ["fine", ""]}, "item 1 is an empty string")
    refused({"model": "llm", "input": "x" * 2_000_000}, "2,000,000 characters")
    refused({"model": "llm", "input": "hi", "dimensions": 0}, "dimensions")
    refused({"model": "llm", "input": "hi", "dimensions": True}, "dimensions")
    refused({"model": "llm", "input": "hi", "encoding_format": "int8"}, "encoding_format")
    refused({"model": "llm"}, "'input' is required")
    refused({"model": "llm", "input": "hi", "foo": 1, "bar": 2}, "'bar', 'foo' are not supported")
    refused({"model": "llm", "input": "hi", "options": {"temperature": 1}}, "temperature",
            route=f"{gw.url}/api/embed")
    # the worker's own rejections: over the model's dimensions, over its embedding context
    refused({"model": "llm", "input": "hi", "dimensions": 10_000},
            "dimensions 10000 is more than this model's 640")
    refused({"model": "llm", "input": ["short", "word " * 400]},
            "input 1 has 402 tokens; this worker embeds at most 256 tokens per input")
    # Ollama truncates by default: the same long input is cut to fit
    cut = httpx.post(f"{gw.url}/api/embed", json={"model": "llm", "input": "word " * 400}, timeout=60).json()
    assert cut["prompt_eval_count"] == 256 and len(cut["embeddings"][0]) == N_EMBD

    assert worker.alive()
    ok = oai(gw).embeddings.create(model="llm", input=["still serving"])
    assert len(ok.data[0].embedding) == N_EMBD


def test_generation_beside_embedding_jobs_keeps_its_text(workers, gateways) -> None:
    workers.start("e3", backend__slots=4)
    gw = gateways.start()
    wait_until_healthy(gw)
    client = oai(gw)
    ask = {"model": "llm", "prompt": "The three largest cities of France are", "max_tokens": 40,
           "temperature": 0}
    alone = client.completions.create(**ask).choices[0].text
    texts = [f"Sentence {i}: a note about gardens, rivers and the weather in spring." for i in range(40)]
    baseline = client.embeddings.create(model="llm", input=texts[:3]).data

    stop = threading.Event()
    spans: list[tuple[float, float, int]] = []  # (start, end, vectors) of each embedding request

    def embed_until_stopped() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            n = len(client.embeddings.create(model="llm", input=texts).data)
            spans.append((t0, time.monotonic(), n))

    thread = threading.Thread(target=embed_until_stopped)
    thread.start()
    while not spans:  # embedding jobs are flowing before the completion starts
        time.sleep(0.05)
    started = time.monotonic()
    beside = client.completions.create(**ask).choices[0].text
    ended = time.monotonic()
    stop.set()
    thread.join(300)
    assert beside == alone
    assert any(s < ended and e > started for s, e, _ in spans)  # they overlapped
    assert all(n == 40 for _, _, n in spans)
    assert all(len(d.embedding) == N_EMBD for d in baseline)


def test_python_and_plain_rq_producers(workers, redis_url: str, redis: Redis) -> None:
    """On a worker with backend.overlap (the engine steps on a helper thread; embeddings wait
    for the step in flight)."""
    workers.start("e4", backend__slots=4, backend__overlap=True)
    fleet = Fleet(redis_url)
    vectors = fleet.embed([*SIMILAR, *UNRELATED], tenant="acme")
    assert [len(v) for v in vectors] == [N_EMBD] * 4
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2])

    job = fleet.submit_embed(SIMILAR[0], dimensions=32, tenant="acme")
    result = job.result(timeout=60)
    assert result["dimensions"] == 32 and result["usage"]["completion_tokens"] == 0
    used = result["usage"]["prompt_tokens"]
    assert used > 2

    async def via_asyncio() -> list[list[float]]:
        async with AsyncFleet(redis_url) as afleet:
            return await afleet.embed(SIMILAR[0])

    assert max(abs(a - b) for a, b in zip(asyncio.run(via_asyncio())[0], vectors[0], strict=True)) < 1e-6

    # a plain RQ producer: the allow-listed function, `kind: "embed"` in its one argument
    queue = Queue("llm:default", connection=redis, serializer=JSONSerializer)
    rq_job = queue.enqueue(JOB_FUNCTION, {"kind": "embed", "input": [SIMILAR[1]]})
    plain = fleet.job(rq_job.id).result(timeout=60)
    assert len(plain["embeddings"]) == 1
    assert rq_job.latest_result(timeout=5).return_value["embeddings"] == plain["embeddings"]

    # a bad one from a plain producer fails with the reason, not the worker
    bad = queue.enqueue(JOB_FUNCTION, {"kind": "embed", "input": [""]})
    with pytest.raises(JobFailed) as failed:
        fleet.job(bad.id).result(timeout=60)
    assert "item 0 is an empty string" in failed.value.error

    # the tenant's usage counts the embedding jobs' prompt tokens (two jobs, two requests)
    total = {k.decode(): int(v) for k, v in redis.hgetall(usage_key("acme", "total")).items()}
    assert total["requests"] == 2 and total["prompt_tokens"] >= used + 4 and total.get("failed", 0) == 0


def test_the_graph_cut_gives_llamacpp_mean_pooling_and_long_inputs_span_decodes() -> None:
    """The engine's embedding context (hidden states, graph stopped before the vocabulary
    projection, mean pooled here) against llama.cpp's own MEAN pooling on the same model; an
    input longer than one decode (embed_n_batch) gives the vector it gives in one decode."""
    import llama_cpp as ll
    import numpy as np

    from backends.llamacpp.embedding import EmbeddingContext
    from backends.llamacpp.engine import LlamaCppBackend
    from backends.llamacpp_settings import LlamaCppSettings

    engine = LlamaCppBackend(LlamaCppSettings(slots=1, embed_n_batch=64, embed_batch=4))
    try:
        long_text = "Rivers carry water from the hills to the sea, " * 12
        texts = [*SIMILAR, long_text]
        ours = engine.embed(texts, [False] * 3)
        assert ours[2].tokens > 64  # spans several decodes of 64 tokens
        assert engine._embedding is not None and engine._embedding.graph_cuts >= 3
        wide = EmbeddingContext(engine.model.model, n_ctx=512, n_batch=512, n_seq=4,
                                threads=engine.model.threads)
        try:
            one_decode = wide.embed(texts, [False] * 3)  # all in one decode
        finally:
            wide.close()
        # llama.cpp's own MEAN pooling, the whole graph
        params = ll.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = 512
        params.n_seq_max, params.embeddings, params.kv_unified = 4, True, True
        params.pooling_type = ll.LLAMA_POOLING_TYPE_MEAN
        ctx = ll.llama_init_from_model(engine.model.model, params)
        batch = ll.llama_batch_init(512, 0, 1)
        try:
            n = 0
            for seq, emb in enumerate(one_decode):
                for pos, token in enumerate(engine._embedding.tokens_of(texts[seq])):
                    batch.token[n], batch.pos[n], batch.n_seq_id[n], batch.logits[n] = token, pos, 1, 1
                    batch.seq_id[n][0] = seq
                    n += 1
                assert emb.tokens == len(engine._embedding.tokens_of(texts[seq]))
            batch.n_tokens = n
            assert ll.llama_decode(ctx, batch) == 0
            theirs = [np.ctypeslib.as_array(ll.llama_get_embeddings_seq(ctx, s), shape=(N_EMBD,)).copy()
                      for s in range(3)]
        finally:
            ll.llama_batch_free(batch)
            ll.llama_free(ctx)
        for a, b, c in zip(ours, one_decode, theirs, strict=True):
            unit = [np.asarray(v) / np.linalg.norm(v) for v in (a.vector, b.vector, c)]
            assert float(unit[1] @ unit[2]) > 0.999999  # the same pooling as llama.cpp's
            assert float(unit[0] @ unit[1]) > 0.999  # chunked vs whole: kernels round differently
    finally:
        engine.close()


def test_llama_server_backend_embeds_or_says_it_cannot(workers, redis_url: str, tmp_path) -> None:
    """The llama-server backend forwards to its /v1/embeddings: the in-process engine's vectors
    (both mean pooling on the same model); a server started without --embeddings gives the job
    a clear error. `-kvu`: with one KV stream per slot (its default) this llama-server's mean
    pooling of several inputs in one batch is wrong for all but the first (cosine ~0.76 with the
    same input alone; measured, docs/gateway.md)."""
    from ecosystem.local.llama_server import start_llama_server

    texts = [*SIMILAR, UNRELATED[0]]
    with start_llama_server(tmp_path / "emb", parallel=4, ctx=4096, threads=1,
                            extra_args=["--embeddings", "--pooling", "mean", "-kvu"]) as server:
        workers.start("ls1", pool="ls", backend__type="llama-server", backend__endpoint=server.url,
                      backend__connect_timeout=30)
        via_server = Fleet(redis_url, pool="ls").embed(texts, timeout=120)
    with start_llama_server(tmp_path / "plain", parallel=1, ctx=1024, threads=1) as plain:
        workers.start("ls2", pool="plain", backend__type="llama-server", backend__endpoint=plain.url,
                      backend__connect_timeout=30)
        with pytest.raises(JobFailed) as failed:
            Fleet(redis_url, pool="plain").embed("hi", timeout=60)
    assert "(501)" in failed.value.error and "--embeddings" in failed.value.error
    workers.start("ip1", backend__slots=2)
    in_process = Fleet(redis_url).embed(texts, timeout=120)
    assert all(abs(norm(v) - 1) < 1e-5 for v in via_server)
    assert all(cosine(a, b) > 0.999 for a, b in zip(via_server, in_process, strict=True))
