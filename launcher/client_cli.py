"""``herald submit | status | watch | cancel | download``: the command line on top of herald_client.

The server and key come from ``--url`` / ``--key``, else ``HERALD_URL`` / ``HERALD_API_KEY``
(read into the one ``Settings``), else the local dev defaults. Results go to stdout (status objects as JSON, so the
commands compose with ``jq``); progress and errors go to stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import msgspec

from herald.settings import DEV_KEY as DEFAULT_KEY, Settings, SettingsError, bearer_key_problem, in_clear_beyond_this_machine

DEFAULT_URL = Settings().url

Handler = Callable[[argparse.Namespace], int]


def add_client_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help=f"Herald's base URL (HERALD_URL, default {DEFAULT_URL})")
    common.add_argument("--key", type=_bearer_key, help=f"API key (HERALD_API_KEY, default {DEFAULT_KEY})")
    common.add_argument("--allow-http", action="store_true",
                        help="send the API key over plain http:// to a host that is not this machine")

    submit = sub.add_parser("submit", help="start a job and print its status")
    kinds = submit.add_subparsers(dest="kind", required=True)
    options = argparse.ArgumentParser(add_help=False, parents=[common])
    options.add_argument("--idempotency-key", help="default: a fresh UUID (a lost answer is retried safely)")
    options.add_argument("--callback-url", help="https URL that receives this job's webhooks")
    options.add_argument("--wait", action="store_true", help="wait for the job to end and print the final status")
    report = kinds.add_parser("report", parents=[options], help="a PDF report")
    report.add_argument("--title", required=True)
    report.add_argument("--pages", type=int, required=True)
    report.add_argument("--fail-on-page", type=int, help="demo knob: rendering fails on this page")
    report.set_defaults(handler=_guarded(_submit), params=_report_params)
    export = kinds.add_parser("export", parents=[options], help="a CSV or NDJSON export")
    export.add_argument("--format", choices=("csv", "ndjson"), required=True)
    export.add_argument("--rows", type=int, required=True)
    export.set_defaults(handler=_guarded(_submit), params=_export_params)

    status = sub.add_parser("status", parents=[common], help="print a job's status")
    status.add_argument("id")
    status.set_defaults(handler=_guarded(_status))
    watch = sub.add_parser("watch", parents=[common], help="follow a job live with a progress bar")
    watch.add_argument("id")
    watch.add_argument("--output", action="store_true",
                       help="print the job's streamed output as it comes (strings as they are, other values "
                            "as JSON lines), resuming after drops; the final state goes to stderr")
    watch.set_defaults(handler=_guarded(_watch))
    cancel = sub.add_parser("cancel", parents=[common], help="cancel a job")
    cancel.add_argument("id")
    cancel.set_defaults(handler=_guarded(_cancel))
    download = sub.add_parser("download", parents=[common], help="save a finished job's result")
    download.add_argument("id")
    download.add_argument("-o", "--output", help="file or directory (default: the name the server gives, here)")
    download.set_defaults(handler=_guarded(_download))


def _bearer_key(value: str) -> str:
    """``--key``, refused as ``HERALD_API_KEY`` is (never echoed: argparse would print it)."""
    if problem := bearer_key_problem(value):
        raise argparse.ArgumentTypeError(problem)
    return value


# ----- plumbing -----------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> Any:
    from herald_client import HeraldClient

    settings = Settings.from_env()
    url = args.url or settings.url
    if not args.allow_http and in_clear_beyond_this_machine(url):
        # The admin CLI's rule (launcher/admin_cli.py): a tenant's key is as worth stealing.
        raise SettingsError(
            f"{url} is plain http:// to another machine: the API key would cross the network readable by "
            "anyone on the way; use the gateway's https:// URL (or a tunnel to 127.0.0.1), or --allow-http "
            "if the network is yours alone")
    return HeraldClient(url, args.key or settings.api_key)


def _guarded(handler: Handler) -> Handler:
    """Turn the client's errors into a message on stderr and exit status 1."""

    def run(args: argparse.Namespace) -> int:
        try:
            from herald_client import HeraldError
        except ImportError:
            print("herald: the client package is not installed: pip install -e ./client", file=sys.stderr)
            return 2
        try:
            return handler(args)
        except HeraldError as exc:
            print(f"herald: {exc}", file=sys.stderr)
            return 1
        except SettingsError as exc:
            print(f"herald: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130

    return run


def _print_status(status: Any) -> None:
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(status), indent=2).decode() + "\n")
    sys.stdout.flush()


