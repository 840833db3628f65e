"""7. Noisy neighbour (issue 21): what one tenant sees while another floods, and what fair share costs.

One deployment: a gateway, a notifier and two pairs of workers of default concurrency (8
slots a pair), one pair serving reports (the noisy neighbour), the other exports (fair
share's cost), with its tenants from ``HERALD_API_KEYS``: ``a`` (noisy), ``b`` (quiet) and
``fair_tenants`` more for the cost rows. Each of ``b`` and the others has one webhook
endpoint for ``job.succeeded`` on the verifying receiver. Every tenant's first job (its
work consumer made) runs before anything is measured.

* **Noisy neighbour.** Workers run every job for ``noisy_page_ms`` (reports of 1 page at
  that page time: A's jobs and B's are alike, so a free slot comes up every
  ``noisy_page_ms / 8`` on average). First B alone: ``noisy_rate`` starts/s for
  ``noisy_s`` (open loop). Then A floods: ``noisy_backlog`` starts as fast as 16
  connections go, each with a ``callback_url`` on one of ``noisy_hanging`` receivers that
  accept the connection and never answer (issue 21's measurement), and once A's webhooks
  hang, B again at the same rate while A's backlog drains. Per B job, from its
  ``job.succeeded`` delivery: start → succeeded (the start's send time to the status
  object's ``updated_at``, the commit), split at its claim (start → running, from the
  store's ``job.running`` event: the wait for a slot and the claim; running → succeeded:
  the run), and commit → webhook (``updated_at`` to arrival). The baseline is B alone,
  same deployment, same run.
* **Fair share's cost.** Trivial jobs (exports of 10 rows, on their own pair of workers):
  ``fair_jobs`` starts as fast as 16 connections go from one tenant, then the same number
  spread at random over ``fair_tenants`` tenants (each with its own work consumer and
  endpoint), ``fair_rounds`` times back to back; jobs/s from the first start to the last
  ``job.succeeded`` delivery. The baseline is one tenant; the figure is the median of the
  rounds' ratios. This measures what sharing among
  tenants costs the deployment's end-to-end rate (a consumer and a pull per tenant, the
  picks, the claim's ranking); it does not measure what the fair-share code costs a lone
  tenant against a Herald without it (that needs two commits: see bench/RESULTS.md).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import sqlite3
from typing import Any

from bench import httpclient
from bench.hanging import HangingReceivers
from bench.procs import BenchError, CpuMeter, free_port, http_post_json, wait_until
from bench.receiver import Receiver
from bench.scenario import Context, Outcome
from bench.scenarios.e2e import _job_id, _succeeded, _ts, _wait_for
from bench.stats import latency_summary, median
from bench.systems import Herald
from herald.settings import Settings

NOISY, QUIET = "a", "b"
REPORT = {"title": "bench", "pages": 1}  # the noisy neighbour's jobs: HERALD_REPORT_PAGE_MS each
EXPORT = {"format": "csv", "rows": 10}  # fair share's cost: trivial jobs of another kind


def _keys(ctx: Context) -> dict[str, str]:
    """tenant -> API key: the noisy tenant, the quiet one, and the cost rows' tenants."""
    keys = {NOISY: "noisy-a-key", QUIET: "quiet-b-key"}
    keys.update({f"t{i}": f"fair-t{i}-key" for i in range(ctx.sizes.fair_tenants)})
    return keys


def _starts(port: int, keys: list[str], bodies: list[dict[str, Any]], path: str = "/reports") -> httpclient.Target:
    """``POST path``, each request one of every (key, body) pair, picked at random."""
    choices = []
    for key in keys:
        for body in bodies:
            headers = (("Content-Type", "application/json"), ("Authorization", f"Bearer {key}"))
            choices.append(httpclient.Target(port=port, method="POST", paths=(path,),
                                             body=json.dumps(body).encode(), headers=headers).request(path))
    return httpclient.Target(port=port, method="POST", paths=(path,), choices=tuple(choices))


