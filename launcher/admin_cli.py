"""``herald tenants create|list|update``, ``herald keys create|list|revoke`` and ``herald audit``:
the admin API (SPEC §12) over HTTP, through herald_client's ``HeraldAdmin``.

The server is ``--url``, else ``HERALD_URL``, else the local default. The key is
``HERALD_ADMIN_KEY`` and nothing else: a flag would put the operator's key in shell
history and in every process listing. Tables go to stdout, or with ``--json`` JSON (to
compose with ``jq``); errors go to stderr with exit status 1 (2: the command cannot run
at all), and never carry a key.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import msgspec

from herald.settings import Settings, SettingsError, in_clear_beyond_this_machine
from herald.tenants import ALL_SCOPES

if TYPE_CHECKING:
    from rich.console import Console

    from herald_client import ApiKey, AuditEntry, CreatedKey, HeraldAdmin, Tenant

AdminHandler = Callable[["HeraldAdmin", argparse.Namespace, "Output"], int]

LIMIT_FLAGS = ("rate_limit", "max_running", "max_endpoints", "max_streams")


def add_admin_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help="Herald's base URL (HERALD_URL, default http://127.0.0.1:8000)")
    common.add_argument("--json", action="store_true", help="print JSON instead of a table")
    common.add_argument("--allow-http", action="store_true",
                        help="send the admin key over plain http:// to a host that is not this machine")
    limits = argparse.ArgumentParser(add_help=False)
    limits.add_argument("--rate-limit", type=_finite, metavar="N", help="job starts per second (burst: twice that; 0: no limit)")
    limits.add_argument("--max-running", type=int, metavar="N", help="jobs running at once (0: no cap)")
    limits.add_argument("--max-endpoints", type=int, metavar="N", help="webhook endpoints")
    limits.add_argument("--max-streams", type=int, metavar="N", help="event streams and long polls held at once")

    tenants = sub.add_parser("tenants", help="create, list and change tenants (admin API, HERALD_ADMIN_KEY)")
    verbs = tenants.add_subparsers(dest="action", required=True)
    create = verbs.add_parser("create", parents=[common, limits],
                              help="add a tenant (limits not given: the deployment's defaults)")
    create.add_argument("id", type=_an_id, help="^[a-z0-9][a-z0-9_-]{0,62}$")
    create.set_defaults(handler=_admin(_tenants_create))
    verbs.add_parser("list", parents=[common], help="every tenant with its limits").set_defaults(
        handler=_admin(_tenants_list))
    update = verbs.add_parser("update", parents=[common, limits], help="change limits, disable or enable")
    update.add_argument("id", type=_an_id)
    state = update.add_mutually_exclusive_group()
    state.add_argument("--disable", dest="disabled", action="store_const", const=True,
                       help="its keys and portal sessions get 401; its running jobs finish")
    state.add_argument("--enable", dest="disabled", action="store_const", const=False)
    update.set_defaults(handler=_admin(_tenants_update))

    keys = sub.add_parser("keys", help="create, list and revoke tenants' API keys (admin API, HERALD_ADMIN_KEY)")
    verbs = keys.add_subparsers(dest="action", required=True)
    create = verbs.add_parser("create", parents=[common], help="a new key for a tenant, printed this once")
    create.add_argument("tenant", type=_an_id)
    create.add_argument("--name", required=True, help="what the key is for (1..100 characters)")
    create.add_argument("--scope", dest="scopes", action="append", choices=ALL_SCOPES,
                        help="repeat for several (default: all)")
    create.add_argument("--expires-at", type=_rfc3339, metavar="RFC3339",
                        help="e.g. 2027-01-31T00:00:00Z (default: never)")
    create.set_defaults(handler=_admin(_keys_create))
    listing = verbs.add_parser("list", parents=[common], help="a tenant's keys, with when each was last used")
    listing.add_argument("tenant", type=_an_id)
    listing.set_defaults(handler=_admin(_keys_list))
    revoke = verbs.add_parser("revoke", parents=[common], help="revoke a key: 401 everywhere within 2 s")
    revoke.add_argument("key_id", type=_an_id)
    revoke.set_defaults(handler=_admin(_keys_revoke))

    audit = sub.add_parser("audit", parents=[common], help="the admin API's audit log, newest first")
    audit.add_argument("--limit", type=_positive, default=50, metavar="N", help="entries to show (default 50)")
    audit.set_defaults(handler=_admin(_audit))


def _an_id(value: str) -> str:
    """A tenant or key id: not empty, which would drop out of the request's path."""
    if not value:
        raise argparse.ArgumentTypeError("must not be empty")
    return value


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value!r}")
    return number


