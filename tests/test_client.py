"""The Python client and the CLI against a real running Herald (nats-server, gateway, worker)."""

from __future__ import annotations

import base64
import io
import json
import os
import random
import re
import secrets
import socket
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pypdf
import pytest

import schemas
import schemas.webhooks
from herald_client import (
    AsyncHeraldClient,
    Backoff,
    Conflict,
    HeraldAdmin,
    HeraldClient,
    HeraldConnectionError,
    IdempotencyKeyMismatch,
    InvalidRequest,
    JobNotSucceeded,
    NotFound,
    Policy,
    RateLimited,
    Unauthorized,
    WaitTimeout,
    WebhookVerificationError,
    verify_webhook,
)
from herald_client import _core
from herald_client import models as client_models
from herald_client.policy import parse_retry_after
from herald_client.sse import SSEDecoder
from tests.harness import KEYS, Deployment, free_port, wait_until

KEY = KEYS["acme"]
FAST = Policy(retry=Backoff(initial=0.05, cap=0.5))


# ----- a misbehaving network between client and gateway ------------------------------------


class FlakyProxy:
    """A TCP proxy on 127.0.0.1 in front of the gateway that breaks chosen connections.

    ``faults`` maps a connection's index (0 = the first one opened) to:

    * ``"drop-answer"``: forward the request, swallow the answer and close — the request
      was processed, but its answer is lost on the way back;
    * ``"cut-after-event"``: forward the answer until it holds one complete SSE event,
      then close — a stream dropped mid-way.
    """

    def __init__(self, upstream_port: int, faults: dict[int, str]) -> None:
        self.upstream_port = upstream_port
        self.faults = faults
        self.requests: list[bytearray] = []
        self.answers: list[bytearray] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FlakyProxy:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        with _quiet():
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for sock in list(self._sockets):
            with _quiet():
                sock.shutdown(socket.SHUT_RDWR)
        self._accepting.join(5)
        for thread in self._threads:
            thread.join(5)
        for sock in self._sockets:
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self._listener.accept()
            except OSError:
                return
            index = len(self.requests)
            self.requests.append(bytearray())
            self.answers.append(bytearray())
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._sockets += [downstream, upstream]
            fault = self.faults.get(index)
            forward = threading.Thread(target=self._pump, args=(downstream, upstream, self.requests[index], None))
            back = threading.Thread(target=self._pump, args=(upstream, downstream, self.answers[index], fault))
            self._threads += [forward, back]
            forward.start()
            back.start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, record: bytearray, fault: str | None) -> None:
        try:
            while chunk := source.recv(65536):
                before = len(record)
                record += chunk
                if fault == "drop-answer":
                    break
                if fault == "cut-after-event" and (event := re.search(rb"data: [^\n]*\n\n", record)):
                    # One read may hold several events: forward exactly the first, then cut.
                    sink.sendall(bytes(record[before:event.end()]))
                    break
                sink.sendall(chunk)
        except OSError:
            pass
        for sock in (source, sink):
            with _quiet():
                sock.shutdown(socket.SHUT_RDWR)


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        return kind is not None and issubclass(kind, OSError)


def job_ids(base: str, key: str = KEY) -> set[str]:
    response = httpx.get(base + "/jobs", params={"limit": 100}, headers={"Authorization": f"Bearer {key}"})
    return {item["id"] for item in response.json()["items"]}


# ----- typed results ---------------------------------------------------------------------------


def test_client_structs_mirror_the_server_schemas() -> None:
    """The client keeps its own Structs (installable alone); they must match the contract."""
    pairs = [(client_models.JobStatus, schemas.JobStatus), (client_models.JobLinks, schemas.JobLinks),
             (client_models.Problem, schemas.Problem), (client_models.FieldError, schemas.FieldError),
             (client_models.JobList, schemas.JobList)]
    pairs += [(getattr(client_models, name), getattr(schemas.webhooks, name)) for name in (
        "Endpoint", "CreatedEndpoint", "EndpointList", "EndpointHealth", "LastDelivery", "SigningSecret", "Attempt",
        "Delivery", "DeliveryList", "PortalLink", "Recovered")]
    for mine, theirs in pairs:
        assert {f.encode_name for f in msgspec.structs.fields(mine)} == \
            {f.encode_name for f in msgspec.structs.fields(theirs)}, mine.__name__


