"""The gateway's settings: a `gateway` section next to the fleet's own settings, from the same
worker-config.json and FLEET_* environment (FLEET_GATEWAY__PORT=8080,
FLEET_GATEWAY__API_KEYS='["key-1"]', FLEET_GATEWAY__MODELS='{"gemma-3-270m": "llm"}').

    {"redis_url": "redis://10.0.0.5:6379/0",
     "gateway": {"port": 8000, "max_queue": 500, "api_keys": ["..."],
                 "models": {"gemma-3-270m": "llm", "big": "big-pool"}}}

The section's model is in the contract because one file configures the whole fleet: the gateway
(dispatcher/gateway/settings.py `ServeSettings`) reads it and the worker (worker/settings.py)
checks it at start, and neither side may import the other.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from backends.contract.rerank import MAX_RERANK_DOCUMENTS
from backends.contract.schema import MAX_TOKENS_LIMIT, TENANT_PATTERN, Priority

POOL_PATTERN = r"^[A-Za-z0-9_.-]+$"


def shown_name(name: str) -> str:
    return name.encode("utf-8", "backslashreplace").decode()[:80]
MIB = 1024 * 1024


class BudgetSettings(BaseModel):
    """Tokens (prompt + completion) a tenant may spend over a period (docs/tenants.md, "Budgets")."""

    model_config = ConfigDict(extra="forbid")

    tokens: int = Field(ge=1, description="prompt + completion tokens of the tenant's ended jobs in the "
                        "period")
    period: Literal["day", "week", "month"] = Field("month", description="calendar: this UTC day, ISO "
                                                    "week (from Monday) or month; rolling: the last 1, 7 "
                                                    "or 30 days")
    rolling: bool = Field(False, description="the last N days (day 1, week 7, month 30) instead of the "
                          "calendar period, which resets at its start (00:00 UTC)")
    hard: bool = Field(True, description="hard: 429 once reached, until it resets; soft: served, marked "
                       "with x-fleet-budget-* headers and counted (fleet_tenant_over_budget_requests)")

    @property
    def name(self) -> str:
        """How refusals, headers and `fleet usage` name it: 'month', 'rolling-30d'."""
        return f"rolling-{ROLLING_DAYS[self.period]}d" if self.rolling else self.period


ROLLING_DAYS = {"day": 1, "week": 7, "month": 30}  # periods.lua's, for the names


class Prices(BaseModel):
    """What a tenant's tokens cost, per 1,000, to report its spend (`fleet usage`); no effect on
    admission."""

    model_config = ConfigDict(extra="forbid")

    prompt: float = Field(0.0, ge=0, description="per 1k prompt tokens prefilled")
    cached: float = Field(0.0, ge=0, description="per 1k prompt tokens found in the KV cache")
    completion: float = Field(0.0, ge=0, description="per 1k generated tokens")

    def cost(self, prompt: int, cached: int, completion: int) -> float:
        return ((prompt - cached) * self.prompt + cached * self.cached + completion * self.completion) / 1000


class NamedKey(BaseModel):
    """One of a tenant's keys under a name, with budgets of its own besides the tenant's."""

    model_config = ConfigDict(extra="forbid")

    key: SecretStr = Field(description="a bearer key that acts as the tenant")
    budgets: list[BudgetSettings] = Field(default_factory=list, description="this key's own budgets")

    @field_validator("budgets")
    @classmethod
    def _one_per_period(cls, v: list[BudgetSettings]) -> list[BudgetSettings]:
        return one_budget_per_period(v)


def one_budget_per_period(budgets: list[BudgetSettings]) -> list[BudgetSettings]:
    names = [b.name for b in budgets]
    if len(set(names)) != len(names):
        raise ValueError(f"two budgets over the same period ({', '.join(names)}): keep one")
    return budgets


class TenantSettings(BaseModel):
    """One tenant of `gateway.tenants` (docs/tenants.md): its keys, its share of the workers and
    its limits; every limit is optional."""

    model_config = ConfigDict(extra="forbid")

    api_keys: list[SecretStr] = Field(default_factory=list, description="bearer keys that act as this tenant")
    weight: float = Field(1.0, gt=0, le=1000, description="share of the claims when tenants wait at one "
                          "priority (proportional)")
    requests_per_minute: int | None = Field(None, ge=1, description="jobs admitted per minute; 429 beyond")
    tokens_per_minute: int | None = Field(None, ge=1, description="prompt + completion tokens per minute, "
                                          "counted as jobs end; 429 once reached")
    max_concurrent: int | None = Field(None, ge=1, description="jobs admitted and not ended (waiting or "
                                       "running), across gateways; 429 beyond")
    max_queued: int | None = Field(None, ge=0, description="jobs admitted and not started; 429 beyond")
    max_priority: Priority = Field("high", description="highest X-Fleet-Priority the tenant may ask; a "
                                   "higher one is lowered to it")
    models: list[str] | None = Field(None, description="models the tenant may use; None: all")
    max_batch_lines: int | None = Field(None, ge=0, description="batch lines not ended yet across the "
                                        "tenant's open batches (a batch's own quota); 0: no batches; "
                                        "unset: no cap for a tenant without limits, 0 for one with any")
    budgets: list[BudgetSettings] = Field(default_factory=list, description="token budgets over days, "
                                          "weeks or months, hard (429) or soft (marked)")
    prices: Prices | None = Field(None, description="per 1k prompt / cached / completion tokens: the "
                                  "spend `fleet usage` reports")

    keys: dict[str, NamedKey] = Field(default_factory=dict, description="key name -> a key that acts "
                                      "as the tenant, with budgets of its own")

    @field_validator("budgets")
    @classmethod
    def _one_budget_per_period(cls, v: list[BudgetSettings]) -> list[BudgetSettings]:
        return one_budget_per_period(v)

    @field_validator("keys")
    @classmethod
    def _key_names(cls, v: dict[str, NamedKey]) -> dict[str, NamedKey]:
        for name in v:
            if not re.match(TENANT_PATTERN, name):
                raise ValueError(f"key name {shown_name(name)!r}: 1..64 of A-Z a-z 0-9 _ . -")
        return v

    def all_keys(self) -> list[tuple[SecretStr, str | None]]:
        """Every key that acts as the tenant, and its name (None: an unnamed `api_keys` one)."""
        return [(k, None) for k in self.api_keys] + [(k.key, name) for name, k in self.keys.items()]

    def batch_lines_cap(self) -> int | None:
        """What the tenant's open batches may hold (None: no cap of its own). Batch lines do not
        pass the interactive limits (a batch is admitted whole, its lines run over hours), so a
        tenant an operator limited runs no batches until it is given a batch quota."""
        if self.max_batch_lines is not None:
            return self.max_batch_lines
        limited = (self.requests_per_minute, self.tokens_per_minute, self.max_concurrent, self.max_queued)
        return 0 if any(v is not None for v in limited) else None


class FairTokens(BaseModel):
    """What a token of service weighs in the tenants' fair share (docs/tenants.md, "Fair share at
    the claim"): on CPU prefill is most of a job's cost per job, decode most per token."""

    model_config = ConfigDict(extra="forbid")

    prompt: float = Field(1.0, ge=0, le=1000, description="a prompt token the engine prefilled")
    generated: float = Field(2.0, ge=0, le=1000, description="a generated token (one decode step each, "
                             "where prefill does a batch of prompt tokens per step)")
    cached: float = Field(0.1, ge=0, le=1000, description="a prompt token found in the KV cache (not "
                          "prefilled: it costs memory, not compute)")
    unsized: int = Field(256, ge=1, le=1_000_000, description="tokens charged at claim for a job whose "
                         "producer gave no size (a plain RQ producer's), until its ending corrects it")


class GatewaySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    workers: int = Field(1, ge=1, le=64, description="gateway processes (uvicorn workers)")
    max_queue: int = Field(1000, ge=0, description="jobs waiting in a pool beyond which requests get 429")
    retry_after: int = Field(1, ge=1, le=3600, description="seconds, in the Retry-After of a 429")
    api_keys: list[SecretStr] = Field(default_factory=list,
                                      description="accepted bearer keys of the default tenant; with "
                                      "no keys anywhere: no authentication")
    tenants: dict[str, TenantSettings] = Field(default_factory=dict,
                                               description="tenant name -> its keys, weight and limits")
    admin_keys: list[SecretStr] = Field(default_factory=list, description="operators' keys: the "
                                        "dashboard, metrics and every tenant's data")
    fair_tokens: FairTokens = Field(default_factory=FairTokens,
                                    description="weights of prompt, generated and cached tokens in the "
                                    "tenants' fair share at the claim")
    models: dict[str, str] = Field(default_factory=dict,
                                   description="model name -> pool: names added to the served ones "
                                   "(the fleet's pool by its name, or the catalogue's models): aliases, "
                                   "other pools")
    request_timeout: float = Field(900.0, gt=0, description="seconds a request waits for its jobs")
    cold_start_wait: float = Field(0.0, ge=0, description="seconds a request for a catalogue model that "
                                   "no live worker serves waits in its queue for one to start (scale "
                                   "from zero: `fleet up`, KEDA) before a 503 says none came; 0: 503 at once")
    shutdown_grace: float = Field(10.0, ge=0, description="seconds open requests get at shutdown")
    # what the gateway refuses (docs/gateway.md): bounds an unauthenticated client cannot exceed
    max_body_bytes: int = Field(8 * MIB, ge=1024, description="largest request body (JSON routes); 413")
    max_upload_bytes: int = Field(65 * MIB, ge=1024, description="largest request body of POST /v1/files "
                                  "(multipart, the whole body); 413")
    max_json_depth: int = Field(64, ge=2, le=500, description="deepest nesting of a JSON body; 400")
    body_timeout: float = Field(60.0, gt=0, description="seconds a request body may take to arrive; 408")
    body_min_rate: int = Field(1024, ge=0, description="bytes/s a body must average after its first 5 s "
                               "(a trickling client holds a connection for nothing); 408; 0: no floor")
    header_timeout: float = Field(10.0, gt=0, description="seconds a request head (request line and "
                                  "headers) may take to arrive; the connection closes")
    max_header_bytes: int = Field(64 * 1024, ge=4096, description="largest request head; 431 and the "
                                  "connection closes")
    max_connections: int = Field(2048, ge=1, description="open connections and requests (uvicorn "
                                 "limit_concurrency); 503 beyond")
    keep_alive_timeout: float = Field(5.0, gt=0, description="seconds an idle kept-alive connection stays")
    rerank_max_documents: int = Field(1000, ge=1, le=MAX_RERANK_DOCUMENTS,
                                      description="documents one rerank request may hold; 400 beyond")
    max_n: int = Field(8, ge=1, le=16, description="jobs one request may start (n x prompts); 400")
    max_tokens: int = Field(4096, ge=1, le=MAX_TOKENS_LIMIT,
                            description="largest max_tokens / num_predict a request may ask; 400 "
                            "(default: the in-process engine's n_ctx_per_seq)")
    trusted_origins: list[str] = Field(default_factory=list, description="browser origins "
                                       "(scheme://host:port) that may POST/DELETE besides the gateway's own")
    # batches and files (docs/batch.md): a batch or an uploader cannot take the fleet's room
    max_batch_queue: int = Field(50_000, ge=0, description="batch lines not ended yet that a pool's open "
                                 "batches may hold; a batch that would pass it gets 429")
    max_batch_lines: int = Field(50_000, ge=1, description="lines one batch may have; 400 beyond")
    file_ttl: int = Field(86400, ge=60, le=30 * 86400, description="seconds an uploaded file is kept")
    max_file_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="largest uploaded file; 413 beyond")
    max_files: int = Field(100, ge=1, description="files one caller (API key) may keep at once; 429 beyond")
    max_file_storage: int = Field(256 * 1024 * 1024, ge=1024,
                                  description="bytes of files one caller may keep at once; 413 beyond")
    dashboard_prompts: bool = Field(False, description="the gateway's /dashboard shows prompts and job "
                                    "details to anyone who can reach it (with api_keys set, to key holders "
                                    "anyway); off: they are redacted")

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, v: dict[str, TenantSettings]) -> dict[str, TenantSettings]:
        for name in v:
            if not re.match(TENANT_PATTERN, name):
                raise ValueError(f"tenant name {shown_name(name)!r}: 1..64 of A-Z a-z 0-9 _ . -")
        return v

    @model_validator(mode="after")
    def _one_owner_per_key(self) -> GatewaySettings:
        seen: set[str] = set()
        tenants = [[k for k, _ in t.all_keys()] for t in self.tenants.values()]
        for keys in [self.api_keys, self.admin_keys, *tenants]:
            for key in keys:
                if key.get_secret_value() in seen:  # the message never shows a key
                    raise ValueError("an API key is listed twice (across api_keys, admin_keys and tenants)")
                seen.add(key.get_secret_value())
        return self

    def tenant_weights(self) -> dict[str, float]:
        """Tenant -> weight, for the workers' fair share (only those not of weight 1)."""
        return {name: t.weight for name, t in self.tenants.items() if t.weight != 1.0}

    @field_validator("models")
    @classmethod
    def _pool_names(cls, v: dict[str, str]) -> dict[str, str]:
        for model, pool in v.items():
            if not model or len(model) > 256:
                raise ValueError(f"model name {model!r} must be 1..256 characters")
            if not re.match(POOL_PATTERN, pool):
                raise ValueError(f"model {model!r}: pool {pool!r} is not a pool name")
        return v

