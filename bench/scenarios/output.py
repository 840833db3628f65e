"""Streamed output (issue 22): one job emitting 1 000 chunks/s, read live by 100 SSE readers.

Herald: a gateway and a worker of one deployment, the bench's ``ticker`` kind
(``bench/handlers.py``, loaded through ``HERALD_KINDS``). One job is accepted; its readers
(``GET /jobs/{id}/output``, SSE, in a separate client process as in the fan-out scenario)
connect while it waits on a gate file, and are ready once they have the ``retry:`` line.
The bench then opens the gate: the handler emits ``output_chunks`` chunks
``{"i": n, "t": <wall clock>}`` at ``output_rate`` per second with ``ctx.emit_nowait``. The
latency of a chunk at a reader is its arrival minus its stamp (the processes share the
clock): JetStream storing it, its republish to the gateway's one hub subscription, the
frame to each stream, the client reading it. Completeness: each reader got chunks 1..N
exactly once, in order, and then the terminal event (Herald's stream ends there).

Baseline: the same client on one nginx + nchan EventSource channel (one worker process),
the same chunks published by the bench at the same steady rate, each stamped just before
its publish. RSS per reader: the server's peak resident memory while the chunks flow, less
what it held before the readers connected, over the readers (the idle figure, once they are
connected, is kept too).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from bench.procs import BenchError, Proc, http_post_json
from bench.scenario import Context, Outcome
from bench.stats import latency_summary
from bench.subscribers import Result, Subscribers
from bench.systems import API_KEY, AUTH, Herald, Nchan

SETTLE_S = 0.5  # before reading a server's memory once its readers are connected


def _request(port: int, path: str, auth: bool) -> bytes:
    lines = [f"GET {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Accept: text/event-stream"]
    if auth:
        lines.append(f"Authorization: Bearer {API_KEY}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _processes(readers: int) -> int:
    # 100 readers of 1 000 chunks/s are 100 000 frames/s for the client: two processes, so
    # that the client is not what falls behind.
    return 2 if readers >= 50 else 1


def _follow(ctx: Context, subs: Subscribers, server: Proc, opened: int, ended: bool) -> dict[str, Any]:
    """Wait until every reader is done (or the deadline), sampling the server's memory and CPU."""
    sizes = ctx.sizes
    cpu0, t0 = server.cpu_seconds(), time.monotonic()
    peak = server.rss_kib()
    deadline = t0 + sizes.output_chunks / sizes.output_rate + sizes.wait_s
    while subs.settled(sizes.output_chunks, ended) < opened and time.monotonic() < deadline:
        peak = max(peak, server.rss_kib())
        time.sleep(0.1)
    peak = max(peak, server.rss_kib())
    return {"peak_rss_kib": peak, "server_cpu_s": server.cpu_seconds() - cpu0, "wall_s": time.monotonic() - t0}


