"""No input breaks it, no tenant sees another, load is shed politely (SPEC §2, §6, §10)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import subprocess
import sys

import httpx
import msgspec
import pytest

from tests.harness import ADMIN_KEY, KEYS, Deployment, client, new_database, wait_for_state, wait_until


def counts(deployment: Deployment) -> dict[str, int]:
    """Rows that only a committed start or transition can create."""
    return deployment.count_rows("jobs", "events", "outbox", "idempotency_keys")


# ----- schemathesis against the served OpenAPI document ------------------------------------


def assert_every_operation_tested(summary: str) -> None:
    """The time budget (``--max-time``) spends what is left after the deterministic phases
    on more random cases; it must never cut an operation out (quiet, every operation's
    examples and coverage take under 8 s)."""
    selected = re.search(r"Selected: (\d+)/", summary)
    tested = re.search(r"Tested: (\d+)", summary)
    assert selected and tested and int(tested[1]) == int(selected[1]) > 0, summary[-3000:]
    for phase in ("Coverage", "Fuzzing"):  # Examples: skipped where the schema gives none
        assert re.search(rf"✅ +{phase}", summary), f"phase {phase} did not complete:\n{summary[-3000:]}"


@pytest.fixture(scope="module")
def fuzz_target(tmp_path_factory: pytest.TempPathFactory, store_server: Any) -> Iterator[Deployment]:
    deployment = Deployment(tmp_path_factory.mktemp("fuzz"),
                            database_url=new_database(store_server) if store_server is not None else None)
    deployment.nats.start()
    try:
        deployment.start_gateway(HERALD_RATE_LIMIT="100000", HERALD_WEBHOOK_ALLOW_PRIVATE="0")
        deployment.start_worker()
        yield deployment
    finally:
        deployment.stop()


@pytest.mark.timeout(300)
def test_no_input_gets_a_500_or_breaks_the_schema(fuzz_target: Deployment, tmp_path: Path) -> None:
    """schemathesis (its CLI: its pytest plugin lags pytest 9) over every documented operation.

    ``GET /events`` is left out: every example of it is a stream or a long poll (``wait``
    up to 60 s) that outlasts any request timeout; its inputs are tested in test_streams.
    So is ``GET /webhooks/events``, a stream too (tested in test_portal).
    """
    checks = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
    run = subprocess.run(
        [str(Path(sys.executable).parent / "st"), "run", fuzz_target.url() + "/schema/openapi.json",
         "-H", f"Authorization: Bearer {KEYS['acme']}", "-H", "Accept: application/json", "--checks", checks, "--exclude-path", "/events", "--exclude-path", "/webhooks/events",
         "--max-examples", "8", "--seed", "20261129", "--request-timeout", "15", "--max-time", "30",
         "--phases", "examples,coverage,fuzzing", "--no-color",
         "--report", "junit", "--report-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=280, cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert_every_operation_tested(run.stdout)


@pytest.mark.timeout(200)
def test_no_admin_input_gets_a_500_or_breaks_the_schema(fuzz_target: Deployment, tmp_path: Path) -> None:
    """The /admin routes (SPEC §12), fuzzed with the operator's key (the run above uses a
    tenant's, which every /admin route refuses before reading anything)."""
    checks = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
    run = subprocess.run(
        [str(Path(sys.executable).parent / "st"), "run", fuzz_target.url() + "/schema/openapi.json",
         "-H", f"Authorization: Bearer {ADMIN_KEY}", "-H", "Accept: application/json", "--checks", checks,
         "--include-path-regex", "^/admin",
         "--max-examples", "8", "--seed", "20261201", "--request-timeout", "15", "--max-time", "15",
         "--phases", "examples,coverage,fuzzing", "--no-color",
         "--report", "junit", "--report-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert_every_operation_tested(run.stdout)
    assert "/admin" in run.stdout


# ----- tenancy --------------------------------------------------------------------------------


def _fill(path: str, ids: dict[str, str]) -> str | None:
    names = re.findall(r"{(\w+)}", path)
    if not all(name in ids for name in names):
        return None
    return re.sub(r"{(\w+)}", lambda m: ids[m.group(1)], path)


def test_every_route_answers_404_for_another_tenants_resources(herald: Deployment) -> None:
    spec = httpx.get(herald.url() + "/schema/openapi.json").json()
    ids: dict[str, str] = {}
    with client(herald.url(), "acme") as acme:
        job = acme.post("/reports", json={"title": "private", "pages": 1}).json()
        wait_for_state(acme, job["id"], {"succeeded"})
        ids["job_id"] = job["id"]
        if "/webhooks" in spec["paths"]:
            hook = acme.post("/webhooks", json={"url": "http://127.0.0.1:9/hook"})
            if hook.status_code == 201:
                ids["webhook_id"] = ids["endpoint_id"] = hook.json()["id"]
                ids["delivery_id"] = str(uuid.uuid4())
    walked = 0
    with client(herald.url(), "globex") as globex:
        for template, item in spec["paths"].items():
            path = _fill(template, ids)
            if path is None or "{" not in template:
                continue
            for method in ("get", "post", "patch", "delete"):
                if method not in item:
                    continue
                body = {} if method in ("post", "patch") else None
                response = globex.request(method.upper(), path, json=body, headers={"Accept": "application/json"})
                assert response.status_code == 404, f"{method.upper()} {template} -> {response.status_code}"
                assert response.headers["content-type"] == "application/problem+json"
                walked += 1
    assert walked >= 5


# ----- limits and load shedding ---------------------------------------------------------------


def test_framework_errors_are_problems_and_leave_nothing_behind(herald: Deployment) -> None:
    before = counts(herald)
    with client(herald.url(), "globex") as http:
        too_big = http.post("/reports", content=b'{"title": "' + b"x" * (1024 * 1024 + 10) + b'", "pages": 1}',
                            headers={"Content-Type": "application/json"})
        assert too_big.status_code == 413 and too_big.json()["type"] == "/problems/payload-too-large"
        for response, status, type_ in (
            (http.post("/reports", content=b"{oops", headers={"Content-Type": "application/json"}), 400,
             "/problems/malformed-json"),
            (http.post("/reports", content=b"<xml/>", headers={"Content-Type": "application/xml"}), 415,
             "/problems/unsupported-media-type"),
            (http.get("/nowhere"), 404, "/problems/not-found"),
            (http.patch("/jobs"), 405, "/problems/method-not-allowed"),
            (http.get("/jobs", params={"limit": "many"}), 400, None),
            (http.get("/events", params={"after": "1" * 40}, headers={"Accept": "application/json"}), 400, None),
        ):
            assert response.status_code == status, response.text
            assert response.headers["content-type"] == "application/problem+json"
            problem = response.json()
            assert {"type", "title", "status", "detail"} <= set(problem) and problem["type"].startswith("/problems/")
            if type_:
                assert problem["type"] == type_
        long_header = http.get("/jobs", headers={"X-Filler": "y" * 70_000})
        assert long_header.status_code in (400, 431)
    assert counts(herald)["jobs"] == before["jobs"]


def test_a_body_that_stops_arriving_is_408_and_closes_the_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Content-Length larger than what is sent, then silence: the server bounds no body read,
    so the request was never answered and held its connection for as long as the client
    kept it. Each pause is bounded (``BODY_IDLE_S``, shortened here); a body that keeps
    coming, however slowly, is read whole."""
    import asyncio

    from litestar import Litestar, Request, post
    from litestar.exceptions import HTTPException

    from gateway import bodies
    from gateway.problems import handle_http_exception
    from schemas import ReportParams

    monkeypatch.setattr(bodies, "BODY_IDLE_S", 1.0)

    @post("/reports", status_code=202)
    async def start(request: Request) -> dict[str, Any]:
        params, _document = await bodies.read_body(request, ReportParams)
        return {"title": params.title}

    app = Litestar([start], exception_handlers={HTTPException: handle_http_exception})

    async def send_body(pieces: list[tuple[float, bytes]], length: int, *, stall: bool = False
                        ) -> tuple[int, dict[bytes, bytes], bytes]:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": "/reports", "raw_path": b"/reports", "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(length).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        queue = list(pieces)
        answer: list[Any] = []

        async def receive() -> dict[str, Any]:
            if not queue:
                await asyncio.Event().wait()  # the client sends no more, and keeps the connection
            pause, piece = queue.pop(0)
            await asyncio.sleep(pause)
            return {"type": "http.request", "body": piece, "more_body": stall or bool(queue)}

        async def send(message: dict[str, Any]) -> None:
            answer.append(message)

        await asyncio.wait_for(app(scope, receive, send), timeout=10)  # type: ignore[arg-type]
        head = answer[0]
        return head["status"], dict(head["headers"]), b"".join(m.get("body", b"") for m in answer[1:])

    body = b'{"title": "slow", "pages": 1}'
    status, headers, answered = asyncio.run(send_body([(0, body[:9])], len(body), stall=True))
    assert status == 408 and headers[b"connection"] == b"close", (status, answered)
    problem = msgspec.json.decode(answered)
    assert problem["type"] == "/problems/request-timeout" and problem["status"] == 408, problem
    # Each pause a tenth of the bound (a loaded machine stretches a sleep of 0.2 s past 0.3), 0.7 s in all.
    slow = [(0.1, body[i:i + 5]) for i in range(0, len(body), 5)]
    status, _, answered = asyncio.run(send_body(slow, len(body)))
    assert status == 202 and msgspec.json.decode(answered) == {"title": "slow"}, answered


def test_every_operation_with_a_body_documents_its_408(herald: Deployment) -> None:
    spec = httpx.get(herald.url() + "/schema/openapi.json", timeout=20).json()
    with_body = [(path, method) for path, item in spec["paths"].items() for method, operation in item.items()
                 if isinstance(operation, dict) and "requestBody" in operation]
    assert len(with_body) >= 9
    for path, method in with_body:
        assert "408" in spec["paths"][path][method]["responses"], (method, path)


def test_rate_limit_answers_429_with_retry_after(fresh: Deployment) -> None:
    base = fresh.start_gateway(HERALD_RATE_LIMIT="2")  # burst of 4, then 2 per second
    with client(base) as http:
        answers = [http.post("/reports", json={"title": "burst", "pages": 1}) for _ in range(8)]
        limited = [a for a in answers if a.status_code == 429]
        assert limited, [a.status_code for a in answers]
        assert int(limited[0].headers["retry-after"]) >= 1
        assert limited[0].json()["type"] == "/problems/rate-limited"
        accepted = [a for a in answers if a.status_code == 202]
        assert counts(fresh)["jobs"] == len(accepted), "a refused start leaves no job"


def test_backlog_too_old_answers_503(fresh: Deployment) -> None:
    base = fresh.start_gateway(HERALD_MAX_QUEUE_AGE_S="1")  # no worker: the backlog only ages
    key = {"Idempotency-Key": str(uuid.uuid4())}
    with client(base) as http:
        first = http.post("/reports", json={"title": "first", "pages": 1}, headers=key)
        assert first.status_code == 202
        refused = wait_until(lambda: (r := http.post("/reports", json={"title": "more", "pages": 1})).status_code == 503 and r,
                             timeout=10, interval=0.2, what="503 once the backlog is old")
        assert refused.json()["type"] == "/problems/overloaded" and int(refused.headers["retry-after"]) >= 1
        jobs_while_refused = counts(fresh)["jobs"]
        assert http.post("/reports", json={"title": "still", "pages": 1}).status_code == 503
        # Back-pressure refuses new work, not the answer to work accepted: a retry of the first
        # start (its 202 lost) learns its job, and the same key with another body is the 422.
        replay = http.post("/reports", json={"title": "first", "pages": 1}, headers=key)
        assert replay.status_code == 202, replay.text
        assert replay.headers["idempotent-replayed"] == "true"
        assert replay.headers["location"] == first.headers["location"] and replay.json()["id"] == first.json()["id"]
        other = http.post("/reports", json={"title": "other", "pages": 1}, headers=key)
        assert other.status_code == 422 and other.json()["type"] == "/problems/idempotency-key-mismatch"
        unknown = http.post("/reports", json={"title": "first", "pages": 1}, headers={"Idempotency-Key": str(uuid.uuid4())})
        assert unknown.status_code == 503, "a key never used is a start"
        assert counts(fresh)["jobs"] == jobs_while_refused
        fresh.start_worker()
        wait_until(lambda: http.post("/reports", json={"title": "again", "pages": 1}).status_code == 202,
                   timeout=20, interval=0.3, what="starts accepted once the backlog drains")


def test_held_connections_are_capped_per_tenant(fresh: Deployment) -> None:
    base = fresh.start_gateway(HERALD_MAX_HELD_PER_TENANT="2")
    with client(base) as http:
        job = http.post("/reports", json={"title": "capped", "pages": 1}).json()
        with http.stream("GET", "/events"), http.stream("GET", f"/jobs/{job['id']}/events"):
            refused = http.get("/events")
            assert refused.status_code == 429 and refused.json()["type"] == "/problems/too-many-streams"
            with client(base, "globex") as other:
                with other.stream("GET", "/events") as allowed:
                    assert allowed.status_code == 200, "another tenant is unaffected"
        wait_until(lambda: http.get(f"/jobs/{job['id']}", params={"wait": 1},
                                    headers={"If-None-Match": 'W/"1"'}).status_code in (200, 304),
                   what="capacity back once streams close")


def test_host_names_that_cannot_be_encoded_are_400_not_500(herald: Deployment) -> None:
    """Found by the fuzzer: a callback or webhook host the IDNA codec rejects."""
    odd = ['https://\u9387\U0002213a\u009a\u00e5', 'https://a..b/x', "https://" + "a" * 70 + ".example/x"]
    with client(herald.url(), "globex") as http:
        for url in odd:
            start = http.post("/exports", json={"format": "csv", "rows": 1, "callback_url": url})
            assert start.status_code == 400, (url, start.text)
            assert start.json()["errors"][0]["field"] == "callback_url"
            hook = http.post("/webhooks", json={"url": url})
            assert hook.status_code == 400, (url, hook.text)
