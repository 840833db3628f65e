"""The 202 contract end to end against real processes (SPEC §2-§4, §6)."""

from __future__ import annotations

import csv
import io
import json
import signal
import time
import uuid

import httpx
import pypdf

from tests.harness import Deployment, client, wait_for_state, wait_until


def start(http: httpx.Client, path: str, body: dict, **headers: str) -> httpx.Response:
    return http.post(path, json=body, headers=headers)


def test_report_accept_poll_303_download_pdf(herald: Deployment) -> None:
    with client(herald.url()) as http:
        accepted = start(http, "/reports", {"title": "Quarterly", "pages": 4})
        assert accepted.status_code == 202
        job = accepted.json()
        assert accepted.headers["location"] == f"/jobs/{job['id']}"
        assert accepted.headers["retry-after"] == "1"
        assert accepted.headers["cache-control"] == "no-store"
        assert job["state"] == "queued" and job["version"] == 1 and job["attempt"] == 0
        assert job["links"]["self"] == f"/jobs/{job['id']}"
        # SPEC §2: a random UUID, v7 with 74 random bits (herald/ids.py, tests/test_ids.py).
        assert str(uuid.UUID(job["id"])) == job["id"] and uuid.UUID(job["id"]).version == 7

        wait_for_state(http, job["id"], {"succeeded"})
        done = http.get(f"/jobs/{job['id']}", follow_redirects=False)
        assert done.status_code == 303
        assert done.headers["location"] == f"/reports/{job['id']}"
        status = done.json()
        assert status["result"] == f"/reports/{job['id']}"
        assert status["progress"] == 100 and status["attempt"] == 1
        assert status["expires_at"] is not None

        pdf = http.get(done.headers["location"])
        assert pdf.status_code == 200
        assert pdf.headers["content-type"] == "application/pdf"
        assert pdf.headers["content-disposition"].startswith("attachment")
        assert len(pypdf.PdfReader(io.BytesIO(pdf.content)).pages) == 4
        assert http.get(done.headers["location"], headers={"If-None-Match": pdf.headers["etag"]}).status_code == 304
        # If-None-Match compares weakly: the strong result tag matches when sent as weak too.
        weak = "W/" + pdf.headers["etag"]
        assert http.get(done.headers["location"], headers={"If-None-Match": weak}).status_code == 304


def test_a_report_titled_in_any_script_succeeds(herald: Deployment) -> None:
    """SPEC §3's title is any string of 1..200: one the PDF's built-in font cannot draw (an
    emoji, CJK, Arabic digits) is accepted and rendered, not a job failed after its 202."""
    title = "Q3 \U0001F600 报告 ٣ café"
    with client(herald.url()) as http:
        job = start(http, "/reports", {"title": title, "pages": 2}).json()
        done = wait_for_state(http, job["id"], {"succeeded", "failed"})
        assert done["state"] == "succeeded", done["error"]
        reader = pypdf.PdfReader(io.BytesIO(http.get(f"/reports/{job['id']}").content))
        assert len(reader.pages) == 2 and reader.metadata is not None and reader.metadata.title == title
        assert "café" in reader.pages[0].extract_text()


def test_progress_and_versions_move_while_running(herald: Deployment) -> None:
    with client(herald.url()) as http:
        job = start(http, "/reports", {"title": "slow", "pages": 30}).json()
        running = wait_for_state(http, job["id"], {"running"})
        assert running["attempt"] == 1
        later = wait_until(lambda: (b := http.get(f"/jobs/{job['id']}", follow_redirects=False).json())["version"] > running["version"] and b)
        assert later["progress"] is not None or later["state"] == "succeeded"
        wait_for_state(http, job["id"], {"succeeded"})


def test_signed_result_url_works_without_key_and_rejects_tampering(herald: Deployment) -> None:
    with client(herald.url()) as http:
        job = start(http, "/reports", {"title": "signed", "pages": 1}).json()
        wait_for_state(http, job["id"], {"succeeded"})
        signed = http.get(f"/jobs/{job['id']}").json()["links"]["result"]
    assert "sig=" in signed and "exp=" in signed
    anonymous = httpx.get(herald.url() + signed)
    assert anonymous.status_code == 200 and anonymous.content.startswith(b"%PDF")
    tampered = signed.replace("exp=", "exp=9")
    response = httpx.get(herald.url() + tampered)
    assert response.status_code == 403
    assert response.headers["content-type"] == "application/problem+json"
    other_path = signed.replace(job["id"], "00000000-0000-4000-8000-000000000000")
    assert httpx.get(herald.url() + other_path).status_code == 403
    assert httpx.get(herald.url() + f"/reports/{job['id']}").status_code == 401


