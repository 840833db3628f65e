"""1. Accept: ``POST /reports`` → 202 with the durable commit, against a bare Litestar endpoint.

Herald runs a gateway (with its relay publishing every accepted job to JetStream) and no
workers, so jobs pile up queued; the bare endpoint decodes the same body and answers
202. Saturation: ``connections`` keep-alive connections for ``http_s`` seconds, rounds
interleaved, medians reported. Then both get the same fixed offered load, half of
Herald's saturated rate, in an open loop.

Scaling: in the same rounds, a second deployment runs ``GATEWAYS`` gateways sharing one
port (``HERALD_HTTP_REUSE_PORT``, the kernel spreads connections), against as many bare
processes sharing one port; the rows say how accept grows from one gateway process to two.
"""

from __future__ import annotations

from bench.pg import PgWaits
from bench.procs import CpuMeter
from bench.scenario import Context, Outcome
from bench.scenarios.http import fixed_rate, post_report, saturate
from bench.stats import median
from bench.systems import BareApp

GATEWAYS = 2  # the scaling rows: this many gateway processes sharing one port


def run(ctx: Context) -> Outcome:
    out = Outcome("accept", "POST /reports -> 202 (durable commit)",
                  "bare Litestar POST (same uvicorn: httptools, 1 process; 2 on one port for the scaling rows)")
    work = ctx.dir("accept")
    herald = ctx.herald("accept")
    herald.start_gateway()
    bare = BareApp(ctx.procs, None)
    # Scaling: a second deployment whose gateways share one port (SO_REUSEPORT), against as many
    # bare processes on one port; measured in the same rounds as the single gateway.
    many = ctx.herald("accept-gateways")
    many.start_gateways(GATEWAYS)
    bare_many = BareApp(ctx.procs, None, name="bare-litestar-shared", processes=GATEWAYS)
    h_target, b_target = post_report(herald.port, auth=True), post_report(bare.port, auth=False)
    hm_target, bm_target = post_report(many.port, auth=True), post_report(bare_many.port, auth=False)
    h_runs, b_runs, hm_runs, bm_runs = [], [], [], []
    for index in range(ctx.sizes.rounds):
        ctx.say(f"accept: saturation round {index + 1}/{ctx.sizes.rounds}")
        meter = CpuMeter({"gateway": herald.gateway(), "nats": herald.nats.proc, **ctx.store_meters()}).start()
        with PgWaits(herald.database_url) as waits:
            h = saturate(ctx, h_target, script="post-report", auth=True, workdir=work)
        h["server_cpu_pct"] = meter.stop()
        if herald.database_url:
            h["postgres_waits"] = waits.summary()
        meter = CpuMeter({"bare": bare.proc}).start()
        b = saturate(ctx, b_target, script="post-report", auth=False, workdir=work)
        b["server_cpu_pct"] = meter.stop()
        h_runs.append(h)
        b_runs.append(b)
        ctx.say(f"accept: {GATEWAYS} gateways on one port, round {index + 1}/{ctx.sizes.rounds}")
        meter = CpuMeter({**many.gateways(), "nats": many.nats.proc, **ctx.store_meters()}).start()
        hm = saturate(ctx, hm_target, script="post-report", auth=True, workdir=work)
        hm["server_cpu_pct"] = meter.stop()
        meter = CpuMeter({f"bare{i + 1}": p for i, p in enumerate(bare_many.procs)}).start()
        bm = saturate(ctx, bm_target, script="post-report", auth=False, workdir=work)
        bm["server_cpu_pct"] = meter.stop()
        hm_runs.append(hm)
        bm_runs.append(bm)
    for name in list(many.gateways()):
        many.stop(name)
    h_rps = median([r["rps"] for r in h_runs])
    b_rps = median([r["rps"] for r in b_runs])
    own_rate = max(10.0, h_rps / 2)
    # With several stores in one run, all get the first one's fixed load: p99s at one offered load.
    rate = ctx.shared.setdefault("accept.fixed_rate", own_rate)
    ctx.say(f"accept: fixed load {rate:.0f} req/s")
    h_fixed = fixed_rate(ctx, h_target, rate)
    b_fixed = fixed_rate(ctx, b_target, rate)

    hm_rps = median([r["rps"] for r in hm_runs])
    bm_rps = median([r["rps"] for r in bm_runs])
    out.herald = {"saturation": h_runs, "fixed": h_fixed, "rps": h_rps, "half_saturated_rps": round(own_rate, 1),
                  "gateways": {"count": GATEWAYS, "saturation": hm_runs, "rps": hm_rps}}
    if herald.database_url:
        out.notes.append("saturation, " + waits.note())
    out.baseline = {"saturation": b_runs, "fixed": b_fixed, "rps": b_rps,
                    "processes": {"count": GATEWAYS, "saturation": bm_runs, "rps": bm_rps}}
    sat = f"saturation, {ctx.sizes.connections} conns"
    out.row(sat, "req/s", h_rps, b_rps, better="higher", unit="req/s")
    out.row(sat, "p50", median([r["p50_ms"] for r in h_runs]), median([r["p50_ms"] for r in b_runs]),
            better="lower", unit="ms")
    out.row(sat, "p99", median([r["p99_ms"] for r in h_runs]), median([r["p99_ms"] for r in b_runs]),
            better="lower", unit="ms")
    fixed = f"fixed {rate:.0f} req/s"
    out.row(fixed, "p50", h_fixed["p50_ms"], b_fixed["p50_ms"], better="lower", unit="ms")
    out.row(fixed, "p99", h_fixed["p99_ms"], b_fixed["p99_ms"], better="lower", unit="ms")
    shared = f"{GATEWAYS} processes on one port"
    out.row(shared, "req/s", hm_rps, bm_rps, better="higher", unit="req/s")
    # Herald's column: 2 gateways; the "baseline" column here is 1 gateway (the rows above):
    # the ratio is how accept throughput grows with a second gateway process.
    out.row(shared, "req/s vs 1 gateway", hm_rps, h_rps, better="higher", unit="req/s")
    out.row(shared, "bare req/s vs 1 bare process", bm_rps, b_rps, better="higher", unit="req/s")
    share = h_rps / b_rps if b_rps else 0.0
    out.target("accept >= 30 % of bare req/s", f"{100 * share:.0f} %", share >= 0.30)
    if rate == own_rate:
        out.target("accept p99 < 10 ms at half of Herald's saturated rate", f"{h_fixed['p99_ms']:.1f} ms",
                   h_fixed["p99_ms"] < 10)
    else:
        out.target("accept p99 < 10 ms at half of Herald's saturated rate", f"{h_fixed['p99_ms']:.1f} ms at "
                   f"{rate:.0f} req/s (the first store's; half of this one's: {own_rate:.0f})", h_fixed["p99_ms"] < 10)
        out.notes.append(f"fixed load at {rate:.0f} req/s, the first store's half-saturated rate, so that the "
                         f"stores' p99s are at one offered load (half of this store's saturated rate: {own_rate:.0f})")
    errors = sum(r["errors"] for r in h_runs) + h_fixed["errors"]
    if errors:
        out.notes.append(f"Herald answered {errors} requests with an error")
    out.notes.append("load: " + ", ".join(f"{r['loadgen']} {r['loadgen_cpu_pct']:.0f} % CPU" for r in h_runs[:1] + b_runs[:1]))
    herald.stop("gateway")
    return out
