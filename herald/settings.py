"""The one settings object. Built once from the environment at an entry point and passed down.

Nothing else in Herald reads ``os.environ``.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Annotated, Any, get_args, get_type_hints
from urllib.parse import parse_qsl, unquote, urlsplit

from herald.constants import ISSUED_KEY_PREFIX, PORTAL_TOKEN_PREFIX
from herald.resolver import dns_server
from schemas.admin import TENANT_ID_PATTERN

DEV_TENANT = "dev"
DEV_KEY = "dev-key"
# The shortest HERALD_API_KEYS key a gateway takes when it listens beyond loopback: there
# anyone who reaches the port can try keys, and an operator's may be a word; on loopback
# (a developer's machine, the README's `dev-key`) any length does.
MIN_EXPOSED_API_KEY_LENGTH = 16


class SettingsError(ValueError):
    """A HERALD_* variable has a value we cannot use; the message names it."""


@dataclass(frozen=True, slots=True)
class Env:
    """How a setting is read from the environment: ``parse(variable, raw)`` of the first of
    ``names`` that is set and not empty (no names: ``HERALD_<FIELD NAME>``); unset, the
    field keeps its default."""

    parse: Callable[[str, str], Any]
    names: tuple[str, ...] = ()


def _number(cast: Callable[[str], float], floor: float | None = None) -> Env:
    def parse(name: str, raw: str) -> float:
        try:
            value = cast(raw)
        except ValueError as exc:
            raise SettingsError(f"{name} must be a number, got {raw!r}") from exc
        if not math.isfinite(value):  # 'nan', 'inf' and '1e309' are floats too
            raise SettingsError(f"{name} must be a finite number, got {raw!r}")
        if value < 0:
            raise SettingsError(f"{name} must not be negative")
        return value if floor is None else max(floor, value)

    return Env(parse)


_TENANT_ID = re.compile(TENANT_ID_PATTERN)


def bearer_key_problem(key: str) -> str | None:
    """Why ``key`` cannot be a bearer token, or None; never the key itself. A header carries
    ASCII, and a token is one word: a key with a space or a letter like 'é' could be set but
    never sent (a client cannot encode it, a gateway would wait for it in vain)."""
    if not all("!" <= c <= "~" for c in key):
        return "must be printable ASCII without spaces (a bearer token is one word that a header can carry)"
    return None


def _api_keys(name: str, raw: str) -> dict[str, str]:
    """``tenant:key,tenant:key`` -> {key: tenant}."""
    keys: dict[str, str] = {}
    for item in raw.split(","):
        item = item.strip()
        if not item:
            continue
        tenant, sep, key = item.partition(":")
        if not sep or not tenant or not key:
            raise SettingsError(f"{name} must look like 'tenant:key,tenant:key'")
        # The same ids the admin API allows (SPEC §12): a tenant becomes part of NATS
        # subjects and consumer names, where '.', '*', '>' or a space would change their meaning.
        if not _TENANT_ID.fullmatch(tenant):
            raise SettingsError(f"{name}: tenant {tenant!r} is not a valid tenant id "
                                "(lower-case letters, digits, '-' and '_', at most 63, starting with a letter or digit)")
        if key.startswith((ISSUED_KEY_PREFIX, PORTAL_TOKEN_PREFIX)):
            # It would be read as an issued key or a portal session, and never match.
            raise SettingsError(f"{name}: a key of tenant {tenant!r} starts with {ISSUED_KEY_PREFIX!r} or "
                                f"{PORTAL_TOKEN_PREFIX!r}, as the keys the admin API issues and portal sessions "
                                "do: choose another")
        if problem := bearer_key_problem(key):
            raise SettingsError(f"{name}: a key of tenant {tenant!r} {problem}")
        if key in keys:
            # Last wins would drop a tenant without a word; never the key in the message.
            who = (f"tenant {tenant!r} has the same key twice" if keys[key] == tenant
                   else f"tenants {keys[key]!r} and {tenant!r} have the same key")
            raise SettingsError(f"{name}: a key is repeated ({who}): each key belongs to one tenant, once")
        keys[key] = tenant
    if not keys:
        raise SettingsError(f"{name} is set but holds no key")
    return keys


def is_loopback_host(host: str) -> bool:
    """Only this machine reaches a server bound to ``host``: ``localhost`` or a loopback
    address (127.0.0.0/8, ::1). Any other name, and 0.0.0.0 or ::, is reachable from elsewhere."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False


