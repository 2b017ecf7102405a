"""The model card's pure rules (backends/model_card.py): typed metadata, Ollama's ways of writing
sizes and parameters, and the bounds that keep a card small."""

from __future__ import annotations

from pathlib import Path

from backends.contract.schema import SamplingDefaults
from backends.model_card import MAX_TEXT, gguf_card, ollama_card, parameter_size, typed


def test_metadata_values_are_typed() -> None:
    assert typed("32768") == 32768 and typed("-3") == -3 and typed("0.000001") == 1e-6
    assert typed("true") is True and typed("false") is False
    assert typed("gemma3") == "gemma3" and typed("1.2.3") == "1.2.3" and typed("270M") == "270M"
    assert parameter_size(268_098_176) == "268.10M" and parameter_size(7_241_732_096) == "7.24B"


def test_a_gguf_card(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    meta = {"general.architecture": "llama", "general.file_type": "7", "llama.context_length": "4096",
            "tokenizer.chat_template": "{% x %}", "general.long": "y" * 5000}
    card = gguf_card(meta, path=model, n_params=1_100_000_000, template="t" * (MAX_TEXT + 10),
                     defaults=SamplingDefaults(), capabilities=["completion"])
    assert card["details"] == {"parent_model": "", "format": "gguf", "family": "llama", "families": ["llama"],
                               "parameter_size": "1.10B", "quantization_level": "Q8_0"}
    info = card["model_info"]
    assert info["llama.context_length"] == 4096 and info["general.parameter_count"] == 1_100_000_000
    assert "tokenizer.chat_template" not in info and "general.long" not in info  # template apart; too long
    assert len(card["template"]) == MAX_TEXT
    assert "temperature" in card["parameters"] and "num_predict        128" in card["parameters"]
    assert card["modelfile"].splitlines()[1] == "FROM m.gguf" and str(tmp_path) not in card["modelfile"]
    assert card["modified_at"].endswith("Z")


def test_an_ollama_servers_card_is_bounded() -> None:
    show = {"template": "x" * (MAX_TEXT * 2), "details": {"family": "qwen2"},
            "capabilities": ["completion", "tools"],
            "model_info": {"general.architecture": "qwen2", "tokenizer.ggml.tokens": ["a"] * 10, "n": 3},
            "tensors": [{"name": "t"}] * 100}
    card = ollama_card(show)
    assert len(card["template"]) == MAX_TEXT and "tensors" not in card
    assert card["model_info"] == {"general.architecture": "qwen2", "n": 3}
    assert card["capabilities"] == ["completion", "tools"]
