"""OpenAI's Files and Batch APIs over fleet batches (docs/batch.md):

    POST /v1/files (purpose=batch)   GET /v1/files/{id}   GET /v1/files/{id}/content   DELETE /v1/files/{id}
    POST /v1/batches   GET /v1/batches   GET /v1/batches/{id}   POST /v1/batches/{id}/cancel

An uploaded file lives in Redis (dispatcher/gateway/batch/files.py: fleet:file:<id>, gateway.file_ttl,
bounded per file and per creator). A batch is an ordinary fleet batch (dispatcher/gateway/batch); its
output and error files are not stored again but streamed from the batch record on request, under
the ids file-out-<batch> / file-err-<batch>.

Every file and batch records its creator (a hash of the caller's API key, `anonymous` without
keys); a caller sees, reads and cancels only what it created: anything else is 404, as an unknown
id. An id is checked against the pattern this gateway makes before any Redis key is built from it.
Batch work runs on the gateway's one async Redis client, as the plans of dispatcher/gateway/batch (those
that build or decode many lines do that work in a thread, so the event loop goes on serving).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from backends.contract.schema import DEFAULT_TENANT
from dispatcher.gateway.batch import control, files, record
from dispatcher.gateway.batch.lines import URLS, safe_text, scan, split_lines
from dispatcher.gateway.batch.multipart import UploadRefused, read_upload
from dispatcher.gateway.batch.submit import (
    BatchQueueFull,
    BatchRefused,
    BatchSpec,
    TenantBatchQuotaFull,
    check,
    new_batch_id,
    submit_plan,
)
from dispatcher.gateway.core import OPEN, ApiError, Caller, Gateway
from dispatcher.gateway.json_body import read_json_object
from dispatcher.plans import Plan, run_async

BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")  # what new_batch_id and default_batch_id make
RESULT_FILE_ID = re.compile(r"file-(out|err)-(batch_[0-9a-f]{24})")
WINDOW = re.compile(r"([0-9]{1,3})h")  # ASCII digits only: int() takes other scripts' digits too
MAX_WINDOW_HOURS = 168
MAX_METADATA = 16
OUT, ERR = "file-out-", "file-err-"
T = TypeVar("T")


async def _run(request: Request, plan: Plan[T], *, offload: bool = False) -> T:
    """The plan, on the gateway's Redis client (the one its AsyncFleet uses)."""
    gw: Gateway = request.app.state.gateway
    return await run_async(gw.fleet.redis, plan, offload=offload)


def _creator(request: Request) -> str:
    """Whose the caller's files and batches are (the guard already checked its key): a named
    tenant's, shared by its keys; for the default tenant's keys, each key's own."""
    caller: Caller = request.state.caller
    if caller.tenant != DEFAULT_TENANT:
        return caller.owner
    if caller is OPEN:
        return files.ANONYMOUS
    _, _, token = (request.headers.get("authorization") or "").partition(" ")
    return files.creator_of(token.strip())


def _reader(request: Request) -> str | None:
    """Whose files and batches the caller may read, cancel and delete: its own; an operator (admin
    key) everyone's."""
    return None if request.state.caller.admin else _creator(request)


def _tenant_cap(gw: Gateway, request: Request) -> int | None:
    """The caller's batch quota (TenantSettings.batch_lines_cap); the default tenant has none."""
    tenant = gw.settings.gateway.tenants.get(request.state.caller.tenant)
    return tenant.batch_lines_cap() if tenant is not None else None


def _tenant(request: Request) -> str | None:
    caller: Caller = request.state.caller
    return None if caller.tenant == DEFAULT_TENANT else caller.tenant


def _shown(value: object) -> str:
    return safe_text(str(value))[:100]


def _no_file(file_id: object, param: str = "file_id") -> ApiError:
    return ApiError(404, f"No such file: '{_shown(file_id)}'", param=param, code="file_not_found")


