"""The GBNF grammar of a model's own tool calls (backends/chat/tool_syntax.py), as llama.cpp's
common/chat.cpp builds one per family: each call's arguments held to its tool's parameter schema
(schema_grammar.json_schema_to_gbnf, its rules renamed `t<i>-...` so the tools' grammars sit in
one), wrapped in the family's markup.

tool_choice auto: the grammar is lazy, text before a call is free; it applies from where a
trigger matches (`NativeGrammar.triggers`, llama_sampler_init_grammar_lazy_patterns' semantics:
fed from the first capture group, or from the match). `required` or a named tool: not lazy, the
answer starts with a call (a named tool: that one, once); a thinking family's grammar lets a
thought come first. A prompt that opened a thought (`thought_open`) keeps the grammar lazy until
the thought's end marker, where the calls must follow.

The triggers are literals (and llama3's anchored start): a pattern with an open repeat such as
`[\\s\\S]*?` is matched by std::regex recursively, once per character of the text, on every token:
a long answer would overflow the stack. A model that writes a call's opener inside its thought
starts the grammar there; llama.cpp's own literal triggers share that limit.

Importable only with llama_cpp (the schema converter); the syntaxes are pure Python.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from backends.chat.tool_syntax import (
    DS_BEGINS,
    DS_CALL,
    DS_END,
    DS_SEP,
    GPT_OSS,
    LLAMA3,
    ToolSyntax,
    regex_escape,
    spellings,
)
from backends.contract.tool_specs import NamedTool, Tool, ToolChoice, max_calls
from backends.llamacpp.schema_grammar import json_schema_to_gbnf

WS = "ws ::= [ \\t\\n]{0,16}"  # bounded: a model cannot idle in whitespace for ever


@dataclass(frozen=True)
class NativeGrammar:
    gbnf: str
    triggers: list[str]
    lazy: bool


def native_call_grammar(syntax: ToolSyntax, tools: list[Tool], tool_choice: ToolChoice | None,
                        parallel: bool | None, *, thought_open: bool = False,
                        thinks: bool = True) -> NativeGrammar:
    """The grammar of `syntax`'s calls of `tools` (module docstring); `thought_open`: the
    prompt ends inside a thought; `thinks`: the template thinks, so a required call may follow a
    thought (else it comes at once: a model that does not think must not wander off in one)."""
    if not tools or tool_choice == "none":
        raise ValueError("a call grammar needs tools and a tool_choice other than 'none'")
    named = tool_choice.name if isinstance(tool_choice, NamedTool) else None
    offered = [t for t in tools if named is None or t.name == named]
    if not offered:
        raise ValueError(f"tool_choice names {named!r}, which is not among the tools")
    most = 1 if syntax.one_call else max_calls(tool_choice, parallel)
    lazy = tool_choice in (None, "auto")
    rules = [WS] + [prefixed(json_schema_to_gbnf(json.dumps(t.parameters)), f"t{i}-")
                    for i, t in enumerate(offered)]
    if syntax is GPT_OSS:
        return _harmony([_without_markup(r) for r in rules], [t.name for t in offered], lazy)
    rules += [_tool_rule(syntax, i, t.name) for i, t in enumerate(offered)]
    rules.append("tool ::= " + " | ".join(f"t{i}-call" for i in range(len(offered))))
    rules.append("calls ::= " + _calls(syntax, most))
    triggers = list(syntax.triggers)
    if thought_open and syntax.thought is not None:
        # lazy until the thought ends; a required call must then come at once
        close = syntax.thought[1]
        if lazy:
            return NativeGrammar(_join([*rules, "root ::= calls"]), triggers, True)
        return NativeGrammar(_join([*rules, f"root ::= {lit(close)} ws calls"]), [regex_escape(close)], True)
    if lazy or syntax.thought is None or not thinks:
        rules.append("root ::= calls")
    else:
        opening, close = syntax.thought
        rules.append(f"thought ::= {lit(opening)} {not_containing(close)} {lit(close)} ws")
        rules.append("root ::= thought? calls")
    return NativeGrammar(_join(rules), triggers if lazy else [], lazy)


def _tool_rule(syntax: ToolSyntax, i: int, name: str) -> str:
    """`t<i>-call`: one call of the i-th tool, its name and arguments as the family writes them."""
    args = f"t{i}-root"
    if syntax.name_end:  # the name as markup, the arguments' JSON after it
        call = f"t{i}-call ::= {lit(name)} {lit(syntax.name_end)} {args}"
        # the suffix's leading whitespace is the JSON's own (DeepSeek's "\n```...")
        return f"{call} ws {marker(syntax.call_suffix.lstrip())}" if syntax.call_suffix else call
    own_id = ""
    if syntax.id_pattern is not None:  # Mistral Nemo's: nine letters or digits
        own_id = f' "," ws {lit(json.dumps("id"))} ws ":" ws "\\"" [a-zA-Z0-9]{{9}} "\\"" ws'
    key = lit(json.dumps(syntax.args_key))
    return (f't{i}-call ::= "{{" ws {lit(json.dumps("name"))} ws ":" ws {lit(json.dumps(name))} ws "," ws '
            f'{key} ws ":" ws {args} ws{own_id} "}}"')


def _calls(syntax: ToolSyntax, most: int) -> str:
    """One to `most` calls in the family's markup."""
    more = f"{{0,{most - 1}}}" if most > 1 else ""
    if syntax.name == "hermes":
        call = '( "<tool_call>" ws tool ws "</tool_call>" )'
        return f"{call} ( ws {call} ){more}" if more else call
    if syntax is LLAMA3:  # fed from its trigger: the JSON's start, or <|python_tag|>
        return f'( {lit("<|python_tag|>")} ws )? tool'
    if syntax.name == "mistral":
        rest = f' ( ws "," ws tool ){more}' if more else ""
        return f'{lit("[TOOL_CALLS]")} "[" ws tool{rest} ws "]"'
    if syntax.name == "mistral-args":
        return f'( {lit("[TOOL_CALLS]")} tool ){{1,{most}}}'
    if syntax.name == "deepseek-r1":
        opener = "( " + " | ".join(lit(b) for b in DS_BEGINS) + " )"
        call = f'( {marker(DS_CALL)}? "function" {marker(DS_SEP)} tool ws )'
        return f"{opener} ws {call}{{1,{most}}} {marker(DS_END)}"
    raise ValueError(f"no call grammar for the {syntax.name} syntax")


