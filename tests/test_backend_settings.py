"""The `backend` section as a union discriminated by `type`: each engine takes only its own keys,
a key of another engine stops the worker naming the key and the engine (a real `fleet worker`
too), env overrides merge with the file's section (and switching the type leaves out the file's
keys of the old engine), and the defaults the README and docs/backends-http.md state are the
models' own."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, get_args

import pytest
from pydantic import BaseModel
from redis import Redis

from backends.fake import FakeSettings
from backends.http_settings import LlamaServerSettings, OllamaSettings
from backends.llamacpp_settings import LlamaCppSettings
from backends.registry import (
    DEFAULT_TYPE,
    SECTIONS,
    SHARED_KEYS,
    BackendType,
    FakeSection,
    LlamaCppSection,
    LlamaServerSection,
    OllamaSection,
    backend_settings,
    make_backend,
)
from dispatcher.status import workers as worker_rows
from ecosystem.planner import WorkerPlan
from ecosystem.sizing import WORKER_OVERHEAD_MIB, worker_memory_mib
from tests.harness import ROOT, start_worker
from worker.settings import SettingsError, load_settings

LLAMA_CPP_FILE = {"backend": {"type": "llama-cpp", "kv_unified": False, "n_batch": 512, "prefix_cache": 2,
                              "n_ctx_per_seq": 4096, "slots": 6, "sampling": {"max_tokens": 77}}}


@pytest.fixture(autouse=True)
def no_fleet_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only what a test sets: the runner's own FLEET_* must not leak into these settings."""
    import os

    for key in [k for k in os.environ if k.startswith("FLEET_")]:
        monkeypatch.delenv(key)


def config(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "worker-config.json"
    path.write_text(json.dumps(data))
    return path


def refusal(tmp_path: Path, backend: dict[str, Any]) -> str:
    with pytest.raises(SettingsError) as e:
        load_settings(config(tmp_path, {"backend": backend}))
    return str(e.value)


# -- one model per engine ---------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "key", "value", "owners"), [
    ("ollama", "kv_unified", True, "only llama-cpp has it"),
    ("ollama", "n_batch", 256, "only llama-cpp has it"),
    ("ollama", "model_path", "/m.gguf", "only llama-cpp has it"),
    ("llama-server", "threads", 4, "only llama-cpp has it"),
    ("llama-server", "n_ctx_per_seq", 1024, "only llama-cpp and ollama have it"),
    ("llama-server", "keep_alive", "1m", "only ollama has it"),
    ("llama-cpp", "endpoint", "http://127.0.0.1:8080", "only llama-server and ollama have it"),
    ("fake", "n_ctx", 2048, "only llama-cpp has it"),
    ("llama-cpp", "step_delay", 0.1, "only fake has it"),
    ("fake", "slotz", 2, "no backend has it"),
])
def test_a_key_of_another_engine_names_the_key_and_the_engine(tmp_path: Path, kind: str, key: str,
                                                              value: Any, owners: str) -> None:
    message = refusal(tmp_path, {"type": kind, key: value})
    assert f"backend.{key}: not a setting of the {kind} backend ({owners})" in message, message


def test_every_foreign_key_is_named_at_once_and_other_errors_keep_their_path(tmp_path: Path) -> None:
    message = refusal(tmp_path, {"type": "ollama", "kv_unified": True, "n_batch": 3, "slots": 0})
    assert "backend.kv_unified: not a setting of the ollama backend" in message
    assert "backend.n_batch: not a setting of the ollama backend" in message
    assert "backend.slots: Input should be greater than or equal to 1" in message


def test_without_type_a_section_is_llama_cpp(tmp_path: Path) -> None:
    assert DEFAULT_TYPE == "llama-cpp"
    assert isinstance(load_settings(config(tmp_path, {"backend": {"n_ctx": 2048}})).backend, LlamaCppSection)
    assert "backend.endpoint: not a setting of the llama-cpp backend" in refusal(tmp_path, {"endpoint": "x"})


