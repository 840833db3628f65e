"""The served API against SPEC: what a client sends wrong is named, and the OpenAPI document
says what the server really answers (routes, statuses, headers, media types).

Everything runs against the shared real deployment (``herald``: nats-server, a gateway, a
worker), with the tenants' keys and the operator's admin key.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import httpx

from tests.harness import ADMIN_KEY, TLS, Deployment, client, wait_for_state


def _admin(base: str) -> httpx.Client:
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10, verify=TLS)


def keyed_client(base: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=10, verify=TLS)


def _fields(answer: httpx.Response) -> dict[str, str]:
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    problem = answer.json()
    assert problem["type"] == "/problems/invalid-request", problem
    return {error["field"]: error["message"] for error in problem["errors"]}


def test_every_bad_field_inside_an_admin_body_is_named_by_its_path(herald: Deployment) -> None:
    """SPEC §3/§12: an invalid body names each bad field, the same on every route. A tenant's
    `limits` is an object of fields: each bad one is named (`limits.rate_limit`), all at once,
    unknown ones included, and beside the bad fields outside it."""
    with _admin(herald.url()) as http:
        created = http.post("/admin/tenants", json={
            "id": 5, "limits": {"rate_limit": "fast", "max_running": -1, "max_streams": 1.5, "burst": 3}})
        assert set(_fields(created)) == {"id", "limits.rate_limit", "limits.max_running", "limits.max_streams",
                                         "limits.burst"}
        assert _fields(created)["limits.burst"] == "unknown field"
        huge = http.post("/admin/tenants", content=b'{"id": "huge", "limits": {"max_endpoints": 1e400}}',
                         headers={"Content-Type": "application/json"})
        assert _fields(huge) == {"limits.max_endpoints": "number out of range"}
        assert http.get("/admin/tenants/huge").status_code == 404, "nothing was made"

        assert http.post("/admin/tenants", json={"id": "contract"}).status_code == 201
        patched = http.patch("/admin/tenants/contract", json={"disabled": "yes", "limits": {"max_endpoints": "²"}})
        assert set(_fields(patched)) == {"disabled", "limits.max_endpoints"}
        # Not an object at all: the field itself is named, as before.
        assert set(_fields(http.patch("/admin/tenants/contract", json={"limits": [1]}))) == {"limits"}
        # A list's item is named by the list, its index leading the message.
        scopes = _fields(http.post("/admin/tenants/contract/keys", json={"name": "k", "scopes": ["jobs:read", "root"]}))
        assert list(scopes) == ["scopes"] and scopes["scopes"].startswith("[1]: ")
        # A key's name tells the keys apart in tables and logs: not blank, no line breaks of any kind.
        for name in ("   ", "\u00a0", "a\u0085b", "a\u2028b"):
            assert list(_fields(http.post("/admin/tenants/contract/keys", json={"name": name}))) == ["name"], name
        assert http.get("/admin/tenants/contract/keys").json()["items"] == [], "no key was made"
        assert http.get("/admin/tenants/contract").json()["limits"]["max_endpoints"] == 100, "nothing changed"


def _spec(herald: Deployment) -> dict[str, Any]:
    return httpx.get(herald.url() + "/schema/openapi.json", timeout=10).json()  # type: ignore[no-any-return]


def _documented(spec: dict[str, Any], method: str, template: str, answer: httpx.Response, *headers: str) -> None:
    """``answer`` (to ``method template``) is what the document says the operation answers:
    its status, its media type, and each of ``headers``, which the server sent."""
    operation = spec["paths"][template][method.lower()]
    status = str(answer.status_code)
    where = f"{method} {template} -> {status}"
    assert status in operation["responses"], f"{where}: status not documented ({answer.text[:200]})"
    documented = operation["responses"][status]
    media_type = answer.headers.get("content-type", "").split(";")[0]
    if media_type:
        assert media_type in documented.get("content", {}), f"{where}: {media_type} not documented"
    for name in headers:
        assert name.lower() in answer.headers, f"{where}: the server did not send {name}"
        assert name in documented.get("headers", {}), f"{where}: {name} not documented"
    if answer.status_code >= 400:
        # SPEC §10: every 4xx/5xx is problem+json with type, title, status and detail, and
        # the document says all four are there.
        assert media_type == "application/problem+json", where
        problem = answer.json()
        assert {"type", "title", "status", "detail"} <= set(problem) and problem["status"] == answer.status_code, where
        schema = documented["content"]["application/problem+json"]["schema"]
        assert schema == {"$ref": "#/components/schemas/ProblemAnswer"}, where
        assert {"type", "title", "status", "detail"} <= set(spec["components"]["schemas"]["ProblemAnswer"]["required"])


def test_the_document_names_the_headers_the_server_sends(herald: Deployment) -> None:
    """SPEC §3, §4, §6, §8, §12: the headers the contract names (Location, Retry-After,
    Cache-Control, Idempotent-Replayed, ETag, Content-Disposition, WWW-Authenticate) are in the
    document for the status that carries them, and the server sends them there."""
    spec = _spec(herald)
    with client(herald.url()) as http:
        key = {"Idempotency-Key": str(uuid.uuid4())}
        started = http.post("/reports", json={"title": "documented", "pages": 2}, headers=key)
        _documented(spec, "POST", "/reports", started, "Location", "Retry-After", "Cache-Control")
        replayed = http.post("/reports", json={"title": "documented", "pages": 2}, headers=key)
        _documented(spec, "POST", "/reports", replayed, "Location", "Idempotent-Replayed")
        job = started.json()
        running = http.get(f"/jobs/{job['id']}")
        if running.status_code == 200:
            _documented(spec, "GET", "/jobs/{job_id}", running, "ETag", "Retry-After", "Cache-Control")
        wait_for_state(http, job["id"], {"succeeded"})
        done = http.get(f"/jobs/{job['id']}")
        _documented(spec, "GET", "/jobs/{job_id}", done, "Location", "ETag", "Cache-Control")

        result = http.get(f"/reports/{job['id']}")
        _documented(spec, "GET", "/reports/{job_id}", result, "ETag", "Content-Disposition", "Cache-Control")
        again = http.get(f"/reports/{job['id']}", headers={"If-None-Match": result.headers["etag"]})
        assert again.status_code == 304
        _documented(spec, "GET", "/reports/{job_id}", again, "ETag")
        part = http.get(f"/reports/{job['id']}", headers={"Range": "bytes=0-9"})
        assert part.status_code == 206 and part.content == result.content[:10]
        _documented(spec, "GET", "/reports/{job_id}", part, "Content-Range", "ETag", "Accept-Ranges", "Content-Disposition")
        past = http.get(f"/reports/{job['id']}", headers={"Range": f"bytes={len(result.content)}-"})
        _documented(spec, "GET", "/reports/{job_id}", past, "Content-Range")
        assert {"Range", "If-Range"} <= {p["name"] for p in spec["paths"]["/reports/{job_id}"]["get"]["parameters"]}
        assert "If-None-Match" in {p["name"] for p in spec["paths"]["/reports/{job_id}"]["get"]["parameters"]}

        for path, template in ((f"/jobs/{job['id']}/events", "/jobs/{job_id}/events"),
                               (f"/jobs/{job['id']}/output", "/jobs/{job_id}/output")):
            stream = http.get(path, headers={"Accept": "text/event-stream"})  # a finished job's: it ends
            _documented(spec, "GET", template, stream, "Cache-Control")
        lines = http.get(f"/jobs/{job['id']}/output")
        _documented(spec, "GET", "/jobs/{job_id}/output", lines, "Cache-Control")
        at_end = http.get(f"/jobs/{job['id']}/output", headers={"Accept": "text/event-stream", "Last-Event-ID": "2"})
        assert at_end.status_code == 204
        _documented(spec, "GET", "/jobs/{job_id}/output", at_end)

        slow = http.post("/reports", json={"title": "not yet", "pages": 1000}).json()
        not_ready = http.get(f"/reports/{slow['id']}")
        assert not_ready.json()["type"] == "/problems/result-not-ready"
        _documented(spec, "GET", "/reports/{job_id}", not_ready, "Retry-After")
        cancelled = http.delete(f"/jobs/{slow['id']}")
        assert cancelled.status_code in (200, 202)
        _documented(spec, "DELETE", "/jobs/{job_id}", cancelled, "Cache-Control")
        link = http.post("/events/link")
        _documented(spec, "POST", "/events/link", link, "Cache-Control")

    with _admin(herald.url()) as http:
        tenant = http.post("/admin/tenants", json={"id": "documented"})
        _documented(spec, "POST", "/admin/tenants", tenant, "Location")
        assert tenant.headers["location"] == "/admin/tenants/documented"
        assert http.get(tenant.headers["location"]).json()["id"] == "documented"


def test_every_protected_operation_documents_its_401_as_sent(herald: Deployment) -> None:
    """SPEC §2: a missing key is `401` with `WWW-Authenticate: Bearer` and a problem body, on
    every route that needs one (the admin routes included); the document says so for each."""
    spec = _spec(herald)
    tried = 0
    with httpx.Client(base_url=herald.url(), timeout=10, verify=TLS) as anonymous:
        for template, item in spec["paths"].items():
            for method, operation in item.items():
                if method not in ("get", "post", "patch", "delete") or not operation.get("security"):
                    continue
                path = re.sub(r"\{[^}]+\}", lambda _: str(uuid.uuid4()), template)
                answer = anonymous.request(method.upper(), path, json={} if method in ("post", "patch") else None,
                                           headers={"Accept": "application/json"})
                assert answer.status_code == 401, f"{method.upper()} {template}: {answer.status_code}"
                assert answer.headers["www-authenticate"].startswith("Bearer"), template
                _documented(spec, method.upper(), template, answer, "WWW-Authenticate")
                tried += 1
    assert tried > 30


def test_every_body_too_large_is_a_documented_413(herald: Deployment) -> None:
    """SPEC §10: a body over 1 MiB is `413`, on every operation that takes a body."""
    spec = _spec(herald)
    body = b'{"pad": "' + b"x" * (1024 * 1024) + b'"}'
    endpoint = None
    tried = 0
    with client(herald.url()) as acme, _admin(herald.url()) as admin:
        for template, item in spec["paths"].items():
            for method, operation in item.items():
                if method not in ("post", "patch", "put") or "requestBody" not in operation:
                    continue
                if "{endpoint_id}" in template and endpoint is None:
                    endpoint = acme.post("/webhooks", json={"url": "http://127.0.0.1:9/too-large"}).json()["id"]
                path = template.replace("{endpoint_id}", endpoint or "").replace("{tenant_id}", "acme")
                http = admin if template.startswith("/admin") else acme
                answer = http.request(method.upper(), path, content=body, headers={"Content-Type": "application/json"})
                assert answer.status_code == 413, f"{method.upper()} {template}: {answer.status_code}"
                _documented(spec, method.upper(), template, answer)
                tried += 1
    assert tried >= 9


def test_the_document_describes_the_streams_as_they_are(herald: Deployment) -> None:
    """SPEC §8: the output stream's last event carries an `id:` (the last chunk's number, so a
    browser's reconnect after the end gets `204`), as the document now says; the deliveries'
    notice stream reads no `Last-Event-ID`, so the document offers none there."""
    spec = _spec(herald)
    described = spec["paths"]["/jobs/{job_id}/output"]["get"]["responses"]["200"]["description"]
    assert "no id" not in described and "last chunk's number" in described
    with client(herald.url()) as http:
        job = http.post("/reports", json={"title": "ids", "pages": 2}).json()
        wait_for_state(http, job["id"], {"succeeded"})
        stream = http.get(f"/jobs/{job['id']}/output", headers={"Accept": "text/event-stream"}).text
    assert stream.rstrip("\n").split("\n\n")[-1].startswith("id: 2\nevent: job.succeeded\ndata: {")
    notices = {p["name"] for p in spec["paths"]["/webhooks/events"]["get"].get("parameters", [])}
    assert "Last-Event-ID" not in notices
    for template in ("/jobs/{job_id}/events", "/events", "/jobs/{job_id}/output"):
        assert "Last-Event-ID" in {p["name"] for p in spec["paths"][template]["get"]["parameters"]}, template


def test_a_key_that_may_not_read_gets_no_signed_link_to_read_with(herald: Deployment) -> None:
    """SPEC §12: results, output and event streams need `jobs:read`. A key with `jobs:write`
    alone is answered the status object (SPEC §3, §5), but its links are plain paths: a signed
    link opens the job's events, output or result without a key, so handing one to this key
    would let it read what its scope does not. An idempotent replay of a job that succeeded
    (its status then carries `links.result`) gave such a key the result, before."""
    with _admin(herald.url()) as admin:
        assert admin.post("/admin/tenants", json={"id": "writer"}).status_code == 201
        write_only = admin.post("/admin/tenants/writer/keys", json={"name": "w", "scopes": ["jobs:write"]}).json()
        reader = admin.post("/admin/tenants/writer/keys", json={"name": "rw"}).json()
    key = {"Idempotency-Key": str(uuid.uuid4())}
    body = {"title": "write only", "pages": 1}
    anonymous = httpx.Client(base_url=herald.url(), timeout=10, verify=TLS)
    with keyed_client(herald.url(), write_only["key"]) as writer, keyed_client(herald.url(), reader["key"]) as both:
        started = writer.post("/reports", json=body, headers=key)
        assert started.status_code == 202
        job = started.json()
        assert job["links"]["events"] == f"/jobs/{job['id']}/events", job["links"]
        assert job["links"]["output"] == f"/jobs/{job['id']}/output", job["links"]
        for link in (job["links"]["events"], job["links"]["output"]):
            assert anonymous.get(link).status_code == 401, link
        wait_for_state(both, job["id"], {"succeeded"})
        replayed = writer.post("/reports", json=body, headers=key)
        assert replayed.headers["idempotent-replayed"] == "true" and replayed.json()["state"] == "succeeded"
        links = replayed.json()["links"]
        assert links["result"] == f"/reports/{job['id']}" == replayed.json()["result"], links
        assert anonymous.get(links["result"]).status_code == 401
        assert writer.get(links["result"]).status_code == 403  # and the key itself may not read it

        # Cancelling answers the status too: the same plain links.
        queued = writer.post("/reports", json={"title": "to cancel", "pages": 1000}).json()
        cancelled = writer.delete(f"/jobs/{queued['id']}")
        assert cancelled.status_code in (200, 202)
        assert "sig=" not in cancelled.json()["links"]["events"] + cancelled.json()["links"]["output"]

        # A key that may read gets signed links, which open without a key.
        signed = both.post("/reports", json={"title": "reader", "pages": 1}).json()["links"]
        assert "sig=" in signed["events"] and "sig=" in signed["output"]
        assert anonymous.get(signed["output"]).status_code == 200
        again = both.post("/reports", json=body, headers=key)
        assert "sig=" in again.json()["links"]["result"]
        assert anonymous.get(again.json()["links"]["result"]).status_code == 200
    anonymous.close()


def test_a_negative_zero_limit_is_kept_as_zero(herald: Deployment) -> None:
    """`-0.0` is a JSON number that passes `>= 0`; it is the limit 0 (no limit), and is shown
    and audited as 0, never as `-0.0`."""
    with _admin(herald.url()) as http:
        created = http.post("/admin/tenants", content=b'{"id": "signed-zero", "limits": {"rate_limit": -0.0}}',
                            headers={"Content-Type": "application/json"})
        assert created.status_code == 201 and b'"rate_limit":-0' not in created.content, created.text
        assert created.json()["limits"]["rate_limit"] == 0
        patched = http.patch("/admin/tenants/signed-zero", content=b'{"limits": {"rate_limit": -0.0}}',
                             headers={"Content-Type": "application/json"})
        assert patched.status_code == 200 and b'"rate_limit":-0' not in patched.content, patched.text
        assert b'"rate_limit":-0' not in http.get("/admin/tenants/signed-zero").content
        audit = [e for e in http.get("/admin/audit", params={"limit": 100}).json()["items"]
                 if e["tenant"] == "signed-zero"]
        assert len(audit) == 2 and "-0.0" not in repr([e["detail"] for e in audit]), audit


def test_max_endpoints_of_0_allows_no_endpoint(herald: Deployment) -> None:
    """SPEC §13 and the README: `max_endpoints` of 0 allows none (unlike `max_running`, whose
    0 is no cap): the first `POST /webhooks` is `409 /problems/limit-reached`. The store read
    0 as "no cap" and took every endpoint."""
    with _admin(herald.url()) as admin:
        assert admin.post("/admin/tenants", json={"id": "no-hooks", "limits": {"max_endpoints": 0}}).status_code == 201
        key = admin.post("/admin/tenants/no-hooks/keys", json={"name": "k"}).json()["key"]
        with keyed_client(herald.url(), key) as http:
            refused = http.post("/webhooks", json={"url": "http://127.0.0.1:9/none"})
            assert refused.status_code == 409 and refused.json()["type"] == "/problems/limit-reached", refused.text
            _documented(_spec(herald), "POST", "/webhooks", refused)
            assert http.get("/webhooks").json()["items"] == []
            assert admin.patch("/admin/tenants/no-hooks", json={"limits": {"max_endpoints": 1}}).status_code == 200
            assert http.post("/webhooks", json={"url": "http://127.0.0.1:9/one"}).status_code == 201
            assert http.post("/webhooks", json={"url": "http://127.0.0.1:9/two"}).status_code == 409


def test_an_empty_cursor_is_a_400_naming_it_on_every_list(herald: Deployment) -> None:
    """SPEC §10: a cursor no list gave out is a bad field. Empty was the first page on some lists
    and a 400 on others; a client that sends back an empty string it built by mistake learns so
    on every list alike, instead of silently starting over on some."""
    with client(herald.url()) as http:
        endpoint = http.post("/webhooks", json={"url": "https://example.com/hook-empty-cursor"}).json()
        paths = ["/jobs", "/webhooks", f"/webhooks/{endpoint['id']}/deliveries"]
        answers = [http.get(path, params={"cursor": ""}) for path in paths]
    with _admin(herald.url()) as admin:
        paths += ["/admin/tenants", "/admin/audit"]
        answers += [admin.get(path, params={"cursor": ""}) for path in paths[3:]]
    for path, answer in zip(paths, answers):
        assert answer.status_code == 400, (path, answer.text)
        problem = answer.json()
        assert problem["type"] == "/problems/invalid-cursor", (path, problem)
        assert [e["field"] for e in problem["errors"]] == ["cursor"], (path, problem)
