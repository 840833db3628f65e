"""The webhook portal (issue 16, SPEC §7): portal links and sessions, their scope, the
delivery notices that keep the page live, and the page itself in real headless Chromium
(Debian's ``chromium`` driven by Playwright, as ``tests/test_browser.py``) against a real
receiver that verifies every delivery with the reference ``standardwebhooks`` library."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from tests.harness import KEYS, Deployment, client, wait_until

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"
SCREENSHOT = ROOT / "docs" / "webhook-portal.png"  # the README's picture
CHROMIUM = shutil.which("chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SCHEDULE = "0.2,0.2"  # two fast retries: a failing receiver fails a delivery within a second


# ----- a real receiver ---------------------------------------------------------------------------


@dataclass
class Received:
    webhook_id: str
    type: str
    body: bytes
    status: int


@dataclass
class Receiver:
    """One HTTP endpoint in a thread. It verifies every delivery against every secret it was
    given (so after a rotation, old and new both must sign) and answers 204 or, while
    ``failing`` is set, 500."""

    secrets: list[str] = field(default_factory=list)
    failing: threading.Event = field(default_factory=threading.Event)
    received: list[Received] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                headers = {k.lower(): v for k, v in self.headers.items()}
                for secret in list(receiver.secrets):
                    try:
                        Webhook(secret).verify(body, headers)
                    except WebhookVerificationError as exc:
                        receiver.problems.append(f"{secret[:12]}…: {exc}")
                if not receiver.secrets:
                    receiver.problems.append("a delivery before any secret was known")
                status = 500 if receiver.failing.is_set() else 200
                answer = b'{"error": "receiver down"}' if status == 500 else b'{"ok": true}'
                receiver.received.append(Received(headers.get("webhook-id", ""), json.loads(body)["type"], body,
                                                  status))
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/herald"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def of_type(self, event_type: str) -> list[Received]:
        return [r for r in self.received if r.type == event_type]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    try:
        yield server
    finally:
        server.stop()
    assert not server.problems, "\n".join(server.problems)


@pytest.fixture()
def portal(fresh: Deployment) -> Deployment:
    """Gateway, worker and notifier, with a fast retry schedule."""
    fresh.env_overrides.update(HERALD_WEBHOOK_RETRY_SCHEDULE=SCHEDULE, HERALD_WEBHOOK_MIN_BACKOFF_S="1")
    fresh.start_gateway()
    fresh.start_worker()
    fresh.start_notifier()
    return fresh


def portal_session(base: str, tenant: str = "acme") -> tuple[str, str]:
    """A portal link of ``tenant`` and the session token the page exchanges it for."""
    with client(base, tenant=tenant) as http:
        link = http.post("/portal/link")
    assert link.status_code == 200, link.text
    url = link.json()["url"]
    query = {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}
    assert urlsplit(url).path == "/portal" and set(query) == {"exp", "sig", "tenant"} and query["tenant"] == tenant
    session = httpx.post(base + "/portal/session", json=query, timeout=10)
    assert session.status_code == 200, session.text
    assert session.json()["tenant"] == tenant and session.json()["expires_in"] == 8 * 3600
    return url, session.json()["token"]


# ----- links, sessions and their scope -------------------------------------------------------------


def test_a_portal_link_opens_the_tenants_webhooks_and_nothing_else(portal: Deployment) -> None:
    base = portal.url()
    with client(base) as acme:
        endpoint = acme.post("/webhooks", json={"url": "https://hooks.example.com/p"}).json()
        job = acme.post("/exports", json={"format": "csv", "rows": 1}).json()
    _url, token = portal_session(base)
    assert token.startswith("hps_")
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=10) as session:
        # The webhook routes: all of them, for this tenant.
        assert [e["id"] for e in session.get("/webhooks").json()["items"]] == [endpoint["id"]]
        assert session.get(f"/webhooks/{endpoint['id']}").status_code == 200
        assert session.get(f"/webhooks/{endpoint['id']}/deliveries").status_code == 200
        assert set(session.post(f"/webhooks/{endpoint['id']}/rotate-secret").json()) == {"secret"}
        created = session.post("/webhooks", json={"url": "https://hooks.example.com/q"})
        assert created.status_code == 201 and created.json()["secret"].startswith("whsec_")
        assert session.post("/webhooks/events/link").status_code == 200
        # Never the tenant's jobs, events or results, and no new links.
        for method, path in (("GET", "/jobs"), ("GET", f"/jobs/{job['id']}"), ("DELETE", f"/jobs/{job['id']}"),
                             ("GET", f"/jobs/{job['id']}/events"), ("GET", "/events"), ("POST", "/events/link"),
                             ("GET", f"/exports/{job['id']}"), ("POST", "/portal/link")):
            answer = session.request(method, path)
            assert answer.status_code == 403, (method, path, answer.text)
            assert answer.json()["type"] == "/problems/portal-scope", (method, path)
        started = session.post("/exports", json={"format": "csv", "rows": 1})
        assert started.status_code == 403 and started.json()["type"] == "/problems/portal-scope"
    with client(base) as acme:
        assert len(acme.get("/jobs").json()["items"]) == 1  # nothing was started

    # Another tenant's link sees none of it; its token cannot reach acme's endpoint.
    _other_url, other_token = portal_session(base, "globex")
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {other_token}"}, timeout=10) as other:
        assert other.get("/webhooks").json()["items"] == []
        for method, path in (("GET", ""), ("GET", "/deliveries"), ("POST", "/test"), ("POST", "/rotate-secret"),
                             ("DELETE", "")):
            assert other.request(method, f"/webhooks/{endpoint['id']}{path}").status_code == 404, (method, path)

    # A token or link that was tampered with, or a link for another tenant's name, is refused.
    forged = token[:-2] + ("AA" if not token.endswith("AA") else "BB")
    assert httpx.get(base + "/webhooks", headers={"Authorization": f"Bearer {forged}"}).status_code == 401
    url, _token = portal_session(base)
    query = {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}
    for changed in ({"tenant": "globex"}, {"exp": str(int(query["exp"]) + 1)}, {"sig": "x" + query["sig"][1:]}):
        refused = httpx.post(base + "/portal/session", json={**query, **changed})
        assert refused.status_code == 403 and refused.json()["type"] == "/problems/invalid-signature", changed
    assert httpx.post(base + "/portal/session", json={"tenant": "acme"}).status_code == 400
    assert httpx.post(base + "/portal/link").status_code == 401


def test_a_portal_link_expires_for_opening_but_a_session_outlives_it(portal: Deployment) -> None:
    short = portal.start_gateway("short", HERALD_SIGNED_URL_TTL_S="1")
    with client(short) as acme:
        url = acme.post("/portal/link").json()["url"]
    query = {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}
    token = httpx.post(short + "/portal/session", json=query).json()["token"]
    time.sleep(2.1)
    late = httpx.post(short + "/portal/session", json=query)
    assert late.status_code == 403 and late.json()["type"] == "/problems/invalid-signature"
    # The session opened in time keeps working, at every gateway of the deployment.
    for base in (short, portal.url()):
        assert httpx.get(base + "/webhooks", headers={"Authorization": f"Bearer {token}"}).status_code == 200


def test_webhook_events_notice_every_change_of_the_tenants_deliveries(portal: Deployment,
                                                                       receiver: Receiver) -> None:
    base = portal.url()
    with client(base) as acme:
        endpoint = acme.post("/webhooks", json={"url": receiver.url, "event_types": ["job.succeeded"]}).json()
        receiver.secrets.append(endpoint["secret"])
        link = acme.post("/webhooks/events/link").json()
    assert link["url"].startswith("/webhooks/events?") and link["expires_in"] == 900
    notices: list[dict[str, Any]] = []

    def listen() -> None:
        with httpx.stream("GET", base + link["url"], timeout=httpx.Timeout(10, read=30)) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            event = None
            for line in stream.iter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event == "deliveries":
                    notices.append(json.loads(line[6:]))
                    if len(notices) >= 3:
                        return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    wait_until(lambda: notices, what="the first notice")
    assert notices[0] == {"endpoint_id": None}  # read everything now
    with client(base) as acme:
        acme.post(f"/webhooks/{endpoint['id']}/test")
    listener.join(20)
    assert {"endpoint_id": endpoint["id"]} in notices[1:], notices  # queued (API), then attempted (notifier)
    with client(base, tenant="globex") as globex:
        other = globex.post("/webhooks/events/link").json()["url"]
    tampered = other.replace("tenant=globex", "tenant=acme")
    assert httpx.get(base + tampered, timeout=5).status_code == 403
    assert httpx.get(base + "/webhooks/events", timeout=5).status_code == 401
