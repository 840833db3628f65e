"""2. Poll: ``GET /jobs/{id}`` over ``poll_jobs`` stored jobs, against bare Litestar + aiosqlite.

The jobs are seeded straight into the store before the gateway starts (the rows
``accept`` writes). Each request asks for a random one of them. The baseline is a
primary-key lookup with aiosqlite in the very same file and table, the row as JSON. With
the PostgreSQL store, the same jobs are seeded into the database and into a SQLite file
of the same schema for the baseline, which stays the same reference for both stores.
"""

from __future__ import annotations

import asyncio

from bench.driver import new_jobs, seed_jobs, seed_sqlite
from bench.procs import CpuMeter
from bench.scenario import Context, Outcome
from bench.scenarios.http import get_jobs, saturate
from bench.stats import median
from bench.systems import TENANT, BareApp


def run(ctx: Context) -> Outcome:
    out = Outcome("poll", f"GET /jobs/{{id}} over {ctx.sizes.poll_jobs:,} jobs",
                  "bare Litestar + aiosqlite primary-key lookup (same file)")
    work = ctx.dir("poll")
    herald = ctx.herald("poll")
    herald.data_dir.mkdir(parents=True, exist_ok=True)
    ctx.say(f"poll: seeding {ctx.sizes.poll_jobs:,} jobs ({herald.store})")
    jobs = new_jobs(TENANT, ctx.sizes.poll_jobs)
    ids = asyncio.run(seed_jobs(herald.store_settings(), jobs))
    bare_db = herald.db_path
    if herald.store != "sqlite":  # the baseline's file: the same jobs
        bare_db = work / "bare" / "herald.db"
        asyncio.run(seed_sqlite(bare_db, jobs))
    ids_file = work / f"ids-{herald.store}.txt"
    ids_file.write_text("\n".join(ids) + "\n")
    herald.start_gateway()
    bare = BareApp(ctx.procs, bare_db)
    sample = ids if ctx.wrk else ids[:20_000]  # the Python fallback ships its paths to each process
    h_target, b_target = get_jobs(herald.port, sample, auth=True), get_jobs(bare.port, sample, auth=False)
    h_runs, b_runs = [], []
    for index in range(ctx.sizes.rounds):
        ctx.say(f"poll: round {index + 1}/{ctx.sizes.rounds}")
        meter = CpuMeter({"gateway": herald.gateway(), **ctx.store_meters()}).start()
        h = saturate(ctx, h_target, script="get-random-job", auth=True, workdir=work, ids_file=ids_file)
        h["server_cpu_pct"] = meter.stop()
        meter = CpuMeter({"bare": bare.proc}).start()
        b = saturate(ctx, b_target, script="get-random-job", auth=False, workdir=work, ids_file=ids_file)
        b["server_cpu_pct"] = meter.stop()
        h_runs.append(h)
        b_runs.append(b)
    h_rps = median([r["rps"] for r in h_runs])
    b_rps = median([r["rps"] for r in b_runs])
    out.herald = {"runs": h_runs, "rps": h_rps, "jobs": len(ids)}
    out.baseline = {"runs": b_runs, "rps": b_rps}
    case = f"{len(ids):,} jobs, {ctx.sizes.connections} conns"
    out.row(case, "req/s", h_rps, b_rps, better="higher", unit="req/s")
    out.row(case, "p50", median([r["p50_ms"] for r in h_runs]), median([r["p50_ms"] for r in b_runs]),
            better="lower", unit="ms")
    out.row(case, "p99", median([r["p99_ms"] for r in h_runs]), median([r["p99_ms"] for r in b_runs]),
            better="lower", unit="ms")
    share = h_rps / b_rps if b_rps else 0.0
    out.target("poll >= 70 % of bare + aiosqlite req/s", f"{100 * share:.0f} %", share >= 0.70)
    h_p99, b_p99 = median([r["p99_ms"] for r in h_runs]), median([r["p99_ms"] for r in b_runs])
    out.target("poll p99 <= 2x bare", f"{h_p99:.0f} ms vs {b_p99:.0f} ms", h_p99 <= 2 * b_p99)
    errors = sum(r["errors"] for r in h_runs)
    if errors:
        out.notes.append(f"Herald answered {errors} polls with an error")
    out.notes.append("load: " + ", ".join(f"{r['loadgen']} {r['loadgen_cpu_pct']:.0f} % CPU" for r in h_runs[:1] + b_runs[:1]))
    return out