def _register(herald: Herald, key: str, url: str) -> str:
    status, body = http_post_json(herald.base + "/webhooks", {"url": url, "event_types": ["job.succeeded"]},
                                  {"Authorization": f"Bearer {key}"})
    if status != 201:
        raise BenchError(f"registering a webhook answered {status}: {body}")
    return str(body["secret"])  # type: ignore[index]


def _accepted(load: dict[str, Any]) -> dict[str, float]:
    """job id -> when its start was sent (or due, open loop), for the 202s."""
    return {_job_id(r[3]): r[0] for r in load["records"] if r[2] == 202}


def _warm_up(ctx: Context, herald: Herald, receiver: Receiver, keys: dict[str, str]) -> None:
    """One job per tenant through the whole path, of the kind it runs later: a tenant's first
    job of a kind makes its work consumer (a tenant at work has one), which no measured phase
    should pay for."""
    sent = set()
    for tenant, key in keys.items():
        path, document = ("/reports", REPORT) if tenant in (NOISY, QUIET) else ("/exports", EXPORT)
        status, body = http_post_json(herald.base + path, document, {"Authorization": f"Bearer {key}"})
        if status != 202:
            raise BenchError(f"a warm-up start answered {status}: {body}")
        sent.add(str(body["id"]))  # type: ignore[index]
    quiet = len(keys) - 1  # the noisy tenant has no endpoint
    wait_until(lambda: len(_succeeded(receiver).keys() & sent) >= quiet, timeout=ctx.sizes.wait_s, interval=0.1,
               what="the warm-up jobs' webhooks")


def _rate(ctx: Context, receiver: Receiver, target: httpclient.Target) -> dict[str, Any]:
    """``fair_jobs`` starts as fast as 16 connections go; jobs/s to the last job.succeeded delivery."""
    receiver.reset()
    load = httpclient.run(target, processes=1, connections=16, count=ctx.sizes.fair_jobs, keep_records=True)
    sent = _accepted(load)
    found = _wait_for(receiver, set(sent), ctx.sizes.wait_s)
    done = [j for j in sent if j in found]
    wall = max((found[j][0] for j in done), default=0.0) - min(sent.values(), default=0.0)
    return {"jobs": len(sent), "completed": len(done), "jobs_per_s": round(len(done) / wall, 1) if wall > 0 else 0.0,
            "accept_rps": load["rps"]}


async def _running_at(herald: Herald, tenant: str) -> dict[str, float]:
    """job id -> when its job.running committed (its first claim), from the store's history."""
    query = "SELECT job_id, MIN(at) FROM events WHERE tenant = {} AND type = 'job.running' GROUP BY job_id"
    if herald.database_url:
        import asyncpg

        conn = await asyncpg.connect(herald.database_url)
        try:
            rows = await conn.fetch(query.format("$1"), tenant)
        finally:
            await conn.close()
        return {row[0]: row[1] for row in rows}
    with sqlite3.connect(f"file:{herald.db_path}?mode=ro", uri=True) as conn:
        return dict(conn.execute(query.format("?"), (tenant,)).fetchall())


def _quiet_phase(ctx: Context, herald: Herald, receiver: Receiver, target: httpclient.Target) -> dict[str, Any]:
    """B's starts at ``noisy_rate`` for ``noisy_s``; per job start -> succeeded (split at its
    claim: start -> running, the wait for a slot; running -> succeeded, the run) and commit -> webhook."""
    sizes = ctx.sizes
    receiver.reset()
    load = httpclient.run(target, processes=1, connections=4, duration_s=sizes.noisy_s, rate=sizes.noisy_rate,
                          keep_records=True)
    sent = _accepted(load)
    found = _wait_for(receiver, set(sent), sizes.wait_s)
    done = [j for j in sent if j in found]
    running = asyncio.run(_running_at(herald, QUIET))
    split = [j for j in done if j in running]
    return {
        "jobs": len(sent), "completed": len(done), "accept_p99_ms": load["p99_ms"],
        "start_to_succeeded": latency_summary((_ts(found[j][1]) - sent[j]) * 1000 for j in done),
        "start_to_running": latency_summary((running[j] - sent[j]) * 1000 for j in split),
        "running_to_succeeded": latency_summary((_ts(found[j][1]) - running[j]) * 1000 for j in split),
        "commit_to_webhook": latency_summary((found[j][0] - _ts(found[j][1])) * 1000 for j in done),
    }


