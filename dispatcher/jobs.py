"""The allow-listed job function. Fleet workers never call it: they recognise its dotted path
(`dispatcher.jobs.generate`) and run the request through their backend. A stock `rq worker`
that picks a fleet job up fails it with this message instead of doing something surprising."""

from __future__ import annotations

from typing import Any


def generate(request: dict[str, Any]) -> dict[str, Any]:
    raise RuntimeError("llama-fleet jobs run on fleet workers (`fleet worker`), not on a stock rq worker")
