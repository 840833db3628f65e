"""Streamed output (SPEC §8 "Streamed output", issue 22), on real processes and both stores:
``ctx.emit`` into JetStream, ``GET /jobs/{id}/output`` as SSE and NDJSON, resuming, limits,
re-run attempts, retention and the client's iterator."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from httpx_sse import connect_sse
from nats.js.errors import NotFoundError

from herald.constants import CHUNK_HEADER, OUTPUT_BYTES_HEADER, OUTPUT_STREAM, output_subject
from launcher.pgserver import PostgresServer
from tests.harness import KEYS, Deployment, client, dispatched_events, new_database, wait_for_state, wait_until

EMIT_KIND = "tests.kinds_fixture:EMIT"
MAX_BYTES = 200_000  # HERALD_OUTPUT_MAX_BYTES of the module's deployment
SSE = {"Accept": "text/event-stream"}


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory, store_server: PostgresServer | None) -> Iterator[Deployment]:
    """A deployment (nats-server, gateway, worker) serving the test kind that emits output."""
    deployment = Deployment(tmp_path_factory.mktemp("output"),
                            database_url=new_database(store_server) if store_server is not None else None,
                            env_overrides={"HERALD_KINDS": EMIT_KIND, "HERALD_OUTPUT_MAX_BYTES": str(MAX_BYTES)})
    deployment.nats.start()
    try:
        deployment.start_gateway()
        deployment.start_worker()
        yield deployment
    finally:
        deployment.stop()


def read_output(http: httpx.Client, path: str, headers: dict[str, str] | None = None,
                stop_after: int | None = None) -> tuple[list[tuple[int, Any]], tuple[str, dict[str, Any]] | None]:
    """The chunks ``(n, data)`` of an SSE output stream, and its closing event (type, status) if it came."""
    chunks: list[tuple[int, Any]] = []
    with connect_sse(http, "GET", path, headers={**SSE, **(headers or {})}, timeout=60) as source:
        assert source.response.status_code == 200, source.response.read()
        assert source.response.headers["content-type"].startswith("text/event-stream")
        for sse in dispatched_events(source):
            if sse.event != "output":
                return chunks, (sse.event, json.loads(sse.data))
            chunks.append((int(sse.id), json.loads(sse.data)))
            if stop_after is not None and len(chunks) >= stop_after:
                break  # drops the connection
    return chunks, None


def ndjson(http: httpx.Client, job_id: str, after: int | None = None) -> list[dict[str, Any]]:
    response = http.get(f"/jobs/{job_id}/output", params={"after": after} if after is not None else None)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in response.text.splitlines()]


def test_read_ten_drop_resume_every_chunk_once_in_order_then_terminal(out: Deployment) -> None:
    with client(out.url()) as http:
        job = http.post("/emits", json={"count": 40, "pause_ms": 25}).json()
        first, ended = read_output(http, f"/jobs/{job['id']}/output", stop_after=10)
        assert ended is None and [n for n, _ in first] == list(range(1, 11))
        assert http.get(f"/jobs/{job['id']}").json()["state"] == "running", "the first ten were read live"
        rest, ended = read_output(http, f"/jobs/{job['id']}/output", headers={"Last-Event-ID": "10"})
    assert [n for n, _ in rest] == list(range(11, 41)), "every later chunk once, in order"
    assert [data["i"] for _, data in first + rest] == list(range(1, 41))
    assert ended is not None and ended[0] == "job.succeeded" and ended[1]["state"] == "succeeded"


def test_report_kind_emits_its_pages_and_ndjson_pages_with_after(out: Deployment) -> None:
    with client(out.url()) as http:
        job = http.post("/reports", json={"title": "out", "pages": 6}).json()
        chunks, ended = read_output(http, f"/jobs/{job['id']}/output")
        assert [data for _, data in chunks] == [{"page": p, "pages": 6} for p in range(1, 7)]
        assert ended is not None and ended[0] == "job.succeeded"
        assert ndjson(http, job["id"]) == [{"n": p, "data": {"page": p, "pages": 6}} for p in range(1, 7)]
        assert [line["n"] for line in ndjson(http, job["id"], after=4)] == [5, 6]
        assert ndjson(http, job["id"], after=6) == []
        bad = http.get(f"/jobs/{job['id']}/output", params={"after": "x²"})
        assert bad.status_code == 400 and bad.headers["content-type"].startswith("application/problem+json")
        assert "after" in bad.text


def test_signed_link_opens_without_a_key_and_a_tampered_one_is_refused(out: Deployment) -> None:
    with client(out.url()) as http:
        job = http.post("/emits", json={"count": 5}).json()
        link = http.get(f"/jobs/{job['id']}").json()["links"]["output"]
    assert link.startswith(f"/jobs/{job['id']}/output?exp=")
    with httpx.Client(base_url=out.url(), timeout=30) as anonymous:
        chunks, ended = read_output(anonymous, link)
        assert [n for n, _ in chunks] == [1, 2, 3, 4, 5] and ended is not None
        assert anonymous.get(link.replace("sig=", "sig=A")).status_code == 403
        assert anonymous.get(f"/jobs/{job['id']}/output").status_code == 401


def test_finished_job_resumed_at_its_last_chunk_gets_204(out: Deployment) -> None:
    with client(out.url()) as http:
        job = http.post("/emits", json={"count": 3}).json()
        wait_for_state(http, job["id"], {"succeeded"})
        assert http.get(f"/jobs/{job['id']}/output", headers={**SSE, "Last-Event-ID": "3"}).status_code == 204
        assert http.get(f"/jobs/{job['id']}/output?last_event_id=3", headers=SSE).status_code == 204
        # The header wins over the query (a browser keeps the query on every reconnect).
        chunks, ended = read_output(http, f"/jobs/{job['id']}/output?last_event_id=3", headers={"Last-Event-ID": "1"})
        assert [n for n, _ in chunks] == [2, 3] and ended is not None and ended[0] == "job.succeeded"
        # Two resume points: which is meant cannot be told (the first was read: 204, the stream's end).
        twice = http.get(f"/jobs/{job['id']}/output", headers=httpx.Headers([*SSE.items(), ("Last-Event-ID", "3"),
                                                                             ("Last-Event-ID", "1")]))
        assert twice.status_code == 400, twice.text
        assert [e["field"] for e in twice.json()["errors"]] == ["Last-Event-ID"]


def _eventsource(http: httpx.Client, url: str) -> tuple[list[tuple[str, str]], int]:
    """What a browser's EventSource does with ``url``: read the stream to its end, then
    reconnect, with Last-Event-ID only if an event carried an id. The events (type, id) of
    the first connection, and the status of the reconnect (any but 200 stops EventSource)."""
    seen: list[tuple[str, str]] = []
    last_id = ""
    with connect_sse(http, "GET", url, headers=SSE, timeout=60) as source:
        assert source.response.status_code == 200
        for sse in dispatched_events(source):
            last_id = sse.id
            seen.append((sse.event, sse.id))
    again = http.get(url, headers={**SSE, **({"Last-Event-ID": last_id} if last_id else {})})
    return seen, again.status_code


def test_eventsource_stops_once_the_job_has_ended_with_or_without_chunks(out: Deployment) -> None:
    """SPEC §8: a stream whose resume point is already its end gets 204, which stops
    EventSource. The terminal event's id is the last chunk's number, 0 when there was none:
    an id-less terminal event left a job without chunks with no Last-Event-ID, so the
    browser reconnected without one, was sent the whole stream again, and so on for ever."""
    with client(out.url()) as http:
        ended = http.post("/emits", json={"count": 0}).json()
        with_chunks = http.post("/emits", json={"count": 2}).json()
        for job in (ended, with_chunks):
            wait_for_state(http, job["id"], {"succeeded"})
        running = http.post("/emits", json={"count": 0, "sleep_ms": 2000}).json()  # ends while streamed
        wait_for_state(http, running["id"], {"running"})
        links = {name: http.get(f"/jobs/{job['id']}").json()["links"]["output"]
                 for name, job in (("running", running), ("ended", ended), ("with chunks", with_chunks))}
    with httpx.Client(base_url=out.url(), timeout=30) as browser:  # the signed links, as a page uses them
        seen, again = _eventsource(browser, links["running"])
        assert seen == [("job.succeeded", "0")] and again == 204
        seen, again = _eventsource(browser, links["ended"])
        assert seen == [("job.succeeded", "0")] and again == 204
        seen, again = _eventsource(browser, links["with chunks"])
        assert seen == [("output", "1"), ("output", "2"), ("job.succeeded", "2")] and again == 204


def test_chunk_limit_at_its_edge_raises_in_the_handler(out: Deployment) -> None:
    with client(out.url()) as http:
        job = http.post("/emits", json={"sizes": [65536, 65537]}).json()
        done = wait_for_state(http, job["id"], {"succeeded", "failed"})
        assert done["state"] == "succeeded"
        assert http.get(done["result"]).json() == {"refused": [65537]}, "64 KiB passes, one byte more raises"
        lines = ndjson(http, job["id"])
        assert [line["n"] for line in lines] == [1] and len(json.dumps(lines[0]["data"])) == 65536


def test_job_limit_at_its_edge_fails_output_too_large(out: Deployment) -> None:
    exact = [65536, 65536, 65536, MAX_BYTES - 3 * 65536]
    with client(out.url()) as http:
        fits = http.post("/emits", json={"sizes": exact}).json()
        over = http.post("/emits", json={"sizes": [*exact[:-1], exact[-1] + 1]}).json()
        assert wait_for_state(http, fits["id"], {"succeeded", "failed"})["state"] == "succeeded"
        failed = wait_for_state(http, over["id"], {"succeeded", "failed"})
        assert failed["state"] == "failed" and failed["error"]["type"] == "/problems/output-too-large"
        assert [line["n"] for line in ndjson(http, fits["id"])] == [1, 2, 3, 4]
        assert [line["n"] for line in ndjson(http, over["id"])] == [1, 2, 3], "what was stored is kept"


def test_an_emit_after_the_run_has_ended_raises_and_stores_nothing(out: Deployment) -> None:
    """A task the handler left behind emitted after the job's end was recorded: the chunk
    was stored after the terminal event, so the SSE stream (which ends there) never showed
    it while NDJSON did. Once the handler has returned, ``emit`` raises."""
    with client(out.url()) as http:
        job = http.post("/emits", json={"count": 2, "late": True}).json()
        wait_for_state(http, job["id"], {"succeeded"})
        wait_until(lambda: out.logged("worker", "late emit refused", job_id=job["id"])
                   or out.logged("worker", "late emit stored", job_id=job["id"]), what="the late emit")
        assert out.logged("worker", "late emit refused", job_id=job["id"])
        assert [line["n"] for line in ndjson(http, job["id"])] == [1, 2]


def test_another_tenants_job_is_404(out: Deployment) -> None:
    with client(out.url()) as http:
        job = http.post("/emits", json={"count": 1}).json()
    with client(out.url(), "globex") as other:
        assert other.get(f"/jobs/{job['id']}/output").status_code == 404
        assert other.get(f"/jobs/{job['id']}/output", headers=SSE).status_code == 404


def test_a_rerun_attempt_continues_the_numbering(out: Deployment) -> None:
    with client(out.url()) as http:
        job = http.post("/emits", json={"count": 60, "pause_ms": 50}).json()
        wait_until(lambda: len(ndjson(http, job["id"])) >= 5, timeout=30, what="first chunks")
        out.kill("worker")  # kill -9, mid-job
        kept = ndjson(http, job["id"])
        out.start_worker()
        done = wait_for_state(http, job["id"], {"succeeded", "failed"}, timeout=90)
        assert done["state"] == "succeeded" and done["attempt"] == 2
        lines = ndjson(http, job["id"])
    assert [line["n"] for line in lines] == list(range(1, len(lines) + 1)), "numbered 1, 2, 3… once each"
    assert lines[:len(kept)] == kept, "the first attempt's chunks are never renumbered"
    first = [line for line in lines if line["data"]["attempt"] == 1]
    second = [line for line in lines if line["data"]["attempt"] == 2]
    assert lines == first + second and [line["data"]["i"] for line in first] == list(range(1, len(first) + 1))
    assert [line["data"]["i"] for line in second] == list(range(1, 61)), "the second attempt starts after the kept ones"


def test_a_run_that_lost_its_job_emits_nothing_into_the_rerun(fresh: Deployment) -> None:
    """A handler blocked its worker's loop past the heartbeat timeout, so the job was re-queued;
    woken, it went on emitting before its heartbeat learned the job had moved on, and its
    chunk was numbered into the re-run's output (or, had the re-run numbered that chunk
    first, it took the number and the re-run's chunk was dropped as a duplicate). A run whose
    heartbeat is overdue asks the store whether the job is still its own before it publishes."""
    fresh.env_overrides.update(HERALD_KINDS=EMIT_KIND)
    base = fresh.start_gateway()
    fresh.start_worker()
    with client(base) as http:
        job = http.post("/emits", json={"count": 2, "stall_ms": 4000}).json()
        done = wait_for_state(http, job["id"], {"succeeded", "failed"})
        lines = ndjson(http, job["id"])
    assert done["state"] == "succeeded" and done["attempt"] == 2
    assert [(line["n"], line["data"]["attempt"]) for line in lines] == [(1, 1), (2, 1), (3, 2), (4, 2)]


def test_client_iterator_resumes_after_the_gateway_is_killed(out: Deployment) -> None:
    from herald_client import HeraldClient

    with client(out.url()) as http:
        job = http.post("/emits", json={"count": 50, "pause_ms": 60, "nowait": True}).json()
    seen: list[int] = []
    with HeraldClient(out.url(), KEYS["acme"]) as herald:
        for chunk in herald.output(job["id"]):
            assert chunk.data["i"] == chunk.n
            seen.append(chunk.n)
            if len(seen) == 10:  # kill -9 the gateway mid-stream; the iterator reconnects by itself
                port = out.ports["gateway"]
                out.kill("gateway")
                out.start_gateway(port=port)
        assert herald.status(job["id"]).state == "succeeded"
    assert seen == list(range(1, 51)), "nothing missed, nothing twice"


def test_async_client_iterator(out: Deployment) -> None:
    from herald_client import AsyncHeraldClient

    async def run() -> list[int]:
        async with AsyncHeraldClient(out.url(), KEYS["acme"]) as herald:
            job = await herald.submit("emit", {"count": 12, "pause_ms": 10})
            return [chunk.n async for chunk in herald.output(job)]

    assert asyncio.run(run()) == list(range(1, 13))


def test_a_reader_catching_up_is_not_dropped_for_the_live_chunks_that_come_meanwhile(fresh: Deployment) -> None:
    """A stream replays what JetStream keeps, then follows the hub; what the hub hears
    meanwhile waits in the stream's queue (256 events). A reader catching up a backlog that
    its socket takes a while to carry (9 MB here) while the job emits 600 more chunks was
    dropped as a slow reader, its connection reset, though it never stopped reading: an
    EventSource, 3 s further behind on each reconnect, then never caught up with a fast job.
    What did not fit is read from JetStream once the replay is done."""
    fresh.env_overrides.update(HERALD_KINDS=EMIT_KIND)
    base = fresh.start_gateway()
    fresh.start_worker()
    big, burst = 150, 600
    with client(base) as http:
        job = http.post("/emits", json={"sizes": [60_000] * big, "burst": burst, "burst_after_ms": 2500}).json()
        wait_until(lambda: ndjson(http, job["id"], after=big - 1), timeout=30, interval=0.1, what="the backlog stored")
        narrow = httpx.HTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)])
        with httpx.Client(base_url=base, headers=http.headers, transport=narrow, timeout=60) as reader, \
                connect_sse(reader, "GET", f"/jobs/{job['id']}/output", headers=SSE) as source:
            events = dispatched_events(source)
            seen = [int(next(events).id)]
            # The reader holds back (the gateway's send blocks, well within the send bound)
            # while the burst is stored and heard live, then reads on.
            wait_for_state(http, job["id"], {"succeeded"})
            ended = None
            for sse in events:
                if sse.event != "output":
                    ended = sse.event
                    break
                seen.append(int(sse.id))
    assert seen == list(range(1, big + burst + 1)), "every chunk once, in order, on one connection"
    assert ended == "job.succeeded"
    assert not fresh.logged("gateway", "slow SSE client dropped")


def _store_chunk(nats_url: str, tenant: str, job_id: str, *numbers: int) -> None:
    """Store these chunks of a job as its run's writer does (what a resend stores after a partial failure)."""
    async def publish() -> None:
        nc = await nats.connect(nats_url)
        try:
            for n in numbers:
                await nc.jetstream().publish(output_subject(tenant, job_id), json.dumps({"i": n}).encode(),
                                             headers={CHUNK_HEADER: str(n), OUTPUT_BYTES_HEADER: str(10 * n)})
        finally:
            await nc.close()

    asyncio.run(publish())


