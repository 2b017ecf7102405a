"""Reading a JSON route's body: its media type, size, encoding, nesting and numbers checked, and
each refusal an ApiError that names the problem in the client's terms (docs/gateway.md, "What
the gateway refuses")."""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING, Any

from dispatcher.gateway.core import ApiError, shown

if TYPE_CHECKING:  # Starlette stays out of producer-only hosts (batch lines import json_int)
    from starlette.requests import Request

LONE_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # a pair is fine; checked below


async def read_json_object(request: Request, *, limit: int, max_depth: int = 64,
                           any_media_type: bool = False) -> dict[str, Any]:
    """The body of a JSON route as a dict, or an ApiError that names what is wrong with it:
    415 unless Content-Type is application/json (UTF-8), or whatever it says with
    `any_media_type` (the body is read as UTF-8 JSON all the same), 413 past `limit` bytes
    (announced or streamed), 400 for invalid UTF-8, non-JSON, nesting deeper than `max_depth`,
    lone surrogates or a non-object."""
    if not any_media_type:
        check_media_type(request.headers.get("content-type", ""))
    announced = request.headers.get("content-length", "")
    if announced.isdigit() and int(announced) > limit:
        raise body_too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the body is not valid UTF-8 (at byte {e.start})", code="invalid_json") from None
    try:
        body = json.loads(text, parse_constant=_not_json, parse_float=_finite, parse_int=json_int)
    except RecursionError:  # the C scanner recurses per level; not a ValueError
        raise too_deep(max_depth) from None
    except ValueError as e:
        raise ApiError(400, f"the body is not JSON: {e}", code="invalid_json") from None
    if text.count("[") + text.count("{") > max_depth and _deeper_than(body, max_depth):
        raise too_deep(max_depth)
    if LONE_SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "the body holds a lone surrogate escape (\\ud800-\\udfff without its pair): "
                           "not text", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    return body


def check_media_type(ctype: str) -> None:
    """415 unless `ctype` is application/json in UTF-8 (OpenAI's routes: docs/gateway.md, "What
    the gateway refuses", says why they keep it)."""
    media, _, params = ctype.partition(";")
    charset = params.strip().lower().removeprefix("charset=").strip('"') if params.strip() else "utf-8"
    if media.strip().lower() != "application/json" or charset not in ("utf-8", "utf8"):
        got = f"'{shown(ctype)}'" if ctype else "none"
        raise ApiError(415, f"Content-Type must be application/json (UTF-8); got {got} (curl: --json, or "
                       "-H 'Content-Type: application/json')", code="unsupported_media_type")


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit:,} bytes (gateway.max_body_bytes)",
                    code="body_too_large", headers={"Connection": "close"})


def too_deep(limit: int) -> ApiError:
    return ApiError(400, f"the JSON body nests deeper than {limit} levels (gateway.max_json_depth)",
                    code="invalid_json")


def _not_json(name: str) -> None:
    raise ValueError(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # 1e999: no response or job could carry it back as JSON
        raise ValueError(f"the number {shown(text, 30)} is out of range")
    return value


MAX_NUMBER_DIGITS = 4300  # Python's own bound on turning digits into an int (the default of sys.int_info)


def json_int(text: str) -> int:
    """A JSON integer, refused in the client's words past MAX_NUMBER_DIGITS (where int() would
    answer with the interpreter's own advice); no field takes anything near that size."""
    digits = len(text) - text.startswith("-")
    if digits > MAX_NUMBER_DIGITS:
        raise ValueError(f"the number {shown(text, 30)} is too large ({digits:,} digits; at most "
                         f"{MAX_NUMBER_DIGITS:,})")
    return int(text)


def _deeper_than(value: object, limit: int) -> bool:
    """Whether `value` nests deeper than `limit`, without recursion (the caller's stack must not
    be what a client's body measures)."""
    stack = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False
