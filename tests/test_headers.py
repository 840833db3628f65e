"""The HTTP edge (``gateway/headers.py``) on a real gateway: request-head limits under
httptools, whichever way a head arrives, and response header names read in any case."""

from __future__ import annotations

import http.client
import json
import socket

from gateway.headers import MAX_RAW_HEAD_BYTES
from tests.harness import KEYS, Deployment, client, wait_for_state


def answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(10)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def test_a_head_that_never_ends_is_refused_with_431_and_the_connection_closed(herald: Deployment) -> None:
    """Sent in pieces, one header line after another without the blank line that ends a
    head: the server stops collecting past its bound instead of buffering without end."""
    with socket.create_connection(("127.0.0.1", herald.ports["gateway"]), timeout=10) as sock:
        sock.sendall(b"GET /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        line = b"X-Filler: " + b"y" * 4000 + b"\r\n"
        sent = 0
        try:
            while sent < 4 * MAX_RAW_HEAD_BYTES:
                sock.sendall(line)
                sent += len(line)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused and closed before all of it was sent: what this test wants
        received = answer(sock)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), received[:200]
    assert json.loads(body)["type"] == "/problems/headers-too-large"


def test_a_complete_head_over_the_limit_is_refused_with_431(herald: Deployment) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", herald.ports["gateway"], timeout=10)
    connection.request("GET", "/jobs", headers={"X-Filler": "y" * 20_000})
    response = connection.getresponse()
    assert response.status == 431 and response.getheader("Content-Type") == "application/problem+json"
    connection.close()


def test_a_large_body_in_the_same_packets_as_its_head_is_no_long_head(herald: Deployment) -> None:
    """The bound counts only bytes of an unfinished head, never a body that follows it."""
    body = b'{"title": "a body of blanks", "pages": 1' + b" " * (4 * MAX_RAW_HEAD_BYTES) + b"}"
    request = (f"POST /reports HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEYS['acme']}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", herald.ports["gateway"]), timeout=10) as sock:
        sock.sendall(request + body)
        received = answer(sock)
    assert received.startswith(b"HTTP/1.1 202 "), received[:300]


def test_header_names_are_found_in_any_case(herald: Deployment) -> None:
    """Names go out lower-case (httptools); HTTP names are case-insensitive, and so are the
    lookups of every client (``getheader``, httpx, urllib: the public smoke check's)."""
    connection = http.client.HTTPConnection("127.0.0.1", herald.ports["gateway"], timeout=10)
    connection.request("POST", "/reports", body=b'{"title": "case", "pages": 1}',
                       headers={"Authorization": f"Bearer {KEYS['acme']}", "Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 202
    for name in ("Location", "Retry-After", "Cache-Control", "Content-Type", "X-Request-ID"):
        assert response.getheader(name) and response.getheader(name) == response.getheader(name.lower()), name
    connection.close()


def test_head_answers_as_get_without_the_body(herald: Deployment) -> None:
    """HEAD is GET without the body (RFC 9110 §9.3.2): the same status and headers for a
    status, a result, a page and a stream (which must not be held open), 405 where GET is not."""
    with client(herald.url()) as acme:
        job = acme.post("/reports", json={"title": "head", "pages": 1}).json()
        done = wait_for_state(acme, job["id"], {"succeeded"})
        checks = {
            f"/jobs/{done['id']}": 303,
            f"/reports/{done['id']}": 200,
            f"/jobs/{done['id']}/events": 200,
            "/events": 200,
            "/portal": 200,
            "/reports": 405,
        }
        for path, status in checks.items():
            got = acme.get(path, follow_redirects=False) if path != "/events" else None
            head = acme.head(path, timeout=10)
            assert head.status_code == status, (path, head.status_code, head.text[:200])
            assert head.content == b"", path
            if got is not None and status != 405:
                assert head.headers["content-type"] == got.headers["content-type"], path
        pdf = acme.get(f"/reports/{done['id']}")
        head = acme.head(f"/reports/{done['id']}")
        assert head.headers["etag"] == pdf.headers["etag"]
        assert head.headers["content-length"] == str(len(pdf.content))
