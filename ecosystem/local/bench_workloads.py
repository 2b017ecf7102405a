"""The request lists `fleet bench --workload` sends: the same list, in the same order, to the fleet
and to llama-server. Every request is made from (seed, workload, index) alone, so a run is
repeatable and round r's requests are new ones (indices r*N .. r*N+N-1), not cache hits of
round r-1. Lengths are real tokens of the benchmarked model (its own tokenizer, BOS included,
special tokens not parsed: how the fleet counts a prompt job).

- short: today's benchmark, 16 short built-in prompts, `--max-tokens` (64) each;
- mixed: prompts of 50-3,000 tokens (log-uniform: many short, a few long, as RAG and chat
  histories are) in three shapes (a document and a question, notes to summarise, a chat history),
  outputs of 16-256 tokens (uniform);
- shared-prefix: one ~300-token system prompt, the same for every request, then a distinct
  user turn (a sentence and a question); 64 output tokens;
- grounded: summarise, rewrite or copy a ~400-token passage (distinct for every request); the
  answer repeats the passage's wording, where prompt-lookup speculation pays; 256 output tokens.

`--max-tokens` given explicitly caps every workload's output lengths.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ecosystem.local.bench_text import paragraph, question, sentence

WORKLOADS = ("short", "mixed", "shared-prefix", "grounded")
SHORT_MAX_TOKENS = 64
MIXED_PROMPT_TOKENS = (50, 3000)
MIXED_OUTPUT_TOKENS = (16, 256)
SHARED_SYSTEM_TOKENS = 300
SHARED_MAX_TOKENS = 64
GROUNDED_PASSAGE_TOKENS = 400
GROUNDED_MAX_TOKENS = 256
CHARS_PER_TOKEN = 5  # of this text with this tokenizer, rounded up: enough text in one go

# how each side says "this prompt does not fit": the fleet's JobRejected text and llama-server's
# exceed_context_size_error (an HTTP 400 body or an error chunk)
LENGTH_REJECTION_MARKERS = ("the context holds", "exceed_context_size_error",
                            "exceeds the available context size", "larger than the max context size")


def is_length_rejection(error: str | None) -> bool:
    return error is not None and any(m in error for m in LENGTH_REJECTION_MARKERS)


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    max_tokens: int
    prompt_tokens: int  # the model's tokens, BOS included


class Tokenizer:
    """The benchmarked GGUF's own tokenizer, vocabulary only (no weights, no context)."""

    def __init__(self, model_path: Path) -> None:
        import llama_cpp
        from llama_cpp._internals import LlamaModel  # no public vocab-only model without a context

        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self._model = LlamaModel(path_model=str(model_path), params=params, verbose=False)

    def count(self, text: str) -> int:
        """Tokens of a prompt as the fleet counts them (BOS added, special tokens as text)."""
        return len(self._model.tokenize(text.encode(), add_bos=True, special=False))

    def tokens(self, text: str) -> list[int]:
        return self._model.tokenize(text.encode(), add_bos=False, special=False)

    def text(self, tokens: list[int]) -> str:
        return self._model.detokenize(tokens).decode("utf-8", errors="ignore")


def fit(tok: Tokenizer, head: str, tail: str, target: int, more: Callable[[], str],
        bounds: tuple[int, int]) -> str:
    """head + body + tail of `target` tokens (within `bounds`), the body cut from `more()` chunks
    at a word boundary."""
    lo, hi = bounds
    stream, stream_tokens = "", list[int]()
    n_body = target - tok.count(head + tail)
    prompt = head + tail
    for _ in range(6):  # the cut and token merges at the joins move the count by a few tokens
        n_body = max(1, n_body)
        while len(stream_tokens) < n_body + 8:
            while len(stream) < (n_body + 16) * CHARS_PER_TOKEN:  # tokenizing is slow: do it once
                stream += more() + " "
            stream_tokens = tok.tokens(stream)
            stream += more() + " "  # in case this text has more tokens per char
        body = tok.text(stream_tokens[:n_body])
        if " " in body:
            body = body[:body.rfind(" ")]  # the cut may fall inside a word
        prompt = head + body.strip() + tail
        count = tok.count(prompt)
        if lo <= count <= hi:
            return prompt
        n_body += (lo - count + 2) if count < lo else (hi - count - 2)
    raise RuntimeError(f"could not fit a prompt into {lo}-{hi} tokens (last: {tok.count(prompt)})")


