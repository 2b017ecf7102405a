"""One sequence's token sampling on llama.cpp: its sampler chain, an optional grammar (structured
output) and optional log-probabilities.

- Plain greedy jobs (no grammar, penalties or logprobs) take the argmax of the logits row.
- Other jobs without a grammar whose chain starts with top-k (the default sampling) hand the chain
  only the tokens near the best logit (`TopCandidates`: numpy reads the row in place, enough tokens
  that top-k keeps exactly what it keeps from the whole vocabulary); the rest take
  `llama_sampler_sample`, which copies all 262k logits into candidate structs first (0.2-0.6 ms a row).
- Logprobs: a numpy log-softmax over the sequence's logits row, only for jobs that ask.
- Grammar: what llama-server does (`common_sampler_sample` with grammar_first=false). Filtering
  every candidate of a 262k vocabulary through the grammar each step is slow, so the chain samples
  first (in C, llama_sampler_sample, unless penalties make the chain remember what it sees) and
  only the picked token is checked against the grammar (a 1-element candidate array);
  only when the grammar rejects it is the candidate list filtered and sampled again. That
  re-filter first tries the SHORTLIST best logits (a few ms instead of 60-200 ms for 262k pieces):
  when at least as many of them pass as the chain keeps (its top-k; 1 for plain greedy), the
  chain picks exactly what it would pick from the whole filtered vocabulary; else the whole one.
- A lazy grammar (a model's own calls) before its trigger changes no pick (its apply() returns at
  once): the chain picks as for a job without a grammar, and the grammar takes the token, while a
  Python watch sees when it fires (lazy_trigger.py: until then the job may draft).
- A thought past its budget gets the template's end marker instead of a pick (thought_budget.py).
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import random
import threading
from collections.abc import Callable
from functools import lru_cache
from typing import Any, TypeVar

import llama_cpp as ll
import numpy as np
from llama_cpp.llama_grammar import JSON_GBNF

from backends.base import JobRejected
from backends.contract.schema import LOGIT_BIAS_BAN, AnswerDialect, Sampling
from backends.contract.schema_limits import SchemaTooComplex
from backends.llamacpp.candidates import Candidates, TopCandidates
from backends.llamacpp.lazy_trigger import TriggerWatch, mirrors
from backends.llamacpp.model import LoadedModel
from backends.llamacpp.schema_grammar import GrammarTooLarge, check_gbnf, json_schema_to_gbnf
from backends.llamacpp.thought_budget import thought_budget

log = logging.getLogger("fleet.engine")

PENALTY_LAST_N = 64  # llama-server's default window for repeat/frequency/presence penalties
GREEDY_PENALTY_TOP_K = 64  # greedy with penalties looks at the best 64 only (see sampler_chain)
SHORTLIST = 1024  # candidates a rejected pick is re-sampled from first
GrammarFormat = str | dict[str, Any]
# The grammar compile's stack: llama.cpp needs ~440 bytes per nested group; the limits allow
# ~1,100 (~0.5 MiB), so 64 MiB leaves a wide margin wherever the worker runs (only pages touched
# are committed). Measured: docs/reliability.md, "Structured output limits".
COMPILE_STACK = 64 << 20
_stack_size_lock = threading.Lock()
T = TypeVar("T")


def sampler_chain(s: Sampling, n_vocab: int) -> ll.llama_sampler_p:
    """One chain per sequence: its own seed, penalties history and temperature."""
    chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
    if s.temperature <= 0:
        if s.has_penalties():  # penalties over the whole vocabulary are slow: the top 64 suffice
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_k(GREEDY_PENALTY_TOP_K))
            ll.llama_sampler_chain_add(chain, _penalties(n_vocab, s))
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_greedy())
        return chain
    if s.top_k > 0:
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_k(s.top_k))
    if s.has_penalties():  # after top-k, for the same reason
        ll.llama_sampler_chain_add(chain, _penalties(n_vocab, s))
    ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_p(s.top_p, 1))
    ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_min_p(s.min_p, 1))
    ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_temp(s.temperature))
    seed = s.seed if s.seed is not None else random.getrandbits(32)
    ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_dist(seed))
    return chain


def chain_keeps(s: Sampling) -> int | None:
    """How many best candidates `sampler_chain` samples from (None: it may use all of them)."""
    if s.temperature <= 0:
        return GREEDY_PENALTY_TOP_K if s.has_penalties() else 1
    return s.top_k if 0 < s.top_k <= SHORTLIST else None


def _penalties(n_vocab: int, s: Sampling) -> ll.llama_sampler_p:
    return ll.llama_sampler_init_penalties(n_vocab, PENALTY_LAST_N, s.repeat_penalty, s.frequency_penalty,
                                           s.presence_penalty)


# -- grammars --------------------------------------------------------------------------------------


def gbnf_for(fmt: GrammarFormat) -> str:
    """The GBNF grammar of a request's `format`: "json" = any JSON object, a dict = a JSON Schema.
    JobRejected naming the problem when the schema cannot be converted."""
    if fmt == "json":
        return JSON_GBNF
    if not isinstance(fmt, dict):
        raise JobRejected(f"format must be \"json\" or a JSON schema object, not {fmt!r}")
    return _schema_gbnf(json.dumps(fmt))  # keeps the schema's property order


@lru_cache(maxsize=64)
def _schema_gbnf(schema: str) -> str:
    try:
        return json_schema_to_gbnf(schema)
    except (SchemaTooComplex, GrammarTooLarge) as e:
        raise JobRejected(f"refused: the JSON schema is too complex for a grammar: {e}") from None
    except Exception as e:  # the converter raises whatever its parser meets; name it for the user
        log.warning("schema converter: %s: %s", type(e).__name__, e)
        why = str(e)[:200] or "unsupported"
        raise JobRejected(f"the JSON schema cannot be turned into a grammar: {why}") from None


def compile_grammar(model: LoadedModel, gbnf: str) -> ll.llama_sampler_p:
    """The grammar sampler; JobRejected when the grammar is over the limits or does not compile.
    llama.cpp's parser recurses once per nested group, so it runs on a thread whose stack size is
    chosen here, not on whatever thread admits the job (a helper thread's may be small)."""
    try:
        _checked(gbnf)
    except GrammarTooLarge as e:
        raise JobRejected(f"refused: {e}") from None
    grammar = _on_compile_stack(lambda: ll.llama_sampler_init_grammar(model.vocab, gbnf.encode(), b"root"))
    if not grammar:
        raise JobRejected("llama.cpp could not compile the grammar made from the JSON schema")
    return grammar


def compile_dialect(model: LoadedModel, dialect: AnswerDialect | None) -> ll.llama_sampler_p:
    """The grammar of a model's own tool calls (backends/llamacpp/tool_grammar.py); lazy: it
    applies from the first match of a trigger pattern on, fed the text from there."""
    assert dialect is not None and dialect.gbnf is not None
    gbnf = dialect.gbnf
    if not dialect.lazy:
        return compile_grammar(model, gbnf)
    try:
        _checked(gbnf)
    except GrammarTooLarge as e:
        raise JobRejected(f"refused: {e}") from None
    patterns = (ctypes.c_char_p * len(dialect.triggers))(*(p.encode() for p in dialect.triggers))
    grammar = _on_compile_stack(lambda: ll.llama_sampler_init_grammar_lazy_patterns(
        model.vocab, gbnf.encode(), b"root", patterns, len(dialect.triggers), None, 0))
    if not grammar:
        raise JobRejected("llama.cpp could not compile the grammar of the tools' calls")
    return grammar


@lru_cache(maxsize=64)
def _checked(gbnf: str) -> None:
    """check_gbnf, once per grammar (a 20 KB one takes ~7 ms; each job compiles its grammar twice)."""
    check_gbnf(gbnf)


def _on_compile_stack(fn: Callable[[], T]) -> T:
    """fn() on a new thread with COMPILE_STACK bytes of stack (reserved, touched only as used)."""
    out: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # handed to the caller's thread
            failed.append(e)

    with _stack_size_lock:  # the size applies to threads started meanwhile: set it only around ours
        before = threading.stack_size(COMPILE_STACK)
        try:
            thread = threading.Thread(target=run, name="grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(before)
    thread.join()
    if failed:
        raise failed[0]
    return out[0]


def check_format(model: LoadedModel, fmt: GrammarFormat) -> None:
    """Fail a job at admission (not mid-generation) when its schema cannot become a grammar."""
    ll.llama_sampler_free(compile_grammar(model, gbnf_for(fmt)))


def grammar_takes(model: LoadedModel, fmt: GrammarFormat, tokens: list[int]) -> bool:
    """Whether the grammar of `fmt` accepts `tokens` one after another (a resumed job's delivered
    text, tokenized again: its tokens may split the text otherwise than the ones sampled). Each is
    checked before it is accepted: llama.cpp aborts the process on a token its grammar refuses."""
    grammar = compile_grammar(model, gbnf_for(fmt))
    try:
        for tok in tokens:
            if model.is_eog(tok) or not grammar_allows(grammar, tok):
                return False
            ll.llama_sampler_accept(grammar, tok)
        return True
    finally:
        ll.llama_sampler_free(grammar)


def check_logit_bias(model: LoadedModel, s: Sampling) -> None:
    """Fail a job at admission whose logit_bias names a token the model does not have."""
    if s.logit_bias and s.logit_bias[-1][0] >= model.n_vocab:  # sorted by token id
        raise JobRejected(f"logit_bias: token {s.logit_bias[-1][0]} is not in this model's vocabulary "
                          f"({model.n_vocab:,} tokens)")


def bias_arrays(s: Sampling) -> tuple[np.ndarray, np.ndarray] | None:
    """A job's logit_bias as token ids and the float32 values added to their logits (-100: -inf,
    a ban whatever the other logits are); None without one."""
    if not s.logit_bias:
        return None
    ids = np.asarray([tok for tok, _ in s.logit_bias], dtype=np.intp)
    values = np.asarray([-np.inf if b <= LOGIT_BIAS_BAN else b for _, b in s.logit_bias], dtype=np.float32)
    return ids, values


def grammar_allows(grammar: ll.llama_sampler_p, tok: int) -> bool:
    """The grammar's verdict on one token, without accepting it."""
    one = ll.llama_token_data(ll.llama_token(tok), 1.0, 0.0)
    array = ll.llama_token_data_array(ctypes.pointer(one), 1, -1, False)
    ll.llama_sampler_apply(grammar, ctypes.byref(array))
    return bool(one.logit != -math.inf)


# -- one sequence ----------------------------------------------------------------------------------


class SequenceSampler:
    def __init__(self, model: LoadedModel, s: Sampling, prompt: list[int],
                 candidates: Candidates | None, top: TopCandidates | None = None, resumed: int = 0,
                 thought: tuple[str, str] | None = None) -> None:
        self.model = model
        self.chain = sampler_chain(s, model.n_vocab)
        if s.has_penalties():  # like llama-server: the prompt's tokens count towards the penalties
            for tok in prompt[-PENALTY_LAST_N:]:
                ll.llama_sampler_accept(self.chain, tok)
        self.grammar: ll.llama_sampler_p | None = None
        self.candidates = candidates
        # a lazy grammar (the model's own calls) lets text through until a call's trigger: it is
        # never "whole" before, and ends by the model's end of generation, which it allows after
        self.lazy = s.format is None and s.dialect is not None and s.dialect.lazy
        if s.constrained():
            assert candidates is not None
            self.grammar = (compile_grammar(model, gbnf_for(s.format)) if s.format is not None
                            else compile_dialect(model, s.dialect))
            self._one = ll.llama_token_data(0, 1.0, 0.0)
            self._one_array = ll.llama_token_data_array(ctypes.pointer(self._one), 1, -1, False)
        # a lazy grammar whose trigger Python sees (lazy_trigger.py): until it fires, a pick is
        # the chain's alone (the grammar's apply() changes nothing yet), so the job may draft
        self.watch = (TriggerWatch(s.dialect.triggers, lambda t: model.piece(t, control=True))
                      if self.lazy and self.grammar is not None and s.dialect is not None
                      and mirrors(s.dialect.triggers) else None)
        if self.grammar is not None:
            for tok in prompt[len(prompt) - resumed:] if resumed else ():  # checked by grammar_takes
                ll.llama_sampler_accept(self.grammar, tok)
                if self.watch is not None:
                    self.watch.accept(tok)
        self.top_logprobs = s.top_logprobs
        self.keeps = chain_keeps(s)
        # with penalties the chain remembers what it accepts, so it may only see the final pick;
        # without, accepting is a no-op and the first pick can be made in C (llama_sampler_sample)
        self.remembers = s.has_penalties()
        self.logprobs: list[dict[str, Any]] = []  # one entry per sampled token, when asked
        self.grammar_complete = False  # the grammar's text is whole: nothing but whitespace may follow
        self.rejections = 0  # picks the grammar refused (each one cost a full-vocabulary filter)
        self.greedy = s.temperature <= 0 and not s.has_penalties()  # the chain is one greedy sampler
        self.greedy_alone = self.greedy and s.is_plain()
        self.top = top if self.keeps is not None and self.keeps > 1 else None  # the chain starts with top-k
        # min_tokens / ignore_eos: the end-of-generation tokens' logits are set to -inf in the row
        # itself (what llama-server's logit bias does), before any path reads it, while fewer than
        # `eog_banned_for` tokens were sampled; jobs that ask for neither pay one test per token
        self.eog_ids = np.asarray(model.eog_ids, dtype=np.intp) if s.bans_eog() else None
        self.eog_banned_for = math.inf if s.ignore_eos else s.min_tokens
        self.sampled = resumed  # a resumed job's delivered tokens count
        # logit_bias is added to the row itself for the same reason: every path sees it (the
        # greedy argmax, TopCandidates, chains, grammars, drafts, logprobs)
        self.bias = bias_arrays(s)
        # a thought held to its budget (thought_budget.py; `thought`: the template's markers)
        self.budget = thought_budget(model, s.reasoning_budget, thought, prompt, resumed)

    def sample(self, ctx: ll.llama_context_p, row: int) -> int:
        if self.bias is not None:
            self._logits(ctx, row)[self.bias[0]] += self.bias[1]
        if self.eog_ids is not None:
            self._ban_eog(ctx, row)
        if (forced := self._forced()) is not None:
            tok = self._take(forced)
        elif self.greedy_alone:
            # llama_sampler_sample would first copy all 262k logits into candidate structs
            # (~0.35 ms per sequence); greedy takes the first maximum, as np.argmax does
            tok = int(self._logits(ctx, row).argmax())
        elif self.grammar is None:
            tok = self._sample_top(ctx, row)
        elif self.grammar_waits:
            tok = self._sample_waiting(ctx, row)
        else:
            tok = self._sample_constrained(ctx, row)
        if self.top_logprobs is not None:
            self.logprobs.append(self._logprob_entry(self._logits(ctx, row), tok))
        if self.budget is not None:
            self.budget.accept(tok)
        return tok

    def _forced(self) -> int | None:
        """The thought's end marker's next token once its budget is spent; a grammar that would
        refuse it (a call begun inside the thought) keeps its say, and the budget gives way."""
        tok = self.budget.forced() if self.budget is not None else None
        if tok is not None and self.grammar is not None and not self.grammar_waits \
                and not self._grammar_allows(tok):
            assert self.budget is not None
            self.budget.give_up()
            return None
        return tok

    def _take(self, tok: int) -> int:
        """A forced token, taken as if sampled: the chain (penalties) and the grammar see it."""
        ll.llama_sampler_accept(self.chain, tok)
        if self.grammar is not None:
            self._into_grammar(tok)
        return tok

    def _ban_eog(self, ctx: ll.llama_context_p, row: int) -> None:
        """Mask the end-of-generation tokens in this row (every row sampled is one more token of
        the job: a draft row is sampled only while the draft held), or stop masking for good."""
        if self.sampled >= self.eog_banned_for:
            self.eog_ids = None
            return
        self._logits(ctx, row)[self.eog_ids] = -np.inf
        self.sampled += 1

    def _logits(self, ctx: ll.llama_context_p, row: int) -> np.ndarray:
        return np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, row), shape=(self.model.n_vocab,))

    def _sample_top(self, ctx: ll.llama_context_p, row: int) -> int:
        """What llama_sampler_sample picks, from the tokens near the best logit (TopCandidates)."""
        top = self.top
        if top is not None and self.keeps is not None:
            cur = top.fill(self._logits(ctx, row), self.keeps)
            if cur is not None:
                ll.llama_sampler_apply(self.chain, ctypes.byref(cur))
                tok = top.selected()
                ll.llama_sampler_accept(self.chain, tok)  # as llama_sampler_sample does (penalties)
                return tok
        return int(ll.llama_sampler_sample(self.chain, ctx, row))

    @property
    def grammar_waits(self) -> bool:
        """A lazy grammar still waits for its trigger, and Python sees when it fires."""
        return self.watch is not None and not self.watch.fired

    def _sample_waiting(self, ctx: ll.llama_context_p, row: int) -> int:
        """The chain's pick, as a job without a grammar makes it, accepted into the grammar (which
        scans for its trigger). Should llama.cpp fire where the watch did not, the grammar now
        refuses an end of generation (mid-call): the watch gives way, and the grammar is checked."""
        tok = int(self._logits(ctx, row).argmax()) if self.greedy else self._sample_top(ctx, row)
        self._into_grammar(tok)
        return tok

    def _sample_constrained(self, ctx: ll.llama_context_p, row: int) -> int:
        assert self.grammar is not None and self.candidates is not None
        if self.remembers:
            cur = self.candidates.fill(self._logits(ctx, row))
            ll.llama_sampler_apply(self.chain, ctypes.byref(cur))
            tok, _ = self.candidates.selected()
        else:
            tok = int(ll.llama_sampler_sample(self.chain, ctx, row))
        if not self._grammar_allows(tok):
            self.rejections += 1
            tok, logit = self._resample(self._logits(ctx, row))
            if logit == -math.inf:  # accepting a token the grammar refuses would abort llama.cpp
                raise JobRejected("the grammar allows no further token")
        if self.remembers:
            ll.llama_sampler_accept(self.chain, tok)
        self._into_grammar(tok)
        return tok

    def _into_grammar(self, tok: int) -> None:
        """Accept a pick into the grammar (an end of generation ends the job, not the grammar);
        while a lazy grammar waits, its watch looks for the trigger in it."""
        assert self.grammar is not None
        if self.model.is_eog(tok):
            return
        watch = self.watch
        waited = watch is not None and not watch.fired
        ll.llama_sampler_accept(self.grammar, tok)
        if watch is None or not waited:
            self.grammar_complete = not self.lazy and self._whole(tok)
        elif not watch.accept(tok) and not self._grammar_allows(self.model.eog_token):
            log.warning("a lazy grammar fired where its trigger watch did not; drafts stop")
            watch.fired = True

    def _resample(self, logits: np.ndarray) -> tuple[int, float]:
        """Sample from the candidates the grammar allows (the picked one was refused)."""
        assert self.grammar is not None and self.candidates is not None
        if self.keeps is not None:
            cur = self.candidates.fill_best(logits, SHORTLIST)
            ll.llama_sampler_apply(self.grammar, ctypes.byref(cur))
            if self.candidates.passing() >= self.keeps:  # the chain's choice lies in the shortlist
                ll.llama_sampler_apply(self.chain, ctypes.byref(cur))
                return self.candidates.selected()
        cur = self.candidates.fill(logits)
        ll.llama_sampler_apply(self.grammar, ctypes.byref(cur))
        ll.llama_sampler_apply(self.chain, ctypes.byref(cur))
        return self.candidates.selected()

    def _grammar_allows(self, tok: int) -> bool:
        assert self.grammar is not None
        self._one.id = ll.llama_token(tok)
        self._one.logit = 1.0
        self._one_array.selected = -1
        ll.llama_sampler_apply(self.grammar, ctypes.byref(self._one_array))
        return bool(self._one.logit != -math.inf)

    def _whole(self, tok: int) -> bool:
        """The grammar may end here (it accepts end-of-generation) and the text cannot grow into a
        longer value: JSON's only open-ended ending is a number ("12" may become "123")."""
        tail = self.model.piece(tok).rstrip()
        if tail and tail[-1:].isdigit():
            return False
        return self._grammar_allows(self.model.eog_token)

    def _logprob_entry(self, logits: np.ndarray, tok: int) -> dict[str, Any]:
        """OpenAI's chat shape: {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}."""
        row = logits.astype(np.float64)
        top = float(row.max())
        log_z = top + math.log(float(np.exp(row - top).sum()))
        entry = self._token_entry(tok, float(row[tok]) - log_z)
        alts: list[dict[str, Any]] = []
        k = self.top_logprobs or 0
        if k > 0:
            best = np.argpartition(row, -k)[-k:]
            best = best[np.argsort(-row[best], kind="stable")]
            alts = [self._token_entry(int(t), float(row[t]) - log_z) for t in best]
        return {**entry, "top_logprobs": alts}

    def _token_entry(self, tok: int, logprob: float) -> dict[str, Any]:
        piece = self.model.piece(tok)
        return {"token": piece.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(piece)}

    def close(self) -> None:
        ll.llama_sampler_free(self.chain)
        if self.grammar is not None:
            ll.llama_sampler_free(self.grammar)
            self.grammar = None
