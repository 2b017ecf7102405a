"""Responses that notice the client leaving, so its jobs are cancelled and their slots freed;
and the ASCII JSON response every error is written with.

Only a client that really left (an `http.disconnect`, or a send that fails) cancels. A request
cut short by the gateway's own shutdown keeps its jobs: they finish in the fleet and their
results stay in Redis (X-Fleet-Job-Id names them), so a gateway restart loses no job.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")
OnDisconnect = Callable[[], Awaitable[None]]


class AsciiJSONResponse(JSONResponse):
    """JSON written as ASCII (\\u escapes): an error that echoes a client's text can always be
    encoded, whatever characters (even lone surrogates) that text holds."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


class JobStreamResponse(StreamingResponse):
    """StreamingResponse that always listens for the client leaving while it streams (whatever
    ASGI version the server speaks), closes the body at once, then runs `on_disconnect`."""

    def __init__(self, body: AsyncIterator[str], *, media_type: str, on_disconnect: OnDisconnect,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(body, media_type=media_type, headers=headers)
        self._body = body
        self._on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client_left = False

        async def stream() -> None:
            nonlocal client_left
            try:
                await self.stream_response(send)
            except (OSError, ClientDisconnect):
                client_left = True

        async def listen() -> None:
            nonlocal client_left
            while (await receive())["type"] != "http.disconnect":
                pass
            client_left = True

        try:
            async with anyio.create_task_group() as group:

                async def run(part: Callable[[], Awaitable[None]]) -> None:
                    await part()
                    group.cancel_scope.cancel()

                group.start_soon(run, stream)
                group.start_soon(run, listen)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self._body, "aclose", None)
                if aclose is not None:
                    await aclose()
                if client_left:
                    await self._on_disconnect()


async def unless_client_leaves(request: Request, work: Awaitable[T], on_disconnect: OnDisconnect) -> T | None:
    """Await `work` (a non-streaming request's jobs); if the client leaves first, stop waiting,
    run `on_disconnect` and return None (nobody reads the answer)."""
    task = asyncio.ensure_future(work)

    async def client_left() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(client_left())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done() and not watcher.done():  # we were cancelled (shutdown): keep the jobs
            task.cancel()
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await asyncio.shield(on_disconnect())
    return None