def test_a_chunk_stored_after_the_next_one_is_still_read_in_order(fresh: Deployment) -> None:
    """A writer resends from its first unacknowledged chunk, so after a partial failure (a
    stream leader failing over mid-batch) chunk 3 can be stored before chunk 2. A stream
    replaying then sent the 3 it held at the end of its replay, and the 2 stored next was
    taken for a copy: never sent. NDJSON, likewise, answered 1 and 3, and ``after=3`` then.
    Until the job has ended, a chunk past a gap waits for the ones before it."""
    fresh.env_overrides.update(HERALD_KINDS=EMIT_KIND)
    base = fresh.start_gateway()
    fresh.start_worker()
    with client(base) as http:
        job = http.post("/emits", json={"sleep_ms": 3000}).json()  # running, emitting nothing itself
        wait_for_state(http, job["id"], {"running"})
        for n in (1, 3):
            _store_chunk(fresh.nats.url, "acme", job["id"], n)
        assert [line["n"] for line in ndjson(http, job["id"])] == [1], "3 waits for 2"
        with connect_sse(http, "GET", f"/jobs/{job['id']}/output", headers=SSE, timeout=30) as source:
            events = dispatched_events(source)
            seen = [int(next(events).id)]  # 1: the stream has read where the output stands
            _store_chunk(fresh.nats.url, "acme", job["id"], 2)
            for sse in events:
                if sse.event != "output":
                    assert sse.event == "job.succeeded" and sse.id == "3"
                    break
                seen.append(int(sse.id))
        assert seen == [1, 2, 3]
        assert [line["n"] for line in ndjson(http, job["id"])] == [1, 2, 3]


