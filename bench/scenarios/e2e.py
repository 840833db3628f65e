"""6. End to end: trivial jobs accepted → succeeded → webhook delivered, against the JetStream ceiling.

Herald as ``herald up`` runs it (a gateway, two workers of default concurrency, a
notifier), trivial jobs: the bench's ``echo`` kind (``bench/handlers.py``), which returns
``{"n": n}`` as its JSON result at once, as the peers' tasks do; one webhook endpoint for
``job.succeeded`` on the verifying receiver, and one tenant SSE stream open. Each job is
three events (queued, running, succeeded).

* Saturation: ``e2e_jobs`` starts as fast as 16 connections get them answered; jobs/s
  from the first start sent to the last ``job.succeeded`` delivery received, and each
  job's start → delivery latency. One tenant SSE stream watches: did it get every event?
* Ten tenants: the same number of starts as fast as 16 connections go, spread at random
  over ``e2e_tenants`` tenants (each with its own webhook endpoint): jobs/s as above, and
  its ratio to the one tenant's rate (issue 24: one tenant's rate must not be capped by
  a per-tenant serialisation, such as a counter row held through each commit's flush).
  Every tenant's first job runs before either burst (a tenant's first job of a kind
  makes its work consumer, which neither burst should pay for).
* Fixed load: each of ``e2e_rates`` starts/s for ``e2e_fixed_s`` (open loop; a rate above
  80 % of the saturated rate is skipped, but for the lowest: it would measure a growing
  queue); commit → SSE
  (every event on the tenant stream) and commit → webhook (``job.succeeded``), the
  commit time being the status object's ``updated_at`` (millisecond precision).

Shapes (``--shape``): ``one`` is the above, on the run's store (SQLite or PostgreSQL);
``cluster`` is ``herald up --cluster`` itself (3 NATS nodes at R3, PostgreSQL, 2 gateways,
2 workers, 2 notifiers, each with its own data dir), started in the run's temp dir on free
ports, the starts sent to the first gateway, the webhook registered there, and the tenant
stream read on the second gateway (so every event crosses NATS between gateways).

Baseline: nats-py publish+consume through JetStream on a single nats-server
(``bench/natsceiling.py``): the rate one message per job could reach.

Peers (``--peers``): Celery + Redis and arq on the same trivial job, two worker processes
each, the same number of jobs (``bench/peers.py`` says what is measured on their side), each
run right after one of Herald's saturation bursts, with Herald's deployment up and idle:
``--rounds N`` such pairs per store and shape (default 1; N bursts, the first being the
saturation phase above). Rows give the medians and the median of the pairs' ratios, on which
the target is judged: on a shared machine one minute can run a third slower than the next,
and a single pair's ratio says more about its two minutes than about the systems.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec

from bench import httpclient, natsceiling, peers
from bench.pg import PgWaits
from bench.procs import BenchError, CpuMeter, free_port, http_post_json, wait_until
from bench.receiver import Receiver
from bench.scenario import Context, Outcome
from bench.scenarios.webhooks import _register
from bench.stats import latency_summary, median
from bench.subscribers import Subscribers
from bench.systems import API_KEY, TENANT, ClusterHerald, Herald
from herald.settings import Settings


KINDS = "bench.handlers:ECHO"
EVENTS_PER_JOB = 3  # queued, running, succeeded


def post_echo(port: int, key: str = API_KEY) -> httpclient.Target:
    """``POST /echoes {"n": 1}`` with a tenant's key (the bench tenant's unless said)."""
    headers = (("Content-Type", "application/json"), ("Authorization", f"Bearer {key}"))
    return httpclient.Target(port=port, method="POST", paths=("/echoes",), body=b'{"n": 1}', headers=headers)


def _spread_keys(ctx: Context) -> dict[str, str]:
    """tenant -> API key of the ten-tenant burst's tenants."""
    return {f"e2e-t{i}": f"e2e-t{i}-key" for i in range(ctx.sizes.e2e_tenants)}


def _api_keys(ctx: Context) -> str:
    """``HERALD_API_KEYS``: the bench tenant and the ten-tenant burst's."""
    return ",".join([f"{TENANT}:{API_KEY}", *(f"{t}:{k}" for t, k in _spread_keys(ctx).items())])


def _spread_target(port: int, keys: list[str]) -> httpclient.Target:
    """``POST /echoes``, each start with one of ``keys``, picked at random."""
    return httpclient.Target(port=port, method="POST", paths=("/echoes",),
                             choices=tuple(post_echo(port, key).request("/echoes") for key in keys))


