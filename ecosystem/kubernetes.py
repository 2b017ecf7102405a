"""A plan -> Kubernetes manifests: worker Deployment, ConfigMap, Secrets (Redis, gateway keys),
gateway Deployment + Service, KEDA ScaledObject, and a helm-free kustomization.yaml
(`kubectl apply -k DIR`).

- Workers: CPU requests = limits = the planned cores per worker, memory requests = limits = the
  sizing estimate, so pods are in the Guaranteed QoS class and a kubelet with the static CPU
  manager policy gives each worker exclusive cores (its cpuset is what the worker pins to; no
  FLEET_CPUS). With the Topology Manager's `single-numa-node` policy the cores come from one
  node, which is what the planner does on bare metal.
- terminationGracePeriodSeconds = drain_grace + STOP_MARGIN: SIGTERM drains, then SIGKILL.
- Probes run `fleet health` against the worker's local health file (liveness never asks Redis);
  a startup probe covers the model load.
- The Redis URL (and, for KEDA, the password) comes from a Secret; worker-config.json minus
  `redis_url` and `gateway.api_keys` is a ConfigMap mounted at CONFIG_DIR. The gateway's API keys
  come from a Secret of their own (FLEET_GATEWAY__API_KEYS), never from the ConfigMap.
- Every container runs as a non-root user, without privilege escalation or capabilities, on a
  read-only root filesystem; what it writes goes to emptyDir volumes (/tmp: the health file,
  uploads spooled by the gateway; the worker's cache dir: the embedded model, assembled at start).
- KEDA: one `redis` (or `redis-sentinel`) trigger per priority queue of the pool, summed by a
  scaling-modifier formula; target = queue_target_per_worker() (ecosystem/sizing.py), the same
  function `fleet scale --suggest` uses (`suggest_scale`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import yaml
from redis import Redis

from backends.contract.catalogue import model_pools
from backends.contract.connect import is_sentinel_url, parse_sentinel_url
from backends.contract.keys import queue_key, queue_name, tenant_queue_name
from backends.contract.redact import redact_url
from backends.contract.schema import DEFAULT_TENANT, PRIORITIES
from backends.llamacpp_settings import LlamaCppSettings
from dispatcher import status as fleet_status
from ecosystem.planner import Plan
from ecosystem.render import STOP_MARGIN
from ecosystem.sizing import Throughput, queue_target_per_worker, worker_memory_mib, workers_needed
from worker.settings import FleetSettings

APP = "llama-fleet"
CONFIG_DIR = "/etc/llama-fleet"
HEALTH_FILE = "/tmp/fleet-health.json"
GATEWAY_PORT = 8000
SECRET = f"{APP}-redis"
GATEWAY_SECRET = f"{APP}-gateway"
CACHE_DIR = "/var/cache/llama-fleet"  # FLEET_CACHE_DIR: the embedded model is assembled here
RUN_AS = 10001  # any non-root uid: the image needs no user of its own
COLD_START_WAIT = 300  # seconds a request waits for its model's first worker (pod start + model load)
PER_HOST_KEYS = ("redis_url", "name", "cpus", "numa_node", "health_file")  # not for the ConfigMap


@dataclass(frozen=True)
class KubernetesOptions:
    image: str = f"{APP}:0.1.0"
    namespace: str | None = None
    ttft_target_s: float = 10.0
    min_workers: int = 1
    max_workers: int = 10
    tokens_per_s: float | None = None  # per worker; None: the measured figure for its cores
    memory_mib: int | None = None  # per worker; None: the sizing estimate
    gateway_replicas: int = 1
    show_secrets: bool = False  # False: the Secret's values are redacted (stdout)


def render_kubernetes(plan: Plan, settings: FleetSettings, config: dict[str, Any],
                      options: KubernetesOptions) -> dict[str, str]:
    """Files by name. `config` is worker-config.json as read (or {} for defaults)."""
    cores = max(w.threads for w in plan.workers)
    slots = max(w.slots for w in plan.workers)
    docs = {
        "configmap.yaml": _configmap(config),
        "secret.yaml": _secret(settings.redis_url, options.show_secrets),
        "gateway-secret.yaml": _gateway_secret(settings, options.show_secrets),
        "gateway-deployment.yaml": _gateway_deployment(options, cold_start=bool(settings.models)),
        "gateway-service.yaml": _gateway_service(),
    }
    if not settings.models:
        docs["worker-deployment.yaml"] = _worker_deployment(plan, settings, cores, slots, options)
        docs["scaledobject.yaml"] = _scaled_object(settings, cores, options)
    # a model catalogue: a Deployment and a ScaledObject per model, each scaled on its own pool's
    # queues, from zero unless the model is pinned
    for name, pool in model_pools(settings.models).items():
        docs[f"worker-{pool}-deployment.yaml"] = _worker_deployment(plan, settings, cores, slots, options,
                                                                    name)
        docs[f"scaledobject-{pool}.yaml"] = _scaled_object(settings, cores, options, name)
    files = {name: _yaml(doc) for name, doc in docs.items()}
    kustomization: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": list(docs),
    }
    if options.namespace:
        kustomization["namespace"] = options.namespace
    files["kustomization.yaml"] = _yaml(kustomization)
    return files


def scale_target(settings: FleetSettings, cores: int, options: KubernetesOptions) -> int:
    """Queued jobs per worker the ScaledObject aims at (see ecosystem/sizing.py)."""
    tokens_per_job = settings.backend.sampling.max_tokens or 128
    throughput = (Throughput(options.tokens_per_s, tokens_per_job) if options.tokens_per_s
                  else Throughput.measured(cores, tokens_per_job))
    return queue_target_per_worker(throughput.jobs_per_s, options.ttft_target_s)


@dataclass(frozen=True)
class ScaleSuggestion:
    queued: int
    live_workers: int
    target_per_worker: int
    jobs_per_s: float  # one worker's
    ttft_target_s: float
    suggested_workers: int

    def row(self) -> dict[str, Any]:
        return {"queued": self.queued, "live_workers": self.live_workers,
                "target_per_worker": self.target_per_worker,
                "jobs_per_s_per_worker": round(self.jobs_per_s, 3),
                "ttft_target_s": self.ttft_target_s, "suggested_workers": self.suggested_workers}


def scaled_lists(settings: FleetSettings, pool: str) -> list[tuple[str, str]]:
    """(trigger name, Redis list) of every list whose jobs count toward the pool's workers: its
    priorities' queues, and each configured tenant's (keys.tenant_queue_name), or a tenant's
    request would never start a worker from zero."""
    tenants = [None, *sorted(t for t in settings.gateway.tenants if t != DEFAULT_TENANT)]
    return [(f"q_{priority}" + (f"_t{i}" if tenant else ""),
             queue_key(tenant_queue_name(queue_name(pool, priority), tenant)))
            for priority in PRIORITIES for i, tenant in enumerate(tenants)]


def suggest_scale(redis: Redis, settings: FleetSettings, cores: int | None, ttft_target: float,
                  tokens_per_s: float | None, min_workers: int, max_workers: int) -> ScaleSuggestion:
    """The worker count the pool's queue depth calls for, by the ScaledObject's formula. `cores`
    per worker: None takes the live workers' mean, else 2."""
    snap = fleet_status.snapshot(redis, settings.pool)
    with redis.pipeline(transaction=False) as pipe:  # the lists the ScaledObject counts
        for _, key in scaled_lists(settings, settings.pool):
            pipe.llen(key)
        queued = sum(int(n) for n in pipe.execute())
    live = snap["workers"]
    if cores is None:
        threads = [int(w.get("threads") or 0) for w in live if w.get("threads")]
        cores = math.ceil(sum(threads) / len(threads)) if threads else 2
    tokens_per_job = settings.backend.sampling.max_tokens or 128
    throughput = (Throughput(tokens_per_s, tokens_per_job) if tokens_per_s
                  else Throughput.measured(cores, tokens_per_job))
    target = queue_target_per_worker(throughput.jobs_per_s, ttft_target)
    return ScaleSuggestion(queued, len(live), target, throughput.jobs_per_s, ttft_target,
                           workers_needed(queued, target, min_workers, max_workers))


