"""Idempotency-Key: retries converge on one job (SPEC §3)."""

from __future__ import annotations

import asyncio
import uuid

import httpx

from herald.constants import JOBS_STREAM
from tests.harness import KEYS, Deployment, client, stream_state, wait_until

BODY = {"title": "Q3", "pages": 2}


def test_replay_returns_the_same_job_and_queues_nothing_new(fresh: Deployment) -> None:
    base = fresh.start_gateway()  # no worker: every published work message stays in the stream
    key = str(uuid.uuid4())
    with client(base) as http:
        first = http.post("/reports", json=BODY, headers={"Idempotency-Key": key})
        assert first.status_code == 202 and "idempotent-replayed" not in first.headers
        wait_until(lambda: stream_state(fresh.nats.url, JOBS_STREAM).messages == 1, what="job published")
        # Same request, keys in another order and other whitespace: the same fingerprint.
        again = http.post("/reports", content=b'{ "pages": 2,\n "title": "Q3" }',
                          headers={"Idempotency-Key": key, "Content-Type": "application/json"})
        assert again.status_code == 202
        assert again.headers["idempotent-replayed"] == "true"
        assert again.headers["location"] == first.headers["location"]
        assert again.json()["id"] == first.json()["id"]
        assert len(http.get("/jobs").json()["items"]) == 1
        state = stream_state(fresh.nats.url, JOBS_STREAM)
        assert state.messages == 1 and state.last_seq == 1, "nothing was queued twice"
        # The replay shows the current status, not a copy of the first answer.
        http.delete(first.headers["location"])
        replay = http.post("/reports", json=BODY, headers={"Idempotency-Key": key})
        assert replay.json()["state"] == "cancelled"


def test_fifty_concurrent_identical_requests_make_one_job(fresh: Deployment) -> None:
    base = fresh.start_gateway()
    key = str(uuid.uuid4())

    async def storm() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {KEYS['acme']}"},
                                     timeout=30, limits=httpx.Limits(max_connections=50)) as http:
            return await asyncio.gather(*(http.post("/reports", json=BODY, headers={"Idempotency-Key": key})
                                          for _ in range(50)))

    answers = asyncio.run(storm())
    assert {a.status_code for a in answers} <= {202, 409}
    ids = {a.json()["id"] for a in answers if a.status_code == 202}
    assert len(ids) == 1
    with client(base) as http:
        assert [j["id"] for j in http.get("/jobs").json()["items"]] == list(ids)
    wait_until(lambda: stream_state(fresh.nats.url, JOBS_STREAM).messages == 1, what="one message")
    assert stream_state(fresh.nats.url, JOBS_STREAM).last_seq == 1


def test_key_reuse_with_another_request_is_422(herald: Deployment) -> None:
    key = str(uuid.uuid4())
    with client(herald.url()) as http:
        assert http.post("/reports", json=BODY, headers={"Idempotency-Key": key}).status_code == 202
        other_body = http.post("/reports", json={"title": "Q4", "pages": 2}, headers={"Idempotency-Key": key})
        assert other_body.status_code == 422
        assert other_body.json()["type"] == "/problems/idempotency-key-mismatch"
        other_path = http.post("/exports", json={"format": "csv", "rows": 2}, headers={"Idempotency-Key": key})
        assert other_path.status_code == 422


def test_keys_are_scoped_per_tenant(herald: Deployment) -> None:
    key = str(uuid.uuid4())
    with client(herald.url(), "acme") as acme, client(herald.url(), "globex") as globex:
        a = acme.post("/reports", json=BODY, headers={"Idempotency-Key": key}).json()
        b = globex.post("/reports", json=BODY, headers={"Idempotency-Key": key}).json()
        assert a["id"] != b["id"]
        assert globex.get(f"/jobs/{a['id']}").status_code == 404


def test_bad_keys_are_400_and_create_nothing(herald: Deployment) -> None:
    with client(herald.url(), "globex") as http:
        before = [job["id"] for job in http.get("/jobs", params={"limit": 100}).json()["items"]]
        for bad in ("", "x" * 256, "tab\there", "é"):
            response = http.post("/reports", json=BODY, headers={"Idempotency-Key": bad.encode("utf-8")})
            assert response.status_code == 400, bad
            assert response.json()["type"] == "/problems/invalid-idempotency-key"
        assert [job["id"] for job in http.get("/jobs", params={"limit": 100}).json()["items"]] == before


def test_two_keys_on_one_request_are_400_and_spend_neither(herald: Deployment) -> None:
    """Which of two Idempotency-Key headers the client meant cannot be told: the first was
    taken, so a retry that sent only the second started the same work again."""
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    with client(herald.url(), "globex") as http:
        before = [job["id"] for job in http.get("/jobs", params={"limit": 100}).json()["items"]]
        both = http.post("/reports", json=BODY, headers=httpx.Headers([("Idempotency-Key", first),
                                                                        ("Idempotency-Key", second)]))
        assert both.status_code == 400, both.text
        assert both.json()["type"] == "/problems/invalid-idempotency-key"
        assert [job["id"] for job in http.get("/jobs", params={"limit": 100}).json()["items"]] == before
        for key in (first, second):  # neither was stored: each starts a job of its own now
            started = http.post("/reports", json=BODY, headers={"Idempotency-Key": key})
            assert started.status_code == 202 and "idempotent-replayed" not in started.headers


def test_required_keys_and_expiry(fresh: Deployment) -> None:
    base = fresh.start_gateway(HERALD_REQUIRE_IDEMPOTENCY_KEY="1", HERALD_RETENTION_S="1")
    key = str(uuid.uuid4())
    with client(base) as http:
        missing = http.post("/reports", json=BODY)
        assert missing.status_code == 400 and missing.json()["type"] == "/problems/idempotency-key-required"
        first = http.post("/reports", json=BODY, headers={"Idempotency-Key": key}).json()
        # The key lives HERALD_RETENTION_S (1 s) after creation; after that it starts a new job.
        second = wait_until(
            lambda: (r := http.post("/reports", json=BODY, headers={"Idempotency-Key": key})).json()["id"] != first["id"] and r,
            timeout=10, interval=0.2, what="key expiry")
        assert "idempotent-replayed" not in second.headers
        assert http.get(f"/jobs/{first['id']}").status_code == 200, "the first job itself lives on"
