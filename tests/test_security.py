"""What the security review found (issue 23 §5, SPEC §10): no 500 from non-ASCII input, the
SSRF guard's address forms, pages without CDN scripts, download headers, tenant names."""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import bcrypt
import httpx
import msgspec
import pytest

from herald.settings import Settings, SettingsError, check_exposed_api_keys
from tests.harness import ADMIN_KEY, KEYS, TLS, Deployment, client, free_port, wait_for_state

# ``²`` passes str.isdigit() but not int(); ``é`` is a letter outside ASCII; the bytes are no UTF-8.
ODD_TEXT = ("²", "é", "1²", "٣")
ODD_BYTES = (b"\xff\xfe", b"caf\xe9", "²".encode())


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


@dataclass
class Target:
    """Ids of real resources of tenant acme, so each route reaches its parsing."""

    base: str
    job_id: str
    endpoint_id: str
    ids: dict[str, str] = field(default_factory=dict)


@pytest.fixture(scope="module")
def target(herald: Deployment) -> Target:
    with client(herald.url()) as acme:
        job = acme.post("/reports", json={"title": "odd input", "pages": 1}).json()
        wait_for_state(acme, job["id"], {"succeeded"})
        hook = acme.post("/webhooks", json={"url": "http://127.0.0.1:9/hook"})
        assert hook.status_code == 201, hook.text
        return Target(herald.url(), job["id"], hook.json()["id"])


def _assert_client_error(response: httpx.Response, what: str) -> None:
    assert 400 <= response.status_code < 500, f"{what}: {response.status_code} {response.text[:300]}"
    assert response.headers["content-type"].startswith("application/problem+json"), what


def _cursor_values() -> list[str]:
    # raw, base64 of a non-ASCII number, of a non-ASCII position, of bytes that are no UTF-8
    return [*ODD_TEXT, _b64("²"), _b64(f"1²|{uuid.uuid4()}"), _b64(f"1.0|{uuid.uuid4()}é"),
            base64.urlsafe_b64encode(b"\xff\xfe1").decode()]


QUERY_CASES: list[tuple[str, str, str, dict[str, str]]] = [
    # (path template, parameter, header set, extra query)
    ("/webhooks", "limit", "acme", {}),
    ("/webhooks", "cursor", "acme", {}),
    ("/webhooks/{endpoint}/deliveries", "limit", "acme", {}),
    ("/webhooks/{endpoint}/deliveries", "cursor", "acme", {}),
    ("/webhooks/{endpoint}/deliveries", "status", "acme", {}),
    ("/jobs", "limit", "acme", {}),
    ("/jobs", "cursor", "acme", {}),
    ("/jobs", "state", "acme", {}),
    ("/jobs", "kind", "acme", {}),
    ("/jobs/{job}", "wait", "acme", {}),
    ("/events", "after", "json", {}),
    ("/events", "limit", "json", {}),
    ("/events", "wait", "json", {}),
    ("/events", "kind", "json", {}),
    ("/events", "exp", "none", {"sig": "x", "tenant": "acme"}),
    ("/events", "sig", "none", {"exp": "9999999999", "tenant": "acme"}),
    ("/events", "tenant", "none", {"exp": "9999999999", "sig": "x"}),
    ("/reports/{job}", "exp", "none", {"sig": "x"}),
    ("/reports/{job}", "sig", "none", {"exp": "9999999999"}),
    ("/jobs/{job}/events", "exp", "none", {"sig": "x"}),
    ("/jobs/{job}/events", "sig", "none", {"exp": "9999999999"}),
    ("/webhooks/events", "exp", "none", {"sig": "x", "tenant": "acme"}),
    ("/webhooks/events", "sig", "none", {"exp": "9999999999", "tenant": "acme"}),
    ("/webhooks/events", "tenant", "none", {"exp": "9999999999", "sig": "x"}),
    ("/jobs/{job}/output", "after", "acme", {}),
    ("/jobs/{job}/output", "last_event_id", "sse", {}),
    ("/jobs/{job}/output", "exp", "none", {"sig": "x"}),
    ("/jobs/{job}/output", "sig", "none", {"exp": "9999999999"}),
    ("/portal", "exp", "none", {}),
    ("/admin/tenants", "limit", "admin", {}),
    ("/admin/tenants", "cursor", "admin", {}),
    ("/admin/audit", "limit", "admin", {}),
    ("/admin/audit", "cursor", "admin", {}),
]


def _headers(which: str) -> dict[str, str]:
    return {"acme": {"Authorization": f"Bearer {KEYS['acme']}"},
            "json": {"Authorization": f"Bearer {KEYS['acme']}", "Accept": "application/json"},
            "sse": {"Authorization": f"Bearer {KEYS['acme']}", "Accept": "text/event-stream"},
            "admin": {"Authorization": f"Bearer {ADMIN_KEY}"},
            "none": {}}[which]


@pytest.mark.parametrize(("template", "name", "who", "extra"), QUERY_CASES,
                         ids=[f"{c[0]}?{c[1]}" for c in QUERY_CASES])
def test_non_ascii_query_parameters_are_client_errors(target: Target, template: str, name: str, who: str,
                                                      extra: dict[str, str]) -> None:
    path = template.format(job=target.job_id, endpoint=target.endpoint_id)
    values = _cursor_values() if name == "cursor" else list(ODD_TEXT)
    with httpx.Client(base_url=target.base, headers=_headers(who), timeout=20, verify=TLS) as http:
        for value in values:
            response = http.get(path, params={**extra, name: value})
            if path == "/portal":  # the page itself: the script reads its query
                assert response.status_code == 200
                continue
            _assert_client_error(response, f"{path}?{name}={value!r}")


def test_get_webhooks_with_a_superscript_limit_names_the_field(target: Target) -> None:
    with client(target.base) as acme:
        response = acme.get("/webhooks?limit=%C2%B2")
    assert response.status_code == 400, response.text
    assert "limit" in response.text


RANGE_CASES: list[tuple[str, str, str, str]] = [
    # (path template, parameter, header set, a value out of its range or of its type)
    ("/jobs", "limit", "acme", "101"),
    ("/jobs", "limit", "acme", "0"),
    ("/jobs", "limit", "acme", "٣"),
    ("/jobs", "state", "acme", "bogus"),
    ("/jobs/{job}", "wait", "acme", "61"),
    ("/events", "limit", "json", "501"),
    ("/events", "wait", "json", "61"),
    ("/webhooks", "limit", "acme", "0"),
    ("/admin/audit", "limit", "admin", "1000000"),
]


@pytest.mark.parametrize(("template", "name", "who", "value"), RANGE_CASES,
                         ids=[f"{c[0]}?{c[1]}={c[3]}" for c in RANGE_CASES])
def test_a_query_parameter_out_of_range_is_named_in_the_problem(target: Target, template: str, name: str, who: str,
                                                                value: str) -> None:
    path = template.format(job=target.job_id)
    with httpx.Client(base_url=target.base, headers=_headers(who), timeout=20, verify=TLS) as http:
        response = http.get(path, params={name: value})
    assert response.status_code == 400, response.text
    problem = response.json()
    assert problem["type"] == "/problems/invalid-request", problem
    assert [error["field"] for error in problem["errors"]] == [name], problem
    assert name in problem["detail"], problem


# (path template, header set, query string, the parameter it must name): an integer spelt as a
# float (the framework read 2.0 as 2 and 1e1 as 10), a parameter given twice (it took the last).
SPELLING_CASES: list[tuple[str, str, str, str]] = [
    ("/jobs", "acme", "limit=2.0", "limit"),
    ("/jobs", "acme", "limit=1e1", "limit"),
    ("/jobs/{job}", "acme", "wait=1e1", "wait"),
    ("/events", "json", "limit=5e1", "limit"),
    ("/events", "json", "wait=1.0", "wait"),
    ("/admin/audit", "admin", "limit=1.0", "limit"),
    ("/jobs", "acme", "limit=1&limit=100", "limit"),
    ("/jobs", "acme", "state=queued&state=failed", "state"),
    ("/jobs/{job}", "acme", "wait=abc&wait=1", "wait"),
    ("/events", "json", "after=1&after=2", "after"),
    ("/webhooks/{endpoint}/deliveries", "acme", "status=failed&status=delivered", "status"),
    ("/reports/{job}", "none", "exp=1&exp=2&sig=x", "exp"),
    ("/events", "none", "exp=9999999999&sig=x&tenant=acme&tenant=globex", "tenant"),
    ("/webhooks/events", "none", "exp=9999999999&sig=x&tenant=acme&tenant=globex", "tenant"),
]