def in_clear_beyond_this_machine(url: str) -> bool:
    """An http:// URL whose host is not a loopback name or address: a key sent there crosses
    the network readable by anyone on the way (the CLIs refuse it without --allow-http)."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "http":
        return False
    host = (parts.hostname or "").rstrip(".")
    # Any other name: wherever it resolves to, the key is in clear on the way.
    return not (is_loopback_host(host) or host.endswith(".localhost"))


def check_exposed_api_keys(settings: Settings) -> None:
    """A gateway listening beyond loopback takes no HERALD_API_KEYS key shorter than
    ``MIN_EXPOSED_API_KEY_LENGTH``: raises ``SettingsError`` naming the variable and the
    tenants whose keys are short (never a key). Keys the admin API issues are random
    (``herald.tenants.issue_key``), and `herald up` generates its dev key there."""
    if is_loopback_host(settings.http_host):
        return
    short = sorted({tenant for key, tenant in settings.api_keys.items() if len(key) < MIN_EXPOSED_API_KEY_LENGTH})
    if short:
        whose = (f"the key of tenant {short[0]!r} is" if len(short) == 1
                 else f"keys of tenants {', '.join(repr(t) for t in short)} are")
        raise SettingsError(
            f"HERALD_API_KEYS: every key must be at least {MIN_EXPOSED_API_KEY_LENGTH} characters when the gateway "
            f"listens beyond loopback (HERALD_HTTP_HOST or --host is {settings.http_host!r}); {whose} shorter: "
            "choose a longer one (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(24))'`), "
            "or listen on 127.0.0.1"
        )


def _admin_key(name: str, raw: str) -> str:
    if len(raw) < 32:
        raise SettingsError(f"{name} must be at least 32 characters")
    if problem := bearer_key_problem(raw):
        raise SettingsError(f"{name} {problem}")
    return raw


def _client_key(name: str, raw: str) -> str:
    """The key the client commands send (``HERALD_API_KEY``)."""
    if problem := bearer_key_problem(raw):
        raise SettingsError(f"{name} {problem}")
    return raw


MAX_RETRY_DELAY_S = 365 * 86400.0


def _schedule(name: str, raw: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in raw.split(",") if x.strip())
    except ValueError as exc:
        raise SettingsError(f"{name} must be comma-separated seconds") from exc
    # A delay that is not a finite number of seconds, or beyond what a time can show, left its
    # delivery pending for ever (NaN is stored as no time at all) and its log a 500.
    if not values or any(not (0 <= v <= MAX_RETRY_DELAY_S) for v in values):
        raise SettingsError(f"{name} must be non-negative seconds, each at most {MAX_RETRY_DELAY_S:g} (a year)")
    return values


def _secret_keys(name: str, raw: str) -> tuple[str, ...]:
    """``new,old``: the first seals (or signs), every one opens (or verifies): rotation, SPEC
    §12. Each at least 32 characters: a short one is guessed offline from one signed URL (an
    HMAC with a known message) or one sealed value, and then every tenant's links are forged."""
    keys = tuple(item.strip() for item in raw.split(",") if item.strip())
    for n, key in enumerate(keys, start=1):
        if len(key) < 32:  # never the key itself in the message
            raise SettingsError(f"{name}: every key must be at least 32 characters; key {n} has {len(key)}")
    if not keys:
        raise SettingsError(f"{name} is set but holds no key")
    return keys


def _dns_servers(name: str, raw: str) -> tuple[str, ...]:
    try:
        return tuple(dns_server(item) for item in raw.split(",") if item.strip())
    except ValueError as exc:
        raise SettingsError(f"{name} must be comma-separated addresses, each 'ip', 'ip:port' or '[ipv6]:port': {exc}") from exc


def _names(name: str, raw: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in raw.split(",") if item.strip())


def _kind_counts(name: str, raw: str) -> dict[str, int]:
    """``kind:n,kind:n`` -> {kind: n}."""
    counts: dict[str, int] = {}
    for item in raw.split(","):
        if not item.strip():
            continue
        kind, sep, count = item.strip().partition(":")
        if not sep or not kind or not (count.isascii() and count.isdigit()) or int(count) < 1:
            raise SettingsError(f"{name} must look like 'kind:n,kind:n' with n >= 1, got {item.strip()!r}")
        counts[kind] = int(count)
    return counts


def _creds_file(name: str, raw: str) -> Path:
    path = Path(raw)
    if not path.is_file():
        raise SettingsError(f"{name}: no such file {raw!r} (a NATS credentials file: `nsc generate creds`)")
    return path