# ----- accept, wait, result ------------------------------------------------------------------


def test_submit_wait_follow_and_download_a_report(herald: Deployment, tmp_path: Path) -> None:
    with HeraldClient(herald.url(), KEY) as client:
        job = client.submit("report", {"title": "client", "pages": 3})
        assert isinstance(job, client_models.JobStatus)
        assert job.state == "queued" and job.version == 1 and job.links.self == f"/jobs/{job.id}"

        result = client.wait(job, 30, follow=True)
        assert result.status.state == "succeeded" and result.status.progress == 100
        assert result.media_type == "application/pdf" and result.filename == f"report-{job.id}.pdf"
        assert len(pypdf.PdfReader(io.BytesIO(result.content)).pages) == 3

        done = client.wait(job)  # returns the status (the 303's body) when not following
        assert done.state == "succeeded" and done.result == f"/reports/{job.id}"

        into_dir = client.download(job, tmp_path)
        assert into_dir.path == tmp_path / f"report-{job.id}.pdf"
        assert into_dir.path.read_bytes() == result.content and into_dir.size == len(result.content)
        named = client.download(job.id, tmp_path / "q3.pdf")
        assert named.path.read_bytes() == result.content
        assert not list(tmp_path.glob(".herald-*")), "no partial files left behind"


async def test_async_client_streams_waits_and_downloads(herald: Deployment, tmp_path: Path) -> None:
    async with AsyncHeraldClient(herald.url(), KEY) as client:
        job = await client.submit("export", {"format": "csv", "rows": 500})
        events = [event async for event in client.stream(job, last_event_id="0")]  # the whole history
        versions = [event.data.version for event in events]
        assert versions == list(range(1, versions[-1] + 1)), "every version once, from the first"
        assert [event.id for event in events] == [str(v) for v in versions]
        assert events[0].type == "job.queued" and events[-1].type == "job.succeeded"
        assert (await client.wait(job, 10)).state == "succeeded"
        saved = await client.download(job, tmp_path)
        lines = saved.path.read_text().splitlines()
        assert saved.media_type == "text/csv" and len(lines) == 501


def test_submit_accepts_a_kind_path_and_a_caller_key(herald: Deployment) -> None:
    key = f"caller-{uuid.uuid4()}"
    with HeraldClient(herald.url(), KEY) as client:
        first = client.submit("/exports", {"format": "ndjson", "rows": 3}, idempotency_key=key)
        again = client.submit("export", {"format": "ndjson", "rows": 3}, idempotency_key=key)
        assert again.id == first.id
        with pytest.raises(IdempotencyKeyMismatch) as caught:
            client.submit("export", {"format": "ndjson", "rows": 4}, idempotency_key=key)
    assert caught.value.status == 422 and caught.value.type == "/problems/idempotency-key-mismatch"


# ----- lost answers and slow-downs --------------------------------------------------------------


def test_a_lost_answer_is_retried_with_the_same_key_and_makes_one_job(herald: Deployment) -> None:
    before = job_ids(herald.url())
    with FlakyProxy(herald.ports["gateway"], {0: "drop-answer"}) as proxy, \
            HeraldClient(proxy.url, KEY, policy=FAST) as client:
        job = client.submit("report", {"title": "lost answer", "pages": 1})
    assert len(proxy.requests) == 2, "the first answer was lost, the request sent again"
    first, second = (bytes(r).lower() for r in proxy.requests)
    key = re.search(rb"idempotency-key: ([^\r\n]+)", first)
    assert key and key.group(0) in second, "the retry carries the same Idempotency-Key"
    assert job.id.encode() in bytes(proxy.answers[0]), "the server did start the job the first time"
    assert b"idempotent-replayed: true" in bytes(proxy.answers[1]).lower()
    assert job_ids(herald.url()) - before == {job.id}, "exactly one job exists"


def test_without_a_key_a_lost_answer_is_not_retried(herald: Deployment) -> None:
    before = job_ids(herald.url())
    with FlakyProxy(herald.ports["gateway"], {0: "drop-answer"}) as proxy, \
            HeraldClient(proxy.url, KEY, policy=FAST) as client:
        with pytest.raises(HeraldConnectionError):
            client.submit("report", {"title": "no key", "pages": 1}, idempotency_key=None)
    assert len(proxy.requests) == 1 and b"idempotency-key" not in bytes(proxy.requests[0]).lower()
    assert len(job_ids(herald.url()) - before) == 1, "the job exists once; the client did not start another"