def _measure(ctx: Context, result: Result, opened: int, ready: int, rss0: int, held_kib: int,
             followed: dict[str, Any], terminal: bool) -> dict[str, Any]:
    chunks, readers = ctx.sizes.output_chunks, ctx.sizes.output_readers
    expected = list(range(1, chunks + 1))
    latencies: list[float] = []
    delivered = duplicates = exact = ended = 0
    first_stamp, last_stamp = float("inf"), float("-inf")
    tail: list[float] = []  # the last tenth of the chunks: does the lag grow as the run goes on?
    for stamps in result.stamps:
        ids = stamps.ids.tolist()
        unique = set(ids)
        delivered += len(unique & set(expected))
        duplicates += len(ids) - len(unique)
        if ids == expected:
            exact += 1
        if terminal and stamps.events[-1:] == ["job.succeeded"]:
            ended += 1
        for n, stamped, arrived in zip(ids, stamps.stamped, stamps.arrived):
            lag = (arrived - stamped) * 1000
            latencies.append(lag)
            if n > chunks - chunks // 10:
                tail.append(lag)
        if stamps.stamped:
            first_stamp = min(first_stamp, min(stamps.stamped))
            last_stamp = max(last_stamp, max(stamps.stamped))
    span = last_stamp - first_stamp
    complete = exact == readers and (ended == readers or not terminal)
    return {
        "readers": readers,
        "ready": ready,
        "opened": opened,
        "chunks": chunks,
        "rate_asked": ctx.sizes.output_rate,
        "rate_emitted": round((chunks - 1) / span, 1) if span > 0 and chunks > 1 else None,
        "delivered": delivered,
        "expected": readers * chunks,
        "completeness": round(delivered / (readers * chunks), 4),
        "readers_exact": exact,  # every chunk once, in order
        "readers_ended": ended if terminal else None,  # then the terminal event
        "duplicates": duplicates,
        "complete": complete,
        **latency_summary(latencies),
        "tail_p50_ms": latency_summary(tail)["p50_ms"],
        "rss_before_mib": round(rss0 / 1024, 1),
        "rss_per_reader_idle_kib": round(held_kib / max(1, ready), 1),
        "rss_per_reader_kib": round((followed["peak_rss_kib"] - rss0) / max(1, ready), 1),
        "server_cpu_pct": round(100 * followed["server_cpu_s"] / max(followed["wall_s"], 1e-9), 1),
        "client_cpu_s": round(result.cpu_s, 2),
        "client_processes": _processes(readers),
        "still_open": result.still_open,
    }


def _herald(ctx: Context) -> dict[str, Any]:
    sizes = ctx.sizes
    herald = ctx.herald("output", HERALD_KINDS="bench.handlers:TICKER")
    gate = ctx.dir("output") / f"gate-{herald.store}"
    gate.unlink(missing_ok=True)
    # Both processes start at once; the job waits on the gate until its readers are connected.
    worker = herald.start_worker(wait=False)
    herald.start_gateway()
    herald.worker_ready(worker)
    status, body = http_post_json(herald.base + "/tickers", {"chunks": sizes.output_chunks,
                                                              "rate": sizes.output_rate, "gate": str(gate)}, AUTH)
    if status != 202 or not isinstance(body, dict):
        raise BenchError(f"POST /tickers answered {status}: {body}")
    job_id = body["id"]
    gateway = herald.gateway()
    rss0 = gateway.rss_kib()
    request = _request(herald.port, f"/jobs/{job_id}/output", True)
    with Subscribers(herald.port, request, sizes.output_readers, mode="sse", ready_frames=1, stamps=True,
                     processes=_processes(sizes.output_readers)) as subs:
        ready = subs.open()
        time.sleep(SETTLE_S)
        held = gateway.rss_kib() - rss0
        gate.touch()
        followed = _follow(ctx, subs, gateway, sizes.output_readers, ended=True)
        result = subs.collect()
    outcome = _measure(ctx, result, sizes.output_readers, ready, rss0, held, followed, terminal=True)
    outcome["gateway_log_dropped"] = gateway.log_text().count("slow SSE client dropped")
    return outcome


def _paced(publish: Callable[[bytes], object], chunks: int, rate: float) -> None:
    """Publish chunks 1..``chunks`` at ``rate`` per second, each stamped just before."""
    encode = msgspec.json.encode
    started = time.monotonic()
    for i in range(1, chunks + 1):
        delay = started + (i - 1) / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        publish(encode({"i": i, "t": time.time()}))


def _nchan(ctx: Context) -> dict[str, Any]:
    sizes = ctx.sizes
    nchan = Nchan(ctx.procs, ctx.dir("output/nchan"))
    try:
        channel = "output"
        rss0 = nchan.proc.rss_kib()
        with Subscribers(nchan.port, _request(nchan.port, f"/sub?id={channel}", False), sizes.output_readers,
                         mode="sse", stamps=True, processes=_processes(sizes.output_readers)) as subs:
            subs.open()
            deadline = time.monotonic() + sizes.wait_s
            while nchan.subscribers(channel) < sizes.output_readers and time.monotonic() < deadline:
                time.sleep(0.05)
            ready = nchan.subscribers(channel)
            time.sleep(SETTLE_S)
            held = nchan.proc.rss_kib() - rss0
            publisher = threading.Thread(target=_paced, name="output-nchan-publisher",
                                         args=(lambda body: nchan.publish(channel, body), sizes.output_chunks,
                                               sizes.output_rate))
            publisher.start()
            followed = _follow(ctx, subs, nchan.proc, sizes.output_readers, ended=False)
            publisher.join()
            result = subs.collect()
        return _measure(ctx, result, sizes.output_readers, ready, rss0, held, followed, terminal=False)
    finally:
        ctx.procs.stop(nchan.proc)


