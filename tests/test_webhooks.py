"""Webhooks end to end (SPEC §7): real nats-server, gateway, worker and notifier processes,
and a real HTTP receiver on 127.0.0.1 that verifies every delivery it gets — HMAC with the
reference ``standardwebhooks`` library, Ed25519 (``v1a``) with ``cryptography``."""

from __future__ import annotations

import asyncio
import base64
import random
import uuid
import json
import signal
import socket
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx
import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

import herald
from herald.deliveries import Attempted, Claimed, Finished
from herald.jobs import NewJob
from herald.settings import Settings, SettingsError
from herald.ssrf import UnsafeUrl, check_url_syntax, is_public_address
from herald.storage.sqlite.db import Database
from herald.storage.sqlite.jobs import SqliteJobStore as Store
from herald.storage.sqlite.queue import SqliteDeliveryQueue as DeliveryQueue
from herald.storage.sqlite.schema import SCHEMA
from herald.storage.sqlite.webhooks import SqliteWebhookStore as WebhookStore
from herald.deliveries import Outcome, Plan
from notifier.delivery import MAX_ANSWER_LINE_BYTES, Sender
from notifier.recorder import Recorder
from notifier.retry import RetryPolicy
from schemas import JobEvent
from tests.harness import Deployment, client, free_port, make_sealer, new_database, wait_for_state, wait_until

SCHEDULE = "0.2,0.2,0.2"  # three retries, fast
MIN_BACKOFF_S = 1.5  # HERALD_WEBHOOK_MIN_BACKOFF_S: 60 s in production
TERMINAL = {"job.succeeded", "job.failed", "job.cancelled"}
T = TypeVar("T")


# ----- a real receiver ---------------------------------------------------------------------


@dataclass
class Hit:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float
    answered: int = 0

    @property
    def payload(self) -> dict[str, Any]:
        return json.loads(self.body)

    @property
    def webhook_id(self) -> str:
        return self.headers["webhook-id"]

    @property
    def job_id(self) -> str:
        return str(self.payload["data"]["id"])

    @property
    def version(self) -> int:
        return int(self.payload["data"]["version"])

    @property
    def type(self) -> str:
        return str(self.payload["type"])


# (hit, how many times this webhook-id reached this path, this one included) -> (status, headers)
Behaviour = Callable[[Hit, int], tuple[int, dict[str, str]]]


def ok(_hit: Hit, _n: int) -> tuple[int, dict[str, str]]:
    return 200, {}


@dataclass
class Route:
    behaviour: Behaviour = ok
    hmac: list[str] = field(default_factory=list)
    ed25519: list[str] = field(default_factory=list)
    seen: Counter[str] = field(default_factory=Counter)


def _ed25519_verifies(public_key: str, hit: Hit) -> bool:
    key = Ed25519PublicKey.from_public_bytes(base64.b64decode(public_key.removeprefix("whpk_")))
    content = f"{hit.webhook_id}.{hit.headers['webhook-timestamp']}.".encode() + hit.body
    for item in hit.headers["webhook-signature"].split():
        version, _, signature = item.partition(",")
        if version != "v1a":
            continue
        try:
            key.verify(base64.b64decode(signature), content)
            return True
        except InvalidSignature:
            continue
    return False


class Receiver:
    """An HTTP server in a thread. Each path is one endpoint with its behaviour and keys;
    every request is checked against *all* keys of its path (so a rotation test proves that
    old and new both sign), and any failure is kept for the fixture to report."""

    def __init__(self, port: int = 0) -> None:
        self.hits: list[Hit] = []
        self.problems: list[str] = []
        self.routes: dict[str, Route] = {}
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: the notifier pools connections

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                hit = Hit(path=self.path, headers={k.lower(): v for k, v in self.headers.items()}, body=body,
                          at=time.monotonic())
                status, headers = receiver._handle(hit)
                answer = b"nope" if status >= 300 else b"thanks"
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> Receiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def route(self, path: str, behaviour: Behaviour = ok) -> str:
        self.routes[path] = Route(behaviour=behaviour)
        return f"http://127.0.0.1:{self.port}{path}"

    def _check(self, route: Route, hit: Hit) -> None:
        h = hit.headers
        if not route.hmac and not route.ed25519:
            self.problems.append(f"{hit.path}: a delivery nobody can verify")
        for secret in route.hmac:
            try:
                Webhook(secret).verify(hit.body, h)
            except WebhookVerificationError as exc:
                self.problems.append(f"{hit.path}: HMAC with {secret[:12]}…: {exc}")
        for key in route.ed25519:
            if not _ed25519_verifies(key, hit):
                self.problems.append(f"{hit.path}: Ed25519 with {key[:12]}… does not verify")
        if h.get("user-agent") != f"Herald/{herald.__version__}" or h.get("content-type") != "application/json":
            self.problems.append(f"{hit.path}: headers {h}")
        if set(hit.payload) != {"type", "timestamp", "data"}:
            self.problems.append(f"{hit.path}: payload {hit.payload}")

    def _handle(self, hit: Hit) -> tuple[int, dict[str, str]]:
        with self._lock:
            route = self.routes.get(hit.path)
            if route is None:
                self.problems.append(f"unexpected path {hit.path}")
                return 404, {}
            self._check(route, hit)
            route.seen[hit.headers.get("webhook-id", "")] += 1
            n = route.seen[hit.headers.get("webhook-id", "")]
            self.hits.append(hit)
        status, headers = route.behaviour(hit, n)  # outside the lock: a behaviour may block
        hit.answered = status
        return status, headers

    def hits_for(self, path: str, job_ids: set[str] | None = None) -> list[Hit]:
        with self._lock:
            return [h for h in self.hits if h.path == path and (job_ids is None or h.job_id in job_ids)]


# ----- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    server = Receiver().start()
    try:
        yield server
    finally:
        server.stop()
    assert not server.problems, "\n".join(server.problems)


@pytest.fixture(scope="module")
def herald_wh(tmp_path_factory: pytest.TempPathFactory, store_server: Any) -> Iterator[Deployment]:
    deployment = Deployment(
        tmp_path_factory.mktemp("webhooks"),
        database_url=new_database(store_server) if store_server is not None else None,
        env_overrides={"HERALD_WEBHOOK_RETRY_SCHEDULE": SCHEDULE, "HERALD_WEBHOOK_MIN_BACKOFF_S": str(MIN_BACKOFF_S)},
    )
    deployment.nats.start()
    try:
        deployment.start_gateway()
        deployment.start_worker()
        deployment.start_notifier()
        yield deployment
    finally:
        deployment.stop()


@pytest.fixture()
def http(herald_wh: Deployment) -> Iterator[httpx.Client]:
    """The acme tenant's client; endpoints it registered are deleted after the test."""
    # Idle connections are dropped before uvicorn's 5 s keep-alive can close them under us.
    with client(herald_wh.url(), limits=httpx.Limits(keepalive_expiry=2.0)) as c:
        yield c
        for item in c.get("/webhooks", params={"limit": 100}).json()["items"]:
            c.delete(f"/webhooks/{item['id']}")


def register(http: httpx.Client, receiver: Receiver, path: str, behaviour: Behaviour = ok,
             **fields: Any) -> dict[str, Any]:
    url = receiver.route(path, behaviour)
    response = http.post("/webhooks", json={"url": url, **fields})
    assert response.status_code == 201, response.text
    endpoint = response.json()
    if endpoint["signature"] == "ed25519":
        receiver.routes[path].ed25519.append(endpoint["public_key"])
    else:
        receiver.routes[path].hmac.append(endpoint["secret"])
    return endpoint


