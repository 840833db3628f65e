"""The HTTP edge (``gateway/headers.py``) on a real gateway: request-head limits under
httptools, whichever way a head arrives, and response header names read in any case."""

from __future__ import annotations

import contextlib
import gzip
import http.client
import json
import re
import socket
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

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


async def test_a_head_that_stops_arriving_is_408_and_an_idle_connection_is_closed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The server bounds no head in time: one sent in part, or nothing at all, held its
    connection for as long as the client kept it open. The gateway's own protocol, on a
    server of its own here, with ``HEAD_WITHIN_S`` shortened."""
    import asyncio

    from gateway import headers

    monkeypatch.setattr(headers, "HEAD_WITHIN_S", 0.5)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})

    async with _serving(app) as port:

        async def exchange(*sends: bytes) -> tuple[bytes, float]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            started = asyncio.get_running_loop().time()
            for data in sends:
                writer.write(data)
            received = await asyncio.wait_for(reader.read(), timeout=5)  # to the server's close
            writer.close()
            return received, asyncio.get_running_loop().time() - started

        partial, waited = await exchange(b"GET /jobs HTTP/1.1\r\nHost: h\r\n")
        assert partial.startswith(b"HTTP/1.1 408 ") and b"connection: close" in partial.lower(), partial
        assert json.loads(partial.partition(b"\r\n\r\n")[2])["type"] == "/problems/request-timeout"
        assert 0.4 < waited < 3, waited
        idle, _ = await exchange()
        assert idle == b""  # closed, no answer to a request that never began
        # Kept alive: the next head is due from its own first byte, and a whole one is served.
        kept, _ = await exchange(b"GET /a HTTP/1.1\r\nHost: h\r\n\r\n", b"GET /b HTTP/1.1\r\n")
        assert kept.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 408 " in kept, kept


async def test_an_answer_its_client_stops_taking_is_reset_and_one_it_takes_is_sent_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The server bounds no write in time: a client that read a download's first bytes and then
    nothing held its connection, and what its answer held open, for as long as it kept the
    socket (a tenant holding hundreds such took the gateway's file descriptors, and every other
    tenant's requests were reset). Now its connection is reset once it has taken nothing for
    ``SEND_WITHIN_S``; a client that keeps reading gets every byte. A server of its own, with
    the bound shortened."""
    import asyncio

    from gateway import headers

    monkeypatch.setattr(headers, "SEND_WITHIN_S", 2.0)  # far above a loaded machine's stall of a reader
    piece, pieces = b"x" * 65536, 512  # 32 MiB: far more than the sockets' buffers hold
    answered: list[asyncio.Event] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            done = asyncio.Event()
            answered.append(done)
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", str(len(piece) * pieces).encode())]})
            for _ in range(pieces):
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            done.set()

    async with _serving(app) as port:
        request = b"GET /download HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"

        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=65536)
        writer.write(request)
        assert (await reader.read(4096)).startswith(b"HTTP/1.1 200 ")
        # Then nothing more is read: the server's send stops, and its answer ends once the bound passed.
        await asyncio.wait_for(answered[0].wait(), timeout=30)
        received = 0
        with contextlib.suppress(ConnectionError):
            while chunk := await asyncio.wait_for(reader.read(1 << 20), timeout=30):
                received += len(chunk)
        assert received < len(piece) * pieces, "cut off, not sent whole"
        writer.close()

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        whole = b""
        while chunk := await asyncio.wait_for(reader.read(1 << 20), timeout=30):
            whole += chunk
        assert whole.endswith(piece) and len(whole.partition(b"\r\n\r\n")[2]) == len(piece) * pieces
        writer.close()


@contextlib.asynccontextmanager
async def _serving(app: Any) -> AsyncIterator[int]:
    """``app`` behind the gateway's own protocol (``launcher.cli.server_config``), on a server of
    its own on 127.0.0.1; yields its port."""
    import asyncio

    import uvicorn

    from launcher.cli import server_config

    config = server_config(app, "127.0.0.1", 0)
    config.lifespan, config.loop = "off", "asyncio"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve(sockets=[taken]))
        try:
            while not server.started:
                await asyncio.sleep(0.01)
            yield taken.getsockname()[1]
        finally:
            server.should_exit = True
            await serving


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


