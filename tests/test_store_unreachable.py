"""A PostgreSQL store that is not there yet, or goes away: the gateway says so and waits
(SPEC §9, §11).

An operator who starts Herald before its database, or with a wrong URL, gets a log line
naming HERALD_DATABASE_URL, a /readyz that answers 503, and a gateway that comes ready
by itself once the database is there: never a silent crash loop. While the database is
away every store-bound route answers 503 with Retry-After (every method of every
PostgreSQL store raises ``StoreUnavailable``, never a driver error that would be a 500),
and each recovers once it is back. A worker rides an outage out: its jobs, running or
queued, are delayed by it and end as they would have without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from herald.deliveries import Attempted, Claimed, LeaseOffer
from herald.jobs import IdempotencyClaim, JobRow, NewJob, StoreUnavailable
from herald.settings import Settings
from herald.storage import open_storage
from herald.storage.ports import DeliveryQueue, JobStore, StartBudget, Storage, TenantStore, WebhookStore
from herald.tenants import KeyRow
from herald.transitions import Change
from launcher.pgserver import PostgresServer
from herald.deliveries import Outcome, Plan
from schemas import JobEvent
from tests.harness import ADMIN_KEY, SECRET_KEY, TLS, Deployment, client, free_port, wait_for_state, wait_until
from tests.store_contract.support import event, new_job

PORTS = {"jobs": JobStore, "webhooks": WebhookStore, "deliveries": DeliveryQueue, "tenants": TenantStore}
# Not calls that can be answered 503: open() waits for the database by design (the gateway
# opens in the background meanwhile), close() lets go, on_commit() registers a callback,
# remember() keeps a row in memory (the write that follows asks the database).
NOT_REQUESTS = {"open", "close", "on_commit", "remember"}


def _port_methods() -> set[str]:
    return {f"{port}.{name}" for port, protocol in PORTS.items() for name, member in vars(protocol).items()
            if not name.startswith("_") and inspect.isfunction(member) and name not in NOT_REQUESTS}


class _Seen:
    """What the sweep needs from the store while it was up: a job, an endpoint, a claimed delivery."""

    job: JobRow
    endpoint_id: str
    claimed: Claimed
    event: JobEvent


async def _before_the_outage(storage: Storage) -> _Seen:
    seen = _Seen()
    seen.job = (await storage.jobs.accept(new_job("sweep"))).job
    row, _ = await storage.webhooks.create_endpoint("sweep", url="https://example.com/hook",
                                                    event_types=["job.succeeded"], kinds=None, signature="hmac-sha256")
    seen.endpoint_id = row.id
    seen.event = event("j-sweep", 1, tenant="sweep")
    assert (await storage.deliveries.fan_out([seen.event])).pending == 1
    [seen.claimed] = await storage.deliveries.claim("n1", lease_s=30, per_target=1, limit=1, in_flight={})
    return seen


def _calls(storage: Storage, seen: _Seen) -> dict[str, Callable[[], Awaitable[Any]]]:
    """One call of every method of every port, each of which needs the database."""
    jobs, webhooks, queue, tenants = storage.jobs, storage.webhooks, storage.deliveries, storage.tenants
    job, endpoint_id, claimed = seen.job, seen.endpoint_id, seen.claimed
    ok = Outcome(status_code=200, latency_s=0.01)
    key = KeyRow(id="k-sweep", tenant="sweep", name="sweep", scopes=("jobs",), digest=b"0" * 32, created_at=0.0)
    return {
        "jobs.ping": lambda: jobs.ping(),
        "jobs.clock": lambda: jobs.clock(),
        "jobs.accept": lambda: jobs.accept(new_job("sweep"), IdempotencyClaim("k", "f", 60.0), StartBudget(1.0, 5.0)),
        "jobs.find_replay": lambda: jobs.find_replay("sweep", IdempotencyClaim("k", "f", 60.0)),
        "jobs.transition": lambda: jobs.transition(job.id, Change(expect={"queued"}, to="cancelled")),
        "jobs.heartbeat": lambda: jobs.heartbeat(job.id, 1),
        "jobs.get": lambda: jobs.get(job.id),
        "jobs.get_for_tenant": lambda: jobs.get_for_tenant("sweep", job.id),
        "jobs.tombstone_tenant": lambda: jobs.tombstone_tenant(job.id),
        "jobs.list_jobs": lambda: jobs.list_jobs("sweep", state=None, kind=None, before=None, limit=10),
        "jobs.job_events": lambda: jobs.job_events(job.id, 0),
        "jobs.tenant_events": lambda: jobs.tenant_events("sweep", 0, 10),
        "jobs.last_event_seq": lambda: jobs.last_event_seq("sweep"),
        "jobs.stats": lambda: jobs.stats(),
        "jobs.queued_ages": lambda: jobs.queued_ages(["report"]),
        "jobs.tenant_queued_age": lambda: jobs.tenant_queued_age("report", "sweep"),
        "jobs.running_counts": lambda: jobs.running_counts(["sweep"]),
        "jobs.outbox_batch": lambda: jobs.outbox_batch(10, stale_after_s=0),
        "jobs.outbox_done": lambda: jobs.outbox_done([1]),
        "jobs.live_jobs": lambda: jobs.live_jobs(stale_before=0, deadline_before=0),
        "jobs.expired": lambda: jobs.expired(0),
        "jobs.forget": lambda: jobs.forget([job], 0),
        "jobs.signing_key": lambda: jobs.signing_key(),
        "jobs.reseal_secrets": lambda: jobs.reseal_secrets(),
        "webhooks.create_endpoint": lambda: webhooks.create_endpoint(
            "sweep", url="https://example.com/2", event_types=["job.succeeded"], kinds=None, signature="hmac-sha256"),
        "webhooks.get_endpoint": lambda: webhooks.get_endpoint("sweep", endpoint_id),
        "webhooks.list_endpoints": lambda: webhooks.list_endpoints("sweep", before=None, limit=10),
        "webhooks.update_endpoint": lambda: webhooks.update_endpoint("sweep", endpoint_id, {"url": "https://e.com/3"}),
        "webhooks.delete_endpoint": lambda: webhooks.delete_endpoint("sweep", endpoint_id),
        "webhooks.rotate_endpoint_key": lambda: webhooks.rotate_endpoint_key("sweep", endpoint_id),
        "webhooks.callback_key": lambda: webhooks.callback_key("sweep"),
        "webhooks.rotate_callback_key": lambda: webhooks.rotate_callback_key("sweep"),
        "webhooks.list_deliveries": lambda: webhooks.list_deliveries(endpoint_id, status=None, before_seq=None,
                                                                     limit=10),
        "webhooks.attempts": lambda: webhooks.attempts([claimed.delivery.id]),
        "webhooks.get_delivery": lambda: webhooks.get_delivery(endpoint_id, claimed.delivery.id),
        "webhooks.retry_now": lambda: webhooks.retry_now(endpoint_id, claimed.delivery.id),
        "webhooks.recover": lambda: webhooks.recover("sweep", endpoint_id, 0),
        "webhooks.add_test_delivery": lambda: webhooks.add_test_delivery("sweep", endpoint_id, "evt_t", "test:t", b"{}"),
        "webhooks.messages": lambda: webhooks.messages([claimed.delivery.event_id]),
        "webhooks.endpoint_health": lambda: webhooks.endpoint_health([endpoint_id], 10),
        "deliveries.fan_out": lambda: queue.fan_out([seen.event]),
        "deliveries.fan_out_leasing": lambda: queue.fan_out_leasing(
            [seen.event], LeaseOffer(owner="n1", lease_s=30, per_target=1, limit=1, in_flight={})),
        "deliveries.drain_waiting": lambda: queue.drain_waiting(),
        "deliveries.anything_due": lambda: queue.anything_due(),
        "deliveries.next_due_after": lambda: queue.next_due_after(0),
        "deliveries.claim": lambda: queue.claim("n1", lease_s=30, per_target=1, limit=1, in_flight={}),
        "deliveries.defer": lambda: queue.defer([claimed.delivery.id], "n1", [claimed.delivery.target], 1.0),
        "deliveries.finish": lambda: queue.finish(claimed, "n1", 0.0, ok, Plan("delivered")),
        "deliveries.finish_many": lambda: queue.finish_many(
            [Attempted(claimed=claimed, started_at=0.0, outcome=ok, plan=Plan("delivered"))], "n1"),
        "deliveries.release": lambda: queue.release([claimed.delivery.id], "n1"),
        "deliveries.renew": lambda: queue.renew([claimed.delivery.id], "n1", 10.0),
        "deliveries.prune": lambda: queue.prune(0),
        "tenants.directory_version": lambda: tenants.directory_version(),
        "tenants.snapshot": lambda: tenants.snapshot(),
        "tenants.create_tenant": lambda: tenants.create_tenant("sweep2", {}),
        "tenants.get_tenant": lambda: tenants.get_tenant("sweep"),
        "tenants.list_tenants": lambda: tenants.list_tenants(after=None, limit=10),
        "tenants.update_tenant": lambda: tenants.update_tenant("sweep", limits=None, disabled=True),
        "tenants.create_key": lambda: tenants.create_key(key),
        "tenants.list_keys": lambda: tenants.list_keys("sweep"),
        "tenants.get_key": lambda: tenants.get_key("k-sweep"),
        "tenants.revoke_key": lambda: tenants.revoke_key("k-sweep"),
        "tenants.touch_keys": lambda: tenants.touch_keys({"k-sweep": 1.0}),
        "tenants.audit_log": lambda: tenants.audit_log(before=None, limit=10),
    }


async def _every_port_method_is_unavailable(storage: Storage, seen: _Seen) -> None:
    calls = _calls(storage, seen)
    # A method added to a port is added here too, or this fails (reads from memory are not calls).
    assert set(calls) >= _port_methods(), sorted(_port_methods() - set(calls))
    wrong: dict[str, str] = {}
    for name in sorted(_port_methods()):
        try:
            await asyncio.wait_for(calls[name](), 30)
        except StoreUnavailable:
            continue
        except BaseException as exc:  # noqa: BLE001 - what a 500 would be made of
            wrong[name] = f"{type(exc).__name__}: {exc}"
        else:
            wrong[name] = "answered without the database"
    assert not wrong, wrong


def test_gateway_waits_for_an_unreachable_database_and_says_why(tmp_path: Path, server_dir: Path) -> None:
    pg_port = free_port()  # nothing listens here yet
    deployment = Deployment(tmp_path / "herald", database_url=f"postgresql://postgres@127.0.0.1:{pg_port}/herald")
    deployment.nats.start()
    server = PostgresServer(server_dir / "pg", port=pg_port)
    runner = asyncio.Runner()
    try:
        port = free_port()
        deployment.ports["gateway"] = port
        process = deployment._spawn("gateway", ["gateway"], deployment.env(HERALD_HTTP_PORT=str(port)))
        base = f"http://127.0.0.1:{port}"
        not_ready = wait_until(lambda: (r := httpx.get(base + "/readyz", timeout=2, verify=TLS)).status_code == 503 and r,
                               what="/readyz 503 while the database is away")
        assert not_ready.headers["content-type"].startswith("application/problem+json")

        def complaint() -> dict[str, object] | None:
            events = deployment.log_events("gateway")
            return next((e for e in events if "HERALD_DATABASE_URL" in str(e.get("event", ""))), None)

        record = wait_until(complaint, what="a log line naming HERALD_DATABASE_URL")
        assert record["level"] in ("error", "warning")
        # A request that needs the store is told to come back, not given a 500.
        answer = httpx.get(base + "/jobs", headers={"Authorization": "Bearer key-acme"}, timeout=5)
        assert answer.status_code == 503 and answer.headers.get("retry-after")

        server.start()  # the database arrives: the gateway gets ready without a restart
        server.create_database("herald")
        wait_until(lambda: httpx.get(base + "/readyz", timeout=2, verify=TLS).status_code == 200, timeout=30,
                   what="/readyz 200 once the database is there")
        assert process.poll() is None, "the gateway kept running throughout"
        key = {"Authorization": "Bearer key-acme"}
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        started = httpx.post(base + "/reports", json={"title": "late db", "pages": 1}, timeout=5, headers=key)
        assert started.status_code == 202
        job_id = started.json()["id"]
        hook = httpx.post(base + "/webhooks", json={"url": "http://127.0.0.1:9/hook"}, headers=key, timeout=5)
        assert hook.status_code == 201, hook.text
        hook_id = hook.json()["id"]
        # This process's ports on the same database, to be called while it is away (one loop:
        # the pool belongs to it).
        storage = runner.run(open_storage(Settings(database_url=deployment.database_url, secret_keys=(SECRET_KEY,))))
        seen = runner.run(_before_the_outage(storage))

        # The database goes away again (the server process stops): every store-bound route
        # family says 503 with Retry-After, never 500; then each recovers by itself.
        routes = (("GET", "/jobs", key, None, 200), ("GET", f"/jobs/{job_id}", key, None, 200),
                  ("POST", "/reports", key, {"title": "outage", "pages": 1}, 202),
                  ("GET", "/webhooks", key, None, 200), ("GET", f"/webhooks/{hook_id}", key, None, 200),
                  ("GET", f"/webhooks/{hook_id}/deliveries", key, None, 200),
                  ("POST", "/webhooks", key, {"url": "http://127.0.0.1:9/hook"}, 201),
                  ("GET", "/admin/tenants", admin, None, 200), ("GET", "/admin/audit", admin, None, 200))
        document = httpx.get(base + "/schema/openapi.json", timeout=5, verify=TLS).json()
        server.stop()
        for method, path, headers, body, _ in routes:
            answer = httpx.request(method, base + path, json=body, headers=headers, timeout=10, verify=TLS)
            assert answer.status_code == 503, (method, path, answer.status_code, answer.text)
            assert answer.headers["content-type"].startswith("application/problem+json"), (method, path)
            assert answer.headers.get("retry-after"), (method, path)
            # ...and the API document says that route may answer so (SPEC §10: what it answers).
            template = path.replace(job_id, "{job_id}").replace(hook_id, "{endpoint_id}")
            documented = document["paths"][template][method.lower()]["responses"]
            assert "503" in documented and "Retry-After" in documented["503"]["headers"], (method, template)
        runner.run(_every_port_method_is_unavailable(storage, seen))
        server.start()
        for method, path, headers, body, healthy in routes:
            wait_until(lambda: httpx.request(method, base + path, json=body, headers=headers,
                                             timeout=5, verify=TLS).status_code == healthy,
                       timeout=30, what=f"{method} {path} {healthy} once the database is back")
        assert process.poll() is None, "the gateway kept running throughout"
        # The same ports recover too: their pool replaced the connections the outage broke.
        reads = ("jobs.get", "webhooks.list_endpoints", "deliveries.anything_due", "tenants.snapshot")

        def answered() -> bool:
            try:
                for name in reads:
                    runner.run(_calls(storage, seen)[name]())
            except StoreUnavailable:
                return False
            return True

        wait_until(answered, timeout=30, what="every port answers once the database is back")
        runner.run(storage.close())
        # The outage was said, not dumped: the pool's reconnect attempts in one line each, no tracebacks.
        pool_lines = [e for e in deployment.log_events("gateway") if e.get("logger") == "asyncpg.pool"]
        assert all("exception" not in e for e in pool_lines), pool_lines[:2]
    finally:
        runner.close()
        deployment.stop()
        server.stop()


async def test_a_unix_socket_url_reaches_the_store(postgres_server: PostgresServer) -> None:
    """``postgresql://user@/db?host=/dir``: the form a database on the same machine is often given in."""
    postgres_server.create_database("socket_test")
    url = f"postgresql://postgres@/socket_test?host={postgres_server.socket_dir}&port={postgres_server.port}"
    storage = await open_storage(Settings(database_url=url, secret_keys=(SECRET_KEY,)))
    try:
        accepted = await storage.jobs.accept(NewJob(id="6f1c1a3e-1b9f-4d1e-9a59-0c4b1f1e2d3c", tenant="acme",
                                                    kind="report", collection="/reports", params=b"{}", deadline_s=60))
        assert (await storage.jobs.get(accepted.job.id)) == accepted.job
    finally:
        await storage.close()