def test_wait_honours_retry_after(herald: Deployment) -> None:
    polls: list[tuple[float, int, str | None]] = []

    def record(response: httpx.Response) -> None:
        if response.request.method == "GET" and response.request.url.path.startswith("/jobs/"):
            polls.append((time.monotonic(), response.status_code, response.headers.get("retry-after")))

    with httpx.Client(event_hooks={"response": [record]}) as http, \
            HeraldClient(herald.url(), KEY, http=http) as client:
        job = client.submit("report", {"title": "patient", "pages": 120})  # about 2.4 s of work
        done = client.wait(job, 60)
    assert done.state == "succeeded"
    assert len(polls) >= 3 and polls[-1][1] == 303
    for (at, _status, hint), (next_at, _, _) in zip(polls, polls[1:]):
        assert hint is not None, "the server hints while the job runs"
        assert next_at - at >= float(hint) - 0.05, f"polled after {next_at - at:.2f} s, Retry-After was {hint}"
    # With every gap at least its hint, whole-second hints mean no busy polling however long
    # the run takes on a loaded machine (a count of polls would measure the machine instead).
    assert all(float(hint) >= 1 for _, _, hint in polls[:-1] if hint is not None), "no busy polling"


def test_wait_times_out_with_the_last_status(herald: Deployment) -> None:
    with HeraldClient(herald.url(), KEY) as client:
        job = client.submit("report", {"title": "long", "pages": 1000})
        started = time.monotonic()
        with pytest.raises(WaitTimeout) as caught:
            client.wait(job, 1.5)
        assert 1.4 <= time.monotonic() - started < 5
        assert caught.value.status is not None and caught.value.status.id == job.id
        assert not caught.value.status.terminal
        client.cancel(job)


def test_rate_limited_submits_slow_down_and_all_succeed(fresh: Deployment) -> None:
    base = fresh.start_gateway(HERALD_RATE_LIMIT="1")  # 1 start/s, burst 2
    answers: list[tuple[float, int, str | None]] = []

    def record(response: httpx.Response) -> None:
        if response.request.method == "POST":
            answers.append((time.monotonic(), response.status_code, response.headers.get("retry-after")))

    with httpx.Client(event_hooks={"response": [record]}) as http, \
            HeraldClient(base, KEY, http=http) as client:
        jobs = [client.submit("export", {"format": "csv", "rows": 1}) for _ in range(5)]
        assert len({job.id for job in jobs}) == 5
        limited = [a for a in answers if a[1] == 429]
        assert limited, "the limit was hit"
        for (at, status, hint), (next_at, _, _) in zip(answers, answers[1:]):
            if status == 429:
                assert hint is not None and next_at - at >= float(hint) - 0.05, "slowed down as told"
        assert [a[1] for a in answers].count(202) == 5

        impatient = HeraldClient(base, KEY, policy=Policy(attempts=1), http=http)
        with pytest.raises(RateLimited) as caught:
            for _ in range(5):
                impatient.submit("export", {"format": "csv", "rows": 1})
    assert caught.value.status == 429 and caught.value.retry_after is not None and caught.value.retry_after >= 1


# ----- streams ---------------------------------------------------------------------------------


def test_stream_resumes_after_a_dropped_connection(herald: Deployment) -> None:
    with HeraldClient(herald.url(), KEY) as direct:
        job = direct.submit("report", {"title": "dropped", "pages": 40})
    with FlakyProxy(herald.ports["gateway"], {0: "cut-after-event"}) as proxy, \
            HeraldClient(proxy.url, KEY) as client:
        events = list(client.stream(job))
    versions = [event.data.version for event in events]
    assert versions == list(range(versions[0], versions[-1] + 1)), f"nothing missed, nothing twice: {versions}"
    assert events[-1].data.state == "succeeded" and events[-1].type == "job.succeeded"
    assert len(proxy.requests) == 2, "one reconnection"
    first, second = (bytes(r).lower() for r in proxy.requests)
    assert b"last-event-id" not in first
    assert f"last-event-id: {versions[0]}\r\n".encode() in second, "resumed after the last event it saw"


