"""Logging: JSON lines on stderr (or console text), one event per line, context as fields.

Code logs with the standard library (``log.info("job started", extra={"job_id": ...})``);
structlog renders every record, including third-party ones, the same way.
"""

from __future__ import annotations

import logging
import sys

import structlog

from herald.settings import Settings


def configure_logging(settings: Settings, component: str) -> None:
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.ExtraAdder(),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]

    def add_component(_logger: object, _name: str, event: dict) -> dict:  # type: ignore[type-arg]
        event.setdefault("component", component)
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
        },
    )
