"""The browser page at ``/`` in real headless Chromium (Debian's ``chromium``, driven by
Playwright): it starts a report, follows it over the one tenant stream, and recovers when
the gateway is killed and restarted mid-job (issue 6, SPEC §8)."""

from __future__ import annotations

import io
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pypdf import PdfReader

from tests.harness import KEYS, Deployment

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install -e '.[dev]'")

CHROMIUM = shutil.which("chromium")
# As the machine's notes advise: without the background-networking flags Chromium keeps
# trying to reach Google's hosts, which a closed network refuses.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
PAGES = 40
PAGE_MS = "150"  # 40 pages x 150 ms: the job runs ~6 s, long enough to restart the gateway mid-job
TITLE = "Q3 <b>not bold</b>"  # markup in server-echoed text must show as text


@pytest.fixture()
def browser() -> Iterator[sync_api.Browser]:
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing in CI: `make browser-deps` should have installed it")
        pytest.skip("Debian chromium is not installed (make browser-deps, or apt-get install chromium)")
    with sync_api.sync_playwright() as playwright:
        # executable_path: the Debian browser; Playwright downloads nothing.
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


def test_page_and_assets_need_no_key_and_stay_out_of_the_schema(herald: Deployment) -> None:
    with httpx.Client(base_url=herald.url(), timeout=10) as anonymous:
        page = anonymous.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert '<script src="/static/app.js"' in page.text
        assert page.headers["content-disposition"] == 'inline; filename="index.html"', "a saved page keeps a name"
        for name, media_type in (("app.js", "text/javascript"), ("app.css", "text/css")):
            asset = anonymous.get(f"/static/{name}")
            assert asset.status_code == 200 and asset.headers["content-type"] == f"{media_type}; charset=utf-8"
            assert asset.headers["content-disposition"] == f'inline; filename="{name}"'
        assert anonymous.get("/static/index.html").status_code == 404, "only the page's assets are served"
        assert anonymous.get("/static/..%2Fapp.py").status_code == 404
        paths = anonymous.get("/schema/openapi.json").json()["paths"]
        assert "/" not in paths and not [p for p in paths if p.startswith("/static")]


def test_page_says_when_the_key_or_the_request_is_wrong(browser: sync_api.Browser, herald: Deployment) -> None:
    expect = sync_api.expect
    page = browser.new_page()
    page.goto(herald.url() + "/")
    key = page.get_by_role("textbox", name="API key")
    key.fill("not-a-key")
    page.get_by_role("button", name="Connect").click()
    expect(page.get_by_role("status")).to_have_text("API key not accepted")
    key.fill(KEYS["acme"])
    page.get_by_role("button", name="Connect").click()
    expect(page.get_by_role("status")).to_have_text("Live")
    # The key survives a reload (localStorage) and the page reconnects by itself.
    page.reload()
    expect(page.get_by_role("status")).to_have_text("Live")
    # A problem from the API is shown, field by field (past the form's own maxlength).
    title = page.get_by_label("Title")
    title.evaluate("input => input.removeAttribute('maxlength')")
    title.fill("x" * 201)
    page.get_by_role("button", name="Start report").click()
    expect(page.get_by_role("alert")).to_contain_text("title:")
    page.close()