def test_an_unknown_type_is_named(tmp_path: Path) -> None:
    message = refusal(tmp_path, {"type": "olama"})
    assert "backend.type: 'olama' is not a backend (one of llama-cpp, llama-server, ollama, fake)" in message


def test_each_type_builds_its_own_model(tmp_path: Path) -> None:
    for kind, model in [("llama-cpp", LlamaCppSection), ("llama-server", LlamaServerSection),
                        ("ollama", OllamaSection), ("fake", FakeSection)]:
        got = load_settings(config(tmp_path, {"backend": {"type": kind}})).backend
        assert type(got) is model and got.type == kind
    assert {"slots", "sampling", "fallback"} == SHARED_KEYS
    assert set(get_args(BackendType)) == set(SECTIONS)


def test_fallback_entries_are_sections_of_their_own_engine(tmp_path: Path) -> None:
    s = load_settings(config(tmp_path, {"backend": {
        "type": "llama-server", "endpoint": "http://127.0.0.1:1",
        "fallback": [{"type": "ollama", "model": "m"}, {"slots": 2, "n_ctx_per_seq": 512}]}}))
    primary = s.backend
    assert isinstance(primary, LlamaServerSection)
    first, second = primary.fallback
    assert isinstance(first, OllamaSection) and first.model == "m"
    assert isinstance(second, LlamaCppSection) and second.n_ctx_per_seq == 512
    foreign = {"type": "ollama", "kv_unified": True}
    message = refusal(tmp_path, {"type": "llama-server", "fallback": [foreign]})
    assert "backend.fallback.0.kv_unified: not a setting of the ollama backend" in message
    inner = {"type": "fake", "fallback": [{"type": "fake"}]}
    nested = refusal(tmp_path, {"type": "fake", "fallback": [inner]})
    assert "backend.fallback: Value error, a fallback entry has no fallback of its own" in nested


def test_make_backend_builds_the_engine_the_model_is_for() -> None:
    fake = make_backend(backend_settings({"type": "fake", "slots": 3}))
    assert fake.name == "fake" and fake.slots == 3
    chain = make_backend(backend_settings({"type": "fake", "fallback": [{"type": "fake", "slots": 5}]}))
    assert chain.name == "fake>fake"


# -- env over the file -----------------------------------------------------------------------------


def test_env_keys_merge_with_the_files_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = config(tmp_path, {"backend": {"type": "ollama", "endpoint": "http://127.0.0.1:11434"}})
    monkeypatch.setenv("FLEET_BACKEND__MODEL", "gemma3:1b")
    monkeypatch.setenv("FLEET_BACKEND__SAMPLING__MAX_TOKENS", "9")
    backend = load_settings(path).backend
    assert isinstance(backend, OllamaSection)
    assert (backend.endpoint, backend.model, backend.sampling.max_tokens) == (
        "http://127.0.0.1:11434", "gemma3:1b", 9)


def test_env_switching_the_type_leaves_out_the_files_keys_of_the_old_engine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = config(tmp_path, LLAMA_CPP_FILE)
    monkeypatch.setenv("FLEET_BACKEND__TYPE", "llama-server")
    monkeypatch.setenv("FLEET_BACKEND__ENDPOINT", "http://127.0.0.1:8080")
    backend = load_settings(path).backend
    assert isinstance(backend, LlamaServerSection) and backend.endpoint == "http://127.0.0.1:8080"
    # what every section has carries over; kv_unified, n_batch, ... were written for llama-cpp
    assert backend.slots == 6 and backend.sampling.max_tokens == 77


def test_a_switch_by_init_arguments_follows_the_same_rule(tmp_path: Path) -> None:
    path = config(tmp_path, {"backend": {"type": "ollama", "endpoint": "http://x", "keep_alive": "1m"}})
    backend = load_settings(path, backend={"type": "fake", "step_delay": 0.5}).backend
    assert isinstance(backend, FakeSection) and backend.step_delay == 0.5