def _harmony(rules: list[str], names: list[str], lazy: bool) -> NativeGrammar:
    """gpt-oss: a call is a message to functions.NAME, named in its channel's header or in its
    role's, its body the arguments (its <|call|> ends generation, so the grammar ends with the
    JSON). Auto starts at `<|channel|>... to=` or `<|start|>assistant to=` (llama.cpp's
    triggers); required lets one analysis message come first (the call follows its end, so a
    reasoning budget that ends it brings the call)."""
    # the constraint's word stands apart from the name (a space or <|constrain|>), or a name the
    # tools lack would pass as an offered one and its tail as the constraint
    rules += ['channel ::= "<|channel|>" ( "commentary" | "analysis" )',
              'constraint ::= ( ( " " | " "? "<|constrain|>" ) [A-Za-z0-9_-]+ )?']
    calls = []
    for i, name in enumerate(names):  # each header names its tool: the body is that tool's
        to, body = f'" to=functions." {lit(name)}', f'constraint "<|message|>" t{i}-root'
        rules.append(f"t{i}-in-channel ::= channel {to} {body}")
        rules.append(f"t{i}-in-role ::= {to} channel {body}")
        calls += [f"t{i}-in-channel", f"t{i}-in-role"]
    rules.append("call ::= " + " | ".join(calls))
    if lazy:
        rules.append("root ::= call")
        return NativeGrammar(_join(rules), list(GPT_OSS.triggers), True)
    rules.append(f'analysis ::= "<|channel|>analysis<|message|>" {not_containing("<|end|>")} "<|end|>"')
    rules.append('root ::= ( analysis "<|start|>assistant" )? call')
    return NativeGrammar(_join(rules), [], False)


def _without_markup(gbnf: str) -> str:
    """A tool's grammar whose JSON strings never hold `<|`, which opens every harmony marker: the
    reader ends a message at its first marker, so `<|end|>` written inside an argument (the small
    model does) would cut the call short. `<` stays allowed before anything else, and last."""
    def char(m: re.Match[str]) -> str:
        escape = m.group(2)
        return f'{m.group(1)} ::= [^"\\\\<] | {escape} | "<"+ ( [^"\\\\<|] | {escape} )'

    gbnf = _CHAR.sub(char, gbnf)
    return _STRING.sub(lambda m: f'{m.group(1)} ::= "\\"" {m.group(2)}* "<"* "\\""{m.group(3)}', gbnf)


# the JSON string rules of llama.cpp's schema converter (schema_grammar.py), prefixed per tool
_CHAR = re.compile(r'^(t\d+-char) ::= \[\^"\\\\\] \| (.*)$', re.M)
_STRING = re.compile(r'^(t\d+-string) ::= "\\"" (t\d+-char)\* "\\""(.*)$', re.M)


def _join(rules: list[str]) -> str:
    return "\n".join(rules) + "\n"


def lit(text: str) -> str:
    """`text` as a GBNF literal."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return f'"{escaped}"'


def marker(text: str) -> str:
    """A marker as a GBNF literal, in each of its spellings (tool_syntax.spellings)."""
    forms = spellings(text)
    return lit(text) if len(forms) == 1 else "( " + " | ".join(lit(f) for f in forms) + " )"


def _cls(chars: str) -> str:
    return "".join("\\" + c if c in "]\\^-" else c for c in chars).replace("\n", "\\n")


def not_containing(marker: str) -> str:
    """Any text without `marker` (a thought up to its end marker): each step is a character
    other than the marker's first, or a run of the marker's start broken off by another one.
    A run broken by the marker's own first character ('<</think>') cannot end the thought there:
    it stays text, and the thought ends at the next whole marker."""
    alts = [f"[^{_cls(marker[0])}]"]
    alts += [f"{lit(marker[:k])} [^{_cls(marker[k])}]" for k in range(1, len(marker))]
    return "( " + " | ".join(alts) + " )*"


def prefixed(gbnf: str, prefix: str) -> str:
    """`gbnf` with every rule name prefixed, so several grammars combine in one; literals,
    classes, `{m,n}` counts and comments stay as they are."""
    out: list[str] = []
    i, n = 0, len(gbnf)
    while i < n:
        c = gbnf[i]
        if c in '"[':
            close, j = ('"' if c == '"' else "]"), i + 1
            while j < n and gbnf[j] != close:
                j += 2 if gbnf[j] == "\\" else 1
            out.append(gbnf[i:j + 1])
            i = j + 1
        elif c in "{#":
            j = gbnf.find("}" if c == "{" else "\n", i)
            j = n if j < 0 else j + (c == "{")
            out.append(gbnf[i:j])
            i = j
        elif c.isascii() and (c.isalnum() or c in "-_"):  # llama.cpp's rule-name characters
            j = i
            while j < n and gbnf[j].isascii() and (gbnf[j].isalnum() or gbnf[j] in "-_"):
                j += 1
            out.append(prefix + gbnf[i:j])
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)
