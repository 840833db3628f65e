"""Job kinds for tests/test_kinds.py, found through HERALD_KINDS=tests.kinds_fixture:<NAME>.

The handlers live in tests/kinds_fixture_handlers.py, which logs every process that
imports it: a gateway never may.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from herald.kinds import KindDeclaration
from schemas import JobParams


class EchoParams(JobParams, kw_only=True):
    message: Annotated[str, msgspec.Meta(min_length=1, max_length=100)]
    sleep_ms: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = 0


ECHO = KindDeclaration(
    name="echo",
    params=EchoParams,
    collection="/echoes",
    handler="tests.kinds_fixture_handlers:echo",
    concurrency=1,
    example={"message": "hello"},
    description="Answers its message back as JSON (a test kind).",
)
ONE_ATTEMPT = KindDeclaration(name="once", params=EchoParams, collection="/once",
                              handler="tests.kinds_fixture_handlers:echo", max_attempts=1)
SAME_ECHO = ECHO  # the same declaration reached twice is one kind
CLASH_NAME = KindDeclaration(name="report", params=EchoParams, collection="/reports2",
                             handler="tests.kinds_fixture_handlers:echo")
CLASH_PATH = KindDeclaration(name="other", params=EchoParams, collection="/reports",
                             handler="tests.kinds_fixture_handlers:echo")
NO_HANDLER = KindDeclaration(name="orphan", params=EchoParams, collection="/orphans",
                             handler="tests.no_such_module:run")
SYNC_HANDLER = KindDeclaration(name="blocking", params=EchoParams, collection="/blocking",
                               handler="tests.kinds_fixture_handlers:not_async")
NOT_A_KIND = {"name": "echo"}


class EmitParams(JobParams, kw_only=True):
    """After ``sleep_ms``, ``count`` small chunks ``{"i", "attempt"}`` ``pause_ms`` apart, then
    one string chunk per entry of ``sizes`` whose JSON is exactly that many bytes, then a burst."""

    count: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = 0
    pause_ms: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = 0
    sizes: list[Annotated[int, msgspec.Meta(ge=2, le=1_000_000)]] = []
    nowait: bool = False  # emit_nowait instead of awaiting each chunk
    sleep_ms: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = 0
    # Last, after ``burst_after_ms``: ``burst`` small chunks ``{"i", "attempt"}`` at once (emit_nowait).
    burst_after_ms: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = 0
    burst: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = 0
    late: bool = False  # leave a task behind that emits once the job has ended (a handler's bug)
    # First attempt: after its ``count`` chunks, block the worker's loop this long (no heartbeat:
    # the job is re-queued), then emit one more. A later attempt waits as long before its chunks.
    stall_ms: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = 0


EMIT = KindDeclaration(
    name="emit",
    params=EmitParams,
    collection="/emits",
    handler="tests.output_handlers:emit",
    max_attempts=3,
    concurrency=4,
    example={"count": 3},
    description="Streams output chunks of given sizes (a test kind).",
)


class SizedParams(JobParams, kw_only=True):
    size: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)]


SIZED = KindDeclaration(
    name="sized",
    params=SizedParams,
    collection="/sized",
    handler="tests.kinds_fixture_handlers:sized",
    example={"size": 10},
    description="Returns a JSON result of about `size` bytes (a test kind).",
)


PARTIAL = KindDeclaration(
    name="partial",
    params=EchoParams,
    collection="/partials",
    handler="tests.kinds_fixture_handlers:partial",
    media_type="text/plain",
    suffix=".txt",
    concurrency=1,
    example={"message": "hello", "sleep_ms": 10},
    description="Writes its message to its result file, waits, then ends the file (a test kind).",
)