def test_a_gap_no_resend_can_fill_is_passed_once_a_batch_lies_beyond_it(out: Deployment) -> None:
    """A writer has at most 256 chunks out before all are stored, so with 256 stored past a
    gap, the gap is for good (its run is gone, and the re-run numbered after it): a running
    job's output is not held back behind it until the job ends."""
    with client(out.url()) as http:
        job = http.post("/emits", json={"sleep_ms": 3000}).json()  # running, emitting nothing itself
        wait_for_state(http, job["id"], {"running"})
        _store_chunk(out.nats.url, "acme", job["id"], 1, *range(3, 258))
        assert [line["n"] for line in ndjson(http, job["id"])] == [1], "255 past the gap: it may still be filled"
        _store_chunk(out.nats.url, "acme", job["id"], 258)
        assert [line["n"] for line in ndjson(http, job["id"])] == [1, *range(3, 259)]
        chunks, _ = read_output(http, f"/jobs/{job['id']}/output", stop_after=257)
        assert [n for n, _ in chunks] == [1, *range(3, 259)]


def _chunks_kept(nats_url: str, tenant: str, job_id: str) -> bool:
    async def read() -> bool:
        nc = await nats.connect(nats_url)
        try:
            await nc.jetstream().get_last_msg(OUTPUT_STREAM, output_subject(tenant, job_id))
            return True
        except NotFoundError:
            return False
        finally:
            await nc.close()

    return asyncio.run(read())


