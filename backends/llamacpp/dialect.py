"""What a model's own chat template speaks, and how a job of it is read: the engine's side of
backends/chat. A chat with tools runs in the model's own syntax (rendered by its Jinja template,
its calls held to a lazy grammar, its text read into the answer JSON) where the template has a
syntax llama-fleet reads and `tool_format` is native; else the worker lowers it to the generic
tool format (backends/contract/tools.py) before the engine sees it."""

from __future__ import annotations

from backends.base import JobRejected
from backends.chat.reasoning import THINK
from backends.chat.tool_syntax import ToolSyntax, detect
from backends.contract import tools
from backends.contract.schema import AnswerDialect, GenerateRequest
from backends.llamacpp.model import LoadedModel
from backends.llamacpp.tool_grammar import native_call_grammar

THOUGHT_OPENERS = ("<think>",)  # a prompt ending so was opened inside a thought by its template


class ModelDialect:
    def __init__(self, model: LoadedModel, tool_format: str) -> None:
        self.model = model
        jinja = model.jinja
        # the model's syntax is read for its thoughts (gpt-oss's channels) even with generic tools
        self.own_syntax: ToolSyntax | None = detect(jinja.source) if jinja else None
        self.syntax = self.own_syntax if tool_format == "native" else None  # its calls read natively
        self.thinking = bool(jinja and jinja.template.caps.thinking)
        if self.own_syntax is not None:
            model.preserve(self.own_syntax.preserved)
        # where a thought starts and ends, as the answer's reader finds it (a reasoning budget
        # holds it: thought_budget.py; gpt-oss: its analysis message); None: a plain template
        own = self.own_syntax
        self.thought: tuple[str, str] | None = (
            own.thought or own.analysis if own is not None else THINK if self.thinking else None)

    def speaks(self, request: GenerateRequest) -> bool:
        """Whether the engine takes the request as sent (its model's own template renders its
        tools, calls and results) rather than lowered to the generic tool format."""
        if self.model.jinja is None:
            return False
        touched = bool(request.tools) or any(m.role == "tool" or m.tool_calls for m in request.messages or [])
        # one grammar per job: structured output beside tools keeps the generic format's
        return not touched or (self.syntax is not None and request.format is None)

    def of(self, request: GenerateRequest, tokens: list[int]) -> AnswerDialect | None:
        """How the job's raw text is read into the answer JSON (None: it streams as it is)."""
        if request.messages is None or self.model.jinja is None or not tools.answers_in_json(request):
            return None
        reasoning = request.reasoning_format or "none"
        thought_open = self._ends_in_thought(tokens)
        if not tools.calls_tools(request):
            own = self.own_syntax.name if self.own_syntax is not None else None
            return AnswerDialect(own, reasoning, thought_open, read_calls=False)
        if self.syntax is None or request.tools is None:
            raise JobRejected("tools reached the engine unlowered, and its template has no tool syntax")
        grammar = native_call_grammar(self.syntax, request.tools, request.tool_choice,
                                      request.parallel_tool_calls, thought_open=thought_open,
                                      thinks=self.thinking)
        return AnswerDialect(self.syntax.name, reasoning, thought_open, gbnf=grammar.gbnf,
                             triggers=tuple(grammar.triggers), lazy=grammar.lazy)

    def _ends_in_thought(self, tokens: list[int]) -> bool:
        tail = b"".join(self.model.piece(t) for t in tokens[-4:]).decode("utf-8", errors="replace")
        return tail.rstrip().endswith(THOUGHT_OPENERS)
