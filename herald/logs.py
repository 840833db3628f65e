"""Logging: JSON lines on stderr (or console text), one event per line, context as fields.

Code logs with the standard library (``log.info("job started", extra={"job_id": ...})``);
structlog renders every record, including third-party ones (uvicorn's, warnings), the
same way. Context bound with ``structlog.contextvars`` (the gateway binds ``request_id``
and ``job_id`` per request) is merged into every line. Secrets never reach a line: fields
named like credentials are redacted, and so is any ``Bearer`` token inside a value.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import MutableMapping
from typing import Any

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
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "litestar"):
        framework = logging.getLogger(name)  # whatever configured them, they go through our handler
        framework.handlers = []
        framework.propagate = True
    logging.captureWarnings(True)  # warnings become log events, not free text on stderr
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )


_transition_log = logging.getLogger("herald.transition")


def log_transition(job: object, event: object) -> None:
    """Store listener: one line per committed transition, with its job_id."""
    _transition_log.info(
        "transition",
        extra={
            "job_id": event.job_id,  # type: ignore[attr-defined]
            "event_type": event.type,  # type: ignore[attr-defined]
            "version": event.version,  # type: ignore[attr-defined]
            "state": job.state,  # type: ignore[attr-defined]
            "attempt": job.attempt,  # type: ignore[attr-defined]
            "trace_id": job.trace_id,  # type: ignore[attr-defined]
        },
    )
