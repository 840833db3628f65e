"""The bound on every SSE send: a client that cannot take an event in time is dropped, others are not.

The slow-reader test in test_streams.py fills the stream's queue first; this one drives the
streaming response directly with a send that never completes, so the send bound itself
(one watchdog timer per stream) is what ends the stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import REGISTRY

from gateway import sse
from herald.metrics import metrics


def _dropped() -> float:
    metrics()  # registers the process's metrics on first use
    return REGISTRY.get_sample_value("herald_sse_dropped_total", {"reason": "send_timeout"}) or 0.0


async def _chunks(n: int) -> AsyncIterator[bytes]:
    for i in range(n):
        yield b"data: %d\n\n" % i


async def _never_disconnects() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


async def test_a_send_that_does_not_complete_is_dropped_within_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sse, "SEND_TIMEOUT_S", 0.2)
    sent: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        if sent:
            await asyncio.Event().wait()  # the client stopped reading: the second send blocks
        sent.append(message["body"])

    before = _dropped()
    response = sse._BoundedStreamingResponse(iterator=_chunks(5), media_type="text/event-stream")
    started = time.monotonic()
    await asyncio.wait_for(response.send_body(send, _never_disconnects), timeout=5)  # type: ignore[arg-type]
    assert 0.2 <= time.monotonic() - started < 1.0, "dropped between 1 and 1.5 x the bound"
    assert sent == [b"data: 0\n\n"]
    assert _dropped() == before + 1


async def test_sends_that_complete_are_never_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sse, "SEND_TIMEOUT_S", 0.2)
    sent: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        await asyncio.sleep(0.05)  # slow, but each send well within the bound
        sent.append(message["body"])

    before = _dropped()
    response = sse._BoundedStreamingResponse(iterator=_chunks(10), media_type="text/event-stream")
    await asyncio.wait_for(response.send_body(send, _never_disconnects), timeout=5)  # type: ignore[arg-type]
    assert len(sent) == 11 and sent[-1] == b"", "every chunk, then the end of the body"
    assert _dropped() == before
