"""`fleet serve`'s settings: the producer's settings plus the `gateway` section, whose model
(GatewaySettings) is in the contract (backends/contract/gateway_settings.py) so the worker can
check the same file's section without importing the gateway."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from backends.contract.catalogue import ModelEntry, model_pools
from backends.contract.gateway_settings import GatewaySettings
from backends.contract.settings import ProducerSettings, load


class ServeSettings(ProducerSettings):
    """The producer's settings plus the gateway section (`fleet serve`); worker keys in the same
    file are the worker's to check."""

    gateway: GatewaySettings = Field(default_factory=GatewaySettings)

    def model_pools(self, catalogue: dict[str, ModelEntry] | None = None) -> dict[str, str]:
        """Model name -> pool, as the API lists them: the catalogue's models (each in its own pool;
        `catalogue`: the live one, else the config's), else the fleet's pool by its name;
        `gateway.models` adds names (aliases) to these, and names another pool's model."""
        models = self.models if catalogue is None else catalogue
        return {**(model_pools(models) or {self.pool: self.pool}), **self.gateway.models}


def load_serve_settings(config: str | None = None, **overrides: Any) -> ServeSettings:
    return load(ServeSettings, config, **overrides)
