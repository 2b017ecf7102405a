"""What one soak run is: its seed and length, the engine, the fleet's shape, the tenants and the
one worker-config.json every worker and gateway of the run reads.

The tenants between them use every limit and weight the gateway knows (docs/tenants.md), so that
traffic meets each of them: a tenant with a concurrency cap, one capped to low priority with
rate limits, one with a model allow-list, a queue cap of 2 beside a concurrency cap of 4, and
the default tenant (the flat `api_keys`). Limits are loose enough that most requests pass and
tight enough that 429s happen.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from backends.model import default_model_path

Backend = Literal["fake", "llama-cpp"]

DEFAULT_KEY = "soak-default-key"
ADMIN_KEY = "soak-admin-key"
MODEL = "llm"  # the pool's own name
OTHER_MODEL = "other"  # a second name for the same pool: outside the `trial` tenant's allow-list
# on the real model, two more catalogue models that no request may get past a 4xx: the embedded
# model behind a chat template that runs away on longer chats, and a file cut short
HOSTILE_MODEL = "hostile"
BROKEN_MODEL = "broken"
# renders a plain chat (the load-time probes pass), then builds strings without end once a chat
# has three messages: without a render budget it holds a worker's loop for hours
HOSTILE_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}"
    "{% if messages | length > 2 %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{{ ''.ljust(100000)[:0] }}{% endfor %}{% endfor %}{% endif %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

TENANTS: dict[str, dict[str, Any]] = {
    "search": {"api_keys": ["soak-search-key"], "weight": 3, "max_concurrent": 10},
    "nightly": {"api_keys": ["soak-nightly-key"], "weight": 1, "max_priority": "low",
                "requests_per_minute": 240, "tokens_per_minute": 60000},
    "trial": {"api_keys": ["soak-trial-key"], "models": [MODEL], "requests_per_minute": 90,
              "tokens_per_minute": 20000, "max_queued": 3},
    "bots": {"api_keys": ["soak-bots-key"], "weight": 2, "max_concurrent": 4, "max_queued": 2},
}
DEFAULT_TENANT = "default"


def tenant_key(tenant: str) -> str:
    return DEFAULT_KEY if tenant == DEFAULT_TENANT else str(TENANTS[tenant]["api_keys"][0])


def named_tenants() -> list[str]:
    return sorted(TENANTS)


@dataclass(frozen=True)
class SoakPlan:
    seed: int = 1
    duration: float = 120.0  # seconds of traffic and faults
    backend: Backend = "fake"
    run_dir: Path = Path("soak-run")
    workers: int = 2
    gateways: int = 2
    clients: int = 6
    slots: int = 8  # low-priority jobs get slots beside interactive ones (worker/claiming/priority.py)
    faults: tuple[str, ...] = ()  # kinds to inject; empty: every kind of the phase (faults.KINDS)
    sentinel: bool = False  # a second phase on a Sentinel-managed Redis with a failover
    sentinel_duration: float = 90.0
    quiet_timeout: float = 120.0  # seconds the fleet may take to drain once traffic stops
    heartbeat_interval: float = 1.0
    # gateway 0's request_timeout; gateway 1 answers 504 sooner (the timeout path). None: by
    # backend (the real model on a small box is slower by far)
    request_timeout: float | None = None
    short_request_timeout: float | None = None
    drain_grace: float = 3.0  # a SIGTERMed worker hands back what runs past this

    @property
    def fake(self) -> bool:
        return self.backend == "fake"

    @property
    def long_timeout(self) -> float:
        return self.request_timeout or (60.0 if self.fake else 120.0)

    @property
    def short_timeout(self) -> float:
        return self.short_request_timeout or (8.0 if self.fake else 20.0)

    @property
    def heartbeat_ttl(self) -> float:
        return 3 * self.heartbeat_interval

    @property
    def job_timeout(self) -> int:
        return 300 if self.fake else 600

    @property
    def result_ttl(self) -> int:
        """Every record of the run must outlive the checks at its end."""
        return int(self.duration + self.sentinel_duration + 3 * 3600)

    @property
    def client_deadline(self) -> float:
        """A client still waiting this long after sending has hung: every gateway answers (a
        result, an error or its request_timeout's 504) well before."""
        return self.long_timeout + 45.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["run_dir"] = str(self.run_dir)
        return out


@dataclass
class FleetConfig:
    """The run's worker-config.json: one file for workers and gateways (FLEET_* overrides per
    process: its Redis URL, its name, a gateway's request_timeout)."""

    plan: SoakPlan
    redis_url: str
    path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.path = self.plan.run_dir / "worker-config.json"

    def backend(self) -> dict[str, Any]:
        if self.plan.fake:
            # 0.05 s a step: a 100-word job runs ~5 s, long enough to be caught mid-stream
            return {"type": "fake", "slots": self.plan.slots, "step_delay": 0.05}
        # one thread each: two workers on a small box share its cores instead of fighting for them
        return {"type": "llama-cpp", "slots": self.plan.slots, "threads": 1, "n_ctx_per_seq": 1024,
                "n_batch": 256, "prefix_cache": 2, "embed_n_ctx": 256, "embed_batch": 8,
                # the host's KV store, shared by the run's workers: restores across kills and tenants
                "kv_store": {"path": str(self.plan.run_dir / "kv-store"), "min_tokens": 16},
                "sampling": {"max_tokens": 32, "temperature": 0.7}}

    @property
    def hostile_template(self) -> Path:
        return self.plan.run_dir / "hostile.jinja"

    @property
    def broken_model(self) -> Path:
        return self.plan.run_dir / "broken.gguf"

    def catalogue(self) -> dict[str, Any]:
        """The real model's catalogue: the pool's own model pinned (it serves as the one-model
        worker did), the hostile-template and broken-file models loaded when asked for."""
        if self.plan.fake:
            return {}
        path = str(default_model_path())
        return {MODEL: {"path": path, "pinned": True},
                HOSTILE_MODEL: {"path": path, "chat_template_file": str(self.hostile_template),
                                "keep_alive": 60},
                BROKEN_MODEL: {"path": str(self.broken_model)}}

    def settings(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "redis_url": self.redis_url,
            "pool": MODEL,
            "job_timeout": plan.job_timeout,
            "result_ttl": plan.result_ttl,
            "heartbeat_interval": plan.heartbeat_interval,
            "drain_grace": plan.drain_grace,
            "placement": True,
            "backend": self.backend(),
            "models": self.catalogue(),
            "gateway": {
                "api_keys": [DEFAULT_KEY],
                "admin_keys": [ADMIN_KEY],
                "tenants": TENANTS,
                "models": {MODEL: MODEL, OTHER_MODEL: MODEL},
                "request_timeout": plan.long_timeout,
                "max_queue": 400,
                "max_tokens": 512,
            },
        }

    def write(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.plan.fake:
            self.hostile_template.write_text(HOSTILE_TEMPLATE)
            with default_model_path().open("rb") as f:  # the header and a little: its tensors are cut
                self.broken_model.write_bytes(f.read(1 << 20))
        self.path.write_text(json.dumps(self.settings(), indent=1) + "\n")
        return self.path