def test_after_retention_410_and_the_chunks_are_purged(fresh: Deployment) -> None:
    fresh.env_overrides.update(HERALD_RETENTION_S="1", HERALD_KINDS=EMIT_KIND)
    fresh.start_gateway()
    fresh.start_worker()
    with client(fresh.url()) as http:
        job = http.post("/emits", json={"count": 3}).json()
        wait_for_state(http, job["id"], {"succeeded"})
        assert _chunks_kept(fresh.nats.url, "acme", job["id"])
        wait_until(lambda: http.get(f"/jobs/{job['id']}").status_code == 410, timeout=30, what="retention")
        assert http.get(f"/jobs/{job['id']}/output").status_code == 410
        assert http.get(f"/jobs/{job['id']}/output", headers=SSE).status_code == 410
    assert not _chunks_kept(fresh.nats.url, "acme", job["id"]), "the chunks went with the job"


def test_the_cli_prints_chunks_as_they_come(out: Deployment, tmp_path: Path) -> None:
    import subprocess
    import sys

    with client(out.url()) as http:
        job = http.post("/emits", json={"count": 4}).json()
    run = subprocess.run([sys.executable, "-m", "launcher.cli", "watch", job["id"], "--output",
                          "--url", out.url(), "--key", KEYS["acme"]],
                         capture_output=True, text=True, timeout=60, env={**out.env()})
    assert run.returncode == 0, run.stderr
    assert [json.loads(line)["i"] for line in run.stdout.splitlines()] == [1, 2, 3, 4]
    assert "succeeded" in run.stderr


