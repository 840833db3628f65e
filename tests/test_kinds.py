"""Job kinds from outside Herald (issue 15): discovery through entry points and HERALD_KINDS,
refusal of clashes and broken declarations at start, workers that serve only some kinds,
per-kind concurrency and queue age, JSON results."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from herald.kinds import REPORT, KindError, discover
from tests.harness import Deployment, client, wait_for_state, wait_until

REPO = Path(__file__).resolve().parent.parent
FIXTURE = "tests.kinds_fixture"


# ----- discovery, in process -------------------------------------------------------------------


def test_builtin_kinds_come_from_entry_points_like_a_users() -> None:
    found = discover()
    assert {"report", "export"} <= set(found)
    for name in ("report", "export"):
        assert found[name].origin.startswith(f"entry point {name} = 'herald.kinds:"), found[name].origin
        assert "distribution herald " in found[name].origin


def test_herald_kinds_adds_a_module_attribute_and_counts_one_declaration_once() -> None:
    found = discover([f"{FIXTURE}:ECHO", f" {FIXTURE}:SAME_ECHO "])
    assert found["echo"].kind.collection == "/echoes"
    assert found["echo"].origin == f"HERALD_KINDS item '{FIXTURE}:ECHO'"
    assert "tests.kinds_fixture_handlers" not in sys.modules  # a declaration imports no handler
    assert found["echo"].kind.handler == "tests.kinds_fixture_handlers:echo"


@pytest.mark.parametrize(("item", "words"), [
    (f"{FIXTURE}:CLASH_NAME", ["the name 'report'", "entry point report = 'herald.kinds:REPORT'",
                               f"HERALD_KINDS item '{FIXTURE}:CLASH_NAME'"]),
    (f"{FIXTURE}:CLASH_PATH", ["the path '/reports'", "entry point report", f"'{FIXTURE}:CLASH_PATH'"]),
    (f"{FIXTURE}:NOT_A_KIND", [f"'{FIXTURE}:NOT_A_KIND'", "not a herald.kinds.KindDeclaration"]),
    (f"{FIXTURE}:MISSING", [f"'{FIXTURE}:MISSING'", "cannot be loaded", "AttributeError"]),
    ("tests.no_such_module:KIND", ["'tests.no_such_module:KIND'", "ModuleNotFoundError"]),
    ("no_colon_here", ["'no_colon_here'", "module:attribute"]),
])
def test_bad_declarations_are_refused_by_name(item: str, words: list[str]) -> None:
    with pytest.raises(KindError) as refused:
        discover([item])
    for word in words:
        assert word in str(refused.value), str(refused.value)


def test_a_malformed_declaration_says_what_is_wrong() -> None:
    from herald.kinds import KindDeclaration
    from tests.kinds_fixture import EchoParams

    for changes, words in (
        ({"name": "Bad-Name"}, "name"), ({"collection": "/a/b"}, "collection"), ({"collection": "/jobs"}, "Herald's own"),
        ({"handler": "no_function"}, "module:function"), ({"example": {"message": ""}}, "example body is not valid"),
        ({"max_attempts": 0}, "max_attempts"),
    ):
        arguments = {"name": "ok", "params": EchoParams, "collection": "/oks", "handler": "m:f", **changes}
        with pytest.raises(KindError, match=words):
            KindDeclaration(**arguments)  # type: ignore[arg-type]


# ----- refusals at a process's start -------------------------------------------------------------


def _herald(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("HERALD_")}
    base.update(HERALD_DATA_DIR=str(tmp_path / "var"), HERALD_NATS_URL="nats://127.0.0.1:1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "launcher.cli", *argv], env=base, cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def _broken_distribution(site: Path) -> None:
    """An installed distribution whose herald.kinds entry point names a module that does not exist."""
    info = site / "broken_kinds-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-kinds\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[herald.kinds]\nbroken = broken_kinds_missing.kinds:KIND\n")


def test_processes_refuse_to_start_naming_the_fault(tmp_path: Path) -> None:
    clash = _herald(tmp_path, "gateway", env={"HERALD_KINDS": f"{FIXTURE}:CLASH_NAME"})
    assert clash.returncode == 2
    assert "two job kinds claim the name 'report'" in clash.stderr and "CLASH_NAME" in clash.stderr

    unknown = _herald(tmp_path, "worker", "--kinds", "report,nope")
    assert unknown.returncode == 2 and "'nope'" in unknown.stderr and "declared kinds: export, report" in unknown.stderr
    unknown_env = _herald(tmp_path, "worker", env={"HERALD_WORKER_KINDS": "nope"})
    assert unknown_env.returncode == 2 and "'nope'" in unknown_env.stderr
    counts = _herald(tmp_path, "worker", env={"HERALD_WORKER_KIND_CONCURRENCY": "nope:2"})
    assert counts.returncode == 2 and "HERALD_WORKER_KIND_CONCURRENCY" in counts.stderr and "'nope'" in counts.stderr

    no_handler = _herald(tmp_path, "worker", env={"HERALD_KINDS": f"{FIXTURE}:NO_HANDLER"})
    assert no_handler.returncode == 2
    assert "job kind 'orphan'" in no_handler.stderr and "cannot import handler 'tests.no_such_module:run'" in no_handler.stderr
    sync = _herald(tmp_path, "kinds", "--check", env={"HERALD_KINDS": f"{FIXTURE}:SYNC_HANDLER"})
    assert sync.returncode == 2 and "must be an 'async def" in sync.stderr
    up = _herald(tmp_path, "up", env={"HERALD_KINDS": f"{FIXTURE}:NO_HANDLER"})  # before it starts anything
    assert up.returncode == 2 and "cannot import handler" in up.stderr

    site = tmp_path / "site"
    _broken_distribution(site)
    broken = _herald(tmp_path, "gateway", env={"PYTHONPATH": str(site)})
    assert broken.returncode == 2
    assert "entry point broken = 'broken_kinds_missing.kinds:KIND'" in broken.stderr
    assert "distribution broken-kinds 0.1" in broken.stderr and "ModuleNotFoundError" in broken.stderr

    listed = _herald(tmp_path, "kinds", "--check", env={"HERALD_KINDS": f"{FIXTURE}:ECHO"})
    assert listed.returncode == 0, listed.stderr
    assert "echo  POST /echoes  ->  application/json" in listed.stdout and "every handler imports (3 kinds)" in listed.stdout


# ----- workers for some kinds --------------------------------------------------------------------


def _metric(base: str, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_workers_serve_only_their_kinds_and_the_rest_wait(fresh: Deployment, tmp_path: Path) -> None:
    log = tmp_path / "kinds.log"
    fresh.env_overrides.update(HERALD_KINDS=f"{FIXTURE}:ECHO", KINDS_TEST_LOG=str(log))
    base = fresh.start_gateway()
    reports_only = fresh.start_worker("reports", HERALD_WORKER_KINDS="report")
    # Only the kind it serves, with the slots the kind declares.
    assert fresh.logged("reports", "worker ready")[0]["kinds"] == {"report": REPORT.concurrency}
    with client(base) as http:
        echo = http.post("/echoes", json={"message": "waiting"}).json()
        report = http.post("/reports", json={"title": "served", "pages": 2}).json()
        wait_for_state(http, report["id"], {"succeeded"})
        # No worker serves echo: it waits in JetStream, and its queue age shows per kind.
        assert http.get(f"/jobs/{echo['id']}").json()["state"] == "queued"
        wait_until(lambda: (_metric(base, "herald_kind_queue_oldest_age_seconds", kind="echo") or 0) > 0.5,
                   what="echo's queue age growing")
        assert _metric(base, "herald_kind_queue_oldest_age_seconds", kind="report") == 0.0

        fresh._spawn("echoes", ["worker", "--kinds", "echo"], fresh.env())  # the flag, as an operator types it
        wait_until(lambda: fresh.logged("echoes", "worker ready"), what="the echo worker ready")
        done = wait_for_state(http, echo["id"], {"succeeded"})
        assert done["result"] == f"/echoes/{echo['id']}"
        result = http.get(f"/echoes/{echo['id']}")
        assert result.status_code == 200 and result.headers["content-type"] == "application/json"
        assert result.json() == {"echo": "waiting", "attempt": 1, "kind": "echo"}
        assert result.headers["content-disposition"] == f'attachment; filename="echo-{echo["id"]}.json"'
        signed = httpx.get(base + done["links"]["result"])  # the signed URL, no key
        assert signed.status_code == 200 and signed.json()["echo"] == "waiting"
        assert _metric(base, "herald_kind_queue_oldest_age_seconds", kind="echo") == 0.0

        # Only the echo worker ever ran echo jobs; a new report still goes to the report worker.
        again = http.post("/reports", json={"title": "again", "pages": 1}).json()
        wait_for_state(http, again["id"], {"succeeded"})
    assert reports_only.poll() is None
    importers = {int(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("import ")}
    assert importers == {fresh.processes["echoes"].pid}, "only the worker serving echo imports its handler"
    assert not fresh.logged("reports", "job started", kind="echo")
    assert not fresh.logged("echoes", "job started", kind="report")


def test_small_json_results_live_in_the_row_where_the_store_keeps_them(fresh: Deployment) -> None:
    """Both stores keep a small JSON result in the job's row, written by the success itself (no
    file, no fsync); a large one goes to the result store.
    Both are served alike: body, type, attachment name, ETag and 304, the signed URL."""
    from workers.runner import ROW_RESULT_MAX_BYTES

    fresh.env_overrides.update(HERALD_KINDS=f"{FIXTURE}:SIZED")
    base = fresh.start_gateway()
    fresh.start_worker()
    sizes = {"small": 100, "large": ROW_RESULT_MAX_BYTES + 1}
    with client(base) as http:
        started = {name: http.post("/sized", json={"size": size}).json()["id"] for name, size in sizes.items()}
        for name, job_id in started.items():
            done = wait_for_state(http, job_id, {"succeeded"})
            result = http.get(f"/sized/{job_id}")
            assert result.status_code == 200, result.text
            assert result.headers["content-type"] == "application/json"
            assert result.headers["content-disposition"] == f'attachment; filename="sized-{job_id}.json"'
            assert result.json() == {"data": "x" * sizes[name]}
            again = http.get(f"/sized/{job_id}", headers={"If-None-Match": result.headers["etag"]})
            assert again.status_code == 304 and again.headers["etag"] == result.headers["etag"]
            assert httpx.get(base + done["links"]["result"]).json() == {"data": "x" * sizes[name]}
    assert fresh.result_names(started["small"]) == []
    assert fresh.result_names(started["large"]) == ["1.json"]
    if fresh.database_url is None:  # and no scratch directory was made for a result that never needed one
        assert not (fresh.data_dir / "results" / started["small"][:2] / started["small"]).exists()


def test_per_kind_concurrency_and_openapi_of_a_users_kind(fresh: Deployment, tmp_path: Path) -> None:
    log = tmp_path / "kinds.log"
    fresh.env_overrides.update(HERALD_KINDS=f"{FIXTURE}:ECHO", KINDS_TEST_LOG=str(log))
    base = fresh.start_gateway()
    fresh.start_worker(HERALD_WORKER_CONCURRENCY="4")  # echo declares concurrency=1: one at a time
    assert fresh.logged("worker", "worker ready")[0]["kinds"] == {"echo": 1, "export": 4, "report": 4}
    with client(base) as http:
        jobs = [http.post("/echoes", json={"message": f"m{i}", "sleep_ms": 300}).json() for i in range(3)]
        report = http.post("/reports", json={"title": "beside", "pages": 1}).json()
        wait_for_state(http, report["id"], {"succeeded"})  # other kinds are not held back
        for job in jobs:
            wait_for_state(http, job["id"], {"succeeded"})
    spans = {}
    for line in log.read_text().splitlines():
        what, *rest = line.split()
        if what in ("start", "end"):
            spans.setdefault(rest[0], {})[what] = float(rest[1])
    ordered = sorted(spans.values(), key=lambda s: s["start"])
    assert len(ordered) == 3
    assert all(a["end"] <= b["start"] for a, b in zip(ordered, ordered[1:])), f"ran at once: {ordered}"

    spec = httpx.get(base + "/schema/openapi.json").json()
    start = spec["paths"]["/echoes"]["post"]
    body = start["requestBody"]["content"]["application/json"]
    assert body["example"] == {"message": "hello"}
    assert body["schema"] == {"$ref": "#/components/schemas/EchoParams"}
    assert set(spec["components"]["schemas"]["EchoParams"]["required"]) == {"message"}
    assert "Answers its message back" in start["description"]
    assert "application/json" in spec["paths"]["/echoes/{job_id}"]["get"]["responses"]["200"]["content"]
    report_body = spec["paths"]["/reports"]["post"]["requestBody"]["content"]["application/json"]
    assert report_body["example"] == {"title": "Quarterly report", "pages": 5}
    assert "application/pdf" in spec["paths"]["/reports/{job_id}"]["get"]["responses"]["200"]["content"]


def test_backlog_of_an_unserved_kind_does_not_hold_back_the_others(fresh: Deployment) -> None:
    fresh.env_overrides.update(HERALD_KINDS=f"{FIXTURE}:ECHO")
    base = fresh.start_gateway(HERALD_MAX_QUEUE_AGE_S="1")
    fresh.start_worker(HERALD_WORKER_KINDS="report")
    with client(base) as http:
        assert http.post("/echoes", json={"message": "nobody serves me"}).status_code == 202
        refused = wait_until(lambda: (r := http.post("/echoes", json={"message": "x"})).status_code == 503 and r,
                             timeout=10, interval=0.2, what="echo starts refused once its backlog is old")
        assert refused.json()["type"] == "/problems/overloaded" and "echo" in refused.json()["detail"]
        time.sleep(0.6)  # past the guard's refresh
        assert http.post("/reports", json={"title": "still welcome", "pages": 1}).status_code == 202


# ----- the topology -----------------------------------------------------------------------------


async def test_older_consumers_give_way_and_their_messages_reach_the_workers(tmp_path: Path) -> None:
    """Upgrading: the one consumer of every kind (``herald-workers`` on ``jobs.>``) of an older
    Herald is removed (on a work-queue stream consumers may not overlap); a message it had
    not delivered, on ``jobs.<kind>`` (before work was split by tenant), is drained through
    the kind's consumer of old, ``herald-workers-<kind>``, beside the tenants' own."""
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig

    from herald import jetstream
    from herald.constants import JOBS_STREAM, WORKERS_CONSUMER, job_subject, worker_consumer_name
    from herald.kinds import declared_kinds
    from herald.settings import Settings
    from herald.tenants import DefaultLimits
    from tests.harness import NatsServer
    from workers.dispatch import LEGACY, Dispatch

    server = NatsServer(tmp_path / "nats")
    server.start()
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        settings = Settings(data_dir=tmp_path, nats_url=server.url, max_attempts=3)
        for config in jetstream.stream_configs(settings):
            await js.add_stream(config)
        await js.add_consumer(JOBS_STREAM, ConsumerConfig(durable_name=WORKERS_CONSUMER, ack_policy=AckPolicy.EXPLICIT,
                                                          filter_subject="jobs.>"))
        await js.publish(job_subject("export"), b"waiting since before the upgrade")
        await js.publish(job_subject("export", "acme"), b"published since")

        await jetstream.ensure_topology(js, settings, declared_kinds().values())
        await jetstream.ensure_topology(js, settings, declared_kinds().values())  # a second process: no change
        assert WORKERS_CONSUMER not in {info.name for info in await js.consumers_info(JOBS_STREAM)}

        dispatch = Dispatch(nc, js, settings, declared_kinds().values(), DefaultLimits(settings))
        await dispatch.start()
        exports = dispatch.kinds["export"]
        assert set(exports.tenants) == {LEGACY, "acme"}
        taken = {token: [m.data for m in await exports.take(exports.tenants[token], 5)] for token in (LEGACY, "acme")}
        assert taken == {LEGACY: [b"waiting since before the upgrade"], "acme": [b"published since"]}
        old = await js.consumer_info(JOBS_STREAM, worker_consumer_name("export"))
        assert old.config.filter_subject == "jobs.export" and old.config.max_deliver == 4
        tenant = await js.consumer_info(JOBS_STREAM, worker_consumer_name("export", "acme"))
        assert tenant.config.filter_subject == "jobs.export.acme"
        await dispatch.stop()
        await nc.close()
    finally:
        server.stop()


def test_the_sweeper_gives_each_kind_its_own_attempts() -> None:
    """A silent running job is re-queued until its kind's ``max_attempts`` (declared, else
    HERALD_MAX_ATTEMPTS), then failed ``worker-lost``."""
    from herald.jobs import JobRow
    from herald.kinds import load_kinds
    from herald.settings import Settings
    from herald.sweeper import _decide

    load_kinds([f"{FIXTURE}:ONE_ATTEMPT"])
    try:
        settings = Settings(max_attempts=3, heartbeat_timeout_s=30)

        def silent(kind: str, attempt: int) -> JobRow:
            return JobRow(id="j", tenant="t", kind=kind, collection="/x", state="running", params=b"{}", progress=None,
                          version=2, attempt=attempt, cancel_requested=False, created_at=0.0, updated_at=0.0,
                          heartbeat_at=0.0, deadline_at=10_000.0, finished_at=None, expires_at=None, result_path=None,
                          media_type=None, error=None, callback_url=None)

        once = _decide(silent("once", 1), settings, at=100.0, stale_before=70.0)
        assert once is not None and once.to == "failed" and once.error is not None
        assert once.error.type == "/problems/worker-lost" and "attempt 1 of 1" in (once.error.detail or "")
        report = _decide(silent("report", 1), settings, at=100.0, stale_before=70.0)
        assert report is not None and report.to == "queued"
        last = _decide(silent("report", 3), settings, at=100.0, stale_before=70.0)
        assert last is not None and last.to == "failed"
    finally:
        load_kinds()
