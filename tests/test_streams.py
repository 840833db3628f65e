"""Server-sent events, the JSON event feed and long polling (SPEC §4, §8), on real processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import connect_sse

from tests.harness import KEYS, Deployment, client, dispatched_events, wait_for_state, wait_until

TERMINAL = {"job.succeeded", "job.failed", "job.cancelled"}


def read_job_stream(http: httpx.Client, path: str, headers: dict[str, str] | None = None,
                    stop_after: int | None = None) -> list[dict[str, Any]]:
    events = []
    with connect_sse(http, "GET", path, headers=headers or {}, timeout=30) as source:
        assert source.response.status_code == 200
        assert source.response.headers["content-type"].startswith("text/event-stream")
        assert source.response.headers["cache-control"] == "no-store"
        for sse in dispatched_events(source):
            events.append({"id": sse.id, "event": sse.event, "data": json.loads(sse.data)})
            if stop_after is not None and len(events) >= stop_after:
                break
    return events


def test_stream_sends_snapshot_every_transition_and_ends(herald: Deployment) -> None:
    with client(herald.url()) as http:
        job = http.post("/reports", json={"title": "live", "pages": 10}).json()
        events = read_job_stream(http, f"/jobs/{job['id']}/events")
    versions = [int(e["id"]) for e in events]
    assert versions == list(range(versions[0], versions[-1] + 1)), "every version, in order, once"
    assert events[-1]["event"] == "job.succeeded" and events[-1]["data"]["state"] == "succeeded"
    assert all(e["data"]["version"] == int(e["id"]) for e in events)
    assert {"job.running", "job.progress"} <= {e["event"] for e in events} or versions[0] > 2


def test_resume_with_last_event_id_misses_nothing_and_repeats_nothing(herald: Deployment) -> None:
    with client(herald.url()) as http:
        job = http.post("/reports", json={"title": "resume", "pages": 25}).json()
        first = read_job_stream(http, f"/jobs/{job['id']}/events", stop_after=4)
        last_id = first[-1]["id"]
        rest = read_job_stream(http, f"/jobs/{job['id']}/events", headers={"Last-Event-ID": last_id})
        versions = [int(e["id"]) for e in first + rest]
        assert versions == list(range(versions[0], versions[-1] + 1))
        assert rest[-1]["event"] == "job.succeeded"
        # The query form works too (a browser's first connection), and the header wins over it.
        via_query = read_job_stream(http, f"/jobs/{job['id']}/events?last_event_id={last_id}")
        assert [e["id"] for e in via_query] == [e["id"] for e in rest]
        both = read_job_stream(http, f"/jobs/{job['id']}/events?last_event_id=1",
                               headers={"Last-Event-ID": rest[-2]["id"]})
        assert [e["id"] for e in both] == [rest[-1]["id"]]
        # Resuming a finished stream at its terminal event: 204 stops EventSource for good.
        done = http.get(f"/jobs/{job['id']}/events", headers={"Last-Event-ID": rest[-1]["id"]})
        assert done.status_code == 204
        # A resume point we never gave out: the current status as job.snapshot.
        odd = read_job_stream(http, f"/jobs/{job['id']}/events", headers={"Last-Event-ID": "99999"})
        assert [e["event"] for e in odd] == ["job.snapshot"]
        # ...also when it is no number at all, and the job has finished (not its terminal type).
        garbled = read_job_stream(http, f"/jobs/{job['id']}/events", headers={"Last-Event-ID": "not-an-id"})
        assert [(e["event"], e["data"]["state"]) for e in garbled] == [("job.snapshot", "succeeded")]
        # Two resume points (the terminal event and the first): which is meant cannot be told, so
        # neither is taken (the first was: a 204), and the current status comes as job.snapshot.
        twice = httpx.Headers([("Last-Event-ID", rest[-1]["id"]), ("Last-Event-ID", "1")])
        garbled = read_job_stream(http, f"/jobs/{job['id']}/events", headers=twice)  # type: ignore[arg-type]
        assert [(e["event"], e["data"]["state"]) for e in garbled] == [("job.snapshot", "succeeded")]


def test_signed_stream_url_works_without_a_key(herald: Deployment) -> None:
    with client(herald.url()) as http:
        job = http.post("/reports", json={"title": "signed", "pages": 3}).json()
    with httpx.Client(base_url=herald.url()) as anonymous:
        events = read_job_stream(anonymous, job["links"]["events"])
        assert events[-1]["event"] == "job.succeeded"
        assert anonymous.get(f"/jobs/{job['id']}/events").status_code == 401
        tampered = job["links"]["events"].replace("sig=", "sig=x")
        assert anonymous.get(tampered).status_code == 403


def test_long_poll_wakes_on_transition_and_304_on_timeout(fresh: Deployment) -> None:
    base = fresh.start_gateway()
    with client(base) as http:
        job = http.post("/reports", json={"title": "poll", "pages": 1}).json()
        etag = http.get(f"/jobs/{job['id']}").headers["etag"]
        started = time.monotonic()
        timed_out = http.get(f"/jobs/{job['id']}", params={"wait": 1}, headers={"If-None-Match": etag})
        assert timed_out.status_code == 304 and time.monotonic() - started >= 0.9

        answer: dict[str, Any] = {}

        def hold() -> None:
            with client(base) as poller:
                response = poller.get(f"/jobs/{job['id']}", params={"wait": 30}, headers={"If-None-Match": etag})
                answer["at"], answer["response"] = time.monotonic(), response

        poll = threading.Thread(target=hold)
        poll.start()
        wait_until(lambda: b"herald_long_polls 1.0" in httpx.get(base + "/metrics").content, what="poll held")
        cancelled_at = time.monotonic()
        assert http.delete(f"/jobs/{job['id']}").status_code == 200
        poll.join(10)
        response = answer["response"]
        assert response.status_code == 200 and response.json()["state"] == "cancelled"
        # Woken by the committed transition, not by its 30 s timer (the bound is far from both:
        # a loaded machine has taken over a second to answer).
        assert answer["at"] - cancelled_at < 10.0
        assert http.get(f"/jobs/{job['id']}", params={"wait": 61}).status_code == 400

        # If-None-Match: * matches whatever version the job is at (RFC 9110 §13.1.2): no change
        # could end such a poll with anything but 304, so it is answered at once, not held.
        queued = http.post("/reports", json={"title": "any version", "pages": 1}).json()
        started = time.monotonic()
        anything = http.get(f"/jobs/{queued['id']}", params={"wait": 30}, headers={"If-None-Match": "*"})
        assert anything.status_code == 304 and anything.headers["etag"] == 'W/"1"'
        assert time.monotonic() - started < 10.0, "held for a change that could not end it"


def test_a_poll_its_client_gave_up_on_frees_its_place_at_once(fresh: Deployment) -> None:
    """A client whose own timeout is shorter than its ``wait`` closes the connection: the
    poll it held ends then, not ``wait`` seconds later. Such polls kept the tenant's
    ``max_streams`` places (and the gauge) for up to 60 s, and the client's next poll was a 429."""
    base = fresh.start_gateway(HERALD_MAX_HELD_PER_TENANT="3")  # no worker: the job stays at version 1
    port = int(base.rsplit(":", 1)[1])

    def long_polls() -> float:
        line = next(x for x in httpx.get(base + "/metrics").text.splitlines() if x.startswith("herald_long_polls "))
        return float(line.split()[1])

    with client(base) as http, contextlib.ExitStack() as held:
        job = http.post("/reports", json={"title": "given up", "pages": 1}).json()
        cursor = http.get("/events", params={"limit": 500}, headers={"Accept": "application/json"}).json()["next_cursor"]
        polls = [(f"/jobs/{job['id']}?wait=60", 'If-None-Match: W/"1"'),
                 (f"/events?wait=60&after={cursor}", "Accept: application/json"),
                 (f"/jobs/{job['id']}?wait=60", 'If-None-Match: W/"1"')]
        for path, header in polls:
            sock = held.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10))
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEYS['acme']}\r\n"
                         f"{header}\r\n\r\n".encode())
        wait_until(lambda: long_polls() == 3, what="three polls held")
        full = http.get(f"/jobs/{job['id']}", params={"wait": 1}, headers={"If-None-Match": 'W/"1"'})
        assert full.status_code == 429 and full.json()["type"] == "/problems/too-many-streams"
        held.close()  # the clients give up
        wait_until(lambda: long_polls() == 0, timeout=10, what="the given-up polls ended")
        started = time.monotonic()
        again = http.get(f"/jobs/{job['id']}", params={"wait": 1}, headers={"If-None-Match": 'W/"1"'})
        assert again.status_code == 304, again.text
        assert time.monotonic() - started >= 0.9, "held, as a poll is"


