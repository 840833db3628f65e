"""Metrics and logs as an operator sees them, on real processes (SPEC §10)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from herald.logs import REDACTED, redact_secrets
from herald_client import HeraldClient
from launcher.supervisor import metrics_dir_in_ram
from tests.harness import KEYS, TLS, Deployment, free_port, wait_until
from tests.test_client import Receiver  # a real webhook receiver on 127.0.0.1

KEY = KEYS["acme"]
SPEC_METRICS = {
    "herald_jobs_accepted_total", "herald_jobs_finished_total", "herald_queue_oldest_age_seconds",
    "herald_job_run_seconds", "herald_outbox_pending", "herald_webhook_deliveries_total",
    "herald_webhook_delivery_seconds", "herald_sse_streams", "herald_long_polls", "herald_http_requests_total",
}


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    response = httpx.get(url + "/metrics", timeout=5, verify=TLS)
    assert response.status_code == 200 and response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def families(url: str) -> set[str]:
    """Every metric the endpoint declares, samples or not (counters by their ``_total`` name)."""
    text = httpx.get(url + "/metrics", timeout=5).text
    return {family.name + ("_total" if family.type == "counter" else "")
            for family in text_string_to_metric_families(text)}


def log_lines(deployment: Deployment, *names: str) -> list[dict[str, Any]]:
    lines = deployment.log_events(*names)
    assert not [line for line in lines if "raw" in line], "every line is one JSON event"
    return lines


def run_report(base: str, pages: int = 3) -> str:
    with HeraldClient(base, KEY) as client:
        job = client.submit("report", {"title": "observed", "pages": pages})
        assert client.wait(job, 60).state == "succeeded"
    return job.id


# ----- metrics ------------------------------------------------------------------------------


def test_http_requests_are_counted_by_route_template(herald: Deployment) -> None:
    base = herald.url()
    job_id = run_report(base, pages=1)
    before = scrape(base)
    auth = {"Authorization": f"Bearer {KEY}"}
    for _ in range(3):
        assert httpx.get(f"{base}/jobs/{job_id}", headers=auth).status_code == 303
    assert httpx.get(f"{base}/jobs/{uuid.uuid4()}", headers=auth).status_code == 404
    assert httpx.get(f"{base}/no/such/route/{uuid.uuid4()}").status_code == 404
    after = scrape(base)

    def delta(**labels: str) -> float:
        return value(after, "herald_http_requests_total", **labels) - value(before, "herald_http_requests_total", **labels)

    assert delta(route="/jobs/{job_id}", method="GET", status="303") == 3
    assert delta(route="/jobs/{job_id}", method="GET", status="404") == 1
    assert delta(route="unmatched", method="GET", status="404") == 1
    routes = {dict(labels)["route"] for name, labels in after if name == "herald_http_requests_total"}
    assert not any(job_id in route or "/no/such" in route for route in routes), "templates, never raw paths"
    assert value(after, "herald_http_request_seconds_count", route="/jobs/{job_id}", method="GET") > 0


def total(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def register_webhook(base: str, url: str) -> None:
    created = httpx.post(base + "/webhooks", headers={"Authorization": f"Bearer {KEY}"},
                         json={"url": url, "event_types": ["job.succeeded"]})
    assert created.status_code == 201, created.text


def test_worker_and_notifier_metrics_ports_and_gateway_metrics_change_as_jobs_run(fresh: Deployment) -> None:
    base = fresh.start_gateway()
    worker_port, notifier_port = free_port(), free_port()
    fresh.start_worker(HERALD_METRICS_PORT=str(worker_port))
    fresh.start_notifier(HERALD_METRICS_PORT=str(notifier_port))
    worker, notifier = f"http://127.0.0.1:{worker_port}", f"http://127.0.0.1:{notifier_port}"
    receiver = Receiver()
    register_webhook(base, receiver.url)
    gateway_before, worker_before, notifier_before = scrape(base), scrape(worker), scrape(notifier)
    try:
        run_report(base)
        run_report(base)
        wait_until(lambda: len(receiver.hits) == 2, what="two deliveries")
    finally:
        receiver.close()
    gateway_after = scrape(base)
    worker_after = wait_until(lambda: (s := scrape(worker)) and value(
        s, "herald_jobs_finished_total", kind="report", state="succeeded") >= 2 and s, what="worker counted")
    notifier_after = wait_until(lambda: (s := scrape(notifier)) and total(
        s, "herald_webhook_deliveries_total") >= 2 and s, what="notifier counted")
    assert total(notifier_before, "herald_webhook_deliveries_total") == 0
    assert total(notifier_after, "herald_webhook_delivery_seconds_count") >= 2

    assert value(gateway_after, "herald_jobs_accepted_total", kind="report") - \
        value(gateway_before, "herald_jobs_accepted_total", kind="report") == 2
    assert value(worker_before, "herald_jobs_finished_total", kind="report", state="succeeded") == 0
    assert value(worker_after, "herald_jobs_finished_total", kind="report", state="succeeded") == 2
    assert value(worker_after, "herald_job_run_seconds_count", kind="report") == 2
    assert value(gateway_after, "herald_outbox_pending") >= 0
    assert SPEC_METRICS <= families(base), SPEC_METRICS - families(base)


def test_herald_up_serves_every_components_metrics_on_the_api_port(tmp_path: Path) -> None:
    port, nats_port = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HERALD_", "PROMETHEUS_"))}
    env.update(HERALD_NATS_PORT=str(nats_port), HERALD_DATA_DIR=str(tmp_path / "var"),
               HERALD_REPORT_PAGE_MS="20", HERALD_WORKERS="1", HERALD_API_KEYS=f"acme:{KEY}",
               HERALD_WEBHOOK_ALLOW_PRIVATE="1")
    log = open(tmp_path / "up.log", "wb")  # noqa: SIM115  (closed below, after the process)
    # The port as a flag (README): it must reach the gateway, not only the supervisor.
    up = subprocess.Popen([sys.executable, "-m", "launcher.cli", "up", "--port", str(port)], env=env, stdout=log,
                          stderr=log)
    try:
        wait_until(lambda: httpx.get(base + "/readyz", timeout=1, verify=TLS).status_code == 200, timeout=40, what="herald up")
        fresh_start = scrape(base)
        # Before anything happened every known series is there, at 0: no gaps for dashboards.
        def at_zero(name: str, **labels: str) -> bool:
            return fresh_start.get((name, frozenset(labels.items()))) == 0.0

        for kind in ("report", "export"):
            assert all(at_zero("herald_jobs_finished_total", kind=kind, state=state)
                       for state in ("succeeded", "failed", "cancelled")), kind
            assert at_zero("herald_job_run_seconds_count", kind=kind) and at_zero("herald_jobs_accepted_total", kind=kind)
        assert all(at_zero("herald_webhook_deliveries_total", outcome=outcome)
                   for outcome in ("delivered", "retry", "failed", "superseded", "dropped"))
        receiver = Receiver()
        register_webhook(base, receiver.url)
        before = scrape(base)
        try:
            run_report(base)
            run_report(base)
            wait_until(lambda: len(receiver.hits) == 2, what="two deliveries")
        finally:
            receiver.close()
        # Counted in the notifier process, shown by the gateway.
        wait_until(lambda: total(scrape(base), "herald_webhook_deliveries_total") >= 2, what="notifier-side counters")
        # Counted in the worker process, shown by the gateway: the multiprocess registry works.
        after = wait_until(lambda: (s := scrape(base)) and value(
            s, "herald_jobs_finished_total", kind="report", state="succeeded") - value(
            before, "herald_jobs_finished_total", kind="report", state="succeeded") == 2 and s,
            what="worker-side counters on the API port")
        assert value(after, "herald_job_run_seconds_count", kind="report") - \
            value(before, "herald_job_run_seconds_count", kind="report") == 2
        assert value(after, "herald_jobs_accepted_total", kind="report") - \
            value(before, "herald_jobs_accepted_total", kind="report") == 2
        assert value(after, "herald_http_requests_total", route="/reports", method="POST", status="202") == 2
        assert SPEC_METRICS <= families(base), SPEC_METRICS - families(base)

        with HeraldClient(base, KEY) as client:  # a live gauge, summed over processes
            job = client.submit("report", {"title": "watched", "pages": 1000})
            events = client.stream(job)
            next(events)
            wait_until(lambda: value(scrape(base), "herald_sse_streams") == 1, what="one open stream")
            events.close()
            client.cancel(job)
            wait_until(lambda: value(scrape(base), "herald_sse_streams") == 0, what="the stream closed")
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(30)
        log.close()
    assert code == 0, (tmp_path / "up.log").read_text()[-3000:]


def test_herald_up_keeps_its_gateway_and_says_it_is_not_ready_while_the_data_disk_is_full(tmp_path: Path) -> None:
    """The processes' shared metrics live in RAM, not on the data disk: prometheus_client grows
    each process's file through mmap, and on a full disk the first new series was SIGBUS,
    so the gateway died at its next new route or status, and again after every restart."""
    if os.geteuid() != 0 or not Path("/dev/shm").is_dir():
        pytest.skip("a small disk of its own (tmpfs) needs root; the metrics in RAM need /dev/shm")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m", "tmpfs", str(disk)], check=True)
    port, nats_port = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HERALD_", "PROMETHEUS_"))}
    env.update(HERALD_NATS_PORT=str(nats_port), HERALD_DATA_DIR=str(disk / "var"), HERALD_WORKERS="1",
               HERALD_API_KEYS=f"acme:{KEY}")
    log = open(tmp_path / "up.log", "wb")  # noqa: SIM115  (closed below, after the process)
    up = subprocess.Popen([sys.executable, "-m", "launcher.cli", "up", "--port", str(port)], env=env, stdout=log,
                          stderr=log)
    try:
        wait_until(lambda: httpx.get(base + "/readyz", timeout=1).status_code == 200, timeout=40, what="herald up")
        assert not (disk / "var" / "metrics").exists(), "the metrics files are on the data disk"
        with open(disk / "filler", "wb") as filler:  # the disk full, as a runaway log leaves it
            with contextlib.suppress(OSError):
                while True:
                    filler.write(b"\0" * (1 << 20))
                    filler.flush()
        auth = {"Authorization": f"Bearer {KEY}"}
        # Routes, statuses and kinds no request had yet: each a new series, a new page of a file.
        # An answer of any status will do (503 store-unavailable is a fair one on a full disk);
        # a connection the gateway's death cut raises.
        with httpx.Client(base_url=base, timeout=10) as http:
            for _ in range(3):
                for path in ("/exports", "/reports"):
                    http.post(path, json={"rows": 1, "title": "full"}, headers=auth)
                for path in ("/jobs?state=failed", "/webhooks", "/no-such-route", "/events?after=1"):
                    http.get(path, headers={**auth, "Accept": "application/json"})
            assert http.get("/healthz").status_code == 200
            # Not ready while nothing can be written (SPEC §10: the store unreachable), and says
            # why; ready again once the operator frees space, with no restart.
            full = http.get("/readyz")
            assert full.status_code == 503 and "disk is full" in full.json()["detail"], full.text
            (disk / "filler").unlink()
            wait_until(lambda: http.get("/readyz").status_code == 200, what="ready again")
        assert b"gateway exited" not in (tmp_path / "up.log").read_bytes(), (tmp_path / "up.log").read_text()[-3000:]
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(30)
        log.close()
        subprocess.run(["umount", "-l", str(disk)], check=False)
    assert code == 0, (tmp_path / "up.log").read_text()[-3000:]
    assert not metrics_dir_in_ram(disk / "var").exists(), "the metrics files outlived herald up in RAM"


# ----- logs ---------------------------------------------------------------------------------


def test_every_line_is_json_and_every_transition_is_logged_with_its_job_id(herald: Deployment) -> None:
    job_id = run_report(herald.url(), pages=4)
    with HeraldClient(herald.url(), KEY) as client:
        final = client.status(job_id).version

    def transitions() -> list[dict[str, Any]]:
        return [line for line in log_lines(herald, "gateway", "worker")
                if line["event"] == "transition" and line.get("job_id") == job_id]

    logged = wait_until(lambda: len(transitions()) == final and transitions(), what="a line per transition")
    assert sorted(line["version"] for line in logged) == list(range(1, final + 1))
    assert logged[-1]["event_type"] == "job.succeeded" and logged[-1]["state"] == "succeeded"
    lines = log_lines(herald, "gateway", "worker")
    for line in lines:
        assert {"event", "level", "timestamp", "component"} <= line.keys(), line
        if job_id in json.dumps(line):
            assert line.get("job_id") == job_id, f"a line about the job without its job_id: {line}"
    assert any(line.get("logger", "").startswith("uvicorn") for line in lines), "uvicorn's own lines are JSON too"
    assert not any("color_message" in line for line in lines)


def test_each_request_has_an_id_in_the_answer_and_in_the_log(herald: Deployment) -> None:
    base = herald.url()
    job_id = run_report(base, pages=1)
    auth = {"Authorization": f"Bearer {KEY}"}
    traced = httpx.get(f"{base}/jobs/{job_id}", headers={**auth, "X-Request-ID": "trace-7.a:b"})
    assert traced.headers["x-request-id"] == "trace-7.a:b", "a sane incoming id is kept"
    insane = httpx.get(f"{base}/jobs/{job_id}", headers={**auth, "X-Request-ID": "x" * 300})
    minted = insane.headers["x-request-id"]
    assert len(minted) == 32 and minted != "x" * 300, "an unusable one is replaced"
    plain = httpx.get(f"{base}/nowhere")
    assert plain.status_code == 404 and len(plain.headers["x-request-id"]) == 32, "unknown routes get one too"
    # A start's line names the job it made, and so does its replay's (SPEC §10: every line about a job).
    starts = [httpx.post(f"{base}/reports", json={"title": "t", "pages": 1},
                         headers={**auth, "X-Request-ID": f"start-{n}", "Idempotency-Key": f"log-{job_id}"})
              for n in range(2)]
    assert [r.status_code for r in starts] == [202, 202] and starts[0].json()["id"] == starts[1].json()["id"]
    ids = {response.headers["x-request-id"] for response in (traced, insane, plain, *starts)}

    def request_lines() -> dict[str, dict[str, Any]]:
        return {line["request_id"]: line for line in log_lines(herald, "gateway")
                if line["event"] == "request" and line.get("request_id") in ids}

    lines = wait_until(lambda: len(r := request_lines()) == 5 and r, what="access lines")
    assert lines["start-0"]["job_id"] == lines["start-1"]["job_id"] == starts[0].json()["id"]
    assert lines["trace-7.a:b"]["route"] == "/jobs/{job_id}" and lines["trace-7.a:b"]["job_id"] == job_id
    assert lines["trace-7.a:b"]["status"] == 303 and lines[minted]["status"] == 303
    assert lines[plain.headers["x-request-id"]]["route"] == "unmatched"


def test_a_head_request_is_logged_and_counted_as_head(herald: Deployment) -> None:
    """The edge answers a HEAD as a GET without its body; the access line and the request
    counter still name the method the client sent (the line said GET)."""
    base = herald.url()
    job_id = run_report(base, pages=1)
    before = scrape(base)
    auth = {"Authorization": f"Bearer {KEY}"}
    tag = uuid.uuid4().hex[:8]
    head = httpx.head(f"{base}/jobs/{job_id}", headers={**auth, "X-Request-ID": f"head-{tag}"})
    get = httpx.get(f"{base}/jobs/{job_id}", headers={**auth, "X-Request-ID": f"get-{tag}"})
    assert head.status_code == get.status_code == 303 and head.content == b""

    def request_lines() -> dict[str, dict[str, Any]]:
        return {line["request_id"]: line for line in log_lines(herald, "gateway")
                if line["event"] == "request" and line.get("request_id") in (f"head-{tag}", f"get-{tag}")}

    lines = wait_until(lambda: len(r := request_lines()) == 2 and r, what="the two access lines")
    assert lines[f"head-{tag}"]["method"] == "HEAD", lines[f"head-{tag}"]
    assert lines[f"get-{tag}"]["method"] == "GET", lines[f"get-{tag}"]
    for line in lines.values():
        assert line["route"] == "/jobs/{job_id}" and line["status"] == 303 and line["job_id"] == job_id
    after = scrape(base)
    counted = {method: value(after, "herald_http_requests_total", route="/jobs/{job_id}", method=method, status="303")
               - value(before, "herald_http_requests_total", route="/jobs/{job_id}", method=method, status="303")
               for method in ("HEAD", "GET")}
    assert counted == {"HEAD": 1, "GET": 1}


def test_keys_never_reach_the_logs(herald: Deployment) -> None:
    wrong = f"wrong-key-{uuid.uuid4()}"
    assert httpx.get(herald.url() + "/jobs", headers={"Authorization": f"Bearer {wrong}"}).status_code == 401
    run_report(herald.url(), pages=1)
    text = herald.log_text("gateway") + herald.log_text("worker")
    assert KEY not in text and wrong not in text
    assert KEYS["globex"] not in text
    event = redact_secrets(None, "info", {"event": "sent Authorization: Bearer abc123", "api_key": "k",
                                          "secret": "whsec_x", "job_id": "j"})
    assert event == {"event": f"sent Authorization: Bearer {REDACTED}", "api_key": REDACTED,
                     "secret": REDACTED, "job_id": "j"}


def test_console_format_for_humans(fresh: Deployment) -> None:
    base = fresh.start_gateway(HERALD_LOG_FORMAT="console")
    response = httpx.get(base + "/nowhere", headers={"X-Request-ID": "human-1"})
    assert response.status_code == 404

    def lines() -> list[str]:
        return [line for line in fresh.log_text("gateway").splitlines() if "request_id=human-1" in line]

    found = wait_until(lines, what="a console access line")
    assert "request" in found[0] and "route=unmatched" in found[0]
    assert not found[0].lstrip().startswith("{")
