"""``python -m bench [--smoke] [--only accept,poll,...] [--store sqlite|postgres|both] [--shape one|cluster]
[--out bench/out] [--keep] [--without wrk,nchan] [--tracing] [--peers [--rounds N]]``

Starts everything it needs on 127.0.0.1 (own temp dir, free ports), runs each scenario
against Herald and its baseline in the same run, stops everything, prints a table and
writes ``results.json`` and ``results.png`` to the output dir. Exit status 1 if a
scenario failed to run (a missed target is not a failure).

``--store postgres`` runs every scenario against Herald on the PostgreSQL store: the bench
starts a PostgreSQL server (``launcher.pgserver``) in its temp dir on a free port, gives each
deployment a fresh database and stops the server at the end. ``--store both`` runs each
scenario on SQLite, then on PostgreSQL, and prints them side by side: each store's value and
its ratio to the baseline, and PostgreSQL's value as a ratio to SQLite's from the same run.
``--shape cluster`` also runs the end-to-end scenario on ``herald up --cluster`` (3 NATS
nodes, PostgreSQL, 2 gateways, 2 workers, 2 notifiers), beside the one-machine shape.
``--peers`` runs Celery + Redis and arq on the e2e scenario's trivial jobs in the same run
(``bench/peers.py``), and gives Herald's jobs/s and CPU per job as ratios of theirs.
``--rounds N`` makes that N interleaved pairs per store, Herald's burst then each peer's: on
a shared machine one minute can run a third slower than the next, so one pair's ratio says
more about the minutes than the systems; the median of N pairs' ratios is reported.
``--tracing`` exports every Herald process's spans over OTLP/HTTP to a sink process the
bench starts (``bench/otlpsink.py``): tracing on, as against a collector.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench import report
from bench.config import FULL, SMOKE
from bench.otlpsink import OtlpSink
from bench.procs import Procs
from bench.profile import summarize
from bench.pg import BenchPostgres
from bench.scenario import STORES, Context, Outcome
from bench.scenarios import CLUSTER_SHAPED, SCENARIOS
from bench.systems import INSTALL_HINT, nchan_missing
from bench.wrk import wrk_path
from launcher.open_files import raise_open_files_limit

DEFAULT_OUT = Path(__file__).resolve().parent / "out"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description="Herald benchmarks against their baselines")
    parser.add_argument("--smoke", action="store_true", help="every scenario at minimal size (seconds)")
    parser.add_argument("--only", help="comma-separated scenarios: " + ",".join(SCENARIOS))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output dir (default bench/out)")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir with every process's log")
    parser.add_argument("--without", default="", help="act as if these were not installed: wrk,nchan")
    parser.add_argument("--set", action="append", default=[], metavar="HERALD_X=VALUE",
                        help="a setting for every Herald process (experiments, e.g. HERALD_LOG_LEVEL=warning)")
    parser.add_argument("--profile", default="", help="py-spy these Herald roles: gateway,worker,notifier "
                        "(raw stacks in <out>/profiles/, summaries printed)")
    parser.add_argument("--store", choices=("sqlite", "postgres", "both"), default="sqlite",
                        help="Herald's store: SQLite (default), PostgreSQL (a server the bench starts), or both "
                        "side by side")
    parser.add_argument("--shape", choices=("one", "cluster"), default="one",
                        help="cluster: the e2e scenario also on `herald up --cluster`, beside the one-machine shape")
    parser.add_argument("--pg-set", action="append", default=[], metavar="NAME=VALUE",
                        help="a PostgreSQL server setting for --store postgres/both (what-ifs, e.g. "
                        "synchronous_commit=off)")
    parser.add_argument("--peers", action="store_true",
                        help="e2e also runs Celery + Redis and arq on the same trivial jobs (needs redis-server and "
                        "the bench extra) and gives Herald's rate as a ratio of theirs")
    parser.add_argument("--rounds", type=int, default=1, metavar="N",
                        help="with --peers: N interleaved pairs (Herald's saturation burst, then each peer's, N "
                        "times, Herald's deployment left up and idle meanwhile); rows give medians and the median "
                        "of the pairs' ratios, which a slow minute on one side cannot decide")
    parser.add_argument("--workers", type=int, default=2, metavar="N",
                        help="worker processes of the e2e scenario's one-machine shape (default 2, as herald up): "
                        "how the rate grows with a third where cores allow")
    parser.add_argument("--tracing", action="store_true",
                        help="tracing on: Herald's processes export spans over OTLP/HTTP to a sink the bench starts")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers: at least 1")
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    if args.rounds > 1 and not args.peers:
        parser.error("--rounds pairs Herald's bursts with the peers': it needs --peers")
    names = list(SCENARIOS) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(unknown)}")

    without = {w.strip() for w in args.without.split(",") if w.strip()}
    raise_open_files_limit()
    sizes = SMOKE if args.smoke else FULL
    missing = []
    have_wrk = wrk_path() is not None and "wrk" not in without
    if not have_wrk:
        missing.append("wrk (the HTTP scenarios fall back to the Python load client)")
    nchan = nchan_missing() or (f"nginx + nchan disabled by --without; {INSTALL_HINT}" if "nchan" in without else None)
    if nchan:
        missing.append("nginx + nchan (the SSE and long-poll baselines are unavailable)")
    if missing and not args.smoke:
        print(f"note: missing {'; '.join(missing)}; {INSTALL_HINT}", file=sys.stderr)

    root = Path(tempfile.mkdtemp(prefix="herald-bench-"))
    results: list[dict] = []
    failed = False
    started = time.monotonic()
    overrides = dict(item.split("=", 1) for item in args.set)
    if any(not k.startswith("HERALD_") for k in overrides):
        parser.error("--set takes HERALD_* settings")
    roles = frozenset(r.strip() for r in args.profile.split(",") if r.strip())
    stores = list(STORES) if args.store == "both" else [args.store]
    pg_settings = dict(item.split("=", 1) for item in args.pg_set)
    postgres = BenchPostgres(root / "postgres", pg_settings) if "postgres" in stores else None
    sink = OtlpSink(root / "logs" / "otlp-sink.log") if args.tracing else None
    if sink is not None:
        sink.__enter__()
        overrides.update(OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint)
    try:
        with Procs(root / "logs", profile=roles, profile_dir=args.out / "profiles" if roles else None) as procs:
            ctx = Context(sizes=sizes, root=root, procs=procs, smoke=args.smoke, wrk=have_wrk, nchan_missing=nchan,
                          herald_env=overrides, postgres=postgres, peers=args.peers,
                          workers=args.workers, rounds=args.rounds)
            for name in names:
                # Each scenario on each store in turn (interleaved: noise hits the stores alike).
                variants = [(store, "one") for store in stores]
                if args.shape == "cluster" and name in CLUSTER_SHAPED:
                    variants.append(("postgres", "cluster"))
                for store, shape in variants:
                    ctx.store, ctx.shape = store, shape
                    ctx.say(f"scenario {name}" + (f" ({ctx.variant})" if len(variants) > 1 or store != "sqlite" else ""))
                    t0 = time.monotonic()
                    try:
                        outcome = SCENARIOS[name](ctx)
                    except Exception as exc:  # one broken scenario must not hide the others' numbers
                        failed = True
                        traceback.print_exc()
                        outcome = Outcome(name, name, "-")
                        outcome.error = f"{type(exc).__name__}: {exc}"
                        outcome.baseline_unavailable("the scenario failed")
                    finally:
                        procs.stop_all()
                    outcome.store, outcome.shape = store, shape
                    outcome.elapsed_s = time.monotonic() - t0
                    results.append(outcome.as_dict())
        postgres_info = postgres.describe() if postgres is not None else {}
    finally:
        if postgres is not None:
            postgres.stop()
        if sink is not None:
            sink.__exit__(None, None, None)

    document = {
        "mode": "smoke" if args.smoke else "full",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - (time.monotonic() - started))),
        "elapsed_s": round(time.monotonic() - started, 1),
        "environment": report.environment(),
        "tools": {"wrk": have_wrk, "nchan": nchan is None},
        "herald_settings": overrides,
        "tracing": sink.counts() if sink is not None else False,
        "stores": stores,
        "shape": args.shape,
        "postgres": postgres_info,
        "scenarios": results,
        "comparison": report.compare(results),
    }
    out_json = args.out / "results.json"
    report.write_json(out_json, document)
    chart_note = report.chart(args.out / "results.png", results)
    print()
    print(report.table(results))
    print()
    if document["comparison"]:
        print("stores and shapes side by side (each value's ratio to its same-run baseline in brackets; "
              "the last columns: ratio to SQLite's value, same run):")
        print(report.comparison_table(document["comparison"]))
        print()
    print("targets:")
    print(report.targets(results))
    print()
    notes = report.notes(results)
    if notes:
        print("notes:")
        print(notes)
        print()
    if sink is not None:
        print(f"tracing on: the OTLP sink received {document['tracing']}")
    print(f"wrote {out_json}" + (f" ({chart_note})" if chart_note else f" and {args.out / 'results.png'}"))
    if roles:
        time.sleep(1.0)  # py-spy writes its file once its target has exited
        for path in procs.profiles:
            if path.exists():
                print()
                print(summarize(path, top=15))
    if missing:
        print(f"note: missing {'; '.join(missing)}; {INSTALL_HINT}")
    if args.keep or failed:
        print(f"logs kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