def _answer(response: httpx.Response) -> tuple[int, tuple[tuple[str, str], ...], bytes]:
    """Status, headers (in order) and body of an answer, less what differs per request by design."""
    headers = tuple((k, v) for k, v in response.headers.items() if k not in ("x-request-id", "date"))
    return response.status_code, headers, response.content


_SIGNATURE = re.compile(rb"exp=\d+&sig=[A-Za-z0-9_-]+")


def _unsigned(answer: tuple[int, Any, bytes]) -> tuple[int, Any, bytes]:
    status, headers, body = answer
    return status, headers, _SIGNATURE.sub(b"exp=E&sig=S", body)


def test_polls_woken_by_one_change_share_one_answer_identical_to_a_single_poll(fresh: Deployment) -> None:
    """Held polls woken together are answered from one read and one encoded answer (gateway/answers.py):
    every header and byte as a plain poll at that moment would have them."""
    base = fresh.start_gateway()
    with client(base) as http:
        job = http.post("/reports", json={"title": "woken", "pages": 2}).json()
        etag = http.get(f"/jobs/{job['id']}").headers["etag"]
        answers: list[httpx.Response] = []
        lock = threading.Lock()

        def hold() -> None:
            with client(base) as poller:
                response = poller.get(f"/jobs/{job['id']}", params={"wait": 30}, headers={"If-None-Match": etag})
                with lock:
                    answers.append(response)

        polls = [threading.Thread(target=hold) for _ in range(8)]
        for poll in polls:
            poll.start()
        wait_until(lambda: b"herald_long_polls 8.0" in httpx.get(base + "/metrics").content, what="polls held")
        # One transition, and then nothing for a while: each page takes 5 s.
        fresh.start_worker(HERALD_REPORT_PAGE_MS="5000")
        for poll in polls:
            poll.join(20)
        assert len(answers) == 8
        woken = {_answer(response) for response in answers}
        for _ in range(5):  # a plain poll in the same second of signing (links carry a whole-second expiry)
            single = http.get(f"/jobs/{job['id']}")
            if _answer(single) in woken:
                break
        status, headers, body = _answer(single)
        assert status == 200 and json.loads(body)["state"] == "running"
        assert {"etag", "retry-after", "cache-control", "content-type", "content-length"} <= dict(headers).keys()
        assert len(woken) == 1, "every woken poll got one and the same answer"
        # What a plain poll gets: byte for byte, but for the signed links' whole-second expiry and
        # their signature when the plain poll fell in a later second (a loaded machine).
        assert {_unsigned(a) for a in woken} == {_unsigned((status, headers, body))}, \
            "every woken poll got exactly what a single poll gets"
        # The raw header names are canonical on both paths (Retry-After, ETag), as before.
        assert [name for name, _ in single.headers.raw] == [name for name, _ in answers[0].headers.raw]