def export(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    response = http.post("/exports", json={"format": "csv", "rows": 10, **fields})
    assert response.status_code == 202, response.text
    return response.json()


def deliveries(http: httpx.Client, endpoint_id: str, **params: Any) -> list[dict[str, Any]]:
    response = http.get(f"/webhooks/{endpoint_id}/deliveries", params={"limit": 100, **params})
    assert response.status_code == 200, response.text
    return list(response.json()["items"])


def settle(predicate: Callable[[], T | None | Literal[False]], *, timeout: float = 20.0, what: str) -> T:
    """``wait_until`` for a predicate that answers a value once the condition holds."""
    found = wait_until(predicate, timeout=timeout, what=what)
    assert found
    return found


def terminal_hit(receiver: Receiver, path: str, job_id: str, status: int = 200) -> Hit | None:
    return next((h for h in receiver.hits_for(path, {job_id}) if h.type in TERMINAL and h.answered == status), None)


# ----- the retry policy, in process ------------------------------------------------------------


def test_retry_policy_is_the_table_of_spec_7() -> None:
    policy = RetryPolicy(schedule=(5.0, 300.0), min_backoff_s=60.0)
    rng = random.Random(7)

    def delay(outcome: Outcome, attempts: int = 1) -> float | None:
        return policy.plan(outcome, attempts, rng).delay_s

    def answer(status: int | None, retry_after: float | None = None, timed_out: bool = False) -> Outcome:
        return Outcome(status_code=status, latency_s=0.1, retry_after_s=retry_after, timed_out=timed_out)

    assert policy.plan(answer(204), 1, rng) == Plan("delivered")
    assert policy.plan(answer(410), 1, rng) == Plan("failed", disable_endpoint=True)
    assert policy.plan(answer(500), 3, rng) == Plan("failed")  # schedule used up: 1 + 2 retries
    for _ in range(200):
        assert 4.0 <= (delay(answer(500)) or 0) <= 6.0  # ±20 % jitter
        assert 240.0 <= (delay(answer(302), 2) or 0) <= 360.0  # a redirect is a failure
        assert delay(answer(429)) == 60.0 and delay(answer(None, timed_out=True)) == 60.0  # the floor
        assert delay(answer(429, retry_after=90)) == 90.0  # honoured inside [60, 120]
        assert delay(answer(429, retry_after=10_000)) == 120.0  # at most twice the scheduled delay
        assert delay(answer(429, retry_after=1)) == 60.0  # at least the scheduled delay
        assert 4.0 <= (delay(answer(503, retry_after=1)) or 0) <= 6.0  # 503: no floor, RA kept in bounds
        assert 8.0 <= (delay(answer(503, retry_after=3600)) or 0) <= 12.0
        assert 4.0 <= (delay(answer(None)) or 0) <= 6.0  # connection refused: the plain schedule


def test_a_retry_delay_that_is_not_a_finite_time_is_refused_at_start() -> None:
    """A schedule of 'nan' made every retry's next attempt NaN, which SQLite stores as no time:
    the delivery stayed pending for ever. 'inf' (or '1e309', or a delay past year 9999) made its
    next_attempt_at unshowable: the endpoint's delivery log answered 500. Refused at start now,
    naming the variable, as is a minimum backoff that is not a finite number."""
    assert Settings.from_env({"HERALD_WEBHOOK_RETRY_SCHEDULE": "5, 300,36000"}).webhook_retry_schedule == (
        5.0, 300.0, 36000.0)
    for bad in ("nan", "5,inf", "1e309", "1e12", "-1", "5,x"):
        with pytest.raises(SettingsError, match="HERALD_WEBHOOK_RETRY_SCHEDULE"):
            Settings.from_env({"HERALD_WEBHOOK_RETRY_SCHEDULE": bad})
    for bad in ("nan", "inf", "-inf", "1e309"):
        with pytest.raises(SettingsError, match="HERALD_WEBHOOK_MIN_BACKOFF_S must be a finite number"):
            Settings.from_env({"HERALD_WEBHOOK_MIN_BACKOFF_S": bad})


async def _two_jobs(store: Store) -> list[JobEvent]:
    """Two accepted jobs: their job.queued events, as the store committed them."""
    events = []
    for _ in range(2):
        job = NewJob(id=str(uuid.uuid4()), tenant="acme", kind="export", collection="/exports", params=b"{}",
                     deadline_s=60)
        event = (await store.accept(job)).event
        assert event is not None
        events.append(event)
    return events


# ----- the endpoints API -------------------------------------------------------------------


def test_endpoint_api_shapes_validation_and_tenancy(http: httpx.Client, herald_wh: Deployment) -> None:
    created = http.post("/webhooks", json={"url": "https://hooks.example.com/a"})
    assert created.status_code == 201 and created.headers["location"] == f"/webhooks/{created.json()['id']}"
    endpoint = created.json()
    assert set(endpoint) == {"id", "url", "event_types", "kinds", "signature", "status", "created_at", "secret"}
    assert endpoint["event_types"] == ["job.queued", "job.running", "job.cancel_requested", "job.succeeded",
                                       "job.failed", "job.cancelled"]  # all but job.progress
    assert endpoint["kinds"] is None and endpoint["signature"] == "hmac-sha256" and endpoint["status"] == "enabled"
    assert endpoint["secret"].startswith("whsec_") and len(base64.b64decode(endpoint["secret"][6:])) >= 24
    ed = http.post("/webhooks", json={"url": "https://hooks.example.com/b", "signature": "ed25519",
                                      "event_types": ["job.progress"], "kinds": ["report"]}).json()
    assert ed["public_key"].startswith("whpk_") and "secret" not in ed
    assert len(base64.b64decode(ed["public_key"][5:])) == 32

    shown = http.get(f"/webhooks/{endpoint['id']}").json()
    assert "secret" not in shown and shown["url"] == "https://hooks.example.com/a"
    first = http.get("/webhooks", params={"limit": 1}).json()
    second = http.get("/webhooks", params={"limit": 1, "cursor": first["next_cursor"]}).json()
    assert [first["items"][0]["id"], second["items"][0]["id"]] == [ed["id"], endpoint["id"]]
    assert second["next_cursor"] is None

    patched = http.patch(f"/webhooks/{endpoint['id']}", json={"kinds": ["export"], "status": "disabled"})
    assert patched.status_code == 200 and patched.json()["kinds"] == ["export"]
    assert patched.json()["status"] == "disabled" and patched.json()["url"] == endpoint["url"]
    rotated = http.post(f"/webhooks/{ed['id']}/rotate-secret")
    assert rotated.status_code == 200 and set(rotated.json()) == {"public_key"}

    bad = http.post("/webhooks", json={"url": 5, "event_types": ["job.nope"], "kinds": ["nope"], "colour": "red"})
    assert bad.status_code == 400 and bad.headers["content-type"] == "application/problem+json"
    assert bad.json()["type"] == "/problems/invalid-request"
    assert {e["field"] for e in bad.json()["errors"]} == {"url", "event_types", "colour"}
    unknown_kind = http.post("/webhooks", json={"url": "https://hooks.example.com/c", "kinds": ["nope"]})
    assert [e["field"] for e in unknown_kind.json()["errors"]] == ["kinds"]
    assert http.patch(f"/webhooks/{endpoint['id']}", json={"status": "paused"}).json()["errors"][0]["field"] == "status"
    assert http.post("/webhooks", content=b"{", headers={"content-type": "application/json"}).status_code == 400
    assert http.post("/webhooks", content=b"{}", headers={"content-type": "text/plain"}).status_code == 415
    assert http.get("/webhooks", params={"limit": 0}).json()["errors"][0]["field"] == "limit"
    listed = http.get(f"/webhooks/{endpoint['id']}/deliveries", params={"status": "lost"})
    assert listed.status_code == 400 and listed.json()["errors"][0]["field"] == "status"

    with client(herald_wh.url(), tenant="globex") as other:
        for method, path in (("GET", ""), ("PATCH", ""), ("DELETE", ""), ("POST", "/rotate-secret"),
                             ("GET", "/deliveries")):
            body = {"status": "enabled"} if method == "PATCH" else None
            answer = other.request(method, f"/webhooks/{endpoint['id']}{path}", json=body)
            assert answer.status_code == 404, (method, path)
            assert answer.json()["type"] == "/problems/not-found"
        assert endpoint["id"] not in {i["id"] for i in other.get("/webhooks").json()["items"]}
        assert other.get("/webhooks/callback-secret").json() != http.get("/webhooks/callback-secret").json()
    assert httpx.get(herald_wh.url() + "/webhooks").status_code == 401
    assert http.get("/webhooks/not-a-uuid").status_code == 404

    assert http.delete(f"/webhooks/{endpoint['id']}").status_code == 204
    assert http.get(f"/webhooks/{endpoint['id']}").status_code == 404


def test_private_addresses_refused_without_the_flag(herald_wh: Deployment, receiver: Receiver) -> None:
    strict = herald_wh.start_gateway("strict", HERALD_WEBHOOK_ALLOW_PRIVATE="0")
    with client(strict) as http:
        for url in (f"http://127.0.0.1:{receiver.port}/x", "https://127.0.0.1/x", "https://10.1.2.3/x",
                    "https://[::1]/x", "https://localhost/x", "https://169.254.169.254/latest",
                    "https://user:pw@hooks.example.com/x", "ftp://hooks.example.com/x"):
            refused = http.post("/webhooks", json={"url": url})
            assert refused.status_code == 400, url
            assert [e["field"] for e in refused.json()["errors"]] == ["url"], url
        job = http.post("/exports", json={"format": "csv", "rows": 1, "callback_url": "https://192.168.1.1/cb"})
        assert job.status_code == 400 and job.json()["errors"][0]["field"] == "callback_url"
        # A name is resolved at once too: this machine's own name is not a public address.
        by_name = http.post("/exports", json={"format": "csv", "rows": 1,
                                              "callback_url": f"https://{socket.gethostname()}/cb"})
        assert by_name.status_code == 400 and by_name.json()["errors"][0]["field"] == "callback_url"
    herald_wh.kill("strict", signal.SIGTERM)


@pytest.mark.parametrize("host", ["hooks\u00ad.example.com", "hooks\u200b.example.com"], ids=["soft hyphen", "zero width"])
def test_a_url_the_delivery_client_cannot_read_is_refused_at_registration(http: httpx.Client, host: str) -> None:
    """IDNA maps these characters away, so the guard found the host fine, but the notifier's
    client (aiohttp, by yarl) refuses the URL outright: registered, every delivery to it would
    fail. Refused at once instead, naming the field, also where private targets are allowed."""
    url = f"https://{host}/hook"
    before = http.get("/webhooks", params={"limit": 100}).json()["items"]
    refused = http.post("/webhooks", json={"url": url})
    assert refused.status_code == 400, refused.text
    assert [(e["field"], e["message"][:16]) for e in refused.json()["errors"]] == [("url", "not a valid URL:")]
    assert http.get("/webhooks", params={"limit": 100}).json()["items"] == before
    job = http.post("/exports", json={"format": "csv", "rows": 1, "callback_url": url})
    assert job.status_code == 400 and [e["field"] for e in job.json()["errors"]] == ["callback_url"], job.text
    with pytest.raises(UnsafeUrl, match="not a valid URL"):  # before DNS is asked, where only public ones are
        check_url_syntax(url, allow_private=False)


def test_delivery_time_guard_checks_the_resolved_address(receiver: Receiver) -> None:
    """Before each delivery the name is resolved again and every address must be public:
    this machine's own name resolves to a private or loopback address, so it is refused."""
    host = socket.gethostname()
    addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    if not addresses or any(is_public_address(a) for a in addresses):
        pytest.skip(f"{host} does not resolve to a private address here: {addresses}")
    url = f"https://{host}:{receiver.port}/guarded"

    async def send(allow_private: bool) -> Any:
        async with Sender(allow_private=allow_private) as sender:
            return await sender.send(url, b"{}", {})

    outcome = asyncio.run(send(False))
    assert outcome.status_code is None and "non-public address" in (outcome.error or "")
    assert receiver.hits_for("/guarded") == []


async def test_a_2xx_whose_body_stalls_or_is_cut_short_is_still_a_2xx() -> None:
    """SPEC §7: success is a 2xx within 15 s. The status is the answer; the body is read only for
    the log. A receiver that sent its 200 and then stalled the body (or cut it short) was counted
    a failure with no status at all, and its delivery was sent again though the receiver had it."""
    release = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nthanks")
        await writer.drain()
        if writer.get_extra_info("sockname")[1] == cut.sockets[0].getsockname()[1]:
            writer.close()  # 94 bytes short
        else:
            await release.wait()  # the rest never comes within the 15 s
            writer.close()

    cut = await asyncio.start_server(answer, "127.0.0.1", 0)
    stalled = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        async with Sender(allow_private=True) as sender:
            started = time.monotonic()
            short, slow = await asyncio.gather(
                *(sender.send(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/hook", b"{}", {})
                  for server in (cut, stalled)))
        assert short.ok and short.status_code == 200 and short.response == b"thanks", short
        assert "could not be read" in (short.error or "") and not short.timed_out and not short.unreachable
        assert slow.ok and slow.status_code == 200 and slow.response == b"thanks", slow
        assert "did not come within 15 s" in (slow.error or "") and not slow.timed_out and not slow.unreachable
        assert time.monotonic() - started < 20  # the body is waited for within the 15 s, no longer
    finally:
        release.set()
        for server in (cut, stalled):
            server.close()
MALFORMED_ANSWERS = {
    "bad status line": b"GARBAGE\r\n\r\n",
    "bad header": b"HTTP/1.1 200 OK\r\nBad Header Line\r\nContent-Length: 0\r\n\r\n",
    "bad chunk": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\nxx\r\n",
    "bad length": b"HTTP/1.1 200 OK\r\nContent-Length: abc\r\n\r\n",
    "header too long": b"HTTP/1.1 200 OK\r\nX: " + b"a" * (MAX_ANSWER_LINE_BYTES + 1) + b"\r\n\r\n",
}


@pytest.mark.parametrize("answer", list(MALFORMED_ANSWERS.values()), ids=list(MALFORMED_ANSWERS))
def test_an_answer_that_is_not_http_is_recorded_without_the_urls_path_or_query(answer: bytes) -> None:
    """An endpoint's path and query are often the receiver's secret (a Slack-style hook URL, a
    ``?token=``), so an attempt's error, which is kept with the delivery and logged, names the
    target by its origin only, as every other error does. An answer that was not HTTP was
    recorded as aiohttp words it, "ClientResponseError: 400, message=..., url='<the whole
    URL>'": the URL in the notifier's log line, and a 400 the receiver never sent."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer_once() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(65536)
            connection.sendall(answer)

    thread = threading.Thread(target=answer_once, daemon=True)
    thread.start()

    async def attempt() -> Any:
        async with Sender(allow_private=True) as sender:
            return await sender.send(f"http://127.0.0.1:{port}/hooks/PATH-SECRET?token=QUERY-SECRET", b"{}", {})

    try:
        outcome = asyncio.run(attempt())
    finally:
        thread.join(5)
        listener.close()
    error = outcome.error or ""
    assert outcome.status_code is None and "the answer could not be read" in error, outcome
    assert "SECRET" not in error and "400," not in error, error


# ----- signatures -------------------------------------------------------------------------


def test_deliveries_carry_the_committed_status_in_order(http: httpx.Client, receiver: Receiver) -> None:
    endpoint = register(http, receiver, "/plain")
    job = export(http)
    wait_until(lambda: terminal_hit(receiver, "/plain", job["id"]), what="terminal delivery")
    hits = receiver.hits_for("/plain", {job["id"]})
    assert [h.type for h in hits] == ["job.queued", "job.running", "job.succeeded"]
    assert [h.version for h in hits] == sorted(h.version for h in hits)
    final = hits[-1].payload
    status = http.get(f"/jobs/{job['id']}", follow_redirects=False).json()
    assert final["data"]["state"] == "succeeded" and final["data"]["version"] == status["version"]
    assert final["data"]["updated_at"] == status["updated_at"] and final["timestamp"] == status["updated_at"]
    assert abs(int(hits[-1].headers["webhook-timestamp"]) - time.time()) < 60
    assert len(hits[-1].headers["webhook-signature"].split()) == 1

    def logged_all() -> list[dict[str, Any]] | None:
        items = deliveries(http, endpoint["id"], status="delivered")
        return items if len([x for x in items if x["job_id"] == job["id"]]) == 3 else None

    logged = settle(logged_all, what="delivery log")
    assert {d["event_id"] for d in logged if d["job_id"] == job["id"]} == {h.webhook_id for h in hits}
    one = logged[0]
    assert set(one) >= {"id", "event_id", "type", "job_id", "status", "next_attempt_at", "attempts"}
    assert one["next_attempt_at"] is None and one["attempts"][0]["status_code"] == 200
    assert set(one["attempts"][0]) >= {"at", "status_code", "latency_ms", "error"}
    assert deliveries(http, endpoint["id"], status="failed") == []


def test_rotation_old_and_new_keys_both_sign(http: httpx.Client, receiver: Receiver) -> None:
    hmac_ep = register(http, receiver, "/rotated-hmac", event_types=["job.succeeded"])
    ed_ep = register(http, receiver, "/rotated-ed", signature="ed25519", event_types=["job.succeeded"])
    new_secret = http.post(f"/webhooks/{hmac_ep['id']}/rotate-secret").json()["secret"]
    new_key = http.post(f"/webhooks/{ed_ep['id']}/rotate-secret").json()["public_key"]
    assert new_secret != hmac_ep["secret"] and new_key != ed_ep["public_key"]
    receiver.routes["/rotated-hmac"].hmac.append(new_secret)  # now both must verify every delivery
    receiver.routes["/rotated-ed"].ed25519.append(new_key)

    job = export(http)
    hmac_hit = settle(lambda: terminal_hit(receiver, "/rotated-hmac", job["id"]), what="HMAC delivery")
    ed_hit = settle(lambda: terminal_hit(receiver, "/rotated-ed", job["id"]), what="Ed25519 delivery")
    assert [s.split(",")[0] for s in hmac_hit.headers["webhook-signature"].split()] == ["v1", "v1"]
    assert [s.split(",")[0] for s in ed_hit.headers["webhook-signature"].split()] == ["v1a", "v1a"]
    for secret in (hmac_ep["secret"], new_secret):  # each one alone, through the reference library
        assert Webhook(secret).verify(hmac_hit.body, hmac_hit.headers)["type"] == "job.succeeded"
    assert _ed25519_verifies(ed_ep["public_key"], ed_hit) and _ed25519_verifies(new_key, ed_hit)
    assert hmac_hit.webhook_id == ed_hit.webhook_id  # one id per event, whichever endpoint


def test_callback_url_deliveries_are_signed_with_the_callback_secret(http: httpx.Client, receiver: Receiver) -> None:
    first = http.get("/webhooks/callback-secret").json()["secret"]
    assert http.get("/webhooks/callback-secret").json()["secret"] == first
    rotated = http.post("/webhooks/callback-secret/rotate")
    assert rotated.status_code == 200 and rotated.json()["secret"] != first
    url = receiver.route("/callback")
    receiver.routes["/callback"].hmac += [first, rotated.json()["secret"]]

    job = http.post("/reports", json={"title": "cb", "pages": 5, "callback_url": url}).json()
    wait_until(lambda: terminal_hit(receiver, "/callback", job["id"]), what="callback delivery")
    hits = receiver.hits_for("/callback", {job["id"]})
    assert [h.type for h in hits] == ["job.queued", "job.running", "job.succeeded"]  # no job.progress
    assert [h.version for h in hits] == sorted(h.version for h in hits)


# ----- retries ---------------------------------------------------------------------------------


def test_500_twice_then_200_delivers_on_attempt_3_with_the_same_id(http: httpx.Client, receiver: Receiver) -> None:
    def flaky(_hit: Hit, n: int) -> tuple[int, dict[str, str]]:
        return (500, {}) if n <= 2 else (200, {})

    endpoint = register(http, receiver, "/flaky", flaky, event_types=["job.succeeded"])
    job = export(http)
    wait_until(lambda: terminal_hit(receiver, "/flaky", job["id"]), what="third attempt")
    hits = receiver.hits_for("/flaky", {job["id"]})
    assert [h.answered for h in hits] == [500, 500, 200]
    assert len({h.webhook_id for h in hits}) == 1
    gaps = [b.at - a.at for a, b in zip(hits, hits[1:])]
    assert all(0.15 < g < MIN_BACKOFF_S for g in gaps), gaps  # the schedule (0.2 s ± 20 %), no floor for 5xx

    def settled() -> dict[str, Any] | None:
        items = deliveries(http, endpoint["id"])
        return items[0] if items and items[0]["status"] == "delivered" else None

    delivery = settle(settled, what="delivered in the log")
    assert delivery["event_id"] == hits[0].webhook_id and delivery["job_id"] == job["id"]
    assert [a["status_code"] for a in delivery["attempts"]] == [500, 500, 200]
    assert delivery["attempts"][0]["response"] == "nope" and delivery["attempts"][0]["latency_ms"] is not None

    again = http.post(f"/webhooks/{endpoint['id']}/deliveries/{delivery['id']}/retry")
    assert again.status_code == 202 and again.json()["id"] == delivery["id"]
    wait_until(lambda: len(receiver.hits_for("/flaky", {job["id"]})) == 4, what="manual resend")
    assert receiver.hits_for("/flaky", {job["id"]})[-1].webhook_id == delivery["event_id"]
    assert http.post(f"/webhooks/{endpoint['id']}/deliveries/{endpoint['id']}/retry").status_code == 404


def test_429_and_503_retry_after_is_honoured_within_bounds(http: httpx.Client, receiver: Receiver) -> None:
    answers = {1: (429, {}), 2: (429, {"Retry-After": "3"}), 3: (503, {"Retry-After": "3600"})}

    def busy(_hit: Hit, n: int) -> tuple[int, dict[str, str]]:
        return answers.get(n, (200, {}))

    register(http, receiver, "/busy", busy, event_types=["job.succeeded"])
    job = export(http)
    wait_until(lambda: terminal_hit(receiver, "/busy", job["id"]), timeout=30, what="fourth attempt")
    hits = receiver.hits_for("/busy", {job["id"]})
    assert [h.answered for h in hits] == [429, 429, 503, 200]
    first, second, third = (b.at - a.at for a, b in zip(hits, hits[1:]))
    assert first >= MIN_BACKOFF_S * 0.95, first  # a 429 waits at least the floor, not 0.2 s
    assert second >= 2 * MIN_BACKOFF_S * 0.95, second  # Retry-After: 3 honoured (the floor alone: 1.5 s)
    assert third < MIN_BACKOFF_S, third  # Retry-After: 3600 clamped to 2 × the scheduled 0.2 s


def test_410_fails_the_delivery_and_disables_the_endpoint(http: httpx.Client, receiver: Receiver) -> None:
    gone = register(http, receiver, "/gone", lambda _h, _n: (410, {}))
    witness = register(http, receiver, "/witness", event_types=["job.succeeded"])
    job = export(http)
    wait_until(lambda: http.get(f"/webhooks/{gone['id']}").json()["status"] == "disabled", what="disabled")
    logged = settle(lambda: [d for d in deliveries(http, gone["id"]) if d["status"] == "failed"], what="failed")
    tried = [d for d in logged if d["attempts"]]
    assert len(tried) == 1 and [a["status_code"] for a in tried[0]["attempts"]] == [410]  # never retried
    assert [h.answered for h in receiver.hits_for("/gone", {job["id"]})] == [410]  # the rest: dropped
    assert deliveries(http, gone["id"], status="pending") == []

    later = export(http)  # events for a disabled endpoint are dropped, not queued
    wait_until(lambda: terminal_hit(receiver, "/witness", later["id"]), what="witness delivery")
    assert not [d for d in deliveries(http, gone["id"]) if d["job_id"] == later["id"]]
    retry = http.post(f"/webhooks/{gone['id']}/deliveries/{tried[0]['id']}/retry")
    assert retry.status_code == 409 and retry.json()["type"] == "/problems/endpoint-disabled"
    assert http.patch(f"/webhooks/{gone['id']}", json={"status": "enabled"}).json()["status"] == "enabled"
    assert witness["status"] == "enabled"


def test_a_2xx_with_a_header_line_over_8_kib_is_delivered(http: httpx.Client, receiver: Receiver) -> None:
    """A receiver's 200 with a 9000-byte Set-Cookie is a 2xx (SPEC 7). aiohttp reads no header
    line over 8190 bytes by default: the attempt was a failure with no status, retried for ever."""
    cookie = "session=" + "c" * 9000

    def big(_hit: Hit, _n: int) -> tuple[int, dict[str, str]]:
        return 200, {"Set-Cookie": cookie}

    endpoint = register(http, receiver, "/big-header", big, event_types=["job.succeeded"])
    job = export(http)

    def settled() -> dict[str, Any] | None:
        items = deliveries(http, endpoint["id"])
        return items[0] if items and (items[0]["status"] != "pending" or len(items[0]["attempts"]) > 1) else None

    delivery = settle(settled, what="the delivery settled or retried")
    assert delivery["status"] == "delivered", delivery
    assert [(a["status_code"], a["error"]) for a in delivery["attempts"]] == [(200, None)]
    assert [h.answered for h in receiver.hits_for("/big-header", {job["id"]})] == [200]


def test_a_redirect_is_not_followed(http: httpx.Client, receiver: Receiver) -> None:
    target = receiver.route("/redirect-target")

    def moved(_hit: Hit, n: int) -> tuple[int, dict[str, str]]:
        return (302, {"Location": target}) if n == 1 else (200, {})

    endpoint = register(http, receiver, "/moved", moved, event_types=["job.succeeded"])
    job = export(http)
    wait_until(lambda: terminal_hit(receiver, "/moved", job["id"]), what="delivery after the redirect")
    assert [h.answered for h in receiver.hits_for("/moved", {job["id"]})] == [302, 200]
    assert receiver.hits_for("/redirect-target") == []
    logged = settle(lambda: (d := deliveries(http, endpoint["id"], status="delivered")) and d, what="log")
    assert [a["status_code"] for a in logged[0]["attempts"]] == [302, 200]


def test_two_notifiers_share_the_work_without_doubles(http: httpx.Client, herald_wh: Deployment,
                                                      receiver: Receiver) -> None:
    herald_wh.start_notifier("notifier-b")
    try:
        endpoint = register(http, receiver, "/shared")
        jobs = [export(http) for _ in range(8)]
        ids = {j["id"] for j in jobs}
        wait_until(lambda: all(terminal_hit(receiver, "/shared", i) for i in ids), what="all delivered")
        hits = receiver.hits_for("/shared", ids)
        assert len({h.webhook_id for h in hits}) == len(hits)  # nothing sent twice
        for job_id in ids:
            versions = [h.version for h in hits if h.job_id == job_id]
            assert versions == sorted(versions)
        # Each event was delivered, or (when its job's next event reached the other notifier
        # and was sent first) superseded: never both, never left behind.
        def settled() -> list[dict[str, Any]] | None:
            log = [d for d in deliveries(http, endpoint["id"]) if d["job_id"] in ids]
            return log if all(d["status"] != "pending" for d in log) else None

        log = settle(settled, what="every delivery settled")
        assert len(log) == 3 * len(jobs) and {d["status"] for d in log} <= {"delivered", "superseded"}
        assert len([d for d in log if d["status"] == "delivered"]) == len(hits)
        attempts = herald_wh.logged("notifier", "webhook attempt") + herald_wh.logged("notifier-b", "webhook attempt")
        assert len(attempts) >= len(hits) and all(a.get("job_id") and a.get("outcome") for a in attempts)
    finally:
        herald_wh.kill("notifier-b", signal.SIGTERM)


def test_attempts_finishing_together_are_each_recorded_with_their_outcome(http: httpx.Client,
                                                                         receiver: Receiver) -> None:
    """The notifier records attempts in batches (issue 14): many deliveries to several endpoints
    answering at once, some with 500s, still leave every attempt in the log with its own
    status, latency and answer, and every delivery with its own end."""
    def down(_hit: Hit, _n: int) -> tuple[int, dict[str, str]]:
        return 500, {}

    def flaky(_hit: Hit, n: int) -> tuple[int, dict[str, str]]:
        return (500, {}) if n == 1 else (200, {})

    paths = {"/batch-a": ok, "/batch-b": ok, "/batch-down": down, "/batch-flaky": flaky}
    endpoints = {p: register(http, receiver, p, b, event_types=["job.queued"])["id"] for p, b in paths.items()}
    ids = {export(http)["id"] for _ in range(12)}

    def settled(endpoint_id: str) -> Callable[[], list[dict[str, Any]] | None]:
        def check() -> list[dict[str, Any]] | None:
            log = [d for d in deliveries(http, endpoint_id) if d["job_id"] in ids]
            return log if len(log) == len(ids) and all(d["status"] != "pending" for d in log) else None
        return check

    tries = len(SCHEDULE.split(",")) + 1
    for path, endpoint_id in endpoints.items():
        log = settle(settled(endpoint_id), timeout=30, what=f"every delivery to {path} settled")
        for d in log:
            codes = [a["status_code"] for a in d["attempts"]]
            expected = {"/batch-down": [500] * tries, "/batch-flaky": [500, 200]}.get(path, [200])
            assert codes == expected, (path, d)  # in attempt order
            assert d["status"] == ("failed" if path == "/batch-down" else "delivered"), (path, d)
            for a in d["attempts"]:
                assert a["latency_ms"] is not None and a["response"] == ("nope" if a["status_code"] == 500 else "thanks")
        hits = receiver.hits_for(path, ids)
        assert len(hits) == sum(len(d["attempts"]) for d in log)  # each attempt sent once and logged once


# ----- isolation and order ------------------------------------------------------------------


def test_a_slow_endpoint_does_not_delay_a_fast_one(http: httpx.Client, receiver: Receiver) -> None:
    release = threading.Event()

    def slow(_hit: Hit, _n: int) -> tuple[int, dict[str, str]]:
        release.wait(12)  # answers only when the test says so (within the 15 s limit)
        return 200, {}

    register(http, receiver, "/slow", slow)
    register(http, receiver, "/fast")
    try:
        jobs = [export(http) for _ in range(3)]
        ids = {j["id"] for j in jobs}
        wait_until(lambda: all(terminal_hit(receiver, "/fast", i) for i in ids), what="fast endpoint served")
        assert not release.is_set()
        held = receiver.hits_for("/slow", ids)
        assert held and all(h.answered == 0 for h in held)  # the slow one is still holding its first calls
    finally:
        release.set()
    wait_until(lambda: all(terminal_hit(receiver, "/slow", i) for i in ids), what="slow endpoint caught up")


def test_one_jobs_events_never_arrive_out_of_version_order(http: httpx.Client, receiver: Receiver) -> None:
    """The receiver fails the first attempt of every job.running and of every other progress
    event, slowly: without ordering, the retry of an older event would land after a newer one."""
    failed_first: set[str] = set()

    def fails_some_once(hit: Hit, n: int) -> tuple[int, dict[str, str]]:
        if n == 1 and (hit.type == "job.running" or (hit.type == "job.progress" and hit.version % 2 == 0)):
            failed_first.add(hit.webhook_id)
            time.sleep(0.05)  # still in flight while newer events of the job commit
            return 500, {}
        return 200, {}

    all_types = ["job.queued", "job.running", "job.progress", "job.succeeded"]
    endpoint = register(http, receiver, "/ordered", fails_some_once, event_types=all_types)
    jobs = [export(http, rows=20_000) for _ in range(3)]
    jobs += [http.post("/reports", json={"title": f"o{i}", "pages": 15}).json() for i in range(2)]
    for job in jobs:
        wait_until(lambda: terminal_hit(receiver, "/ordered", job["id"]), timeout=30, what="terminal delivery")
    assert failed_first, "the receiver should have failed some deliveries"
    for job in jobs:
        hits = receiver.hits_for("/ordered", {job["id"]})
        versions = [h.version for h in hits]
        assert versions == sorted(versions), versions  # arrival order never goes back
        assert hits[-1].type == "job.succeeded" and hits[-1].answered == 200
        first_sent: dict[str, float] = {}
        for h in hits:
            if h.type == "job.progress":
                first_sent.setdefault(h.webhook_id, h.at)
        starts = sorted(first_sent.values())
        # throttled: the k-th progress delivery of a job is scheduled at least k seconds after the first
        assert all(t - starts[0] >= k - 0.5 for k, t in enumerate(starts)), starts
    log = deliveries(http, endpoint["id"])
    assert any(d["status"] == "superseded" for d in log)
    assert not [d for d in log if d["status"] == "failed"]


# ----- durability ---------------------------------------------------------------------------------


def test_deliveries_do_not_depend_on_nats_and_survive_its_restart(http: httpx.Client, herald_wh: Deployment,
                                                                   receiver: Receiver) -> None:
    endpoint = register(http, receiver, "/outage", event_types=["job.succeeded"])
    before = export(http)
    first = settle(lambda: terminal_hit(receiver, "/outage", before["id"]), what="delivery before the outage")
    delivery = deliveries(http, endpoint["id"])[0]

    herald_wh.nats.stop()
    try:
        # The schedule lives in the store: a resend asked for now goes out while NATS is away.
        assert http.post(f"/webhooks/{endpoint['id']}/deliveries/{delivery['id']}/retry").status_code == 202
        wait_until(lambda: len(receiver.hits_for("/outage", {before["id"]})) == 2, what="resend without NATS")
        assert receiver.hits_for("/outage", {before["id"]})[-1].webhook_id == first.webhook_id
        during = export(http)  # accepted into the outbox
    finally:
        herald_wh.nats.start()
    settle(lambda: terminal_hit(receiver, "/outage", during["id"]), timeout=30, what="delivery after the restart")


def test_a_killed_notifiers_delivery_in_flight_goes_to_another_within_its_lease(fresh: Deployment) -> None:
    """kill -9 of a notifier mid-POST: its lease, renewed only while it lives, runs out within
    LEASE_S and the other notifier sends the delivery; a lease as long as an attempt (30 s)
    held it that long."""
    from notifier.scheduler import LEASE_S

    receiver = Receiver().start()
    released = threading.Event()

    def first_hangs(_hit: Hit, n: int) -> tuple[int, dict[str, str]]:
        if n == 1:
            released.wait(60)  # its notifier is killed meanwhile: nobody reads this answer
        return 200, {}

    try:
        base = fresh.start_gateway()
        fresh.start_worker()
        fresh.start_notifier("notifier-a")
        with client(base) as http:
            endpoint = register(http, receiver, "/held", first_hangs, event_types=["job.succeeded"])
            job = export(http)
            wait_until(lambda: receiver.hits_for("/held", {job["id"]}), what="the first POST, held")
            # Started only now, so the delivery is notifier-a's; long after its renewals began.
            fresh.start_notifier("notifier-b")
            fresh.kill("notifier-a", signal.SIGKILL)
            killed_at = time.monotonic()
            again = settle(lambda: terminal_hit(receiver, "/held", job["id"]), timeout=60, what="sent again")
            # Within the lease (10 s) and a claim pass or two, with a loaded machine's margin:
            # far below the 30 s a lease as long as an attempt took.
            assert LEASE_S <= 10.0 and time.monotonic() - killed_at < 20.0
            first = receiver.hits_for("/held", {job["id"]})[0]
            assert again.webhook_id == first.webhook_id  # the same message, as at-least-once allows
            settle(lambda: (d := deliveries(http, endpoint["id"])) and d[0]["status"] == "delivered",
                   what="delivered in the log")
    finally:
        released.set()
        receiver.stop()


def test_receiver_down_notifier_killed_and_restarted_still_delivers(
    http: httpx.Client, herald_wh: Deployment, tmp_path: Path
) -> None:
    port = free_port()  # nothing listens there yet: the endpoint is down (connections refused)
    url = f"http://127.0.0.1:{port}/late"
    endpoint = http.post("/webhooks", json={"url": url, "event_types": ["job.succeeded"]}).json()

    # A notifier with a long first retry delay, so that it is killed while the retry waits.
    herald_wh.kill("notifier", signal.SIGKILL)
    job = export(http)  # its events wait in the durable consumer meanwhile
    wait_for_state(http, job["id"], {"succeeded"})
    # (New names: the harness waits for "notifier ready" in the process's own log file.)
    herald_wh.start_notifier("notifier-slow-retry", HERALD_WEBHOOK_RETRY_SCHEDULE="3,0.2,0.2")

    def failed_once() -> dict[str, Any] | None:
        items = [d for d in deliveries(http, endpoint["id"]) if d["job_id"] == job["id"]]
        return items[0] if items and len(items[0]["attempts"]) == 1 and items[0]["status"] == "pending" else None

    waiting = settle(failed_once, what="first attempt failed")
    assert waiting["attempts"][0]["status_code"] is None and "connect" in waiting["attempts"][0]["error"].lower()
    herald_wh.kill("notifier-slow-retry", signal.SIGKILL)

    late = Receiver(port).start()
    late.route("/late")
    late.routes["/late"].hmac.append(endpoint["secret"])
    metrics_port = free_port()
    try:
        herald_wh.start_notifier("notifier-restarted", HERALD_METRICS_PORT=str(metrics_port))
        wait_until(lambda: terminal_hit(late, "/late", job["id"]), what="delivery after restart")
        hits = late.hits_for("/late", {job["id"]})
        assert len(hits) == 1 and hits[0].webhook_id == waiting["event_id"]
        done = settle(lambda: (d := deliveries(http, endpoint["id"])) and d[0]["status"] == "delivered" and d[0],
                          what="delivered in the log")
        assert len(done["attempts"]) == 2 and done["attempts"][1]["status_code"] == 200
        scraped = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
        assert 'herald_webhook_deliveries_total{outcome="delivered"}' in scraped
        assert "herald_webhook_delivery_seconds_count" in scraped
    finally:
        late.stop()
    assert not late.problems, late.problems


# ----- recover and test events (the portal's actions, issue 16) --------------------------------


def test_test_event_is_a_signed_delivery_through_the_queue(http: httpx.Client, herald_wh: Deployment,
                                                           receiver: Receiver) -> None:
    path = f"/tested-{uuid.uuid4().hex[:8]}"  # the receiver is the module's, shared by both stores' runs
    endpoint = register(http, receiver, path, event_types=["job.succeeded"])
    sent = http.post(f"/webhooks/{endpoint['id']}/test")
    assert sent.status_code == 202, sent.text
    delivery = sent.json()
    assert delivery["type"] == "webhook.test" and delivery["job_id"] is None and delivery["version"] is None
    assert delivery["status"] == "pending" and delivery["event_id"].startswith("evt_test_")
    payload = json.loads(delivery["payload"])
    assert payload["type"] == "webhook.test" and payload["data"]["endpoint_id"] == endpoint["id"]
    assert set(payload) == {"type", "timestamp", "data"} and payload["data"]["message"]

    # Signed with the endpoint's secret (the receiver verifies it) and recorded like any delivery.
    hit = settle(lambda: next(iter(receiver.hits_for(path)), None), what="the test event")
    assert hit.webhook_id == delivery["event_id"] and hit.type == "webhook.test"
    assert hit.body.decode() == delivery["payload"]  # the payload shown is the body signed and sent
    logged = settle(lambda: (d := http.get(f"/webhooks/{endpoint['id']}/deliveries/{delivery['id']}").json())
                    and d["status"] == "delivered" and d, what="delivered in the log")
    assert [a["status_code"] for a in logged["attempts"]] == [200] and logged["attempts"][0]["response"] == "thanks"
    assert logged["payload"] == delivery["payload"]
    listed = deliveries(http, endpoint["id"])
    assert [d["id"] for d in listed] == [delivery["id"]] and listed[0]["payload"] == delivery["payload"]
    health = http.get(f"/webhooks/{endpoint['id']}").json()["health"]
    assert health["delivered"] == 1 and health["success_rate"] == 1.0
    assert health["last_delivery"]["id"] == delivery["id"] and health["last_delivery"]["status_code"] == 200

    # Resent with the same webhook-id, like any delivery.
    assert http.post(f"/webhooks/{endpoint['id']}/deliveries/{delivery['id']}/retry").status_code == 202
    wait_until(lambda: len(receiver.hits_for(path)) == 2, what="the test event resent")
    assert {h.webhook_id for h in receiver.hits_for(path)} == {delivery["event_id"]}

    # It cannot be subscribed to; a disabled endpoint gets none; another tenant sees none of it.
    refused = http.post("/webhooks", json={"url": "https://hooks.example.com/t", "event_types": ["webhook.test"]})
    assert refused.status_code == 400 and refused.json()["errors"][0]["field"] == "event_types"
    http.patch(f"/webhooks/{endpoint['id']}", json={"status": "disabled"})
    disabled = http.post(f"/webhooks/{endpoint['id']}/test")
    assert disabled.status_code == 409 and disabled.json()["type"] == "/problems/endpoint-disabled"
    with client(herald_wh.url(), tenant="globex") as other:
        assert other.post(f"/webhooks/{endpoint['id']}/test").status_code == 404
        assert other.get(f"/webhooks/{endpoint['id']}/deliveries/{delivery['id']}").status_code == 404
    assert http.get(f"/webhooks/{endpoint['id']}/deliveries/{endpoint['id']}").status_code == 404
    assert http.get(f"/webhooks/{endpoint['id']}/deliveries/nope").status_code == 404


def test_recover_resends_the_failed_deliveries_since_a_time(http: httpx.Client, herald_wh: Deployment,
                                                            receiver: Receiver) -> None:
    up = threading.Event()

    def down_until_up(_hit: Hit, _n: int) -> tuple[int, dict[str, str]]:
        return (200, {}) if up.is_set() else (500, {})

    endpoint = register(http, receiver, "/recovering", down_until_up, event_types=["job.succeeded"])
    before = time.time() - 1
    jobs = [export(http) for _ in range(2)]

    def all_failed() -> list[dict[str, Any]] | None:
        items = deliveries(http, endpoint["id"])
        return items if len(items) == 2 and all(d["status"] == "failed" for d in items) else None

    failed = settle(all_failed, timeout=30, what="both deliveries failed")
    assert all(len(d["attempts"]) == 4 for d in failed)  # the first try and the schedule's three retries
    health = http.get(f"/webhooks/{endpoint['id']}").json()["health"]
    assert health["failed"] == 2 and health["success_rate"] == 0.0
    assert health["last_delivery"]["status"] == "failed" and health["last_delivery"]["status_code"] == 500

    # Nothing failed after "now"; a bad time is a field error; a disabled endpoint is refused.
    later = datetime.fromtimestamp(time.time() + 60, tz=timezone.utc).isoformat()
    assert http.post(f"/webhooks/{endpoint['id']}/recover", json={"since": later}).json() == {"count": 0}
    for bad in ({"since": "yesterday"}, {"since": "2026-01-01T00:00:00"}, {}, {"since": 5, "extra": 1}):
        answer = http.post(f"/webhooks/{endpoint['id']}/recover", json=bad)
        assert answer.status_code == 400 and "since" in {e["field"] for e in answer.json()["errors"]}, bad
    with client(herald_wh.url(), tenant="globex") as other:
        since = datetime.fromtimestamp(before, tz=timezone.utc).isoformat()
        assert other.post(f"/webhooks/{endpoint['id']}/recover", json={"since": since}).status_code == 404

    up.set()
    since = datetime.fromtimestamp(before, tz=timezone.utc).isoformat().replace("+00:00", "Z")
    recovered = http.post(f"/webhooks/{endpoint['id']}/recover", json={"since": since})
    assert recovered.status_code == 202 and recovered.json() == {"count": 2}
    for job in jobs:
        wait_until(lambda job=job: terminal_hit(receiver, "/recovering", job["id"]), what="recovered delivery")
    delivered = settle(lambda: (d := deliveries(http, endpoint["id"], status="delivered")) and len(d) == 2 and d,
                       what="both delivered")
    for item in delivered:  # same delivery, same webhook-id, one more attempt
        assert [a["status_code"] for a in item["attempts"]] == [500, 500, 500, 500, 200]
        assert {h.webhook_id for h in receiver.hits_for("/recovering", {item["job_id"]})} == {item["event_id"]}
    assert http.post(f"/webhooks/{endpoint['id']}/recover", json={"since": since}).json() == {"count": 0}

    http.patch(f"/webhooks/{endpoint['id']}", json={"status": "disabled"})
    refused = http.post(f"/webhooks/{endpoint['id']}/recover", json={"since": since})
    assert refused.status_code == 409 and refused.json()["type"] == "/problems/endpoint-disabled"


# ----- the deliveries cursor: nothing of other tenants' traffic -----------------------------------


def _pages(http: httpx.Client, endpoint_id: str, cursor: str | None = None) -> tuple[list[str], list[str]]:
    """Every delivery id of the endpoint from ``cursor`` on, one a page, and each page's next_cursor."""
    ids: list[str] = []
    cursors: list[str] = []
    while True:
        response = http.get(f"/webhooks/{endpoint_id}/deliveries",
                            params={"limit": 1, **({"cursor": cursor} if cursor else {})})
        assert response.status_code == 200, response.text
        page = response.json()
        ids += [d["id"] for d in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            return ids, cursors
        cursors.append(cursor)


def _listed(http: httpx.Client, endpoint_id: str, jobs: list[dict[str, Any]]) -> None:
    """Wait until each job's last event (and so every earlier one) has its delivery to the endpoint."""
    wanted = {job["id"] for job in jobs}
    wait_until(lambda: wanted <= {d["job_id"] for d in deliveries(http, endpoint_id) if d["type"] == "job.succeeded"},
               what="the jobs' deliveries listed")


def _unpadded_b64(raw: str) -> bytes:
    return base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4))


def test_a_tenants_deliveries_cursors_count_none_of_another_tenants_traffic(
        http: httpx.Client, herald_wh: Deployment, receiver: Receiver) -> None:
    """A delivery's ``seq`` is numbered across every tenant's deliveries. Shown in a cursor, the
    gap between two of a tenant's cursors counted the deliveries every other tenant made
    meanwhile (SPEC §2: another tenant's anything is as if it did not exist). Globex watches
    (it starts no other job in this module), acme makes the traffic."""
    theirs = register(http, receiver, "/cursor-acme")
    with client(herald_wh.url(), "globex") as globex:
        mine = register(globex, receiver, "/cursor-globex")
        try:
            first = [export(globex) for _ in range(2)]
            _listed(globex, mine["id"], first)
            before_ids, before = _pages(globex, mine["id"])

            burst = [export(http) for _ in range(5)]
            _listed(http, theirs["id"], burst)
            after_ids, after = _pages(globex, mine["id"])
            # The same list, and each cursor given before the burst still resumes where it was given.
            assert after_ids == before_ids and len(after) == len(before) == len(before_ids) - 1
            for n, cursor in enumerate(before):
                assert _pages(globex, mine["id"], cursor)[0] == before_ids[n + 1:]

            second = [export(globex) for _ in range(2)]
            _listed(globex, mine["id"], first + second)
            ids, cursors = _pages(globex, mine["id"])
            seqs = dict(herald_wh.store_rows(f"SELECT id, seq FROM webhook_deliveries"
                                             f" WHERE endpoint_id = '{mine['id']}'"))  # gone with the endpoint
        finally:
            globex.delete(f"/webhooks/{mine['id']}")

    # The premise, read from the store: acme's deliveries were numbered between globex's two rounds.
    burst_ids = {job["id"] for job in burst}
    their_seqs = [seq for seq, job_id in herald_wh.store_rows(
        f"SELECT seq, job_id FROM webhook_deliveries WHERE endpoint_id = '{theirs['id']}'") if job_id in burst_ids]
    newest_first_round = max(seqs[d] for d in before_ids)
    oldest_second_round = min(seqs[d] for d in ids if d not in before_ids)
    assert len(their_seqs) >= 3 * len(burst)  # queued, running, succeeded
    assert all(newest_first_round < seq < oldest_second_round for seq in their_seqs)

    # What globex is shown carries none of it: every cursor is as long as any other, and none
    # holds the seq of the delivery it pages after, as text (as it did) or as a 64-bit number.
    shown = [*before, *after, *cursors]
    assert len({len(c) for c in shown}) == 1, shown
    for delivery_id, cursor in zip(ids, cursors, strict=False):
        opened = _unpadded_b64(cursor)
        seq = seqs[delivery_id]
        assert not opened.isdigit() and seq.to_bytes(8, "big") not in opened, (cursor, seq)
        assert seq.to_bytes(8, "little") not in opened, (cursor, seq)


def test_a_deliveries_cursor_altered_or_taken_elsewhere_is_a_400_naming_it(
        http: httpx.Client, herald_wh: Deployment, receiver: Receiver) -> None:
    mine = register(http, receiver, "/cursor-tampered")
    other = register(http, receiver, "/cursor-other")
    jobs = [export(http) for _ in range(2)]
    _listed(http, mine["id"], jobs)
    _listed(http, other["id"], jobs)
    ids, cursors = _pages(http, mine["id"])
    _, other_cursors = _pages(http, other["id"])
    cursor = cursors[0]
    raw = bytearray(_unpadded_b64(cursor))
    raw[len(raw) // 2] ^= 0x01
    flipped = base64.urlsafe_b64encode(bytes(raw)).decode().rstrip("=")
    old_style = base64.urlsafe_b64encode(b"9223372036854775807").decode().rstrip("=")
    for bad in (flipped, cursor[:-4], cursor + "AAAA", other_cursors[0], old_style, "", "é", "%%", cursor * 3):
        answer = http.get(f"/webhooks/{mine['id']}/deliveries", params={"limit": 1, "cursor": bad})
        assert answer.status_code == 400, (bad, answer.text)
        assert answer.headers["content-type"] == "application/problem+json"
        problem = answer.json()
        assert problem["type"] == "/problems/invalid-cursor", problem
        assert [e["field"] for e in problem["errors"]] == ["cursor"] and "cursor" in problem["detail"], problem
    # Another tenant holding a cursor of acme's still gets nothing but the 404 of an endpoint it lacks.
    with client(herald_wh.url(), "globex") as globex:
        answer = globex.get(f"/webhooks/{mine['id']}/deliveries", params={"cursor": cursor})
        assert answer.status_code == 404, answer.text
    assert _pages(http, mine["id"], cursor)[0] == ids[1:]


# ----- outcomes recorded in batches (issue 14) ------------------------------------------------


class _RefusingQueue(DeliveryQueue):
    """The real SQLite queue, except that a transaction holding one chosen delivery's attempt fails
    (as a store refusing one row would): the recorder must still record the others."""

    def __init__(self, db: Database, refused: str) -> None:
        super().__init__(db, make_sealer())
        self.refused = refused
        self.batch_sizes: list[int] = []
        self.writing = asyncio.Event()  # a batch has reached the store
        self.gate: asyncio.Event | None = None  # if set: the store answers once it opens

    async def finish_many(self, attempts: Any, owner: str) -> Any:
        self.batch_sizes.append(len(attempts))
        self.writing.set()
        if self.gate is not None:
            await self.gate.wait()
        if any(a.claimed.delivery.id == self.refused for a in attempts):
            raise sqlite3.OperationalError("refused for the test")
        return await super().finish_many(attempts, owner)


async def test_the_recorder_commits_attempts_that_finish_together_in_one_transaction(tmp_path: Path) -> None:
    db = Database(tmp_path / "herald.db", SCHEMA)
    store = Store(db, retention_s=60, sealer=make_sealer())
    await store.open()
    try:
        webhooks = WebhookStore(db, make_sealer())
        ids = [(await webhooks.create_endpoint("acme", url=f"https://hooks.example.com/{n}", event_types=["job.queued"],
                                               kinds=None, signature="hmac-sha256"))[0].id for n in range(3)]
        events = [e for _ in range(5) for e in await _two_jobs(store)]
        assert (await DeliveryQueue(db, make_sealer()).fan_out(events)).pending == 30
        claimed = await DeliveryQueue(db, make_sealer()).claim("n1", lease_s=30, per_target=10, limit=100, in_flight={})
        assert len(claimed) == 30
        refused = claimed[7].delivery.id
        queue = _RefusingQueue(db, refused)
        recorder = Recorder(queue, "n1")
        outcomes = {ids[0]: Outcome(status_code=200, latency_s=0.01),
                    ids[1]: Outcome(status_code=500, latency_s=0.02, response=b"down"),
                    ids[2]: Outcome(status_code=204, latency_s=0.01)}

        def attempt(item: Claimed) -> Attempted:
            outcome = outcomes[item.delivery.endpoint_id or ""]
            return Attempted(claimed=item, started_at=time.time(), outcome=outcome,
                             plan=Plan("delivered") if outcome.ok else Plan("retry", delay_s=60))

        # All 30 answers come in the same loop turn: one transaction, which fails (one
        # refused attempt), then each on its own: 29 recorded, the refused one raises.
        results = await asyncio.gather(*(recorder.record(attempt(c)) for c in claimed), return_exceptions=True)
        assert queue.batch_sizes == [30] + [1] * 30
        for item, result in zip(claimed, results, strict=True):
            if item.delivery.id == refused:
                assert isinstance(result, sqlite3.OperationalError)
            else:
                assert isinstance(result, Finished)
                assert result.status == ("pending" if item.delivery.endpoint_id == ids[1] else "delivered")
        logged = await webhooks.attempts([c.delivery.id for c in claimed])
        assert not logged.get(refused) and len([i for i, rows in logged.items() if rows]) == 29
        for item in claimed:
            if item.delivery.id != refused:
                [row] = logged[item.delivery.id]
                assert row.status_code == outcomes[item.delivery.endpoint_id or ""].status_code
        # The refused one stays leased and unrecorded: it is sent again once its lease runs out.
        [left] = [r for r in await webhooks.list_deliveries(claimed[7].delivery.endpoint_id or "", status=None,
                                                            before_seq=None, limit=100) if r.id == refused]
        assert left.status == "pending" and left.attempts == 0 and left.lease_owner == "n1"

        # Answers arriving while a batch is being written join the next one: two transactions.
        queue.refused, queue.batch_sizes = "", []
        again = await _RefusingQueue(db, "").claim("n2", lease_s=30, per_target=10, limit=100, in_flight={})
        assert again == []  # everything is recorded or leased
        await db.write(lambda conn: conn.execute("UPDATE webhook_deliveries SET lease_until = 0, next_attempt_at = 0"
                                                 " WHERE status = 'pending'"))
        retried = await queue.claim("n2", lease_s=30, per_target=10, limit=100, in_flight={})
        expected = {c.delivery.id for c in claimed if c.delivery.endpoint_id == ids[1]} | {refused}
        assert {c.delivery.id for c in retried} == expected  # the retries and the refused one
        recorder = Recorder(queue, "n2")
        queue.gate, queue.writing = asyncio.Event(), asyncio.Event()
        first = [asyncio.create_task(recorder.record(attempt(c))) for c in retried[:4]]
        await queue.writing.wait()  # the first batch is being written (held at the gate)
        rest = [asyncio.create_task(recorder.record(attempt(c))) for c in retried[4:]]
        await asyncio.sleep(0)  # one loop turn: the new tasks hand in their attempts
        queue.gate.set()
        await asyncio.gather(*first, *rest)
        assert queue.batch_sizes == [4, len(retried) - 4] and recorder.batches == 2
        logged = await webhooks.attempts([c.delivery.id for c in retried])
        assert all(logged[c.delivery.id][-1].status_code == outcomes[c.delivery.endpoint_id or ""].status_code
                   for c in retried)
    finally:
        await store.close()