def test_a_hung_nats_is_a_503_for_ndjson_and_a_clean_retry_for_sse(fresh: Deployment) -> None:
    """README: while NATS is unreachable from the gateway, NDJSON answers 503 with Retry-After
    and SSE 200 with only ``retry: 3000``. A NATS that hangs (SIGSTOP) keeps its connection
    looking up, and its requests time out instead (5 s): NDJSON answered 200 and broke off
    then with an unhandled error logged, a resumed SSE stream of a finished job got a 500."""
    fresh.env_overrides.update(HERALD_KINDS=EMIT_KIND)
    base = fresh.start_gateway()
    fresh.start_worker()
    with client(base) as http:
        job = http.post("/emits", json={"count": 3}).json()
        wait_for_state(http, job["id"], {"succeeded"})
        assert [line["n"] for line in ndjson(http, job["id"])] == [1, 2, 3]
    path = f"/jobs/{job['id']}/output"
    asks = {
        "ndjson": ({}, None),
        "ndjson after": ({}, {"after": 1}),
        "sse": (SSE, None),
        "sse resumed": ({**SSE, "Last-Event-ID": "3"}, None),
    }
    nats = fresh.nats.process
    assert nats is not None
    nats.send_signal(signal.SIGSTOP)
    try:
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEYS['acme']}"}, timeout=30) as http, \
                ThreadPoolExecutor(len(asks)) as pool:
            answers = dict(zip(asks, pool.map(lambda ask: http.get(path, headers=ask[0], params=ask[1]),
                                              asks.values())))
    finally:
        nats.send_signal(signal.SIGCONT)
    for name in ("ndjson", "ndjson after"):
        answer = answers[name]
        assert answer.status_code == 503, (name, answer.status_code, answer.text)
        assert answer.headers["retry-after"] == "1"
        assert answer.headers["content-type"].startswith("application/problem+json")
    for name in ("sse", "sse resumed"):
        answer = answers[name]
        assert answer.status_code == 200, (name, answer.status_code, answer.text)
        assert answer.headers["content-type"].startswith("text/event-stream")
        assert answer.content == b"retry: 3000\n\n", (name, answer.content)  # EventSource tries again in 3 s
    with client(base) as http:
        wait_until(lambda: http.get(path).status_code == 200, timeout=30, what="NDJSON once NATS answers again")
        assert [line["n"] for line in ndjson(http, job["id"], after=1)] == [2, 3]
    log = fresh.log_text("gateway")
    assert "Exception in ASGI application" not in log and "unhandled error" not in log
    assert fresh.logged("gateway", "output not read: NATS did not answer")