def _register_tenant(base: str, key: str, url: str) -> str:
    status, body = http_post_json(base + "/webhooks", {"url": url, "event_types": ["job.succeeded"]},
                                  {"Authorization": f"Bearer {key}"})
    if status != 201:
        raise BenchError(f"registering a webhook answered {status}: {body}")
    return str(body["secret"])  # type: ignore[index]


def _ts(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _job_id(location: str) -> str:
    return location.rsplit("/", 1)[-1]


def _succeeded(receiver: Receiver) -> dict[str, tuple[float, str]]:
    """job id → (arrival, updated_at) of its first job.succeeded delivery."""
    found: dict[str, tuple[float, str]] = {}
    for arrived, _wid, kind, updated_at, job_id, _state, _name in receiver.stats()["records"]:
        if kind == "job.succeeded" and job_id not in found:
            found[job_id] = (arrived, updated_at)
    return found


def _sse_latencies(frames: list[tuple[float, bytes]], since: float) -> dict[str, list[float]]:
    by_type: dict[str, list[float]] = {"all": [], "job.succeeded": []}
    for arrived, frame in frames:
        if arrived < since:
            continue
        event_type, data = "", b""
        for line in frame.split(b"\n"):
            if line.startswith(b"event: "):
                event_type = line[7:].decode()
            elif line.startswith(b"data: "):
                data = line[6:]
        status = msgspec.json.decode(data)
        latency = (arrived - _ts(status["updated_at"])) * 1000
        by_type["all"].append(latency)
        if event_type == "job.succeeded":
            by_type["job.succeeded"].append(latency)
    return by_type


def _log_count(proc: Any, text: str) -> int:
    return proc.log_text().count(text)


def _wait_for(receiver: Receiver, ids: set[str], timeout: float) -> dict[str, tuple[float, str]]:
    deadline = time.monotonic() + timeout
    found = _succeeded(receiver)
    while not ids <= found.keys() and time.monotonic() < deadline:
        time.sleep(0.2)
        found = _succeeded(receiver)
    return found


@dataclass
class Deployment:
    """What the measurement drives: starts go to ``port``, the tenant stream is read on
    ``sse_port``, the webhook is registered through ``base``; ``meters`` for CPU, ``log`` for
    the gateways' lines (slow SSE readers dropped)."""

    port: int
    sse_port: int
    base: str
    meters: dict[str, Any]
    log: Any
    database_url: str | None  # PostgreSQL: its sessions' wait events are sampled during the burst
    description: dict[str, Any] = field(default_factory=dict)


def _one_machine(ctx: Context) -> Deployment:
    """``herald up``'s processes, started one by one: a gateway, two workers (``--workers``), a notifier."""
    herald = ctx.herald("e2e", HERALD_KINDS=KINDS, HERALD_API_KEYS=_api_keys(ctx))
    herald.start_gateway()
    workers = [herald.start_worker(f"worker{i}") for i in range(ctx.workers)]
    notifier = herald.start_notifier()
    meters = {"gateway": herald.gateway(), "notifier": notifier, "nats": herald.nats.proc,
              **{w.name.rsplit("-", 1)[-1]: w for w in workers}, **ctx.store_meters()}
    return Deployment(port=herald.port, sse_port=herald.port, base=herald.base, meters=meters, log=herald.gateway(),
                      database_url=herald.database_url,
                      description={"shape": f"one machine: 1 gateway, {len(workers)} workers, 1 notifier, 1 nats-server",
                                   "store": herald.store, "workers": len(workers),
                                   "worker_concurrency": herald.env().get("HERALD_WORKER_CONCURRENCY", f"{Settings.worker_concurrency} (default)")})


def _cluster(ctx: Context) -> Deployment:
    """``herald up --cluster``: starts through the first gateway, the tenant stream on the second."""
    ctx.say("e2e: starting herald up --cluster")
    started = time.monotonic()
    cluster = ClusterHerald(ctx.procs, ctx.dir("e2e") / "cluster",
                            **{**ctx.herald_env, "HERALD_KINDS": KINDS, "HERALD_API_KEYS": _api_keys(ctx)})
    return Deployment(port=cluster.port, sse_port=cluster.port + 1, base=cluster.base, meters=cluster.roles(),
                      log=cluster.proc, database_url=cluster.database_url,
                      description={"shape": "herald up --cluster: 3 NATS nodes (R3), PostgreSQL, 2 gateways, "
                                   "2 workers, 2 notifiers", "store": "postgres", "workers": 2,
                                   "worker_concurrency": ctx.herald_env.get("HERALD_WORKER_CONCURRENCY", f"{Settings.worker_concurrency} (default)"),
                                   "startup_s": round(time.monotonic() - started, 1),
                                   "starts_via": cluster.base, "tenant_stream_via": cluster.base_of(1)})


class _Registrar:
    """``_register`` wants something with ``base``."""

    def __init__(self, base: str) -> None:
        self.base = base


def _warm_up(ctx: Context, base: str, receiver: Receiver, keys: list[str]) -> None:
    """One job per tenant through the whole path before the bursts (its work consumer)."""
    sent = set()
    for key in keys:
        status, body = http_post_json(base + "/echoes", {"n": 1}, {"Authorization": f"Bearer {key}"})
        if status != 202:
            raise BenchError(f"a warm-up start answered {status}: {body}")
        sent.add(str(body["id"]))  # type: ignore[index]
    wait_until(lambda: sent <= _succeeded(receiver).keys(), timeout=ctx.sizes.wait_s, interval=0.1,
               what="the warm-up jobs' webhooks")


def _burst(ctx: Context, deployment: Deployment, receiver: Receiver, target: httpclient.Target) -> dict[str, Any]:
    """``e2e_jobs`` starts as fast as 16 connections go; jobs/s to the last job.succeeded delivery."""
    receiver.reset()
    meter = CpuMeter(deployment.meters).start()
    with PgWaits(deployment.database_url) as waits:
        load = httpclient.run(target, processes=1, connections=16, count=ctx.sizes.e2e_jobs, keep_records=True)
        sent = {_job_id(r[3]): r[0] for r in load["records"] if r[2] == 202}
        found = _wait_for(receiver, set(sent), ctx.sizes.wait_s)
        cpu = meter.stop()  # before the sampler's last counters (a second after the burst)
    done = [found[j][0] - sent[j] for j in sent if j in found]
    wall = max((found[j][0] for j in sent if j in found), default=0) - min(sent.values(), default=0)
    phase = {
        "jobs": len(sent), "completed": len(done),
        "jobs_per_s": round(len(done) / wall, 1) if wall > 0 else 0.0,
        "accept_rps": load["rps"],
        "start_to_webhook": latency_summary(v * 1000 for v in done),
        "cpu_pct": cpu, "loadgen_cpu_pct": load["loadgen_cpu_pct"],
        "cpu_ms_per_job": peers.cpu_ms_per_job(meter, len(done)),
    }
    if deployment.database_url:
        phase["postgres_waits"] = waits.summary()
        phase["postgres_waits_note"] = waits.note()
        phase["postgres_per_job"] = waits.per(len(done))
    return phase


def _herald(ctx: Context, out: Outcome) -> dict[str, Any]:
    sizes = ctx.sizes
    deployment = _cluster(ctx) if ctx.shape == "cluster" else _one_machine(ctx)
    port = free_port()
    secret = _register(_Registrar(deployment.base), f"http://127.0.0.1:{port}/hook/e2e", ["job.succeeded"])  # type: ignore[arg-type]
    spread = _spread_keys(ctx)
    secrets = {"e2e": secret, **{tenant: _register_tenant(deployment.base, key, f"http://127.0.0.1:{port}/hook/{tenant}")
                                 for tenant, key in spread.items()}}
    target = post_echo(deployment.port)
    request = (f"GET /events HTTP/1.1\r\nHost: 127.0.0.1:{deployment.sse_port}\r\nAccept: text/event-stream\r\n"
               f"Authorization: Bearer {API_KEY}\r\n\r\n").encode()
    result: dict[str, Any] = dict(deployment.description)
    with Receiver(secrets, processes=1, port=port) as receiver:
        _warm_up(ctx, deployment.base, receiver, [API_KEY, *spread.values()])
        ctx.say(f"e2e: {sizes.e2e_jobs} jobs as fast as they go ({ctx.variant})")
        result["saturation"] = _watched_burst(ctx, deployment, receiver, target, request)
        if deployment.database_url:
            result["postgres_waits_note"] = "saturation, " + result["saturation"].pop("postgres_waits_note")
        if ctx.peers:
            result["rounds"] = _interleaved(ctx, deployment, receiver, target, request, result["saturation"])
        ctx.say(f"e2e: {sizes.e2e_jobs} jobs over {len(spread)} tenants as fast as they go ({ctx.variant})")
        result["spread"] = _burst(ctx, deployment, receiver, _spread_target(deployment.port, list(spread.values())))
        result["spread"]["tenants"] = len(spread)
        if deployment.database_url:
            result["spread_postgres_waits_note"] = (f"{len(spread)} tenants, "
                                                    + result["spread"].pop("postgres_waits_note"))

        result["fixed"] = []
        result["sse_streams_dropped"] = 0
        for rate in sizes.e2e_rates:
            if rate > 0.8 * result["saturation"]["jobs_per_s"] and rate > min(sizes.e2e_rates):  # the lowest always runs
                ctx.say(f"e2e: {rate:g} jobs/s skipped (saturation {result['saturation']['jobs_per_s']:g} jobs/s)")
                result["fixed"].append({"rate": rate, "skipped": True})
                continue
            result["fixed"].append(_fixed_phase(ctx, deployment, receiver, target, request, rate))
        result["sse_streams_dropped"] = _log_count(deployment.log, "slow SSE client dropped")
    return result


def _watched_burst(ctx: Context, deployment: Deployment, receiver: Receiver, target: httpclient.Target,
                   request: bytes) -> dict[str, Any]:
    """A saturation burst (``_burst``) with one tenant stream open: did it get every event?"""
    with Subscribers(deployment.sse_port, request, 1, mode="sse", ready_frames=1) as watcher:
        watcher.open()
        phase = _burst(ctx, deployment, receiver, target)
        time.sleep(0.2)
        watched = watcher.collect()
    phase.update({
        "sse_events_expected": EVENTS_PER_JOB * phase["jobs"],
        "sse_events_received": len(watched.times[0]) if watched.times else 0,
        "sse_stream_survived": watched.still_open == 1,
    })
    return phase


def _interleaved(ctx: Context, deployment: Deployment, receiver: Receiver, target: httpclient.Target,
                 request: bytes, first: dict[str, Any]) -> dict[str, Any]:
    """``--peers``: after Herald's first burst each peer's, then Herald's again, ``--rounds`` pairs
    in all. Herald's deployment stays up meanwhile; its processes' CPU while a peer runs (idle:
    heartbeats, timers) is kept beside, since that peer shares the cores with it."""
    reason = peers.missing()
    if reason is not None:
        return {"unavailable": reason}
    herald_rounds = [first]
    peer_rounds: dict[str, list[dict[str, Any]]] = {peer: [] for peer in peers.PEERS}
    idle_pct: list[float] = []
    for n in range(ctx.rounds):
        if n:
            ctx.say(f"e2e: round {n + 1} of {ctx.rounds}, Herald ({ctx.variant})")
            herald_rounds.append(_watched_burst(ctx, deployment, receiver, target, request))
        for peer in peers.PEERS:
            ctx.say(f"e2e: round {n + 1} of {ctx.rounds}, {peers.NAMES[peer]}")
            idle = CpuMeter(deployment.meters).start()
            peer_rounds[peer].append(peers.run(ctx.procs, ctx.dir("e2e") / f"peers-{ctx.variant}-{n + 1}", peer,
                                               ctx.sizes.e2e_jobs, ctx.sizes.wait_s))
            idle_pct.append(round(sum(idle.stop().values()), 1))
    return {"herald": herald_rounds, **peer_rounds, "herald_idle_cpu_pct": idle_pct}


def _fixed_phase(ctx: Context, deployment: Deployment, receiver: Receiver, target: Any, request: bytes,
                 rate: float) -> dict[str, Any]:
    sizes = ctx.sizes
    ctx.say(f"e2e: {rate:g} jobs/s for {sizes.e2e_fixed_s:g} s")
    receiver.reset()
    # A stream of its own for this phase: under the saturation burst above, the gateway
    # may drop a tenant stream as a slow reader (a client would resume by Last-Event-ID).
    with Subscribers(deployment.sse_port, request, 1, mode="sse", ready_frames=1, keep_frames=True) as sse:
        sse.open()
        since = time.time()
        load = httpclient.run(target, processes=1, connections=16, duration_s=sizes.e2e_fixed_s,
                              rate=rate, keep_records=True)
        sent = {_job_id(r[3]): r[0] for r in load["records"] if r[2] == 202}
        found = _wait_for(receiver, set(sent), sizes.wait_s)
        time.sleep(0.2)  # the last events' frames
        frames = sse.collect().frames[0]
    sse_latency = _sse_latencies(frames, since)
    return {
        "rate": rate, "jobs": len(sent), "completed": sum(1 for j in sent if j in found),
        "accept": {k: load[k] for k in ("p50_ms", "p99_ms", "max_ms")},
        "commit_to_webhook": latency_summary((found[j][0] - _ts(found[j][1])) * 1000 for j in sent if j in found),
        "commit_to_sse": latency_summary(sse_latency["all"]),
        "commit_to_sse_succeeded": latency_summary(sse_latency["job.succeeded"]),
        "start_to_webhook": latency_summary((found[j][0] - sent[j]) * 1000 for j in sent if j in found),
    }


def run(ctx: Context) -> Outcome:
    out = Outcome("e2e", "trivial jobs: accepted -> succeeded -> webhook delivered",
                  "nats-py JetStream publish+consume (2 processes, same nats-server)")
    h = _herald(ctx, out)
    ctx.say(f"e2e: JetStream ceiling, {ctx.sizes.nats_msgs} messages")
    herald_nats = Herald(ctx.procs, ctx.dir("e2e") / f"ceiling-{ctx.variant}")  # a fresh server, same binary and config
    b = natsceiling.measure(herald_nats.nats.url, ctx.sizes.nats_msgs)
    out.herald, out.baseline = h, b
    sat = h["saturation"]
    out.row("saturation", "jobs/s (vs msgs/s)", sat["jobs_per_s"], b["pipeline_rate"], better="higher", unit="/s")
    out.row("saturation", "start->webhook p99", sat["start_to_webhook"]["p99_ms"], None, better="lower", unit="ms")
    spread = h["spread"]
    out.row("saturation", f"jobs/s over {spread['tenants']} tenants (vs 1 tenant)", spread["jobs_per_s"],
            sat["jobs_per_s"], better="higher", unit="/s")
    out.row("saturation", "CPU ms per job, all processes", sat["cpu_ms_per_job"].get("total"), None,
            better="lower", unit="ms")
    out.row("saturation", "tenant SSE events received",
            round(100 * sat["sse_events_received"] / max(1, sat["sse_events_expected"]), 1), None, better="higher",
            unit="%")
    for fixed in h["fixed"]:
        if fixed.get("skipped"):
            continue
        case = f"{fixed['rate']:g} jobs/s"
        out.row(case, "commit->SSE p99", fixed["commit_to_sse"]["p99_ms"], None, better="lower", unit="ms")
        out.row(case, "commit->webhook p99", fixed["commit_to_webhook"]["p99_ms"], None, better="lower", unit="ms")
        out.row(case, "start->webhook p99", fixed["start_to_webhook"]["p99_ms"], None, better="lower", unit="ms")
    out.target("end to end >= 1000 trivial jobs/s", f"{sat['jobs_per_s']:.0f} jobs/s", sat["jobs_per_s"] >= 1000)
    # The latency targets are at 500 jobs/s (the smoke run's only rate stands in for it).
    goal = max(h["fixed"], key=lambda f: f["rate"])
    if goal.get("skipped"):
        value = f"not measured: {goal['rate']:g} jobs/s is above 80 % of the saturated {sat['jobs_per_s']:g} jobs/s"
        out.target(f"commit -> SSE p99 < 20 ms at {goal['rate']:g} jobs/s", value, False)
        out.target(f"commit -> webhook p99 < 50 ms at {goal['rate']:g} jobs/s", value, False)
    else:
        out.target(f"commit -> SSE p99 < 20 ms at {goal['rate']:g} jobs/s",
                   f"{goal['commit_to_sse']['p99_ms']:.1f} ms", goal["commit_to_sse"]["p99_ms"] < 20)
        out.target(f"commit -> webhook p99 < 50 ms at {goal['rate']:g} jobs/s",
                   f"{goal['commit_to_webhook']['p99_ms']:.1f} ms", goal["commit_to_webhook"]["p99_ms"] < 50)
    for note in ("postgres_waits_note", "spread_postgres_waits_note"):
        if h.get(note):
            out.notes.append(h[note])
    for label, phase in (("saturation", sat), (f"{spread['tenants']} tenants", spread)):
        if phase.get("postgres_per_job"):
            per = phase["postgres_per_job"]
            out.notes.append(f"{label}, PostgreSQL per job: {per['commits']:g} commits, {per['wal_fsyncs']:g} WAL "
                             f"fsyncs ({per.get('ms_per_wal_fsync', 0):g} ms each, after {per.get('write_ms_per_wal_fsync', 0):g} ms"
                             f" of write), {per['wal_records']:g} WAL records, {per['wal_kb']:g} kB of WAL")
    if h.get("sse_streams_dropped"):
        out.notes.append(f"the gateway dropped {h['sse_streams_dropped']} SSE stream(s) as slow readers "
                         "(hub queue full) during the run")
    for phase in (sat, spread, *(f for f in h["fixed"] if not f.get("skipped"))):
        if phase["completed"] < phase["jobs"]:
            out.notes.append(f"{phase['jobs'] - phase['completed']} of {phase['jobs']} jobs had no job.succeeded "
                             f"webhook within {ctx.sizes.wait_s:g} s")
    out.notes.append("the ceiling is one message per job; a Herald job stores 1 work message and 1 event "
                     "(succeeded, which the webhook wants) in JetStream, and publishes 2 more on core NATS "
                     "(queued, running: no target wants them)")
    if ctx.peers:
        _peer_rows(out, out.herald.pop("rounds"))
    return out


def _peer_rows(out: Outcome, rounds: dict[str, Any]) -> None:
    """Herald beside its peers: medians of the pairs (``_interleaved``), and the median of
    their ratios, which one slow minute on either side cannot decide."""
    out.herald["peers"] = rounds
    if "unavailable" in rounds:
        out.notes.append(f"peers not run: {rounds['unavailable']}")
        return
    herald = rounds["herald"]
    rates = [phase["jobs_per_s"] for phase in herald]
    cpus = [phase["cpu_ms_per_job"].get("total", 0.0) for phase in herald]
    pairs = len(herald)
    out.row("peers", f"Herald jobs/s, median of {pairs} burst(s)", round(median(rates), 1), None, better="higher",
            unit="/s")
    out.row("peers", "Herald CPU per job (all processes), median", round(median(cpus), 2), None, better="lower",
            unit="ms")
    for peer in peers.PEERS:
        name = peers.NAMES[peer]
        theirs = rounds[peer]
        their_rates = [result["jobs_per_s"] for result in theirs]
        their_cpus = [result["cpu_ms_per_job"].get("total", 0.0) for result in theirs]
        rate_ratios = [round(h / p, 2) if p else 0.0 for h, p in zip(rates, their_rates)]
        cpu_ratios = [round(h / p, 2) if p else 0.0 for h, p in zip(cpus, their_cpus)]
        out.row("peers", f"jobs/s vs {name}, medians", round(median(rates), 1), round(median(their_rates), 1),
                better="higher", unit="/s")
        out.row("peers", f"CPU per job vs {name}, medians", round(median(cpus), 2), round(median(their_cpus), 2),
                better="lower", unit="ms")
        out.row("peers", f"jobs/s / {name}'s, median of {pairs} pair(s)", median(rate_ratios), None,
                better="higher", unit="x")
        out.notes.append(f"{name}, {pairs} interleaved pair(s): Herald's jobs/s / theirs "
                         f"{', '.join(f'{r:g}' for r in rate_ratios)}; CPU per job / theirs "
                         f"{', '.join(f'{r:g}' for r in cpu_ratios)} (Herald {', '.join(f'{r:g}' for r in rates)} "
                         f"jobs/s; {name} {', '.join(f'{r:g}' for r in their_rates)})")
        missed = sum(result["jobs"] - result["completed"] for result in theirs)  # Herald's: below
        if missed:
            out.notes.append(f"{name}: {missed} jobs over the rounds had no result in time")
        out.target(f"end to end ahead of {name} (median of {pairs} interleaved pair(s))",
                   f"{median(rate_ratios):.2f} x their jobs/s", median(rate_ratios) > 1)
    missed = sum(phase["jobs"] - phase["completed"] for phase in herald[1:])
    if missed:
        out.notes.append(f"Herald: {missed} jobs of the later bursts had no job.succeeded webhook in time")
    out.notes.append("Herald's deployment, idle while the peers ran: "
                     f"{', '.join(f'{p:g}' for p in rounds['herald_idle_cpu_pct'])} % of a core")
