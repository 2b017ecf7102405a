"""A thinking model's thoughts, as each API asks for them, to job fields: `reasoning_format` (how
the worker returns them: apart from the answer by default where the pool's model thinks, as
llama-server's `--reasoning-format auto`) and `chat_template_kwargs` (what the model's template
reads: `enable_thinking`, `reasoning_effort`; the settings a request may give are the contract's
TEMPLATE_SETTINGS).

OpenAI-style bodies send `reasoning_format`, `chat_template_kwargs` and `reasoning_effort`;
Ollama's `think` (true/false or "low"/"medium"/"high"); Anthropic's `thinking` ({"type":
"enabled"|"disabled"}); the Responses API's `reasoning` ({"effort": ...}).

A thought's budget (`reasoning_budget`: the most tokens a thought may have before the engine ends
it; 0: no thought) comes from Anthropic's `thinking.budget_tokens` ("disabled": 0) and from
OpenAI-style bodies' `reasoning_budget` or `thinking_budget` (llama-server's
`reasoning_budget_tokens` / `thinking_budget_tokens` too; -1: no limit, as llama-server reads it).
"""

from __future__ import annotations

from typing import Any

from backends.contract.schema import MAX_TOKENS_LIMIT, REASONING_EFFORTS
from dispatcher.gateway.core import ApiError

FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")
BUDGET_FIELDS = ("reasoning_budget", "thinking_budget", "reasoning_budget_tokens", "thinking_budget_tokens")


def budget_field(body: dict[str, Any]) -> tuple[object, str]:
    """An OpenAI-style body's thought budget and the field that sent it (the first of
    BUDGET_FIELDS it has; None: none)."""
    for name in BUDGET_FIELDS:
        if name in body:
            return body[name], name
    return None, BUDGET_FIELDS[0]


def budget_tokens(value: object, param: str) -> int | None:
    """A budget as the job takes it: tokens from 0 (no thought) up; -1 or None: no limit, nor one
    past the most tokens a job may have (Anthropic's clients ask for tens of thousands)."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < -1:
        raise ApiError(400, f"'{param}' must be an integer of at least 0 (-1: no limit)",
                       param=param, code="invalid_value")
    return value if 0 <= value <= MAX_TOKENS_LIMIT else None


def reasoning_fields(thinks: bool, *, fmt: object = None, kwargs: object = None, effort: object = None,
                     enable: bool | None = None, param: str = "reasoning_format",
                     budget: tuple[object, str] = (None, "reasoning_budget")) -> dict[str, Any]:
    """The job fields for a request to a pool whose model `thinks` (or not: thoughts cannot be
    asked apart of a model that has none, so its answers stream as plain text, and there is no
    thought to hold to a budget). `budget`: the value sent and its field's name."""
    out: dict[str, Any] = {}
    tokens = budget_tokens(*budget)
    if tokens is not None and thinks:
        out["reasoning_budget"] = tokens
    if tokens == 0:
        enable = False  # no thought: the template's enable_thinking false (the budget wins)
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
        if effort not in REASONING_EFFORTS:
            raise ApiError(400, f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}",
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