def test_json_feed_pages_in_commit_order_and_long_polls(herald: Deployment) -> None:
    json_accept = {"Accept": "application/json"}
    with client(herald.url(), tenant="globex") as http:
        tail = http.get("/events", params={"limit": 500}, headers=json_accept).json()
        cursor = tail["next_cursor"]
        while tail["events"]:
            tail = http.get("/events", params={"after": cursor, "limit": 500}, headers=json_accept).json()
            cursor = tail["next_cursor"]
        job = http.post("/exports", json={"format": "csv", "rows": 20}).json()
        wait_for_state(http, job["id"], {"succeeded"})
        seen: list[dict[str, Any]] = []
        while True:
            page = http.get("/events", params={"after": cursor, "limit": 2}, headers=json_accept).json()
            assert isinstance(page["next_cursor"], str)
            if not page["events"]:
                break
            seen += page["events"]
            cursor = page["next_cursor"]
        mine = [e for e in seen if e["data"]["id"] == job["id"]]
        assert [e["data"]["version"] for e in mine] == list(range(1, len(mine) + 1))
        assert mine[0]["type"] == "job.queued" and mine[-1]["type"] == "job.succeeded"
        ids = [int(e["id"]) for e in seen]
        assert ids == sorted(ids)

        started = time.monotonic()
        empty = http.get("/events", params={"after": cursor, "wait": 1}, headers=json_accept).json()
        assert empty == {"events": [], "next_cursor": cursor} and time.monotonic() - started >= 0.9

        result: dict[str, Any] = {}

        def hold() -> None:
            with client(herald.url(), tenant="globex") as other:
                result["page"] = other.get("/events", params={"after": cursor, "wait": 30}, headers=json_accept).json()

        poll = threading.Thread(target=hold)
        poll.start()
        time.sleep(0.2)  # let the poll be held before the event exists (a miss is also correct, just not this test)
        another = http.post("/exports", json={"format": "csv", "rows": 5}).json()
        poll.join(15)
        assert result["page"]["events"][0]["data"]["id"] == another["id"]
        for bad in ({"after": "x"}, {"limit": 0}, {"limit": 501}, {"wait": 0}, {"wait": 61}):
            assert http.get("/events", params=bad, headers=json_accept).status_code == 400
        # A cursor past the newest event was answered as the next cursor: following it, a
        # client would have skipped every event numbered up to it.
        newest = int(result["page"]["next_cursor"])
        beyond = http.get("/events", params={"after": newest + 1000, "wait": 1}, headers=json_accept)
        assert beyond.status_code == 400 and beyond.json()["errors"][0]["field"] == "after", beyond.text
        at_newest = http.get("/events", params={"after": newest}, headers=json_accept).json()
        assert at_newest["events"] == [] or int(at_newest["events"][0]["id"]) > newest


