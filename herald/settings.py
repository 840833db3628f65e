"""The one settings object. Built once from the environment at an entry point and passed down.

Nothing else in Herald reads ``os.environ``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

DEV_TENANT = "dev"
DEV_KEY = "dev-key"


class SettingsError(ValueError):
    """A HERALD_* variable has a value we cannot use; the message names it."""


def _parse_api_keys(raw: str | None) -> dict[str, str]:
    """``tenant:key,tenant:key`` -> {key: tenant}."""
    if not raw:
        return {DEV_KEY: DEV_TENANT}
    keys: dict[str, str] = {}
    for item in raw.split(","):
        item = item.strip()
        if not item:
            continue
        tenant, sep, key = item.partition(":")
        if not sep or not tenant or not key:
            raise SettingsError("HERALD_API_KEYS must look like 'tenant:key,tenant:key'")
        keys[key] = tenant
    if not keys:
        raise SettingsError("HERALD_API_KEYS is set but holds no key")
    return keys


def _schedule(raw: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in raw.split(",") if x.strip())
    except ValueError as exc:
        raise SettingsError("HERALD_WEBHOOK_RETRY_SCHEDULE must be comma-separated seconds") from exc
    if not values or any(v < 0 for v in values):
        raise SettingsError("HERALD_WEBHOOK_RETRY_SCHEDULE must be non-negative seconds")
    return values


@dataclass(frozen=True, kw_only=True)
class Settings:
    data_dir: Path = Path("./var")
    nats_url: str | None = None
    nats_port: int = 4222
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    api_keys: Mapping[str, str] = field(default_factory=lambda: {DEV_KEY: DEV_TENANT}, repr=False)
    retention_s: float = 86400.0
    heartbeat_timeout_s: float = 30.0
    max_attempts: int = 3
    job_deadline_s: float = 3600.0
    sweep_interval_s: float = 5.0
    signed_url_ttl_s: float = 900.0
    rate_limit: float = 50.0
    require_idempotency_key: bool = False
    webhook_allow_private: bool = False
    webhook_retry_schedule: tuple[float, ...] = (5, 300, 1800, 7200, 18000, 36000, 36000)
    webhook_min_backoff_s: float = 60.0  # a timeout or 429 waits at least this long (SPEC §7)
    report_page_ms: float = 200.0
    metrics_port: int | None = None
    workers: int = 2
    worker_concurrency: int = 4
    worker_grace_s: float = 10.0
    max_queue_age_s: float = 300.0
    max_held_per_tenant: int = 10_000
    log_format: str = "json"
    log_level: str = "info"
    signing_secrets: tuple[str, ...] = field(default=(), repr=False)
    database_url: str | None = field(default=None, repr=False)  # postgresql://...: the PostgreSQL store
    result_store: str = ""  # "file" or "nats"; empty: file with SQLite, nats with PostgreSQL
    nats_replicas: int = 1

    @property
    def db_path(self) -> Path:
        return self.data_dir / "herald.db"

    @property
    def results_dir(self) -> Path:
        return self.data_dir / "results"

    @property
    def nats_store_dir(self) -> Path:
        return self.data_dir / "nats"

    @property
    def effective_nats_url(self) -> str:
        return self.nats_url or f"nats://127.0.0.1:{self.nats_port}"

    @property
    def nats_servers(self) -> list[str]:
        """Every server of the cluster (HERALD_NATS_URL may list several, comma-separated)."""
        return [url.strip() for url in self.effective_nats_url.split(",") if url.strip()]

    @property
    def uses_postgres(self) -> bool:
        return self.database_url is not None

    @property
    def effective_result_store(self) -> str:
        return self.result_store or ("nats" if self.uses_postgres else "file")

    @property
    def first_api_key(self) -> str:
        return next(iter(self.api_keys))

    @property
    def heartbeat_interval_s(self) -> float:
        # SPEC §9: at least every third of the timeout.
        return max(0.05, self.heartbeat_timeout_s / 3.5)

    def with_changes(self, **changes: object) -> Settings:
        return replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env

        def get(name: str) -> str | None:
            value = env.get(f"HERALD_{name}")
            return value if value not in (None, "") else None

        def num(name: str, default: float, cast: type = float) -> float:
            raw = get(name)
            if raw is None:
                return default
            try:
                value = cast(raw)
            except ValueError as exc:
                raise SettingsError(f"HERALD_{name} must be a number, got {raw!r}") from exc
            if value < 0:
                raise SettingsError(f"HERALD_{name} must not be negative")
            return value

        def flag(name: str) -> bool:
            return (get(name) or "").lower() in ("1", "true", "yes", "on")

        metrics = get("METRICS_PORT")
        secrets_raw = get("SIGNING_KEY") or get("SIGNING_SECRETS")
        database_url = get("DATABASE_URL")
        if database_url is not None and not database_url.startswith(("postgresql://", "postgres://")):
            raise SettingsError("HERALD_DATABASE_URL must be a postgresql:// URL")
        result_store = (get("RESULT_STORE") or "").lower()
        if result_store not in ("", "file", "nats"):
            raise SettingsError("HERALD_RESULT_STORE must be 'file' or 'nats'")
        return cls(
            data_dir=Path(get("DATA_DIR") or "./var"),
            nats_url=get("NATS_URL"),
            nats_port=int(num("NATS_PORT", 4222, int)),
            http_host=get("HTTP_HOST") or "127.0.0.1",
            http_port=int(num("HTTP_PORT", 8000, int)),
            api_keys=_parse_api_keys(get("API_KEYS")),
            retention_s=num("RETENTION_S", 86400.0),
            heartbeat_timeout_s=num("HEARTBEAT_TIMEOUT_S", 30.0),
            max_attempts=max(1, int(num("MAX_ATTEMPTS", 3, int))),
            job_deadline_s=num("JOB_DEADLINE_S", 3600.0),
            sweep_interval_s=max(0.05, num("SWEEP_INTERVAL_S", 5.0)),
            signed_url_ttl_s=num("SIGNED_URL_TTL_S", 900.0),
            rate_limit=num("RATE_LIMIT", 50.0),
            require_idempotency_key=flag("REQUIRE_IDEMPOTENCY_KEY"),
            webhook_allow_private=flag("WEBHOOK_ALLOW_PRIVATE"),
            webhook_retry_schedule=_schedule(get("WEBHOOK_RETRY_SCHEDULE") or "5,300,1800,7200,18000,36000,36000"),
            webhook_min_backoff_s=num("WEBHOOK_MIN_BACKOFF_S", 60.0),
            report_page_ms=num("REPORT_PAGE_MS", 200.0),
            metrics_port=int(metrics) if metrics else None,
            workers=max(1, int(num("WORKERS", 2, int))),
            worker_concurrency=max(1, int(num("WORKER_CONCURRENCY", 4, int))),
            worker_grace_s=num("WORKER_GRACE_S", 10.0),
            max_queue_age_s=num("MAX_QUEUE_AGE_S", 300.0),
            max_held_per_tenant=int(num("MAX_HELD_PER_TENANT", 10_000, int)),
            log_format=(get("LOG_FORMAT") or "json").lower(),
            log_level=(get("LOG_LEVEL") or "info").lower(),
            signing_secrets=tuple(s for s in (secrets_raw or "").split(",") if s),
            database_url=database_url,
            result_store=result_store,
            nats_replicas=max(1, int(num("NATS_REPLICAS", 1, int))),
        )

    def configured_signing_keys(self) -> tuple[bytes, ...]:
        """HERALD_SIGNING_KEY's keys (comma-separated: the first signs, all verify, for
        rotation). Empty: the store keeps a generated one (``JobStore.signing_key``)."""
        return tuple(s.encode() for s in self.signing_secrets)
