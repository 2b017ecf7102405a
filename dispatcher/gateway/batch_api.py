"""OpenAI's Files and Batch APIs over fleet batches (docs/batch.md):

    POST /v1/files (purpose=batch)   GET /v1/files/{id}   GET /v1/files/{id}/content
    POST /v1/batches   GET /v1/batches   GET /v1/batches/{id}   POST /v1/batches/{id}/cancel

An uploaded file lives in Redis (fleet:file:<id>, FILE_TTL, at most MAX_FILE_BYTES). A batch is
an ordinary fleet batch (dispatcher/batch); its output and error files are not stored again but
streamed from the batch record on request, under the ids file-out-<batch> / file-err-<batch>.
Batch work runs on a synchronous Redis client in a thread, so the event loop never waits on it.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator
from typing import Any

from redis import Redis
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from backends.contract.connect import redis_from_url
from backends.contract.keys import batch_key, file_key
from backends.contract.replies import Fields, as_str
from dispatcher.batch import control, record
from dispatcher.batch.lines import URLS, scan
from dispatcher.batch.submit import BatchRefused, BatchSpec, new_batch_id, submit_batch
from dispatcher.gateway.core import ApiError, Gateway

MAX_FILE_BYTES = 64 * 1024 * 1024
FILE_TTL = 7 * 86400
OUT, ERR = "file-out-", "file-err-"


def _redis(request: Request) -> Redis:
    state = request.app.state
    if getattr(state, "batch_redis", None) is None:
        gw: Gateway = state.gateway
        state.batch_redis = redis_from_url(gw.settings.redis_url, socket_connect_timeout=5, socket_timeout=30)
    client: Redis = state.batch_redis
    return client


# -- files ------------------------------------------------------------------------------------------


async def create_file(request: Request) -> Response:
    async with request.form(max_files=1, max_fields=8, max_part_size=MAX_FILE_BYTES) as form:
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            raise ApiError(400, "purpose must be 'batch' (the only file purpose this gateway keeps)",
                           param="purpose", code="invalid_value")
        if not isinstance(upload, UploadFile):
            raise ApiError(400, "a 'file' part is required", param="file", code="invalid_value")
        content = await upload.read(MAX_FILE_BYTES + 1)
        filename = upload.filename or "upload.jsonl"
    if len(content) > MAX_FILE_BYTES:
        raise ApiError(413, f"the file is larger than {MAX_FILE_BYTES} bytes", param="file",
                       code="file_too_large")
    file_id = "file-" + secrets.token_hex(12)
    meta: Fields = {"filename": filename, "purpose": purpose, "bytes": len(content),
                                  "created_at": int(time.time())}

    def store() -> None:
        redis = _redis(request)
        with redis.pipeline(transaction=True) as pipe:
            pipe.hset(file_key(file_id), mapping={**meta, "content": content})
            pipe.expire(file_key(file_id), FILE_TTL)
            pipe.execute()

    await asyncio.to_thread(store)
    return JSONResponse(_file_object(file_id, meta))


def _file_object(file_id: str, meta: Any) -> dict[str, Any]:
    created = int(meta.get("created_at") or 0)
    return {"id": file_id, "object": "file", "bytes": int(meta.get("bytes") or 0), "created_at": created,
            "filename": meta.get("filename"), "purpose": meta.get("purpose"), "status": "processed",
            "expires_at": created + FILE_TTL if meta.get("purpose") == "batch" else None,
            "status_details": None}


def _read_file_meta(redis: Redis, file_id: str) -> dict[str, Any]:
    if file_id.startswith((OUT, ERR)):
        batch_id = file_id[len(OUT):]
        state = record.read_state(redis, batch_id)
        if state is None:
            raise ApiError(404, f"No such file: {file_id}", param="file_id", code="file_not_found")
        return {"filename": f"{batch_id}_{'output' if file_id.startswith(OUT) else 'error'}.jsonl",
                "purpose": "batch_output", "bytes": 0, "created_at": state.get("completed_at") or 0}
    raw = redis.hmget(file_key(file_id), ["filename", "purpose", "bytes", "created_at"])
    if raw[0] is None:
        raise ApiError(404, f"No such file: {file_id}", param="file_id", code="file_not_found")
    return dict(zip(("filename", "purpose", "bytes", "created_at"), (as_str(v) for v in raw), strict=True))


async def get_file(request: Request) -> Response:
    file_id = request.path_params["file_id"]
    meta = await asyncio.to_thread(_read_file_meta, _redis(request), file_id)
    return JSONResponse(_file_object(file_id, meta))


async def file_content(request: Request) -> Response:
    file_id = request.path_params["file_id"]
    redis = _redis(request)
    if file_id.startswith((OUT, ERR)):
        await asyncio.to_thread(_read_file_meta, redis, file_id)  # 404 for an unknown batch
        lines = _result_file(redis, file_id[len(OUT):], errors=file_id.startswith(ERR))
        return StreamingResponse(lines, media_type="application/jsonl")  # iterated in a thread
    content = await asyncio.to_thread(redis.hget, file_key(file_id), "content")
    if content is None:
        raise ApiError(404, f"No such file: {file_id}", param="file_id", code="file_not_found")
    return Response(content, media_type="application/jsonl")


def _result_file(redis: Redis, batch_id: str, errors: bool) -> Iterator[bytes]:
    model = as_str(redis.hget(batch_key(batch_id), "model")) or ""
    for is_error, obj in control.result_lines(redis, batch_id, model):
        if is_error == errors:
            yield (json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


# -- batches ----------------------------------------------------------------------------------------


def batch_object(state: dict[str, Any]) -> dict[str, Any]:
    """A fleet batch as OpenAI's Batch object."""
    ended = state["state"] in record.FINAL_STATES
    bad = (state.get("failed") or 0) + (state.get("cancelled") or 0)
    errors = state.get("errors")
    return {
        "id": state["id"], "object": "batch", "endpoint": state.get("endpoint") or "",
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": state.get("input_file_id") or state.get("input") or "",
        "completion_window": f"{(state.get('window') or 86400) // 3600}h",
        "status": state["state"],
        "output_file_id": OUT + state["id"] if ended and state.get("completed") else None,
        "error_file_id": ERR + state["id"] if ended and bad else None,
        "created_at": state.get("created_at") or 0, "in_progress_at": state.get("in_progress_at"),
        "expires_at": state.get("expires_at"), "finalizing_at": None,
        "completed_at": state.get("completed_at"), "failed_at": state.get("failed_at"), "expired_at": None,
        "cancelling_at": state.get("cancelling_at"), "cancelled_at": state.get("cancelled_at"),
        "request_counts": {"total": state.get("total") or 0, "completed": state.get("completed") or 0,
                           "failed": bad},
        "metadata": state.get("metadata") or None,
    }