def test_tenant_stream_via_signed_link(herald: Deployment) -> None:
    with client(herald.url(), tenant="globex") as http:
        link = http.post("/events/link")
        assert link.status_code == 200
        url = link.json()["url"]
        received: list[dict[str, Any]] = []
        job_box: dict[str, str] = {}

        def listen() -> None:
            with httpx.Client(base_url=herald.url()) as anonymous:
                with connect_sse(anonymous, "GET", url, timeout=30) as source:
                    for sse in source.iter_sse():
                        if not sse.data:
                            continue
                        data = json.loads(sse.data)
                        received.append({"id": sse.id, "event": sse.event, "data": data})
                        if data["id"] == job_box.get("id") and sse.event == "job.succeeded":
                            return

        listener = threading.Thread(target=listen)
        listener.start()
        wait_until(lambda: b"herald_sse_streams 1.0" in httpx.get(herald.url() + "/metrics").content,
                   what="stream open")
        job_box["id"] = http.post("/reports", json={"title": "tenant", "pages": 2}).json()["id"]
        listener.join(30)
        mine = [e for e in received if e["data"]["id"] == job_box["id"]]
        assert [e["data"]["version"] for e in mine] == list(range(1, len(mine) + 1))
        assert all(e["data"]["id"] == job_box["id"] or e["data"]["kind"] for e in received)
        with client(herald.url(), tenant="acme") as acme:
            assert job_box["id"] not in {i["id"] for i in acme.get("/jobs").json()["items"]}
        assert httpx.get(herald.url() + url.replace("tenant=globex", "tenant=acme")).status_code == 403


