"""Reading an OpenAI batch input file: one JSON request per line, each checked before anything is
enqueued (docs/batch.md).

    {"custom_id": "req-1", "method": "POST", "url": "/v1/completions",
     "body": {"model": "llm", "prompt": "Hello", "max_tokens": 16}}

The body is mapped exactly as the gateway maps the same HTTP request (openai_bodies.job_fields),
then checked as a fleet request; a problem is reported with its line number and the field
(`body.temperature`, `custom_id`, ...). A batch line is one completion: n = 1, one prompt, no stream.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.contract.batch.line_record import line_key
from dispatcher.gateway.batch.record import Kind
from dispatcher.gateway.core import ApiError, field_named
from dispatcher.gateway.json_body import json_int
from dispatcher.gateway.openai_bodies import job_fields
from dispatcher.rules import validate_request

URLS: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "text"}
LINE_FIELDS = ("custom_id", "method", "url", "body")
MAX_CUSTOM_ID = 512
MAX_REPORTED = 100  # line errors kept in a scan (all are counted)
MAX_DEPTH = 64  # nesting of a line's JSON: deeper values would exhaust recursion somewhere later


@dataclass
class BatchLine:
    number: int  # 1-based line number in the file
    custom_id: str
    key: str
    kind: Kind
    model: str
    request: dict[str, Any]  # the fleet request (GenerateRequest fields)


def safe_text(text: str) -> str:
    """`text` as valid Unicode: a lone surrogate (JSON allows "\\ud800") becomes an escape, so an
    echo of it can be encoded to UTF-8 (a JSON response, a Redis argument)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def split_lines(text: str) -> list[str]:
    """A JSONL text's lines, split on "\\n" only (a "\\r" before it is dropped): str.splitlines
    also splits on U+2028, U+0085 and others, which may sit inside a JSON string."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def file_lines(path: Path) -> Iterator[str]:
    """A JSONL file's lines, split as split_lines does, read lazily (bad UTF-8 replaced)."""
    with path.open(encoding="utf-8", errors="replace", newline="\n") as f:
        for line in f:
            yield line.removesuffix("\n").removesuffix("\r")


def too_deep(obj: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether `obj` nests lists/objects more than `limit` deep (checked without recursion)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth > limit:
                return True
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return False


@dataclass
class LineError:
    number: int
    field: str
    message: str

    def __post_init__(self) -> None:
        self.field, self.message = safe_text(self.field), safe_text(self.message)

    def __str__(self) -> str:
        return f"line {self.number}: {self.field}: {self.message}"

    def openai(self) -> dict[str, Any]:
        """As an entry of OpenAI's batch `errors.data`."""
        return {"code": "invalid_request", "message": self.message, "param": self.field, "line": self.number}


class LineProblem(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def parse_line(number: int, text: str) -> BatchLine:
    """One input line as a BatchLine; raises LineProblem naming the field."""
    try:
        obj = json.loads(text, parse_int=json_int)
    except ValueError as e:
        raise LineProblem("(line)", f"not JSON: {e}") from None
    except RecursionError:
        raise LineProblem("(line)", f"nested deeper than {MAX_DEPTH} levels") from None
    if too_deep(obj):
        raise LineProblem("(line)", f"nested deeper than {MAX_DEPTH} levels")
    try:  # JSON may escape half a surrogate pair: no valid text, and unencodable further on
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise LineProblem("(line)", "holds an unpaired surrogate escape (\\ud800-\\udfff): not valid "
                          "Unicode text") from None
    if not isinstance(obj, dict):
        raise LineProblem("(line)", "must be a JSON object with custom_id, method, url and body")
    for name in obj:
        if name not in LINE_FIELDS:
            raise LineProblem(name, f"unknown field (a line has {', '.join(LINE_FIELDS)})")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        raise LineProblem("custom_id", f"must be a non-empty string of at most {MAX_CUSTOM_ID} characters")
    if obj.get("method") != "POST":
        raise LineProblem("method", f"must be \"POST\", not {obj.get('method')!r}")
    url = obj.get("url")
    if url not in URLS:
        raise LineProblem("url", f"must be one of {', '.join(URLS)}, not {url!r}")
    kind = URLS[url]
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineProblem("body", "must be a JSON object (the request body)")
    body = {k: v for k, v in body.items() if v is not None}
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise LineProblem("body.model", "is required: the name of a model this fleet serves")
    if body.get("stream"):
        raise LineProblem("body.stream", "batch lines cannot stream")
    try:
        requests, n = job_fields(body, chat=kind == "chat")
        if n != 1 or len(requests) != 1:
            raise LineProblem("body.n" if n != 1 else "body.prompt",
                              "a batch line is one completion: n = 1 and one prompt")
        request = validate_request(requests[0]).model_dump(exclude_none=True, exclude_defaults=True)
    except ApiError as e:
        raise LineProblem(f"body.{e.param}" if e.param else "body", e.message) from None
    except ValueError as e:
        named = field_named(str(e))
        message = str(e).removeprefix("invalid request: ")
        raise LineProblem(f"body.{named}" if named else "body", message) from None
    return BatchLine(number, custom_id, line_key(custom_id), kind, model, request)


@dataclass
class Scan:
    """What a first pass over the file found."""

    valid: int = 0
    kinds: set[Kind] = field(default_factory=set)
    invalid: int = 0
    errors: list[LineError] = field(default_factory=list)  # the first MAX_REPORTED
    models: set[str] = field(default_factory=set)
    fingerprint: str = ""  # sha256 over the valid lines' keys, in order: the same input, resubmitted

    def add_error(self, err: LineError) -> None:
        self.invalid += 1
        if len(self.errors) < MAX_REPORTED:
            self.errors.append(err)


def numbered(lines: Iterable[str]) -> Iterator[tuple[int, str]]:
    """(line number, text) of the non-blank lines."""
    for number, text in enumerate(lines, 1):
        if text.strip():
            yield number, text


def scan(lines: Iterable[str]) -> Scan:
    """Check every line (duplicate custom_ids included) without keeping them."""
    out = Scan()
    seen: dict[str, tuple[str, int]] = {}  # key -> (custom_id, first line)
    digest = hashlib.sha256()
    for number, text in numbered(lines):
        try:
            line = parse_line(number, text)
        except LineProblem as e:
            out.add_error(LineError(number, e.field, e.message))
            continue
        first = seen.get(line.key)
        if first is not None:
            what = "duplicate custom_id" if first[0] == line.custom_id else "custom_id hash collides with"
            out.add_error(LineError(number, "custom_id", f"{what} {first[0]!r} of line {first[1]}"))
            continue
        if out.models and line.model not in out.models:
            out.add_error(LineError(number, "body.model", f"a batch uses one model; {line.model!r} differs "
                                    f"from {next(iter(out.models))!r} of the lines before"))
            continue
        seen[line.key] = (line.custom_id, number)
        out.valid += 1
        out.models.add(line.model)
        out.kinds.add(line.kind)
        digest.update(line.key.encode())
    out.fingerprint = digest.hexdigest()[:32]
    return out


def valid_lines(lines: Iterable[str]) -> Iterator[BatchLine]:
    """The lines `scan` accepted, parsed again (so a 100,000-line file is never held in memory)."""
    seen: set[str] = set()
    model = None
    for number, text in numbered(lines):
        try:
            line = parse_line(number, text)
        except LineProblem:
            continue
        model = model or line.model
        if line.key not in seen and line.model == model:
            seen.add(line.key)
            yield line