def test_export_csv_and_ndjson_are_right_and_deterministic(herald: Deployment) -> None:
    with client(herald.url()) as http:
        jobs = [start(http, "/exports", {"format": fmt, "rows": 1234}).json() for fmt in ("csv", "ndjson", "csv")]
        bodies = []
        for job in jobs:
            wait_for_state(http, job["id"], {"succeeded"})
            result = http.get(f"/exports/{job['id']}")
            assert result.status_code == 200
            bodies.append(result)
    csv_result, ndjson_result, csv_again = bodies
    assert csv_result.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(csv_result.text)))
    assert len(rows) == 1234 and rows[0]["order_id"] == "1" and rows[-1]["order_id"] == "1234"
    assert ndjson_result.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in ndjson_result.text.splitlines()]
    assert len(lines) == 1234 and lines[5]["order_id"] == 6
    assert str(lines[5]["total"]) == rows[5]["total"]
    assert csv_again.content == csv_result.content


def _job_count(http: httpx.Client) -> int:
    count, cursor = 0, None
    while True:
        page = http.get("/jobs", params={"limit": 100, **({"cursor": cursor} if cursor else {})}).json()
        count += len(page["items"])
        cursor = page["next_cursor"]
        if cursor is None:
            return count


def test_invalid_bodies_name_every_field_and_create_nothing(herald: Deployment) -> None:
    with client(herald.url(), tenant="globex") as http:
        before = _job_count(http)
        bad = start(http, "/reports", {"title": "", "pages": 0, "colour": "red"})
        assert bad.status_code == 400
        assert bad.headers["content-type"] == "application/problem+json"
        problem = bad.json()
        assert problem["type"] == "/problems/invalid-request" and problem["status"] == 400
        assert {e["field"] for e in problem["errors"]} == {"title", "pages", "colour"}

        cross = start(http, "/reports", {"title": "x", "pages": 2, "fail_on_page": 3})
        assert cross.status_code == 400 and cross.json()["errors"][0]["field"] == "fail_on_page"
        missing = start(http, "/exports", {"format": "xml"})
        assert {e["field"] for e in missing.json()["errors"]} == {"format", "rows"}
        assert start(http, "/exports", {"format": "csv", "rows": 1, "callback_url": "ftp://x"}).status_code == 400

        malformed = http.post("/reports", content=b'{"title": ', headers={"Content-Type": "application/json"})
        assert malformed.status_code == 400 and malformed.json()["type"] == "/problems/malformed-json"
        not_json = http.post("/reports", content=b"title=x", headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert not_json.status_code == 415 and not_json.json()["type"] == "/problems/unsupported-media-type"
        no_type = http.post("/reports", content=b'{"title": "x", "pages": 1}')
        assert no_type.status_code == 415
        assert _job_count(http) == before


def test_authentication_and_tenancy(herald: Deployment) -> None:
    base = herald.url()
    anonymous = httpx.post(base + "/reports", json={"title": "x", "pages": 1})
    assert anonymous.status_code == 401 and anonymous.headers["www-authenticate"].startswith("Bearer")
    assert anonymous.json()["type"] == "/problems/unauthorized"
    wrong = httpx.get(base + "/jobs", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    with client(base, "acme") as acme, client(base, "globex") as globex:
        job = start(acme, "/reports", {"title": "mine", "pages": 1}).json()
        assert globex.get(f"/jobs/{job['id']}").status_code == 404
        assert globex.delete(f"/jobs/{job['id']}").status_code == 404
        wait_for_state(acme, job["id"], {"succeeded"})
        assert globex.get(f"/reports/{job['id']}").status_code == 404
        assert all(item["id"] != job["id"] for item in globex.get("/jobs").json()["items"])
        assert globex.get("/jobs/not-a-uuid").status_code == 404
    assert httpx.get(base + "/no/such/route").status_code == 404
    assert httpx.put(base + "/jobs").status_code == 405
    assert httpx.put(base + "/jobs").headers["content-type"] == "application/problem+json"


def test_etag_and_if_none_match(herald: Deployment) -> None:
    with client(herald.url()) as http:
        job = start(http, "/reports", {"title": "etag", "pages": 1, "fail_on_page": 1}).json()
        failed = wait_for_state(http, job["id"], {"failed"})
        response = http.get(f"/jobs/{job['id']}")
        assert response.headers["etag"] == f'W/"{failed["version"]}"'
        assert http.get(f"/jobs/{job['id']}", headers={"If-None-Match": response.headers["etag"]}).status_code == 304
        assert http.get(f"/jobs/{job['id']}", headers={"If-None-Match": 'W/"1"'}).status_code == 200
        # A list field: its tags may come on several lines, each as good as one joined by commas.
        two_lines = httpx.Headers([("If-None-Match", 'W/"1"'), ("If-None-Match", response.headers["etag"])])
        assert http.get(f"/jobs/{job['id']}", headers=two_lines).status_code == 304
        done = start(http, "/reports", {"title": "etag", "pages": 1}).json()
        wait_for_state(http, done["id"], {"succeeded"})
        result = http.get(f"/reports/{done['id']}")
        two_lines = httpx.Headers([("If-None-Match", '"other"'), ("If-None-Match", result.headers["etag"])])
        assert http.get(f"/reports/{done['id']}", headers=two_lines).status_code == 304


def test_fail_on_page_ends_failed_with_a_problem(herald: Deployment) -> None:
    with client(herald.url()) as http:
        job = start(http, "/reports", {"title": "boom", "pages": 5, "fail_on_page": 3}).json()
        failed = wait_for_state(http, job["id"], {"failed"})
        response = http.get(f"/jobs/{job['id']}")
        assert response.status_code == 200
        error = failed["error"]
        assert error["type"] == "/problems/report-render-failed"
        assert "page 3" in error["detail"] and "Traceback" not in json.dumps(error)
        no_result = http.get(f"/reports/{job['id']}")
        assert no_result.status_code == 404 and no_result.json()["type"] == "/problems/no-result"


def test_job_list_filters_and_pages(herald: Deployment) -> None:
    with client(herald.url(), tenant="globex") as http:
        ids = [start(http, "/exports", {"format": "csv", "rows": 10}).json()["id"] for _ in range(5)]
        page = http.get("/jobs", params={"kind": "export", "limit": 2})
        assert page.status_code == 200
        body = page.json()
        assert len(body["items"]) == 2 and body["next_cursor"]
        seen = [item["id"] for item in body["items"]]
        cursor = body["next_cursor"]
        while cursor:
            body = http.get("/jobs", params={"kind": "export", "limit": 2, "cursor": cursor}).json()
            seen += [item["id"] for item in body["items"]]
            cursor = body["next_cursor"]
        assert seen[:5] == list(reversed(ids)), "newest first"
        assert len(seen) == len(set(seen))
        assert http.get("/jobs", params={"limit": 0}).status_code == 400
        assert http.get("/jobs", params={"limit": 101}).status_code == 400
        assert http.get("/jobs", params={"state": "weird"}).status_code == 400
        assert http.get("/jobs", params={"cursor": "!!!"}).status_code == 400
        for job_id in ids:
            wait_for_state(http, job_id, {"succeeded"})
        assert all(i["state"] == "succeeded" for i in http.get("/jobs", params={"state": "succeeded"}).json()["items"])


def test_result_not_ready_while_running(herald: Deployment) -> None:
    with client(herald.url()) as http:
        job = start(http, "/reports", {"title": "wait", "pages": 50}).json()
        early = http.get(f"/reports/{job['id']}")
        assert early.status_code == 404 and early.json()["type"] == "/problems/result-not-ready"
        assert http.delete(f"/jobs/{job['id']}").status_code in (200, 202)
        wait_for_state(http, job["id"], {"cancelled"})


def test_health_ready_and_openapi(herald: Deployment) -> None:
    base = herald.url()
    assert httpx.get(base + "/healthz").status_code == 200
    assert httpx.get(base + "/readyz").status_code == 200
    spec = httpx.get(base + "/schema/openapi.json").json()
    assert "/reports" in spec["paths"] and "/jobs/{job_id}" in spec["paths"]
    for missing in ("/schema/swagger", "/schema/redoc", "/schema/%C3%A9"):  # Litestar's own answer is an HTML page
        answer = httpx.get(base + missing)
        assert answer.status_code == 404 and answer.headers["Content-Type"] == "application/problem+json", missing
    assert httpx.get(base + "/schema").headers["Content-Type"].startswith("text/html")
    # Every error answer is documented as the problem+json it is (SPEC §10), and every
    # key-protected operation says it can refuse a missing key (401) and a missing scope (403).
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            responses = operation["responses"]
            for status, response in responses.items():
                if status.startswith(("4", "5")):
                    assert list(response["content"]) == ["application/problem+json"], (method, path, status)
            if operation.get("security"):
                assert {"401", "403"} <= set(responses), (method, path)
            for status in ("429", "503"):
                if status in responses:
                    assert "Retry-After" in responses[status]["headers"], (method, path, status)
    # The headers the routes read and write themselves (SPEC §3, §4, §8) are documented too.
    start = spec["paths"]["/reports"]["post"]
    assert {"Location", "Retry-After"} <= set(start["responses"]["202"]["headers"])
    assert {"Idempotency-Key", "traceparent"} <= {p["name"] for p in start["parameters"] if p["in"] == "header"}
    poll = spec["paths"]["/jobs/{job_id}"]["get"]
    assert "Location" in poll["responses"]["303"]["headers"] and "ETag" in poll["responses"]["200"]["headers"]
    assert "If-None-Match" in {p["name"] for p in poll["parameters"] if p["in"] == "header"}
    stream = spec["paths"]["/jobs/{job_id}/events"]["get"]
    assert "Last-Event-ID" in {p["name"] for p in stream["parameters"] if p["in"] == "header"}


def test_job_accepted_without_workers_runs_once_a_worker_starts(fresh: Deployment) -> None:
    base = fresh.start_gateway()
    with client(base) as http:
        job = start(http, "/reports", {"title": "patient", "pages": 2}).json()
        time.sleep(0.5)  # no worker exists: nothing may move it (a negative check needs a window)
        assert http.get(f"/jobs/{job['id']}").json()["state"] == "queued"
        fresh.start_worker()
        wait_for_state(http, job["id"], {"succeeded"})


def test_readyz_follows_nats(fresh: Deployment) -> None:
    base = fresh.start_gateway()
    fresh.nats.stop()
    not_ready = wait_until(lambda: (r := httpx.get(base + "/readyz")).status_code == 503 and r, what="503 without NATS")
    assert not_ready.json()["type"] == "/problems/not-ready"
    assert httpx.get(base + "/healthz").status_code == 200, "alive all the same"
    fresh.nats.start()
    wait_until(lambda: httpx.get(base + "/readyz").status_code == 200, what="ready again")


def test_commit_without_publish_is_repaired_after_a_crash(fresh: Deployment) -> None:
    """NATS down: the job commits but cannot be published; the gateway dies (kill -9) with the
    row unsent; NATS and a new gateway come back: the relay publishes it and it runs."""
    base = fresh.start_gateway()
    fresh.start_worker()
    fresh.nats.stop()
    with client(base) as http:
        accepted = start(http, "/reports", {"title": "outbox", "pages": 1})
        assert accepted.status_code == 202, "starts are accepted while NATS is down"
        job = accepted.json()
    fresh.kill("gateway", signal.SIGKILL)
    fresh.nats.start()
    base = fresh.start_gateway("gateway2")
    with client(base) as http:
        done = wait_for_state(http, job["id"], {"succeeded"}, timeout=40)
        assert done["attempt"] == 1


def test_signed_url_expires(fresh: Deployment) -> None:
    base = fresh.start_gateway(HERALD_SIGNED_URL_TTL_S="1")
    fresh.start_worker()
    with client(base) as http:
        job = start(http, "/reports", {"title": "ttl", "pages": 1}).json()
        wait_for_state(http, job["id"], {"succeeded"})
        signed = http.get(f"/jobs/{job['id']}").json()["links"]["result"]
    exp = int(signed.split("exp=")[1].split("&")[0])
    wait_until(lambda: time.time() > exp + 1, timeout=5, what="expiry")
    expired = httpx.get(base + signed)
    assert expired.status_code == 403 and expired.json()["type"] == "/problems/invalid-signature"