def test_two_gateways_each_stream_a_job_started_on_the_other(fresh: Deployment) -> None:
    first = fresh.start_gateway("gateway-a")
    second = fresh.start_gateway("gateway-b")
    fresh.start_worker()
    with client(first) as http_a, client(second) as http_b:
        job = http_a.post("/reports", json={"title": "fan", "pages": 6}).json()
        events = read_job_stream(http_b, f"/jobs/{job['id']}/events")
        versions = [int(e["id"]) for e in events]
        assert versions == list(range(versions[0], versions[-1] + 1)) and events[-1]["event"] == "job.succeeded"
        job2 = http_b.post("/reports", json={"title": "fan back", "pages": 3}).json()
        assert read_job_stream(http_a, f"/jobs/{job2['id']}/events")[-1]["event"] == "job.succeeded"


def _tenant_sse(base: str, headers: dict[str, str], until: Callable[[list[dict[str, Any]]], bool]) -> list[dict[str, Any]]:
    """The tenant's /events stream on ``base`` until ``until(events so far)``."""
    events: list[dict[str, Any]] = []
    with client(base) as http, connect_sse(http, "GET", "/events", headers=headers, timeout=30) as source:
        assert source.response.status_code == 200
        for sse in source.iter_sse():
            if sse.data:
                events.append({"id": sse.id, "event": sse.event, "data": json.loads(sse.data)})
                if until(events):
                    break
    return events


def test_one_tenant_written_by_two_gateways_and_two_workers_is_read_whole_and_in_order(fresh: Deployment) -> None:
    """SPEC §8 while one tenant's events are written by four processes at once (issue 24: no
    tenant-wide lock orders them any more): a JSON feed reader following its cursor, and an
    SSE stream dropped midway and resumed by Last-Event-ID on the other gateway, each get
    every event exactly once, in the one order the feed keeps, each job's versions in order."""
    gateways = [fresh.start_gateway("gateway-a"), fresh.start_gateway("gateway-b")]
    fresh.start_worker("worker-a")
    fresh.start_worker("worker-b")
    jobs_per_gateway = 12
    total = 2 * jobs_per_gateway
    json_accept = {"Accept": "application/json"}

    def terminal(events: list[dict[str, Any]]) -> int:
        return sum(e["event" if "event" in e else "type"] in TERMINAL for e in events)

    streamed: dict[str, list[dict[str, Any]]] = {}

    def stream() -> None:
        # Dropped after 10 events on one gateway, resumed on the other.
        first = _tenant_sse(gateways[1], {}, lambda events: len(events) >= 10)
        rest = _tenant_sse(gateways[0], {"Last-Event-ID": first[-1]["id"]},
                           lambda events: terminal(first + events) >= total)
        streamed["events"] = first + rest

    followed: list[dict[str, Any]] = []

    def follow() -> None:
        cursor, turn = None, 0
        deadline = time.monotonic() + 120
        while terminal(followed) < total and time.monotonic() < deadline:
            with client(gateways[turn % 2]) as http:
                params: dict[str, Any] = {"limit": 7, "wait": 5}
                if cursor is not None:
                    params["after"] = cursor
                page = http.get("/events", params=params, headers=json_accept).json()
            followed.extend(page["events"])
            cursor, turn = page["next_cursor"], turn + 1

    def start(base: str) -> list[str]:
        with client(base) as http:
            return [http.post("/exports", json={"format": "csv", "rows": 3}).json()["id"] for _ in range(jobs_per_gateway)]

    readers = [threading.Thread(target=stream), threading.Thread(target=follow)]
    for reader in readers:
        reader.start()
    wait_until(lambda: b"herald_sse_streams 1.0" in httpx.get(gateways[1] + "/metrics").content, what="stream open")
    with ThreadPoolExecutor(2) as pool:
        ids = [job_id for started in pool.map(start, gateways) for job_id in started]
    for reader in readers:
        reader.join(150)

    with client(gateways[0]) as http:
        for job_id in ids:
            wait_for_state(http, job_id, {"succeeded"})
        whole: list[dict[str, Any]] = []
        cursor = "0"
        while page := http.get("/events", params={"after": cursor, "limit": 500}, headers=json_accept).json()["events"]:
            whole += page
            cursor = page[-1]["id"]
    history = [(e["id"], e["data"]["id"], e["data"]["version"]) for e in whole]
    numbers = [int(i) for i, _, _ in history]
    assert numbers == sorted(set(numbers)), "one order, every id once"
    versions: dict[str, list[int]] = {}
    for _, job_id, version in history:
        versions.setdefault(job_id, []).append(version)
    assert set(versions) == set(ids) and all(v == list(range(1, len(v) + 1)) for v in versions.values()), versions
    assert [(e["id"], e["data"]["id"], e["data"]["version"]) for e in followed] == history, "the follower: all, once"
    assert [(e["id"], e["data"]["id"], e["data"]["version"]) for e in streamed["events"]] == history, "the stream"