class Workload:
    """The requests of one workload, made on demand by index and kept."""

    def __init__(self, name: str, tok: Tokenizer, *, seed: int = 0, max_tokens: int | None = None,
                 short_prompts: Sequence[str] = ()) -> None:
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
        self.name, self.tok, self.seed, self.cap = name, tok, seed, max_tokens
        self.short_prompts = list(short_prompts)
        self._made: dict[int, BenchRequest] = {}
        self._system: str | None = None
        self._make: Callable[[int, random.Random], tuple[str, int]] = {
            "short": self._short, "mixed": self._mixed, "shared-prefix": self._shared_prefix,
            "grounded": self._grounded}[name]

    def request(self, index: int) -> BenchRequest:
        if index not in self._made:
            prompt, max_tokens = self._make(index, random.Random(f"{self.seed}/{self.name}/{index}"))
            self._made[index] = BenchRequest(prompt, max_tokens, self.tok.count(prompt))
        return self._made[index]

    def requests(self, start: int, count: int) -> list[BenchRequest]:
        return [self.request(i) for i in range(start, start + count)]

    def _out(self, default: int) -> int:
        return default if self.cap is None else min(default, self.cap)

    def _short(self, index: int, _rng: random.Random) -> tuple[str, int]:
        return self.short_prompts[index % len(self.short_prompts)], self._out(SHORT_MAX_TOKENS)

    def _mixed(self, _index: int, rng: random.Random) -> tuple[str, int]:
        lo, hi = MIXED_PROMPT_TOKENS
        target = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        out = self._out(rng.randint(*MIXED_OUTPUT_TOKENS))
        shape = rng.randrange(3)
        if shape == 0:
            head = "Answer the question using only the document below.\n\nDocument:\n"
            tail = f"\n\nQuestion: {question(rng)}\nAnswer:"
            return fit(self.tok, head, tail, target, lambda: paragraph(rng), (lo, hi)), out
        if shape == 1:
            tail = "\n\nWrite a short summary of the notes above.\nSummary:"
            return fit(self.tok, "Meeting notes:\n", tail, target, lambda: paragraph(rng), (lo, hi)), out
        head = "A conversation between a user and a helpful assistant who knows the town well.\n\n"
        tail = f"\nUser: {question(rng)}\nAssistant:"
        turn = lambda: f"\nUser: {question(rng)}\nAssistant: {paragraph(rng)}"  # noqa: E731
        return fit(self.tok, head, tail, target, turn, (lo, hi)), out

    def system_prompt(self) -> str:
        """shared-prefix: the one system prompt every request starts with."""
        if self._system is None:
            rng = random.Random(f"{self.seed}/system")
            head = ("You are the help desk assistant of the town of Eastbrook. Answer questions about "
                    "the town in a friendly way, using the town chronicle below, and say so when the "
                    "chronicle does not tell.\n\nTown chronicle:\n")
            n = SHARED_SYSTEM_TOKENS
            self._system = fit(self.tok, head, "\n", n, lambda: paragraph(rng), (n - 10, n + 10))
        return self._system

    def _shared_prefix(self, _index: int, rng: random.Random) -> tuple[str, int]:
        turn = f"\nUser: {sentence(rng)} {question(rng)}\nAssistant:"
        return self.system_prompt() + turn, self._out(SHARED_MAX_TOKENS)

    def _grounded(self, _index: int, rng: random.Random) -> tuple[str, int]:
        n = GROUNDED_PASSAGE_TOKENS
        passage = fit(self.tok, "", "", n, lambda: paragraph(rng), (n - 10, n + 10))
        ask = rng.choice(["Rewrite the passage above in plain English, keeping every detail.",
                          "Summarise the passage above, keeping its wording where you can.",
                          "Copy the passage above, correcting any mistakes."])
        return f"Passage:\n{passage}\n\n{ask}\n\n", self._out(GROUNDED_MAX_TOKENS)


def unmeasured(prompts: Sequence[str], max_tokens: int) -> list[BenchRequest]:
    """Requests from plain prompts whose token counts nobody needs (prompt_tokens 0)."""
    return [BenchRequest(p, max_tokens, 0) for p in prompts]


def with_max_tokens(requests: Sequence[BenchRequest], max_tokens: int) -> list[BenchRequest]:
    """The same prompts, shorter answers (the warm-up)."""
    return [replace(r, max_tokens=max_tokens) for r in requests]


def context_needed(requests: Sequence[BenchRequest]) -> int:
    """KV cells the longest request needs: its prompt and every token it may generate."""
    return max(r.prompt_tokens + r.max_tokens for r in requests)


def ctx_per_slot(needed: int, floor: int) -> int:
    """Per-job context for both sides: at least `floor`, else the next power of two that fits."""
    return max(floor, 1 << max(0, needed - 1).bit_length())


def describe(requests: Sequence[BenchRequest]) -> dict[str, Any]:
    """Token-length statistics of the requests actually sent (JSON and the log line)."""
    prompts = [r.prompt_tokens for r in requests]
    outs = [r.max_tokens for r in requests]
    return {"requests": len(requests), "distinct_prompts": len({r.prompt for r in requests}),
            "prompt_tokens": {"min": min(prompts), "median": statistics.median(prompts), "max": max(prompts)},
            "max_tokens": {"min": min(outs), "median": statistics.median(outs), "max": max(outs)}}
