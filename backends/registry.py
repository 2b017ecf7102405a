"""Which engine a worker runs: `BackendSettings`, the `backend` section of worker-config.json as a
union discriminated by `type`, and `make_backend`, which imports only the implementation the
settings name (so a worker on an HTTP backend never imports llama_cpp).

Each engine's section is its own settings model (only the keys that engine reads) plus `fallback`,
the engines to fail over to, in order; a `fallback` entry is a backend section too. A key of
another engine stops the worker with a message naming the key and the type (`name_the_engine`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
)
from pydantic_core import ErrorDetails, InitErrorDetails, PydanticCustomError

from backends.base import Backend
from backends.contract.settings import EngineSettings
from backends.fake import FakeSettings
from backends.http_settings import HttpSettings, LlamaServerSettings, OllamaSettings
from backends.llamacpp_settings import LlamaCppSettings

BackendType = Literal["llama-cpp", "llama-server", "ollama", "fake"]
DEFAULT_TYPE: BackendType = "llama-cpp"  # a section without `type`


class Chained(BaseModel):
    """The key every backend section has besides its engine's own."""

    fallback: list[BackendSettings] = Field(
        default_factory=list, description="backends to run a job on when this one is unreachable, in order")

    @field_validator("fallback")
    @classmethod
    def _flat(cls, chain: list[EngineSettings]) -> list[EngineSettings]:
        if any(isinstance(entry, Chained) and entry.fallback for entry in chain):
            # one chain, tried in order: a nested list would have no order against the outer one
            raise ValueError("a fallback entry has no fallback of its own: list every backend in "
                             "the top-level backend.fallback")
        return chain


class LlamaCppSection(LlamaCppSettings, Chained):
    """`backend.type: llama-cpp` (the default)."""


class LlamaServerSection(LlamaServerSettings, Chained):
    """`backend.type: llama-server`."""


class OllamaSection(OllamaSettings, Chained):
    """`backend.type: ollama`."""


class FakeSection(FakeSettings, Chained):
    """`backend.type: fake` (tests)."""


SECTIONS: dict[str, type[EngineSettings]] = {
    "llama-cpp": LlamaCppSection, "llama-server": LlamaServerSection,
    "ollama": OllamaSection, "fake": FakeSection,
}
# What a section written for one engine still says when a higher-priority source switches the
# type (worker/settings.py): the keys every section has.
SHARED_KEYS = frozenset.intersection(*(frozenset(m.model_fields) for m in SECTIONS.values())) - {"type"}


def section_type(value: Any) -> Any:
    """The discriminator: a section's `type`, the default when it names none."""
    if isinstance(value, Mapping):
        return value.get("type", DEFAULT_TYPE)
    return getattr(value, "type", None)


def name_the_engine(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """Validate a section; errors say which engine refused what, at the key's own place (pydantic
    would put the union's tag in the path and say "extra inputs are not permitted")."""
    try:
        return handler(value)
    except ValidationError as e:
        errors = [_engine_error(err) for err in e.errors()]
        raise ValidationError.from_exception_data(e.title, errors) from None


def _engine_error(err: ErrorDetails) -> InitErrorDetails:
    loc, message = err["loc"], err["msg"]
    if err["type"] in ("union_tag_invalid", "union_tag_not_found") and not loc:
        types = ", ".join(SECTIONS)
        if isinstance(err["input"], Mapping):
            loc, message = ("type",), f"{err['input'].get('type')!r} is not a backend (one of {types})"
        else:
            message = f"a backend section is an object with a type (one of {types})"
    elif loc and loc[0] in SECTIONS:
        kind, loc = str(loc[0]), loc[1:]
        if err["type"] == "extra_forbidden" and len(loc) == 1:
            owners = [name for name, m in SECTIONS.items() if loc[0] in m.model_fields]
            whose = (f"only {' and '.join(owners)} {'has' if len(owners) == 1 else 'have'} it" if owners
                     else "no backend has it")
            message = f"not a setting of the {kind} backend ({whose})"
    # the message is final: a template would read braces in user input as placeholders
    return {"type": PydanticCustomError(err["type"], "{message}", {"message": message}),
            "loc": loc, "input": err["input"]}


BackendSettings = Annotated[
    Annotated[LlamaCppSection, Tag("llama-cpp")]
    | Annotated[LlamaServerSection, Tag("llama-server")]
    | Annotated[OllamaSection, Tag("ollama")]
    | Annotated[FakeSection, Tag("fake")],
    Discriminator(section_type),
    WrapValidator(name_the_engine),
]
Chained.model_rebuild()
for _section in SECTIONS.values():
    _section.model_rebuild()

_ADAPTER: TypeAdapter[BackendSettings] = TypeAdapter(BackendSettings)


def backend_settings(section: Mapping[str, Any]) -> BackendSettings:
    """A `backend` section as written in worker-config.json, validated (tests and scripts)."""
    return _ADAPTER.validate_python(section)


def make_backend(settings: EngineSettings, threads: int | None = None) -> Backend:
    """Build the engine `settings` are for. `threads` is the pinned core count.

    With a non-empty `fallback`, a FallbackBackend over [settings, *fallback]."""
    if isinstance(settings, Chained) and settings.fallback:
        return _fallback_chain(settings, settings.fallback, threads)
    if isinstance(settings, LlamaCppSettings):
        from backends.llamacpp import LlamaCppBackend

        engine = LlamaCppBackend(settings, threads=settings.threads or threads)
        if settings.overlap:
            from backends.overlap import OverlappedBackend

            return OverlappedBackend(engine)
        return engine
    if isinstance(settings, LlamaServerSettings):
        from backends.llama_server import LlamaServerBackend

        return LlamaServerBackend(settings)
    if isinstance(settings, OllamaSettings):
        from backends.ollama import OllamaBackend

        return OllamaBackend(settings)
    if isinstance(settings, FakeSettings):
        from backends.fake import FakeBackend

        return FakeBackend(settings)
    raise ValueError(f"unknown backend type {settings.type!r}")


def engine_threads(settings: EngineSettings) -> int | None:
    """The configured llama.cpp thread count; None for other engines (and by default)."""
    return settings.threads if isinstance(settings, LlamaCppSettings) else None


def _where(settings: EngineSettings) -> str:
    if isinstance(settings, HttpSettings) and settings.endpoint:
        return settings.endpoint
    if isinstance(settings, LlamaCppSettings) and settings.model_path:
        return str(settings.model_path)
    return "default"


def _fallback_chain(settings: EngineSettings, fallback: Sequence[EngineSettings],
                    threads: int | None) -> Backend:
    from backends.fallback import FallbackBackend

    chain = [settings.model_copy(update={"fallback": []}), *fallback]
    members = [(f"{s.type}@{_where(s)}", partial(make_backend, s, threads)) for s in chain]
    return FallbackBackend(members, name=">".join(s.type for s in chain))
