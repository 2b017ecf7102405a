"""An Ollama-API server for tests, written from Ollama's documented API (docs/api.md, docs/api/errors)
and backed by the real model through llama_cpp's high-level `Llama`.

What it speaks: GET / and /api/version, GET /api/tags, POST /api/show, DELETE /api/delete,
POST /api/generate and /api/chat with NDJSON streaming (or one object with "stream": false).
Chunks: {"model", "created_at", "response" | "message", "done": false}; the final object adds
done_reason, total_duration, load_duration, prompt_eval_count, prompt_eval_duration, eval_count,
eval_duration (nanoseconds) and, for templated /api/generate, "context". Errors are {"error": "..."}
with 400 (bad request), 404 (unknown model), 503 (busy: more requests than parallel + max_queue,
like OLLAMA_NUM_PARALLEL / OLLAMA_MAX_QUEUE); once streaming, an error is an {"error": ...} line.

Thinking (`thinking=True`, --thinking): the model is listed with the "thinking" capability, and a
chat's `think` (true or a level) opens a thought in the prompt (`<think>\n`, as a thinking
template does) and splits the output at `</think>` into `message.thinking` and `message.content`,
as Ollama's thinking parser does; `think: false` renders the thought closed. Unset, nothing is
split. A `think` for a model without the capability is a 400, as Ollama answers it.

Test knob: `error_after` (--error-after N, or OLLAMA_TEST_ERROR_AFTER): after N tokens the stream
gets the error line Ollama sends when the runner fails, and ends.

    python -m tests.ollama_api_server --model-path m.gguf --port 11434 [--name gemma3:270m]  # repo root
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import socket
import sys
import threading
import time
from collections.abc import Callable, Generator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import llama_cpp

from tests.ollama_thoughts import ThoughtSplit, whole

RUNNER_ERROR = "an error was encountered while running the model"
BUSY_ERROR = "server busy, please try again.  maximum pending requests exceeded"
VERSION = "0.6.0-fleet-test"


def full_name(name: str) -> str:
    """Ollama's model names are model[:tag]; the tag defaults to 'latest'."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def gemma_chat_prompt(messages: list[dict[str, str]]) -> str:
    """Gemma's turn format (the GGUF carries no template); system text joins the first user turn,
    as in Ollama's gemma3 template."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    turns = []
    for m in (m for m in messages if m["role"] != "system"):
        content = m["content"]
        if system and m["role"] == "user":
            content, system = f"{system}\n\n{content}", ""
        turns.append(
            f"<start_of_turn>{'model' if m['role'] == 'assistant' else 'user'}\n{content}<end_of_turn>\n"
        )
    return "".join(turns) + "<start_of_turn>model\n"


def _unrepacked_llama(model_path: str, **kw: Any) -> llama_cpp.Llama:
    """A Llama without weight repacking, as the fleet's engine loads the model: repacking picks
    ggml's AMX kernels on a CPU that lists AMX, and where Linux was not asked for the tile state
    they die with SIGILL (ecosystem/local/llama_server.py, amx_unusable). Llama() has no argument
    for it, so its default model parameters are amended while it loads."""
    low = llama_cpp.llama_cpp  # the module Llama() reads its defaults from
    default = low.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = False
        return p

    with _LOAD_LOCK:
        low.llama_model_default_params = params
        try:
            return llama_cpp.Llama(model_path, **kw)
        finally:
            low.llama_model_default_params = default


_LOAD_LOCK = threading.Lock()


class Engine:
    """One Llama, one generation at a time (Ollama with OLLAMA_NUM_PARALLEL=1)."""

    def __init__(self, model_path: str, n_ctx: int, threads: int) -> None:
        started = time.perf_counter_ns()
        self.llm = _unrepacked_llama(model_path, n_ctx=n_ctx, n_threads=threads, verbose=False)
        self.load_ns = time.perf_counter_ns() - started
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self.lock = threading.Lock()
        self.n_ctx = n_ctx
        self.last_counts = (0, 0)  # (prompt tokens, generated tokens) of the last generation

    def prompt_tokens(self, prompt: str, options: dict[str, Any]) -> list[int]:
        """The prompt's tokens; PromptTooLong when it cannot fit with num_predict."""
        tokens = self.llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
        num_predict = int(options.get("num_predict", -1))
        if len(tokens) + max(num_predict, 1) > self.n_ctx:
            raise PromptTooLong(f"prompt ({len(tokens)} tokens) + num_predict exceeds num_ctx ({self.n_ctx})")
        return tokens

    def generate(
        self, prompt_tokens: list[int], options: dict[str, Any]
    ) -> Generator[tuple[str, list[int]], None, str]:
        """Yield (text delta, tokens so far); the generator's return value is the done_reason."""
        llm = self.llm
        num_predict = int(options.get("num_predict", -1))
        if num_predict < 0:
            num_predict = self.n_ctx - len(prompt_tokens)
        stops = [s for s in options.get("stop") or [] if s]
        seed = options.get("seed")
        llm.set_seed(int(seed) if seed is not None and int(seed) >= 0 else random.randrange(2**31))
        out: list[int] = []
        text = sent = ""
        reason = "length"
        hold = max((len(s) - 1 for s in stops), default=0)  # a tail that could still become a stop string
        for token in llm.generate(
            prompt_tokens,
            top_k=int(options.get("top_k", 40)),
            top_p=float(options.get("top_p", 0.9)),
            min_p=float(options.get("min_p", 0.0)),
            temp=float(options.get("temperature", 0.8)),
            repeat_penalty=float(options.get("repeat_penalty", 1.1)),
        ):
            if num_predict == 0:
                break
            if llama_cpp.llama_vocab_is_eog(self.vocab, token):
                reason = "stop"
                break
            out.append(token)
            text = llm.detokenize(out, prev_tokens=prompt_tokens).decode("utf-8", errors="ignore")
            cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
            if cut >= 0:
                text, reason = text[:cut], "stop"
                break
            if len(text) - hold > len(sent):
                delta = text[len(sent) : len(text) - hold]
                sent += delta
                yield delta, prompt_tokens + out
            if len(out) >= num_predict:
                break
        if len(text) > len(sent):
            yield text[len(sent) :], prompt_tokens + out
        self.last_counts = (len(prompt_tokens), len(out))
        return reason