def test_stream_of_a_finished_job(herald: Deployment) -> None:
    with HeraldClient(herald.url(), KEY) as client:
        job = client.submit("export", {"format": "csv", "rows": 2})
        done = client.wait(job, 30)
        snapshot = list(client.stream(job))
        assert [(e.type, e.data.version) for e in snapshot] == [("job.succeeded", done.version)]
        assert list(client.stream(job, last_event_id=str(done.version))) == [], "204: the stream is over"
        replay = list(client.stream(job, last_event_id="1"))
        assert [e.data.version for e in replay] == list(range(2, done.version + 1))


# ----- cancel and errors ------------------------------------------------------------------------


def test_cancel_then_no_result(herald: Deployment, tmp_path: Path) -> None:
    with HeraldClient(herald.url(), KEY) as client:
        job = client.submit("report", {"title": "unwanted", "pages": 1000})
        answer = client.cancel(job)
        assert answer.state == "cancelled" or answer.cancel_requested
        ended = client.wait(job, 30)
        assert ended.state == "cancelled"
        with pytest.raises(JobNotSucceeded) as caught:
            client.wait(job, 5, follow=True)
        assert caught.value.status.state == "cancelled"
        with pytest.raises(JobNotSucceeded):
            client.download(job, tmp_path)


def test_failed_job_carries_its_problem(herald: Deployment) -> None:
    with HeraldClient(herald.url(), KEY) as client:
        job = client.submit("report", {"title": "broken", "pages": 5, "fail_on_page": 2})
        failed = client.wait(job, 30)
        assert failed.state == "failed" and failed.error is not None
        assert failed.error.type == "/problems/report-render-failed"
        with pytest.raises(JobNotSucceeded, match="failed"):
            client.wait(job, 5, follow=True)


def test_errors_carry_the_problem_fields(herald: Deployment) -> None:
    with HeraldClient(herald.url(), KEY) as client:
        with pytest.raises(NotFound) as missing:
            client.status("00000000-0000-4000-8000-000000000000")
        assert missing.value.status == 404 and missing.value.type == "/problems/not-found"
        assert missing.value.request_id and missing.value.request_id in str(missing.value)
        with pytest.raises(InvalidRequest) as invalid:
            client.submit("report", {"title": "", "pages": 0, "colour": "red"})
        assert {e.field for e in invalid.value.errors} == {"title", "pages", "colour"}
    with HeraldClient(herald.url(), "not-a-key") as stranger, pytest.raises(Unauthorized):
        stranger.status("00000000-0000-4000-8000-000000000000")
    # A job id is one path segment: '..' is an id no job has, not a way to another route, and
    # an empty one is refused before anything is sent.
    with HeraldClient(herald.url(), KEY) as client:
        for odd in ("..", "../webhooks", "a/b", "?x=1"):
            with pytest.raises(NotFound):
                client.status(odd)
        with pytest.raises(ValueError, match="^job is empty"):
            client.status("")
    # A key no Authorization header can carry is refused where it is given, not at a request.
    for odd_key in ("dév-key", "k y", "", "line\nbreak"):
        with pytest.raises(ValueError, match="printable ASCII"):
            HeraldClient(herald.url(), odd_key)
        with pytest.raises(ValueError, match="printable ASCII"):
            HeraldAdmin(herald.url(), odd_key)
    nowhere = f"http://127.0.0.1:{free_port()}"
    with HeraldClient(nowhere, KEY, policy=Policy(retry=Backoff(initial=0.01), attempts=3)) as client:
        with pytest.raises(HeraldConnectionError) as unreachable:
            client.status("x")
    assert unreachable.value.attempts == 3


# ----- the sans-IO core, without a network ---------------------------------------------------


def drive(flow: Any, replies: list[Any]) -> tuple[Any, list[float]]:
    """Run a flow against scripted replies; return its result and the sleeps it asked for."""
    sleeps: list[float] = []
    outcome: Any = None
    while True:
        try:
            action = flow.send(outcome)
        except StopIteration as stop:
            return stop.value, sleeps
        outcome = None
        if isinstance(action, _core.Sleep):
            sleeps.append(action.seconds)
        elif isinstance(action, _core.Call):
            outcome = replies.pop(0)


