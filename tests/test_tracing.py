"""Tracing (SPEC §10, issue 17): one trace from the POST to the webhook.

Real parts: Herald's gateway, worker and notifier processes on a real nats-server and the
store under test; an OTLP/HTTP receiver of the test's own on 127.0.0.1 (a real HTTP
server that decodes every ``ExportTraceServiceRequest`` it is sent with the protobuf
classes of ``opentelemetry-proto``); and a real webhook receiver that keeps each
request's headers.
"""

from __future__ import annotations

import gzip
import json
import re
import secrets
import signal
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan

from herald import tracing
from tests.harness import Deployment, client, wait_until

TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")


# ----- an OTLP/HTTP receiver -------------------------------------------------------------------


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    attributes: dict[str, Any]
    error: bool


def _value(any_value: Any) -> Any:
    which = any_value.WhichOneof("value")
    return getattr(any_value, which) if which else None


class OtlpReceiver:
    """``POST /v1/traces`` with an ``application/x-protobuf`` ExportTraceServiceRequest
    (gzip or deflate if so encoded), decoded span by span; 200 with an empty response."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self.problems: list[str] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                encoding = (self.headers.get("content-encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces" or self.headers.get("content-type") != "application/x-protobuf":
                    receiver.problems.append(f"unexpected {self.path} {self.headers.get('content-type')}")
                    self._answer(404, b"")
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._keep(request)
                self._answer(200, ExportTraceServiceResponse().SerializeToString())

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _keep(self, request: ExportTraceServiceRequest) -> None:
        decoded = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    decoded.append(ReceivedSpan(
                        service=str(resource.get("service.name")),
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        name=span.name,
                        kind=span.kind,
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        error=span.status.code == 2,
                    ))
        with self._lock:
            self.requests += 1
            self.spans.extend(decoded)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ----- a webhook receiver ----------------------------------------------------------------------


@dataclass
class Webhooks:
    """Answers every POST 200 and keeps its headers and body."""

    hits: list[tuple[dict[str, str], dict[str, Any]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        hits = self.hits

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                hits.append(({k.lower(): v for k, v in self.headers.items()}, json.loads(body)))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def for_job(self, job_id: str) -> list[tuple[dict[str, str], dict[str, Any]]]:
        return [(h, b) for h, b in list(self.hits) if b["data"]["id"] == job_id]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def otlp() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver().start()
    try:
        yield receiver
    finally:
        receiver.stop()
    assert not receiver.problems, receiver.problems


@pytest.fixture()
def webhooks() -> Iterator[Webhooks]:
    receiver = Webhooks()
    try:
        yield receiver
    finally:
        receiver.stop()


def _start(deployment: Deployment, **env: str) -> str:
    deployment.env_overrides.update(env)
    base = deployment.start_gateway()
    deployment.start_worker()
    deployment.start_notifier()
    return base


def _succeeded_hook(webhooks: Webhooks, job_id: str) -> list[tuple[dict[str, str], dict[str, Any]]] | None:
    hits = webhooks.for_job(job_id)
    return hits if any(b["type"] == "job.succeeded" for _h, b in hits) else None


# ----- the tests -------------------------------------------------------------------------------


def test_one_trace_from_the_post_to_the_webhook(fresh: Deployment, otlp: OtlpReceiver, webhooks: Webhooks) -> None:
    base = _start(fresh, OTEL_EXPORTER_OTLP_ENDPOINT=otlp.endpoint, OTEL_BSP_SCHEDULE_DELAY="100")
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    with client(base) as http:
        answer = http.post("/reports", json={"title": "traced", "pages": 2, "callback_url": webhooks.url},
                           headers={"traceparent": f"00-{trace_id}-{client_span}-01", "tracestate": "acme=1"})
        assert answer.status_code == 202, answer.text
        job = answer.json()
        assert job["trace_id"] == trace_id  # the status object names the job's trace
        hits = wait_until(lambda: _succeeded_hook(webhooks, job["id"]), timeout=30, what="the job.succeeded webhook")
        assert http.get(f"/jobs/{job['id']}", follow_redirects=False).json()["trace_id"] == trace_id

    # Every webhook request carries a traceparent of the job's trace (and its tracestate).
    for headers, body in hits:
        match = TRACEPARENT.match(headers.get("traceparent", ""))
        assert match and match.group(1) == trace_id, headers
        assert headers.get("tracestate") == "acme=1", headers
        assert body["data"]["trace_id"] == trace_id

    def complete() -> list[ReceivedSpan] | None:
        spans = otlp.trace(trace_id)
        names = {s.name for s in spans}
        deliveries = [s for s in spans if s.name == "webhook delivery"]
        wanted = {"POST /reports", "store accept", "publish jobs", "run report", "handler report",
                  "store transition job.running", "store transition job.succeeded"}
        return spans if wanted <= names and len(deliveries) >= len(hits) else None

    spans = wait_until(complete, timeout=20, what="the job's spans at the OTLP receiver")
    by_id = {s.span_id: s for s in spans}

    # One trace: the accept span is the client's span's child, every other span descends from it.
    (accept,) = [s for s in spans if s.name == "POST /reports"]
    assert accept.parent_span_id == client_span and accept.kind == ProtoSpan.SPAN_KIND_SERVER
    assert accept.attributes["herald.job.id"] == job["id"] and accept.attributes["http.response.status_code"] == 202
    assert accept.service == "herald-gateway"

    def ancestors(span: ReceivedSpan) -> list[str]:
        chain = []
        while span.parent_span_id in by_id:
            span = by_id[span.parent_span_id]
            chain.append(span.name)
        assert span.parent_span_id == client_span, f"{span.name} does not lead back to the client's span"
        return chain

    for span in spans:
        ancestors(span)
    (run,) = [s for s in spans if s.name == "run report"]
    assert run.service == "herald-worker" and run.kind == ProtoSpan.SPAN_KIND_CONSUMER
    assert run.attributes["herald.job.attempt"] == 1
    assert ancestors(run)[:2] == ["publish jobs", "POST /reports"]  # continued from the message's headers
    handler = next(s for s in spans if s.name == "handler report")
    assert ancestors(handler)[0] == "run report"
    for name in ("store transition job.running", "store transition job.succeeded"):
        assert "run report" in ancestors(next(s for s in spans if s.name == name))

    # Each webhook request's traceparent is its delivery span: the receiver's spans hang under it.
    deliveries = {s.span_id: s for s in spans if s.name == "webhook delivery"}
    for headers, body in hits:
        span = deliveries[TRACEPARENT.match(headers["traceparent"]).group(2)]  # type: ignore[union-attr]
        assert span.service == "herald-notifier" and span.kind == ProtoSpan.SPAN_KIND_CLIENT
        assert span.attributes["http.response.status_code"] == 200
        assert span.attributes["herald.delivery.attempt"] == 1
        assert span.attributes["herald.endpoint.id"] == "callback_url"
        assert span.attributes["herald.event.type"] == body["type"]
        assert "POST /reports" in ancestors(span)

    # Log lines carry the trace and the span they were logged in.
    started = wait_until(lambda: fresh.logged("worker", "job started", job_id=job["id"]), what="job started")
    assert started[0]["trace_id"] == trace_id and started[0]["span_id"] in by_id
    attempts = fresh.logged("notifier", "webhook attempt", job_id=job["id"])
    assert attempts and all(line["trace_id"] == trace_id and line["span_id"] in deliveries for line in attempts)


def test_without_a_traceparent_herald_starts_the_trace(
    fresh: Deployment, otlp: OtlpReceiver, webhooks: Webhooks
) -> None:
    base = _start(fresh, OTEL_EXPORTER_OTLP_ENDPOINT=otlp.endpoint, OTEL_BSP_SCHEDULE_DELAY="100",
                  OTEL_SERVICE_NAME="herald-test")
    with client(base) as http:
        job = http.post("/exports", json={"format": "csv", "rows": 5, "callback_url": webhooks.url}).json()
        hits = wait_until(lambda: _succeeded_hook(webhooks, job["id"]), timeout=30, what="the job.succeeded webhook")
    trace_id = job["trace_id"]
    assert re.fullmatch(r"[0-9a-f]{32}", trace_id)
    assert all(TRACEPARENT.match(h["traceparent"]).group(1) == trace_id for h, _b in hits)  # type: ignore[union-attr]
    wanted = {"POST /exports", "run export", "handler export", "webhook delivery"}
    spans = wait_until(lambda: wanted <= {s.name for s in otlp.trace(trace_id)} and otlp.trace(trace_id),
                       timeout=20, what="the job's spans")
    (accept,) = [s for s in spans if s.name == "POST /exports"]
    assert accept.parent_span_id == ""  # the root of the trace
    assert {s.service for s in spans} == {"herald-test"}  # OTEL_SERVICE_NAME wins


def test_tracing_off_still_propagates_the_context(fresh: Deployment, webhooks: Webhooks) -> None:
    """No OTLP endpoint: nothing is exported, but the job still belongs to the caller's trace,
    its webhooks carry it and its log lines name it."""
    base = _start(fresh, OTEL_EXPORTER_OTLP_ENDPOINT="")
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    with client(base) as http:
        job = http.post("/reports", json={"title": "untraced", "pages": 1, "callback_url": webhooks.url},
                        headers={"traceparent": f"00-{trace_id}-{client_span}-01"}).json()
        assert job["trace_id"] == trace_id
        hits = wait_until(lambda: _succeeded_hook(webhooks, job["id"]), timeout=30, what="the job.succeeded webhook")
        malformed = http.post("/reports", json={"title": "x", "pages": 1},
                              headers={"traceparent": "00-00000000000000000000000000000000-0000000000000000-01"})
        assert malformed.status_code == 202 and re.fullmatch(r"[0-9a-f]{32}", malformed.json()["trace_id"])
        assert malformed.json()["trace_id"] != "0" * 32  # an invalid context starts a new trace
    for headers, _body in hits:
        assert headers["traceparent"] == f"00-{trace_id}-{client_span}-01"  # the caller's span, as kept
    started = fresh.logged("worker", "job started", job_id=job["id"])
    assert started and started[0]["trace_id"] == trace_id
    assert not any("tracing on" in str(e.get("event")) for e in fresh.log_events("gateway", "worker", "notifier"))


@pytest.mark.slow
def test_a_job_re_queued_after_its_worker_died_stays_in_its_trace(
    fresh: Deployment, otlp: OtlpReceiver, webhooks: Webhooks
) -> None:
    """The context lives in the store and the messages: a worker killed mid-job takes no
    part of the trace with it; the sweeper's re-queue and the second attempt join it."""
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    # A heartbeat timeout with room for a loaded machine: the second worker must not lose the
    # job to a second re-queue while it starts up (the test follows exactly one re-queue).
    fresh.env_overrides.update(otel, HERALD_HEARTBEAT_TIMEOUT_S="6")
    base = fresh.start_gateway()
    fresh.start_notifier()
    fresh.start_worker("worker-1", HERALD_REPORT_PAGE_MS="100")
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    with client(base) as http:
        job = http.post("/reports", json={"title": "survivor", "pages": 20, "callback_url": webhooks.url},
                        headers={"traceparent": f"00-{trace_id}-{client_span}-01"}).json()
        wait_until(lambda: (s := http.get(f"/jobs/{job['id']}").json())["state"] == "running" and s["progress"],
                   what="job running with progress")
        fresh.kill("worker-1", signal.SIGKILL)
        fresh.start_worker("worker-2")
        hits = wait_until(lambda: _succeeded_hook(webhooks, job["id"]), timeout=40, what="the job.succeeded webhook")
    assert all(TRACEPARENT.match(h["traceparent"]).group(1) == trace_id for h, _b in hits)  # type: ignore[union-attr]

    def spans() -> list[ReceivedSpan] | None:
        found = otlp.trace(trace_id)
        runs = [s for s in found if s.name == "run report"]
        requeued = [s for s in found if s.name == "store transition job.queued"]
        return found if runs and requeued and "store transition job.succeeded" in {s.name for s in found} else None

    found = wait_until(spans, timeout=20, what="the second attempt's spans")
    by_id = {s.span_id: s for s in found}
    (accept,) = [s for s in found if s.name == "POST /reports"]
    (requeue,) = [s for s in found if s.name == "store transition job.queued"]
    assert requeue.service == "herald-gateway" and requeue.parent_span_id == accept.span_id  # the sweeper, from the row
    (run,) = [s for s in found if s.name == "run report"]  # the killed attempt's run never ended: never exported
    assert run.attributes["herald.job.attempt"] == 2
    publish = by_id[run.parent_span_id]  # continued from the re-queue's work message
    assert publish.name == "publish jobs" and publish.attributes["messaging.message.id"] == f"{job['id']}.a2"


def test_context_helpers() -> None:
    assert tracing.context_from(None) is None
    assert tracing.context_from("garbage") is None
    assert tracing.context_from("00-" + "0" * 32 + "-" + "1" * 16 + "-01") is None
    ctx = tracing.context_from("00-" + "a" * 32 + "-" + "b" * 16 + "-01", "k=v")
    assert ctx is not None
    with tracing.span("x", ctx):  # tracing off in this process: the context itself is current
        headers: dict[str, str] = {}
        tracing.inject(headers)
        fields = tracing.job_fields()
    assert headers == {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "tracestate": "k=v"}
    assert fields == {"traceparent": headers["traceparent"], "tracestate": "k=v"}
    fresh_fields = tracing.job_fields()  # no current span: a trace of its own
    assert TRACEPARENT.match(fresh_fields["traceparent"] or "")