def _finite(value: str) -> float:
    """A number JSON can carry: ``inf``, ``nan`` or ``1e309`` would go out as null, "the default"."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {value!r}")
    return number


def _rfc3339(value: str) -> str:
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an RFC 3339 time: {value!r}") from None
    if parsed.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{value!r} needs a UTC offset (e.g. Z or +02:00)")
    return value


# ----- plumbing -----------------------------------------------------------------------------


class Output:
    """Where a command's answer goes: a table (rich) or JSON, on stdout."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self._console: Console | None = None

    @property
    def console(self) -> Console:
        from rich.console import Console

        if self._console is None:
            # Piped (grep, a file): whole rows, one line each, however wide; on a terminal, its width.
            self._console = Console(highlight=False, width=None if sys.stdout.isatty() else 240)
        return self._console

    def json(self, value: Any) -> None:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(value), indent=2).decode() + "\n")
        sys.stdout.flush()

    def table(self, columns: Iterable[str], rows: Iterable[Iterable[str]]) -> None:
        from rich import box
        from rich.table import Table
        from rich.text import Text

        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        for index, column in enumerate(columns):
            table.add_column(column, no_wrap=index == 0)  # an id stays whole, to copy and paste
        for row in rows:
            table.add_row(*(Text(cell) for cell in row))  # server text is never rich markup
        self.console.print(table)

    def line(self, text: str) -> None:
        print(text, flush=True)


def _fail(message: str, hint: str | None = None) -> int:
    print(f"herald: {message}", file=sys.stderr)
    if hint:
        print(f"  {hint}", file=sys.stderr)
    return 1


def _admin(handler: AdminHandler) -> Callable[[argparse.Namespace], int]:
    """Run ``handler`` with a ``HeraldAdmin``; turn every failure into a message and an exit status."""

    def run(args: argparse.Namespace) -> int:
        try:
            from herald_client import (
                Forbidden,
                HeraldAdmin,
                HeraldConnectionError,
                HeraldError,
                Policy,
                Unauthorized,
            )
        except ImportError:
            print("herald: the client package is not installed: pip install -e ./client", file=sys.stderr)
            return 2
        try:
            settings = Settings.from_env()
        except SettingsError as exc:
            print(f"herald: {exc}", file=sys.stderr)
            return 2
        if not settings.admin_key:
            from launcher.supervisor import ADMIN_KEY_FILE

            print("herald: HERALD_ADMIN_KEY is not set: these commands need the operator's admin key "
                  f"(`herald up` prints it and keeps it in {settings.data_dir / ADMIN_KEY_FILE})", file=sys.stderr)
            return 2
        url = args.url or settings.url
        if not args.allow_http and in_clear_beyond_this_machine(url):
            print(f"herald: {url} is plain http:// to another machine: the admin key would cross the network "
                  "readable by anyone on the way", file=sys.stderr)
            print("  use the gateway's https:// URL (or a tunnel to 127.0.0.1), or --allow-http if the network "
                  "is yours alone", file=sys.stderr)
            return 2
        try:
            # An operator at a prompt: three tries, not the library's patient six.
            with HeraldAdmin(url, settings.admin_key, policy=Policy(attempts=3)) as admin:
                return handler(admin, args, Output(args.json))
        except HeraldConnectionError as exc:
            return _fail(f"cannot reach Herald at {url}: {exc}", "is it running? (--url or HERALD_URL)")
        except Unauthorized as exc:
            return _fail(str(exc), "the admin key was refused: HERALD_ADMIN_KEY must be the gateway's own "
                                   "(a gateway without one has the admin API off)")
        except Forbidden as exc:
            return _fail(str(exc), "HERALD_ADMIN_KEY holds a tenant's key, not the admin key")
        except HeraldError as exc:  # 400 naming the field, 404, 409, 5xx, …
            return _fail(str(exc))
        except KeyboardInterrupt:
            return 130

    return run


def _limits(args: argparse.Namespace) -> dict[str, float] | None:
    given = {name: getattr(args, name) for name in LIMIT_FLAGS if getattr(args, name) is not None}
    return given or None


# ----- rendering ----------------------------------------------------------------------------