def status_reply(state: str, version: int, code: int = 200, **headers: str) -> _core.Reply:
    body = {"id": "j", "kind": "report", "state": state, "progress": None, "version": version, "attempt": 1,
            "created_at": "t", "updated_at": "t", "expires_at": None, "cancel_requested": False,
            "result": None, "error": None, "links": {"self": "/jobs/j", "events": "/jobs/j/events"}}
    return _core.Reply(code, {k.replace("_", "-"): v for k, v in headers.items()}, json.dumps(body).encode())


def test_polling_without_retry_after_backs_off_with_jitter_to_a_cap() -> None:
    policy = Policy(poll=Backoff(initial=0.25, factor=2, cap=2.0, jitter=0.5))
    ctx = _core.Context(policy=policy, rng=random.Random(7))
    replies = [status_reply("running", v) for v in range(1, 8)] + [status_reply("succeeded", 8, 303)]
    done, sleeps = drive(_core.wait("j", None, False, ctx), replies)
    assert done.state == "succeeded" and len(sleeps) == 7
    for n, slept in enumerate(sleeps):
        ceiling = min(2.0, 0.25 * 2**n)
        assert ceiling * 0.5 <= slept <= ceiling, (n, slept)
    assert len(set(sleeps)) == len(sleeps), "jittered"


def test_polling_honours_hints_and_slows_down_on_429_and_503() -> None:
    ctx = _core.Context(policy=Policy(), rng=random.Random(1))
    replies = [
        status_reply("running", 2, retry_after="3"),
        _core.Reply(429, {"retry-after": "7"}, b""),
        _core.Reply(503, {"retry-after": "5"}, b""),
        _core.Failure("connection reset"),
        status_reply("failed", 3),
    ]
    done, sleeps = drive(_core.wait("j", None, False, ctx), replies)
    assert done.state == "failed"
    assert sleeps[:3] == [3.0, 7.0, 5.0] and 0 < sleeps[3] <= Policy().retry.cap


def test_submit_retries_only_what_is_safe() -> None:
    ctx = _core.Context(policy=Policy(retry=Backoff(initial=0.1)), rng=random.Random(2))
    lost = [_core.Failure("reset"), _core.Reply(502, {}, b""), _core.Reply(409, {}, b""),
            status_reply("queued", 1, 202)]
    job, sleeps = drive(_core.submit("/reports", b"{}", "key", ctx), lost)
    assert job.state == "queued" and len(sleeps) == 3
    with pytest.raises(HeraldConnectionError):
        drive(_core.submit("/reports", b"{}", None, ctx), [_core.Failure("reset")])
    job, sleeps = drive(_core.submit("/reports", b"{}", None, ctx),
                        [_core.Reply(429, {"retry-after": "2"}, b""), status_reply("queued", 1, 202)])
    assert sleeps == [2.0], "a 429 proves nothing started: safe to retry even without a key"


def test_retry_after_forms() -> None:
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None


def test_sse_decoder_handles_any_chunking() -> None:
    wire = (b"retry: 3000\r\n\r\n: keep-alive\r\nid: 7\r\nevent: job.progress\r\ndata: {\"a\":\r\n"
            b"data: 1}\r\n\r\nevent: x\ndata: \xc3\xa9\n\n")
    for size in (1, 2, 3, 5, len(wire)):
        decoder = SSEDecoder()
        messages = [m for i in range(0, len(wire), size) for m in decoder.feed(wire[i:i + size])]
        assert [(m.event, m.data, m.id) for m in messages] == [("job.progress", '{"a":\n1}', "7"), ("x", "é", "7")]
        assert decoder.retry_ms == 3000


# ----- webhooks ---------------------------------------------------------------------------------


def webhook_body() -> bytes:
    status = json.loads(status_reply("succeeded", 6).body)
    return json.dumps({"type": "job.succeeded", "timestamp": "2026-01-01T00:00:00Z", "data": status}).encode()


