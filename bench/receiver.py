"""The webhook receiver: aiohttp, in its own processes, verifying every delivery's signature.

``POST /hook/{name}`` checks the Standard Webhooks signature and timestamp against the
secret registered for ``name`` (with the reference ``standardwebhooks`` library when it
is installed, else the same HMAC rule by hand), answers ``204`` (``400`` when it does
not verify) and keeps, per delivery: when it arrived, its ``webhook-id``, the event
type and the status object's ``id``, ``state`` and ``updated_at`` (when the transition
committed) and the endpoint's name. Several processes share the port (SO_REUSEPORT); a thread in each answers
the bench's ``stats`` / ``reset`` / ``stop`` over a pipe.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import multiprocessing
import multiprocessing.connection
import resource
import secrets
import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from bench.procs import free_port, listening, wait_until

_CTX = multiprocessing.get_context("spawn")


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """``v1,<base64 HMAC-SHA256>`` of ``id.timestamp.body``, as Herald's notifier signs."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    digest = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


class _HandVerifier:
    """The Standard Webhooks rule, for when the reference library is not installed."""

    def __init__(self, secret: str) -> None:
        self.secret = secret

    def verify(self, body: bytes, headers: Mapping[str, str]) -> Any:
        lower = {k.lower(): v for k, v in headers.items()}
        timestamp = int(lower["webhook-timestamp"])
        if abs(time.time() - timestamp) > 300:
            raise ValueError("timestamp out of tolerance")
        expected = sign(self.secret, lower["webhook-id"], timestamp, body).encode()
        if not any(hmac.compare_digest(expected, s.encode()) for s in lower["webhook-signature"].split()):
            raise ValueError("no matching signature")
        return json.loads(body)


def _verifier(secret: str) -> Any:
    try:
        from standardwebhooks.webhooks import Webhook
    except ImportError:
        return _HandVerifier(secret)
    return Webhook(secret)


def _serve(port: int, secrets_by_name: dict[str, str], pipe: multiprocessing.connection.Connection) -> None:
    import asyncio

    import uvloop
    from aiohttp import web

    verifiers = {name: _verifier(secret) for name, secret in secrets_by_name.items()}
    records: list[tuple[float, str, str, str, str, str, str]] = []
    invalid = [0]

    async def hook(request: web.Request) -> web.Response:
        body = await request.read()
        arrived = time.time()
        name = request.match_info["name"]
        verifier = verifiers.get(name)
        try:
            if verifier is None:
                raise ValueError("unknown endpoint")
            payload = verifier.verify(body, request.headers)
        except Exception:
            invalid[0] += 1
            return web.Response(status=400)
        data = payload.get("data") or {}
        records.append((arrived, request.headers.get("webhook-id", ""), payload.get("type", ""),
                        data.get("updated_at", ""), data.get("id", ""), data.get("state", ""), name))
        return web.Response(status=204)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        app = web.Application()
        app.router.add_post("/hook/{name}", hook)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port, reuse_port=True, backlog=4096)
        await site.start()

        def control() -> None:
            while True:
                try:
                    command = pipe.recv()
                except EOFError:
                    command = "stop"
                if command == "stats":
                    usage = resource.getrusage(resource.RUSAGE_SELF)
                    pipe.send({"records": list(records), "invalid": invalid[0],
                               "cpu_s": usage.ru_utime + usage.ru_stime})
                elif command == "count":
                    pipe.send(len(records))
                elif command == "reset":
                    records.clear()
                    invalid[0] = 0
                    pipe.send("ok")
                else:
                    loop.call_soon_threadsafe(stop.set)
                    return

        threading.Thread(target=control, daemon=True).start()
        pipe.send("started")
        await stop.wait()
        await runner.cleanup()
        pipe.send("stopped")

    uvloop.run(main())


class Receiver:
    """``processes`` receiver processes on one free port; ``url(name)`` is an endpoint's URL."""

    def __init__(self, secrets_by_name: Mapping[str, str], *, processes: int = 2, port: int | None = None) -> None:
        self.port = port or free_port()
        self.pipes: list[multiprocessing.connection.Connection] = []
        self.procs: list[Any] = []
        for _ in range(processes):
            parent, child = _CTX.Pipe()
            proc = _CTX.Process(target=_serve, args=(self.port, dict(secrets_by_name), child), daemon=True)
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)
        for pipe in self.pipes:
            assert pipe.recv() == "started"
        wait_until(lambda: listening(self.port), timeout=10, what="webhook receiver listening")

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/hook/{name}"

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def _ask(self, command: str) -> list[Any]:
        for pipe in self.pipes:
            pipe.send(command)
        return [pipe.recv() for pipe in self.pipes]

    def stats(self) -> dict[str, Any]:
        answers = self._ask("stats")
        records = sorted(r for a in answers for r in a["records"])
        return {"records": records, "invalid": sum(a["invalid"] for a in answers),
                "cpu_s": sum(a["cpu_s"] for a in answers)}

    def count(self) -> int:
        return sum(self._ask("count"))

    def reset(self) -> None:
        self._ask("reset")

    def stop(self) -> None:
        if not self.pipes:
            return
        try:
            self._ask("stop")
        except (OSError, EOFError):
            pass
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
        self.pipes, self.procs = [], []