@pytest.mark.parametrize(("template", "who", "query", "name"), SPELLING_CASES,
                         ids=[f"{c[0]}?{c[2]}" for c in SPELLING_CASES])
def test_a_float_for_an_integer_or_a_parameter_given_twice_is_named_in_the_problem(
        target: Target, template: str, who: str, query: str, name: str) -> None:
    path = template.format(job=target.job_id, endpoint=target.endpoint_id)
    with httpx.Client(base_url=target.base, headers=_headers(who), timeout=20, verify=TLS) as http:
        response = http.get(f"{path}?{query}")
    assert response.status_code == 400, response.text
    problem = response.json()
    assert problem["type"] == "/problems/invalid-request", problem
    assert [error["field"] for error in problem["errors"]] == [name], problem


# (route, who, body, the field the answer must name: a field inside an object by its dotted path,
# an item of a list by the list, its index leading the message; None: malformed JSON, no field)
BAD_BODIES: list[tuple[str, str, bytes, str | None]] = [
    ("/reports", "acme", b'{"title": "a", "pages": 1e309}', "pages"),
    ("/reports", "acme", b'{"title": "a", "pages": 1, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),
    ("/portal/session", "none", b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),
    ("/admin/tenants", "admin", b'{"id": "odd-limits", "limits": {"rate_limit": -1}}', "limits.rate_limit"),
    ("/webhooks", "acme", b'{"url": "https://hooks.example.com/a", "event_types": ["job.queued", 7]}',
     "event_types[1]"),
    ("/admin/tenants", "admin", b'{"id": "odd-limits", "limits": {"max_running": 1e400}}', "limits.max_running"),
    ("/admin/tenants/acme/keys", "admin", b'{"name": "n", "expires_at": "9999-12-31T23:59:59-23:59"}', "expires_at"),
    ("/webhooks", "acme", b'{"url": "http://exa mple.com/hook"}', "url"),
]


@pytest.mark.parametrize(("path", "who", "body", "name"), BAD_BODIES,
                         ids=[f"{c[0]}:{c[3]}" for c in BAD_BODIES])
def test_a_bad_body_is_a_problem_naming_its_field_and_changes_nothing(target: Target, path: str, who: str, body: bytes,
                                                                      name: str | None) -> None:
    headers = {**_headers(who), "Content-Type": "application/json"}
    with httpx.Client(base_url=target.base, headers=headers, timeout=20, verify=TLS) as http:
        response = http.post(path, content=body)
        assert response.status_code == 400, response.text[:300]
        problem = response.json()
        if name is None:
            assert problem["type"] == "/problems/malformed-json", problem
        else:
            assert problem["type"] == "/problems/invalid-request", problem
            field, bracket, index = name.partition("[")
            assert [error["field"] for error in problem["errors"]] == [field], problem
            assert problem["errors"][0]["message"].startswith(f"[{index}: " if bracket else ""), problem
        if path.startswith("/admin/tenants/acme/keys"):  # nothing half-written: the listing still renders
            listing = http.get(path)
            assert listing.status_code == 200, listing.text[:300]


def test_a_request_line_the_server_cannot_read_is_answered_as_a_problem(target: Target) -> None:
    """Raw non-ASCII in the request target never reaches the app: the HTTP parser refuses it,
    still as problem+json."""
    host, port = urlsplit(target.base).hostname, urlsplit(target.base).port
    with socket.create_connection((host, port), timeout=10) as conn:
        conn.sendall(f"GET /jobs/{target.job_id}?exp=".encode() + "²".encode() + b"&sig=x HTTP/1.1\r\nHost: h\r\n\r\n")
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), answer[:300]
    assert b"content-type: application/problem+json" in head.lower(), head
    assert msgspec.json.decode(body)["type"] == "/problems/bad-request"


def _raw_get(base: str, path: str, headers: list[tuple[bytes, bytes]]) -> httpx.Response:
    with httpx.Client(base_url=base, timeout=20, verify=TLS) as http:
        request = http.build_request("GET", path)
        request.headers = _with(request.headers, headers)
        return http.send(request)


def _with(defaults: httpx.Headers, headers: list[tuple[bytes, bytes]]) -> httpx.Headers:
    """httpx's default headers, each one named in ``headers`` replaced by that raw value."""
    names = {name for name, _ in headers}
    return httpx.Headers([*((k, v) for k, v in defaults.raw if k.lower() not in names), *headers])


@pytest.mark.parametrize("path", ["/jobs", "/webhooks", "/events", "/admin/tenants", "/reports/{job}", "/jobs/{job}/events"])
def test_non_ascii_bearer_tokens_are_401(target: Target, path: str) -> None:
    path = path.format(job=target.job_id)
    tokens: list[bytes] = [t.encode() for t in ODD_TEXT] + list(ODD_BYTES)
    tokens += [b"hps_" + t for t in tokens]
    tokens += [f"hps_9999999999.{_b64('acme')}.k.{v}".encode() for v in ODD_TEXT]
    tokens += [f"hps_{v}.{_b64('acme')}.k.sig".encode() for v in ODD_TEXT]
    tokens += [f"hps_9999999999.{_b64(v)}.k.sig".encode() for v in ODD_TEXT]
    tokens += [b"hps_9999999999." + base64.urlsafe_b64encode(b"\xff") + b".k.sig"]
    tokens += [KEYS["acme"].encode() + b"\xe9", ADMIN_KEY.encode() + "é".encode(), ADMIN_KEY.encode() + b"\xff"]
    for token in tokens:
        response = _raw_get(target.base, path, [(b"authorization", b"Bearer " + token)])
        assert response.status_code in (401, 403), f"{path} Bearer {token!r}: {response.status_code} {response.text[:300]}"
        assert response.headers["content-type"].startswith("application/problem+json")


def test_a_loopback_gateway_answers_only_a_loopback_host(target: Target) -> None:
    """DNS rebinding: a web page whose name is made to resolve to 127.0.0.1 calls a local
    gateway as its own origin, so it can read the answers, with the public dev key. Its requests
    name the page's host: a gateway bound to loopback refuses them (421, problem+json) before
    any key is looked at, and serves loopback names and addresses as before."""
    port = urlsplit(target.base).port
    auth = {"Authorization": f"Bearer {KEYS['acme']}"}
    for host in (f"rebound.example:{port}", "rebound.example", f"127.0.0.1.nip.io:{port}", f"localhost.evil:{port}"):
        refused = httpx.get(f"{target.base}/jobs/{target.job_id}", headers={**auth, "Host": host}, timeout=10)
        assert refused.status_code == 421, (host, refused.status_code, refused.text[:300])
        assert refused.headers["content-type"].startswith("application/problem+json")
        assert refused.json()["type"] == "/problems/misdirected-request" and target.job_id not in refused.text
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST.", f"[::1]:{port}", f"app.localhost:{port}",
                 f"127.1.2.3:{port}"):
        served = httpx.get(f"{target.base}/jobs/{target.job_id}", headers={**auth, "Host": host}, timeout=10)
        assert served.status_code == 303, (host, served.status_code, served.text[:300])


