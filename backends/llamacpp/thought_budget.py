"""A job's thought held to a budget (the request's `reasoning_budget`; Anthropic's
`thinking.budget_tokens`): once the thought has had that many tokens, the template's end-of-thought
marker is fed to the model as if sampled, and the answer goes on after it.

What llama-server does (common/reasoning-budget.cpp in the llama.cpp vendored here; the server's
`reasoning_budget_tokens`, -1 for no limit): a sampler in the chain counts the tokens after the
start tag, and when the budget is spent (and the last token ended a UTF-8 character) it masks
every logit but the next forced token's, the end tag (after an optional message) one token per
step. Here the same, with these differences:

- the thought is where the answer's reader finds it (backends/chat/reasoning.py ThoughtSplitter):
  opened by the prompt (the template ended its generation prompt inside one) or at the output's
  start, after whitespace, and ended by the first close marker; matched on text, not on the
  tokenizer's token ids for the tags, since a model may spell a marker in other tokens. One thought
  per answer, as the reader reads one (llama.cpp counts again at every start tag);
- the forced text is what the close marker still lacks: a thought whose tail already spells its
  start ("</") gets the rest ("think>"), so the text holds one marker, not "</</think>";
- a forced token replaces the pick (the row is not masked): penalties, grammar and logprobs see
  it as if sampled, its logprob the model's own. A grammar that would refuse it (a call's grammar
  started inside the thought) keeps its say: the budget gives way;
- budget 0 turns thinking off: the engine renders the template with enable_thinking false (where
  the template reads it), and a thought the prompt opens anyway is closed at once;
- gpt-oss's thought is its analysis message (`<|channel|>analysis<|message|>` up to `<|end|>`,
  tool_syntax.GPT_OSS.analysis): the budget ends it with `<|end|>`; under a required call's
  grammar the call's header follows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from backends.chat.reasoning import partial_suffix
from backends.contract.schema import GenerateRequest

if TYPE_CHECKING:
    from backends.llamacpp.model import LoadedModel

START, INSIDE, FORCING, DONE = range(4)
PROMPT_TAIL = 4  # prompt tokens read for a thought the template opened ("<think>\n")


def thinking_off(request: GenerateRequest) -> GenerateRequest:
    """A budget of 0: the template's enable_thinking false, whatever the request's kwargs say."""
    if request.reasoning_budget != 0:
        return request
    kwargs = {**(request.chat_template_kwargs or {}), "enable_thinking": False}
    return request.model_copy(update={"chat_template_kwargs": kwargs})


def _whole_utf8(data: bytes) -> bool:
    """No UTF-8 character cut short at the end of `data`."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return True
        if byte >= 0xC0:  # a lead byte: its character needs 2, 3 or 4 bytes
            return back >= (2 if byte < 0xE0 else 3 if byte < 0xF0 else 4)
    return True


class ThoughtBudget:
    """One job's thought and its budget, fed every token the job takes (sampled or forced)."""

    __slots__ = ("_budget", "_close", "_forced", "_open", "_piece", "_state", "_tail", "_tokenize",
                 "thought_tokens")

    def __init__(self, budget: int, markers: tuple[str, str], inside: bool,
                 tokenize: Callable[[str], list[int]], piece: Callable[[int], bytes]) -> None:
        self._budget = budget
        self._open, self._close = markers[0].encode(), markers[1].encode()
        self._tokenize = tokenize  # text -> tokens, control tokens' text as those tokens
        self._piece = piece  # token -> its text, control tokens rendered
        self._tail = b""  # before the thought: the output so far; inside: the thought's last bytes
        self._forced: list[int] = []
        self._state = START
        self.thought_tokens = 0  # tokens after the opener, up to the close (forced ones not counted)
        if inside:
            self._enter()

    def forced(self) -> int | None:
        """The token to feed now instead of sampling one (None: sample)."""
        return self._forced[0] if self._state == FORCING else None

    def give_up(self) -> None:
        """Something else decides the next token (a grammar refused the forced one)."""
        self._state, self._forced = DONE, []

    def accept(self, token: int) -> None:
        if self._state == DONE:
            return
        if self._state == FORCING:
            if token != self._forced.pop(0):  # not what was forced (a resumed job's own text)
                self.give_up()
            elif not self._forced:
                self._state = DONE
            return
        text = self._tail + self._piece(token)
        if self._state == START:
            body = text.lstrip()
            if body.startswith(self._open):
                self._tail = body[len(self._open):]
                self._enter()
            elif self._open.startswith(body):  # whitespace, or the opener's start: wait
                self._tail = text
            else:
                self._state = DONE  # the answer starts without a thought
            return
        self.thought_tokens += 1
        self._inside(text)

    def _enter(self) -> None:
        self._state = INSIDE
        self._inside(self._tail)

    def _inside(self, text: bytes) -> None:
        if self._close in text:
            self._state = DONE  # the model ended it
            return
        self._tail = text[-(len(self._close) + 8):]
        if self.thought_tokens >= self._budget and _whole_utf8(self._tail):
            close = self._close.decode()
            have = partial_suffix(self._tail.decode("utf-8", errors="replace"), [close])
            self._forced = self._tokenize(close[have:])
            self._state = FORCING if self._forced else DONE


def thought_budget(model: LoadedModel, budget: int | None, markers: tuple[str, str] | None,
                   prompt: list[int], resumed: int) -> ThoughtBudget | None:
    """The budget of a job whose model thinks between `markers` (None: no budget to hold).
    `prompt`'s last `resumed` tokens are a dead attempt's output, taken as the job's own."""
    if budget is None or markers is None:
        return None
    own = prompt[: len(prompt) - resumed]
    tail = b"".join(model.piece(t, control=True) for t in own[-PROMPT_TAIL:])
    opened = tail.decode("utf-8", errors="replace").rstrip().endswith(markers[0])
    thought = ThoughtBudget(budget, markers, opened,
                            lambda text: model.tokenize(text, special=True, add_special=False),
                            lambda t: model.piece(t, control=True))
    for tok in prompt[len(prompt) - resumed:] if resumed else ():
        thought.accept(tok)
    return thought
