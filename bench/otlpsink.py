"""An OTLP/HTTP trace sink for ``python -m bench --tracing``: a process of its own that
answers every ``POST /v1/traces`` with 200 and counts the spans it was sent (decoded with
``opentelemetry-proto``), so Herald's processes export exactly as they would to a
collector. ``python -m bench.otlpsink PORT`` serves until SIGTERM, then prints its counts.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType

from bench.procs import free_port, listening, wait_until


class OtlpSink:
    """The sink as a child process; ``endpoint`` is what ``OTEL_EXPORTER_OTLP_ENDPOINT`` names."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> OtlpSink:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen([sys.executable, "-m", "bench.otlpsink", str(self.port)],
                                            stdout=out, stderr=out)
        wait_until(lambda: listening(self.port), timeout=15, what="OTLP sink listening")
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(10)

    def counts(self) -> dict[str, int]:
        """What it received (read from its last line, once it has stopped)."""
        for line in reversed(self.log.read_text().splitlines()):
            if line.startswith("{"):
                return dict(json.loads(line))
        return {}


def serve(port: int) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    counts = {"requests": 0, "spans": 0, "bytes": 0}
    lock = threading.Lock()
    answer = ExportTraceServiceResponse().SerializeToString()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            spans = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
            with lock:
                counts["requests"] += 1
                counts["spans"] += spans
                counts["bytes"] += len(body)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    server.serve_forever()
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