def run(ctx: Context) -> Outcome:
    sizes = ctx.sizes
    out = Outcome("output", f"Streamed output: one job at {sizes.output_rate:,.0f} chunks/s to "
                            f"{sizes.output_readers} SSE readers",
                  "nginx + nchan EventSource (1 worker), same client, same chunks at the same rate")
    if ctx.nchan_missing:
        out.baseline_unavailable(ctx.nchan_missing)
    ctx.say(f"output: Herald, {sizes.output_readers} readers, {sizes.output_chunks} chunks")
    herald = _herald(ctx)
    base: dict[str, Any] = {}
    if not ctx.nchan_missing:
        ctx.say(f"output: nchan, {sizes.output_readers} readers, {sizes.output_chunks} chunks")
        base = _nchan(ctx)
    out.herald = herald
    out.baseline = base
    case = f"{sizes.output_readers} readers, {sizes.output_rate:,.0f} chunks/s"
    out.row(case, "emit->read p50", herald["p50_ms"], base.get("p50_ms"), better="lower", unit="ms")
    out.row(case, "emit->read p99", herald["p99_ms"], base.get("p99_ms"), better="lower", unit="ms")
    out.row(case, "emit->read max", herald["max_ms"], base.get("max_ms"), better="lower", unit="ms")
    out.row(case, "completeness", 100 * herald["completeness"],
            100 * base["completeness"] if base else None, better="higher", unit="%")
    out.row(case, "rate emitted", herald["rate_emitted"], base.get("rate_emitted"), better="higher", unit="/s")
    out.row(case, "RSS/reader", herald["rss_per_reader_kib"], base.get("rss_per_reader_kib"), better="lower",
            unit="KiB")
    out.row(case, "RSS/reader idle", herald["rss_per_reader_idle_kib"], base.get("rss_per_reader_idle_kib"),
            better="lower", unit="KiB")
    out.row(case, "server CPU", herald["server_cpu_pct"], base.get("server_cpu_pct"), better="lower",
            unit="% core")

    exact = f"{herald['readers_exact']}/{herald['readers']} readers"
    out.target("output: every chunk to every reader once, in order, then the terminal event",
               f"{exact}, {herald['readers_ended']} ended", herald["complete"])
    emitted = herald["rate_emitted"] or 0.0
    out.target(f"output: the handler emits {sizes.output_rate:,.0f} chunks/s (emit_nowait)",
               f"{emitted:,.0f}/s", emitted >= 0.95 * sizes.output_rate)
    worst = herald["p99_ms"]
    if base:
        out.target("output p99 <= 2x nchan (issue 9's SSE fan-out target)",
                   f"{worst:.1f} ms vs {base['p99_ms']:.1f} ms", worst <= 2 * base["p99_ms"])
    else:
        out.target("output p99 <= 2x nchan (issue 9's SSE fan-out target)", f"{worst:.1f} ms, nchan n/a", None)
    if herald["gateway_log_dropped"]:
        cut = herald["readers"] - (herald["readers_ended"] or 0)
        out.notes.append(f"the gateway logged {herald['gateway_log_dropped']} 'slow SSE client dropped'; "
                         f"{cut} reader(s) lost their stream before the terminal event")
    if herald["tail_p50_ms"] > 4 * max(herald["p50_ms"], 1.0):
        out.notes.append(f"Herald's lag grows as the run goes on (p50 {herald['p50_ms']:.1f} ms overall, "
                         f"{herald['tail_p50_ms']:.1f} ms over the last tenth of the chunks): it falls behind the rate")
    return out

