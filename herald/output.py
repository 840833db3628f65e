"""A job's streamed output in JetStream (SPEC §8): reading chunks back, and purging them.

Chunks live in ``HERALD_OUTPUT`` on ``output.<tenant token>.<job>``, numbered 1, 2, 3… by
the ``Herald-Chunk`` header (``workers/output.py`` writes them). Readers order and
de-duplicate by that number, never by stream position: a chunk republished after a lost
ack may be stored twice (past the duplicate window) and must be shown once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import NamedTuple

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from herald.constants import CHUNK_HEADER, OUTPUT_BYTES_HEADER, OUTPUT_STREAM, output_subject

REPLAY_IDLE_S = 5.0  # a replay that gets nothing for this long (NATS gone) fails; the reader retries
# A run's writer publishes at most this many chunks before all of them are stored, so no more
# than this many can be stored past a gap that a resend will still fill (workers/output.py).
MAX_UNSTORED = 256

# What reading output raises while NATS does not answer (down, or hung: a request times out
# after the JetStream context's timeout, a replay after REPLAY_IDLE_S).
UNREACHABLE: tuple[type[Exception], ...] = (TimeoutError, nats.errors.Error)


class Chunk(NamedTuple):
    n: int  # its number in the job's output
    seq: int  # its position in the stream (to resume a replay)
    data: bytes  # the chunk's JSON


class OutputMark(NamedTuple):
    """Where a job's output stands: its last chunk's number, the bytes so far, and the
    stream position of that chunk (0, 0, 0: nothing emitted)."""

    n: int
    total_bytes: int
    seq: int


def chunk_number(headers: dict[str, str] | None) -> int | None:
    raw = (headers or {}).get(CHUNK_HEADER)
    return int(raw) if raw is not None and raw.isdigit() else None


async def last_mark(js: JetStreamContext, tenant: str, job_id: str) -> OutputMark:
    """The job's last stored chunk (one direct get by subject)."""
    try:
        message = await js.get_last_msg(OUTPUT_STREAM, output_subject(tenant, job_id), direct=True)
    except NotFoundError:
        return OutputMark(0, 0, 0)
    headers = message.headers or {}
    n = chunk_number(headers) or 0
    raw_bytes = headers.get(OUTPUT_BYTES_HEADER, "0")
    return OutputMark(n, int(raw_bytes) if raw_bytes.isdigit() else 0, message.seq or 0)


async def replay(js: JetStreamContext, tenant: str, job_id: str, after_seq: int, upto_seq: int) -> AsyncIterator[Chunk]:
    """The job's stored chunks at stream positions ``after_seq`` < seq <= ``upto_seq``, in stream
    order, through one ordered consumer (flow-controlled, nothing acked, gone when done)."""
    if upto_seq <= after_seq:
        return
    subject = output_subject(tenant, job_id)
    config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=after_seq + 1,
                            inactive_threshold=30.0)
    sub = await js.subscribe(subject, stream=OUTPUT_STREAM, ordered_consumer=True, config=config)
    try:
        while True:
            message: Msg = await sub.next_msg(timeout=REPLAY_IDLE_S)
            seq = message.metadata.sequence.stream
            n = chunk_number(message.headers)
            if n is not None and seq > after_seq:
                yield Chunk(n, seq, message.data)
            if seq >= upto_seq or message.metadata.num_pending == 0:
                return
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def purge(js: JetStreamContext, tenant: str, job_id: str) -> None:
    """Remove every chunk of the job (retention: it goes with the job)."""
    await js.purge_stream(OUTPUT_STREAM, subject=output_subject(tenant, job_id))


async def purge_with_retry(js: JetStreamContext, tenant: str, job_id: str, attempts: int = 3) -> None:
    for attempt in range(attempts):
        try:
            await purge(js, tenant, job_id)
            return
        except NotFoundError:
            return
        except Exception:
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(0.2)
