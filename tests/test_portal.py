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

from tests.harness import KEYS, TLS, Deployment, client, wait_until

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"
# The README's picture, refreshed only on request (HERALD_UPDATE_DOCS=1), so that a test run
# leaves the checkout clean; artifacts/portal-readme.png is the same picture, every run.
SCREENSHOT = ROOT / "docs" / "webhook-portal.png"
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
    assert urlsplit(url).path == "/portal" and set(query) == {"exp", "sig", "tenant", "key"} and query["tenant"] == tenant
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
    for forged in ("hps_garbage", token[:-2] + ("AA" if not token.endswith("AA") else "BB")):  # no session: 401
        answer = httpx.get(base + "/jobs", headers={"Authorization": f"Bearer {forged}"})
        assert answer.status_code == 401 and answer.json()["type"] == "/problems/unauthorized", answer.text
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
    for changed in ({"tenant": "globex"}, {"exp": str(int(query["exp"]) + 1)}, {"sig": ("y" if query["sig"].startswith("x") else "x") + query["sig"][1:]},
                    {"key": "env-000000000000"}):
        refused = httpx.post(base + "/portal/session", json={**query, **changed})
        assert refused.status_code == 403 and refused.json()["type"] == "/problems/invalid-signature", changed
    assert httpx.post(base + "/portal/session", json={"tenant": "acme"}).status_code == 400
    assert httpx.post(base + "/portal/link").status_code == 401

    # Neither the key, nor a link's signature, nor a session token reaches a log.
    logged = portal.log_text("gateway")
    assert "/portal/session" in logged and "/webhooks" in logged  # the requests were logged...
    for secret in (KEYS["acme"], token, other_token, query["sig"], token.rsplit(".", 1)[1]):
        assert secret not in logged  # ...without their credentials


def test_a_portal_link_expires_for_opening_but_a_session_outlives_it(portal: Deployment) -> None:
    # Expiry is whole seconds, so a TTL of 3 s leaves more than 2 s to open the link on a busy machine.
    short = portal.start_gateway("short", HERALD_SIGNED_URL_TTL_S="3")
    with client(short) as acme:
        url = acme.post("/portal/link").json()["url"]
    query = {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}
    opened = httpx.post(short + "/portal/session", json=query)
    assert opened.status_code == 200, opened.text
    token = opened.json()["token"]

    def refused() -> httpx.Response | None:
        answer = httpx.post(short + "/portal/session", json=query, verify=TLS)
        return answer if answer.status_code != 200 else None

    late = wait_until(refused, timeout=10, what="the portal link to expire")
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


# ----- the page in Chromium -----------------------------------------------------------------------


sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install -e '.[dev]'")


@pytest.fixture()
def browser() -> Iterator[Any]:
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing in CI: `make browser-deps` should have installed it")
        pytest.skip("Debian chromium is not installed (make browser-deps, or apt-get install chromium)")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


def test_page_and_assets_need_no_key_and_stay_out_of_the_schema(portal: Deployment) -> None:
    with httpx.Client(base_url=portal.url(), timeout=10) as anonymous:
        page = anonymous.get("/portal")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        assert page.headers["referrer-policy"] == "no-referrer"  # a link's query never leaves in a Referer
        assert '<script src="/static/portal.js"' in page.text
        for name, media_type in (("portal.js", "text/javascript"), ("portal.css", "text/css")):
            asset = anonymous.get(f"/static/{name}")
            assert asset.status_code == 200 and asset.headers["content-type"] == f"{media_type}; charset=utf-8"
        assert anonymous.get("/static/portal.html").status_code == 404
        paths = anonymous.get("/schema/openapi.json").json()["paths"]
        assert "/portal" not in paths
        for path, method in (("/portal/link", "post"), ("/portal/session", "post"), ("/webhooks/{endpoint_id}/recover", "post"),
                             ("/webhooks/{endpoint_id}/test", "post"), ("/webhooks/events", "get"),
                             ("/webhooks/events/link", "post"), ("/webhooks/{endpoint_id}/deliveries/{delivery_id}", "get")):
            assert method in paths[path], path
        assert {"bearer": []} in paths["/webhooks/{endpoint_id}/test"]["post"]["security"]
        assert {"portal": []} in paths["/webhooks/{endpoint_id}/test"]["post"]["security"]
        assert paths["/jobs"]["get"]["security"] == [{"bearer": []}]  # a portal session opens no job route