def test_an_event_stream_request_outwaits_a_store_outage(tmp_path: Path, server_dir: Path) -> None:
    """SPEC §8: a 5xx stops an EventSource for good, so an SSE request is never answered 5xx
    for what the client can outwait, and a store outage is such a thing. While PostgreSQL is
    away, each stream route (a job's events, by key and by signed link; its output; the
    tenant's stream) answers 200 with only `retry: 3000` and ends cleanly, so a browser comes
    back in 3 s; the same routes asked for JSON keep their 503 with Retry-After. Once the
    store is back, the same requests stream again."""
    server = PostgresServer(server_dir / "pg", port=free_port())
    server.start()
    deployment = Deployment(tmp_path / "herald", database_url=server.create_database("herald"))
    deployment.nats.start()
    try:
        base = deployment.start_gateway()
        deployment.start_worker()
        key = {"Authorization": "Bearer key-acme"}
        with httpx.Client(base_url=base, headers=key, timeout=10, verify=TLS) as http:
            job = http.post("/reports", json={"title": "outage", "pages": 1}).json()
            wait_until(lambda: http.get(f"/jobs/{job['id']}").status_code == 303, what="the job succeeded")
            links = http.get(f"/jobs/{job['id']}").json()["links"]
        sse = {"Accept": "text/event-stream"}
        streams = {"job events": (f"/jobs/{job['id']}/events", key),
                   "signed job events": (links["events"], {}),
                   "output": (f"/jobs/{job['id']}/output", key),
                   "signed output": (links["output"], {}),
                   "tenant stream": ("/events", key)}
        server.stop()
        with httpx.Client(base_url=base, timeout=20, verify=TLS) as http:
            for name, (path, headers) in streams.items():
                answer = http.get(path, headers={**headers, **sse})  # a body cut short would raise here
                assert answer.status_code == 200, (name, answer.status_code, answer.text[:300])
                assert answer.headers["content-type"].startswith("text/event-stream"), name
                assert answer.content == b"retry: 3000\n\n", (name, answer.content[:300])
            for path in (f"/jobs/{job['id']}", f"/jobs/{job['id']}/output", "/events"):
                answer = http.get(path, headers={**key, "Accept": "application/json"})
                assert answer.status_code == 503 and answer.headers.get("retry-after"), (path, answer.status_code)
                assert answer.json()["type"] == "/problems/store-unavailable", path
        server.start()
        with httpx.Client(base_url=base, timeout=20, verify=TLS) as http:
            for name, (path, headers) in streams.items():
                if name == "tenant stream":
                    continue  # a live stream: it stays open
                wait_until(lambda: "event: job.succeeded" in http.get(path, headers={**headers, **sse}).text,
                           timeout=30, what=f"{name} streaming again")
        # No request ended as a server error meanwhile (the sweeper's passes may complain).
        errors = [e for e in deployment.log_events("gateway")
                  if e.get("level") == "error" and e.get("logger") != "herald.sweeper"]
        assert not errors, errors[:3]
    finally:
        deployment.stop()
        server.stop()


