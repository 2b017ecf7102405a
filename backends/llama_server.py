"""llama.cpp's `llama-server` over HTTP: one SSE stream per job, as many jobs as the server has slots.

Prompt jobs go to the native `/completion` (raw text, like the in-process backend); message jobs go
to `/v1/chat/completions`, where the server applies the model's chat template. Usage and timings
come from the server's final chunk.

The server tokenizes its rendered chat with special tokens parsed, so a message holding the text of
a control token ("<end_of_turn>") would become that token and could close its turn and forge
another. Before a chat is sent, its messages are tokenized both ways (two /tokenize calls): when
they agree, no message holds such text and the chat goes to /v1/chat/completions unchanged;
otherwise the backend builds the chat's tokens itself with every message as text (the template
rendered by the server around placeholders, as the in-process engine does; five more calls) and
sends them to /completion, which streams raw text: the chat endpoint's parsing of the answer
(reasoning split off, a JSON answer's fences) does not apply to such a chat.

A chat with tools goes to a server with Jinja as sent, in its model's own dialect, where the
server's template renders tools (backends/llama_server_native.py); its parsed deltas stream as the
answer JSON. Such a chat is checked for control-token text in every text the template renders
(tools, calls' names, ids and arguments, thoughts, template settings too); one that holds any is
lowered to the generic tool format here and goes the way above, its answer the generic format's
JSON, which producers read alike.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
from httpx_sse import connect_sse

from backends.base import BackendUnavailable, Event, JobRejected
from backends.chat.openai_deltas import DeltaAnswer
from backends.chat.placeholders import StandIns
from backends.contract import tools
from backends.contract.schema import LOGIT_BIAS_BAN, GenerateRequest, Sampling
from backends.contract.text_ops import TOKENIZE_FIELDS, TextRequest, out_of_vocabulary, too_many
from backends.http_pool import (
    STATUS_ERRORS,
    HttpStreamBackend,
    StreamFailure,
    StreamJob,
    error_message,
    sampler_fields,
)
from backends.http_settings import HttpSettings, LlamaServerSettings
from backends.llama_server_chunks import ChatChunkReader, CompletionChunkReader
from backends.llama_server_native import (
    PROBE_CHAT,
    ServerDialect,
    answer_calls,
    openai_message,
    rendered_texts,
    tool_fields,
)

log = logging.getLogger(__name__)
# between the texts of one /tokenize call, which tokenizes each text alone and passes numbers through
_SEP = -1


class LlamaServerBackend(HttpStreamBackend):
    name = "llama-server"
    health_path = "/health"  # 503 while the model loads
    lacks = ("min_tokens",)  # llama-server takes ignore_eos (as here), no minimum length
    # not started with --embeddings: the job's error, not the engine's failure
    status_errors = {**STATUS_ERRORS, 501: ("{what} does not do this (501): {message}", False)}

    def __init__(self, settings: HttpSettings, *, transport: httpx.BaseTransport | None = None) -> None:
        super().__init__(settings, "llama-server", transport)
        self.server_slots = 0
        self.n_vocab: int | None = None  # read at the first detokenize
        self.dialect = ServerDialect()
        # a plain HttpSettings (tests, scripts) has no tool_format: the model's default
        self.tool_format = settings.tool_format if isinstance(settings, LlamaServerSettings) else "native"
        self._start()

    def _discover_slots(self) -> int:
        props = self._props()
        self.server_slots = self._server_slots(props)
        self.dialect = self._read_dialect(props)
        return min(self.server_slots, self.settings.parallel or self.server_slots)

    def _props(self) -> dict[str, Any]:
        try:
            props = self._ask("GET", "/props")
            body = props.json() if props.status_code == 200 else {}
        except (httpx.HTTPError, ValueError) as e:
            raise BackendUnavailable(f"{self.what}: cannot read its /props: {e}") from e
        return body if isinstance(body, dict) else {}

    def _server_slots(self, props: dict[str, Any]) -> int:
        """The server's `--parallel`: total_slots from /props, else the length of /slots."""
        if isinstance(props.get("total_slots"), int):
            return max(1, int(props["total_slots"]))
        try:
            slots = self._ask("GET", "/slots")
            if slots.status_code == 200 and isinstance(slots.json(), list):
                return max(1, len(slots.json()))
        except (httpx.HTTPError, ValueError) as e:
            raise BackendUnavailable(f"{self.what}: cannot read its slot count: {e}") from e
        raise BackendUnavailable(f"{self.what}: neither /props nor /slots gives a slot count")

    def _read_dialect(self, props: dict[str, Any]) -> ServerDialect:
        """Whether the server renders with Jinja and its template renders tools (a chat offering
        one tool, rendered by /apply-template: llama_server_native's docstring)."""
        try:
            answer = self._ask("POST", "/apply-template", json=PROBE_CHAT)
            rendered = answer.json() if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as e:
            # it answered /health and /props: its jobs will say what is wrong; tools go generic
            log.warning("%s: cannot tell whether it renders tools (%s): generic tool format", self.what, e)
            return ServerDialect()
        return ServerDialect.read(props, answer.status_code, rendered)

    def speaks(self, request: GenerateRequest) -> bool:
        return self.dialect.speaks(request, self.tool_format)

    def stats(self) -> dict[str, object]:
        return {**super().stats(), "server_slots": self.server_slots, "jinja": self.dialect.jinja,
                "native_tools": self.dialect.tools and self.tool_format == "native"}

    # -- one job ------------------------------------------------------------------------------------

    def _stream(self, job: StreamJob) -> Iterator[Event]:
        request, s = job.request, job.sampling
        reader: ChatChunkReader | CompletionChunkReader
        path = "/completion"
        if request.messages is not None:
            native = self.speaks(request)
            texts = rendered_texts(request)
            if self._read_as_text(texts):
                body = chat_body(request, s, native=native)
                path = "/v1/chat/completions"
                # in the server's dialect, what it parsed streams as the answer JSON
                in_json = native and tools.answers_in_json(request)
                answer = DeltaAnswer(job.job_id, answer_calls(request)) if in_json else None
                reader = ChatChunkReader(job.job_id, request.top_logprobs, answer)
            else:
                if native:  # the server would read control tokens in it: the generic format, as text
                    request = tools.lower(request)[0]
                assert request.messages is not None
                contents = [m.content for m in request.messages]
                body = prompt_body(self._chat_tokens(chat_body(request, s), contents), request, s)
                reader = CompletionChunkReader(job.job_id, request.top_logprobs)
            if job.cancelled.is_set():  # cancelled while its chat was prepared
                return
        else:
            assert request.prompt is not None
            body = prompt_body(request.prompt, request, s)
            reader = CompletionChunkReader(job.job_id, request.top_logprobs)
        with connect_sse(self.client, "POST", path, json=body) as source:
            job.response = source.response
            self._check_status(source.response)
            for sse in source.iter_sse():
                if sse.data == "[DONE]":
                    break
                chunk = json.loads(sse.data)
                if "error" in chunk:  # an error after the stream started (OAI-style, status stays 200)
                    raise self._chunk_failure(chunk["error"])
                yield from reader.feed(chunk)
                if reader.done is not None:
                    break
        if reader.done is None:
            reader.finish()
        if reader.done is not None:
            yield reader.done

    # -- chats: message content is text ------------------------------------------------------------

    def chat_tokens(self, request: GenerateRequest) -> list[int]:
        """The chat's tokens with every message read as text, the template's own text read with its
        control tokens (what a chat holding control-token text is sent as)."""
        assert request.messages is not None
        body = chat_body(request, request.sampling(self.settings.sampling))
        return self._chat_tokens(body, [m.content for m in request.messages])

    def _read_as_text(self, contents: list[str]) -> bool:
        """True when special-token parsing leaves every message as it is, i.e. none holds the text
        of a control token. Checked per message, without a render: a control token whose text would
        begin in the template's text and end in a message (or the reverse) is not looked for."""
        texts: list[str | int] = [x for c in contents for x in (c, _SEP)][:-1]
        return self._tokenize(texts, special=True) == self._tokenize(texts, special=False)

    def _chat_tokens(self, chat: dict[str, Any], contents: list[str]) -> list[int]:
        """The server renders the chat (the same body, so the same template and options) with a
        placeholder per message; the template's text keeps its control tokens, each message goes in
        as text where its placeholder was (trimmed if the template trimmed it), and each run of text
        between two control tokens is tokenized whole, so an ordinary chat would get the very tokens
        the server's own rendering gets."""
        stand_ins = StandIns()
        chat = {**chat, "messages": [{**m, "content": stand_ins.message(c)}
                                     for m, c in zip(chat["messages"], contents, strict=True)]}
        if "chat_template_kwargs" in chat:  # a setting holding a control token's text: as text too
            chat["chat_template_kwargs"] = {
                k: stand_ins.literal(v) if isinstance(v, str) and not self._read_as_text([v]) else v
                for k, v in chat["chat_template_kwargs"].items()}
        rendered = self._post("/apply-template", chat)["prompt"]
        segments, placed = stand_ins.place(rendered)  # the template's text, each message as text
        items: list[int | str] = []  # control token ids and text, in order
        for i, split in enumerate(self._split_control(segments)):
            items += split
            if i < len(placed):
                items.append(placed[i])
        # each run of text alone, with "" first: the only text given add_special, it gets the BOS
        # (and EOS) the model adds, kept apart by a separator
        runs: list[int | str] = ["", _SEP]
        run: list[str] = []
        for item in [*items, _SEP]:
            if isinstance(item, str):
                run.append(item)
                continue
            if text := "".join(run):
                runs.append(text)
            if item != _SEP:
                runs.append(item)
            run = []
        tokens = self._tokenize(runs, special=False, add_special=True)
        cut = tokens.index(_SEP)
        added, body = tokens[:cut], tokens[cut + 1:]
        return added[:1] + body + added[1:]  # BOS first, EOS (a model that adds one) last

    def _split_control(self, segments: list[str]) -> list[list[int | str]]:
        """Each template segment as its control token ids and the text between them. Control tokens
        are those the segments' special tokenization holds whose text tokenizes to that token only
        with special parsing. (Tokens that strip the spaces beside them, phi-3's, are not mirrored:
        the server does not tell a token's attributes.)"""
        pieces = self._post("/tokenize", {"content": segments, "add_special": False, "parse_special": True,
                                          "with_pieces": True})["tokens"]
        found = list(dict.fromkeys((p["id"], p["piece"]) for p in pieces
                                   if isinstance(p["piece"], str) and p["piece"]))
        texts: list[str | int] = [x for _, piece in found for x in (piece, _SEP)][:-1]
        special = _split_at_sep(self._tokenize(texts, special=True)) if found else []
        plain = _split_at_sep(self._tokenize(texts, special=False)) if found else []
        control = {f for f, sp, pl in zip(found, special, plain, strict=True) if sp == [f[0]] != pl}
        out: list[list[int | str]] = [[] for _ in segments]
        k, pos = 0, 0
        for p in pieces:
            if not isinstance(p["piece"], str) or (p["id"], p["piece"]) not in control:
                continue
            # in order: the segment holding it is this one or a later one
            while k < len(segments) and (at := segments[k].find(p["piece"], pos)) < 0:
                out[k].append(segments[k][pos:])
                k, pos = k + 1, 0
            if k == len(segments):  # never expected: the rest stays text
                break
            out[k] += [segments[k][pos:at], p["id"]]
            pos = at + len(p["piece"])
        for rest in range(k, len(segments)):
            out[rest].append(segments[rest][pos if rest == k else 0:])
        return out

    def _tokenize(self, content: list[str | int], *, special: bool, add_special: bool = False) -> list[int]:
        tokens = self._post("/tokenize", {"content": content, "add_special": add_special,
                                          "parse_special": special})["tokens"]
        return [int(t) for t in tokens]

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        """A request that prepares a job (not a probe: as long as a job's own request may take)."""
        response = self.client.post(path, json=body)
        if response.status_code != 200:
            raise self._status_failure(response.status_code, error_message(response))
        return response.json()

    # -- text jobs: the server's own /tokenize, /detokenize, /apply-template ----------------------

    def text_op(self, request: TextRequest) -> dict[str, object]:
        """The server's answer to the same request (its tokenizer, its template: the same body as a
        chat job's, so the same options); ids outside its vocabulary are refused here, which the
        server would answer with a 500."""
        try:
            if request.op == "tokenize":
                answer = self._post("/tokenize", request.model_dump(include=set(TOKENIZE_FIELDS)))
                if reason := too_many(answer["tokens"]):
                    raise JobRejected(reason)
                return {"tokens": answer["tokens"]}
            if request.op == "detokenize":
                assert request.tokens is not None
                if reason := out_of_vocabulary(request.tokens, self._vocabulary_size()):
                    raise JobRejected(reason)
                return {"content": self._post("/detokenize", {"tokens": request.tokens})["content"]}
            chat = request.chat
            assert chat is not None
            body = chat_body(chat, chat.sampling(self.settings.sampling), native=self.speaks(chat))
            return {"prompt": self._post("/apply-template", body)["prompt"]}
        except StreamFailure as e:
            raise (BackendUnavailable if e.retryable else JobRejected)(e.message) from None
        except httpx.HTTPError as e:
            raise BackendUnavailable(self._exception_failure(e)[0]) from None

    def _vocabulary_size(self) -> int:
        """The model's n_vocab, from the server's /v1/models (asked once: a server's model is fixed)."""
        if self.n_vocab is None:
            models = self._ask("GET", "/v1/models")
            self._check_status(models)
            try:
                self.n_vocab = int(models.json()["data"][0]["meta"]["n_vocab"])
            except (ValueError, LookupError, TypeError):
                raise JobRejected(f"{self.what}: its /v1/models does not tell the vocabulary's size, "
                                  "so token ids cannot be checked") from None
        return self.n_vocab

    def _embed_request(self, texts: Sequence[str], truncate: Sequence[bool]) -> tuple[str, dict[str, Any]]:
        """OpenAI's route (llama-server started with --embeddings; else a 501, the job's error)."""
        return "/v1/embeddings", {"input": list(texts)}

    def _embed_answer(self, answer: Any) -> tuple[list[list[float]], int]:
        data = sorted(answer["data"], key=lambda d: d["index"])
        return [d["embedding"] for d in data], int(answer.get("usage", {}).get("prompt_tokens") or 0)

    def _chunk_failure(self, error: object) -> StreamFailure:
        if isinstance(error, dict):
            code = error.get("code")
            return self._status_failure(code if isinstance(code, int) else 500, str(error.get("message")))
        return StreamFailure(f"{self.what} failed mid-stream: {error}", retryable=True)