def _yaml(doc: dict[str, Any]) -> str:
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)


def _meta(name: str, component: str) -> dict[str, Any]:
    return {"name": name, "labels": _labels(component)}


def _labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": component}


def _configmap(config: dict[str, Any]) -> dict[str, Any]:
    shared = {k: v for k, v in config.items() if k not in PER_HOST_KEYS}
    if isinstance(shared.get("gateway"), dict):  # keys go to the gateway's Secret
        shared["gateway"] = {k: v for k, v in shared["gateway"].items() if k != "api_keys"}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(f"{APP}-config", "config"),
            "data": {"worker-config.json": json.dumps(shared, indent=2) + "\n"}}


def _secret(redis_url: str, show: bool) -> dict[str, Any]:
    if redis_url.startswith("unix:"):
        raise ValueError("a unix:// Redis URL cannot reach pods: configure redis://, rediss:// or "
                         "redis+sentinel:// for Kubernetes")
    data = {"redis-url": redis_url, "redis-password": _password(redis_url)}
    if is_sentinel_url(redis_url):
        data["sentinel-password"] = parse_sentinel_url(redis_url).sentinel_password or ""
    if not show:
        data = {k: (redact_url(v) if k == "redis-url" else ("***" if v else "")) for k, v in data.items()}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(SECRET, "redis"), "type": "Opaque",
            "stringData": data}