OUTAGE_S = 5.0  # longer than JetStream redelivers a message handed back: ack_wait (1 s) x max_deliver (2)
WRITE_WAITING = ("SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))"
                 " AND query LIKE $2 AND NOT pid = ANY($3::int[])")


def _ended(http: httpx.Client, job_id: str, timeout: float = 30) -> dict[str, Any]:
    """The job once it has ended (answers without a status, a 503 while the store is back
    but the gateway's pool not yet, are polled past)."""
    def ended() -> dict[str, Any] | None:
        answer = http.get(f"/jobs/{job_id}")
        body = answer.json() if answer.status_code in (200, 303) else {}
        return body if body.get("state") in ("succeeded", "failed", "cancelled") else None

    return wait_until(ended, timeout=timeout, interval=0.05, what=f"job {job_id} ended")


def _making_progress(http: httpx.Client, job_id: str) -> None:
    wait_until(lambda: (s := http.get(f"/jobs/{job_id}").json())["state"] == "running" and s["progress"],
               what="job running with progress")


class _RowHolder:
    """A connection that holds a row (``SELECT ... FOR UPDATE``: a job's, a delivery's), so that
    the next write of it (a statement whose text is like ``write``) waits for it; and another
    that cuts the connection under that write."""

    def __init__(self, runner: asyncio.Runner, url: str, job_id: str,
                 table: str = "jobs", column: str = "id", write: str = "%herald_transition(%") -> None:
        self.runner = runner
        self.write = write
        self.holder: asyncpg.Connection = runner.run(asyncpg.connect(url))
        # (Another connection reads pg_stat_activity: a transaction sees it as it first read it.)
        self.observer: asyncpg.Connection = runner.run(asyncpg.connect(url))
        self.held = self.holder.transaction()
        runner.run(self.held.start())
        runner.run(self.holder.execute(f"SELECT 1 FROM {table} WHERE {column} = $1 FOR UPDATE", job_id))
        self.cut: list[int] = []
        self.released = False

    def waiting_write(self) -> int:
        """The server pid of a write of the row waiting for it, once there is one."""
        holder_pid = self.holder.get_server_pid()
        return wait_until(lambda: self.runner.run(self.observer.fetchval(WRITE_WAITING, holder_pid, self.write,
                                                                         self.cut)),
                          what=f"a write like {self.write!r} waiting for the row")

    def cut_the_waiting_write(self) -> None:
        """Once a write of the row waits for it, terminate its connection (mid-statement)."""
        waiting = self.waiting_write()
        assert self.runner.run(self.observer.fetchval("SELECT pg_terminate_backend($1)", waiting))
        self.cut.append(waiting)

    def release(self) -> None:
        """Let the waiting write have the row (the observer stays open)."""
        if not self.released:
            self.released = True
            self.runner.run(self.held.rollback())

    def let_go(self) -> None:
        self.release()
        for connection in (self.holder, self.observer):
            self.runner.run(connection.close())


