"""What a job is and what it returns: the request producers send (validated on both sides), the
sampling values a backend runs with, and the one result object every finished job gets.

Importable without llama_cpp and without Redis: producers, workers and backends all use it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from backends.contract import schema_limits
from backends.contract.tool_specs import (
    MAX_CALLS_PER_MESSAGE,
    MAX_TOOLS,
    Tool,
    ToolCall,
    ToolChoice,
    answer_schema,
    check_tools,
    tools_chars,
)

MAX_TOKENS_LIMIT = 8192
MAX_PROMPT_CHARS = 1_000_000
# All of a request's text together (prompt, or every message): 256 messages of MAX_PROMPT_CHARS
# each would otherwise pass. Workers bound it further by their context.
MAX_REQUEST_CHARS = 1_000_000
MAX_SCHEMA_CHARS = 32_768  # a JSON schema for structured output, serialized
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries of logit_bias: each costs a little on every token of the job
LOGIT_BIAS_BAN = -100.0  # OpenAI: -100 bans the token; engines make it -inf, not merely low
TOKEN_ID = re.compile(r"[0-9]{1,10}")
Priority = Literal["high", "default", "low"]
# A tenant's name: it names Redis keys (its queues, its counters), so no ':' and nothing odd
TENANT_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
DEFAULT_TENANT = "default"  # jobs that name no tenant, and the flat gateway.api_keys
PRIORITIES: tuple[Priority, ...] = ("high", "default", "low")
# tool_calls: the answer called tools (the result's `tool_calls`; backends/contract/tools.py)
FinishReason = Literal["stop", "length", "cancelled", "tool_calls"]
ReasoningFormat = Literal["none", "auto", "deepseek", "deepseek-legacy"]
REASONING_EFFORTS = ("minimal", "low", "medium", "high")


def _flag(v: object) -> bool:
    return isinstance(v, bool)


# What a request may set in a model's own template (chat_template_kwargs): each setting, the values
# it takes and what an error says of them. The template's other variables (the chat, the tools,
# special tokens, dates, add_generation_prompt, builtin tools) are the renderer's alone.
TEMPLATE_SETTINGS: dict[str, tuple[Callable[[object], bool], str]] = {
    "enable_thinking": (_flag, "true or false"),
    "reasoning_effort": (lambda v: v in REASONING_EFFORTS, "one of " + ", ".join(REASONING_EFFORTS)),
    "model_identity": (lambda v: isinstance(v, str) and 0 < len(v) <= 256, "text of 1 to 256 characters"),
    "preserve_reasoning": (_flag, "true or false"),
    "tools_in_user_message": (_flag, "true or false"),
}


class Message(BaseModel):
    """One message of a chat. An assistant message may repeat the calls it made (`tool_calls`,
    content then usually empty); a `tool` message is a call's result, naming the call it
    answers (`tool_call_id`, `name`: the function's)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field("", max_length=MAX_PROMPT_CHARS)
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_CALLS_PER_MESSAGE)
    tool_call_id: str | None = Field(None, min_length=1, max_length=256)
    name: str | None = Field(None, min_length=1, max_length=256)
    # an assistant turn's thoughts, given back: templates of thinking models place them
    reasoning_content: str | None = Field(None, max_length=MAX_PROMPT_CHARS)

    @model_validator(mode="after")
    def _tool_fields(self) -> Message:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry reasoning_content")
        if (self.tool_call_id is not None or self.name is not None) and self.role != "tool":
            raise ValueError("tool_call_id and name belong to tool messages (a tool's result)")
        return self

    def chars(self) -> int:
        """Every text field: what a template may render from this message."""
        calls = sum(len(c.id) + len(c.name) + len(c.arguments) for c in self.tool_calls or [])
        return (len(self.content) + len(self.reasoning_content or "") + calls
                + len(self.tool_call_id or "") + len(self.name or ""))


