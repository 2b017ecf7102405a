"""What a worker tells the fleet about its model: a small JSON dict (the "model card") that its
heartbeat publishes next to its status, and the gateway answers Ollama's `/api/show` with. The
gateway host may not have the model file (a producer-only host, another machine), so the worker,
which has the model open, describes it.

The card holds Ollama's `/api/show` fields as far as the model tells them: `model_info` (the
GGUF's scalar metadata, typed), `details`, `template`, `parameters`, `capabilities`,
`modified_at`; and what Ollama's listings (`/api/tags`, `/api/ps`) show: `name` (the model's
Ollama-style name, `ollama_name`), `size` (the file's bytes), `digest` (the file's sha256, which
the worker adds once it has it: backends/model.py `file_digest`) and `context_length` (the worker's
tokens per job). No llama_cpp here: an engine hands over its metadata as text.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from backends.contract.schema import SamplingDefaults

MAX_TEXT = 16_384  # longest template a card carries (a card is written every heartbeat)
MAX_VALUE = 1_024  # longer metadata strings are left out of model_info
# llama.cpp's llama_ftype (general.file_type) -> Ollama's quantization_level
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
              11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
              17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
              23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M",
              30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4"}
# Ollama's PARAMETER names of the worker's sampling defaults
PARAMETERS = {"max_tokens": "num_predict", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
              "min_p": "min_p", "repeat_penalty": "repeat_penalty", "presence_penalty": "presence_penalty",
              "frequency_penalty": "frequency_penalty"}
NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?")


def gguf_card(metadata: dict[str, str], *, path: Path, n_params: int, template: str | None,
              defaults: SamplingDefaults, capabilities: list[str]) -> dict[str, Any]:
    """The card of a GGUF model from its metadata as llama.cpp renders it (every value text)."""
    info: dict[str, Any] = {k: typed(v) for k, v in sorted(metadata.items())
                            if k != "tokenizer.chat_template" and len(v) <= MAX_VALUE}
    info["general.parameter_count"] = n_params
    arch = str(info.get("general.architecture", ""))
    quantization = FILE_TYPES.get(info.get("general.file_type", -1), "")
    parameters = ollama_parameters(defaults)
    template = (template or "")[:MAX_TEXT]
    try:
        stat = path.stat()
        modified, size = datetime.fromtimestamp(stat.st_mtime, UTC), stat.st_size
    except OSError:
        modified, size = datetime.now(UTC), 0
    return {
        "name": ollama_name(info),
        "size": size,
        "modelfile": modelfile(path.name, template, parameters),
        "parameters": parameters,
        "template": template,
        "details": {"parent_model": "", "format": "gguf", "family": arch,
                    "families": [arch] if arch else None,
                    "parameter_size": str(info.get("general.size_label") or parameter_size(n_params)),
                    "quantization_level": quantization},
        "model_info": info,
        "license": str(info.get("general.license", "")),
        "capabilities": capabilities,
        "modified_at": modified.isoformat().replace("+00:00", "Z"),
    }


def ollama_card(show: dict[str, Any]) -> dict[str, Any]:
    """The card of a model an Ollama server describes (its /api/show answer), bounded like ours:
    large values (the vocabulary's arrays, long texts) are left out."""
    kept = ("parameters", "details", "capabilities", "modified_at")
    card: dict[str, Any] = {k: show[k] for k in kept if k in show}
    card["template"] = str(show.get("template") or "")[:MAX_TEXT]
    card["modelfile"] = str(show.get("modelfile") or "")[:MAX_TEXT]
    card["license"] = str(show.get("license") or "")[:MAX_VALUE]
    info = show.get("model_info")
    card["model_info"] = {k: v for k, v in (info if isinstance(info, dict) else {}).items()
                          if _small(v)}
    card["name"] = ollama_name(card["model_info"])
    return card


def ollama_name(info: dict[str, Any]) -> str:
    """The name Ollama's library would give the model, from its metadata: `<base>:<size>`, the
    base from `general.basename` (else `general.architecture`) in lower case with the dash before
    a version number dropped (gemma-3 -> gemma3, Llama-3.2 -> llama3.2), the tag from
    `general.size_label` (else the parameter count): the embedded gemma-3-270m is `gemma3:270m`.
    "" when the metadata names no model."""
    base = str(info.get("general.basename") or info.get("general.architecture") or "").strip().lower()
    base = re.sub(r"[\s_]+", "-", base)
    base = re.sub(r"(?<=[a-z])-(?=\d)", "", base)
    base = re.sub(r"[^a-z0-9._-]", "", base).strip("-._")[:64]
    if not base:
        return ""
    tag = re.sub(r"[^a-z0-9._-]", "", str(info.get("general.size_label") or "").lower()).strip("-._")
    count = info.get("general.parameter_count")
    if not tag and isinstance(count, int) and not isinstance(count, bool) and count > 0:
        tag = size_tag(count)
    return f"{base}:{tag[:32] or 'latest'}"


def size_tag(n_params: int) -> str:
    """A parameter count as Ollama's tags write it: 268m, 1.1b, 7b."""
    if n_params >= 1_000_000_000:
        return f"{n_params / 1e9:.1f}".removesuffix(".0") + "b"
    return f"{max(1, round(n_params / 1e6))}m"


def _small(value: object) -> bool:
    return isinstance(value, bool | int | float) or (isinstance(value, str) and len(value) <= MAX_VALUE)


def capabilities(*, completion: bool = True, thinking: bool = False) -> list[str]:
    """Ollama's capability names for what the worker serves: a generative model completes and
    calls tools (in its own syntax, or lowered to the generic format: backends/contract/tools.py),
    and thinks where its template does; "embedding" is added by the engines that embed."""
    if not completion:
        return []
    return ["completion", "tools", "thinking"] if thinking else ["completion", "tools"]


def typed(value: str) -> Any:
    """A metadata value as JSON would carry it: numbers and booleans as such, the rest text."""
    if value in ("true", "false"):
        return value == "true"
    if NUMBER.fullmatch(value):
        number = float(value)
        return int(value) if value.lstrip("-").isdigit() else number
    return value


def parameter_size(n_params: int) -> str:
    """Ollama's way of writing a parameter count: 268.10M, 7.24B."""
    if n_params >= 1_000_000_000:
        return f"{n_params / 1e9:.2f}B"
    return f"{n_params / 1e6:.2f}M"


def ollama_parameters(defaults: SamplingDefaults) -> str:
    """The worker's sampling defaults as Ollama writes a model's parameters (one `name value` a line)."""
    values = defaults.model_dump()
    return "\n".join(f"{PARAMETERS[k]:<18} {values[k]:g}" if isinstance(values[k], float)
                     else f"{PARAMETERS[k]:<18} {values[k]}" for k in PARAMETERS)


def modelfile(file_name: str, template: str, parameters: str) -> str:
    lines = ["# Modelfile of a llama-fleet worker pool's model", f"FROM {file_name}"]
    if template:
        lines.append(f'TEMPLATE """{template}"""')
    lines += [f"PARAMETER {line}" for line in parameters.splitlines()]
    return "\n".join(lines) + "\n"