def test_a_foreign_key_beside_the_type_it_contradicts_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the env names no type: its keys are for the file's engine
    path = config(tmp_path, {"backend": {"type": "ollama", "endpoint": "http://x"}})
    monkeypatch.setenv("FLEET_BACKEND__THREADS", "4")
    with pytest.raises(SettingsError, match=r"backend\.threads: not a setting of the ollama backend"):
        load_settings(path)
    # the same source switches the type and sets a key the new engine lacks
    monkeypatch.delenv("FLEET_BACKEND__THREADS")
    monkeypatch.setenv("FLEET_BACKEND__TYPE", "llama-server")
    monkeypatch.setenv("FLEET_BACKEND__KV_UNIFIED", "true")
    with pytest.raises(SettingsError, match=r"backend\.kv_unified: not a setting of the llama-server "):
        load_settings(config(tmp_path, LLAMA_CPP_FILE))


def test_env_sets_a_whole_section_or_the_fallback_list(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path = config(tmp_path, LLAMA_CPP_FILE)
    monkeypatch.setenv("FLEET_BACKEND", json.dumps({"type": "fake", "slots": 2}))
    backend = load_settings(path).backend
    assert isinstance(backend, FakeSection) and backend.slots == 2
    monkeypatch.delenv("FLEET_BACKEND")
    monkeypatch.setenv("FLEET_BACKEND__FALLBACK", json.dumps([{"type": "fake", "slots": 3}]))
    chained = load_settings(path).backend
    assert isinstance(chained, LlamaCppSection) and isinstance(chained.fallback[0], FakeSection)


# -- a real worker --------------------------------------------------------------------------------


@pytest.mark.model
def test_fleet_worker_stops_at_start_naming_the_foreign_key(redis_url: str, tmp_path: Path) -> None:
    path = config(tmp_path, {"backend": {"type": "ollama", "endpoint": "http://127.0.0.1:1",
                                         "kv_unified": True}})
    worker = start_worker(redis_url, "foreign-key", tmp_path / "logs", config=path, wait=False)
    assert worker.process.wait(timeout=60) != 0
    expected = "backend.kv_unified: not a setting of the ollama backend (only llama-cpp has it)"
    assert expected in worker.output(), worker.output()


def test_fleet_worker_switched_by_env_runs_over_a_llama_cpp_file(redis_url: str, redis: Redis,
                                                                 tmp_path: Path) -> None:
    path = config(tmp_path, LLAMA_CPP_FILE)
    worker = start_worker(redis_url, "switched", tmp_path / "logs", config=path, backend__type="fake")
    try:
        (row,) = [w for w in worker_rows(redis) if w["name"] == "switched"]
        assert row["backend"] == "fake" and int(row["slots"]) == 6  # the file's slots carried over
    finally:
        worker.stop()


# -- readers of the union -------------------------------------------------------------------------


def test_the_plan_sets_threads_only_for_llama_cpp() -> None:
    cpp = WorkerPlan("w", (0, 1), None, threads=2, slots=4)
    http = WorkerPlan("w", (0, 1), None, threads=2, slots=4, engine_threads=False)
    assert cpp.env()["FLEET_BACKEND__THREADS"] == "2"
    assert "FLEET_BACKEND__THREADS" not in http.env() and http.env()["FLEET_BACKEND__SLOTS"] == "4"


def test_memory_counts_the_in_process_engines_of_the_chain() -> None:
    http = backend_settings({"type": "llama-server", "endpoint": "http://x"})
    chained = backend_settings({"type": "llama-server", "endpoint": "http://x", "fallback": [{"slots": 2}]})
    alone = backend_settings({"slots": 2})
    assert worker_memory_mib(http) < WORKER_OVERHEAD_MIB * 1.2
    assert worker_memory_mib(chained) == worker_memory_mib(alone) > worker_memory_mib(http)


# -- documented defaults --------------------------------------------------------------------------

SCOPES = {"llama-cpp": {"llama-cpp"}, "llama-server": {"llama-server"}, "ollama": {"ollama"},
          "fake": {"fake"}, "HTTP backends": {"llama-server", "ollama"}}
SCOPE = re.compile(r"(?:^|\. )(llama-cpp|llama-server|ollama|fake|HTTP backends): ")
ROW = re.compile(r"^\| (`backend\.[^|]*) \| ([^|]*) \| ([^|]*) \|$", re.M)


def documented_value(text: str) -> Any:
    """A table's default as a value: a literal (`false`, 16, `[]`, `5m`), else None (prose such
    as "embedded model" or "pinned cores" stands for a default the code fills in)."""
    text = text.strip()
    bare = text.strip("`")
    try:
        return json.loads(bare)
    except ValueError:
        return bare if text.startswith("`") and text.endswith("`") and "`" not in bare else None


def documented_rows(doc: str) -> list[tuple[str, dict[str, Any], set[str] | None, str]]:
    """(key, default per engine ("*": all others), engines the meaning is scoped to, raw default)."""
    rows = []
    for names, default, meaning in ROW.findall((ROOT / doc).read_text()):
        main, _, special = default.partition(" (")
        defaults = {"*": documented_value(main)}
        for scope, value in re.findall(r"([\w -]+): ([^;)]+)", special):
            for engine in SCOPES[scope.strip()]:
                defaults[engine] = documented_value(value)
        claimed = [SCOPES[s] for s in SCOPE.findall(meaning)]
        scope = set().union(*claimed) if claimed else None
        for key in re.findall(r"`(?:backend\.)?(\w+)`", names):
            rows.append((key, defaults, scope, default.strip()))
    return rows


def model_default(engine: str, key: str) -> Any:
    if key == "type":
        return DEFAULT_TYPE  # a section that names no type
    field = SECTIONS[engine].model_fields[key]
    return field.get_default(call_default_factory=True)


@pytest.mark.parametrize("doc", ["README.md", "docs/backends-http.md"])
def test_documented_backend_defaults_are_the_models(doc: str) -> None:
    rows = documented_rows(doc)
    assert rows, f"{doc} lost its backend settings table"
    for key, defaults, scope, raw in rows:
        having = {name for name, m in SECTIONS.items() if key in m.model_fields}
        assert having, f"{doc}: backend.{key} is no backend's setting"
        assert scope is None or scope <= having, f"{doc}: backend.{key} is documented for {scope}"
        if doc == "README.md":
            assert (scope or set(SECTIONS)) == having, f"README: backend.{key} is a setting of {having}"
        for engine in scope or having:
            if raw == "see file":  # the shipped worker-config.json shows the defaults
                shipped = json.loads((ROOT / "worker-config.json").read_text())["backend"][key]
                default = model_default(engine, key)
                assert type(default).model_validate(shipped) == default
                continue
            want = defaults.get(engine, defaults["*"])
            got = model_default(engine, key)
            assert got == want, f"{doc}: backend.{key} for {engine}: documented {raw!r}, the model: {got!r}"


def test_the_readme_documents_every_backend_key() -> None:
    documented = {key for key, *_ in documented_rows("README.md")}
    every = {key for m in SECTIONS.values() for key in m.model_fields}
    assert every == documented


def test_engine_models_stand_alone() -> None:
    """The engines' own models (what the engine code takes) refuse foreign keys too."""
    cases: list[tuple[type[BaseModel], str]] = [
        (LlamaCppSettings, "endpoint"), (LlamaServerSettings, "n_ctx_per_seq"),
        (OllamaSettings, "threads"), (FakeSettings, "model")]
    for model, foreign in cases:
        with pytest.raises(ValueError, match=foreign):
            model.model_validate({foreign: 1})