async def _raw_subscriber(port: int, path: str, key: str, ready: asyncio.Event, counter: list[int]) -> list[int]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\nAccept: text/event-stream\r\n\r\n".encode())
    await writer.drain()
    versions: list[int] = []
    try:
        buffer = b""
        while True:
            chunk = await reader.read(65536)
            if not chunk:
                return versions
            buffer += chunk
            while b"\n\n" in buffer:
                block, buffer = buffer.split(b"\n\n", 1)
                for line in block.split(b"\n"):
                    if line.startswith(b"retry:"):
                        counter[0] += 1
                        if counter[0] >= counter[1]:
                            ready.set()
                    if line.startswith(b"id: "):
                        versions.append(int(line[4:]))
                if b"event: job.succeeded" in block:
                    return versions
    finally:
        writer.close()


@pytest.mark.slow
def test_a_thousand_subscribers_on_one_job_all_get_every_event(fresh: Deployment) -> None:
    base = fresh.start_gateway()
    port = fresh.ports["gateway"]
    with client(base) as http:
        job = http.post("/reports", json={"title": "crowd", "pages": 5}).json()

    async def crowd() -> list[list[int]]:
        ready = asyncio.Event()
        counter = [0, 1000]
        tasks = [asyncio.create_task(_raw_subscriber(port, f"/jobs/{job['id']}/events", KEYS["acme"], ready, counter))
                 for _ in range(1000)]
        await asyncio.wait_for(ready.wait(), 60)
        fresh.start_worker()
        return await asyncio.wait_for(asyncio.gather(*tasks), 90)

    results = asyncio.run(crowd())
    expected = results[0]
    assert expected[-1] >= 7, "queued, running, 5 progress steps (or fewer), succeeded"
    assert all(r == list(range(1, expected[-1] + 1)) for r in results), "every subscriber saw every version once"


