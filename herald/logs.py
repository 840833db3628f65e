"""Logging: JSON lines on stderr (or console text), one event per line, context as fields.

Code logs with the standard library (``log.info("job started", extra={"job_id": ...})``);
structlog renders every record, including third-party ones (uvicorn's, warnings), the
same way. Context bound with ``structlog.contextvars`` (the gateway binds ``request_id``
and ``job_id`` per request) is merged into every line. Secrets never reach a line: fields
named like credentials are redacted, and so is any ``Bearer`` token inside a value.

The two lines logged for nearly every request (the access line, the transition line) go
through ``log_event``: with the JSON format it builds the very event dict the structlog
chain would (same fields, same processors: context, level, logger, timestamp, redaction,
trace ids, component) and writes it with msgspec, skipping the ``LogRecord`` and the
formatter chain, which cost ~10 % of a gateway's CPU under accept load (bench/RESULTS.md,
issue 14). Whenever logging is set up otherwise (console format, a handler added by a
test's ``caplog``), it logs through the standard library as any other line.
"""

from __future__ import annotations

import contextvars
import datetime
import logging
import re
import sys
import threading
from collections.abc import MutableMapping
from typing import Any

import msgspec
import structlog

from herald.settings import Settings
from herald.tracing import add_trace_ids

REDACTED = "[redacted]"
_SECRET_FIELDS = frozenset({
    "authorization", "api_key", "api_keys", "key", "keys", "secret", "secrets", "password", "token",
    "signature", "sig", "public_key", "private_key",
})
_BEARER = re.compile(r"(?i)\bbearer\s+[^\s\"',;]+")
_DROPPED_FIELDS = ("color_message",)  # uvicorn's ANSI-coloured copy of the message


