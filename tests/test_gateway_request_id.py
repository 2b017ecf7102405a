"""`RequestId` on its own: the id reaches the response head even where no route answers (Starlette's
500 for an exception no handler takes), and a client's id is kept only when sane."""

from __future__ import annotations

import re

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from dispatcher.gateway.app import GatewayApp, request_id_of

GENERATED_ID = re.compile(r"req_[0-9a-f]{32}")


async def crash(request: Request) -> Response:
    raise RuntimeError("a bug")


async def echo(request: Request) -> Response:
    return PlainTextResponse(request.scope["state"]["request_id"])


def test_even_an_unhandled_500_carries_the_id() -> None:
    app = GatewayApp(routes=[Route("/crash", crash), Route("/echo", echo)])
    with TestClient(app, raise_server_exceptions=False) as client:
        crashed = client.get("/crash", headers={"x-request-id": "abc-1"})
        assert crashed.status_code == 500 and crashed.headers["x-request-id"] == "abc-1"
        echoed = client.get("/echo")
        assert echoed.text == echoed.headers["x-request-id"] and GENERATED_ID.fullmatch(echoed.text)
        assert client.get("/echo").text != echoed.text


def test_only_sane_ids_are_kept() -> None:
    assert request_id_of([(b"x-request-id", b"Trace_1.2/3:4")]) == b"Trace_1.2/3:4"
    for bad in (b"", b"a b", b"x" * 129, b"\xc3\xa9", b"tab\t", b"new\nline"):
        assert GENERATED_ID.fullmatch(request_id_of([(b"x-request-id", bad)]).decode()), bad
    assert GENERATED_ID.fullmatch(request_id_of([]).decode())
