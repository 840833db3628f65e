"""A work message whose job has nothing left to run is acknowledged and runs nothing (SPEC §9):
a redelivery after the job ended, a message of a job that no longer exists, and one on an
older Herald's subject (``jobs.<kind>``, which names no tenant)."""

from __future__ import annotations

import asyncio

import msgspec
import nats
import pytest

from herald.constants import JOBS_STREAM, MSG_ID_HEADER, job_subject
from schemas import JobMessage
from tests.harness import Deployment, client, stream_state, wait_for_state, wait_until

pytestmark = pytest.mark.slow


def publish(nats_url: str, messages: list[tuple[str, JobMessage]]) -> None:
    async def send() -> None:
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            for n, (subject, message) in enumerate(messages):
                await js.publish(subject, msgspec.msgpack.encode(message),
                                 headers={MSG_ID_HEADER: f"test-again-{message.job_id}-{n}"})
        finally:
            await nc.close()

    asyncio.run(send())


def test_messages_of_ended_or_missing_jobs_are_acked_without_running(fresh: Deployment) -> None:
    base = fresh.start_gateway()
    fresh.start_worker()
    with client(base) as http:
        job = http.post("/reports", json={"title": "once", "pages": 1}).json()
        done = wait_for_state(http, job["id"], {"succeeded"})
        publish(fresh.nats.url, [
            (job_subject("report", "acme"), JobMessage(job_id=done["id"], kind="report", attempt=1)),
            (job_subject("report", "acme"), JobMessage(job_id="01NOSUCHJOB0000000000000000", kind="report", attempt=1)),
            (job_subject("report"), JobMessage(job_id=done["id"], kind="report", attempt=1)),
        ])
        # Acknowledged: the work queue holds nothing any more; the job did not move (a claim
        # would have made a new version and attempt).
        wait_until(lambda: stream_state(fresh.nats.url, JOBS_STREAM).messages == 0, what="every message acked")
        again = http.get(f"/jobs/{done['id']}").json()
        assert (again["state"], again["version"], again["attempt"]) == ("succeeded", done["version"], 1)
        # The slots those messages took are free again: a new job runs.
        assert wait_for_state(http, http.post("/reports", json={"title": "next", "pages": 1}).json()["id"],
                              {"succeeded"})["attempt"] == 1