@pytest.mark.slow
def test_a_client_that_stops_reading_is_dropped_and_others_are_not(fresh: Deployment) -> None:
    """The kernel absorbs up to ~4 MB for a reader that stalls (autotuned send buffer); past
    that the server's sends block, the stream's bounded queue fills, and it is dropped."""
    import socket

    jobs = 90  # ~100 events each, ~550 bytes an event: well past the kernel's 4 MB
    base = fresh.start_gateway()
    port = fresh.ports["gateway"]
    slow = socket.socket()  # a tiny receive window, and it never reads
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    slow.connect(("127.0.0.1", port))
    slow.sendall(f"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEYS['acme']}\r\n\r\n".encode())
    received: list[dict[str, Any]] = []
    ids: list[str] = []

    def listen() -> None:
        finished = 0
        with client(base) as http, connect_sse(http, "GET", "/events", timeout=60) as source:
            for sse in source.iter_sse():
                if sse.data:
                    received.append(json.loads(sse.data))
                    finished += sse.event == "job.succeeded"
                    if finished == jobs:
                        return

    listener = threading.Thread(target=listen)
    listener.start()
    wait_until(lambda: b"herald_sse_streams 2.0" in httpx.get(base + "/metrics").content, what="two streams open")
    fresh.start_worker(HERALD_REPORT_PAGE_MS="0", HERALD_WORKER_CONCURRENCY="8")
    with client(base) as http:
        ids.extend(http.post("/reports", json={"title": "flood", "pages": 100}).json()["id"] for _ in range(jobs))
    listener.join(120)
    assert not listener.is_alive()
    for job_id in ids:  # the reader that kept up has every version of every job, in order
        versions = [e["version"] for e in received if e["id"] == job_id]
        assert versions == list(range(1, len(versions) + 1)) and versions[-1] >= 100
    wait_until(lambda: b'herald_sse_dropped_total{reason="queue_full"} 1.0' in httpx.get(base + "/metrics").content,
               timeout=30, what="the slow stream dropped, once")
    _assert_reset_not_left_open(fresh, slow)
    metrics = httpx.get(base + "/metrics").content
    assert b'reason="send_timeout"' not in metrics, "dropped once, for its full queue, not again by the send bound"


TCP_CLOSE = 7  # tcpi_state of a connection that was reset (an open one is 1, ESTABLISHED)


def _tcp_state(sock: Any) -> int:
    import socket

    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]  # type: ignore[no-any-return]


def _assert_reset_not_left_open(deployment: Deployment, slow: Any) -> None:
    """A dropped reader's connection is reset by the gateway, though the reader never reads:
    not closed, which waits for the client to take the megabytes queued for it, so that the
    socket stayed open (and out of max_streams' count) for as long as the client liked. And
    the gateway logs no error for a response it ended on purpose."""
    try:
        wait_until(lambda: _tcp_state(slow) == TCP_CLOSE, timeout=5, what="the dropped reader's connection reset")
        slow.settimeout(10)
        received = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := slow.recv(1 << 20):  # what reached the reader before the reset, then the reset
                received += chunk
        assert received.startswith(b"HTTP/1.1 200")
    finally:
        slow.close()
    log = deployment.log_text("gateway")
    assert "without completing response" not in log and "Exception in ASGI application" not in log


@pytest.mark.slow
def test_a_reader_that_stops_reading_its_output_is_dropped_by_the_send_bound_and_reset(fresh: Deployment) -> None:
    """A finished job's output is replayed from JetStream, not queued in the hub: a reader that
    never reads blocks the gateway's send once the kernel holds all it will (about 4 MB), and
    the send bound (10-15 s) drops it and resets its connection."""
    import socket

    fresh.env_overrides.update(HERALD_KINDS="tests.kinds_fixture:EMIT")
    base = fresh.start_gateway()
    port = fresh.ports["gateway"]
    fresh.start_worker()
    with client(base) as http:
        job = http.post("/emits", json={"sizes": [60_000] * 150}).json()  # 9 MB of output
        wait_for_state(http, job["id"], {"succeeded"}, timeout=60)
    slow = socket.socket()  # a tiny receive window, and it never reads
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    slow.connect(("127.0.0.1", port))
    slow.sendall(f"GET /jobs/{job['id']}/output HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEYS['acme']}\r\n"
                 "Accept: text/event-stream\r\n\r\n".encode())
    wait_until(lambda: b'herald_sse_dropped_total{reason="send_timeout"} 1.0' in httpx.get(base + "/metrics").content,
               timeout=40, interval=0.2, what="the stuck output stream dropped by the send bound")
    _assert_reset_not_left_open(fresh, slow)
    assert b"herald_sse_streams 0.0" in httpx.get(base + "/metrics").content


