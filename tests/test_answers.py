"""Long polls woken by one change share one store read and one answer (gateway/answers.py), on a real SQLite store."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bench.driver import new_job, step
from gateway.answers import WokenAnswers, status_answer
from herald.jobs import JobRow
from herald.settings import Settings
from herald.signing import UrlSigner
from herald.storage import build_storage
from herald.storage.ports import JobStore
from launcher.pgserver import PostgresServer
from tests.harness import SECRET_KEY, new_database


@pytest.fixture
async def jobs(tmp_path: Path, store_server: PostgresServer | None) -> AsyncIterator[JobStore]:
    """The job store of each backend (a fresh database on the session's PostgreSQL server)."""
    url = new_database(store_server) if store_server is not None else None
    jobs = build_storage(Settings(data_dir=tmp_path, database_url=url, secret_keys=(SECRET_KEY,))).jobs
    await jobs.open()
    try:
        yield jobs
    finally:
        await jobs.close()


def _count_reads(store: JobStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    reads: list[str] = []
    real_get = store.get

    async def get(job_id: str) -> JobRow | None:
        reads.append(job_id)
        return await real_get(job_id)

    monkeypatch.setattr(store, "get", get)
    return reads


async def test_the_polls_one_change_wakes_share_one_read_and_one_answer(
        jobs: JobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    store = jobs
    signer = UrlSigner((b"k" * 32,), 900)
    job_id = (await store.accept(new_job("acme"))).job.id
    moved = (await store.transition(job_id, step(1))).after
    reads = _count_reads(store, monkeypatch)
    # One signing second for all of them: a poll answered in the next second gets a new
    # answer by design (the test below), which a slow machine could otherwise cross into.
    frozen = moved.updated_at + 0.5
    monkeypatch.setattr("gateway.answers.time.time", lambda: frozen)
    answers = WokenAnswers()
    got = await asyncio.gather(*(answers.answer(store, signer, job_id, moved.version) for _ in range(200)))
    assert len(reads) == 1, "one read for every poll the change woke"
    assert all(answer is got[0] for answer in got), "one answer, encoded once"
    single = status_answer(moved, signer)
    assert got[0] is not None and (got[0].status_code, got[0].headers, got[0].body) == (
        single.status_code, single.headers, single.body) or got[0].expiry != single.expiry

    # The next change: an answer older than the change that woke a poll is never used.
    moved = (await store.transition(job_id, step(2))).after
    again = await answers.answer(store, signer, job_id, moved.version)
    assert len(reads) == 2 and again is not None and again.job.version == moved.version
    # A poll woken without a known version (a NATS reconnect) always reads afresh.
    assert (await answers.answer(store, signer, job_id, -1)) is not None and len(reads) == 3


async def test_a_new_signing_second_or_retry_after_builds_a_new_answer(
        jobs: JobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    store = jobs
    signer = UrlSigner((b"k" * 32,), 900)
    job_id = (await store.accept(new_job("acme"))).job.id
    moved = (await store.transition(job_id, step(1))).after
    answers = WokenAnswers()
    first = await answers.answer(store, signer, job_id, moved.version)
    clock = [moved.created_at + 31.0]  # a later second, and a Retry-After one step longer
    monkeypatch.setattr("gateway.answers.time.time", lambda: clock[0])
    later = await answers.answer(store, signer, job_id, moved.version)
    assert first is not None and later is not None and later is not first
    assert later.expiry == int(clock[0] + 900) and later.headers["Retry-After"] == "2"
    assert later.body == status_answer(moved, signer, clock[0]).body


async def test_a_job_gone_meanwhile_gives_no_answer(jobs: JobStore) -> None:
    store = jobs
    answers = WokenAnswers()
    assert await answers.answer(store, UrlSigner((b"k" * 32,), 900), "00000000-0000-4000-8000-000000000000", 3) is None