def _no_batch(batch_id: object) -> ApiError:
    return ApiError(404, f"No such batch: '{_shown(batch_id)}'", param="batch_id", code="batch_not_found")


# -- files ------------------------------------------------------------------------------------------


async def create_file(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    limits = gw.settings.gateway
    try:
        upload = await read_upload(request.headers.get("content-type", ""), request.stream(),
                                   max_file_bytes=limits.max_file_bytes)
    except UploadRefused as e:
        raise ApiError(e.status, e.message, param=e.param,
                       code="file_too_large" if e.status == 413 else "invalid_value") from None
    purpose = upload.fields.get("purpose")
    if purpose != "batch":
        raise ApiError(400, "purpose must be 'batch' (the only file purpose this gateway keeps)",
                       param="purpose", code="invalid_value")
    if upload.content is None or upload.file_field != "file":
        raise ApiError(400, "a 'file' part is required", param="file", code="invalid_value")
    file_id = files.new_file_id()
    keep = files.FileLimits(limits.file_ttl, limits.max_files, limits.max_file_storage)
    try:
        name = upload.filename or "upload.jsonl"
        meta = await _run(request, files.store_plan(file_id, _creator(request), name, upload.content, keep))
    except files.FileLimitReached as e:
        raise ApiError(e.status, e.message, param="file", code="file_limit_reached") from None
    return JSONResponse(_file_object(file_id, meta, limits.file_ttl))


def _file_object(file_id: str, meta: dict[str, Any], ttl: int) -> dict[str, Any]:
    created = int(meta.get("created_at") or 0)
    return {"id": file_id, "object": "file", "bytes": int(meta.get("bytes") or 0), "created_at": created,
            "filename": meta.get("filename"), "purpose": meta.get("purpose"), "status": "processed",
            "expires_at": created + ttl if meta.get("purpose") == "batch" else None,
            "status_details": None}


def _owned_batch(batch_id: str, creator: str | None) -> Plan[dict[str, Any] | None]:
    """The batch's state if `creator` made it through this API (None: an operator, any batch);
    None for anyone else."""
    if not BATCH_ID.fullmatch(batch_id):
        return None
    state = yield from control.status_plan(batch_id, with_running=False)
    mine = state is not None and (creator is None or state.get("owner") == creator)
    return state if mine else None


def _read_file_meta(file_id: str, creator: str | None) -> Plan[dict[str, Any]]:
    result = RESULT_FILE_ID.fullmatch(file_id)
    if result:
        state = yield from _owned_batch(result.group(2), creator)
        if state is None:
            raise _no_file(file_id)
        name = "output" if result.group(1) == "out" else "error"
        return {"filename": f"{result.group(2)}_{name}.jsonl", "purpose": "batch_output", "bytes": 0,
                "created_at": state.get("completed_at") or 0}
    meta = yield from files.read_meta_plan(file_id, creator)
    if meta is None:
        raise _no_file(file_id)
    return meta


async def get_file(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    file_id = request.path_params["file_id"]
    meta = await _run(request, _read_file_meta(file_id, _reader(request)))
    return JSONResponse(_file_object(file_id, meta, gw.settings.gateway.file_ttl))


async def file_content(request: Request) -> Response:
    file_id, creator = request.path_params["file_id"], _reader(request)
    result = RESULT_FILE_ID.fullmatch(file_id)
    if result:
        await _run(request, _read_file_meta(file_id, creator))  # 404 unless the caller's batch
        lines = _result_file(request, result.group(2), errors=result.group(1) == "err")
        return StreamingResponse(lines, media_type="application/jsonl")
    content = await _run(request, files.read_content_plan(file_id, creator))
    if content is None:
        raise _no_file(file_id)
    return Response(content, media_type="application/jsonl")


async def delete_file(request: Request) -> Response:
    file_id, creator = request.path_params["file_id"], _creator(request)
    if request.state.caller.admin:  # an operator deletes any file: in its creator's name
        meta = await _run(request, files.read_meta_plan(file_id, None))
        creator = (meta or {}).get("owner") or creator
    if not await _run(request, files.delete_plan(file_id, creator)):
        raise _no_file(file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


async def _result_file(request: Request, batch_id: str, errors: bool) -> AsyncIterator[bytes]:
    """The output (or error) file, a page of the batch's lines at a time; building a page's
    objects runs in a thread."""
    state = await _run(request, record.read_state_plan(batch_id))
    pages = control.ResultPages(batch_id, (state or {}).get("model") or "")
    while not pages.done:
        page = await _run(request, pages.page_plan(), offload=True)
        text = "".join(json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n"
                       for is_error, obj in page if is_error == errors)
        if text:
            yield text.encode()


# -- batches ----------------------------------------------------------------------------------------


def batch_object(state: dict[str, Any]) -> dict[str, Any]:
    """A fleet batch as OpenAI's Batch object."""
    status = state.get("state") or "failed"
    ended = status in record.FINAL_STATES
    bad = (state.get("failed") or 0) + (state.get("cancelled") or 0)
    errors = state.get("errors")
    return {
        "id": state["id"], "object": "batch", "endpoint": state.get("endpoint") or "",
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": state.get("input_file_id") or state.get("input") or "",
        "completion_window": f"{(state.get('window') or 86400) // 3600}h",
        "status": status,
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


def window_seconds(window: object) -> int:
    """OpenAI's completion_window ("24h"): whole hours, 1h to MAX_WINDOW_HOURS; 400 otherwise."""
    m = WINDOW.fullmatch(window) if isinstance(window, str) else None
    if m is None or not 1 <= int(m.group(1)) <= MAX_WINDOW_HOURS:
        raise ApiError(400, f"completion_window must be whole hours from 1h to {MAX_WINDOW_HOURS}h, like "
                       f"'24h'; got '{_shown(window)}'", param="completion_window", code="invalid_value")
    return int(m.group(1)) * 3600


def checked_metadata(metadata: object) -> dict[str, str]:
    """OpenAI's bounds: at most 16 pairs, keys up to 64 and values up to 512 characters, text."""
    metadata = metadata or {}
    ok = isinstance(metadata, dict) and len(metadata) <= MAX_METADATA and all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
        and safe_text(k) == k and safe_text(v) == v for k, v in metadata.items())
    if not ok:
        raise ApiError(400, f"metadata must be an object of at most {MAX_METADATA} string pairs (keys up "
                       "to 64 characters, values up to 512)", param="metadata", code="invalid_value")
    assert isinstance(metadata, dict)
    return dict(metadata)


async def create_batch(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    body = await read_json_object(request, limit=gw.settings.gateway.max_body_bytes,
                                  max_depth=gw.settings.gateway.max_json_depth)
    endpoint, file_id = body.get("endpoint"), body.get("input_file_id")
    if endpoint not in URLS:
        raise ApiError(400, f"endpoint must be one of {', '.join(URLS)}", param="endpoint",
                       code="invalid_value")
    window = window_seconds(body.get("completion_window", "24h"))
    metadata = checked_metadata(body.get("metadata"))
    creator, limits = _creator(request), gw.settings.gateway
    content = None
    if isinstance(file_id, str):
        content = await _run(request, files.read_content_plan(file_id, creator))
    if content is None:
        raise _no_file(file_id, param="input_file_id")
    lines = split_lines(content.decode("utf-8", "replace"))
    found = await asyncio.to_thread(scan, lines)
    if found.valid > limits.max_batch_lines:
        raise ApiError(400, f"the file has {found.valid:,} requests; a batch may have at most "
                       f"{limits.max_batch_lines:,} (gateway.max_batch_lines)", param="input_file_id",
                       code="too_many_requests_in_batch")
    model = next(iter(found.models), "")
    pool = gw.pool_for(model, request.state.caller) if model else gw.settings.pool
    marks = await gw.check_budgets(request.state.caller, gw.tenant(request.state.caller))
    spec = BatchSpec(new_batch_id(), pool, "low", window, job_timeout=gw.settings.job_timeout,
                     endpoint=str(endpoint), input_name=str(file_id), metadata=metadata,
                     extra={"input_file_id": str(file_id), "owner": creator},
                     max_open_lines=limits.max_batch_queue, tenant=_tenant(request),
                     tenant_max_open_lines=_tenant_cap(gw, request))
    mismatched = found.kinds - {URLS[str(endpoint)]}
    try:
        if mismatched or found.invalid or not found.valid:
            raise BatchRefused("bad lines", found)
        check(spec, lambda: lines, checked=found)
        await gw.fleet.check_server()
        await _run(request, submit_plan(spec, lambda: lines, found), offload=True)
    except BatchQueueFull as e:
        raise ApiError(429, f"{e} (gateway.max_batch_queue)", code="batch_queue_full",
                       headers={"Retry-After": str(max(60, limits.retry_after))}) from None
    except TenantBatchQuotaFull as e:
        if e.never:  # more lines than the quota holds at all: retrying never helps
            raise ApiError(400, str(e), param="input_file_id", code="batch_quota_exceeded") from None
        raise ApiError(429, str(e), code="batch_quota_exceeded", kind="requests",
                       headers={"Retry-After": str(max(60, limits.retry_after))}) from None
    except BatchRefused as e:
        errors = [err.openai() for err in (e.scan.errors if e.scan else [])]
        if mismatched:
            errors.append({"code": "invalid_url", "message": f"every line's url must be {endpoint}",
                           "param": "url", "line": None})
        if not errors:
            errors.append({"code": "invalid_request", "message": str(e), "param": None, "line": None})
        await _run(request, _record_failed(spec, errors))
    state = await _run(request, control.status_plan(spec.batch_id))
    assert state is not None
    return JSONResponse(batch_object(state), headers=marks)


def _record_failed(spec: BatchSpec, errors: list[dict[str, Any]]) -> Plan[None]:
    """A batch refused at validation, as OpenAI shows one: status failed, errors per line."""
    fields = {"endpoint": spec.endpoint, "window": spec.window,
              "input_file_id": spec.extra.get("input_file_id", ""), "owner": spec.extra.get("owner", ""),
              "errors": json.dumps(errors), "metadata": json.dumps(spec.metadata or {})}
    return record.record_failed_plan(spec.batch_id, fields, spec.retention, int(time.time()))


async def get_batch(request: Request) -> Response:
    batch_id = request.path_params["batch_id"]
    state = await _run(request, _owned_batch(batch_id, _reader(request)))
    if state is None:
        raise _no_batch(batch_id)
    return JSONResponse(batch_object(state))


async def cancel_batch(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    batch_id = request.path_params["batch_id"]
    if await _run(request, _owned_batch(batch_id, _reader(request))) is None:
        raise _no_batch(batch_id)
    try:
        await _run(request, control.cancel_plan(batch_id, gw.settings.job_timeout))
    except KeyError:
        raise _no_batch(batch_id) from None
    return await get_batch(request)


async def list_batches(request: Request) -> Response:
    try:
        limit = max(1, min(100, int(request.query_params.get("limit", "20"))))
    except ValueError:
        raise ApiError(400, "limit must be an integer", param="limit", code="invalid_value") from None
    after = request.query_params.get("after")
    states = await _run(request, control.list_plan(1000, _reader(request)))
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
        Route("/v1/files/{file_id}", guarded(delete_file), methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", guarded(file_content)),
        Route("/v1/batches", guarded(create_batch), methods=["POST"]),
        Route("/v1/batches", guarded(list_batches)),
        Route("/v1/batches/{batch_id}", guarded(get_batch)),
        Route("/v1/batches/{batch_id}/cancel", guarded(cancel_batch), methods=["POST"]),
    ]