def test_a_gateway_raises_its_open_files_limit_to_what_the_system_allows(fresh: Deployment) -> None:
    """Every held stream, poll and download is a descriptor, and a tenant may hold
    ``max_streams`` of them (10 000 by default): at the soft limit a process starts with
    (often 1 024), one tenant's streams used up the gateway's descriptors and every other
    tenant's requests were refused. A gateway started at a soft limit of 256 runs at its
    hard limit, and says so when even that is below twice a tenant's share."""
    import resource

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = min(4096, hard)
    gateway, _base, log = _start_gateway_with_open_files(fresh, 256, ceiling)
    try:
        limits = open(f"/proc/{gateway.pid}/limits").read()
        row = next(line for line in limits.splitlines() if line.startswith("Max open files"))
        assert row.split()[3:5] == [str(ceiling), str(ceiling)], row
        assert f"this process may open {ceiling} files" in log.read_text(), log.read_text()[-2000:]
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)


def _start_gateway_with_open_files(deployment: Deployment, soft: int, hard: int) -> tuple[Any, str, Path]:
    import resource
    import subprocess
    import sys

    from tests.harness import free_port

    port = free_port()
    log = deployment.logs / f"gateway-{port}.log"
    with open(log, "wb") as out:
        gateway = subprocess.Popen(
            [sys.executable, "-m", "launcher.cli", "gateway"], env=deployment.env(HERALD_HTTP_PORT=str(port)),
            stdout=out, stderr=subprocess.STDOUT,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: _ready(base), timeout=30, what="the gateway ready")
    return gateway, base, log


def test_a_tenant_that_filled_a_gateways_streams_cannot_keep_another_out(fresh: Deployment) -> None:
    """A gateway can hold as many connections as its open files allow, less a reserve
    (``gateway.ratelimit.HELD_RESERVE``), whatever each tenant's ``max_streams``: once one
    tenant holds them all, another tenant still gets streams up to its fair part, and the
    first gets none more until it holds no more than its part. Before, the first tenant's
    streams (up to 10 000 each by default) used up the descriptors, and every other tenant's
    requests were refused at ``accept()``."""
    from gateway.ratelimit import HELD_RESERVE

    open_files = HELD_RESERVE + 40
    budget = open_files - HELD_RESERVE
    gateway, base, _log = _start_gateway_with_open_files(fresh, open_files, open_files)

    async def probe() -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with contextlib.AsyncExitStack() as held, httpx.AsyncClient(base_url=base, limits=limits,
                                                                           timeout=20) as http:
            async def open_stream(tenant: str) -> httpx.Response:
                return await held.enter_async_context(http.stream(
                    "GET", "/events", headers={"Authorization": f"Bearer {KEYS[tenant]}",
                                               "Accept": "text/event-stream"}))

            first = [await open_stream("acme") for _ in range(budget)]
            assert [r.status_code for r in first] == [200] * budget
            assert (await open_stream("globex")).status_code == 200  # the gateway is full, globex holds none
            refused = await open_stream("acme")
            assert refused.status_code == 429, refused.status_code
            await refused.aread()
            problem = refused.json()
            assert problem["type"].endswith("too-many-streams") and "share" in problem["detail"], problem
            assert refused.headers["retry-after"]
            assert (await open_stream("globex")).status_code == 200  # still below its part (budget / 2)

    try:
        asyncio.run(probe())
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)


def _ready(base: str) -> bool:
    try:
        return httpx.get(base + "/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