def common_fields(s: Sampling) -> dict[str, Any]:
    out: dict[str, Any] = {**sampler_fields(s), "seed": -1 if s.seed is None else s.seed, "stop": s.stop,
                           "stream": True, "cache_prompt": True}
    if s.ignore_eos:  # both endpoints read it (masks every end-of-generation token)
        out["ignore_eos"] = True
    if s.logit_bias:  # llama-server's pair form, which both endpoints read; false: a ban (-inf)
        out["logit_bias"] = [[tok, False if bias <= LOGIT_BIAS_BAN else bias] for tok, bias in s.logit_bias]
    return out


def structured_fields(request: GenerateRequest) -> dict[str, Any]:
    """Structured output and logprobs, in the names both llama-server endpoints read (the
    chat endpoint turns logprobs/top_logprobs into n_probs itself)."""
    out: dict[str, Any] = {}
    if request.format is not None:  # "json": any JSON object, as llama-server's json_object
        out["json_schema"] = {"type": "object"} if request.format == "json" else request.format
    if request.logprobs:
        out["logprobs"] = True
        out["top_logprobs"] = max(1, request.top_logprobs or 0)
    return out


def completion_body(prompt: str | list[int], s: Sampling) -> dict[str, Any]:
    """The streaming `/completion` request this backend sends for a prompt job (`fleet bench` sends
    the very same to llama-server directly); `prompt` is text or token ids."""
    return {**common_fields(s), "prompt": prompt, "n_predict": s.max_tokens}