def redact_secrets(_logger: object, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Processor: no key, secret or bearer token is ever written to a log line."""
    for name in _DROPPED_FIELDS:
        event.pop(name, None)
    for name, value in event.items():
        if name.lower() in _SECRET_FIELDS:
            event[name] = REDACTED
        elif isinstance(value, str) and "earer" in value:
            event[name] = _BEARER.sub(f"Bearer {REDACTED}", value)
    return event


_STRUCTLOG_PREFIX = "structlog_"  # structlog.contextvars' name prefix for bound variables
_UTC = datetime.timezone.utc


def _unserializable(value: object) -> str:
    return repr(value)  # what structlog's JSONRenderer writes for a value JSON has no type for


class _JsonLines:
    """Writes an event as one JSON line to the root handler's stream, as the chain would render it."""

    def __init__(self, handler: logging.StreamHandler[Any], component: str, instance: str) -> None:
        self.handler = handler
        self.handlers = [handler]
        self.component = component
        self.instance = instance
        self.encoder = msgspec.json.Encoder(enc_hook=_unserializable)
        self.buffer = bytearray()

    def usable(self, logger: logging.Logger, level: int) -> bool:
        """True when the standard library would hand this line to our handler and to it only."""
        if self.handler.level > level or self.handler.filters:
            return False
        current: logging.Logger | None = logger
        while current is not None:
            if current.filters:
                return False
            if current.parent is None:  # the root logger
                return current.handlers == self.handlers
            if current.handlers or not current.propagate:
                return False
            current = current.parent
        return False

    def write(self, logger_name: str, level: int, event: str, fields: dict[str, Any]) -> None:
        line: dict[str, Any] = {"event": event}
        # The processors of ``configure_logging``, in order, on the same dict shape.
        context = contextvars.copy_context()
        for var in context:  # merge_contextvars: bound values, never over the event's own keys
            name = var.name
            if name.startswith(_STRUCTLOG_PREFIX):
                value = context[var]
                if value is not Ellipsis:
                    line.setdefault(name[len(_STRUCTLOG_PREFIX):], value)
        line["level"] = logging.getLevelName(level).lower()  # add_log_level
        line["logger"] = logger_name  # add_logger_name
        line.update(fields)  # ExtraAdder: the extras win over bound context
        line["timestamp"] = datetime.datetime.now(tz=_UTC).isoformat().replace("+00:00", "Z")  # TimeStamper
        redact_secrets(None, "", line)
        add_trace_ids(None, "", line)
        line.setdefault("component", self.component)  # add_component
        if self.instance:
            line.setdefault("instance", self.instance)
        buffer = self.buffer
        with self.handler.lock or _NO_LOCK:
            self.encoder.encode_into(line, buffer)
            buffer.extend(b"\n")
            stream = self.handler.stream
            raw = getattr(stream, "buffer", None)
            try:
                if raw is None:
                    stream.write(buffer.decode())
                    stream.flush()
                else:
                    stream.flush()  # whatever text is pending goes first (nothing, normally)
                    raw.write(buffer)
                    raw.flush()
            except Exception:  # as StreamHandler.emit: a failed log write must not fail the request
                self.handler.handleError(logging.makeLogRecord({"msg": event, "levelno": level, "name": logger_name}))


_NO_LOCK = threading.Lock()
_json_lines: _JsonLines | None = None  # set by configure_logging for the JSON format


def log_event(logger: logging.Logger, level: int, event: str, fields: dict[str, Any]) -> None:
    """``logger.log(level, event, extra=fields)``, rendered without the ``LogRecord`` chain
    when the process logs JSON through ``configure_logging``'s handler (module docstring)."""
    if not logger.isEnabledFor(level):
        return
    fast = _json_lines
    if fast is not None and fast.usable(logger, level):
        fast.write(logger.name, level, event, fields)
    else:
        logger.log(level, event, extra=fields)


class _ErrorWithoutTraceback(logging.Filter):
    """asyncpg's pool logs every failed reconnect with its whole traceback (a dozen lines a
    second per process while PostgreSQL is away): the error's own words say all of it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            record.msg = f"{record.getMessage()}: {type(exc).__name__}: {exc}"
            record.args = None
            record.exc_info = None
        return True


def configure_logging(settings: Settings, component: str) -> None:
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.ExtraAdder(),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        redact_secrets,
        add_trace_ids,  # trace_id, span_id of the current span (herald.tracing)
    ]

    def add_component(_logger: object, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        event.setdefault("component", component)
        if settings.instance:
            event.setdefault("instance", settings.instance)
        return event

    renderer: structlog.typing.Processor
    if settings.log_format == "console":
        renderer = structlog.dev.ConsoleRenderer(colors=False)
    else:
        renderer = structlog.processors.JSONRenderer()
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            add_component,
            structlog.processors.format_exc_info,
            renderer,
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(settings.log_level.upper())
    for noisy in ("uvicorn.access", "nats"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    pool = logging.getLogger("asyncpg.pool")
    if not any(isinstance(f, _ErrorWithoutTraceback) for f in pool.filters):
        pool.addFilter(_ErrorWithoutTraceback())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "litestar"):
        framework = logging.getLogger(name)  # whatever configured them, they go through our handler
        framework.handlers = []
        framework.propagate = True
    logging.captureWarnings(True)  # warnings become log events, not free text on stderr
    # No line shows a record's process, thread or process name: not looking them up spares
    # a getpid() and two thread lookups per line (syscalls are dear in some sandboxes).
    logging.logProcesses = False
    logging.logThreads = False
    logging.logMultiprocessing = False
    global _json_lines
    _json_lines = _JsonLines(handler, component, settings.instance) if settings.log_format != "console" else None
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )


_transition_log = logging.getLogger("herald.transition")


def log_transition(job: object, event: object) -> None:
    """Store listener: one line per committed transition, with its job_id."""
    log_event(
        _transition_log,
        logging.INFO,
        "transition",
        {
            "job_id": event.job_id,  # type: ignore[attr-defined]
            "event_type": event.type,  # type: ignore[attr-defined]
            "version": event.version,  # type: ignore[attr-defined]
            "state": job.state,  # type: ignore[attr-defined]
            "attempt": job.attempt,  # type: ignore[attr-defined]
            "trace_id": job.trace_id,  # type: ignore[attr-defined]
        },
    )
