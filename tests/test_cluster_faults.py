"""Faults an operator of a clustered Herald meets (SPEC §8, §9, §11), caused for real.

Three nats-server nodes (R3), a PostgreSQL server of the test's own (so it can be
killed and started again), results in the NATS object store, and two gateways, two
workers and two notifiers, each with its own data dir. Where ``tests/test_scale_out.py``
kills one of each and restarts nothing, these restart what they kill and read what a
client reads across the fault: a browser's ``EventSource`` on a gateway killed under it
(it reconnects to the other with ``Last-Event-ID``); a job's streamed output while NATS
nodes die and come back, two at once (no quorum) included; a burst of starts while
PostgreSQL is killed and recovers; notifiers and workers killed again and again; a large
result downloaded while the object stream's leaders die. After each: every job ends, on
its first attempt unless its worker died, with one result, and every committed event
reached the tenant's streams and the webhook receiver exactly as the JSON feed
(``GET /events?after=``) lists it: nothing missed, nothing twice, in commit order.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from herald.constants import EVENTS_STREAM, JOBS_STREAM, OUTPUT_STREAM
from launcher.pgserver import PostgresServer
from tests.harness import KEYS, Deployment, NatsCluster, client, free_port, sse_frames, wait_until
from tests.test_scale_out import Receiver, list_jobs, read_feed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TENANT = "acme"
TERMINAL = {"job.succeeded", "job.failed", "job.cancelled"}


# ----- an EventSource that fails over between gateways ------------------------------------


@dataclass
class Frame:
    id: str | None
    type: str
    data: Any


class EventSource:
    """Reads ``path`` as a browser's EventSource behind a load balancer would: a dropped
    connection is reopened after ``retry`` on the next gateway that answers, with
    ``Last-Event-ID``. A 204 stops it for good, as it stops a browser's."""

    def __init__(self, bases: list[str], path: str, headers: dict[str, str] | None = None) -> None:
        self.bases = bases
        self.path = path
        self.frames: list[Frame] = []
        self.errors: list[str] = []
        self.statuses: list[int] = []
        self.connects: list[str] = []
        self.ended = threading.Event()
        self.opened = threading.Event()
        self._headers = headers or {}
        self._last_id: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> EventSource:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1)

    def snapshot(self) -> list[Frame]:
        with self._lock:
            return list(self.frames)

    def _run(self) -> None:
        turn = 0
        while not self._stop.is_set() and not self.ended.is_set():
            base = self.bases[turn % len(self.bases)]
            try:
                self._read_once(base)
            except Exception as exc:  # noqa: BLE001  (a dropped connection: reconnect, as EventSource does)
                self.errors.append(f"{base}: {exc!r}")
                turn += 1  # the load balancer takes the next gateway
            if self._stop.wait(0.3):
                return

    def _read_once(self, base: str) -> None:
        headers = {"Accept": "text/event-stream", **self._headers}
        if self._last_id is not None:
            headers["Last-Event-ID"] = self._last_id
        with httpx.Client(base_url=base, timeout=httpx.Timeout(3.0, read=20.0)) as http, \
                http.stream("GET", self.path, headers=headers) as response:
            self.statuses.append(response.status_code)
            self.connects.append(base)
            if response.status_code == 204:
                self.ended.set()
                return
            if response.status_code != 200:
                raise RuntimeError(f"answered {response.status_code}: {response.read()[:300]!r}")
            for frame in sse_frames(response.iter_lines(), self.opened, self._stop):
                if frame.data is not None:
                    with self._lock:
                        self.frames.append(Frame(frame.id, frame.type, frame.data))
                if frame.id is not None:
                    self._last_id = frame.id
            # The stream ended: the browser reconnects (to the same gateway first).


# ----- the rig -----------------------------------------------------------------------------