def test_a_job_cancelled_while_queued_shows_a_still_bar(browser: sync_api.Browser, fresh: Deployment) -> None:
    """A job that ended without progress shows an empty bar, not a busy one: an indeterminate
    <progress> animates as if work went on."""
    expect = sync_api.expect
    base = fresh.start_gateway()  # no worker: the job stays queued until it is cancelled
    page = browser.new_page()
    page.goto(base + "/")
    page.get_by_role("textbox", name="API key").fill(KEYS["acme"])
    page.get_by_role("button", name="Connect").click()
    expect(page.get_by_role("status")).to_have_text("Live")
    page.get_by_label("Title").fill("never run")
    page.get_by_role("button", name="Start report").click()
    row = page.locator("#jobs tbody tr").first
    expect(row).to_have_attribute("data-state", "queued")
    bar = row.get_by_role("progressbar", name="Progress of never run")
    assert bar.get_attribute("value") is None  # queued: indeterminate, work is still to come
    job_id = row.get_attribute("data-job-id")
    answer = httpx.delete(f"{base}/jobs/{job_id}", headers={"Authorization": f"Bearer {KEYS['acme']}"}, timeout=10)
    assert answer.status_code == 200, answer.text
    expect(row).to_have_attribute("data-state", "cancelled")
    expect(bar).to_have_attribute("value", "0")
    page.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("first_link_ttl", "screenshot"),
    [
        # EventSource resumes by itself, sending Last-Event-ID on the same signed link.
        pytest.param("900", "browser-reconnect.png", id="eventsource-reconnects"),
        # The link expired meanwhile, so that reconnect gets 403 and EventSource gives up:
        # the page takes a fresh link and resumes with ?last_event_id=.
        pytest.param("2", "browser.png", id="link-expired"),
    ],
)
def test_page_follows_a_report_across_a_gateway_restart(
    browser: sync_api.Browser, fresh: Deployment, first_link_ttl: str, screenshot: str
) -> None:
    expect = sync_api.expect
    expect.set_options(timeout=30_000)
    base = fresh.start_gateway(HERALD_SIGNED_URL_TTL_S=first_link_ttl)
    port = fresh.ports["gateway"]
    fresh.start_worker(HERALD_REPORT_PAGE_MS=PAGE_MS)

    page = browser.new_page(viewport={"width": 1100, "height": 1000})
    page_errors: list[str] = []
    page.on("pageerror", lambda exc: page_errors.append(str(exc)))
    requests: list[tuple[float, str, str]] = []
    page.on("request", lambda req: requests.append((time.monotonic(), req.method, req.url)))

    # The page needs no key; the API key goes in once and the one tenant stream opens.
    page.goto(base + "/")
    page.get_by_role("textbox", name="API key").fill(KEYS["acme"])
    page.get_by_role("button", name="Connect").click()
    connection = page.get_by_role("status")
    expect(connection).to_have_text("Live")

    page.get_by_label("Title").fill(TITLE)
    page.get_by_label("Pages").fill(str(PAGES))
    page.get_by_role("button", name="Start report").click()
    row = page.locator("#jobs tbody tr").first
    expect(row).to_have_attribute("data-state", "running")
    job_id = row.get_attribute("data-job-id")
    assert job_id
    bar = row.get_by_role("progressbar", name=f"Progress of {TITLE}")
    expect(row.locator("th span")).to_have_text(TITLE)
    assert row.locator("b").count() == 0, "server-echoed text is never parsed as markup"

    # The bar moves.
    page.wait_for_function("bar => bar.value >= 5", arg=bar.element_handle())
    before_kill = float(bar.get_attribute("value") or 0)

    # Kill the gateway mid-job and start a new one on the same address.
    fresh.kill("gateway")
    expect(connection).to_have_text("Reconnecting…")
    fresh.start_gateway(port=port)
    restarted_at = time.monotonic()

    # The page recovers: live again, the job ends succeeded, the bar is full, the PDF link is there.
    expect(connection).to_have_text("Live")
    expect(row).to_have_attribute("data-state", "succeeded")
    expect(bar).to_have_attribute("value", "100")
    assert before_kill < 100
    link = row.get_by_role("link", name=f"Download the result of {TITLE}")
    expect(link).to_be_visible()

    # Nothing missed, nothing twice: the feed holds every version of the job, in order,
    # from its first events to job.succeeded, across the restart.
    feed = page.locator(f'#feed li[data-job-id="{job_id}"]')
    versions = feed.evaluate_all("items => items.map(li => Number(li.dataset.version)).reverse()")
    types = feed.evaluate_all("items => items.map(li => li.dataset.type).reverse()")
    assert versions == list(range(versions[0], versions[-1] + 1)), versions
    assert versions[0] <= 2 and types[-1] == "job.succeeded" and types.count("job.succeeded") == 1

    # One tenant stream, never one per job; the page reopened it on the new gateway.
    after = [(method, url) for at, method, url in requests if at > restarted_at]
    assert not [url for _, _, url in requests if "/jobs/" in url and "/events" in url]
    assert any(method == "GET" and "/events?" in url for method, url in after)
    if first_link_ttl == "2":
        # The old link had expired: a fresh one, resuming where the page stopped.
        assert ("POST", f"{base}/events/link") in after
        assert any("/events?" in url and "last_event_id=" in url for _, url in after)

    # The link downloads the PDF without a key (it is a signed URL).
    href = link.get_attribute("href")
    assert href and href.startswith("/reports/")
    pdf = httpx.get(base + href, timeout=10)
    assert pdf.status_code == 200 and pdf.headers["content-type"] == "application/pdf"
    assert len(PdfReader(io.BytesIO(pdf.content)).pages) == PAGES

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / screenshot), full_page=True)
    assert not page_errors, page_errors


def test_page_shows_a_jobs_output_live_and_resumes_after_a_reload(browser: sync_api.Browser, fresh: Deployment) -> None:
    """Streamed output (SPEC §8): the page shows the report's pages as they are rendered,
    over the signed links.output, and after a reload shows them again and resumes."""
    expect = sync_api.expect
    expect.set_options(timeout=30_000)
    base = fresh.start_gateway()
    fresh.start_worker(HERALD_REPORT_PAGE_MS=PAGE_MS)
    pages = 30
    page = browser.new_page(viewport={"width": 1100, "height": 1000})
    page_errors: list[str] = []
    page.on("pageerror", lambda exc: page_errors.append(str(exc)))
    page.goto(base + "/")
    page.get_by_role("textbox", name="API key").fill(KEYS["acme"])
    page.get_by_role("button", name="Connect").click()
    page.get_by_label("Title").fill("streamed")
    page.get_by_label("Pages").fill(str(pages))
    page.get_by_role("button", name="Start report").click()

    output = page.locator("#output")
    expect(output).to_contain_text('{"page":5,"pages":30}')
    assert '"page":30' not in output.inner_text(), "the output shows while the job runs"
    page.reload()  # mid-job: the page shows what it had, then resumes after its last chunk
    expect(page.locator("#output-job")).to_contain_text("(succeeded)")
    lines = output.inner_text().strip().splitlines()
    assert lines == [f'{{"page":{n},"pages":{pages}}}' for n in range(1, pages + 1)], lines
    assert not page_errors, page_errors
