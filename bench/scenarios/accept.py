"""1. Accept: ``POST /reports`` → 202 with the durable commit, against a bare Litestar endpoint.

Herald runs a gateway (with its relay publishing every accepted job to JetStream) and no
workers, so jobs pile up queued; the bare endpoint decodes the same body and answers
202. Saturation: ``connections`` keep-alive connections for ``http_s`` seconds, rounds
interleaved, medians reported. Then both get the same fixed offered load, half of
Herald's saturated rate, in an open loop.
"""

from __future__ import annotations

from bench.procs import CpuMeter
from bench.scenario import Context, Outcome
from bench.scenarios.http import fixed_rate, post_report, saturate
from bench.stats import median
from bench.systems import BareApp


def run(ctx: Context) -> Outcome:
    out = Outcome("accept", "POST /reports -> 202 (durable commit)", "bare Litestar POST (same uvicorn: h11, 1 process)")
    work = ctx.dir("accept")
    herald = ctx.herald("accept")
    herald.start_gateway()
    bare = BareApp(ctx.procs, None)
    h_target, b_target = post_report(herald.port, auth=True), post_report(bare.port, auth=False)
    h_runs, b_runs = [], []
    for index in range(ctx.sizes.rounds):
        ctx.say(f"accept: saturation round {index + 1}/{ctx.sizes.rounds}")
        meter = CpuMeter({"gateway": herald.gateway(), "nats": herald.nats.proc, **ctx.store_meters()}).start()
        h = saturate(ctx, h_target, script="post-report", auth=True, workdir=work)
        h["server_cpu_pct"] = meter.stop()
        meter = CpuMeter({"bare": bare.proc}).start()
        b = saturate(ctx, b_target, script="post-report", auth=False, workdir=work)
        b["server_cpu_pct"] = meter.stop()
        h_runs.append(h)
        b_runs.append(b)
    h_rps = median([r["rps"] for r in h_runs])
    b_rps = median([r["rps"] for r in b_runs])
    rate = max(10.0, h_rps / 2)
    ctx.say(f"accept: fixed load {rate:.0f} req/s")
    h_fixed = fixed_rate(ctx, h_target, rate)
    b_fixed = fixed_rate(ctx, b_target, rate)

    out.herald = {"saturation": h_runs, "fixed": h_fixed, "rps": h_rps}
    out.baseline = {"saturation": b_runs, "fixed": b_fixed, "rps": b_rps}
    sat = f"saturation, {ctx.sizes.connections} conns"
    out.row(sat, "req/s", h_rps, b_rps, better="higher", unit="req/s")
    out.row(sat, "p50", median([r["p50_ms"] for r in h_runs]), median([r["p50_ms"] for r in b_runs]),
            better="lower", unit="ms")
    out.row(sat, "p99", median([r["p99_ms"] for r in h_runs]), median([r["p99_ms"] for r in b_runs]),
            better="lower", unit="ms")
    fixed = f"fixed {rate:.0f} req/s"
    out.row(fixed, "p50", h_fixed["p50_ms"], b_fixed["p50_ms"], better="lower", unit="ms")
    out.row(fixed, "p99", h_fixed["p99_ms"], b_fixed["p99_ms"], better="lower", unit="ms")
    share = h_rps / b_rps if b_rps else 0.0
    out.target("accept >= 30 % of bare req/s", f"{100 * share:.0f} %", share >= 0.30)
    out.target("accept p99 < 10 ms at half of Herald's saturated rate", f"{h_fixed['p99_ms']:.1f} ms",
               h_fixed["p99_ms"] < 10)
    errors = sum(r["errors"] for r in h_runs) + h_fixed["errors"]
    if errors:
        out.notes.append(f"Herald answered {errors} requests with an error")
    out.notes.append("load: " + ", ".join(f"{r['loadgen']} {r['loadgen_cpu_pct']:.0f} % CPU" for r in h_runs[:1] + b_runs[:1]))
    herald.stop("gateway")
    return out