@dataclass
class Rig:
    root: Path
    postgres: PostgresServer
    cluster: NatsCluster
    deployment: Deployment
    receiver: Receiver
    bases: dict[str, str] = field(default_factory=dict)

    def spawn_all(self) -> None:
        for name in ("g1", "g2"):
            self.bases[name] = self.deployment.start_gateway(name, None, HERALD_DATA_DIR=str(self.root / "data" / name))
        for name in ("w1", "w2"):
            self.deployment.start_worker(name, HERALD_DATA_DIR=str(self.root / "data" / name))
        for name in ("n1", "n2"):
            self.deployment.start_notifier(name, HERALD_DATA_DIR=str(self.root / "data" / name))

    def print_logs(self, tail: int = 40) -> None:
        print("\n========== process logs (tails) ==========")
        for path in sorted(self.deployment.logs.glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()
            print(f"----- {path.name} ({len(lines)} lines) -----")
            print("\n".join(line[:600] for line in lines[-tail:]))


@pytest.fixture()
def rig(tmp_path: Path, server_dir: Path) -> Iterator[Rig]:
    postgres = PostgresServer(server_dir / "pg", port=free_port())
    postgres.start()
    cluster = NatsCluster(tmp_path / "cluster", max_file_store="8GB")
    receiver = Receiver().start()
    deployment = Deployment(tmp_path, database_url=postgres.create_database("herald"), env_overrides={
        "HERALD_NATS_URL": cluster.urls,
        "HERALD_NATS_REPLICAS": "3",
        "HERALD_RESULT_STORE": "nats",
        "HERALD_SIGNING_KEY": secrets.token_urlsafe(32),
        "HERALD_WEBHOOK_RETRY_SCHEDULE": "0.5,1,1,2,2,5",
        "HERALD_REPORT_PAGE_MS": "40",
    })
    try:
        cluster.start()
        rig = Rig(tmp_path, postgres, cluster, deployment, receiver)
        rig.spawn_all()
        with client(rig.bases["g2"]) as http:
            created = http.post("/webhooks", json={"url": receiver.url})
            assert created.status_code == 201, created.text
            receiver.secret = created.json()["secret"]
        yield rig
    finally:
        deployment.stop()
        cluster.stop()
        receiver.stop()
        postgres.stop()


class Starter:
    """Starts a report or an export every ``interval`` s at the gateways in turn, skipping a
    gateway that does not answer; records every answer."""

    def __init__(self, bases: list[str], interval: float = 0.15) -> None:
        self.bases = bases
        self.interval = interval
        self.accepted: dict[str, str] = {}  # job id -> path
        self.answers: list[tuple[int, str]] = []
        self.lost: list[str] = []
        self.bad: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Starter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        clients = [client(b, TENANT) for b in self.bases]
        i = 0
        try:
            while not self._stop.is_set():
                i += 1
                http = clients[i % len(clients)]
                path, body = (("/reports", {"title": f"f{i}", "pages": 5 + i % 20}) if i % 2
                              else ("/exports", {"format": "csv", "rows": 50 + i}))
                try:
                    answer = http.post(path, json=body)
                except httpx.TransportError as exc:
                    self.lost.append(f"{http.base_url}: {exc!r}")
                else:
                    if answer.status_code != 202 and not (
                            answer.status_code == 503 and int(answer.headers.get("retry-after", "0")) >= 1
                            and answer.headers["content-type"].startswith("application/problem+json")):
                        self.bad.append(f"{answer.status_code} {dict(answer.headers)} {answer.text[:300]}")
                    self.answers.append((answer.status_code, answer.text[:300]))
                    if answer.status_code == 202:
                        self.accepted[answer.json()["id"]] = path
                self._stop.wait(self.interval)
        finally:
            for http in clients:
                http.close()

    def count(self) -> int:
        return len(self.accepted)


def all_end(http: httpx.Client, ids: list[str], timeout: float = 120) -> dict[str, dict[str, Any]]:
    final: dict[str, dict[str, Any]] = {}

    def ended() -> bool:
        for job_id in set(ids) - final.keys():
            status = http.get(f"/jobs/{job_id}").json()
            if status["state"] in ("succeeded", "failed", "cancelled"):
                final[job_id] = status
        return len(final) == len(ids)

    wait_until(ended, timeout=timeout, interval=0.3, what=f"all {len(ids)} jobs to end")
    return final


def report(rig: Rig, findings: list[str]) -> None:
    """Every violation at once, with the tails of the processes' logs when there are any."""
    if findings:
        rig.print_logs()
    assert not findings, "\n".join(findings)


def check_delivered(rig: Rig, http: httpx.Client, final: dict[str, dict[str, Any]], findings: list[str]) -> list[dict[str, Any]]:
    """The feed lists each job's versions once, in order; the receiver got each job's
    terminal event once per webhook-id, in version order. Returns the feed."""
    feed = read_feed(http)
    ids = [e["id"] for e in feed]
    if len(set(ids)) != len(ids):
        findings.append("an event twice in the feed")
    by_job: dict[str, list[int]] = defaultdict(list)
    for event in feed:
        by_job[event["data"]["id"]].append(event["data"]["version"])
    for job_id, status in final.items():
        if by_job[job_id] != list(range(1, status["version"] + 1)):
            findings.append(f"{job_id}: feed versions {by_job[job_id]}, last {status['version']}")
        if status["state"] != "succeeded":
            findings.append(f"{job_id} ended {status['state']}: {status.get('error')}")

    def terminal_delivered() -> bool:
        return {d.job_id for d in rig.receiver.snapshot() if d.type in TERMINAL} >= final.keys()

    with contextlib.suppress(AssertionError):
        wait_until(terminal_delivered, timeout=60, interval=0.3, what="terminal deliveries")
    first: dict[str, Any] = {}
    for delivery in rig.receiver.snapshot():
        first.setdefault(delivery.webhook_id, delivery)
    versions: dict[str, list[int]] = defaultdict(list)
    terminal: dict[str, int] = defaultdict(int)
    for delivery in first.values():
        versions[delivery.job_id].append(delivery.version)
        terminal[delivery.job_id] += delivery.type in TERMINAL
    for job_id in final:
        if terminal[job_id] != 1:
            findings.append(f"{job_id}: {terminal[job_id]} terminal webhook-ids")
        if versions[job_id] != sorted(versions[job_id]):
            findings.append(f"{job_id}: deliveries out of version order {versions[job_id]}")
    if rig.receiver.problems:
        findings.append(f"receiver: {rig.receiver.problems[:3]}")
    return feed


def settled(streams: list[EventSource], http: httpx.Client) -> list[dict[str, Any]]:
    """Once every job has ended: the feed, after each tenant stream has as many events from
    its first one as the feed has (or 20 s have passed), the streams stopped."""
    feed = read_feed(http)
    ids = [e["id"] for e in feed]

    def caught_up(stream: EventSource) -> bool:
        got = stream.snapshot()
        return bool(got) and got[0].id in ids and len(got) >= len(ids) - ids.index(got[0].id)

    with contextlib.suppress(AssertionError):
        wait_until(lambda: all(caught_up(s) for s in streams), timeout=20, interval=0.2, what="tenant streams caught up")
    for stream in streams:
        stream.stop()
    return feed


def check_tenant_stream(stream: EventSource, feed: list[dict[str, Any]], findings: list[str], name: str) -> None:
    """The stream's events are the feed's, from the first it got: the same ids, in the same order."""
    got = [(f.id, f.type) for f in stream.snapshot()]
    if not got:
        findings.append(f"{name}: no events")
        return
    ids = [e["id"] for e in feed]
    if got[0][0] not in ids:
        findings.append(f"{name}: first id {got[0][0]} not in the feed")
        return
    start = ids.index(got[0][0])
    expected = [(e["id"], e["type"]) for e in feed[start:]]
    if got != expected[:len(got)] or len(got) < len(expected):
        missing = [e for e in expected if e not in got]
        twice = [e for e in got if got.count(e) > 1]
        order = [e for e in got if e in expected] != [e for e in expected if e in got]
        findings.append(f"{name}: {len(got)} events, feed has {len(expected)} from the same point; "
                        f"missing {missing[:10]}, twice {twice[:10]}, out of order {order}; "
                        f"connects {stream.connects}, errors {stream.errors[:4]}")


def check_job_stream(stream: EventSource, status: dict[str, Any], findings: list[str], name: str) -> None:
    frames = stream.snapshot()
    versions = [f.data["version"] for f in frames]
    if versions != list(range(versions[0] if versions else 0, status["version"] + 1)) or not versions:
        findings.append(f"{name}: versions {versions}, last {status['version']}; connects {stream.connects}, "
                        f"statuses {stream.statuses}, errors {stream.errors[:4]}")
    if not stream.ended.is_set():
        findings.append(f"{name}: not stopped by a 204 (statuses {stream.statuses})")


def check_output_stream(stream: EventSource, pages: int, status: dict[str, Any], findings: list[str], name: str) -> None:
    frames = stream.snapshot()
    chunks = [int(f.id or 0) for f in frames if f.type == "output"]
    if chunks != list(range(1, pages + 1)):
        findings.append(f"{name}: chunks {chunks} {[f.data for f in frames][:3]}...{[f.data for f in frames][-3:]}; "
                        f"status {status}; connects {stream.connects}, statuses {stream.statuses}, "
                        f"errors {stream.errors[:4]}")
    ends = [f.type for f in frames if f.type != "output"]
    if ends != [f"job.{status['state']}"]:
        findings.append(f"{name}: terminal frames {ends}")


# ----- the faults --------------------------------------------------------------------------


def test_kill_9_of_the_gateway_under_browsers_streams(rig: Rig) -> None:
    """Streams read at g1 (the tenant's, a job's, a job's output) go on at g2 when g1 is
    killed: resumed with Last-Event-ID, nothing missed or twice, ended by a 204."""
    g1, g2 = rig.bases["g1"], rig.bases["g2"]
    findings: list[str] = []
    auth = {"Authorization": f"Bearer {KEYS[TENANT]}"}
    with client(g2) as http:
        pages = 60
        watched = http.post("/reports", json={"title": "watched", "pages": pages}).json()
        tenant = EventSource([g1, g2], "/events", auth).start()
        job = EventSource([g1, g2], f"/jobs/{watched['id']}/events", auth).start()
        output = EventSource([g1, g2], f"/jobs/{watched['id']}/output", auth).start()
        for stream in (tenant, job, output):
            assert stream.opened.wait(10)
        starter = Starter([g1, g2]).start()
        try:
            wait_until(lambda: len(output.snapshot()) >= 10, timeout=30, what="output chunks at g1")
            rig.deployment.kill("g1", signal.SIGKILL)
            wait_until(lambda: starter.count() >= 30, timeout=60, what="starts after the kill")
        finally:
            starter.stop()
        final = all_end(http, [watched["id"], *starter.accepted])
        wait_until(lambda: job.ended.is_set() and output.ended.is_set(), timeout=30, what="job streams stopped")
        check_delivered(rig, http, final, findings)
        check_tenant_stream(tenant, settled([tenant], http), findings, "tenant stream")
        check_job_stream(job, final[watched["id"]], findings, "job stream")
        check_output_stream(output, pages, final[watched["id"]], findings, "output stream")
        for name, stream in (("tenant", tenant), ("job", job), ("output", output)):
            if g2 not in stream.connects:
                findings.append(f"the {name} stream never went on at g2: {stream.connects}")
        bad = [a for a in starter.answers if a[0] != 202]
        if bad:
            findings.append(f"starts answered {bad[:5]}")
    print(f"\nstarts: {Counter(a[0] for a in starter.answers)}")
    report(rig, findings)


@dataclass
class UnderLoad:
    """A report emitting output, watched on the tenant's stream and its output stream, while
    starts arrive at both gateways."""

    http: httpx.Client
    watched: dict[str, Any]
    pages: int
    tenant: EventSource
    output: EventSource
    starter: Starter


@contextlib.contextmanager
def nats_faults_under_load(rig: Rig, end_within: float, every_start_202: bool, pages: int = 150) -> Iterator[UnderLoad]:
    """The load the NATS faults below are caused under: the block runs once the report has
    emitted some output; when it ends, the starts stop and ``check_after_nats_faults`` runs."""
    g1, g2 = rig.bases["g1"], rig.bases["g2"]
    auth = {"Authorization": f"Bearer {KEYS[TENANT]}"}
    with client(g2) as http:
        watched = http.post("/reports", json={"title": "watched", "pages": pages}).json()
        tenant = EventSource([g1, g2], "/events", auth).start()
        output = EventSource([g2, g1], f"/jobs/{watched['id']}/output", auth).start()
        for stream in (tenant, output):
            assert stream.opened.wait(10)
        starter = Starter([g1, g2]).start()
        load = UnderLoad(http, watched, pages, tenant, output, starter)
        try:
            wait_until(lambda: len(output.snapshot()) >= 10, timeout=30, what="output chunks")
            yield load
        finally:
            starter.stop()
        check_after_nats_faults(rig, load, end_within, every_start_202)


def check_after_nats_faults(rig: Rig, load: UnderLoad, end_within: float, every_start_202: bool) -> None:
    """Every job ended, delivered and in the tenant's stream once, the output whole and in
    order, every result readable, every start answered: 202, or (without ``every_start_202``:
    while JetStream has no quorum) a 503 with Retry-After."""
    findings: list[str] = []
    http, starter = load.http, load.starter
    final = all_end(http, [load.watched["id"], *starter.accepted], timeout=end_within)
    wait_until(lambda: load.output.ended.is_set(), timeout=30, what="the output stream stopped")
    check_delivered(rig, http, final, findings)
    check_tenant_stream(load.tenant, settled([load.tenant], http), findings, "tenant stream")
    check_output_stream(load.output, load.pages, final[load.watched["id"]], findings, "output stream")
    for job_id, path in starter.accepted.items():
        if final[job_id]["state"] == "succeeded":
            got = http.get(f"{path}/{job_id}")
            if got.status_code != 200:
                findings.append(f"{job_id}: result {got.status_code} {got.text[:200]}")
    bad = [a for a in starter.answers if a[0] != 202] if every_start_202 else starter.bad
    if bad:
        findings.append(f"starts answered {bad[:5]}")
    if starter.lost:
        findings.append(f"starts lost {starter.lost[:3]}")
    print(f"\nstarts: {Counter(a[0] for a in starter.answers)}")
    report(rig, findings)


def test_a_nats_node_killed_and_restarted_then_another(rig: Rig) -> None:
    """kill -9 the node leading the jobs, events and output streams mid-burst, restart it,
    then kill -9 the next leader: with a job emitting output and streams open throughout."""
    with nats_faults_under_load(rig, end_within=120, every_start_202=True) as load:
        starter = load.starter
        first = rig.cluster.stream_leader(JOBS_STREAM)
        rig.cluster.kill(first, signal.SIGKILL)
        wait_until(lambda: starter.count() >= 20, timeout=60, what="starts after the first kill")
        rig.cluster._spawn(first)
        rig.cluster.wait_jetstream(60)
        wait_until(lambda: starter.count() >= 40, timeout=60, what="starts after the restart")
        second = rig.cluster.stream_leader(EVENTS_STREAM)
        if second == first:
            second = rig.cluster.stream_leader(OUTPUT_STREAM)
        if second == first:
            second = (first + 1) % 3
        rig.cluster.kill(second, signal.SIGKILL)
        wait_until(lambda: starter.count() >= 60, timeout=60, what="starts after the second kill")


def test_postgres_killed_and_restarted_mid_burst(rig: Rig) -> None:
    """PostgreSQL killed (-9) while starts arrive at both gateways and jobs run, and started
    again (crash recovery) 5 s later, longer than the heartbeat timeout: every start is
    answered 202 or 503 with Retry-After (never a 500), every accepted job ends succeeded on
    its first attempt (its worker lived through it), each report's output once, and every
    event reaches the feed, the tenant streams at both gateways and the webhooks once."""
    g1, g2 = rig.bases["g1"], rig.bases["g2"]
    findings: list[str] = []
    auth = {"Authorization": f"Bearer {KEYS[TENANT]}"}
    with client(g2) as http:
        pages = 100
        watched = http.post("/reports", json={"title": "watched", "pages": pages}).json()
        tenant1 = EventSource([g1], "/events", auth).start()
        tenant2 = EventSource([g2], "/events", auth).start()
        output = EventSource([g1], f"/jobs/{watched['id']}/output", auth).start()
        job = EventSource([g2], f"/jobs/{watched['id']}/events", auth).start()
        for stream in (tenant1, tenant2, output, job):
            assert stream.opened.wait(10)
        starter = Starter([g1, g2], interval=0.1).start()
        try:
            wait_until(lambda: starter.count() >= 15, timeout=60, what="starts before the restart")
            rig.postgres.kill(signal.SIGKILL)
            time.sleep(5)  # the outage's length (beyond the heartbeat timeout), not a wait for a state
            rig.postgres.start()
            wait_until(lambda: starter.count() >= 50, timeout=90, what="starts after the restart")
        finally:
            starter.stop()
        final = all_end(http, [watched["id"], *starter.accepted], timeout=180)
        wait_until(lambda: output.ended.is_set() and job.ended.is_set(), timeout=30, what="job streams stopped")
        check_delivered(rig, http, final, findings)
        feed = settled([tenant1, tenant2], http)
        check_tenant_stream(tenant1, feed, findings, "tenant stream at g1")
        check_tenant_stream(tenant2, feed, findings, "tenant stream at g2")
        check_job_stream(job, final[watched["id"]], findings, "job stream")
        check_output_stream(output, pages, final[watched["id"]], findings, "output stream")
        if starter.bad:
            findings.append(f"starts answered {starter.bad[:5]}")
        if starter.lost:
            findings.append(f"starts lost {starter.lost[:3]}")
        rerun = {job_id: status["attempt"] for job_id, status in final.items() if status["attempt"] != 1}
        if rerun:
            findings.append(f"jobs run again though no worker died: {rerun}")
        everything = list_jobs(http)
        unknown = [j["id"] for j in everything if j["id"] not in final]
        if unknown:
            findings.append(f"jobs that were not answered 202: {unknown[:5]}")
    print(f"\nstarts: {Counter(a[0] for a in starter.answers)}")
    report(rig, findings)


def test_two_nats_nodes_killed_at_once_and_restarted(rig: Rig) -> None:
    """Two of the three nodes killed (-9) at once, so JetStream has no quorum for 5 s, then
    started again. Starts go on at both gateways throughout (the store takes them; the
    outbox holds their messages), a job emits output, streams stay open."""
    with nats_faults_under_load(rig, end_within=180, every_start_202=False) as load:
        starter = load.starter
        leader = rig.cluster.stream_leader(JOBS_STREAM)
        victims = [leader, (leader + 1) % 3]
        for index in victims:
            rig.cluster.kill(index, signal.SIGKILL)
        time.sleep(5)  # the fault's length, not a wait for a state
        for index in victims:
            rig.cluster._spawn(index)
        rig.cluster.wait_jetstream(60)
        count = starter.count()
        wait_until(lambda: starter.count() >= count + 20, timeout=60, what="starts after quorum is back")


def stored_results(rig: Rig) -> dict[str, list[str]]:
    """Every object of the result store, by job id."""
    import asyncio

    import nats

    from herald.constants import RESULTS_BUCKET

    async def read() -> dict[str, list[str]]:
        nc = await nats.connect(servers=rig.cluster.url_list)
        try:
            objects = await (await nc.jetstream().object_store(RESULTS_BUCKET)).list(ignore_deletes=True)
        finally:
            await nc.close()
        found: dict[str, list[str]] = defaultdict(list)
        for o in objects:
            job_id, _, name = o.name.partition("/")
            found[job_id].append(name)
        return found

    return asyncio.run(read())


def test_notifiers_and_workers_killed_again_and_again(rig: Rig) -> None:
    """kill -9 a notifier and a worker, then the other of each, every couple of seconds,
    each started again: every job ends once with one result, every delivery of the
    endpoint ends delivered or superseded, each event once, the terminal ones delivered."""
    findings: list[str] = []
    with client(rig.bases["g2"]) as http:
        starter = Starter([rig.bases["g1"], rig.bases["g2"]], interval=0.1).start()
        try:
            for victim in ("n1", "w1", "n2", "w2", "n1", "w1"):
                count = starter.count()
                wait_until(lambda count=count: starter.count() >= count + 8, timeout=60, what="starts")
                rig.deployment.kill(victim, signal.SIGKILL)
                data = str(rig.root / "data" / victim)
                if victim.startswith("n"):
                    rig.deployment.start_notifier(victim, HERALD_DATA_DIR=data)
                else:
                    rig.deployment.start_worker(victim, HERALD_DATA_DIR=data)
        finally:
            starter.stop()
        final = all_end(http, list(starter.accepted), timeout=180)
        check_delivered(rig, http, final, findings)
        endpoint = http.get("/webhooks").json()["items"][0]["id"]

        def settled() -> list[dict[str, Any]]:
            rows: list[dict[str, Any]] = []
            params: dict[str, Any] = {"limit": 100}
            while True:
                page = http.get(f"/webhooks/{endpoint}/deliveries", params=params).json()
                rows += page["items"]
                if not page["next_cursor"]:
                    break
                params["cursor"] = page["next_cursor"]
            return rows

        with contextlib.suppress(AssertionError):
            wait_until(lambda: not [r for r in settled() if r["status"] == "pending"], timeout=60,
                       interval=0.5, what="no delivery pending")
        rows = settled()
        statuses = Counter(r["status"] for r in rows)
        if set(statuses) - {"delivered", "superseded"}:
            findings.append(f"deliveries: {dict(statuses)}")
        events = Counter(r["event_id"] for r in rows)
        twice = [e for e, n in events.items() if n > 1]
        if twice:
            findings.append(f"events with more than one delivery row: {twice[:5]}")
        results = stored_results(rig)
        for job_id, status in final.items():
            if status["state"] == "succeeded" and len(results.get(job_id, [])) != 1:
                findings.append(f"{job_id} (attempt {status['attempt']}): results {results.get(job_id)}")
        print(f"\ndeliveries {dict(statuses)}; attempts {Counter(s['attempt'] for s in final.values())}")
    report(rig, findings)


def test_one_nats_restarted_under_a_streamed_output(fresh: Deployment) -> None:
    """herald up's one nats-server killed (-9) and started again while a report emits and a
    browser reads its output and its events: each chunk once, in order, at SSE and NDJSON."""
    base = fresh.start_gateway()
    fresh.start_worker(HERALD_REPORT_PAGE_MS="40")
    findings: list[str] = []
    auth = {"Authorization": f"Bearer {KEYS[TENANT]}"}
    pages = 120
    with client(base) as http:
        watched = http.post("/reports", json={"title": "watched", "pages": pages}).json()
        output = EventSource([base], f"/jobs/{watched['id']}/output", auth).start()
        job = EventSource([base], f"/jobs/{watched['id']}/events", auth).start()
        tenant = EventSource([base], "/events", auth).start()
        for stream in (output, job, tenant):
            assert stream.opened.wait(10)
        wait_until(lambda: len(output.snapshot()) >= 10, timeout=30, what="output chunks")
        fresh.nats.stop(signal.SIGKILL)
        time.sleep(2)  # the fault's length, not a wait for a state
        fresh.nats.start()
        others = [http.post("/exports", json={"format": "csv", "rows": 10}).json()["id"] for _ in range(5)]
        final = all_end(http, [watched["id"], *others])
        wait_until(lambda: output.ended.is_set() and job.ended.is_set(), timeout=30, what="job streams stopped")
        check_output_stream(output, pages, final[watched["id"]], findings, "output stream")
        check_job_stream(job, final[watched["id"]], findings, "job stream")
        check_tenant_stream(tenant, settled([tenant], http), findings, "tenant stream")
        ndjson = [json.loads(line)["n"] for line in http.get(f"/jobs/{watched['id']}/output").text.splitlines()]
        if ndjson != list(range(1, pages + 1)):
            findings.append(f"NDJSON: {ndjson}")
        for job_id, status in final.items():
            if (status["state"], status["attempt"]) != ("succeeded", 1):
                findings.append(f"{job_id}: {status['state']} attempt {status['attempt']} {status['error']}")
    assert not findings, "\n".join(findings)


def leader_of(rig: Rig, stream: str, timeout: float = 30) -> int:
    """The node leading ``stream``, asked again while an election is under way."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return rig.cluster.stream_leader(stream)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def test_a_download_from_the_object_store_while_nodes_die_and_come_back(rig: Rig) -> None:
    """A large result read slowly from g2 while its object stream's leader is killed (-9),
    started again, and the next leader killed: the download completes, whole."""
    from herald.constants import RESULTS_BUCKET
    from herald.storage.results import object_stream

    rows = 150_000
    with client(rig.bases["g2"]) as http:
        job = http.post("/exports", json={"format": "csv", "rows": rows}).json()
        done = all_end(http, [job["id"]], timeout=120)[job["id"]]
        assert done["state"] == "succeeded", done
        received = bytearray()
        with httpx.Client(base_url=rig.bases["g2"], headers={"Authorization": f"Bearer {KEYS[TENANT]}"},
                          timeout=httpx.Timeout(10, read=60)) as slow, \
                slow.stream("GET", f"/exports/{job['id']}") as answer:
            assert answer.status_code == 200
            size = int(answer.headers["content-length"])
            killed: list[int] = []
            for chunk in answer.iter_bytes(65536):
                received += chunk
                if len(received) > size // 4 and not killed:
                    killed.append(rig.cluster.stream_leader(object_stream(RESULTS_BUCKET)))
                    rig.cluster.kill(killed[0], signal.SIGKILL)
                elif len(received) > size // 2 and len(killed) == 1:
                    rig.cluster._spawn(killed[0])
                    rig.cluster.wait_jetstream(60)
                    killed.append(leader_of(rig, object_stream(RESULTS_BUCKET)))
                    rig.cluster.kill(killed[1], signal.SIGKILL)
                time.sleep(0.002)
        assert len(killed) == 2
        assert len(received) == size
        lines = received.decode().splitlines()
        assert len(lines) == rows + 1 and lines[0].startswith("order_id,")