def test_an_http11_request_with_no_host_or_several_is_a_400(target: Target) -> None:
    """RFC 9112 §3.2. Both were served: two Host lines were judged by the first alone (the
    second could name the rebound page), and none at all was waved through as HTTP/1.0's."""
    port = urlsplit(target.base).port
    assert port is not None
    auth = f"Authorization: Bearer {KEYS['acme']}\r\n"

    def answer(head: str) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(head.encode() + b"Connection: close\r\n\r\n")
            return b"".join(iter(lambda: conn.recv(65536), b""))

    path = f"/jobs/{target.job_id}"
    for head in (f"GET {path} HTTP/1.1\r\n{auth}",
                 f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nHost: rebound.example\r\n{auth}",
                 f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nHost: 127.0.0.1:{port}\r\n{auth}"):
        refused = answer(head)
        assert refused.startswith(b"HTTP/1.1 400 "), refused[:300]
        assert b"application/problem+json" in refused and b'"field":"Host"' in refused.replace(b" ", b"")
        assert target.job_id.encode() not in refused.partition(b"\r\n\r\n")[2]
    assert answer(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{auth}").startswith(b"HTTP/1.1 303 ")
    assert answer(f"GET {path} HTTP/1.0\r\n{auth}").startswith(b"HTTP/1.1 303 ")  # 1.0 has no Host to send


def test_the_hosts_a_gateway_answers_follow_where_it_listens() -> None:
    from gateway.middleware import host_served

    loopback = Settings.from_env({})
    assert not host_served("rebound.example:8000", loopback) and host_served("localhost:8000", loopback)
    assert host_served(None, loopback)  # HTTP/1.0 without a Host: no browser, no rebinding
    behind_proxy = Settings.from_env({"HERALD_ALLOWED_HOSTS": "Herald.Example.com, api.example.com"})
    assert host_served("herald.example.com", behind_proxy) and host_served("API.example.com:443", behind_proxy)
    assert not host_served("other.example.com", behind_proxy)
    for bound in ("0.0.0.0", "::", "herald.internal"):  # reachable from elsewhere: by any name
        assert host_served("anything.example:8000", Settings.from_env({"HERALD_HTTP_HOST": bound}))


def test_non_ascii_headers_never_500(target: Target) -> None:
    auth = (b"authorization", f"Bearer {KEYS['acme']}".encode())
    values = [v.encode() for v in ODD_TEXT] + list(ODD_BYTES)
    for value in values:
        cases = [
            (f"/jobs/{target.job_id}", [auth, (b"if-none-match", value)]),
            (f"/jobs/{target.job_id}?wait=1", [auth, (b"if-none-match", b'"' + value + b'"')]),
            (f"/reports/{target.job_id}", [auth, (b"if-none-match", value)]),
            ("/jobs", [auth, (b"x-request-id", value)]),
            ("/jobs", [auth, (b"accept", value)]),
            ("/events", [auth, (b"accept", b"application/json"), (b"last-event-id", value)]),
        ]
        for path, headers in cases:
            response = _raw_get(target.base, path, headers)
            assert response.status_code < 500, f"{path} {headers[-1]!r}: {response.status_code} {response.text[:300]}"
        # A finished job's stream resumed from an odd id: answered (snapshot or 204), never a 500.
        with httpx.Client(base_url=target.base, timeout=20) as http:
            request = http.build_request("GET", f"/jobs/{target.job_id}/events")
            request.headers = _with(request.headers, [auth, (b"last-event-id", value)])
            response = http.send(request, stream=True)
            try:
                assert response.status_code in (200, 204), f"Last-Event-ID {value!r}: {response.status_code}"
            finally:
                response.close()


def test_non_ascii_idempotency_keys_are_400(target: Target) -> None:
    auth = (b"authorization", f"Bearer {KEYS['acme']}".encode())
    for value in [v.encode() for v in ODD_TEXT] + list(ODD_BYTES):
        with httpx.Client(base_url=target.base, timeout=20) as http:
            request = http.build_request("POST", "/reports", json={"title": "odd key", "pages": 1})
            request.headers = _with(request.headers, [auth, (b"idempotency-key", value)])
            response = http.send(request)
        _assert_client_error(response, f"Idempotency-Key {value!r}")
        assert "Idempotency-Key" in response.text


@pytest.mark.parametrize("field_name", ["tenant", "key", "exp", "sig"])
def test_non_ascii_portal_session_fields_are_client_errors(target: Target, field_name: str) -> None:
    good = {"tenant": "acme", "key": "k1", "exp": "9999999999", "sig": "c2ln"}
    with httpx.Client(base_url=target.base, timeout=20) as http:
        for value in ODD_TEXT:
            response = http.post("/portal/session", json={**good, field_name: value})
            _assert_client_error(response, f"{field_name}={value!r}")


def test_answers_that_carry_a_secret_or_a_signed_link_are_never_stored(herald: Deployment) -> None:
    with client(herald.url()) as acme:
        created = acme.post("/webhooks", json={"url": "https://hooks.example.com/no-store"})
        assert created.status_code == 201
        endpoint = created.json()["id"]
        answers = {
            "POST /webhooks": created,
            "POST /webhooks/{id}/rotate-secret": acme.post(f"/webhooks/{endpoint}/rotate-secret"),
            "GET /webhooks/callback-secret": acme.get("/webhooks/callback-secret"),
            "POST /webhooks/callback-secret/rotate": acme.post("/webhooks/callback-secret/rotate"),
            "POST /portal/link": acme.post("/portal/link"),
            "POST /events/link": acme.post("/events/link"),
            "POST /webhooks/events/link": acme.post("/webhooks/events/link"),
        }
        acme.delete(f"/webhooks/{endpoint}")
    for route, answer in answers.items():
        assert answer.status_code in (200, 201) and answer.headers.get("cache-control") == "no-store", \
            (route, answer.status_code, answer.headers.get("cache-control"))


# ----- the SSRF guard (SPEC §7, §10) ------------------------------------------------------------

REFUSED_HOSTS = [
    "127.0.0.1", "10.0.0.1", "169.254.169.254", "[::1]", "[fe80::1]", "[fc00::1]",
    # IPv6 forms that carry an IPv4 address (here loopback, or public 8.8.8.8: refused all the same)
    "[::ffff:127.0.0.1]", "[::ffff:8.8.8.8]", "[::7f00:1]", "[64:ff9b::7f00:1]", "[64:ff9b::808:808]",
    "[64:ff9b:1::7f00:1]", "[2002:7f00:1::1]", "[2002:808:808::1]", "[2001:0:4136:e378:8000:63bf:3fff:fdd2]",
    # hosts written as numbers: 127.0.0.1, 10.0.0.1, 169.254.169.254
    "2130706433", "127.1", "0x7f.1", "0x7f000001", "0177.0.0.1", "017700000001", "127.0.0.1.", "10.1",
    "0xa9.0xfe.0xa9.0xfe", "2852039166",
    # not addresses at all, though numeric
    "1.2.3.999", "1.2.3.4.5",
    # special-purpose blocks that Python 3.11.7's is_global still calls global
    "192.0.0.8", "192.88.99.1",
    # names: local, and one that does not resolve (the same answer: no probing of names)
    "localhost", "api.localhost", "no-such-host.invalid",
]


@pytest.fixture(scope="module")
def strict(herald: Deployment) -> Iterator[str]:
    """A gateway of the shared deployment with the SSRF guard on (no HERALD_WEBHOOK_ALLOW_PRIVATE)."""
    base = herald.start_gateway("security-strict", HERALD_WEBHOOK_ALLOW_PRIVATE="0")
    try:
        yield base
    finally:
        herald.kill("security-strict", signal.SIGTERM)


@pytest.mark.parametrize("host", REFUSED_HOSTS)
def test_webhook_urls_to_non_public_addresses_are_refused(strict: str, host: str) -> None:
    with client(strict) as acme:
        response = acme.post("/webhooks", json={"url": f"https://{host}/hook"})
        assert response.status_code == 400, f"{host}: {response.status_code} {response.text}"
        errors = response.json()["errors"]
        assert errors == [{"field": "url", "message": "must resolve to a public address"}] or \
            (errors[0]["field"] == "url" and host in ("1.2.3.999", "1.2.3.4.5")), errors
        # the same guard for a job's callback_url, and for a PATCH
        started = acme.post("/reports", json={"title": "x", "pages": 1, "callback_url": f"https://{host}/cb"})
        assert started.status_code == 400 and started.json()["errors"][0]["field"] == "callback_url", started.text


def test_public_addresses_pass_however_written(strict: str) -> None:
    """Positive control: the guard judges the address a number denotes, not its spelling."""
    with client(strict) as acme:
        for host in ("1.1.1.1", "16843009", "0x1.0x1.0x1.0x1", "1.65793", "[2606:4700:4700::1111]"):
            response = acme.post("/webhooks", json={"url": f"https://{host}/hook"})
            assert response.status_code == 201, f"{host}: {response.text}"
            patched = acme.patch(f"/webhooks/{response.json()['id']}", json={"url": "https://0x7f.1/hook"})
            assert patched.status_code == 400, patched.text
            assert acme.delete(f"/webhooks/{response.json()['id']}").status_code == 204


class _Listener:
    """A real HTTP receiver on 127.0.0.1 that counts the requests it gets."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        hits: list[str] = []
        self.hits = hits

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("content-length", 0)))
                hits.append(self.path)
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_delivery_dials_the_address_a_numeric_host_denotes() -> None:
    """At delivery the guard judges a numeric host as its address, and the connection goes to
    that address: refused with the guard on (no request arrives), delivered to 127.0.0.1 with
    it off (the number was dialled as the address that was judged)."""
    from notifier.delivery import Sender

    listener = _Listener()

    async def attempt(url: str, *, allow_private: bool) -> Any:
        async with Sender(allow_private=allow_private) as sender:
            return await sender.send(url, b"{}", {})

    try:
        for host in ("2130706433", "127.1", "0x7f.1", "0177.0.0.1", "[::ffff:127.0.0.1]"):
            outcome = asyncio.run(attempt(f"https://{host}:{listener.port}/guarded", allow_private=False))
            assert outcome.status_code is None and "refused by the SSRF guard" in (outcome.error or ""), (host, outcome)
        assert listener.hits == []
        for host in ("2130706433", "127.1", "0x7f.1", "0177.0.0.1"):
            outcome = asyncio.run(attempt(f"http://{host}:{listener.port}/open", allow_private=True))
            assert outcome.status_code == 204, (host, outcome)
        assert listener.hits == ["/open"] * 4
    finally:
        listener.close()


# Spellings of 127.0.0.1 that IDNA maps to ASCII digits and dots: a guard that judged the
# spelling took them for names, while the HTTP client dialled the address they map to.
UNICODE_LOOPBACK = {
    "fullwidth digits": "１２７.０.０.１", "ideographic full stops": "127。0。0。1",
    "mathematical digits": "𝟏𝟐𝟕.𝟎.𝟎.𝟏", "fullwidth number": "２１３０７０６４３３", "hex, ideographic stop": "0x7f。1",
}
UNICODE_LOOPBACK_HOSTS = list(UNICODE_LOOPBACK.values())


def test_delivery_refuses_a_host_that_idna_maps_to_a_private_address() -> None:
    """The guard at delivery (SPEC §7: checked again at each delivery, whatever was let in at
    registration, say under HERALD_WEBHOOK_ALLOW_PRIVATE) judges the host as the client will
    dial it: no connection reaches the loopback listener, however the address is spelt."""
    from notifier.delivery import Sender

    accepted: list[object] = []
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    port = server.getsockname()[1]
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, peer = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            accepted.append(peer)
            conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()

    async def attempts() -> list[Any]:
        async with Sender(allow_private=False) as sender:
            return [await sender.send(f"https://{host}:{port}/hook", b"{}", {}) for host in UNICODE_LOOPBACK_HOSTS]

    try:
        for host, outcome in zip(UNICODE_LOOPBACK_HOSTS, asyncio.run(attempts()), strict=True):
            assert outcome.status_code is None and "refused by the SSRF guard" in (outcome.error or ""), (host, outcome)
        assert accepted == []
    finally:
        stop.set()
        thread.join(5)
        server.close()


@pytest.mark.parametrize("host", UNICODE_LOOPBACK_HOSTS, ids=list(UNICODE_LOOPBACK))
def test_a_host_that_idna_maps_to_a_private_address_is_refused_at_registration(host: str) -> None:
    """The same judgement at registration, without asking DNS what the spelling means."""
    from herald.ssrf import UnsafeUrl, check_url_syntax

    with pytest.raises(UnsafeUrl, match="public address"):
        check_url_syntax(f"https://{host}/hook", allow_private=False)
    check_url_syntax(f"https://{host}/hook", allow_private=True)  # development: allowed


# ----- downloads (SPEC §6, §10) -------------------------------------------------------------------


def _max_age(cache_control: str) -> int | None:
    for directive in (d.strip() for d in cache_control.split(",")):
        if directive.startswith("max-age="):
            return int(directive.removeprefix("max-age="))
    return None


def test_downloads_are_nosniff_and_cached_no_longer_than_their_signature(target: Target) -> None:
    with client(target.base) as acme:
        status = acme.get(f"/jobs/{target.job_id}", follow_redirects=False).json()
        bearer = acme.get(f"/reports/{target.job_id}")
        assert bearer.status_code == 200
        assert bearer.headers["x-content-type-options"] == "nosniff"
        directives = {d.strip() for d in bearer.headers["cache-control"].split(",")}
        assert "private" in directives and ("no-cache" in directives or (_max_age(bearer.headers["cache-control"]) or 0) == 0), \
            bearer.headers["cache-control"]
        again = acme.get(f"/reports/{target.job_id}", headers={"If-None-Match": bearer.headers["etag"]})
        assert again.status_code == 304 and again.headers["cache-control"] == bearer.headers["cache-control"]
    signed_url = status["links"]["result"]
    exp = int(httpx.URL(signed_url).params["exp"])
    for headers in ({}, {"If-None-Match": bearer.headers["etag"]}):
        before = time.time()
        signed = httpx.get(target.base + signed_url, headers=headers, timeout=20)
        assert signed.status_code in (200, 304)
        assert signed.headers["x-content-type-options"] == "nosniff"
        cache_control = signed.headers["cache-control"]
        assert "public" not in cache_control and "private" in cache_control, cache_control
        max_age = _max_age(cache_control)
        assert max_age is not None and 0 < max_age <= exp - before + 1, (cache_control, exp - before)


def test_every_answer_is_nosniff(target: Target) -> None:
    with client(target.base) as acme:
        for path in ("/schema/openapi.json", "/metrics", "/healthz", "/jobs", f"/jobs/{uuid.uuid4()}", "/static/app.js", "/"):
            response = acme.get(path)
            assert response.headers.get("x-content-type-options") == "nosniff", path
        assert httpx.get(target.base + "/jobs").headers.get("x-content-type-options") == "nosniff"  # a 401


# ----- tenant names (SPEC §12) ----------------------------------------------------------------------


BAD_TENANT_NAMES = ["a.b", "acme.*", "events.>", "Acme", "we are", "über", "-x", "x" * 64, "ac\tme"]


@pytest.mark.parametrize("tenant", BAD_TENANT_NAMES)
def test_api_keys_for_tenant_names_that_are_no_ids_are_refused(tenant: str) -> None:
    """A tenant becomes part of NATS subjects: HERALD_API_KEYS takes only the ids the admin API does."""
    with pytest.raises(SettingsError) as refused:
        Settings.from_env({"HERALD_API_KEYS": f"good:key-1,{tenant}:key-2"})
    assert "HERALD_API_KEYS" in str(refused.value) and repr(tenant) in str(refused.value)


@pytest.mark.parametrize("key", ["hk_0123456789abcdef_secret", "hps_1.ZGV2.env-1.sig"])
def test_api_keys_shaped_like_issued_keys_or_portal_sessions_are_refused(key: str) -> None:
    """Such a key would be read as an issued key or a portal session and never authenticate."""
    with pytest.raises(SettingsError) as refused:
        Settings.from_env({"HERALD_API_KEYS": f"acme:{key}"})
    assert "HERALD_API_KEYS" in str(refused.value) and key[4:] not in str(refused.value)


@pytest.mark.parametrize("admin_key", [" " * 40, "an admin key with spaces in it, forty chars", "tab\t" * 10, "short",
                                       "é" * 40, "an-admin-key-with-a-letter-no-header-carries-ü"])
def test_admin_keys_that_could_never_be_sent_are_refused(admin_key: str) -> None:
    with pytest.raises(SettingsError, match="HERALD_ADMIN_KEY"):
        Settings.from_env({"HERALD_ADMIN_KEY": admin_key})


@pytest.mark.parametrize("key", ["k é", "dév-key", "key\u00a0nbsp", "ключ"])
def test_keys_no_header_can_carry_are_refused_naming_the_variable(key: str) -> None:
    """A key a client cannot encode (non-ASCII) or send as one word (a space) could be set, and
    never match: refused at start, as the admin key with them is, never echoing the key."""
    for variable, value in (("HERALD_API_KEYS", f"acme:{key}"), ("HERALD_API_KEY", key)):
        with pytest.raises(SettingsError) as refused:
            Settings.from_env({variable: value})
        assert variable in str(refused.value) and "ASCII" in str(refused.value) and key not in str(refused.value)


def test_the_cli_refuses_such_keys_with_exit_2_not_a_traceback(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERALD_")}
    env.update(HERALD_URL="http://127.0.0.1:9", HERALD_DATA_DIR=str(tmp_path))
    runs = {
        "HERALD_ADMIN_KEY": (["tenants", "list"], {"HERALD_ADMIN_KEY": "é" * 40}),
        "HERALD_API_KEY": (["status", "some-job"], {"HERALD_API_KEY": "dév-key"}),
        "--key": (["status", "some-job", "--key", "dév-key"], {}),
    }
    for name, (argv, extra) in runs.items():
        run = subprocess.run([sys.executable, "-m", "launcher.cli", *argv], env={**env, **extra},
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 2, (name, run.stderr[-2000:])
        assert name in run.stderr and "ASCII" in run.stderr and "Traceback" not in run.stderr, (name, run.stderr)
        assert "dév-key" not in run.stderr and "é" * 40 not in run.stderr, run.stderr


def test_a_gateway_with_such_a_name_refuses_to_start_naming_it(tmp_path: Path) -> None:
    tenant = BAD_TENANT_NAMES[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERALD_")}
    env.update(HERALD_API_KEYS=f"good:key-1,{tenant}:key-2", HERALD_DATA_DIR=str(tmp_path),
               HERALD_NATS_URL="nats://127.0.0.1:9", HERALD_HTTP_PORT="9")
    run = subprocess.run([sys.executable, "-m", "launcher.cli", "gateway"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode != 0
    assert "HERALD_API_KEYS" in run.stderr and repr(tenant) in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize("signing_key", ["secret", "a-long-enough-key-for-now,old"])
def test_a_signing_key_short_enough_to_guess_stops_the_gateway_naming_the_variable(
        signing_key: str, tmp_path: Path) -> None:
    """Every tenant holds signed URLs, each an HMAC of a known message under HERALD_SIGNING_KEY:
    a short key is found offline from one of them, and then anyone forges ``/events?tenant=<any
    tenant>`` (another tenant's whole feed) or a result link. At least 32 characters, as
    HERALD_SECRET_KEY and HERALD_ADMIN_KEY, or the process stops at start saying so."""
    with pytest.raises(SettingsError, match="HERALD_SIGNING_KEY"):
        Settings.from_env({"HERALD_SIGNING_KEY": signing_key})
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERALD_")}
    env.update(HERALD_API_KEYS="acme:key-1", HERALD_SIGNING_KEY=signing_key, HERALD_DATA_DIR=str(tmp_path),
               HERALD_NATS_URL="nats://127.0.0.1:9", HERALD_HTTP_PORT=str(free_port()))
    run = subprocess.run([sys.executable, "-m", "launcher.cli", "gateway"], env=env, capture_output=True, text=True,
                         timeout=30)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "HERALD_SIGNING_KEY" in run.stderr and "32 characters" in run.stderr, run.stderr[-2000:]
    assert signing_key.split(",")[-1] not in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert Settings.from_env({"HERALD_SIGNING_KEY": "n" * 32 + ", " + "o" * 40}).signing_secrets == ("n" * 32, "o" * 40)


@pytest.mark.parametrize("api_keys", ["alpha:shared-key-7f3a,beta:shared-key-7f3a",
                                      "alpha:shared-key-7f3a,alpha:shared-key-7f3a"])
def test_a_key_given_twice_stops_the_gateway_naming_the_variable(api_keys: str, tmp_path: Path) -> None:
    """One key for two tenants was {key: tenant}, last wins: a tenant dropped without a word."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERALD_")}
    env.update(HERALD_API_KEYS=api_keys, HERALD_DATA_DIR=str(tmp_path),
               HERALD_NATS_URL="nats://127.0.0.1:9", HERALD_HTTP_PORT="9")
    run = subprocess.run([sys.executable, "-m", "launcher.cli", "gateway"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "HERALD_API_KEYS" in run.stderr and "repeated" in run.stderr and "'alpha'" in run.stderr, run.stderr
    assert "shared-key-7f3a" not in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize("argv", [["gateway"], ["up"]], ids=" ".join)
def test_an_admin_key_that_is_also_a_tenants_key_stops_at_start_naming_the_tenant(
        argv: list[str], tmp_path: Path) -> None:
    """The admin key's text as a tenant's key in HERALD_API_KEYS would make that tenant's key
    open /admin (SPEC §12: a tenant's key there is 403): refused at start, naming both
    variables and the tenant, never the key, before anything is started or written."""
    shared = "admin-and-tenant-key-0123456789abcdef"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERALD_")}
    env.update(HERALD_ADMIN_KEY=shared, HERALD_API_KEYS=f"other:other-key-0123456789,acme:{shared}",
               HERALD_DATA_DIR=str(tmp_path / "var"), HERALD_NATS_URL="nats://127.0.0.1:9",
               HERALD_HTTP_PORT=str(free_port()))
    run = subprocess.run([sys.executable, "-m", "launcher.cli", *argv], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.startswith("herald: HERALD_ADMIN_KEY") and "HERALD_API_KEYS" in run.stderr, run.stderr[-2000:]
    assert "'acme'" in run.stderr and "'other'" not in run.stderr, run.stderr
    assert shared not in run.stderr + run.stdout and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert not (tmp_path / "var").exists()
    with pytest.raises(SettingsError):
        Settings(admin_key=shared, api_keys={shared: "acme"})


SHARED = "a-key-the-operator-used-twice-0123456789"


@pytest.mark.parametrize(("sent", "kept", "said"), [
    ({"HERALD_API_KEYS": f"other:other-key-0123456789,acme:{SHARED}"}, "HERALD_SIGNING_KEY",
     "herald: HERALD_API_KEYS: the key of tenant 'acme' is also a key of HERALD_SIGNING_KEY"),
    ({"HERALD_API_KEYS": f"acme:{SHARED}"}, "HERALD_SECRET_KEY",
     "herald: HERALD_API_KEYS: the key of tenant 'acme' is also a key of HERALD_SECRET_KEY"),
    ({"HERALD_API_KEYS": "acme:key-acme", "HERALD_ADMIN_KEY": SHARED}, "HERALD_SIGNING_KEY",
     "herald: HERALD_ADMIN_KEY is also a key of HERALD_SIGNING_KEY"),
    ({"HERALD_API_KEYS": "acme:key-acme", "HERALD_ADMIN_KEY": SHARED}, "HERALD_SECRET_KEY",
     "herald: HERALD_ADMIN_KEY is also a key of HERALD_SECRET_KEY"),
], ids=["tenant-signing", "tenant-secret", "admin-signing", "admin-secret"])
def test_a_bearer_key_that_is_also_a_signing_or_sealing_key_stops_at_start(
        sent: dict[str, str], kept: str, said: str, tmp_path: Path) -> None:
    """A key sent in every request's header must not be one that signs links or seals the
    store's secrets. A tenant whose key was HERALD_SIGNING_KEY's could sign any tenant's
    links (``/events?tenant=<another>``: that tenant's whole feed, by its name alone; its
    results); one whose key was HERALD_SECRET_KEY's could open every secret of a copy of the
    store; and either travels in a header that proxies may log. Refused at start, naming the
    variables (and the tenant), never the key, whichever of a rotation's keys it is."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERALD_")}
    env.update(sent, HERALD_DATA_DIR=str(tmp_path / "var"), HERALD_NATS_URL="nats://127.0.0.1:9",
               HERALD_HTTP_PORT=str(free_port()))
    env[kept] = f"a-newer-key-of-32-characters-or-more,{SHARED}"
    run = subprocess.run([sys.executable, "-m", "launcher.cli", "gateway"], env=env, capture_output=True, text=True,
                         timeout=30)
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.startswith(said), run.stderr[-2000:]
    assert "'other'" not in run.stderr and SHARED not in run.stderr + run.stdout, run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "var").exists(), run.stderr[-2000:]


BAD_DSN_PASSWORD = "PgSecr/et?P#W@rd"


@pytest.mark.parametrize(("variable", "url", "hidden"), [
    ("HERALD_DATABASE_URL", "postgresql://herald:PgSecr/etPW@127.0.0.1:5432/herald", ("PgSecr", "etPW")),  # '/' ends the netloc: 'PgSecr' read as the port
    ("HERALD_DATABASE_URL", "postgresql://herald:PgSecr#etPW@127.0.0.1:5432/herald", ("PgSecr", "etPW")),
    ("HERALD_DATABASE_URL", "postgresql://herald:PgSecr?etPW@127.0.0.1:5432/herald", ("PgSecr", "etPW")),
    ("HERALD_DATABASE_URL", "postgresql://herald:PgSecr@etPW@127.0.0.1:5432/herald", ("PgSecr", "etPW")),  # 'etPW@127.0.0.1' would be dialled as a host
    ("HERALD_DATABASE_URL", "postgresql://herald:pw@db.example:PgSecr/herald", ("PgSecr",)),
    ("HERALD_DATABASE_URL", "postgresql://[::1/herald", ("::1",)),
    # The same of NATS's, and a typo'd port: each process retried its first connect for ever.
    ("HERALD_NATS_URL", "nats://herald:NatsSecret@127.0.0.1:notaport", ("Secret", "127.0.0.1")),
    ("HERALD_NATS_URL", "nats://herald:Nats/Secret@127.0.0.1:4222", ("Nats", "Secret")),
    ("HERALD_NATS_URL", "nats://herald:Nats@Secret@127.0.0.1:4222", ("Nats", "Secret")),
    ("HERALD_NATS_URL", "nats://127.0.0.1:4222,nats://herald:NatsSecret@127.0.0.1:99999", ("Secret", "127.0.0.1")),
    ("HERALD_NATS_URL", "http://herald:NatsSecret@127.0.0.1:4222", ("Secret", "127.0.0.1")),
])
def test_a_service_url_whose_host_cannot_be_read_is_refused_without_showing_it(
    variable: str, url: str, hidden: tuple[str, ...]
) -> None:
    """A password with an unencoded '/', '?', '#' or '@' cuts the URL's host part short, and
    asyncpg then failed in the store's first connect with the password's start as the "port"
    in its message, logged with the traceback on every retry. Refused when the settings are
    read, naming the variable and the fix, never a part of the URL."""
    with pytest.raises(SettingsError) as refused:
        Settings.from_env({variable: url})
    message = str(refused.value)
    assert message.startswith(variable) and "percent-encoded" in message, message
    assert not [part for part in hidden if part in message], message


def test_database_urls_asyncpg_reads_are_taken_as_they_are() -> None:
    from urllib.parse import quote

    for url in (f"postgresql://herald:{quote(BAD_DSN_PASSWORD, safe='')}@127.0.0.1:5432/herald",
                "postgresql://u:pw@h1:5432,h2:5433/herald", "postgres://u@[::1]:5432/herald",
                "postgresql:///herald?host=/run/postgresql", "postgresql://db.example/herald?user=a@b"):
        assert Settings.from_env({"HERALD_DATABASE_URL": url}).database_url == url


@pytest.mark.parametrize(("component", "variable", "url", "hidden"), [
    ("gateway", "HERALD_DATABASE_URL", "postgresql://herald:PgSecr/etPW@127.0.0.1:9/herald", "PgSecr"),
    ("worker", "HERALD_NATS_URL", "nats://herald:NatsSecret@127.0.0.1:42222x", "NatsSecret"),
])
def test_a_process_with_an_unreadable_service_url_stops_at_start_without_showing_it(
    tmp_path: Path, component: str, variable: str, url: str, hidden: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERALD_")}
    env.update(HERALD_SECRET_KEY="k" * 40, HERALD_DATA_DIR=str(tmp_path), HERALD_NATS_URL="nats://127.0.0.1:9",
               HERALD_HTTP_PORT=str(free_port()), HERALD_LOG_LEVEL="debug")
    env[variable] = url
    run = subprocess.run([sys.executable, "-m", "launcher.cli", component], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.startswith(f"herald: {variable}"), run.stderr[-2000:]
    assert hidden not in run.stderr + run.stdout and "Traceback" not in run.stderr, run.stderr[-2000:]


def test_nats_urls_nats_py_dials_are_taken_as_they_are() -> None:
    for url in ("nats://127.0.0.1:4222", "127.0.0.1:4222", "nats://u:pw@h1:4222,nats://u:pw@h2:4223",
                "tls://[::1]:4222", "nats://u:p%2Fw@nats.example", "wss://nats.example:443"):
        assert Settings.from_env({"HERALD_NATS_URL": url}).nats_url == url


def test_a_database_url_with_an_sslmode_asyncpg_does_not_know_is_refused() -> None:
    with pytest.raises(SettingsError, match="^HERALD_DATABASE_URL: its sslmode must be one of"):
        Settings.from_env({"HERALD_DATABASE_URL": "postgresql://herald:PgSecret@db.example/herald?sslmode=bogus"})
    for mode in ("disable", "prefer", "require", "verify-full"):
        Settings.from_env({"HERALD_DATABASE_URL": f"postgresql://h@db.example/herald?sslmode={mode}"})


# ----- HERALD_API_KEYS beyond loopback --------------------------------------------------------------


EXPOSED_HOSTS = ["0.0.0.0", "::", "192.0.2.10", "gateway.example.com"]
LOOPBACK_HOSTS = ["127.0.0.1", "127.0.0.53", "::1", "localhost"]


def test_short_api_keys_are_refused_only_where_the_gateway_listens_beyond_loopback() -> None:
    """Anyone who reaches a gateway on a public address can try keys, and an operator's key may be
    a word: there HERALD_API_KEYS takes only keys of at least 16 characters. On loopback (the
    README's `dev-key`, the smoke check's `smoke-key`) any length still does."""
    short = {"HERALD_API_KEYS": "acme:key-acme,globex:0123456789abcdef,initech:x"}
    for host in EXPOSED_HOSTS:
        with pytest.raises(SettingsError) as refused:
            check_exposed_api_keys(Settings.from_env({**short, "HERALD_HTTP_HOST": host}))
        message = str(refused.value)
        assert message.startswith("HERALD_API_KEYS") and "16 characters" in message and repr(host) in message
        assert "'acme'" in message and "'initech'" in message and "globex" not in message, message
        assert "key-acme" not in message and "acme:x" not in message, message
    for host in LOOPBACK_HOSTS:
        check_exposed_api_keys(Settings.from_env({**short, "HERALD_HTTP_HOST": host}))
        check_exposed_api_keys(Settings.from_env({"HERALD_API_KEYS": "dev:dev-key", "HERALD_HTTP_HOST": host}))
    check_exposed_api_keys(Settings.from_env({"HERALD_API_KEYS": "acme:0123456789abcdef", "HERALD_HTTP_HOST": "0.0.0.0"}))
    check_exposed_api_keys(Settings.from_env({"HERALD_HTTP_HOST": "0.0.0.0"}))  # no keys: /admin's only


@pytest.mark.parametrize("argv", [["gateway"], ["gateway", "--host", "0.0.0.0"], ["up"], ["up", "--host", "0.0.0.0"]],
                         ids=" ".join)
def test_a_gateway_beyond_loopback_with_a_short_key_stops_at_start_naming_the_variable(
        argv: list[str], tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERALD_")}
    env.update(HERALD_API_KEYS="acme:key-acme", HERALD_DATA_DIR=str(tmp_path), HERALD_NATS_URL="nats://127.0.0.1:9",
               HERALD_HTTP_PORT=str(free_port()))
    if "--host" not in argv:
        env["HERALD_HTTP_HOST"] = "0.0.0.0"
    run = subprocess.run([sys.executable, "-m", "launcher.cli", *argv], env=env, capture_output=True, text=True,
                         timeout=30)
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.startswith("herald: HERALD_API_KEYS") and "16 characters" in run.stderr, run.stderr[-2000:]
    assert "'acme'" in run.stderr and "key-acme" not in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert not (tmp_path / "admin.key").exists()  # `herald up` stopped before it provisioned anything


def test_a_gateway_beyond_loopback_serves_a_long_enough_key(fresh: Deployment) -> None:
    key = "acme-key-0123456789"
    base = fresh.start_gateway(HERALD_HTTP_HOST="0.0.0.0", HERALD_API_KEYS=f"acme:{key},globex:{'g' * 16}")
    assert httpx.get(base + "/webhooks", headers={"Authorization": f"Bearer {key}"}, timeout=20).status_code == 200
    assert httpx.get(base + "/webhooks", headers={"Authorization": "Bearer key-acme"}, timeout=20).status_code == 401


def test_the_admin_api_refuses_a_tenant_id_with_a_trailing_newline(target: Target) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for bad in ("acme2\n", "acme2\r\n", "a.b", "A"):
        response = httpx.post(target.base + "/admin/tenants", json={"id": bad}, headers=admin, timeout=20)
        assert response.status_code == 400, (bad, response.text)
        assert response.json()["errors"][0]["field"] == "id"


def test_the_event_stream_link_carries_the_tenant_as_a_query_value(target: Target) -> None:
    with client(target.base) as acme:
        for path in ("/events/link", "/webhooks/events/link"):
            link = acme.post(path).json()["url"]
            url = httpx.URL(link)
            assert url.params["tenant"] == "acme" and set(url.params) == {"exp", "sig", "tenant"}, link
            with httpx.stream("GET", target.base + link, timeout=20) as stream:
                assert stream.status_code == 200, link


# ----- internal services need credentials; files are the owner's (issue 23 §5) ------------------


async def _nats_refuses(url: str, **auth: str) -> bool:
    import nats

    try:
        nc = await nats.connect(url, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0, **auth)
    except Exception as exc:  # noqa: BLE001  (nats-py raises the server's -ERR as several types)
        return "authorization" in repr(exc).lower()
    await nc.close()
    return False


async def _nats_accepts(settings_env: dict[str, str]) -> bool:
    """Connect the way every Herald process does (herald.jetstream.connect, from settings)."""
    from herald import jetstream
    from herald.settings import Settings

    nc = await jetstream.connect(Settings.from_env(settings_env), name="test")
    try:
        await nc.jetstream().account_info()
        return True
    finally:
        await nc.close()


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def _child_environ(pid: int, command: str) -> dict[str, str]:
    """The environment of the live child of ``pid`` that runs ``herald <command>``."""
    import psutil

    for child in psutil.Process(pid).children():
        try:
            if child.cmdline()[-2:] == ["launcher.cli", command]:
                return dict(child.environ())
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no `herald {command}` child of {pid}")


def _config_passwords(conf: Path) -> list[str]:
    """The ``password:`` values of a nats-server config that Herald generated."""
    return [line.split('"')[1] for line in conf.read_text().splitlines() if line.strip().startswith("password:")]


def test_herald_up_starts_nats_with_credentials_and_keeps_its_files_private(tmp_path: Path) -> None:
    from tests.harness import wait_until

    port, nats_port, data = free_port(), free_port(), tmp_path / "var"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERALD_")}
    env.update(HERALD_API_KEYS="acme:up-key", HERALD_HTTP_PORT=str(port), HERALD_NATS_PORT=str(nats_port),
               HERALD_DATA_DIR=str(data), HERALD_REPORT_PAGE_MS="20", HERALD_LOG_LEVEL="warning")
    log = open(tmp_path / "up.log", "wb")  # noqa: SIM115  (closed below)
    up = subprocess.Popen([sys.executable, "-m", "launcher.cli", "up"], env=env, stdout=log, stderr=log,
                          start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            try:
                return httpx.get(base + "/readyz", timeout=2, verify=TLS).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, timeout=60, interval=0.2, what="herald up ready")
        # The children are handed the generated credentials in HERALD_NATS_URL (their environment) ...
        url = urlsplit(_child_environ(up.pid, "gateway")["HERALD_NATS_URL"])
        password = url.password or ""
        assert url.username == "herald" and len(password) >= 32 and url.port == nats_port
        assert password not in (tmp_path / "up.log").read_text(errors="replace")
        # ... while the 0600 config keeps only a bcrypt hash of the password: no plaintext at rest,
        # and no "Plaintext passwords detected" from nats-server.
        conf = data / "nats-server.conf"
        assert _mode(conf) == 0o600
        assert password not in conf.read_text()
        [stored] = _config_passwords(conf)
        assert stored.startswith("$2a$") and bcrypt.checkpw(password.encode(), stored.encode())
        assert "Plaintext passwords" not in (tmp_path / "up.log").read_text(errors="replace")
        # The admin key goes to the gateway alone, which serves /admin: a worker runs job handlers,
        # code that reads its environment, and neither it nor the notifier has a use for the key.
        assert _child_environ(up.pid, "gateway")["HERALD_ADMIN_KEY"] == (data / "admin.key").read_text().strip()
        assert "HERALD_ADMIN_KEY" not in _child_environ(up.pid, "worker")
        assert "HERALD_ADMIN_KEY" not in _child_environ(up.pid, "notifier")
        # nats-server is handed none of Herald's settings: the admin key and the API keys are not its.
        import psutil

        [nats_server] = [p for p in psutil.Process(up.pid).children() if p.name() == "nats-server"]
        assert not [k for k in nats_server.environ() if k.startswith("HERALD_")], nats_server.environ()
        # A client without credentials, with wrong ones, or with the hash for a password is turned
        # away; the generated ones open it, as the children do.
        assert asyncio.run(_nats_refuses(f"nats://127.0.0.1:{nats_port}"))
        assert asyncio.run(_nats_refuses(f"nats://herald:guess@127.0.0.1:{nats_port}"))
        assert asyncio.run(_nats_refuses(f"nats://127.0.0.1:{nats_port}", user="herald", password=stored))
        assert asyncio.run(_nats_accepts({"HERALD_NATS_URL": f"nats://herald:{password}@127.0.0.1:{nats_port}"}))

        with httpx.Client(base_url=base, headers={"Authorization": "Bearer up-key"}, timeout=20) as http:
            job = http.post("/reports", json={"title": "private", "pages": 1}).json()
            wait_for_state(http, job["id"], {"succeeded"}, timeout=60)
        # Everything Herald keeps is its owner's alone.
        assert _mode(data) == 0o700
        for name in ("herald.db", "herald.db-wal", "herald.db-shm", "admin.key", "secret.key"):
            if (data / name).exists() or name in ("herald.db", "admin.key", "secret.key"):
                assert _mode(data / name) == 0o600, name
        assert _mode(data / "results") == 0o700
        results = [p for p in (data / "results").rglob("*") if p.is_file()]
        assert results and all(_mode(p) == 0o600 for p in results), [(p, oct(_mode(p))) for p in results]
        assert _mode(data / "nats") == 0o700
    finally:
        _stop_up(up)
        log.close()


def _stop_up(up: subprocess.Popen[bytes]) -> None:
    """Ctrl-C to ``herald up``; its whole group killed if it has not stopped within 30 s."""
    up.send_signal(signal.SIGINT)
    try:
        up.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(up.pid, signal.SIGKILL)
        up.wait()


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_generated_key_file_others_may_read_is_refused_naming_it(tmp_path: Path, mode: int) -> None:
    """admin.key, dev.key and --cluster's postgres.password are made 0600 (README); one found
    with any group or other bit (copied in, restored from a backup) may already be known, so it
    is refused as secret.key is, naming the file and not the key; an owner-only one is used."""
    from herald.keyfiles import load_or_create

    path = tmp_path / "admin.key"
    path.write_text("a-key-others-could-read-0123456789abcdef\n")
    path.chmod(mode)
    with pytest.raises(SettingsError) as refused:
        load_or_create(path)
    assert str(path) in str(refused.value) and "chmod 600" in str(refused.value)
    assert "a-key-others-could-read" not in str(refused.value)
    path.chmod(0o600)
    assert load_or_create(path) == "a-key-others-could-read-0123456789abcdef"


def test_herald_up_with_an_admin_key_file_others_may_read_stops_at_start_naming_it(tmp_path: Path) -> None:
    """Before it starts anything: exit 2, one line naming the file, no traceback, no key."""
    data = tmp_path / "var"
    data.mkdir(mode=0o700)
    (data / "admin.key").write_text("an-admin-key-others-could-read-0123456789\n")
    (data / "admin.key").chmod(0o644)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERALD_")}
    env.update(HERALD_DATA_DIR=str(data), HERALD_HTTP_PORT=str(free_port()), HERALD_NATS_PORT=str(free_port()))
    run = subprocess.run([sys.executable, "-m", "launcher.cli", "up"], env=env, capture_output=True, text=True,
                         timeout=30)
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.startswith(f"herald: {data / 'admin.key'}") and "chmod 600" in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr and "an-admin-key-others" not in run.stderr + run.stdout, run.stderr
    assert not (data / "nats-server.conf").exists()  # stopped before NATS was started


def test_herald_up_never_prints_an_admin_key_the_operator_set(tmp_path: Path) -> None:
    """The banner shows the admin key herald up generated (SPEC §12); one the operator set in
    HERALD_ADMIN_KEY (from a secret store, say) is theirs already and is not echoed to stdout,
    which a service manager keeps in a log more people read than hold that key."""
    from tests.harness import wait_until

    admin_key = "operator-set-admin-key-" + "x" * 20
    port, nats_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERALD_")}
    env.update(HERALD_API_KEYS="acme:up-key", HERALD_ADMIN_KEY=admin_key, HERALD_HTTP_PORT=str(port),
               HERALD_NATS_PORT=str(nats_port), HERALD_DATA_DIR=str(tmp_path / "var"), HERALD_WORKERS="1",
               HERALD_LOG_LEVEL="warning")
    out, err = open(tmp_path / "up.out", "wb"), open(tmp_path / "up.err", "wb")  # noqa: SIM115  (closed below)
    up = subprocess.Popen([sys.executable, "-m", "launcher.cli", "up"], env=env, stdout=out, stderr=err,
                          start_new_session=True)
    try:
        wait_until(lambda: "Herald is up at" in (tmp_path / "up.out").read_text(errors="replace") or up.poll() is not None,
                   timeout=60, interval=0.2, what="the banner")
        banner = (tmp_path / "up.out").read_text(errors="replace")
        assert "Herald is up at" in banner, (tmp_path / "up.err").read_text(errors="replace")[-2000:]
        assert "admin key (HERALD_ADMIN_KEY" in banner and "not shown" in banner, banner
        admin = httpx.get(f"http://127.0.0.1:{port}/admin/tenants", headers={"Authorization": f"Bearer {admin_key}"},
                          timeout=10)
        assert admin.status_code == 200, admin.text  # the key works: it was set, only not shown
        assert not (tmp_path / "var" / "admin.key").exists()
    finally:
        _stop_up(up)
        out.close()
        err.close()
    for name in ("up.out", "up.err"):
        assert admin_key not in (tmp_path / name).read_text(errors="replace"), name


def test_external_nats_credentials_come_from_the_url_or_a_creds_file(tmp_path: Path) -> None:
    from herald.jetstream import auth_options
    from herald.settings import Settings, SettingsError, redact_url

    url = "nats://herald:s%40cret@10.0.0.1:4222,nats://10.0.0.2:4222"
    settings = Settings.from_env({"HERALD_NATS_URL": url})
    assert auth_options(settings) == {"user": "herald", "password": "s@cret"}  # for the announced servers too
    assert auth_options(Settings.from_env({"HERALD_NATS_URL": "nats://tok@10.0.0.1:4222"})) == {"token": "tok"}
    assert "s%40cret" not in repr(settings) and "s%40cret" not in redact_url(url)
    assert redact_url(url) == "nats://herald:***@10.0.0.1:4222,nats://10.0.0.2:4222"
    # libpq's and asyncpg's password in the query, as a banner would print HERALD_DATABASE_URL
    assert redact_url("postgresql://herald@db:5432/herald?sslmode=require&password=s3cr&t") == \
        "postgresql://***@db:5432/herald?sslmode=require&password=***&t"  # a lone userinfo may be a token
    assert redact_url("postgresql://db/herald?PASSWORD=s3cr#x") == "postgresql://db/herald?PASSWORD=***#x"
    creds = tmp_path / "herald.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\n")
    assert auth_options(Settings.from_env({"HERALD_NATS_CREDS": str(creds)})) == {"user_credentials": str(creds)}
    with pytest.raises(SettingsError, match="HERALD_NATS_CREDS"):
        Settings.from_env({"HERALD_NATS_CREDS": str(tmp_path / "missing.creds")})


# ----- pages load nothing from elsewhere (SPEC §10) -------------------------------------------------

HTML_PAGES = ["/", "/portal", "/schema", "/schema/", "/schema/swagger", "/schema/redoc", "/schema/rapidoc",
              "/schema/elements", "/schema/stoplight", "/schema/scalar", "/schema/oauth2-redirect.html"]


class _Sources(HTMLParser):
    """Every URL a page loads: script src, link href, img/iframe src, and any inline script."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.inline_scripts = 0
        self._in_script_without_src = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag == "script":
            if values.get("src"):
                self.urls.append(values["src"] or "")
            else:
                self._in_script_without_src = True
        elif tag == "link" and values.get("href"):
            self.urls.append(values["href"] or "")
        elif tag in ("img", "iframe", "embed", "source") and values.get("src"):
            self.urls.append(values["src"] or "")

    def handle_data(self, data: str) -> None:
        if self._in_script_without_src and data.strip():
            self.inline_scripts += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script_without_src = False


def test_every_html_page_loads_only_herald_s_own_files_under_a_csp(target: Target) -> None:
    with httpx.Client(base_url=target.base, timeout=20) as anonymous:
        for path in HTML_PAGES:
            page = anonymous.get(path, follow_redirects=True)
            if not page.headers.get("content-type", "").startswith("text/html"):
                assert page.status_code == 404, path
                continue
            sources = _Sources()
            sources.feed(page.text)
            assert sources.inline_scripts == 0, f"{path}: inline script"
            for url in sources.urls:
                assert url.startswith("/") and not url.startswith("//"), f"{path} loads {url}"
                asset = anonymous.get(url)
                assert asset.status_code == 200, f"{path}: {url} -> {asset.status_code}"
                assert asset.headers["x-content-type-options"] == "nosniff"
                assert asset.headers["content-type"].count("charset=") <= 1, asset.headers["content-type"]
            if page.status_code == 200:
                policy = page.headers.get("content-security-policy", "")
                directives = {d.strip().split(" ")[0]: d.strip() for d in policy.split(";") if d.strip()}
                assert directives.get("default-src") == "default-src 'none'", f"{path}: {policy!r}"
                assert directives.get("script-src") == "script-src 'self'", f"{path}: {policy!r}"
                assert "unsafe-inline" not in policy and "http" not in policy, f"{path}: {policy!r}"
        browser_page = anonymous.get("/schema")
        assert browser_page.status_code == 200 and "/schema/assets/swagger-ui-bundle.js" in browser_page.text
        assert anonymous.get("/schema/assets/index.html").status_code == 404  # only the two files used
        assert anonymous.get("/schema/openapi.json").json()["openapi"].startswith("3.")


def test_the_api_browser_renders_every_operation_with_no_csp_violation(target: Target) -> None:
    """/schema in real headless Chromium: Swagger UI (served by Herald) shows the document's
    operations; the CSP blocks nothing it needs, and no request leaves the origin."""
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium_path = shutil.which("chromium")
    if chromium_path is None:
        pytest.skip("Debian chromium is not installed (make browser-deps)")
    document = httpx.get(target.base + "/schema/openapi.json", timeout=20).json()
    operations = {op["operationId"] for item in document["paths"].values() for op in item.values()
                  if isinstance(op, dict) and "operationId" in op}
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path, headless=True, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        try:
            page = browser.new_page()
            problems: list[str] = []
            requested: list[str] = []
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.on("request", lambda r: requested.append(r.url))
            page.goto(target.base + "/schema")
            page.wait_for_selector(".opblock", timeout=30_000)
            shown = page.locator(".opblock").count()
            assert shown >= len(operations) - 5, (shown, len(operations))
            assert not [p for p in problems if "Content Security Policy" in p or "Refused" in p], problems
            assert all(u.startswith(target.base) or u.startswith("data:") for u in requested), requested
        finally:
            browser.close()


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/webhooks", {"url": "http://127.0.0.1:9/a\u0000b"}, "url"),
    ("/webhooks", {"url": "http://127.0.0.1:9/a\nb"}, "url"),
    ("/exports", {"format": "csv", "rows": 1, "callback_url": "http://127.0.0.1:9/\u0000"}, "callback_url"),
])
def test_control_characters_in_urls_are_named_400s(target: Target, path: str, body: dict[str, Any], field: str) -> None:
    """A NUL in a URL once reached PostgreSQL (which stores no NUL in text) and came back a 500."""
    with client(target.base) as http:
        answer = http.post(path, json=body)
    assert answer.status_code == 400, answer.text
    assert [e["field"] for e in answer.json()["errors"]] == [field]


def test_control_characters_in_a_key_name_are_a_named_400(target: Target) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for name in ("a\u0000b", "line\n", "tab\there"):
        answer = httpx.post(target.base + "/admin/tenants/acme/keys", json={"name": name}, headers=admin, timeout=10)
        assert answer.status_code == 400, (name, answer.text)
        assert answer.json()["errors"][0]["field"] == "name"
