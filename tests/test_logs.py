"""``herald.logs.log_event`` (the access and transition lines' fast path) writes what the
structlog chain writes for the same call: every field, same values, same order.

Each case runs in a fresh Python process, as a Herald process sets up its logging once
for its whole life; the process logs each event twice, once through the standard library
(``logger.log(..., extra=...)``, the chain every other line takes) and once through
``log_event``, into the real stderr, and the test compares the two lines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

PROGRAM = r"""
import logging, sys
import structlog
from opentelemetry.sdk.trace import TracerProvider
from herald import logs
from herald.logs import configure_logging, log_event
from herald.settings import Settings

configure_logging(Settings(instance=sys.argv[1], log_format=sys.argv[2]), "gateway")
log = logging.getLogger("herald.http")
# The fast path is taken for JSON (else this compares the chain with itself), never for console.
fast = logs._json_lines is not None and logs._json_lines.usable(log, logging.INFO)
assert fast == (sys.argv[2] == "json"), fast


class Opaque:
    def __repr__(self) -> str:
        return "<opaque>"


fields = {"method": "POST", "route": "/reports", "path": "/reports", "status": 202, "duration_ms": 1.3,
          "job_id": "job-from-extra", "token": "secret-value", "note": "Authorization: Bearer abc.def, ok",
          "unicode": "r\u00e9sum\u00e9 \u2713", "nothing": None, "opaque": Opaque()}
structlog.contextvars.bind_contextvars(request_id="req-1", job_id="job-bound")
log.log(logging.INFO, "request", extra=fields)
log_event(log, logging.INFO, "request", fields)
with TracerProvider().get_tracer("test").start_as_current_span("span"):
    log.log(logging.WARNING, "in a span", extra={"n": 1})
    log_event(log, logging.WARNING, "in a span", {"n": 1})
structlog.contextvars.unbind_contextvars("job_id")
log.setLevel(logging.WARNING)
log_event(log, logging.INFO, "below the level", {})
log.setLevel(logging.NOTSET)
logging.getLogger().addHandler(logging.NullHandler())  # as a test's caplog does: the chain takes over
assert logs._json_lines is None or not logs._json_lines.usable(log, logging.INFO)
"""


def run(instance: str = "", log_format: str = "json") -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERALD_")}
    done = subprocess.run([sys.executable, "-c", PROGRAM, instance, log_format], env=env, capture_output=True,
                          timeout=60, check=True)
    return done.stderr.decode().splitlines()


def without_timestamp(line: str) -> dict[str, Any]:
    event: dict[str, Any] = json.loads(line)
    assert event.pop("timestamp").endswith("Z")
    return event


def test_log_event_writes_the_line_the_structlog_chain_writes() -> None:
    lines = run(instance="gw-2")
    assert len(lines) == 4, lines  # the line below the level is not written
    chain, fast = without_timestamp(lines[0]), without_timestamp(lines[1])
    assert list(fast.items()) == list(chain.items())  # same fields, values and order
    assert fast["job_id"] == "job-from-extra" and fast["request_id"] == "req-1"
    assert fast["token"] == "[redacted]" and "abc.def" not in fast["note"]
    assert fast["unicode"] == "r\u00e9sum\u00e9 \u2713" and fast["nothing"] is None and fast["opaque"] == "<opaque>"
    assert (fast["component"], fast["instance"], fast["level"], fast["logger"]) == ("gateway", "gw-2", "info",
                                                                                    "herald.http")
    in_span_chain, in_span_fast = without_timestamp(lines[2]), without_timestamp(lines[3])
    assert list(in_span_fast.items()) == list(in_span_chain.items())
    assert len(in_span_fast["trace_id"]) == 32 and len(in_span_fast["span_id"]) == 16


def test_log_event_without_an_instance_and_in_console_format() -> None:
    chain, fast = (without_timestamp(line) for line in run()[:2])
    assert "instance" not in fast and list(fast.items()) == list(chain.items())
    console = run(log_format="console")
    assert len(console) == 4
    assert console[0].split(" ", 1)[1] == console[1].split(" ", 1)[1]  # past the timestamp: the same text