def test_a_worker_rides_out_the_store_going_away_under_its_jobs(tmp_path: Path, server_dir: Path) -> None:
    """SPEC §9 and §11 (every job ends; a store restart loses nothing committed): a store that
    goes away under a worker delays its jobs and fails none of them.

    * The connection under a job's progress write is cut (a failover, a proxy, an operator's
      pg_terminate_backend), the server staying up: the job runs on and succeeds. It failed
      with /problems/job-failed, as if its handler had crashed.
    * The connection under a queued job's claim is cut, twice: the claim is tried again with
      the message held. The message went back to JetStream each time, and after
      ``max_deliver`` deliveries it was never delivered again: the job stayed queued until
      its deadline.
    * The server stops for longer than JetStream redelivers a message, under a running job
      and a queued backlog: the running job finishes its work and records its end once the
      store is back, the backlog waits. The running job was left running with no worker
      (for the sweeper to re-queue a heartbeat timeout later, or to fail worker-lost), and
      the worker, its slot free again, took the queued messages one after another, failed
      each claim and handed them back until JetStream gave up on them."""
    server = PostgresServer(server_dir / "pg", port=free_port())
    server.start()
    url = server.create_database("herald")
    deployment = Deployment(tmp_path / "herald", database_url=url)
    deployment.nats.start()
    runner = asyncio.Runner()
    try:
        # The gateway's sweeper waits 30 s for a silent job: it neither rescues nor ends one here.
        base = deployment.start_gateway(HERALD_HEARTBEAT_TIMEOUT_S="30")
        # One slot; a message's lease of 1 s and one attempt (max_deliver 2): JetStream gives a
        # message up after two deliveries.
        deployment.start_worker(HERALD_WORKER_CONCURRENCY="1", HERALD_HEARTBEAT_TIMEOUT_S="1",
                                HERALD_MAX_ATTEMPTS="1", HERALD_REPORT_PAGE_MS="100")
        with client(base) as http:
            running = http.post("/reports", json={"title": "cut mid-progress", "pages": 20}).json()
            queued = http.post("/reports", json={"title": "cut mid-claim", "pages": 2}).json()  # behind it
            _making_progress(http, running["id"])
            claim = _RowHolder(runner, url, queued["id"])
            progress = _RowHolder(runner, url, running["id"])
            progress.cut_the_waiting_write()
            progress.let_go()
            for _ in range(2):  # as many times as JetStream delivers the message
                claim.cut_the_waiting_write()
            claim.let_go()
            for name, job in (("cut mid-progress", running), ("cut mid-claim", queued)):
                done = _ended(http, job["id"])
                assert (done["state"], done["attempt"]) == ("succeeded", 1), (name, done["error"])

            jobs = [http.post("/reports", json={"title": f"outage {i}", "pages": 20 if i == 0 else 2}).json()
                    for i in range(4)]
            _making_progress(http, jobs[0]["id"])
            server.stop()
            until = time.monotonic() + OUTAGE_S
            while time.monotonic() < until:  # the fault's length, not a wait for a state
                assert httpx.get(base + "/readyz", timeout=5, verify=TLS).status_code == 503
                time.sleep(0.2)
            server.start()
            for job in jobs:
                done = _ended(http, job["id"])
                assert (done["state"], done["attempt"]) == ("succeeded", 1), (job["id"], done["error"])
        worker = deployment.log_events("worker")
        assert not [e for e in worker if e.get("level") == "error"], [e for e in worker if e.get("level") == "error"][:3]
        retried = {e.get("write") for e in worker if e.get("event") == "the store is unreachable; trying again"}
        assert retried >= {"claim", "success"}, retried
    finally:
        runner.close()
        deployment.stop()
        server.stop()


