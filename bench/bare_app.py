"""The HTTP baselines: bare Litestar endpoints, served exactly as ``herald gateway`` serves Herald.

    python -m bench.bare_app --port 8123 [--db path/to/herald.db]

* ``POST /reports``: the body decoded into a msgspec Struct by Litestar, answered ``202``
  with a small JSON body and ``Location`` — no store, no auth, no outbox. What an accept
  costs before Herald does anything durable.
* ``GET /jobs/{id}``: one primary-key lookup with aiosqlite in the same ``jobs`` table
  Herald reads (the bench points it at Herald's own data file), the row as JSON.

The uvicorn settings are ``launcher.cli.run_gateway``'s (``server_config``: httptools, uvloop,
one process, no access log), so the comparison is Herald's code against the same server;
``--reuse-port`` shares the port with other processes, as ``HERALD_HTTP_REUSE_PORT`` does.
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiosqlite
import msgspec
from litestar import Litestar, Request, Response, get, post


class ReportBody(msgspec.Struct):
    title: str
    pages: int


class Accepted(msgspec.Struct):
    id: str
    state: str


@post("/reports", status_code=202)
async def start_report(data: ReportBody) -> Response[Accepted]:
    job_id = str(uuid.uuid4())
    return Response(Accepted(id=job_id, state="queued"), status_code=202,
                    headers={"Location": f"/jobs/{job_id}", "Retry-After": "1", "Cache-Control": "no-store"})


@get("/jobs/{job_id:str}")
async def get_job(request: Request, job_id: str) -> Response[Any]:
    db: aiosqlite.Connection | None = request.app.state.db
    if db is None:
        return Response({"detail": "no database"}, status_code=404)
    async with db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)) as cursor:
        row = await cursor.fetchone()
    if row is None:
        return Response({"detail": "not found"}, status_code=404)
    values = dict(row)
    for name in ("params", "error"):
        if isinstance(values.get(name), bytes):
            values[name] = values[name].decode()
    return Response(values, headers={"Cache-Control": "no-store"})


@get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


def create_app(db_path: Path | None) -> Litestar:
    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        app.state.db = None
        if db_path is None:
            print("bare app ready", flush=True)  # noqa: T201  (the bench waits for it)
            yield
            return
        async with aiosqlite.connect(db_path) as db:
            db.row_factory = aiosqlite.Row
            await db.execute("PRAGMA query_only=ON")
            app.state.db = db
            print("bare app ready", flush=True)  # noqa: T201
            yield

    return Litestar([start_report, get_job, healthz], lifespan=[lifespan], logging_config=None, debug=False)


def main() -> None:
    import uvicorn

    from launcher.cli import server_config, shared_listener

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--db", type=Path)
    parser.add_argument("--reuse-port", action="store_true", help="share the port with other processes (SO_REUSEPORT)")
    args = parser.parse_args()
    config = server_config(create_app(args.db), "127.0.0.1", args.port)  # the gateway's own settings
    if args.reuse_port:  # as `herald gateway` with HERALD_HTTP_REUSE_PORT=1
        uvicorn.Server(config).run(sockets=[shared_listener("127.0.0.1", args.port, config.backlog)])
    else:
        uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