class PromptTooLong(ValueError):
    pass


class OllamaApiServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        engine: Engine,
        names: list[str],
        parallel: int = 1,
        max_queue: int = 0,
        error_after: int | None = None,
        thinking: bool = False,
    ) -> None:
        super().__init__(address, OllamaHandler)
        self.thinking = thinking
        self.engine = engine
        self.models = {full_name(n) for n in names}
        self.slots = threading.BoundedSemaphore(parallel + max_queue)
        self.active = 0  # requests holding a slot (generating or waiting for the model)
        self.error_after = error_after
        self.first_request = True

    def handle_error(self, request: object, client_address: object) -> None:
        """Clients hanging up (cancel, keep-alive sockets closed) are normal; other errors print."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"


class OllamaHandler(BaseHTTPRequestHandler):
    server: OllamaApiServer
    protocol_version = "HTTP/1.1"  # chunked NDJSON streams, keep-alive like Ollama's Go server

    def log_message(self, format: str, *args: Any) -> None:  # quiet in tests
        pass

    # -- plumbing -----------------------------------------------------------------------------------

    def _json(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": message})

    def _body(self) -> dict[str, Any] | None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not raw:
            self._error(400, "missing request body")
            return None
        try:
            body = json.loads(raw)
        except ValueError as e:
            self._error(400, str(e))
            return None
        if not isinstance(body, dict):
            self._error(400, "request body must be a JSON object")
            return None
        return body

    def _client_gone(self) -> bool:
        """Like Go's request context: notice a client that hung up without waiting for a write to fail."""
        readable, _, _ = select.select([self.connection], [], [], 0)
        if not readable:
            return False
        try:
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _chunk(self, obj: object) -> None:
        if self._client_gone():
            raise ConnectionResetError("client closed the stream")
        data = json.dumps(obj).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    # -- routes -------------------------------------------------------------------------------------

    def do_GET(self) -> None:
        if self.path == "/":
            data = b"Ollama is running"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif self.path == "/api/version":
            self._json(200, {"version": VERSION})
        elif self.path == "/api/tags":
            models = [
                {"name": n, "model": n, "modified_at": now(), "details": {"format": "gguf"}}
                for n in self.server.models
            ]
            self._json(200, {"models": models})
        else:
            self._error(404, "404 page not found")

    def do_DELETE(self) -> None:
        if self.path != "/api/delete" or (body := self._body()) is None:
            return None if self.path == "/api/delete" else self._error(404, "404 page not found")
        name = full_name(str(body.get("model") or body.get("name") or ""))
        if name not in self.server.models:
            return self._error(404, f"model '{body.get('model')}' not found")
        self.server.models.discard(name)
        return self._json(200, {})

    def do_POST(self) -> None:
        routes: dict[str, Callable[[dict[str, Any]], None]] = {
            "/api/show": self._show,
            "/api/generate": self._generate,
            "/api/chat": self._chat,
        }
        route = routes.get(self.path)
        if route is None:
            self._error(404, "404 page not found")
        elif (body := self._body()) is not None:
            route(body)

    def _known_model(self, body: dict[str, Any]) -> str | None:
        name = body.get("model") or body.get("name")
        if not name:
            self._error(400, "model is required")
            return None
        if full_name(str(name)) not in self.server.models:
            self._error(404, f'model "{name}" not found, try pulling it first')
            return None
        return str(name)

    def _show(self, body: dict[str, Any]) -> None:
        if self._known_model(body) is not None:
            self._json(
                200,
                {
                    "modelfile": "",
                    "parameters": "",
                    "template": "{{ .Prompt }}",
                    "details": {"format": "gguf", "family": "gemma3"},
                    **({"capabilities": ["completion", "thinking"]} if self.server.thinking else {}),
                },
            )

    def _generate(self, body: dict[str, Any]) -> None:
        if (name := self._known_model(body)) is None:
            return
        prompt = str(body.get("prompt") or "")
        raw = bool(body.get("raw"))
        if not prompt:  # "load a model" request
            return self._json(200, {"model": name, "created_at": now(), "response": "", "done": True})
        text = (
            prompt
            if raw
            else gemma_chat_prompt(
                ([{"role": "system", "content": body["system"]}] if body.get("system") else [])
                + [{"role": "user", "content": prompt}]
            )
        )
        self._run(body, name, text, chat=False, with_context=not raw)

    def _chat(self, body: dict[str, Any]) -> None:
        if (name := self._known_model(body)) is None:
            return
        messages = body.get("messages") or []
        if not messages:  # "load a model" request
            return self._json(
                200,
                {
                    "model": name,
                    "created_at": now(),
                    "done": True,
                    "done_reason": "load",
                    "message": {"role": "assistant", "content": ""},
                },
            )
        think = body.get("think")
        if not (think is None or isinstance(think, bool) or think in ("low", "medium", "high")):
            return self._error(400, f"invalid think value: {think!r}")
        if think and not self.server.thinking:
            return self._error(400, f'"{name}" does not support thinking')
        text = gemma_chat_prompt([{"role": m["role"], "content": m.get("content", "")} for m in messages])
        if self.server.thinking and think is not None:
            text += "<think>\n" if think else "<think>\n\n</think>\n\n"
        self._run(body, name, text, chat=True, with_context=False)

    # -- generation ---------------------------------------------------------------------------------

    def _run(self, body: dict[str, Any], name: str, prompt: str, chat: bool, with_context: bool) -> None:
        server = self.server
        if not server.slots.acquire(blocking=False):
            return self._error(503, BUSY_ERROR)
        server.active += 1
        try:
            with server.engine.lock:
                self._generate_locked(body, name, prompt, chat, with_context)
        finally:
            server.active -= 1
            server.slots.release()

    def _generate_locked(
        self, body: dict[str, Any], name: str, prompt: str, chat: bool, with_context: bool
    ) -> None:
        server, engine = self.server, self.server.engine

        split = ThoughtSplit(opened=chat and bool(body.get("think")) and server.thinking)

        def payload(text: str, last: bool = False) -> dict[str, Any]:
            if not chat:
                return {"response": text}
            thinking, content = split.feed(text)
            thinking += split.close() if last else ""
            return {"message": {"role": "assistant", "content": content,
                                **({"thinking": thinking} if thinking else {})}}

        started = time.perf_counter_ns()
        load_ns = engine.load_ns if server.first_request else 0
        server.first_request = False
        stream = body.get("stream", True) is not False
        options = body.get("options") or {}
        try:
            tokens = engine.prompt_tokens(prompt, options)
        except PromptTooLong as e:
            return self._error(400, str(e))
        gen = engine.generate(tokens, options)
        pieces: list[str] = []
        first_token_ns = 0
        context: list[int] = []
        if stream:
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
        try:
            reason = "stop"
            while True:
                try:
                    delta, context = next(gen)
                except StopIteration as end:
                    reason = end.value
                    break
                first_token_ns = first_token_ns or time.perf_counter_ns()
                pieces.append(delta)
                if stream:
                    if server.error_after is not None and len(pieces) > server.error_after:
                        self._chunk({"error": RUNNER_ERROR})  # what Ollama sends when its runner fails
                        self.wfile.write(b"0\r\n\r\n")
                        return None
                    self._chunk({"model": name, "created_at": now(), **payload(delta), "done": False})
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away (cancel): stop generating
            return None
        finally:
            gen.close()
        ended = time.perf_counter_ns()
        n_prompt, n_eval = engine.last_counts
        first_token_ns = first_token_ns or ended
        final: dict[str, Any] = {
            "model": name,
            "created_at": now(),
            **(payload("", last=True) if stream else whole(chat, body, server.thinking, "".join(pieces))),
            "done": True,
            "done_reason": reason,
            "total_duration": ended - started + load_ns,
            "load_duration": load_ns,
            "prompt_eval_count": n_prompt,
            "prompt_eval_duration": first_token_ns - started,
            "eval_count": n_eval,
            "eval_duration": ended - first_token_ns,
        }
        if with_context:
            final["context"] = context
        if stream:
            self._chunk(final)
            self.wfile.write(b"0\r\n\r\n")
        else:
            self._json(200, final)


