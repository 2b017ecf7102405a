"""A server's streamed chat deltas, already parsed by the server from its model's own syntax
(llama-server `--jinja`: `delta.reasoning_content`, `delta.content`, `delta.tool_calls`), re-written
as the answer JSON the in-process engine streams for its model's own syntax
(backends/chat/answer_json.py), so the gateway keeps one reader whatever engine ran the job.

A call goes out whole, once its arguments' JSON closes (or the next call, the answer's end, or
other text comes first); arguments that never became JSON (max_tokens cut them) are no call, as
the in-process readers drop a cut call. The answer ends (`ended`) at a call repeating an earlier
one word for word, or once it holds as many calls as the request allows: the server's grammar
lets a model go on calling (llama-server's does even with `parallel_tool_calls: false`), and the
caller stops reading there. Importable without llama_cpp.
"""

from __future__ import annotations

import json
from typing import Any

from backends.chat.answer_json import AnswerJsonWriter, CallLedger, JsonScan, Piece


class _PendingCall:
    def __init__(self, name: str) -> None:
        self.name = name
        self.arguments = ""
        self.scan: JsonScan | None = JsonScan()

    def extend(self, text: str) -> bool:
        """Add arguments' text; True once their JSON value closed."""
        self.arguments += text
        if self.scan is None:
            return False
        try:
            self.scan.scan(text)
        except ValueError:  # not an object's text: whole only when the call ends
            self.scan = None
            return False
        return self.scan.done


class DeltaAnswer:
    """Deltas in (`feed`, one choice's `delta` object), answer JSON text out; `close` ends it."""

    def __init__(self, job_id: str, max_calls: int) -> None:
        self.max_calls = max_calls
        self.ledger = CallLedger(job_id)
        self._writer = AnswerJsonWriter()
        self._open: tuple[int, _PendingCall] | None = None  # the call being streamed, by index
        self._past: set[int] = set()  # indexes of calls already whole (or dropped)
        self._closed = False

    @property
    def ended(self) -> bool:
        """Nothing more belongs to the answer: a call repeated, or the last call allowed came."""
        calls = len(self.ledger.calls)
        return self.ledger.repeated or 0 < calls >= self.max_calls

    def feed(self, delta: dict[str, Any]) -> str:
        out = Piece()
        for kind, key in (("reasoning", "reasoning_content"), ("content", "content")):
            text = delta.get(key)
            if isinstance(text, str) and text:
                self._complete(out)  # a call before this text is whole: keep the answer's order
                if not self.ended:
                    out.add(kind, text)
        for part in delta.get("tool_calls") or []:
            self._call_part(out, part)
        return self._writer.feed(out)

    def close(self) -> str:
        """The rest of the answer: a call still open, then the object's end (once)."""
        if self._closed:
            return ""
        out = Piece()
        self._complete(out)
        self._closed = True
        return self._writer.feed(out) + self._writer.close()

    def _call_part(self, out: Piece, part: dict[str, Any]) -> None:
        index = part.get("index", 0)
        function = part.get("function") or {}
        if self._open is None or self._open[0] != index:
            self._complete(out)  # the next call began: the one before is whole
            if index in self._past or self.ended:
                return
            self._open = (index, _PendingCall(function.get("name") or ""))
        call = self._open[1]
        call.name = call.name or function.get("name") or ""
        if call.extend(function.get("arguments") or ""):
            self._complete(out)

    def _complete(self, out: Piece) -> None:
        if self._open is None:
            return
        index, call = self._open
        self._open = None
        self._past.add(index)
        if self.ended or not call.name:
            return
        try:
            arguments = json.loads(call.arguments or "{}", strict=False)
        except ValueError:  # cut short: no call
            return
        self.ledger.add(out, call.name, arguments)