def test_a_store_outage_longer_than_the_heartbeat_timeout_requeues_no_live_workers_job(
    tmp_path: Path, server_dir: Path
) -> None:
    """SPEC §9 (a job is re-queued when its worker dies): a store restart that outlasts
    HERALD_HEARTBEAT_TIMEOUT_S, under running jobs whose workers live on, re-queues none of
    them. The sweeper's first pass once the store was back found every running job's
    heartbeat too old (its worker could not write one meanwhile) and re-queued it, just
    before the worker retried its heartbeat or recorded the end it had reached: the whole
    work ran again, attempt 2, every output chunk emitted twice. The sweeper now judges
    heartbeats again only once the store has been back for a heartbeat timeout."""
    server = PostgresServer(server_dir / "pg", port=free_port())
    server.start()
    deployment = Deployment(tmp_path / "herald", database_url=server.create_database("herald"))
    deployment.nats.start()
    try:
        # A 2 s heartbeat timeout (heartbeats every 0.67 s) and a sweep every 0.2 s.
        base = deployment.start_gateway(HERALD_HEARTBEAT_TIMEOUT_S="2", HERALD_SWEEP_INTERVAL_S="0.2")
        deployment.start_worker(HERALD_HEARTBEAT_TIMEOUT_S="2", HERALD_REPORT_PAGE_MS="100")
        with client(base) as http:
            long = http.post("/reports", json={"title": "runs through it", "pages": 80}).json()
            short = http.post("/reports", json={"title": "done during it", "pages": 20}).json()
            for job in (long, short):
                _making_progress(http, job["id"])
            server.stop()
            until = time.monotonic() + 4.0  # twice the heartbeat timeout: the fault's length, not a wait
            while time.monotonic() < until:
                assert httpx.get(base + "/readyz", timeout=5, verify=TLS).status_code == 503
                time.sleep(0.2)
            server.start()
            for job, pages in ((long, 80), (short, 20)):
                done = _ended(http, job["id"])
                assert (done["state"], done["attempt"]) == ("succeeded", 1), (job["id"], done["attempt"], done["error"])
                chunks = [json.loads(line) for line in http.get(f"/jobs/{job['id']}/output").text.splitlines()]
                assert [c["data"]["page"] for c in chunks] == list(range(1, pages + 1)), "each page emitted once"
        swept = deployment.logged("gateway", "job swept")
        assert not swept, swept
        assert deployment.logged("gateway", "sweep skipped: the store is unreachable")
    finally:
        deployment.stop()
        server.stop()


