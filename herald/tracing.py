"""Tracing: every job is one W3C trace, from the POST to the last webhook (SPEC §10).

The trace context is kept **with the job**, never in a process's memory: a job start's
``traceparent``/``tracestate`` (or a new trace, if it has none) is written into the job's
row in the accept transaction, and into every outbox row, so the relay sends it as NATS
message headers. A worker continues the trace from the message's headers (or the job
row), the notifier from the job row, and a gateway's sweeper or cancel from the job row,
on whatever machine each runs.

What is kept on the job is the context of the accept span: the run, the transitions and
the webhook deliveries are its descendants, and a webhook request's ``traceparent`` is
the delivery span's, so a receiver's own spans hang under it.

Export is the OpenTelemetry SDK with its OTLP/HTTP exporter, configured by the standard
``OTEL_*`` variables; it is switched on only if ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set, and off with ``OTEL_SDK_DISABLED=true`` or
``OTEL_TRACES_EXPORTER=none``. Off, the tracer is the API's no-op tracer: no SDK is
loaded, no span is recorded, and a "span" is the job's own context made current (so
log lines still carry the job's ``trace_id`` and webhooks still carry a ``traceparent``).
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Mapping, MutableMapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypedDict

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, TraceFlags, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import Attributes

if TYPE_CHECKING:
    from herald.jobs import JobRow
    from herald.transitions import Change
    from schemas import JobEvent

__all__ = ["SpanKind", "TRACEPARENT", "TRACESTATE", "configure", "enabled", "span", "record", "context_from",
           "incoming", "continued", "current_span", "job_fields", "inject", "record_transition", "add_trace_ids", "shutdown", "now_ns"]

log = logging.getLogger("herald.tracing")

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

_propagator = TraceContextTextMapPropagator()
_tracer: Tracer = trace.NoOpTracer()
_provider: Any = None
_enabled = False
_random = random.Random()
now_ns = time.time_ns


def enabled() -> bool:
    """Spans are recorded and exported (an OTLP endpoint is configured)."""
    return _enabled


def _wanted(env: Mapping[str, str]) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = {e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",")}
    if "otlp" not in exporters:
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def configure(component: str, instance: str | None = None, env: Mapping[str, str] | None = None) -> bool:
    """Set up the SDK and the OTLP/HTTP exporter if the environment asks for it; True if it did.

    The SDK reads its own variables: ``OTEL_SERVICE_NAME`` (default ``herald-<component>``),
    ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``/``_ARG`` (default: parent-based,
    always on), ``OTEL_EXPORTER_OTLP_*`` (endpoint, headers, timeout, compression,
    certificates) and ``OTEL_BSP_*`` (the batch processor's delay and queue).
    """
    global _tracer, _provider, _enabled
    env = os.environ if env is None else env
    if _enabled or not _wanted(env):
        return _enabled
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    import herald

    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol and protocol != "http/protobuf":
        log.warning("only OTLP over http/protobuf is supported; exporting with it", extra={"protocol": protocol})
    attributes: dict[str, str] = {"herald.component": component}
    if instance:
        attributes["service.instance.id"] = instance
    resource = Resource.create(attributes)
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: f"herald-{component}"}))
    provider = TracerProvider(resource=resource)  # sampler from OTEL_TRACES_SAMPLER; flushed at exit
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _provider = provider
    _tracer = provider.get_tracer("herald", herald.__version__)
    _enabled = True
    log.info("tracing on: spans exported over OTLP/HTTP",
             extra={"service": resource.attributes.get(SERVICE_NAME),
                    "endpoint": env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")})
    return True


def shutdown() -> None:
    """Export what is still buffered (also done at exit)."""
    if _provider is not None:
        _provider.shutdown()


# ----- contexts -------------------------------------------------------------------------------


def format_traceparent(sc: SpanContext) -> str:
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


def context_from(traceparent: str | None, tracestate: str | None = None) -> Context | None:
    """The context a ``traceparent`` (and ``tracestate``) names; None if absent or malformed."""
    if not traceparent:
        return None
    carrier = {TRACEPARENT: traceparent}
    if tracestate:
        carrier[TRACESTATE] = tracestate
    ctx = _propagator.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def _new_trace() -> Context:
    """A trace Herald starts itself while it records nothing: random ids, sampled (the
    receivers of its webhooks decide for themselves whether to record)."""
    sc = SpanContext(trace_id=_random.getrandbits(128) or 1, span_id=_random.getrandbits(64) or 1,
                     is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return trace.set_span_in_context(NonRecordingSpan(sc))


def incoming(headers: Mapping[str, str]) -> Context | None:
    """The parent of a job start: the request's W3C trace context. Without one, None while
    tracing is on (the accept span starts the trace), else a new trace of Herald's own."""
    ctx = context_from(headers.get(TRACEPARENT), headers.get(TRACESTATE))
    if ctx is None and not _enabled:
        return _new_trace()
    return ctx


class JobTrace(TypedDict):
    """The trace fields of a new job (``NewJob(..., **job_fields())``)."""

    traceparent: str | None
    tracestate: str | None


def job_fields() -> JobTrace:
    """The ``traceparent``/``tracestate`` kept with a new job: the current (accept) span's
    context; with tracing off, the caller's or the trace Herald started (``incoming``)."""
    sc = trace.get_current_span().get_span_context()
    if not sc.is_valid:  # no accept span made current: a trace of the job's own
        sc = trace.get_current_span(_new_trace()).get_span_context()
    return {"traceparent": format_traceparent(sc), "tracestate": sc.trace_state.to_header() or None}


def inject(headers: MutableMapping[str, str]) -> None:
    """Write the current span's context as ``traceparent``/``tracestate`` (NATS, webhooks)."""
    sc = trace.get_current_span().get_span_context()
    if sc.is_valid:
        headers[TRACEPARENT] = format_traceparent(sc)
        state = sc.trace_state.to_header()
        if state:
            headers[TRACESTATE] = state


# ----- spans ----------------------------------------------------------------------------------


def span(
    name: str,
    context: Context | None = None,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Attributes = None,
    error_on_exception: bool = True,
) -> AbstractContextManager[Span]:
    """A span made current for the block: a child of ``context`` (a job's, from ``context_from``),
    or of the current span. With tracing off, the job's context itself is made current."""
    if not _enabled:
        return _Current(context)
    return _tracer.start_as_current_span(name, context=context, kind=kind, attributes=attributes,
                                         record_exception=error_on_exception,
                                         set_status_on_exception=error_on_exception)


class _Current:
    """Tracing off: no span, only ``context`` (if any) made current for the block (what the
    API's no-op tracer does, at a third of its cost)."""

    __slots__ = ("_context", "_token")

    def __init__(self, context: Context | None) -> None:
        self._context = context
        self._token: object = None

    def __enter__(self) -> Span:
        if self._context is None:
            return trace.get_current_span()
        self._token = otel_context.attach(self._context)
        return trace.get_current_span(self._context)

    def __exit__(self, *_exc: object) -> None:
        if self._token is not None:
            otel_context.detach(self._token)  # type: ignore[arg-type]


def continued(headers: Mapping[str, str] | None, job: JobRow) -> Context | None:
    """Where a consumer continues a job's trace: the message's headers, else the job's row."""
    if headers:
        context = context_from(headers.get(TRACEPARENT), headers.get(TRACESTATE))
        if context is not None:
            return context
    return context_from(job.traceparent, job.tracestate)


def current_span() -> Span:
    return trace.get_current_span()


def record(name: str, started_ns: int, job: JobRow | None, attributes: Attributes = None) -> None:
    """A span that already happened (``started_ns`` until now), of the job's trace: a child
    of the current span if that is in the job's trace, else of the job's kept context.

    For writes that learn the job's trace only from the row they read (transitions)."""
    if not _enabled or job is None or not job.traceparent:
        return
    parent: Context | None = None
    current = trace.get_current_span().get_span_context()
    if not current.is_valid or f"{current.trace_id:032x}" != job.traceparent[3:35]:
        parent = context_from(job.traceparent, job.tracestate)
        if parent is None:
            return
    _tracer.start_span(name, context=parent, attributes=attributes, start_time=started_ns).end()


def record_transition(
    started_ns: int, job: JobRow | None, change: Change, event: JobEvent | None, rejected: str | None
) -> None:
    """The span of one ``JobStore.transition`` (the store transaction), in the job's trace."""
    if not _enabled or job is None:
        return
    attributes: dict[str, str | int | bool] = {"herald.job.id": job.id, "herald.job.kind": job.kind,
                                               "herald.job.state": job.state, "herald.job.attempt": job.attempt,
                                               "herald.job.version": job.version}
    if change.to is not None:
        attributes["herald.transition.to"] = change.to
    if rejected is not None:
        name = "store transition rejected"
        attributes["herald.transition.rejected"] = rejected
    elif event is not None:
        name = f"store transition {event.type}"
        attributes["herald.event.type"] = event.type
    else:
        name = "store transition unchanged"
    record(name, started_ns, job, attributes)


def add_trace_ids(_logger: object, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Log processor: ``trace_id`` and ``span_id`` of the span current where the line was logged."""
    sc = trace.get_current_span().get_span_context()
    if sc.is_valid:
        event.setdefault("trace_id", f"{sc.trace_id:032x}")
        event.setdefault("span_id", f"{sc.span_id:016x}")
    return event
