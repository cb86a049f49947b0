"""Operator settings, read from the environment once and validated with a clear message."""

from __future__ import annotations

import os

from pydantic import BaseModel, Field, ValidationError, field_validator


class OperatorSettings(BaseModel):
    """What the chart's values become (env vars `ANNEAL_*`)."""

    engine_image: str = Field("ghcr.io/anneal-dev/anneal-engine:0.1.0", min_length=1)
    prometheus_url: str | None = Field(None, pattern=r"^https?://")
    watch_namespaces: list[str] = Field(default_factory=list, description="empty: all namespaces")
    peering_name: str = "anneal"
    standalone: bool = False
    priority: int = 0
    liveness_host: str = Field("0.0.0.0", min_length=1, description="address of the health endpoint")
    liveness_port: int = Field(8080, ge=0, le=65535, description="0 disables the health endpoint")
    reconcile_interval: float = Field(10.0, gt=0, description="seconds between level-triggered checks")
    log_level: str = "INFO"
    engine_run_as_user: int = Field(10001, ge=1)

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        value = value.upper()
        if value not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError("log level must be DEBUG, INFO, WARNING or ERROR")
        return value


_ENV = {
    "engine_image": "ANNEAL_ENGINE_IMAGE",
    "prometheus_url": "ANNEAL_PROMETHEUS_URL",
    "watch_namespaces": "ANNEAL_WATCH_NAMESPACES",
    "peering_name": "ANNEAL_PEERING_NAME",
    "standalone": "ANNEAL_STANDALONE",
    "priority": "ANNEAL_PRIORITY",
    "liveness_host": "ANNEAL_LIVENESS_HOST",
    "liveness_port": "ANNEAL_LIVENESS_PORT",
    "reconcile_interval": "ANNEAL_RECONCILE_INTERVAL",
    "log_level": "ANNEAL_LOG_LEVEL",
    "engine_run_as_user": "ANNEAL_ENGINE_RUN_AS_USER",
}


def from_env(environ: dict[str, str] | None = None) -> OperatorSettings:
    env = os.environ if environ is None else environ
    raw: dict[str, object] = {}
    for field, var in _ENV.items():
        value = env.get(var)
        if value is None or value == "":
            continue
        if field == "watch_namespaces":
            raw[field] = [ns.strip() for ns in value.split(",") if ns.strip()]
        elif field == "standalone":
            raw[field] = value.lower() in ("1", "true", "yes")
        else:
            raw[field] = value
    try:
        return OperatorSettings.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{_ENV[str(e['loc'][0])]}: {e['msg']}" if e["loc"] else e["msg"] for e in exc.errors()
        )
        raise SystemExit(f"anneal operator: invalid settings: {problems}") from None