def prompt_body(prompt: str | list[int], request: GenerateRequest, s: Sampling) -> dict[str, Any]:
    """A job's `/completion` request: a prompt job's text, or a chat's tokens."""
    body = {**completion_body(prompt, s), **structured_fields(request)}
    if request.logprobs:  # /completion names it n_probs; at least 1 to get any
        body["n_probs"] = max(1, request.top_logprobs or 0)
    return body


def chat_body(request: GenerateRequest, s: Sampling, *, native: bool = False) -> dict[str, Any]:
    """A chat job's `/v1/chat/completions` request; `native`: with its tools, in the server's
    own dialect. Thoughts stay in the text unless the request asks them apart (the server's own
    default would split them off)."""
    body = {
        **common_fields(s),
        **structured_fields(request),
        "messages": [openai_message(m) for m in request.messages or []],
        "max_tokens": s.max_tokens,
        "stream_options": {"include_usage": True},
        "reasoning_format": request.reasoning_format or "none",
        **(tool_fields(request) if native else {}),
    }
    if request.chat_template_kwargs:
        body["chat_template_kwargs"] = request.chat_template_kwargs
    if request.reasoning_budget is not None:  # the server ends a thought its template marks there
        body["reasoning_budget_tokens"] = request.reasoning_budget
    return body


def _split_at_sep(tokens: list[int]) -> list[list[int]]:
    out: list[list[int]] = [[]]
    for t in tokens:
        if t == _SEP:
            out.append([])
        else:
            out[-1].append(t)
    return out