def test_verify_hmac_webhooks_signed_by_the_reference_library() -> None:
    from standardwebhooks import Webhook

    secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    body = webhook_body()
    sent = datetime.now(timezone.utc)
    headers = {"Webhook-Id": "msg_1", "Webhook-Timestamp": str(int(sent.timestamp())),
               "Webhook-Signature": Webhook(secret).sign("msg_1", sent, body.decode())}
    event = verify_webhook(headers, body, secret)
    assert event.type == "job.succeeded" and event.data.version == 6

    for tampered_headers, tampered_body in [
        (headers, body.replace(b"succeeded", b"failed", 1)),
        ({**headers, "Webhook-Id": "msg_2"}, body),
        ({**headers, "Webhook-Signature": "v1," + base64.b64encode(b"x" * 32).decode()}, body),
    ]:
        with pytest.raises(WebhookVerificationError):
            verify_webhook(tampered_headers, tampered_body, secret)
    other = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    with pytest.raises(WebhookVerificationError):
        verify_webhook(headers, body, other)
    assert verify_webhook(headers, body, [other, secret]).type == "job.succeeded", "rotation: either key"
    with pytest.raises(WebhookVerificationError, match="off"):
        verify_webhook(headers, body, secret, now=sent.timestamp() + 3600)
    with pytest.raises(WebhookVerificationError, match="missing"):
        verify_webhook({"webhook-id": "msg_1"}, body, secret)


def test_verify_ed25519_webhooks() -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.generate()
    public = "whpk_" + base64.b64encode(private.public_key().public_bytes_raw()).decode()
    body, stamp = webhook_body(), str(int(time.time()))
    signature = base64.b64encode(private.sign(f"msg_9.{stamp}.".encode() + body)).decode()
    headers = {"webhook-id": "msg_9", "webhook-timestamp": stamp,
               "webhook-signature": f"v1,{base64.b64encode(b'n' * 32).decode()} v1a,{signature}"}
    assert verify_webhook(headers, body, public).data.state == "succeeded"
    with pytest.raises(WebhookVerificationError):
        verify_webhook(headers, body + b" ", public)
    stranger = "whpk_" + base64.b64encode(Ed25519PrivateKey.generate().public_key().public_bytes_raw()).decode()
    with pytest.raises(WebhookVerificationError):
        verify_webhook(headers, body, stranger)
    hmac_secret = "whsec_" + base64.b64encode(b"k" * 32).decode()
    with pytest.raises(WebhookVerificationError):
        verify_webhook(headers, body, hmac_secret)  # a v1a signature never passes as v1