def _gateway_secret(settings: FleetSettings, show: bool) -> dict[str, Any]:
    keys = [k.get_secret_value() for k in settings.gateway.api_keys]
    value = json.dumps(keys if show else ["***" for _ in keys])
    return {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(GATEWAY_SECRET, "gateway"),
            "type": "Opaque", "stringData": {"api-keys": value}}


def _password(url: str) -> str:
    if is_sentinel_url(url):
        return parse_sentinel_url(url).password or ""
    password = urlsplit(url).password
    return unquote(password) if password else ""


def _secret_env(name: str, key: str, secret: str = SECRET) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _shared_env() -> list[dict[str, Any]]:
    return [{"name": "FLEET_CONFIG", "value": f"{CONFIG_DIR}/worker-config.json"},
            _secret_env("FLEET_REDIS_URL", "redis-url")]


def _config_volume() -> tuple[dict[str, Any], dict[str, Any]]:
    volume = {"name": "config", "configMap": {"name": f"{APP}-config"}}
    mount = {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}
    return volume, mount


def _scratch(name: str, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return {"name": name, "emptyDir": {}}, {"name": name, "mountPath": path}


def _pod_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _container_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}}


def _exec_probe(*args: str, period: int, failures: int) -> dict[str, Any]:
    return {"exec": {"command": ["fleet", "health", *args]}, "periodSeconds": period,
            "timeoutSeconds": 5, "failureThreshold": failures}


def _worker_name(model: str | None, settings: FleetSettings) -> str:
    return f"{APP}-worker" if model is None else f"{APP}-worker-{model_pools(settings.models)[model]}"


def _worker_labels(model: str | None, settings: FleetSettings) -> dict[str, str]:
    pool = None if model is None else model_pools(settings.models)[model]
    return {**_labels("worker"), **({"llama-fleet/pool": pool} if pool else {})}


def _worker_deployment(plan: Plan, settings: FleetSettings, cores: int, slots: int,
                       options: KubernetesOptions, model: str | None = None) -> dict[str, Any]:
    """The workers of the pool, or (`model`) those serving that one catalogue model."""
    memory = options.memory_mib or worker_memory_mib(settings.backend)
    resources = {"cpu": str(cores), "memory": f"{memory}Mi"}
    volume, mount = _config_volume()
    tmp, tmp_mount = _scratch("tmp", "/tmp")
    cache, cache_mount = _scratch("cache", CACHE_DIR)
    env = [
        *_shared_env(),
        {"name": "FLEET_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "FLEET_HEALTH_FILE", "value": HEALTH_FILE},
        {"name": "FLEET_CACHE_DIR", "value": CACHE_DIR},
        # a thread count is llama.cpp's alone: any other engine refuses the key
        *([{"name": "FLEET_BACKEND__THREADS", "value": str(cores)}]
          if isinstance(settings.backend, LlamaCppSettings) else []),
        {"name": "FLEET_BACKEND__SLOTS", "value": str(slots)},
        # read by KEDA's scaler from the scale target's container (passwordFromEnv)
        _secret_env("REDIS_PASSWORD", "redis-password"),
        *([{"name": "FLEET_SERVE_MODELS", "value": json.dumps([model])}] if model is not None else []),
    ]
    if is_sentinel_url(settings.redis_url):
        env.append(_secret_env("REDIS_SENTINEL_PASSWORD", "sentinel-password"))
    container = {
        "name": "worker",
        "image": options.image,
        "command": ["fleet", "worker"],
        "env": env,
        "resources": {"requests": resources, "limits": resources},
        "volumeMounts": [mount, tmp_mount, cache_mount],
        "securityContext": _container_security(),
        # the model load: up to 5 min before liveness applies
        "startupProbe": _exec_probe(period=5, failures=60),
        "livenessProbe": _exec_probe(period=10, failures=3),
        "readinessProbe": _exec_probe("--ready", period=5, failures=2),
    }
    grace = int(settings.drain_grace + STOP_MARGIN + 0.999)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": _worker_name(model, settings), "labels": _worker_labels(model, settings)},
        "spec": {
            "replicas": _min_replicas(model, settings, options) if model else max(options.min_workers,
                                                                                  len(plan.workers)),
            "selector": {"matchLabels": _worker_labels(model, settings)},
            # a new pod loads its model before an old one drains
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": _worker_labels(model, settings)},
                "spec": {"terminationGracePeriodSeconds": grace, "securityContext": _pod_security(),
                         "automountServiceAccountToken": False, "containers": [container],
                         "volumes": [volume, tmp, cache]},
            },
        },
    }


