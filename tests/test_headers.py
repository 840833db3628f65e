"""The HTTP edge (``gateway/headers.py``) on a real gateway: request-head limits under
httptools, whichever way a head arrives, and response header names read in any case."""

from __future__ import annotations

import http.client
import json
import socket

from gateway.headers import MAX_RAW_HEAD_BYTES
from tests.harness import KEYS, Deployment


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


def _data_segments_in(sock: socket.socket) -> int:
    """Segments with data this socket has received (Linux ``tcp_info.tcpi_data_segs_in``)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return int.from_bytes(info[152:156], "little")


def _exchange(sock: socket.socket, request: bytes) -> tuple[bytes, int]:
    """Send one keep-alive request; its whole answer (by content-length) and the data segments
    it came in."""
    before = _data_segments_in(sock)
    sock.sendall(request)
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(65536)
    head, _, body = received.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body, _data_segments_in(sock) - before


def test_a_response_of_known_length_leaves_in_one_write(herald: Deployment) -> None:
    """Head and body in one segment (one write at the gateway, not two): a 202, a status and a
    404 problem, on one keep-alive connection; and a HEAD request still gets its head."""
    gateway = ("127.0.0.1", herald.ports["gateway"])
    auth = f"Authorization: Bearer {KEYS['acme']}\r\n"
    body = b'{"title": "one write", "pages": 1}'
    start = (f"POST /reports HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: application/json\r\n"
             f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with socket.create_connection(gateway, timeout=10) as sock:
        sock.settimeout(10)
        accepted, segments = _exchange(sock, start)
        assert accepted.startswith(b"HTTP/1.1 202 "), accepted[:300]
        assert segments == 1, accepted
        location = next(line.split(b":", 1)[1].strip() for line in accepted.split(b"\r\n")
                        if line.lower().startswith(b"location:")).decode()
        status, segments = _exchange(sock, f"GET {location} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}\r\n".encode())
        assert status.startswith(b"HTTP/1.1 200 ") and segments == 1, status[:300]
        missing, segments = _exchange(sock, f"GET /jobs/nope HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}\r\n".encode())
        assert missing.startswith(b"HTTP/1.1 404 ") and segments == 1, missing[:300]
    with socket.create_connection(gateway, timeout=10) as sock:
        sock.sendall(b"HEAD /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        head = answer(sock)  # whatever the status, the head arrives, with no body, and the connection closes
    assert head.startswith(b"HTTP/1.1 ") and head.endswith(b"\r\n\r\n") and b"content-length" in head.lower(), head