def _state(herald: Herald, key: str, job_id: str) -> str:
    """The job's state; a finished report's status answers 303 to its result (not followed)."""
    conn = http.client.HTTPConnection("127.0.0.1", herald.port, timeout=10)
    try:
        conn.request("GET", f"/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"})
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    if response.status == 303:
        return "succeeded"
    return str(json.loads(body).get("state")) if response.status == 200 else f"HTTP {response.status}"


def run(ctx: Context) -> Outcome:
    sizes = ctx.sizes
    out = Outcome("noisy", "noisy neighbour: tenant B while tenant A floods; fair share's cost",
                  "tenant B alone; one tenant's e2e rate (same deployment, same run)")
    keys = _keys(ctx)
    herald = ctx.herald("noisy", HERALD_API_KEYS=",".join(f"{t}:{k}" for t, k in keys.items()))
    herald.start_gateway()
    notifier = herald.start_notifier()
    port = free_port()
    quiet = [t for t in keys if t != NOISY]
    secrets = {t: _register(herald, keys[t], f"http://127.0.0.1:{port}/hook/{t}") for t in quiet}
    spread = [keys[f"t{i}"] for i in range(sizes.fair_tenants)]
    h: dict[str, Any] = {"deployment": "1 gateway, 1 notifier, 2 workers for reports and 2 for exports "
                                       f"(concurrency {Settings.worker_concurrency}: {2 * Settings.worker_concurrency} slots a kind)",
                         "tenants": len(keys)}
    with Receiver(secrets, processes=1, port=port) as receiver:
        # Two workers for each part, all started at once: exports (trivial) for fair share's
        # cost, reports of noisy_page_ms for the noisy neighbour. Each pair has twice a worker's slots.
        exports = {"HERALD_WORKER_KINDS": "export"}
        reports = {"HERALD_WORKER_KINDS": "report", "HERALD_REPORT_PAGE_MS": str(sizes.noisy_page_ms)}
        workers = herald.start_workers({"worker1": exports, "worker2": exports, "worker3": reports,
                                        "worker4": reports})[2:]
        _warm_up(ctx, herald, receiver, keys)
        one, many = [], []
        for index in range(sizes.fair_rounds):
            ctx.say(f"noisy: {sizes.fair_jobs} trivial jobs from 1 tenant, round {index + 1}/{sizes.fair_rounds}")
            one.append(_rate(ctx, receiver, _starts(herald.port, spread[:1], [EXPORT], "/exports")))
            ctx.say(f"noisy: the same over {sizes.fair_tenants} tenants, round {index + 1}/{sizes.fair_rounds}")
            many.append(_rate(ctx, receiver, _starts(herald.port, spread, [EXPORT], "/exports")))
        h["fair_cost"] = {"one_tenant": one, "spread": many, "tenants": sizes.fair_tenants}

        # The noisy neighbour: every job runs noisy_page_ms.
        b_target = _starts(herald.port, [keys[QUIET]], [REPORT])
        ctx.say(f"noisy: tenant B alone, {sizes.noisy_rate:g} jobs/s for {sizes.noisy_s:g} s")
        h["alone"] = _quiet_phase(ctx, herald, receiver, b_target)
        with HangingReceivers(sizes.noisy_hanging) as hanging:
            ctx.say(f"noisy: tenant A queues {sizes.noisy_backlog} jobs, callbacks to {sizes.noisy_hanging} "
                    "receivers that hang")
            flood = httpclient.run(_starts(herald.port, [keys[NOISY]],
                                           [{**REPORT, "callback_url": url} for url in hanging.urls()]),
                                   processes=1, connections=16, count=sizes.noisy_backlog, keep_records=True)
            a_sent = _accepted(flood)
            if not a_sent:
                raise BenchError(f"tenant A's starts were refused: {flood['statuses']}")
            last_a = max(a_sent, key=lambda j: a_sent[j])
            held = min(60, 2 * sizes.noisy_hanging, len(a_sent))
            wait_until(lambda: hanging.requests >= held, timeout=sizes.wait_s, interval=0.1,
                       what=f"{held} of tenant A's webhooks hanging")
            ctx.say(f"noisy: tenant B while A floods, {sizes.noisy_rate:g} jobs/s for {sizes.noisy_s:g} s")
            meter = CpuMeter({"gateway": herald.gateway(), "notifier": notifier, "nats": herald.nats.proc,
                              **{w.name.rsplit("-", 1)[-1]: w for w in workers}, **ctx.store_meters()}).start()
            h["flooded"] = _quiet_phase(ctx, herald, receiver, b_target)
            h["flooded"]["cpu_pct"] = meter.stop()
            h["flood"] = {"accepted": len(a_sent), "statuses": flood["statuses"], "accept_rps": flood["rps"],
                          "hanging_receivers": sizes.noisy_hanging, "hanging_requests": hanging.requests,
                          "last_job_state_after": _state(herald, keys[NOISY], last_a)}
    out.herald = {k: v for k, v in h.items() if k not in ("alone",)}
    out.baseline = {"alone": h["alone"]}
    alone, flooded = h["alone"], h["flooded"]
    case = f"B at {sizes.noisy_rate:g} jobs/s, {sizes.noisy_page_ms} ms jobs"
    for metric in ("start_to_succeeded", "start_to_running", "running_to_succeeded", "commit_to_webhook"):
        label = metric.replace("_to_", "->")
        for p in ("p50", "p99"):
            out.row(case, f"{label} {p} (A flooding vs alone)", flooded[metric][f"{p}_ms"], alone[metric][f"{p}_ms"],
                    better="lower", unit="ms")
    one_rate = median([r["jobs_per_s"] for r in one])
    many_rate = median([r["jobs_per_s"] for r in many])
    # Each round's two runs are back to back: their ratio is less exposed to the machine's drift.
    pairs = [m["jobs_per_s"] / o["jobs_per_s"] for o, m in zip(one, many) if o["jobs_per_s"]]
    h["fair_cost"]["round_ratios"] = [round(r, 3) for r in pairs]
    out.row(f"{sizes.fair_jobs} trivial jobs", f"jobs/s over {sizes.fair_tenants} tenants vs 1", many_rate, one_rate,
            better="higher", unit="/s")
    for metric, text in (("start_to_succeeded", "start -> succeeded"), ("commit_to_webhook", "commit -> webhook")):
        a, f = alone[metric]["p99_ms"], flooded[metric]["p99_ms"]
        r = f / a if a else float("nan")
        out.target(f"B's {text} p99 while A floods <= 2x B alone", f"{r:.2f}x ({f:.0f} ms vs {a:.0f} ms)", r <= 2)
    cost = 100 * (1 - median(pairs)) if pairs else float("nan")
    out.target(f"fair share costs the e2e rate <= 10 % (1 tenant vs {sizes.fair_tenants}, median of "
               f"{len(pairs)} rounds' ratios)", f"{cost:.0f} % ({', '.join(f'{r:.2f}' for r in pairs)})", cost <= 10)
    state = h["flood"]["last_job_state_after"]
    if state not in ("queued",):
        out.notes.append(f"tenant A's last job was {state} when B's flooded phase ended: A's backlog did not "
                         "outlast it")
    for name, phase in (("alone", alone), ("while A floods", flooded)):
        if phase["completed"] < phase["jobs"]:
            out.notes.append(f"B {name}: {phase['jobs'] - phase['completed']} of {phase['jobs']} jobs had no "
                             f"job.succeeded webhook within {sizes.wait_s:g} s")
    return out