class SamplingDefaults(BaseModel):
    """Sampling values a worker uses for fields a request leaves out."""

    model_config = ConfigDict(extra="forbid")
    max_tokens: int = Field(128, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(0.8, ge=0.0, le=5.0)
    top_k: int = Field(40, ge=0, le=1000)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    min_p: float = Field(0.05, ge=0.0, le=1.0)
    repeat_penalty: float = Field(1.0, gt=0.0, le=5.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)


class GenerateRequest(BaseModel):
    """One generation job, as a producer sends it. Unset sampling fields take the worker's defaults."""

    model_config = ConfigDict(extra="forbid", strict=True)
    prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    messages: list[Message] | None = Field(None, max_length=256)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=5.0)
    top_k: int | None = Field(None, ge=0, le=1000)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(None, gt=0.0, le=5.0)
    # OpenAI's additive penalties (llama.cpp's penalties sampler): a token already generated
    # loses presence_penalty once, and frequency_penalty per time it occurred
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, lt=2**32)
    stop: list[str] = Field(default_factory=list, max_length=16)
    # per-token log-probabilities of the sampled tokens; top_logprobs: that many alternatives too
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # structured output: "json" = any JSON object; a dict = a JSON Schema the text must match
    format: Literal["json"] | dict[str, Any] | None = None
    # llama-server's and vLLM's extensions: no end of generation before min_tokens tokens;
    # ignore_eos: none at all (the job runs to max_tokens). Stop strings still stop.
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS_LIMIT)
    ignore_eos: bool = False
    # OpenAI's and llama-server's logit_bias: token id (as text, as JSON keys are) -> a bias from
    # -100 to 100 added to that token's logit at every step; -100 bans it
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    # who asks (docs/tenants.md): fair share at the claim, usage, limits; None: the default tenant
    tenant: str | None = Field(None, pattern=TENANT_PATTERN)
    # the tenant's named key that asked: its spend also counts toward that key's budgets
    key_name: str | None = Field(None, pattern=TENANT_PATTERN)
    # a conversation's id, or OpenAI's prompt_cache_key: jobs with one go to the worker that ran
    # the last (backends/contract/affinity.py); hashed, never part of a Redis key's name
    cache_key: str | None = Field(None, min_length=1, max_length=256)
    # tool calling (backends/contract/tools.py): functions the model may call, whether it must
    # (auto: it may answer in words; none: tools not offered; required; {"name": ...}: that one),
    # and whether one answer may hold several calls (default true, as OpenAI's)
    tools: list[Tool] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # the answer is in the generic tool format: it ends at a call that repeats an earlier one
    # word for word (small models repeat a call until max_tokens). tools.lower sets it when an
    # answer may hold several calls; an engine that cannot check it reads the answer to the end
    end_at_repeated_call: bool = False
    # a thinking model's thoughts (llama-server's reasoning_format): "none" leaves them in the
    # text; "auto"/"deepseek" return them apart (the answer streams as the answer JSON, tools.py);
    # "deepseek-legacy" both. None: "none" (the producer decides how it reads the stream)
    reasoning_format: ReasoningFormat | None = None
    # the most tokens a thinking model's thought may have: then the engine writes the thought's
    # end marker and the answer follows (0: no thought; enable_thinking false). None: no limit
    reasoning_budget: int | None = Field(None, ge=0, le=MAX_TOKENS_LIMIT)
    # settings the model's own (Jinja) chat template reads (TEMPLATE_SETTINGS)
    chat_template_kwargs: dict[str, str | int | float | bool | None] | None = Field(None, max_length=16)
    # Ollama's keep_alive, in seconds (-1: for good): how long the model stays loaded once idle,
    # from this request on (a catalogue model: backends/shelf.py); None: as it was
    keep_alive: float | None = Field(None, ge=-1)

    @field_validator("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty",
                     "frequency_penalty", mode="before")
    @classmethod
    def _int_is_a_float(cls, v: object) -> object:
        # strict mode refuses 1 for a float field; JSON producers write 1 for 1.0
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_biases(cls, v: object) -> object:
        """Token ids as text (a Python producer's int keys too), biases as floats in range."""
        if not isinstance(v, dict):
            return v
        out: dict[str, float] = {}
        for key, bias in v.items():
            tok = str(key) if isinstance(key, int) and not isinstance(key, bool) else key
            if not isinstance(tok, str) or not TOKEN_ID.fullmatch(tok) or int(tok) >= 2**31:
                raise ValueError('keys must be token ids: integers as text, like "15043"')
            if isinstance(bias, int) and not isinstance(bias, bool):
                bias = float(bias)
            if not isinstance(bias, float) or not LOGIT_BIAS_BAN <= bias <= -LOGIT_BIAS_BAN:
                raise ValueError(f"token {int(tok)}: the bias must be a number from -100 to 100")
            out[str(int(tok))] = bias
        return out

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        """Only TEMPLATE_SETTINGS, each with a value it takes; null: as if not sent."""
        if v is None:
            return None
        for key, value in v.items():
            if key not in TEMPLATE_SETTINGS:
                raise ValueError(f"{key[:80]!r} is not a setting a request may give the template; "
                                 f"these are: {', '.join(TEMPLATE_SETTINGS)}")
            fits, takes = TEMPLATE_SETTINGS[key]
            if value is not None and not fits(value):
                raise ValueError(f"{key} must be {takes}")
        return {k: x for k, x in v.items() if x is not None} or None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: list[str]) -> list[str]:
        if any(not s or len(s) > 256 for s in v):
            raise ValueError("stop strings must be 1..256 characters")
        return v

    @field_validator("min_tokens")
    @classmethod
    def _at_most_max_tokens(cls, v: int, info: ValidationInfo) -> int:
        max_tokens = info.data.get("max_tokens")  # validated before (declared before)
        if max_tokens is not None and v > max_tokens:
            raise ValueError(f"{v} is more than max_tokens ({max_tokens})")
        return v

    @field_validator("format")
    @classmethod
    def _json_schema(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(v, dict):
            check_json_schema(v)
        return v

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> GenerateRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError("prompt is empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        total = self.chars()
        if total > MAX_REQUEST_CHARS:
            limit = MAX_REQUEST_CHARS
            raise ValueError(f"the request's text (prompt or messages, tools, template values) holds "
                             f"{total:,} characters together; the limit is {limit:,}")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        self._check_tools()
        return self

    def chars(self) -> int:
        """The characters the request carries into a prompt: the prompt or every text field of
        every message, the tools' definitions, the template variables' names and text values. The
        one count the producer's bound and a worker's context budget both apply."""
        kwargs = sum(len(k) + (len(v) if isinstance(v, str) else 0)
                     for k, v in (self.chat_template_kwargs or {}).items())
        return (len(self.prompt or "") + sum(m.chars() for m in self.messages or [])
                + (tools_chars(self.tools) if self.tools else 0) + kwargs)

    def _check_tools(self) -> None:
        if self.tools is None:
            if self.tool_choice is not None or self.parallel_tool_calls is not None:
                field = "tool_choice" if self.tool_choice is not None else "parallel_tool_calls"
                raise ValueError(f"{field} needs tools (the functions the model may call)")
            return
        if self.messages is None:
            raise ValueError("tools need 'messages' (a chat), not 'prompt'")
        check_tools(self.tools, self.tool_choice)
        for i, tool in enumerate(self.tools):
            try:
                check_json_schema(tool.parameters)
            except ValueError as e:
                raise ValueError(f"tools[{i}].parameters ({tool.name}): {e}") from None
        if self.tool_choice == "none":
            return
        try:
            check_json_schema(answer_schema(self.tools, self.tool_choice, self.parallel_tool_calls,
                                            self.format))
        except ValueError as e:
            raise ValueError(f"tools: together the tools' parameters are too large for one answer: {e}") \
                from None

    def sampling(self, defaults: SamplingDefaults) -> Sampling:
        """The request's sampling values with the worker's defaults filled in."""
        d = defaults.model_dump()
        for k in d:
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        top = (self.top_logprobs or 0) if self.logprobs else None
        bias = tuple(sorted((int(tok), b) for tok, b in (self.logit_bias or {}).items()))
        return Sampling(**d, seed=self.seed, stop=list(self.stop), format=self.format, top_logprobs=top,
                        min_tokens=min(self.min_tokens, d["max_tokens"]), ignore_eos=self.ignore_eos,
                        logit_bias=bias, end_at_repeated_call=self.end_at_repeated_call,
                        reasoning_budget=self.reasoning_budget)


def check_json_schema(schema: dict[str, Any]) -> None:
    """ValueError naming the problem unless `schema` is a usable JSON Schema (any draft
    jsonschema knows; `$schema` picks it, else 2020-12) whose grammar stays within the limits
    of schema_limits (what a worker can compile without risking its process)."""
    from jsonschema import exceptions, validators

    schema_limits.check_depth(schema)  # first: the checks below recurse
    if len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
        raise ValueError(f"the JSON schema is longer than {MAX_SCHEMA_CHARS} characters")
    # before jsonschema: its check compiles each pattern with `re`, which recurses per group
    schema_limits.check_schema_limits(schema)
    try:
        validators.validator_for(schema).check_schema(schema)
    except exceptions.SchemaError as e:
        where = "/".join(str(p) for p in e.path) or "(root)"
        raise ValueError(f"not a valid JSON schema at {where}: {e.message}") from None
    except RecursionError:  # a regex the limits let through but `re` cannot parse
        raise ValueError("the JSON schema nests too deeply to be checked") from None


@dataclass(frozen=True)
class AnswerDialect:
    """How an engine reads a model's raw text in its own dialect (backends/chat) into the answer
    JSON the stream carries: its tool-call syntax, where its thoughts go, and the grammar of its
    calls (lazy: the text before a call's trigger stays free)."""

    syntax: str | None  # a native tool syntax's name; None: no calls offered
    reasoning: ReasoningFormat = "none"
    thought_open: bool = False  # the prompt ends inside a thought (the template opened it)
    read_calls: bool = True  # False: no tools offered, the syntax is read for its thoughts only
    gbnf: str | None = None
    triggers: tuple[str, ...] = ()
    lazy: bool = True


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int | None
    stop: list[str]
    format: Literal["json"] | dict[str, Any] | None = None  # structured output (a grammar)
    top_logprobs: int | None = None  # None: no logprobs; else alternatives per token (0..20)
    min_tokens: int = 0  # no end of generation before this many tokens (at most max_tokens)
    ignore_eos: bool = False  # no end of generation at all: to max_tokens (or a stop string)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) by id; -100 bans the token
    end_at_repeated_call: bool = False  # a generic-format tool answer: it ends at a repeated call
    dialect: AnswerDialect | None = None  # the model's own calls and thoughts, read into answer JSON
    reasoning_budget: int | None = None  # tokens a thought may have (None: no limit)

    def bans_eog(self) -> bool:
        """Whether end-of-generation tokens are masked for some of the job's tokens (they are
        taken out of the logits row before any sampler sees it, so every path honours it)."""
        return self.ignore_eos or self.min_tokens > 0

    def has_penalties(self) -> bool:
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def constrained(self) -> bool:
        """A grammar decides which tokens may come: structured output, or the model's own calls."""
        return self.format is not None or (self.dialect is not None and self.dialect.gbnf is not None)

    def is_plain(self) -> bool:
        """No grammar, no penalties, no logprobs: each token comes from its logits row and the
        chain's own draws alone (what the greedy fast path and speculation rely on)."""
        return not self.constrained() and self.top_logprobs is None and not self.has_penalties()


def describe_validation_error(e: ValidationError) -> str:
    """pydantic's errors as one line a producer understands: `field: message; ...` (first five)."""
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "request"
        # a validator's own ValueError reads as its message, without pydantic's "Value error, "
        msg = err["msg"].removeprefix("Value error, ") if err["type"] == "value_error" else err["msg"]
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


# -- the result ------------------------------------------------------------------------------------


class Usage(BaseModel):
    model_config = ConfigDict(extra="allow")
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those the engine found in its KV cache (not prefilled)


class Timings(BaseModel):
    model_config = ConfigDict(extra="allow")
    queue_ms: float | None = None  # enqueued -> claimed
    ttft_ms: float | None = None  # claimed -> first token
    total_ms: float | None = None  # claimed -> done
    tokens_per_s: float | None = None  # completion tokens / (first token -> done)
    # and load_ms: its model's load, only when the job's start loaded it (before ttft_ms);
    # kv_restored_tokens, kv_restored_ms: of cached_tokens, those read from the host's KV store
    # (docs/conversations.md), and the read's time (before ttft_ms), only when there were some


class JobResultModel(BaseModel):
    """The schema of a job's result. Workers build it (`job_result()`) and store `model_dump()`:
    RQ's return value and the stream's final entry are that plain JSON dict. Fields a writer leaves
    out take these defaults; extra fields (a newer worker's) are kept."""

    model_config = ConfigDict(extra="allow")
    job_id: str = ""
    text: str = ""
    finish_reason: FinishReason = "stop"
    usage: Usage = Field(default_factory=Usage)
    worker: str | None = None
    backend: str | None = None
    attempt: int = 1
    timings: Timings = Field(default_factory=Timings)


class JobResult(dict[str, Any]):
    """What `FleetJob.result()` returns: the stored result dict itself (so `res["text"]`,
    `isinstance(res, dict)` and `json.dumps(res)` work as they do for plain RQ users), checked
    against `JobResultModel` and readable as typed attributes: `res.text`,
    `res.usage.completion_tokens`. A read-only view: edit a copy, not the result."""

    if TYPE_CHECKING:  # the attributes, typed; at run time __getattr__ reads them from the model
        job_id: str
        text: str
        finish_reason: FinishReason
        usage: Usage
        worker: str | None
        backend: str | None
        attempt: int
        timings: Timings

    def __init__(self, data: Mapping[str, Any]) -> None:
        super().__init__(data)
        self.model = JobResultModel.model_validate(data)

    def __getattr__(self, name: str) -> Any:
        if name == "model":  # not set yet (during unpickling/copy): no recursion
            raise AttributeError(name)
        return getattr(self.model, name)


def job_result(job_id: str, text: str, finish_reason: FinishReason, *, prompt_tokens: int,
               completion_tokens: int, worker: str | None, backend: str | None, attempt: int,
               cached_tokens: int = 0, queue_ms: float | None = None, ttft_ms: float | None = None,
               total_ms: float | None = None, tokens_per_s: float | None = None, load_ms: float | None = None,
               restored: tuple[int, float] | None = None, **extra: Any) -> JobResultModel:
    """The one place a job's result is put together (times rounded to 0.1); `extra`: optional
    fields (e.g. `logprobs`)."""
    return JobResultModel(
        job_id=job_id,
        text=text,
        finish_reason=finish_reason,
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                    total_tokens=prompt_tokens + completion_tokens, cached_tokens=cached_tokens),
        worker=worker,
        backend=backend,
        attempt=attempt,
        timings=Timings(queue_ms=_round(queue_ms), ttft_ms=_round(ttft_ms), total_ms=_round(total_ms),
                        tokens_per_s=_round(tokens_per_s),
                        **({} if load_ms is None else {"load_ms": _round(load_ms)}),
                        **({} if restored is None else {"kv_restored_tokens": restored[0],
                                                        "kv_restored_ms": _round(restored[1])})),
        **extra,
    )


def cancelled_in_queue(job_id: str, attempt: int) -> JobResultModel:
    """The result of a job cancelled before any worker ran it."""
    return job_result(job_id, "", "cancelled", prompt_tokens=0, completion_tokens=0, worker=None,
                      backend=None, attempt=attempt)


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)