def test_the_portal_in_chromium(browser: Any, portal: Deployment, receiver: Receiver) -> None:
    expect = sync_api.expect
    expect.set_options(timeout=20_000)
    base = portal.url()
    acme = client(base)
    page = browser.new_page(viewport={"width": 1200, "height": 1000})
    page_errors: list[str] = []
    page.on("pageerror", lambda exc: page_errors.append(str(exc)))

    # Signing in with the API key; nothing there yet, and the page says what to do.
    page.goto(base + "/portal")
    key = page.get_by_label("API key")
    expect(key).to_be_focused()
    key.fill("not-a-key")
    page.get_by_role("button", name="Connect").click()
    expect(page.get_by_role("alert").filter(has_text="not accepted")).to_be_visible()
    key.fill(KEYS["acme"])
    key.press("Enter")
    connection = page.locator("#connection")
    expect(connection).to_have_text("Live")
    expect(page.get_by_text("No endpoints yet")).to_be_visible()
    page.evaluate("window.__sameDocument = true")  # gone if anything below reloads the page

    # Create an endpoint pointing at the real receiver, with the keyboard-friendly form.
    add = page.get_by_role("button", name="Add endpoint")
    add.focus()
    page.keyboard.press("Enter")  # the keyboard alone opens and fills the form
    dialog = page.get_by_role("dialog", name="Add endpoint")
    url_field = dialog.get_by_label("URL")
    expect(url_field).to_be_focused()
    dialog.get_by_role("button", name="Save").click()  # empty: the form says which field is wrong
    expect(dialog.get_by_role("alert")).to_contain_text("url:")
    expect(url_field).to_have_attribute("aria-invalid", "true")
    url_field.fill("ftp://nowhere.example/x")
    dialog.get_by_role("button", name="Save").click()  # the API's field error, shown at the field
    expect(dialog.get_by_role("alert")).to_contain_text("url:")
    url_field.fill(receiver.url)
    expect(dialog.get_by_label("job.succeeded")).to_be_checked()
    expect(dialog.get_by_label("job.progress")).not_to_be_checked()
    url_field.press("Enter")
    secret_dialog = page.get_by_role("dialog", name="Signing secret")
    expect(secret_dialog).to_be_visible()
    first_secret = secret_dialog.locator("#secret-value").inner_text()
    assert first_secret.startswith("whsec_")
    receiver.secrets.append(first_secret)
    secret_dialog.get_by_role("button", name="Done").click()
    card = page.locator("#endpoints > li").first
    expect(card.get_by_role("heading")).to_have_text(receiver.url)
    expect(card).to_contain_text("Enabled")
    endpoint_id = card.get_attribute("data-endpoint-id")
    assert endpoint_id
    deliveries = page.locator("#deliveries > li")
    expect(page.get_by_text("No deliveries here yet")).to_be_visible()

    # A job runs: its deliveries appear live, each with its attempt.
    job = acme.post("/exports", json={"format": "csv", "rows": 10}).json()
    done = page.locator(f'#deliveries > li[data-job-id="{job["id"]}"][data-type="job.succeeded"]')
    expect(done).to_have_attribute("data-status", "delivered")
    expect(done.locator("summary")).to_contain_text("1 attempt")
    done.locator("summary").click()
    expect(done.locator(".attempts tbody tr")).to_have_count(1)
    expect(done.locator(".attempts tbody tr td").nth(2)).to_have_text("200")
    expect(done.locator(".answer")).to_have_text('{"ok": true}')
    expect(done.locator(".payload")).to_contain_text(job["id"])
    expect(page.locator(f'#deliveries > li[data-job-id="{job["id"]}"]')).to_have_count(3)  # queued, running, succeeded
    expect(card).to_contain_text("100% of the last 3")

    # The receiver fails: the delivery ends failed; resent by hand once the receiver is back.
    receiver.failing.set()
    failing_job = acme.post("/exports", json={"format": "csv", "rows": 10}).json()
    failed = page.locator(f'#deliveries > li[data-job-id="{failing_job["id"]}"][data-type="job.succeeded"]')
    expect(failed).to_have_attribute("data-status", "failed")
    expect(failed.locator("summary")).to_contain_text("3 attempts")
    expect(card).to_contain_text("failed · job.succeeded · HTTP 500")
    receiver.failing.clear()
    failed.get_by_role("button", name="Resend").click()
    expect(failed).to_have_attribute("data-status", "delivered")
    expect(failed.locator("summary")).to_contain_text("4 attempts")

    # Recover: everything that failed since the chosen time is sent again.
    receiver.failing.set()
    more = [acme.post("/exports", json={"format": "csv", "rows": 10}).json() for _ in range(2)]
    for item in more:
        expect(page.locator(f'#deliveries > li[data-job-id="{item["id"]}"][data-type="job.succeeded"]')) \
            .to_have_attribute("data-status", "failed")
    receiver.failing.clear()
    page.get_by_role("button", name="Recover").click()
    expect(page.locator("#deliveries-note")).to_contain_text("being sent again")
    for item in more:
        expect(page.locator(f'#deliveries > li[data-job-id="{item["id"]}"][data-type="job.succeeded"]')) \
            .to_have_attribute("data-status", "delivered")
    expect(page.locator('#deliveries > li[data-status="failed"]')).to_have_count(0)
    recovered = page.locator(f'#deliveries > li[data-job-id="{more[-1]["id"]}"][data-type="job.succeeded"]')
    recovered.locator("summary").click()
    expect(recovered.locator(".attempts tbody tr")).to_have_count(4)
    expect(recovered.locator(".answer").first).to_have_text('{"error": "receiver down"}')
    page.evaluate("document.activeElement.blur(); window.scrollTo(0, 0)")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "portal-readme.png"))  # an endpoint, a recovered delivery opened
    if os.environ.get("HERALD_UPDATE_DOCS") == "1":
        shutil.copyfile(ARTIFACTS / "portal-readme.png", SCREENSHOT)
    recovered.locator("summary").click()
    succeeded = {r.webhook_id for r in receiver.of_type("job.succeeded") if r.status == 200}
    assert len(succeeded) == 4  # each job's job.succeeded reached the receiver, verified

    # Rotate the secret: the new one is shown once; both sign meanwhile (the receiver checks both).
    rotate = card.get_by_role("button", name="Rotate secret")
    rotate.click()
    rotated = page.get_by_role("dialog", name="Signing secret")
    expect(rotated).to_contain_text("keeps signing for 24 hours")
    second_secret = rotated.locator("#secret-value").inner_text()
    assert second_secret.startswith("whsec_") and second_secret != first_secret
    receiver.secrets.append(second_secret)
    page.keyboard.press("Escape")
    expect(rotated).to_be_hidden()
    expect(rotate).to_be_focused()  # focus goes back where it was

    # A test event: signed (old and new secret), through the queue, in the log like any other.
    card.get_by_role("button", name="Send test event").click()
    test = page.locator('#deliveries > li[data-type="webhook.test"]')
    expect(test).to_have_attribute("data-status", "delivered")
    expect(test.locator("summary")).to_contain_text("test event")
    assert [r.status for r in receiver.of_type("webhook.test")] == [200]
    test.locator("summary").click()
    expect(test.locator(".payload")).to_contain_text('"type": "webhook.test"')
    expect(card).to_contain_text("delivered · webhook.test · HTTP 200")
    assert page.evaluate("window.__sameDocument") is True, "everything above happened without a reload"

    page.screenshot(path=str(ARTIFACTS / "portal.png"), full_page=True)

    # A phone-width screen: nothing wider than the screen, the actions still reachable.
    page.set_viewport_size({"width": 390, "height": 844})
    too_wide = page.evaluate("""() => Array.from(document.querySelectorAll('body *'))
        .filter(el => (el.getBoundingClientRect().right > window.innerWidth + 0.5 || el.scrollWidth > el.clientWidth + 1) && !el.closest('.table-wrap') && getComputedStyle(el).overflowX === 'visible')
        .map(el => `${el.tagName}.${el.className}#${el.id} ${Math.round(el.getBoundingClientRect().right)}`)""")
    widths = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth, window.innerWidth, document.body.scrollWidth]")
    assert widths[0] <= widths[1], (widths, too_wide[:10])
    expect(card.get_by_role("button", name="Send test event")).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "portal-phone.png"), full_page=True)
    page.close()

    # The portal link: no key, this tenant's webhooks, and nothing of its jobs.
    link = acme.post("/portal/link").json()["url"]
    fresh_context = browser.new_context(viewport={"width": 390, "height": 844})
    guest = fresh_context.new_page()
    guest.on("pageerror", lambda exc: page_errors.append(str(exc)))
    requested: list[str] = []
    guest.on("request", lambda request: requested.append(request.url))
    guest.goto(base + link)
    expect(guest.locator("#connection")).to_have_text("Live")
    expect(guest.get_by_text("Webhooks of acme, opened with a portal link.")).to_be_visible()
    assert "sig=" not in guest.url, "the link's signature leaves the address bar at once"
    guest_card = guest.locator(f'#endpoints > li[data-endpoint-id="{endpoint_id}"]')
    expect(guest_card.get_by_role("heading")).to_have_text(receiver.url)
    guest_card.get_by_role("button", name="Deliveries").click()
    expect(guest.locator("#deliveries-heading")).to_be_focused()
    expect(guest.locator('#deliveries > li[data-type="webhook.test"]')).to_have_count(1)
    guest_card.get_by_role("button", name="Send test event").click()
    expect(guest.locator('#deliveries > li[data-type="webhook.test"][data-status="delivered"]')).to_have_count(2)
    guest.reload()  # the session lives in this tab: a reload keeps it, with no link in the URL
    expect(guest.locator("#connection")).to_have_text("Live")
    expect(guest.locator("#endpoints > li")).to_have_count(1)
    # Meanwhile another tenant's link shows none of it.
    with client(base, tenant="globex") as globex:
        other_link = globex.post("/portal/link").json()["url"]
    other = browser.new_page()
    other.on("pageerror", lambda exc: page_errors.append(str(exc)))
    other.goto(base + other_link)
    expect(other.get_by_text("Webhooks of globex, opened with a portal link.")).to_be_visible()
    expect(other.get_by_text("No endpoints yet")).to_be_visible()
    expect(other.locator("#endpoints > li")).to_have_count(0)
    assert receiver.url not in other.content()
    other.close()

    # Edit, pause, resume and delete work through the session too.
    guest_card.get_by_role("button", name="Edit").click()
    edit = guest.get_by_role("dialog", name="Edit endpoint")
    expect(edit.get_by_label("URL")).to_have_value(receiver.url)
    edit.get_by_label("Job kinds").fill("export")
    edit.get_by_role("button", name="Save").click()
    expect(edit).to_be_hidden()
    expect(guest_card).to_contain_text("Kindsexport")
    guest_card.get_by_role("button", name="Pause").click()
    expect(guest_card).to_contain_text("Paused")
    expect(guest_card.get_by_role("button", name="Send test event")).to_be_disabled()
    guest_card.get_by_role("button", name="Resume").click()
    expect(guest_card).to_contain_text("Enabled")
    with client(base) as check:
        assert check.get(f"/webhooks/{endpoint_id}").json()["kinds"] == ["export"]
    paths = [urlsplit(u).path for u in requested]
    assert not [p for p in paths if p.startswith(("/jobs", "/events", "/exports", "/reports"))], paths
    guest_card.get_by_role("button", name="Delete").click()
    confirm = guest.get_by_role("dialog", name="Delete endpoint?")
    expect(confirm.get_by_role("button", name="Keep it")).to_be_focused()  # the safe choice first
    confirm.get_by_role("button", name="Delete").click()
    expect(guest.get_by_text("No endpoints yet")).to_be_visible()
    expect(guest.locator("#deliveries-section")).to_be_hidden()
    fresh_context.close()

    # A link that was tampered with (or has expired) says what to do.
    other = browser.new_page()
    other.on("pageerror", lambda exc: page_errors.append(str(exc)))
    other.goto(base + link.replace("tenant=acme", "tenant=globex"))
    expect(other.get_by_role("alert").filter(has_text="expired or is not valid")).to_be_visible()
    expect(other.get_by_label("API key")).to_be_visible()
    other.close()
    acme.close()
    assert not page_errors, page_errors