class _AnswerCutter:
    """A TCP proxy in front of PostgreSQL, in a thread: it forwards both ways until a
    client sends bytes holding every one of ``marks``, then forwards that request and cuts
    the connection when the server's answer comes, which the client never gets. So a
    statement commits and its caller sees a lost connection (a failover, a proxy or a
    network cut between the commit and its answer)."""

    def __init__(self, target_port: int) -> None:
        self.port = free_port()
        self.marks: tuple[bytes, ...] | None = None
        self.cut = threading.Event()
        self._target = target_port
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._listener.close()

    def _serve(self) -> None:
        while True:
            try:
                inbound, _ = self._listener.accept()
            except OSError:
                return
            outbound = socket.create_connection(("127.0.0.1", self._target))
            armed = threading.Event()
            threading.Thread(target=self._pump, args=(inbound, outbound, armed, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(outbound, inbound, armed, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, armed: threading.Event, upstream: bool) -> None:
        try:
            while data := source.recv(65536):
                if upstream and self.marks and not self.cut.is_set() and all(m in data for m in self.marks):
                    self.cut.set()
                    armed.set()
                elif not upstream and armed.is_set():
                    break  # the answer: dropped, and the connection with it
                sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()


@dataclass
class _CutWorker:
    deployment: Deployment
    http: httpx.Client
    proxy: _AnswerCutter


@contextlib.contextmanager
def _worker_behind_an_answer_cutter(tmp_path: Path, server_dir: Path, **env: str) -> Iterator[_CutWorker]:
    """A deployment on a PostgreSQL of its own whose worker reaches it through an
    ``_AnswerCutter``, one report run through it first (the worker's connections made)."""
    server = PostgresServer(server_dir / "pg", port=free_port())
    server.start()
    url = server.create_database("herald")
    proxy = _AnswerCutter(server.port)
    deployment = Deployment(tmp_path / "herald", database_url=url, env_overrides=env)
    deployment.nats.start()
    try:
        base = deployment.start_gateway()
        deployment.start_worker(HERALD_DATABASE_URL=url.replace(f":{server.port}/", f":{proxy.port}/"))
        with client(base) as http:
            warm = http.post("/reports", json={"title": "warm", "pages": 1}).json()["id"]
            assert _ended(http, warm)["state"] == "succeeded"
            yield _CutWorker(deployment, http, proxy)
    finally:
        deployment.stop()
        proxy.close()
        server.stop()


def test_a_claim_committed_though_its_answer_was_lost_runs_its_job(tmp_path: Path, server_dir: Path) -> None:
    """SPEC §9 (a job is re-queued when its worker dies, failed worker-lost after its last
    attempt): a worker whose claim committed, the connection lost before its answer came,
    runs the job. It tried the claim again, was refused (the job was running: its own claim)
    and acked the message, leaving the job running with no worker until the sweeper judged
    its heartbeat silent: re-queued a heartbeat timeout later, or, on its last attempt,
    failed /problems/worker-lost though no worker had died."""
    with _worker_behind_an_answer_cutter(tmp_path, server_dir, HERALD_MAX_ATTEMPTS="1") as cut:
        cut.proxy.marks = (b"job.running",)  # the claim's transition: its event type
        job_id = cut.http.post("/reports", json={"title": "claimed in doubt", "pages": 3}).json()["id"]
        assert cut.proxy.cut.wait(20), "the claim went by"
        done = _ended(cut.http, job_id)
        assert (done["state"], done["attempt"], done["error"]) == ("succeeded", 1, None), done
        assert cut.deployment.logged("worker", "the store is unreachable; trying again", write="claim")
        assert not cut.deployment.logged("gateway", "job swept")


def test_a_failure_committed_though_its_answer_was_lost_is_not_logged_as_refused(
    tmp_path: Path, server_dir: Path
) -> None:
    """A worker whose job's failure committed, the connection lost before its answer came,
    tries the failure again and is refused (the job has failed: by this very write). It
    logged a warning that the transition was rejected, which an operator reads as a stale or
    duplicate worker message; the end is recorded, and it says so."""
    with _worker_behind_an_answer_cutter(tmp_path, server_dir) as cut:
        cut.proxy.marks = (b"job.failed",)  # the failure's transition: its event type
        job_id = cut.http.post("/reports", json={"title": "fails", "pages": 2, "fail_on_page": 1}).json()["id"]
        assert cut.proxy.cut.wait(20), "the failure went by"
        done = _ended(cut.http, job_id)
        assert (done["state"], done["attempt"]) == ("failed", 1), done
        logged = cut.deployment.logged
        wait_until(lambda: logged("worker", "end recorded though its answer was lost", job_id=job_id),
                   what="the lost answer's end recorded")
        assert not logged("worker", "transition rejected", job_id=job_id, level="warning")


def test_a_notifier_records_an_answered_attempt_through_a_cut_connection(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    """A webhook the receiver answered is recorded delivered though the connection under its
    record was cut (a failover, a proxy, pg_terminate_backend): the notifier records it again.
    The attempt crashed instead, its delivery stayed leased for the lease's 30 s and was then
    sent again, a second time and late, for every attempt in flight when the store blinked."""
    from tests.test_webhooks import Receiver

    deployment = Deployment(tmp_path / "herald", database_url=postgres_server.create_database("notifier_cut"))
    deployment.nats.start()
    receiver = Receiver().start()
    runner = asyncio.Runner()
    answering = threading.Event()
    try:
        base = deployment.start_gateway()
        deployment.start_worker()
        deployment.start_notifier()
        with client(base) as http:
            endpoint = _endpoint_answered_when(answering, http, receiver, "/cut")
            job = http.post("/exports", json={"format": "csv", "rows": 10}).json()
            wait_until(lambda: receiver.hits_for("/cut"), what="the attempt in flight")
            record = _RowHolder(runner, deployment.database_url or "", job["id"], table="webhook_deliveries",
                                column="job_id", write="%herald_webhook_finish%")
            answering.set()
            record.cut_the_waiting_write()
            record.let_go()

            def delivered() -> dict[str, Any] | None:
                items = http.get(f"/webhooks/{endpoint['id']}/deliveries").json()["items"]
                return items[0] if items and items[0]["status"] == "delivered" else None

            done = wait_until(delivered, timeout=10, what="the delivery recorded delivered (well before its lease ends)")
            assert [a["status_code"] for a in done["attempts"]] == [200], done["attempts"]
        assert len(receiver.hits_for("/cut")) == 1
        _no_attempt_crashed(deployment)
    finally:
        answering.set()
        runner.close()
        receiver.stop()
        deployment.stop()


def _endpoint_answered_when(answering: threading.Event, http: httpx.Client, receiver: Any, path: str) -> dict[str, Any]:
    """A ``job.succeeded`` endpoint whose receiver (``tests.test_webhooks.Receiver``) holds each
    POST on ``path`` until ``answering`` is set, then answers 200."""
    from tests.test_webhooks import Hit

    def held_until_told(_hit: Hit, _n: int) -> tuple[int, dict[str, str]]:
        answering.wait(20)
        return 200, {}

    hook = receiver.route(path, held_until_told)
    endpoint: dict[str, Any] = http.post("/webhooks", json={"url": hook, "event_types": ["job.succeeded"]}).json()
    receiver.routes[path].hmac.append(endpoint["secret"])
    return endpoint


def _no_attempt_crashed(deployment: Deployment) -> None:
    crashed = [e for e in deployment.log_events("notifier") if e.get("event") == "webhook attempt crashed"]
    assert not crashed, crashed


class _AnswerLoser:
    """A TCP proxy on 127.0.0.1 in front of PostgreSQL that can lose a connection's answers:
    ``swallow(port)`` drops what the server sends on the connection the proxy opened from
    ``port`` (the ``client_port`` pg_stat_activity shows for it), ``cut(port)`` closes it. So a
    statement that commits on the server never gets its answer back to the client, as when a
    connection breaks after the commit (a failover, a proxy's idle timeout, a network fault)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._connections: dict[int, tuple[socket.socket, socket.socket]] = {}  # by the upstream local port
        self._swallowed: set[int] = set()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def url(self, database_url: str) -> str:
        """``database_url`` (of the server behind the proxy) through the proxy."""
        return database_url.replace(f":{self.upstream_port}/", f":{self.port}/", 1)

    def swallow(self, port: int) -> None:
        self._swallowed.add(port)

    def cut(self, port: int) -> None:
        with self._lock:
            pair = self._connections[port]
        for sock in pair:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            pairs = list(self._connections.values())
        for pair in pairs:
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        self._accepting.join(5)
        for thread in self._threads:
            thread.join(5)
        for pair in pairs:
            for sock in pair:
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            port = upstream.getsockname()[1]
            with self._lock:
                self._connections[port] = (downstream, upstream)
            for source, sink, answers in ((downstream, upstream, False), (upstream, downstream, True)):
                thread = threading.Thread(target=self._pump, args=(source, sink, port if answers else None),
                                          daemon=True)
                self._threads.append(thread)
                thread.start()

    def _pump(self, source: socket.socket, sink: socket.socket, answers_of: int | None) -> None:
        with contextlib.suppress(OSError):
            while chunk := source.recv(65536):
                if answers_of is None or answers_of not in self._swallowed:
                    sink.sendall(chunk)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def test_an_attempt_recorded_again_after_its_answer_was_lost_is_logged_once(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    """The record of an answered attempt commits, and its answer never reaches the notifier (the
    connection breaks after the commit): the notifier records the attempt again, as it does
    through any cut connection, and the store, which holds the attempt already (its own id),
    writes nothing again. The repeat added a second attempt row, so the delivery's history
    (GET /webhooks/{id}/deliveries, the portal) showed one POST twice."""
    from tests.test_webhooks import Receiver

    url = postgres_server.create_database("notifier_answer_lost")
    deployment = Deployment(tmp_path / "herald", database_url=url)
    deployment.nats.start()
    proxy = _AnswerLoser(postgres_server.port)
    receiver = Receiver().start()
    runner = asyncio.Runner()
    answering = threading.Event()
    try:
        base = deployment.start_gateway()
        deployment.start_worker()
        deployment.start_notifier(HERALD_DATABASE_URL=proxy.url(url))
        with client(base) as http:
            endpoint = _endpoint_answered_when(answering, http, receiver, "/lost")
            job = http.post("/exports", json={"format": "csv", "rows": 10}).json()
            wait_until(lambda: receiver.hits_for("/lost"), what="the attempt in flight")
            record = _RowHolder(runner, url, job["id"], table="webhook_deliveries", column="job_id",
                                write="%herald_webhook_finish%")
            answering.set()
            writer = record.waiting_write()
            port = runner.run(record.observer.fetchval("SELECT client_port FROM pg_stat_activity WHERE pid = $1",
                                                       writer))
            proxy.swallow(port)
            record.release()

            def committed() -> bool:
                return bool(runner.run(record.observer.fetchval(
                    "SELECT count(*) FROM webhook_attempts a JOIN webhook_deliveries d ON d.id = a.delivery_id"
                    " WHERE d.job_id = $1", job["id"]))) and runner.run(record.observer.fetchval(
                        "SELECT state FROM pg_stat_activity WHERE pid = $1", writer)) == "idle"

            wait_until(committed, what="the record committed, its answer swallowed")
            proxy.cut(port)  # the answer is lost with the connection
            record.let_go()
            # The notifier recorded the attempt again and was answered (its line for the attempt
            # is written once the record returns), well before the lease would have run out...
            wait_until(lambda: deployment.logged("notifier", "webhook attempt", outcome="delivered"), timeout=10,
                       what="the attempt recorded again and logged")
            assert deployment.logged("notifier",
                                     "recording a webhook attempt failed: the store is unreachable; trying again")
            # ...and one POST is one attempt in the delivery's history.
            [done] = http.get(f"/webhooks/{endpoint['id']}/deliveries").json()["items"]
            assert done["status"] == "delivered"
            assert [a["status_code"] for a in done["attempts"]] == [200], done["attempts"]
        assert len(receiver.hits_for("/lost")) == 1
        assert deployment.count_rows("webhook_attempts") == {"webhook_attempts": 1}
        _no_attempt_crashed(deployment)
    finally:
        answering.set()
        runner.close()
        receiver.stop()
        deployment.stop()
        proxy.close()


async def _cut_the_first_directory_read(deployment: Deployment, name: str, argv: list[str]) -> None:
    """Start ``argv`` while the tenant directory's version row is locked, and cut the connection
    of its first read of it (pg_terminate_backend) once that read waits for the lock."""
    assert deployment.database_url is not None
    holder, killer = await asyncpg.connect(deployment.database_url), await asyncpg.connect(deployment.database_url)
    try:
        async with holder.transaction():
            await holder.execute("LOCK TABLE herald_directory IN ACCESS EXCLUSIVE MODE")
            extra = {}
            if name == "gateway":
                deployment.ports[name] = free_port()
                extra["HERALD_HTTP_PORT"] = str(deployment.ports[name])
            deployment._spawn(name, argv, deployment.env(**extra))
            deadline = time.monotonic() + 20
            while not (waiting := await killer.fetch(
                    "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND query LIKE '%herald_directory%' AND pid <> pg_backend_pid()")):
                assert time.monotonic() < deadline, f"{name} never read the directory"
                await asyncio.sleep(0.05)
            for row in waiting:
                await killer.execute("SELECT pg_terminate_backend($1)", row["pid"])
    finally:
        await holder.close()
        await killer.close()


def test_a_gateway_whose_first_directory_read_is_cut_loads_it_and_gets_ready(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    """SPEC §12 (a change holds on every gateway) and §9: the store opens, then the connection
    under the gateway's first read of the tenant directory is cut (a failover, a proxy,
    pg_terminate_backend). The gateway read it again and gets ready. It gave up for good: it
    never connected to NATS (/readyz 503 until restarted), every key made over /admin got 503,
    and a key of a disabled tenant from HERALD_API_KEYS was let in, with default limits."""
    deployment = Deployment(tmp_path / "herald", database_url=postgres_server.create_database("directory_cut"))
    deployment.nats.start()
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    runner = asyncio.Runner()
    try:
        first = deployment.start_gateway("first")
        assert httpx.post(first + "/admin/tenants", json={"id": "blink"}, headers=admin, timeout=10).status_code == 201
        issued = httpx.post(first + "/admin/tenants/blink/keys", json={"name": "k"}, headers=admin, timeout=10).json()
        assert httpx.patch(first + "/admin/tenants/acme", json={"disabled": True}, headers=admin,
                           timeout=10).status_code == 200
        deployment.kill("first", signal.SIGTERM)  # nothing else reads the directory now

        runner.run(_cut_the_first_directory_read(deployment, "gateway", ["gateway"]))
        base = deployment.url()
        wait_until(lambda: httpx.get(base + "/readyz", timeout=2, verify=TLS).status_code == 200, timeout=20,
                   what="/readyz 200 once the directory is read")
        assert httpx.get(base + "/jobs", headers={"Authorization": f"Bearer {issued['key']}"},
                         timeout=5).status_code == 200
        assert httpx.get(base + "/jobs", headers={"Authorization": "Bearer key-acme"}, timeout=5).status_code == 401
        said = [str(e.get("event")) for e in deployment.log_events("gateway")]
        assert any("the tenant directory failed" in line and "retrying" in line for line in said), said
        assert "background task failed" not in said
    finally:
        runner.close()
        deployment.stop()


def test_a_worker_whose_first_directory_read_is_cut_reads_it_again_and_runs_jobs(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    """The same cut under a worker's first read of the tenant directory (a notifier's is the
    same code): it reads it again and serves. It exited 1 with a traceback, a crash a store
    that blinked once should not cause, and a standalone ``herald worker`` stayed down."""
    deployment = Deployment(tmp_path / "herald", database_url=postgres_server.create_database("directory_cut_worker"))
    deployment.nats.start()
    runner = asyncio.Runner()
    try:
        deployment.start_gateway("first")  # the schema
        deployment.kill("first", signal.SIGTERM)  # nothing else reads the directory now
        runner.run(_cut_the_first_directory_read(deployment, "worker", ["worker"]))
        with client(deployment.start_gateway()) as http:
            job = http.post("/reports", json={"title": "after the cut", "pages": 1}).json()
            wait_for_state(http, job["id"], {"succeeded"})
        assert deployment.processes["worker"].poll() is None, deployment.log_text("worker")[-3000:]
        said = [str(e.get("event")) for e in deployment.log_events("worker")]
        assert any("the tenant directory failed" in line and "retrying" in line for line in said), said
    finally:
        runner.close()
        deployment.stop()