class Receiver:
    """A real webhook receiver on 127.0.0.1: answers 200 and keeps every delivery as received."""

    def __init__(self) -> None:
        self.hits: list[tuple[str, dict[str, str], bytes]] = []
        hits = self.hits

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802  (http.server's naming)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                hits.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *_args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def test_verify_real_deliveries_hmac_and_ed25519(fresh: Deployment) -> None:
    """Deliveries signed by Herald's notifier verify with the client, and tampering is caught."""
    base = fresh.start_gateway()
    fresh.start_worker()
    fresh.start_notifier()
    receiver = Receiver()
    try:
        auth = {"Authorization": f"Bearer {KEY}"}
        credentials = {}
        for scheme in ("hmac-sha256", "ed25519"):
            created = httpx.post(base + "/webhooks", headers=auth, json={
                "url": f"{receiver.url}/{scheme}", "event_types": ["job.succeeded"], "signature": scheme})
            assert created.status_code == 201, created.text
            credentials[scheme] = created.json().get("secret") or created.json()["public_key"]
        with HeraldClient(base, KEY) as client:
            job = client.submit("export", {"format": "csv", "rows": 5})
            wait_until(lambda: len(receiver.hits) >= 2, timeout=30, what="both deliveries")
        by_path = {path.strip("/"): (headers, body) for path, headers, body in receiver.hits}
        for scheme, secret in credentials.items():
            headers, body = by_path[scheme]
            event = verify_webhook(headers, body, secret)
            assert event.type == "job.succeeded" and event.data.id == job.id and event.data.state == "succeeded"
            with pytest.raises(WebhookVerificationError):
                verify_webhook(headers, body.replace(b"succeeded", b"cancelled"), secret)
            with pytest.raises(WebhookVerificationError):
                verify_webhook({**headers, "webhook-timestamp": str(int(headers["webhook-timestamp"]) + 1)}, body,
                               secret)
        with pytest.raises(WebhookVerificationError):  # the other endpoint's credential does not verify
            verify_webhook(*by_path["ed25519"], credentials["hmac-sha256"])
        # A test event (the portal's button, send_test_event) verifies as every other delivery does.
        receiver.hits.clear()
        with HeraldClient(base, KEY) as client:
            endpoints = {e.url.rsplit("/", 1)[1]: e.id for e in client.list_webhooks().items}
            for endpoint_id in endpoints.values():
                client.send_test_event(endpoint_id)
        wait_until(lambda: len(receiver.hits) >= 2, timeout=30, what="both test deliveries")
        for path, headers, body in receiver.hits:
            scheme = path.strip("/")
            event = verify_webhook(headers, body, credentials[scheme])
            assert event.type == "webhook.test" and isinstance(event.data, client_models.WebhookTestData)
            assert event.data.endpoint_id == endpoints[scheme]
    finally:
        receiver.close()


# ----- the CLI ----------------------------------------------------------------------------------


def herald_cli(*argv: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("HERALD_")}
    return subprocess.run([sys.executable, "-m", "launcher.cli", *argv], env={**base_env, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def test_cli_submit_watch_status_download(herald: Deployment, tmp_path: Path) -> None:
    connection = ["--url", herald.url(), "--key", KEY]
    started = herald_cli("submit", "report", "--title", "From the CLI", "--pages", "4", *connection)
    assert started.returncode == 0, started.stderr
    job = json.loads(started.stdout)
    assert job["state"] == "queued" and job["kind"] == "report"

    watched = herald_cli("watch", job["id"], *connection)
    assert watched.returncode == 0, watched.stderr
    assert f"job {job['id']} succeeded" in watched.stdout and "100%" in watched.stderr

    status = herald_cli("status", job["id"], *connection)
    assert status.returncode == 0 and json.loads(status.stdout)["state"] == "succeeded"

    saved = herald_cli("download", job["id"], "-o", str(tmp_path), *connection)
    assert saved.returncode == 0, saved.stderr
    path = Path(saved.stdout.strip())
    assert path.parent == tmp_path and len(pypdf.PdfReader(path).pages) == 4


def test_cli_reads_url_and_key_from_the_environment(herald: Deployment) -> None:
    env = {"HERALD_URL": herald.url(), "HERALD_API_KEY": KEY}
    done = herald_cli("submit", "export", "--format", "csv", "--rows", "10", "--wait", env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["state"] == "succeeded"
    wrong = herald_cli("status", json.loads(done.stdout)["id"], env={**env, "HERALD_API_KEY": "nope"})
    assert wrong.returncode == 1 and "401" in wrong.stderr


def test_cli_sends_no_api_key_in_clear_to_another_machine_unless_told_to() -> None:
    """As the admin CLI does with its key: a tenant's key to a plain http:// URL beyond this
    machine crosses the network readable by anyone on the way. TEST-NET addresses and a name
    nothing answers: the refusal is the CLI's own, before any connection."""
    key = "k" * 24
    for remote, argv in (("http://192.0.2.1:8000", ("status", "some-job")),
                         ("HTTP://herald.example", ("submit", "export", "--format", "csv", "--rows", "1"))):
        refused = herald_cli(*argv, "--url", remote, "--key", key)
        assert refused.returncode == 2, refused.stderr
        assert "https://" in refused.stderr and "--allow-http" in refused.stderr
        assert key not in refused.stderr + refused.stdout
    from_env = herald_cli("status", "some-job", env={"HERALD_URL": "http://198.51.100.7", "HERALD_API_KEY": key})
    assert from_env.returncode == 2 and "--allow-http" in from_env.stderr

    # A server here that answers every request 404: 0.0.0.0 is no loopback name, yet reaches it.
    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_error(404)

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        assert herald_cli("status", "some-job", "--url", f"http://0.0.0.0:{port}", "--key", key).returncode == 2
        # Told to, it goes; and this machine's names are never refused.
        for argv in (("--url", f"http://0.0.0.0:{port}", "--allow-http"), ("--url", f"http://localhost:{port}"),
                     ("--url", f"http://127.0.0.1:{port}")):
            sent = herald_cli("status", "some-job", *argv, "--key", key)
            assert sent.returncode == 1 and "404" in sent.stderr and "--allow-http" not in sent.stderr, sent.stderr
    finally:
        server.shutdown()
        server.server_close()


def test_cli_cancel_failures_and_errors(herald: Deployment) -> None:
    connection = ["--url", herald.url(), "--key", KEY]
    long = json.loads(herald_cli("submit", "report", "--title", "long", "--pages", "1000", *connection).stdout)
    cancelled = herald_cli("cancel", long["id"], *connection)
    assert cancelled.returncode == 0, cancelled.stderr
    answer = json.loads(cancelled.stdout)
    assert answer["state"] == "cancelled" or answer["cancel_requested"] is True
    watched = herald_cli("watch", long["id"], *connection)
    assert watched.returncode == 1 and "cancelled" in watched.stdout

    broken = json.loads(herald_cli("submit", "report", "--title", "b", "--pages", "3", "--fail-on-page", "2",
                                   *connection).stdout)
    watched = herald_cli("watch", broken["id"], *connection)
    assert watched.returncode == 1 and "failed" in watched.stdout and "report-render-failed" in watched.stdout

    missing = herald_cli("status", str(uuid.uuid4()), *connection)
    assert missing.returncode == 1 and "404" in missing.stderr and missing.stdout == ""
    invalid = herald_cli("submit", "report", "--title", "x", "--pages", "0", *connection)
    assert invalid.returncode == 1 and "pages" in invalid.stderr
    wait_until(lambda: httpx.get(herald.url() + f"/jobs/{long['id']}",
                                 headers={"Authorization": f"Bearer {KEY}"}).json()["state"] == "cancelled")


# ----- webhooks: everything the portal does, as calls ------------------------------------------


def test_webhook_calls_sync(herald: Deployment) -> None:
    with HeraldClient(herald.url(), KEY) as client:
        created = client.create_webhook("https://hooks.example.com/client", event_types=["job.succeeded"],
                                        kinds=["report"])
        assert created.secret and created.secret.startswith("whsec_") and created.public_key is None
        assert created.kinds == ["report"] and created.status == "enabled"
        ed = client.create_webhook("https://hooks.example.com/client-ed", signature="ed25519")
        assert ed.public_key and ed.public_key.startswith("whpk_") and ed.secret is None
        listed = client.list_webhooks(limit=1)
        assert [e.id for e in listed.items] == [ed.id] and listed.next_cursor
        assert [e.id for e in client.list_webhooks(limit=1, cursor=listed.next_cursor).items] == [created.id]
        shown = client.webhook(created.id)
        assert shown.health is not None and shown.health.success_rate is None and shown.health.last_delivery is None

        paused = client.update_webhook(created, status="disabled")
        assert paused.status == "disabled" and paused.kinds == ["report"]  # kinds kept (KEEP)
        with pytest.raises(Conflict):
            client.send_test_event(created)
        everything = client.update_webhook(created, kinds=None, status="enabled")
        assert everything.kinds is None and everything.status == "enabled"
        with pytest.raises(InvalidRequest) as bad:
            client.update_webhook(created, url="ftp://nowhere.example/x")
        assert [e.field for e in bad.value.errors or []] == ["url"]

        rotated = client.rotate_webhook_secret(created)
        assert rotated.secret and rotated.secret != created.secret

        test = client.send_test_event(created)
        assert test.type == "webhook.test" and test.job_id is None and test.payload
        assert json.loads(test.payload)["data"]["endpoint_id"] == created.id
        assert client.webhook_delivery(created, test.id).event_id == test.event_id
        assert [d.id for d in client.webhook_deliveries(created).items] == [test.id]
        assert client.webhook_deliveries(created, status="failed").items == []
        assert client.retry_delivery(created, test).id == test.id
        assert client.recover_webhook(created, datetime.now(timezone.utc)) == 0
        assert client.recover_webhook(created, "2020-01-01T00:00:00Z") == 0  # nothing failed
        with pytest.raises(ValueError):
            client.recover_webhook(created, datetime.now())  # naive: ambiguous

        link = client.portal_link()
        assert link.url.startswith("/portal?") and link.expires_in > 0
        assert client.callback_secret().secret
        old_callback = client.callback_secret().secret
        assert client.rotate_callback_secret().secret != old_callback

        client.delete_webhook(created)
        client.delete_webhook(ed.id)
        with pytest.raises(NotFound):
            client.webhook(created.id)


async def test_webhook_calls_async(herald: Deployment) -> None:
    async with AsyncHeraldClient(herald.url(), KEY) as client:
        created = await client.create_webhook("https://hooks.example.com/async")
        test = await client.send_test_event(created)
        assert (await client.webhook_deliveries(created)).items[0].id == test.id
        assert await client.recover_webhook(created, "2020-01-01T00:00:00+00:00") == 0
        assert (await client.portal_link()).url.startswith("/portal?")
        await client.delete_webhook(created)
        with pytest.raises(NotFound):
            await client.webhook(created)
