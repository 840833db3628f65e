"""A PostgreSQL store that is not there yet: the gateway says so and waits (SPEC §9, §11).

An operator who starts Herald before its database, or with a wrong URL, gets a log line
naming HERALD_DATABASE_URL, a /readyz that answers 503, and a gateway that comes ready
by itself once the database is there: never a silent crash loop.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from launcher.pgserver import PostgresServer
from tests.harness import ADMIN_KEY, SECRET_KEY, Deployment, free_port, wait_until


def test_gateway_waits_for_an_unreachable_database_and_says_why(tmp_path: Path, server_dir: Path) -> None:
    pg_port = free_port()  # nothing listens here yet
    deployment = Deployment(tmp_path / "herald", database_url=f"postgresql://postgres@127.0.0.1:{pg_port}/herald")
    deployment.nats.start()
    server = PostgresServer(server_dir / "pg", port=pg_port)
    try:
        port = free_port()
        deployment.ports["gateway"] = port
        process = deployment._spawn("gateway", ["gateway"], deployment.env(HERALD_HTTP_PORT=str(port)))
        base = f"http://127.0.0.1:{port}"
        not_ready = wait_until(lambda: (r := httpx.get(base + "/readyz", timeout=2)).status_code == 503 and r,
                               what="/readyz 503 while the database is away")
        assert not_ready.headers["content-type"].startswith("application/problem+json")

        def complaint() -> dict[str, object] | None:
            events = deployment.log_events("gateway")
            return next((e for e in events if "HERALD_DATABASE_URL" in str(e.get("event", ""))), None)

        record = wait_until(complaint, what="a log line naming HERALD_DATABASE_URL")
        assert record["level"] in ("error", "warning")
        # A request that needs the store is told to come back, not given a 500.
        answer = httpx.get(base + "/jobs", headers={"Authorization": "Bearer key-acme"}, timeout=5)
        assert answer.status_code == 503 and answer.headers.get("retry-after")

        server.start()  # the database arrives: the gateway gets ready without a restart
        server.create_database("herald")
        wait_until(lambda: httpx.get(base + "/readyz", timeout=2).status_code == 200, timeout=30,
                   what="/readyz 200 once the database is there")
        assert process.poll() is None, "the gateway kept running throughout"
        started = httpx.post(base + "/reports", json={"title": "late db", "pages": 1}, timeout=5,
                             headers={"Authorization": "Bearer key-acme"})
        assert started.status_code == 202

        # The database goes away again: every store-bound route family says 503, never 500.
        server.stop()
        key = {"Authorization": "Bearer key-acme"}
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        for method, path, headers in (("GET", "/jobs", key), ("GET", "/webhooks", key),
                                      ("POST", "/webhooks", key), ("GET", "/admin/tenants", admin),
                                      ("GET", "/admin/audit", admin)):
            body = {"url": "http://127.0.0.1:9/hook"} if method == "POST" else None
            answer = httpx.request(method, base + path, json=body, headers=headers, timeout=10)
            assert answer.status_code == 503, (method, path, answer.status_code, answer.text)
            assert answer.headers.get("retry-after"), (method, path)
        server.start()
        wait_until(lambda: httpx.get(base + "/webhooks", headers=key, timeout=5).status_code == 200, timeout=30,
                   what="/webhooks 200 once the database is back")
    finally:
        deployment.stop()
        server.stop()


async def test_a_unix_socket_url_reaches_the_store(postgres_server: PostgresServer) -> None:
    """``postgresql://user@/db?host=/dir``: the form a database on the same machine is often given in."""
    from herald.jobs import NewJob
    from herald.settings import Settings
    from herald.storage import open_storage

    postgres_server.create_database("socket_test")
    url = f"postgresql://postgres@/socket_test?host={postgres_server.socket_dir}&port={postgres_server.port}"
    storage = await open_storage(Settings(database_url=url, secret_keys=(SECRET_KEY,)))
    try:
        accepted = await storage.jobs.accept(NewJob(id="6f1c1a3e-1b9f-4d1e-9a59-0c4b1f1e2d3c", tenant="acme",
                                                    kind="report", collection="/reports", params=b"{}", deadline_s=60))
        assert (await storage.jobs.get(accepted.job.id)) == accepted.job
    finally:
        await storage.close()