def _pump_until(page: Any, predicate: Any, what: str, timeout_s: float = 20.0) -> None:
    """Let the page's events (and so Playwright's route handlers) run until ``predicate()``;
    a sync Playwright dispatches them only while one of its calls is waiting."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        page.wait_for_timeout(20)


def test_an_endpoint_list_read_before_an_edit_does_not_undo_the_edit(browser: Any, portal: Deployment,
                                                                     receiver: Receiver) -> None:
    """A list of endpoints asked for before an edit was answered, but answered after it (a
    delivery notice's read racing the Save), is read again: shown as it came, it put the old
    endpoint back on the page, and nothing corrected it until the next delivery."""
    expect = sync_api.expect
    expect.set_options(timeout=20_000)
    base = portal.url()
    with client(base) as acme:
        created = acme.post("/webhooks", json={"url": receiver.url, "event_types": ["job.succeeded"]})
        assert created.status_code == 201, created.text
    endpoint_id = created.json()["id"]

    lists: list[str] = []  # every read of the endpoint list, in order
    held: list[tuple[Any, Any]] = []  # (route, the answer the server gave before the edit)
    holding = threading.Event()

    def on_list(route: Any) -> None:
        lists.append(route.request.url)
        if holding.is_set() and not held:
            held.append((route, route.fetch()))  # read now, handed to the page later
        else:
            route.continue_()

    page = browser.new_page()
    page.route(lambda url: urlsplit(url).path == "/webhooks" and "limit=" in url, on_list)
    page.goto(base + "/portal")
    page.get_by_label("API key").fill(KEYS["acme"])
    page.get_by_label("API key").press("Enter")
    expect(page.locator("#connection")).to_have_text("Live")
    card = page.locator(f'#endpoints > li[data-endpoint-id="{endpoint_id}"]')
    expect(card).to_contain_text("Kindsevery kind")
    # Signing in reads the list, and so does the stream's first notice ("read everything");
    # with no delivery here, nothing reads it after those two.
    _pump_until(page, lambda: len(lists) >= 2, "the page's first two reads of the list")

    holding.set()
    page.evaluate("() => { refreshEndpoints(); }")  # what a delivery notice starts, a second later
    _pump_until(page, lambda: bool(held), "the held read")
    route, stale = held[0]
    assert stale.json()["items"][0]["kinds"] is None  # the server answered before the edit
    holding.clear()

    card.get_by_role("button", name="Edit").click()
    dialog = page.get_by_role("dialog", name="Edit endpoint")
    dialog.get_by_label("Job kinds").fill("export")
    dialog.get_by_role("button", name="Save").click()
    expect(card).to_contain_text("Saved.")
    expect(card).to_contain_text("Kindsexport")
    reads_before = len(lists)

    route.fulfill(response=stale)  # the old list arrives after the edit
    _pump_until(page, lambda: len(lists) > reads_before, "the list read again")
    expect(card).to_contain_text("Kindsexport")
    page.wait_for_load_state("networkidle")
    expect(card).to_contain_text("Kindsexport")
    page.close()