# Query parameters that carry a secret: libpq's and asyncpg's `?password=`, `?sslpassword=`.
_SECRET_QUERY = re.compile(r"(?i)([?&](?:password|sslpassword|token)=)[^&#]*")


def redact_url(url: str) -> str:
    """``url`` with any password (or token) in its userinfo or its query replaced by ``***``:
    for banners and logs."""
    def one(part: str) -> str:
        scheme, sep, rest = part.strip().partition("://")
        rest = _SECRET_QUERY.sub(r"\1***", rest)
        userinfo, at, host = rest.rpartition("@")
        if not sep or not at:
            return f"{scheme}{sep}{rest}"
        user, colon, _password = userinfo.partition(":")
        return f"{scheme}://{user + ':***' if colon else '***'}@{host}"
    return ",".join(one(p) for p in url.split(",") if p.strip())


def _database_url(name: str, raw: str) -> str:
    if not raw.startswith(("postgresql://", "postgres://")):
        raise SettingsError(f"{name} must be a postgresql:// URL")
    if not _ports_readable(raw):
        # asyncpg would fail later with the bad "port" in its message, and with a password that
        # holds an unencoded '/', '?' or '#' that "port" is the password's start: in the log.
        raise SettingsError(
            f"{name}: its host and port cannot be read; a user or password holding '/', '?', '#', '@' or ':' "
            "must be percent-encoded (urllib.parse.quote(password, safe=''))")
    if problem := _ssl_mode_problem(raw):
        raise SettingsError(f"{name}: {problem}")
    return raw


NATS_SCHEMES = ("nats", "tls", "ws", "wss")


def _nats_url(name: str, raw: str) -> str:
    """Each comma-separated server a URL nats-py can dial, read as it reads one (``host:port``
    alone is ``nats://host:port``): a port that is no number, or a password whose unencoded
    '/', '?', '#' or '@' cut the host part short, otherwise failed only in the first connect,
    which the process retried for ever, never ready. The message names no part of the URL."""
    servers = [part.strip() for part in raw.split(",") if part.strip()]
    if not servers:
        raise SettingsError(f"{name} names no server")
    for server in servers:
        url = server if "://" in server else f"nats://{server}"
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018  (a ValueError when the port is no number in range)
            readable = (parts.scheme.lower() in NATS_SCHEMES and bool(parts.hostname)
                        and "@" not in parts.netloc.partition("@")[2])  # a password's '@' left unencoded
        except ValueError:
            readable = False
        if not readable:
            raise SettingsError(
                f"{name}: a server's scheme, host or port cannot be read (each is nats://, tls://, ws:// or "
                "wss://host:port, comma-separated); a user or password holding '/', '?', '#', '@' or ':' must be "
                "percent-encoded (urllib.parse.quote(password, safe=''))")
    return raw


SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")


def _ssl_mode_problem(url: str) -> str | None:
    """An ``sslmode`` asyncpg does not know failed each connect, retried for ever, never ready."""
    for key, value in parse_qsl(urlsplit(url).query, keep_blank_values=True):
        if key == "sslmode" and value not in SSL_MODES:
            return f"its sslmode must be one of {', '.join(SSL_MODES)}"
    return None


def _ports_readable(url: str) -> bool:
    """Whether each host of a PostgreSQL URL's netloc has a numeric port or none, read as
    asyncpg reads it (the userinfo ends at the first '@'; hosts are comma-separated)."""
    try:
        netloc = urlsplit(url).netloc
    except ValueError:  # an unbalanced '[': a message naming no part of the URL
        return False
    hosts = netloc.partition("@")[2] if "@" in netloc else netloc
    for host in hosts.split(",") if hosts else ():
        if "@" in host:  # a password's '@' left unencoded: the rest of it would be dialled as a host
            return False
        if host.startswith("["):
            port = host.partition("]")[2]
            if port and not port.startswith(":"):
                return False
            port = port[1:]
        else:
            port = host.partition(":")[2]
        port = unquote(port)
        if port and not (port.isascii() and port.isdigit()):
            return False
    return True


def _result_store(name: str, raw: str) -> str:
    store = raw.lower()
    if store not in ("file", "nats"):
        raise SettingsError(f"{name} must be 'file' or 'nats'")
    return store