def _gateway_deployment(options: KubernetesOptions, cold_start: bool = False) -> dict[str, Any]:
    """`cold_start`: models scale from zero, so a request waits for its model's first worker (the
    queued job is what KEDA starts it for)."""
    volume, mount = _config_volume()
    tmp, tmp_mount = _scratch("tmp", "/tmp")
    waits = [{"name": "FLEET_GATEWAY__COLD_START_WAIT", "value": str(COLD_START_WAIT)}] if cold_start else []
    container = {
        "name": "gateway",
        "image": options.image,
        "command": ["fleet", "serve", "--host", "0.0.0.0", "--port", str(GATEWAY_PORT)],
        "env": [*_shared_env(), _secret_env("FLEET_GATEWAY__API_KEYS", "api-keys", GATEWAY_SECRET), *waits],
        "ports": [{"name": "http", "containerPort": GATEWAY_PORT}],
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}},
        "volumeMounts": [mount, tmp_mount],
        "securityContext": _container_security(),
        # ready = Redis up and a live worker (its /health); alive = it accepts connections
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10, "failureThreshold": 3},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(f"{APP}-gateway", "gateway"),
        "spec": {
            "replicas": options.gateway_replicas,
            "selector": {"matchLabels": _labels("gateway")},
            "template": {"metadata": {"labels": _labels("gateway")},
                         "spec": {"securityContext": _pod_security(), "automountServiceAccountToken": False,
                                  "containers": [container], "volumes": [volume, tmp]}},
        },
    }


def _gateway_service() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(f"{APP}-gateway", "gateway"),
        "spec": {"selector": _labels("gateway"),
                 "ports": [{"name": "http", "port": GATEWAY_PORT, "targetPort": "http"}]},
    }


def _trigger_connection(url: str) -> tuple[str, dict[str, str]]:
    """KEDA trigger type and its connection metadata (no secrets: those come from env)."""
    if is_sentinel_url(url):
        target = parse_sentinel_url(url)
        meta = {"addresses": ",".join(f"{_host(h)}:{p}" for h, p in target.sentinels),
                "sentinelMaster": target.service, "databaseIndex": str(target.db),
                "enableTLS": "true" if target.tls else "false", "passwordFromEnv": "REDIS_PASSWORD",
                "sentinelPasswordFromEnv": "REDIS_SENTINEL_PASSWORD"}
        return "redis-sentinel", meta
    parts = urlsplit(url)
    db = parts.path.strip("/") or "0"
    meta = {"address": f"{_host(parts.hostname or 'localhost')}:{parts.port or 6379}", "databaseIndex": db,
            "enableTLS": "true" if parts.scheme == "rediss" else "false", "passwordFromEnv": "REDIS_PASSWORD"}
    return "redis", meta


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _min_replicas(model: str, settings: FleetSettings, options: KubernetesOptions) -> int:
    """A catalogue model scales from zero, but for a pinned one (kept loaded somewhere)."""
    return options.min_workers if settings.models[model].pinned else 0


def _scaled_object(settings: FleetSettings, cores: int, options: KubernetesOptions,
                   model: str | None = None) -> dict[str, Any]:
    target = scale_target(settings, cores, options)
    kind, connection = _trigger_connection(settings.redis_url)
    pool = settings.pool if model is None else model_pools(settings.models)[model]
    lists = scaled_lists(settings, pool)
    per_list = {"listLength": str(target), "activationListLength": "0"}
    triggers = [{"type": kind, "name": name, "metadata": {**connection, "listName": key, **per_list}}
                for name, key in lists]
    name = _worker_name(model, settings)
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": name, "labels": _worker_labels(model, settings)},
        "spec": {
            "scaleTargetRef": {"name": name},
            "minReplicaCount": (options.min_workers if model is None
                                else _min_replicas(model, settings, options)),
            "maxReplicaCount": options.max_workers,
            "pollingInterval": 15,
            "cooldownPeriod": 300,  # a worker costs a model load: do not flap
            "advanced": {
                # HPA: replicas = ceil(sum of the pool's queues / target) = sizing.workers_needed
                "scalingModifiers": {
                    "formula": " + ".join(name for name, _ in lists),
                    "target": str(target),
                    "metricType": "AverageValue",
                },
            },
            "triggers": triggers,
        },
    }
