"""A thinking model's thoughts, as each API asks for them, to job fields: `reasoning_format` (how
the worker returns them: apart from the answer by default where the pool's model thinks, as
llama-server's `--reasoning-format auto`) and `chat_template_kwargs` (what the model's template
reads: `enable_thinking`, `reasoning_effort`).

OpenAI-style bodies send `reasoning_format`, `chat_template_kwargs` and `reasoning_effort`;
Ollama's `think` (true/false or "low"/"medium"/"high"); Anthropic's `thinking` ({"type":
"enabled"|"disabled"}); the Responses API's `reasoning` ({"effort": ...}).
"""

from __future__ import annotations

from typing import Any

from dispatcher.gateway.core import ApiError

FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")
EFFORTS = ("minimal", "low", "medium", "high")


def reasoning_fields(thinks: bool, *, fmt: object = None, kwargs: object = None, effort: object = None,
                     enable: bool | None = None, param: str = "reasoning_format") -> dict[str, Any]:
    """The job fields for a request to a pool whose model `thinks` (or not: thoughts cannot be
    asked apart of a model that has none, so its answers stream as plain text)."""
    out: dict[str, Any] = {}
    if fmt is not None and fmt not in FORMATS:
        raise ApiError(400, f"'{param}' must be one of {', '.join(FORMATS)}", param=param,
                       code="invalid_value")
    if thinks:
        out["reasoning_format"] = fmt if fmt is not None else "auto"
    template: dict[str, Any] = {}
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise ApiError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs",
                           code="invalid_value")
        template.update(kwargs)
    if effort is not None:
        if effort not in EFFORTS:
            raise ApiError(400, f"'reasoning_effort' must be one of {', '.join(EFFORTS)}",
                           param="reasoning_effort", code="invalid_value")
        template["reasoning_effort"] = effort
    if enable is not None:
        template["enable_thinking"] = enable
    if template:
        out["chat_template_kwargs"] = template
    return out


def ollama_think(think: object) -> tuple[bool | None, str | None]:
    """Ollama's `think`: (enable_thinking, reasoning_effort)."""
    if think is None:
        return None, None
    if isinstance(think, bool):
        return think, None
    if think in ("low", "medium", "high"):
        return True, str(think)
    raise ApiError(400, "'think' must be true, false, \"low\", \"medium\" or \"high\"", param="think",
                   code="invalid_value")