async def create_batch(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    try:
        body = json.loads(await request.body())
    except ValueError:
        raise ApiError(400, "the body is not JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    endpoint, file_id = body.get("endpoint"), body.get("input_file_id")
    if endpoint not in URLS:
        raise ApiError(400, f"endpoint must be one of {', '.join(URLS)}", param="endpoint",
                       code="invalid_value")
    window = body.get("completion_window", "24h")
    if not isinstance(window, str) or not window.endswith("h") or not window[:-1].isdigit() or window == "0h":
        raise ApiError(400, "completion_window must be hours, like '24h'", param="completion_window",
                       code="invalid_value")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict) or len(metadata) > 16:
        raise ApiError(400, "metadata must be an object of at most 16 strings", param="metadata",
                       code="invalid_value")
    redis = _redis(request)
    content = await asyncio.to_thread(redis.hget, file_key(str(file_id)), "content")
    if content is None:
        raise ApiError(404, f"No such file: {file_id}", param="input_file_id", code="file_not_found")
    text = content.decode("utf-8", "replace") if isinstance(content, bytes) else str(content)
    found = await asyncio.to_thread(scan, text.splitlines())
    model = next(iter(found.models), "")
    pool = gw.pool_for(model) if model else gw.settings.pool
    spec = BatchSpec(new_batch_id(), pool, "low", int(window[:-1]) * 3600,
                     job_timeout=gw.settings.job_timeout, endpoint=endpoint, input_name=str(file_id),
                     metadata={str(k): str(v) for k, v in metadata.items()},
                     extra={"input_file_id": str(file_id)})
    mismatched = found.kinds - {URLS[endpoint]}
    try:
        if mismatched or found.invalid or not found.valid:
            raise BatchRefused("bad lines", found)
        await asyncio.to_thread(submit_batch, redis, spec, text.splitlines, checked=found)
    except BatchRefused as e:
        errors = [err.openai() for err in (e.scan.errors if e.scan else [])]
        if mismatched:
            errors.append({"code": "invalid_url", "message": f"every line's url must be {endpoint}",
                           "param": "url", "line": None})
        if not errors:
            errors.append({"code": "invalid_request", "message": str(e), "param": None, "line": None})
        await asyncio.to_thread(_record_failed, redis, spec, errors)
    state = await asyncio.to_thread(control.status, redis, spec.batch_id)
    assert state is not None
    return JSONResponse(batch_object(state))


def _record_failed(redis: Redis, spec: BatchSpec, errors: list[dict[str, Any]]) -> None:
    """A batch refused at validation, as OpenAI shows one: status failed, errors per line."""
    now = int(time.time())
    key = batch_key(spec.batch_id)
    with redis.pipeline(transaction=True) as pipe:
        pipe.hset(key, mapping={"state": "failed", "failed_at": now, "created_at": now,
                                "endpoint": spec.endpoint, "window": spec.window,
                                "input_file_id": spec.extra.get("input_file_id", ""),
                                "errors": json.dumps(errors), "metadata": json.dumps(spec.metadata or {})})
        pipe.expire(key, spec.retention)
        pipe.execute()


async def get_batch(request: Request) -> Response:
    state = await asyncio.to_thread(control.status, _redis(request), request.path_params["batch_id"])
    if state is None:
        raise ApiError(404, f"No such batch: {request.path_params['batch_id']}", code="batch_not_found")
    return JSONResponse(batch_object(state))


async def cancel_batch(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    batch_id, redis = request.path_params["batch_id"], _redis(request)
    try:
        await asyncio.to_thread(control.cancel, redis, batch_id, gw.settings.job_timeout)
    except KeyError:
        raise ApiError(404, f"No such batch: {batch_id}", code="batch_not_found") from None
    return await get_batch(request)


async def list_batches(request: Request) -> Response:
    try:
        limit = max(1, min(100, int(request.query_params.get("limit", "20"))))
    except ValueError:
        raise ApiError(400, "limit must be an integer", param="limit", code="invalid_value") from None
    after = request.query_params.get("after")
    states = await asyncio.to_thread(control.list_batches, _redis(request), 1000)
    if after:
        ids = [s["id"] for s in states]
        states = states[ids.index(after) + 1:] if after in ids else []
    page = [batch_object(s) for s in states[:limit]]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(states) > limit})


def routes(guarded: Any) -> list[Route]:
    return [
        Route("/v1/files", guarded(create_file), methods=["POST"]),
        Route("/v1/files/{file_id}", guarded(get_file)),
        Route("/v1/files/{file_id}/content", guarded(file_content)),
        Route("/v1/batches", guarded(create_batch), methods=["POST"]),
        Route("/v1/batches", guarded(list_batches)),
        Route("/v1/batches/{batch_id}", guarded(get_batch)),
        Route("/v1/batches/{batch_id}/cancel", guarded(cancel_batch), methods=["POST"]),
    ]