def _report_params(args: argparse.Namespace) -> dict[str, Any]:
    return {"title": args.title, "pages": args.pages, "fail_on_page": args.fail_on_page}


def _export_params(args: argparse.Namespace) -> dict[str, Any]:
    return {"format": args.format, "rows": args.rows}


def _exit_code(status: Any) -> int:
    return 0 if status.state == "succeeded" else 1


# ----- commands -----------------------------------------------------------------------------


def _submit(args: argparse.Namespace) -> int:
    from herald_client import AUTO

    params = {k: v for k, v in args.params(args).items() if v is not None}
    if args.callback_url:
        params["callback_url"] = args.callback_url
    with _client(args) as herald:
        status = herald.submit(args.kind, params, idempotency_key=args.idempotency_key or AUTO)
        if args.wait:
            status = herald.wait(status)
        _print_status(status)
    return _exit_code(status) if args.wait else 0


def _status(args: argparse.Namespace) -> int:
    with _client(args) as herald:
        _print_status(herald.status(args.id))
    return 0


def _cancel(args: argparse.Namespace) -> int:
    with _client(args) as herald:
        _print_status(herald.cancel(args.id))
    return 0


def _download(args: argparse.Namespace) -> int:
    with _client(args) as herald:
        saved = herald.download(args.id, args.output)
    print(saved.path)
    return 0


def _watch_output(args: argparse.Namespace) -> int:
    import json

    from herald_client import JobStatus

    with _client(args) as herald:
        text_open = False  # strings are text being written: printed as they are, newline at the end
        for chunk in herald.output(args.id):
            if isinstance(chunk.data, str):
                sys.stdout.write(chunk.data)
                text_open = True
            else:
                sys.stdout.write(("\n" if text_open else "") + json.dumps(chunk.data) + "\n")
                text_open = False
            sys.stdout.flush()
        if text_open:
            sys.stdout.write("\n")
        final: JobStatus = herald.status(args.id)
    detail = f" ({final.error.type}: {final.error.title})" if final.error is not None else ""
    print(f"job {final.id} {final.state}{detail}", file=sys.stderr)
    return _exit_code(final)


def _watch(args: argparse.Namespace) -> int:
    if getattr(args, "output", False):
        return _watch_output(args)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    from herald_client import HeraldConnectionError, ProblemError

    console = Console(stderr=True)
    with _client(args) as herald:
        final = herald.status(args.id)
        with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                      console=console) as bar:
            task = bar.add_task("", total=100)

            def show(status: Any) -> None:
                nonlocal final
                final = status
                done = 100 if status.state == "succeeded" else status.progress
                bar.update(task, completed=done or 0, description=f"{status.kind} {status.id[:8]} {status.state}")

            show(final)
            if not final.terminal:
                try:
                    for event in herald.stream(final, last_event_id=str(final.version)):
                        show(event.data)
                except (ProblemError, HeraldConnectionError) as exc:
                    # No stream (an older server, a proxy that buffers, the held-connection
                    # cap): the status resource is the source of truth, so poll it instead.
                    console.print(f"[dim]stream unavailable ({exc}); polling[/dim]")
                if not final.terminal:
                    herald.wait(final, on_update=show)
    detail = f" ({final.error.type}: {final.error.title})" if final.error is not None else ""
    result = f" result: {final.result}" if final.result else ""
    print(f"job {final.id} {final.state}{detail}{result}")
    return _exit_code(final)