def _cap(value: float, zero: str | None = None) -> str:
    """A limit as the table shows it; ``zero``: what 0 means where it is no limit at all."""
    return zero if zero is not None and value == 0 else f"{value:g}"


def _when(value: str | None, never: str = "-") -> str:
    """An RFC 3339 time as a table shows it: UTC, to the minute."""
    if not value:
        return never
    try:
        return datetime.fromisoformat(value).astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M")
    except ValueError:
        return value


def _tenant_rows(tenants: Iterable[Tenant]) -> Iterable[list[str]]:
    for t in tenants:
        limits = t.limits
        # A rate or a running cap of 0 is no limit; no endpoints or streams at all is 0 (README).
        yield [t.id, t.source, "disabled" if t.disabled else "enabled", _cap(limits.rate_limit, "no limit"),
               _cap(limits.max_running, "no cap"), _cap(limits.max_endpoints), _cap(limits.max_streams),
               _when(t.created_at)]


TENANT_COLUMNS = ("ID", "SOURCE", "STATE", "STARTS/S", "RUNNING", "ENDPOINTS", "STREAMS", "CREATED (UTC)")
KEY_COLUMNS = ("ID", "NAME", "SCOPES", "CREATED (UTC)", "EXPIRES", "LAST USED")


def _key_rows(keys: Iterable[ApiKey]) -> Iterable[list[str]]:
    for k in keys:
        yield [k.id, k.name, ",".join(k.scopes), _when(k.created_at), _when(k.expires_at, "never"),
               _when(k.last_used_at, "never")]


def _show_tenant(out: Output, tenant: Tenant) -> None:
    if out.as_json:
        out.json(tenant)
    else:
        out.table(TENANT_COLUMNS, _tenant_rows([tenant]))


# ----- commands -----------------------------------------------------------------------------


def _tenants_create(admin: HeraldAdmin, args: argparse.Namespace, out: Output) -> int:
    _show_tenant(out, admin.create_tenant(args.id, _limits(args)))
    return 0


def _tenants_list(admin: HeraldAdmin, args: argparse.Namespace, out: Output) -> int:
    tenants = list(admin.list_tenants())
    if out.as_json:
        out.json(tenants)
    else:
        out.table(TENANT_COLUMNS, _tenant_rows(tenants))
    return 0


def _tenants_update(admin: HeraldAdmin, args: argparse.Namespace, out: Output) -> int:
    limits = _limits(args)
    if limits is None and args.disabled is None:
        print("herald: nothing to change: give a limit (--rate-limit, --max-running, --max-endpoints, "
              "--max-streams), --disable or --enable", file=sys.stderr)
        return 2
    _show_tenant(out, admin.update_tenant(args.id, limits=limits, disabled=args.disabled))
    return 0


def _keys_create(admin: HeraldAdmin, args: argparse.Namespace, out: Output) -> int:
    created: CreatedKey = admin.create_key(args.tenant, args.name, scopes=args.scopes, expires_at=args.expires_at)
    if out.as_json:
        out.json(created)
        return 0
    out.table(KEY_COLUMNS, _key_rows([created]))
    out.line(f"\n{created.key}\n")
    out.line(f"This is the only time the key is shown: store it now. Revoke it with `herald keys revoke {created.id}`.")
    return 0


def _keys_list(admin: HeraldAdmin, args: argparse.Namespace, out: Output) -> int:
    keys = list(admin.list_keys(args.tenant))
    if out.as_json:
        out.json(keys)
    else:
        out.table(KEY_COLUMNS, _key_rows(keys))
    return 0


def _keys_revoke(admin: HeraldAdmin, args: argparse.Namespace, out: Output) -> int:
    admin.revoke_key(args.key_id)
    if out.as_json:
        out.json({"id": args.key_id, "revoked": True})
    else:
        out.line(f"revoked {args.key_id}: it gets 401 on every gateway within 2 s")
    return 0


def _audit(admin: HeraldAdmin, args: argparse.Namespace, out: Output) -> int:
    entries: list[AuditEntry] = list(itertools.islice(admin.audit(), args.limit))
    if out.as_json:
        out.json(entries)
    else:
        out.table(("AT", "ACTION", "TENANT", "KEY", "DETAIL"),
                  ([_when(e.at), e.action, e.tenant or "", e.key_id or "",
                    msgspec.json.encode(e.detail).decode() if e.detail else ""] for e in entries))
    return 0