def test_a_header_read_once_and_sent_twice_is_refused_and_starts_nothing(herald: Deployment) -> None:
    """Two keys, or two media types for one body: which one speaks for the request cannot be
    told, and the framework read the first (acme's key, a start as application/json)."""
    body = b'{"title": "twice", "pages": 1}'
    acme, globex = (f"Bearer {KEYS[tenant]}" for tenant in ("acme", "globex"))
    with httpx.Client(base_url=herald.url(), timeout=20) as http:
        before = herald.count_rows("jobs")
        two_keys = http.post("/reports", content=body, headers=httpx.Headers([
            ("Authorization", acme), ("Authorization", globex), ("Content-Type", "application/json")]))
        assert two_keys.status_code == 401, two_keys.text
        assert "one Authorization header" in two_keys.json()["detail"]
        assert http.get("/jobs", headers=httpx.Headers([("Authorization", acme), ("Authorization", acme)])
                        ).status_code == 401
        two_types = http.post("/reports", content=body, headers=httpx.Headers([
            ("Authorization", acme), ("Content-Type", "application/json"), ("Content-Type", "text/plain")]))
        assert two_types.status_code == 415, two_types.text
        assert two_types.json()["type"] == "/problems/unsupported-media-type"
        assert herald.count_rows("jobs") == before


def test_a_body_in_a_content_coding_is_refused_as_such_and_starts_nothing(herald: Deployment) -> None:
    """A gzipped body was read as it came and answered 400 "malformed JSON", which it is not:
    the gateway reads identity only, and says so (RFC 9110 §15.5.16), on every route with a body."""
    body = b'{"title": "coded", "pages": 1}'
    with client(herald.url()) as http:
        before = herald.count_rows("jobs")
        for coding in ("gzip", "identity, gzip", "br"):
            coded = http.post("/reports", content=gzip.compress(body) if coding != "br" else body,
                              headers={"Content-Type": "application/json", "Content-Encoding": coding})
            assert coded.status_code == 415, (coding, coded.text)
            assert coded.json()["type"] == "/problems/unsupported-media-type"
            assert coded.headers["accept-encoding"] == "identity"
        assert http.post("/webhooks", content=gzip.compress(b'{"url": "https://example.com/"}'), headers={
            "Content-Type": "application/json", "Content-Encoding": "gzip"}).status_code == 415
        assert herald.count_rows("jobs") == before
        plain = http.post("/reports", content=body, headers={"Content-Type": "application/json",
                                                              "Content-Encoding": "identity"})
        assert plain.status_code == 202, plain.text


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


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
# What the OpenAPI document leaves out (pages, files, the document itself), by a real path each.
_UNDOCUMENTED = ("/", "/portal", "/static/app.js", "/schema", "/schema/openapi.json", "/schema/assets/swagger-ui.css")


def test_every_route_s_allow_names_exactly_the_methods_it_answers(herald: Deployment) -> None:
    """Every route of the OpenAPI document, and every page it leaves out: OPTIONS answers 204
    with an Allow naming the route's methods, HEAD wherever GET is (the edge answers it as
    GET), and OPTIONS (RFC 9110 §9.3.7), for a route of one handler or several; each method
    it names is answered (never 405), each other one is 405 with that same Allow (§15.5.6).
    No key is sent: every refusal comes before anything is done."""
    base = herald.url()
    document = httpx.get(base + "/schema/openapi.json").json()
    routes = {re.sub(r"\{[^}]+\}", lambda _: str(uuid.uuid4()), path): {m.upper() for m in ops if m.upper() in _METHODS}
              for path, ops in document["paths"].items()}
    assert len(routes) == len(document["paths"]) > 25
    routes.update({path: {"GET"} for path in _UNDOCUMENTED})
    wrong: list[tuple[str, str, int, str | None]] = []
    with httpx.Client(base_url=base, timeout=10) as http:
        for path, methods in routes.items():
            expected = methods | {"OPTIONS"} | ({"HEAD"} if "GET" in methods else set())
            for method in _METHODS:
                answer = http.request(method, path)
                allow = answer.headers.get("allow")
                named = set(allow.split(", ")) if allow else set()
                if method == "OPTIONS":
                    ok = answer.status_code == 204 and named == expected
                elif method in expected:
                    ok = answer.status_code != 405
                else:
                    ok = answer.status_code == 405 and named == expected
                if not ok:
                    wrong.append((method, path, answer.status_code, allow))
    assert not wrong, "\n".join(map(str, wrong))