TEXT = Env(lambda name, raw: raw)
LOWER = Env(lambda name, raw: raw.lower())
PATH = Env(lambda name, raw: Path(raw))
FLAG = Env(lambda name, raw: raw.lower() in ("1", "true", "yes", "on"))
PORT = Env(lambda name, raw: int(raw))
NUMBER = _number(float)
COUNT = _number(int)
AT_LEAST_ONE = _number(int, floor=1)


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Every setting with its one default and, in its ``Env``, how ``from_env`` reads it."""

    data_dir: Annotated[Path, PATH] = Path("./var")
    nats_url: Annotated[str | None, Env(_nats_url)] = field(default=None, repr=False)  # may carry user:password@
    nats_creds: Annotated[Path | None, Env(_creds_file)] = None  # a NATS .creds file (JWT + NKey seed)
    nats_port: Annotated[int, COUNT] = 4222
    http_host: Annotated[str, TEXT] = "127.0.0.1"
    http_port: Annotated[int, COUNT] = 8000
    # Bound to loopback, the gateway answers only requests whose Host is a loopback name or
    # address (a web page that rebinds its own name to 127.0.0.1 would otherwise reach it, and
    # the dev key is public): these names too, for a reverse proxy that passes its own Host on.
    allowed_hosts: Annotated[tuple[str, ...], Env(_names)] = ()
    # Several `herald gateway` processes on one host and port, the kernel spreading connections
    # (SO_REUSEPORT); each gateway has its own relay and hub, so any of them serves any request.
    http_reuse_port: Annotated[bool, FLAG] = False
    # No default tenant: `herald gateway` without HERALD_API_KEYS knows only the store's
    # tenants. `herald up` sets the dev tenant for its children (launcher.supervisor).
    api_keys: Annotated[Mapping[str, str], Env(_api_keys)] = field(default_factory=dict, repr=False)
    # What the client commands (`herald submit|status|…`, `herald tenants|keys`) talk to, and with which key.
    url: Annotated[str, TEXT] = "http://127.0.0.1:8000"
    api_key: Annotated[str, Env(_client_key)] = field(default=DEV_KEY, repr=False)
    retention_s: Annotated[float, NUMBER] = 86400.0
    heartbeat_timeout_s: Annotated[float, NUMBER] = 30.0
    max_attempts: Annotated[int, AT_LEAST_ONE] = 3
    job_deadline_s: Annotated[float, NUMBER] = 3600.0
    sweep_interval_s: Annotated[float, _number(float, floor=0.05)] = 5.0
    signed_url_ttl_s: Annotated[float, NUMBER] = 900.0
    rate_limit: Annotated[float, NUMBER] = 50.0
    require_idempotency_key: Annotated[bool, FLAG] = False
    webhook_allow_private: Annotated[bool, FLAG] = False
    webhook_retry_schedule: Annotated[tuple[float, ...], Env(_schedule)] = (
        5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0
    )
    webhook_min_backoff_s: Annotated[float, NUMBER] = 60.0  # a timeout or 429 waits at least this long (SPEC §7)
    webhook_pause_s: Annotated[float, NUMBER] = 5.0  # a paced target's first pause before its probe (SPEC §13)
    # The DNS servers webhook and callback hosts are looked up with (herald.resolver: the gateway's SSRF guard,
    # the notifier's attempts); empty: /etc/resolv.conf's.
    webhook_dns_servers: Annotated[tuple[str, ...], Env(_dns_servers)] = ()
    report_page_ms: Annotated[float, NUMBER] = 200.0
    metrics_port: Annotated[int | None, PORT] = None
    workers: Annotated[int, AT_LEAST_ONE] = 2
    # 8, not 4: a worker's costs are per batch (a pull, a group commit, a relay pass, a flush),
    # and more jobs in flight fill each batch; CPU per trivial job 0.87 of 4's (bench/RESULTS.md).
    # A kind whose handler is CPU-bound declares its own, lower ``concurrency``.
    worker_concurrency: Annotated[int, AT_LEAST_ONE] = 8
    worker_grace_s: Annotated[float, NUMBER] = 10.0
    max_queue_age_s: Annotated[float, NUMBER] = 300.0
    max_held_per_tenant: Annotated[int, COUNT] = 10_000  # a tenant's max_streams default (SPEC §13)
    tenant_max_running: Annotated[int, COUNT] = 0  # running jobs per tenant, deployment-wide; 0: no cap (SPEC §13)
    tenant_max_endpoints: Annotated[int, COUNT] = 100  # webhook endpoints per tenant (SPEC §13)
    # Every process re-reads the tenant directory's version at least this often, so a change
    # whose broadcast was lost still holds within it (SPEC §12: within 2 s).
    directory_refresh_s: Annotated[float, _number(float, floor=0.05)] = 1.0
    admin_key: Annotated[str | None, Env(_admin_key)] = field(default=None, repr=False)  # /admin (SPEC §12)
    metrics_tenant_labels: Annotated[bool, FLAG] = False  # a per-tenant series of started runs (cardinality: opt in)
    output_max_bytes: Annotated[int, AT_LEAST_ONE] = 16 * 1024 * 1024  # streamed output per job (SPEC §8)
    log_format: Annotated[str, LOWER] = "json"
    log_level: Annotated[str, LOWER] = "info"
    signing_secrets: Annotated[tuple[str, ...], Env(_secret_keys, ("SIGNING_KEY", "SIGNING_SECRETS"))] = field(
        default=(), repr=False
    )
    # Seal every secret the store keeps (SPEC §12); empty: a generated key file (SQLite only).
    secret_keys: Annotated[tuple[str, ...], Env(_secret_keys, ("SECRET_KEY",))] = field(default=(), repr=False)
    database_url: Annotated[str | None, Env(_database_url)] = field(default=None, repr=False)  # the PostgreSQL store
    result_store: Annotated[str, Env(_result_store)] = ""  # "file" or "nats"; empty: file with SQLite, nats with PostgreSQL
    nats_replicas: Annotated[int, AT_LEAST_ONE] = 1
    kinds: Annotated[tuple[str, ...], Env(_names)] = ()  # more job kinds, 'module:attr' (beside the entry points)
    worker_kinds: Annotated[tuple[str, ...], Env(_names)] = ()  # the kinds a worker serves; empty: all
    worker_kind_concurrency: Annotated[Mapping[str, int], Env(_kind_counts)] = field(default_factory=dict)
    instance: Annotated[str, TEXT] = ""  # this process's name in its log lines (several of a component)

    def __post_init__(self) -> None:
        # The operator's key opens /admin; a tenant's key of the same text would open it too,
        # so whoever holds that tenant's key would be the operator (SPEC §12: a tenant key on
        # /admin is 403). Refused at start, naming the tenant, never the key.
        if self.admin_key is not None and self.admin_key in self.api_keys:
            raise SettingsError(
                f"HERALD_ADMIN_KEY is also the key of tenant {self.api_keys[self.admin_key]!r} in HERALD_API_KEYS: "
                "a tenant's key would open the admin API; give the admin key a value of its own")
        # A key sent in every request's header must not be one that signs links or seals the
        # store's secrets: whoever held that tenant's key could sign any tenant's links (its
        # feed, by its name alone) or open every secret of a copy of the store, and a header
        # is what proxies log. Refused at start, naming the variables, never the key.
        sent = [(f"HERALD_API_KEYS: the key of tenant {tenant!r}", key) for key, tenant in self.api_keys.items()]
        if self.admin_key is not None:
            sent.append(("HERALD_ADMIN_KEY", self.admin_key))
        held = (("HERALD_SIGNING_KEY", self.signing_secrets, "signs every tenant's links"),
                ("HERALD_SECRET_KEY", self.secret_keys, "seals the store's secrets"))
        for who, key in sent:
            for variable, keys, does in held:
                if key in keys:
                    raise SettingsError(f"{who} is also a key of {variable}: a bearer key, sent in every request's "
                                        f"header, would be the key that {does}; give each a value of its own")

    @property
    def db_path(self) -> Path:
        return self.data_dir / "herald.db"

    @property
    def scratch_dir(self) -> Path:
        """Where each process that writes results keeps its scratch files, a directory each (herald.scratch)."""
        return self.data_dir / "scratch"

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
    def first_api_key(self) -> str | None:
        return next(iter(self.api_keys), None)

    @property
    def heartbeat_interval_s(self) -> float:
        # SPEC §9: at least every third of the timeout.
        return max(0.05, self.heartbeat_timeout_s / 3.5)

    def with_changes(self, **changes: object) -> Settings:
        return replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """The settings the HERALD_* variables set; the others keep their defaults."""
        env = os.environ if env is None else env
        hints = get_type_hints(cls, include_extras=True)
        values: dict[str, Any] = {}
        for setting in fields(cls):
            (how,) = (meta for meta in get_args(hints[setting.name])[1:] if isinstance(meta, Env))
            for name in how.names or (setting.name.upper(),):
                raw = env.get(f"HERALD_{name}")
                if raw:
                    values[setting.name] = how.parse(f"HERALD_{name}", raw)
                    break
        return cls(**values)

    def configured_signing_keys(self) -> tuple[bytes, ...]:
        """HERALD_SIGNING_KEY's keys (comma-separated: the first signs, all verify, for
        rotation). Empty: the store keeps a generated one (``JobStore.signing_key``)."""
        return tuple(s.encode() for s in self.signing_secrets)
