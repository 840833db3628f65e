"""The bound on every SSE send: a client that cannot take an event in time is dropped, others are not;
and the tenant's held-stream slot is given back once, however a stream ends.

The slow-reader test in test_streams.py fills the stream's queue first; this one drives the
streaming response directly with a send that never completes, so the send bound itself
(one watchdog timer per stream) is what ends the stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from gateway import sse
from gateway.ratelimit import TenantLimits
from herald.directory import Directory, StreamOwner
from herald.metrics import metrics
from herald.settings import Settings
from herald.storage import build_storage
from herald.tenants import DirectorySnapshot, TenantRow
from tests.harness import SECRET_KEY


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


def _owned_by(tenant: str, *, disabled: bool, tmp_path: Path) -> tuple[StreamOwner, TenantLimits]:
    """A stream owner (a signed link of ``tenant``) and the held-stream count, over a real
    tenant directory that holds the tenant as given."""
    settings = Settings(data_dir=tmp_path, secret_keys=(SECRET_KEY,))
    storage = build_storage(settings)
    directory = Directory(settings, storage.tenants, storage.sealer)
    directory.install(DirectorySnapshot(version=1, tenants=[TenantRow(tenant, 0.0, disabled, {})], keys=[]))
    return StreamOwner(directory, tenant, None), TenantLimits(directory)


async def _answer(response: sse._BoundedStreamingResponse, send: Any = None) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def collect(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET"}
    await asyncio.wait_for(response(scope, _never_disconnects, send or collect), timeout=5)  # type: ignore[arg-type]
    return sent


@pytest.mark.parametrize("disabled", [True, False])
async def test_every_stream_gives_its_slot_back_once_however_it_ends(tmp_path: Path, disabled: bool) -> None:
    """The slot a route took for a stream (``max_streams``) is given back by the response, also
    when its body never starts: refused at its start because its owner no longer holds (a 401,
    never a 200 with an empty body, which EventSource retries), or a send that fails."""
    owner, limiter = _owned_by("t1", disabled=disabled, tmp_path=tmp_path)
    response = sse._BoundedStreamingResponse(iterator=_chunks(3), media_type="text/event-stream")
    response.owner, response.slot = owner, limiter.stream_slot("t1")
    assert limiter.held("t1") == 1
    sent = await _answer(response)
    assert limiter.held("t1") == 0, "given back"
    if disabled:
        assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
        assert sent[0]["status"] == 401 and (b"www-authenticate", b'Bearer realm="herald"') in sent[0]["headers"]
    else:
        assert sent[0]["status"] == 200 and [m["body"] for m in sent[1:]] == [b"data: 0\n\n", b"data: 1\n\n",
                                                                              b"data: 2\n\n", b""]
    other = limiter.stream_slot("t1")  # a second stream: its slot is its own
    other()
    other()
    assert limiter.held("t1") == 0, "a slot is given back once, however often it is called"

    async def broken(message: dict[str, Any]) -> None:
        raise OSError("the connection broke")

    response = sse._BoundedStreamingResponse(iterator=_chunks(3), media_type="text/event-stream")
    response.owner, response.slot = owner, limiter.stream_slot("t1")
    with pytest.raises(OSError):
        await _answer(response, broken)
    assert limiter.held("t1") == 0


async def test_a_disconnect_ends_the_stream_even_when_its_cancel_is_swallowed_on_the_way() -> None:
    """Python 3.11's ``asyncio.wait_for`` (nats-py's requests use it) returns the result when a
    cancel lands in the turn its answer arrives: the cancel is lost. A stream that lost the one
    cancel its client's disconnect sent went on waiting for events forever, holding its slot
    in max_streams (an output stream of a queued job, read from JetStream as its client left)."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[None] = loop.create_future()  # a NATS request's answer
    asking = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        yield b"retry: 3000\n\n"
        asking.set()
        await asyncio.wait_for(answer, 10)  # the cancel lands here, and is lost
        await asyncio.Event().wait()  # then it waits for the next event, as every stream does

    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await asking.wait()
        answer.set_result(None)  # the answer arrives in the same turn as the client leaves
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        pass

    response = sse._BoundedStreamingResponse(iterator=body(), media_type="text/event-stream")
    stream = asyncio.ensure_future(response.send_body(send, receive))  # type: ignore[arg-type]
    done, _ = await asyncio.wait({stream}, timeout=3)  # told again within RECANCEL_S (1 s)
    if not done:
        stream.cancel()
    assert done, "the stream went on after its client had left"
    await stream
    assert stream.cancelling() == 0, "every cancel of the stream's own is taken back"


async def test_a_revoked_stream_whose_reader_stopped_reading_is_dropped_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream its tenant's disabling ends sends the end of its body, and that send is bounded
    as every other: a reader that stopped reading held it (its task, its socket, its slot in
    max_streams) for ever."""
    monkeypatch.setattr(sse, "SEND_TIMEOUT_S", 0.2)
    owner, limiter = _owned_by("t1", disabled=False, tmp_path=tmp_path)
    stuck = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message["body"]:
            stuck.set()
        if stuck.is_set() and not message["body"]:
            await asyncio.Event().wait()  # the reader stopped reading: the end of the body never goes

    async def body() -> AsyncIterator[bytes]:
        yield b"retry: 3000\n\n"
        await asyncio.Event().wait()  # no events

    before = _dropped()
    response = sse._BoundedStreamingResponse(iterator=body(), media_type="text/event-stream")
    response.owner, response.slot = owner, limiter.stream_slot("t1")
    answering = asyncio.ensure_future(_answer(response, send))
    await asyncio.wait_for(stuck.wait(), 5)
    owner.directory.install(DirectorySnapshot(version=2, tenants=[TenantRow("t1", 0.0, True, {})], keys=[]))
    done, _ = await asyncio.wait((answering,), timeout=3)
    if not done:
        answering.cancel()
    assert done, "the revoked stream ended though its reader never took the end of its body"
    await answering
    assert limiter.held("t1") == 0
    assert _dropped() == before + 1