def serve(
    model_path: str,
    port: int = 0,
    names: tuple[str, ...] = ("gemma3:270m",),
    n_ctx: int = 2048,
    threads: int = 2,
    parallel: int = 1,
    max_queue: int = 0,
    error_after: int | None = None,
    thinking: bool = False,
) -> OllamaApiServer:
    """Load the model and start serving on a daemon thread; `server.shutdown()` stops it."""
    engine = Engine(model_path, n_ctx=n_ctx, threads=threads)
    server = OllamaApiServer(("127.0.0.1", port), engine, list(names), parallel, max_queue, error_after,
                             thinking)
    threading.Thread(target=server.serve_forever, name="ollama-api-server", daemon=True).start()
    return server


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--port", type=int, default=11434)
    parser.add_argument("--name", action="append", help="model name(s) served (default gemma3:270m)")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--max-queue", type=int, default=0)
    env_error = os.environ.get("OLLAMA_TEST_ERROR_AFTER")
    parser.add_argument("--error-after", type=int, default=int(env_error) if env_error else None)
    parser.add_argument("--thinking", action="store_true", help="the model thinks (module docstring)")
    a = parser.parse_args()
    engine = Engine(a.model_path, n_ctx=a.ctx, threads=a.threads)
    server = OllamaApiServer(
        ("127.0.0.1", a.port), engine, a.name or ["gemma3:270m"], a.parallel, a.max_queue, a.error_after,
        a.thinking,
    )
    print(f"ollama-api test server on {server.url}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
