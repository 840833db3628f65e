"""Every job ends: faults caused for real (kill -9, nats-server restart), cancellation,
leases, the sweeper and retention (SPEC §4, §5, §9)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from typing import Any

import httpx
import pytest

from herald.constants import JOBS_STREAM
from tests.harness import Deployment, client, stream_state, wait_for_state, wait_until

pytestmark = pytest.mark.slow

EMIT_KIND = "tests.kinds_fixture:EMIT"  # streams output chunks and never checks for a cancel


def result_files(deployment: Deployment, job_id: str) -> list[str]:
    return deployment.result_names(job_id)


def assert_one_result(deployment: Deployment, status: dict[str, Any]) -> None:
    files = result_files(deployment, status["id"])
    assert files == [f"{status['attempt']}.pdf"], f"exactly one final result: {files}"


def running_with_progress(http: httpx.Client, job_id: str) -> dict[str, Any]:
    return wait_until(lambda: (s := http.get(f"/jobs/{job_id}").json())["state"] == "running" and s["progress"] and s,
                      what="job running with progress")


def test_kill_9_worker_mid_job_another_finishes_it(fresh: Deployment) -> None:
    base = fresh.start_gateway()
    fresh.start_worker("worker-1", HERALD_REPORT_PAGE_MS="100")
    with client(base) as http:
        job = http.post("/reports", json={"title": "survivor", "pages": 20}).json()
        running_with_progress(http, job["id"])
        fresh.kill("worker-1", signal.SIGKILL)
        fresh.start_worker("worker-2")
        done = wait_for_state(http, job["id"], {"succeeded", "failed"}, timeout=40)
        assert done["state"] == "succeeded" and done["attempt"] == 2
        assert_one_result(fresh, done)
        assert http.get(f"/reports/{job['id']}").content.startswith(b"%PDF")


def test_a_cancel_asked_of_a_job_whose_worker_is_gone_ends_it_cancelled(fresh: Deployment) -> None:
    """SPEC §5 and §9: a running job's cancel was asked for, and its worker is gone before it
    checked: killed (kill -9), or stopped (SIGTERM), which hands the job back. Either way the
    job ends ``cancelled``, never started again. It was re-queued like any other silent or
    handed-back job and ran again from the beginning, so a handler that never checks (this
    test kind's) ran the work the client had called off to ``succeeded``."""
    fresh.env_overrides.update(HERALD_KINDS=EMIT_KIND, HERALD_WORKER_GRACE_S="0.2")
    base = fresh.start_gateway()
    fresh.start_worker("worker-1")
    with client(base) as http:
        def running_unchecked() -> dict[str, Any]:
            job = http.post("/emits", json={"count": 100, "pause_ms": 100}).json()  # never checks
            wait_until(lambda: http.get(f"/jobs/{job['id']}/output").text, what="job running (its first chunk)")
            return job

        killed = running_unchecked()
        fresh.kill("worker-1", signal.SIGKILL)
        asked = http.delete(f"/jobs/{killed['id']}")
        assert asked.status_code == 202 and asked.json()["cancel_requested"] is True
        fresh.start_worker("worker-2")
        done = wait_for_state(http, killed["id"], {"succeeded", "failed", "cancelled"})
        assert (done["state"], done["attempt"]) == ("cancelled", 1), done

        handed_back = running_unchecked()
        assert http.delete(f"/jobs/{handed_back['id']}").status_code == 202
        fresh.kill("worker-2", signal.SIGTERM)  # hands the job back: queued, attempt 2, its cancel asked for
        fresh.start_worker("worker-3")
        done = wait_for_state(http, handed_back["id"], {"succeeded", "failed", "cancelled"})
        assert done["state"] == "cancelled", done
        feed = http.get("/events", params={"limit": 500}, headers={"Accept": "application/json"}).json()["events"]
        for job, ends in ((killed, ["job.cancelled"]), (handed_back, ["job.queued", "job.cancelled"])):
            types = [e["type"] for e in feed if e["data"]["id"] == job["id"]]
            # one run only: the cancel is the end, not a second job.running
            assert types == ["job.queued", "job.running", "job.cancel_requested", *ends], types


def test_nats_restart_loses_no_job(fresh: Deployment) -> None:
    base = fresh.start_gateway()
    fresh.start_worker(HERALD_WORKER_CONCURRENCY="2", HERALD_REPORT_PAGE_MS="60")
    with client(base) as http:
        ids = [http.post("/reports", json={"title": f"r{i}", "pages": 10}).json()["id"] for i in range(6)]
        wait_until(lambda: any(http.get(f"/jobs/{i}").json()["state"] == "running" for i in ids), what="one running")
        fresh.nats.restart()
        ids += [http.post("/reports", json={"title": "after", "pages": 2}).json()["id"]]
        for job_id in ids:
            done = wait_for_state(http, job_id, {"succeeded", "failed", "cancelled"}, timeout=60)
            assert done["state"] == "succeeded", done
            assert_one_result(fresh, done)


def test_kill_9_gateway_right_after_202(fresh: Deployment) -> None:
    base = fresh.start_gateway()
    with client(base) as http:
        job = http.post("/reports", json={"title": "orphan", "pages": 2}).json()
    fresh.kill("gateway", signal.SIGKILL)
    fresh.start_worker()
    base = fresh.start_gateway("gateway-2")
    with client(base) as http:
        done = wait_for_state(http, job["id"], {"succeeded"}, timeout=30)
        assert_one_result(fresh, done)


def test_worker_that_never_heartbeats_ends_worker_lost(fresh: Deployment) -> None:
    # The gateway's sweeper expects a heartbeat every second; this worker is configured
    # to send one only every ~17 minutes, so every attempt goes silent.
    base = fresh.start_gateway(HERALD_HEARTBEAT_TIMEOUT_S="1", HERALD_MAX_ATTEMPTS="2")
    fresh.start_worker(HERALD_HEARTBEAT_TIMEOUT_S="3600", HERALD_MAX_ATTEMPTS="2", HERALD_REPORT_PAGE_MS="100")
    with client(base) as http:
        job = http.post("/reports", json={"title": "silent", "pages": 200}).json()
        done = wait_for_state(http, job["id"], {"succeeded", "failed"}, timeout=40)
        assert done["state"] == "failed" and done["attempt"] == 2
        assert done["error"]["type"] == "/problems/worker-lost"
        assert not any(f.suffix == ".pdf" for f in result_files(fresh, job["id"]))


def test_job_past_its_deadline_fails(fresh: Deployment) -> None:
    base = fresh.start_gateway(HERALD_JOB_DEADLINE_S="1")
    fresh.start_worker(HERALD_REPORT_PAGE_MS="100")
    with client(base) as http:
        job = http.post("/reports", json={"title": "late", "pages": 100}).json()
        done = wait_for_state(http, job["id"], {"succeeded", "failed"}, timeout=20)
        assert done["state"] == "failed" and done["error"]["type"] == "/problems/deadline-exceeded"
        # The worker notices at its next write and stops, leaving no result behind.
        wait_until(lambda: not result_files(fresh, job["id"]), what="partial output removed")
        assert http.get(f"/jobs/{job['id']}").json()["version"] == done["version"], "a terminal job never moves"


def test_cancel_queued_running_and_finished(fresh: Deployment) -> None:
    base = fresh.start_gateway()
    with client(base) as http:
        queued = http.post("/reports", json={"title": "never", "pages": 2}).json()
        cancelled = http.delete(f"/jobs/{queued['id']}")
        assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
        assert http.delete(f"/jobs/{queued['id']}").status_code == 200, "cancelling twice is fine"

        fresh.start_worker(HERALD_REPORT_PAGE_MS="100")
        # The worker receives the cancelled job's message, acks it and skips it.
        wait_until(lambda: stream_state(fresh.nats.url, JOBS_STREAM).messages == 0, what="message consumed")
        assert http.get(f"/jobs/{queued['id']}").json()["state"] == "cancelled"
        assert http.get(f"/jobs/{queued['id']}").json()["attempt"] == 0

        running = http.post("/reports", json={"title": "stop me", "pages": 50}).json()
        running_with_progress(http, running["id"])
        requested = http.delete(f"/jobs/{running['id']}")
        assert requested.status_code == 202 and requested.json()["cancel_requested"] is True
        assert http.delete(f"/jobs/{running['id']}").status_code in (200, 202)
        ended = wait_for_state(http, running["id"], {"cancelled", "succeeded"})
        assert ended["state"] == "cancelled"
        assert not result_files(fresh, running["id"]), "partial output removed"

        finished = http.post("/reports", json={"title": "done", "pages": 1}).json()
        wait_for_state(http, finished["id"], {"succeeded"})
        too_late = http.delete(f"/jobs/{finished['id']}")
        assert too_late.status_code == 409 and too_late.json()["type"] == "/problems/job-finished"


def test_sigterm_hands_the_job_back(fresh: Deployment) -> None:
    base = fresh.start_gateway()
    fresh.start_worker("worker-1", HERALD_REPORT_PAGE_MS="100", HERALD_WORKER_GRACE_S="0.2")
    with client(base) as http:
        job = http.post("/reports", json={"title": "handover", "pages": 30}).json()
        running_with_progress(http, job["id"])
        fresh.kill("worker-1", signal.SIGTERM)
        handed_back = http.get(f"/jobs/{job['id']}").json()
        assert handed_back["state"] == "queued" and handed_back["attempt"] == 2
        fresh.start_worker("worker-2")
        done = wait_for_state(http, job["id"], {"succeeded"}, timeout=30)
        assert done["attempt"] == 2
        assert_one_result(fresh, done)


STOPPED_WITHIN_S = 15.0  # a worker's grace (10 s) and a gateway's stream grace (3 s), on a loaded machine


def _exit_status(deployment: Deployment, name: str) -> int:
    """``name``'s exit status once it has ended (failing, with its log, if it has not in time)."""
    try:
        return deployment.processes[name].wait(STOPPED_WITHIN_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{name} still running {STOPPED_WITHIN_S:g} s after SIGTERM; its log ends:\n"
                             f"{deployment.log_text(name)[-3000:]}") from None


def test_sigterm_stops_every_process_cleanly_with_exit_0(fresh: Deployment) -> None:
    """SIGTERM is the ordinary stop (herald up's, an orchestrator's): each process finishes
    what it has in flight and exits 0. A worker's running job ends within its grace; a
    gateway ends a held stream. A gateway died of the very signal after its clean shutdown
    (-15: uvicorn raises it again once it has stopped), like a process killed mid-request."""
    base = fresh.start_gateway()
    fresh.start_worker(HERALD_REPORT_PAGE_MS="50")
    fresh.start_notifier()
    with client(base) as http:
        job = http.post("/reports", json={"title": "finish me", "pages": 20}).json()
        running_with_progress(http, job["id"])
        fresh.processes["worker"].send_signal(signal.SIGTERM)
        assert _exit_status(fresh, "worker") == 0, fresh.log_text("worker")[-3000:]
        assert http.get(f"/jobs/{job['id']}").json()["state"] == "succeeded", "finished within the grace"
        fresh.processes["notifier"].send_signal(signal.SIGTERM)
        assert _exit_status(fresh, "notifier") == 0, fresh.log_text("notifier")[-3000:]
        with http.stream("GET", "/events", headers={"Accept": "text/event-stream"}, timeout=30) as stream:
            received = stream.iter_bytes()
            assert next(received).startswith(b"retry:")  # held open while the gateway stops
            fresh.processes["gateway"].send_signal(signal.SIGTERM)
            # uvicorn gives streams 3 s, then cancels them and closes their connections: the
            # body breaks off, which an EventSource reconnects after as after any end.
            with contextlib.suppress(httpx.RemoteProtocolError):
                for _ in received:
                    pass
        assert _exit_status(fresh, "gateway") == 0, fresh.log_text("gateway")[-3000:]
    for name in ("gateway", "worker", "notifier"):
        assert "shutdown took longer" not in fresh.log_text(name)


def test_retention_deletes_job_result_and_history(fresh: Deployment) -> None:
    base = fresh.start_gateway(HERALD_RETENTION_S="1")
    fresh.start_worker(HERALD_RETENTION_S="1")
    with client(base) as http:
        job = http.post("/reports", json={"title": "ephemeral", "pages": 1}).json()
        done = wait_for_state(http, job["id"], {"succeeded"})
        assert done["expires_at"] is not None
        assert result_files(fresh, job["id"])
        gone = wait_until(lambda: (r := http.get(f"/jobs/{job['id']}")).status_code == 410 and r, timeout=10,
                          what="410 Gone")
        assert gone.json()["type"] == "/problems/gone"
        assert not result_files(fresh, job["id"])
        assert http.get(f"/reports/{job['id']}").status_code == 410
        # Every signed link answers as the key does (each was a 404 once, as if the job never was).
        for link in ("result", "events", "output"):
            signed = httpx.get(base + done["links"][link])
            assert signed.status_code == 410 and signed.json()["type"] == "/problems/gone", (link, signed.text)
        assert http.get(f"/jobs/{job['id']}/events").status_code == 410
        assert http.get("/jobs/00000000-0000-4000-8000-000000000000").status_code == 404
        feed = http.get("/events", params={"limit": 500}, headers={"Accept": "application/json"}).json()
        assert all(e["data"]["id"] != job["id"] for e in feed["events"]), "history deleted too"
