"""A small multi-process HTTP/1.1 load client (keep-alive, Content-Length bodies), for what wrk cannot do.

* ``open_loop``: a fixed offered rate. Request *i* is due at ``t0 + i / rate``; its
  latency runs from when it was due, not from when a connection was free, so a stalled
  server is charged for the queue it causes (no coordinated omission).
* ``closed_loop``: saturation with N connections (the fallback when wrk is missing), or
  a fixed number of requests (the end-to-end run's job starts, whose ``Location`` and
  send time it keeps).

Each process runs its share on one uvloop event loop over plain ``asyncio.Protocol``
connections; the processes start together (a go signal after every connection is
open) and report their own CPU time.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.connection
import random
import resource
import time
from dataclasses import dataclass, field
from typing import Any

from bench.stats import latency_summary

_CTX = multiprocessing.get_context("spawn")


@dataclass(frozen=True)
class Target:
    """What to send: a method, and a path or a list of paths to pick from at random; or
    ``choices``, whole requests (``Target.request``'s bytes) to pick from at random, for
    loads that vary a header or the body (several tenants' keys, several callback URLs)."""

    port: int
    method: str = "GET"
    paths: tuple[str, ...] = ("/",)
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    choices: tuple[bytes, ...] = ()

    def request(self, path: str) -> bytes:
        lines = [f"{self.method} {path} HTTP/1.1", f"Host: 127.0.0.1:{self.port}"]
        lines += [f"{name}: {value}" for name, value in self.headers]
        if self.body or self.method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(self.body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + self.body

    def pick(self) -> bytes:
        """The next request to send."""
        return random.choice(self.choices) if self.choices else self.request(random.choice(self.paths))


class HttpConnection(asyncio.Protocol):
    """One keep-alive connection; ``request()`` returns (status, head, body)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.head: bytes | None = None
        self.need = 0
        self.waiter: asyncio.Future[tuple[int, bytes, bytes]] | None = None
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection closed"))
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.head is None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            self.head = bytes(self.buffer[:end])
            del self.buffer[: end + 4]
            self.need = 0
            for line in self.head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    self.need = int(value)
        if len(self.buffer) >= self.need and self.waiter is not None and not self.waiter.done():
            status = int(self.head.split(b" ", 2)[1])
            body = bytes(self.buffer[: self.need])
            del self.buffer[: self.need]
            head, self.head = self.head, None
            self.waiter.set_result((status, head, body))

    async def request(self, data: bytes) -> tuple[int, bytes, bytes]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return await self.waiter


def header_value(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


@dataclass
class _Tally:
    latencies_ms: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    errors: int = 0
    records: list[tuple[float, float, int, str]] = field(default_factory=list)  # wall sent, wall done, status, location

    def add(self, status: int, latency_ms: float) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1
        self.latencies_ms.append(latency_ms)


async def _open(port: int, n: int) -> list[HttpConnection]:
    loop = asyncio.get_running_loop()
    conns = []
    for _ in range(n):
        _transport, protocol = await loop.create_connection(HttpConnection, "127.0.0.1", port)
        conns.append(protocol)
    return conns


async def _closed(spec: dict[str, Any], conns: list[HttpConnection], tally: _Tally, start_at: float) -> float:
    target: Target = spec["target"]
    deadline = start_at + spec["duration_s"] if spec.get("duration_s") else float("inf")
    left = [spec.get("count") or 0]
    counted = bool(spec.get("count"))
    keep = spec.get("keep_records", False)

    async def one(conn: HttpConnection) -> None:
        while time.time() < deadline and (not counted or left[0] > 0):
            if counted:
                left[0] -= 1
            sent, t0 = time.time(), time.perf_counter()
            try:
                status, head, _body = await conn.request(target.pick())
            except ConnectionError:
                tally.errors += 1
                return
            tally.add(status, (time.perf_counter() - t0) * 1000)
            if keep:
                location = (header_value(head, b"location") or b"").decode()
                tally.records.append((sent, time.time(), status, location))

    await asyncio.sleep(max(0.0, start_at - time.time()))
    t0 = time.perf_counter()
    await asyncio.gather(*(one(c) for c in conns))
    return time.perf_counter() - t0


async def _open_loop(spec: dict[str, Any], conns: list[HttpConnection], tally: _Tally, start_at: float) -> float:
    target: Target = spec["target"]
    rate, duration = spec["rate"], spec["duration_s"]
    keep = spec.get("keep_records", False)
    idle: asyncio.Queue[HttpConnection] = asyncio.Queue()
    for conn in conns:
        idle.put_nowait(conn)
    tasks: set[asyncio.Task[None]] = set()
    loop = asyncio.get_running_loop()

    async def one(due_perf: float, due_wall: float) -> None:
        conn = await idle.get()
        try:
            status, head, _body = await conn.request(target.pick())
        except ConnectionError:
            tally.errors += 1
            return
        idle.put_nowait(conn)
        tally.add(status, (time.perf_counter() - due_perf) * 1000)
        if keep:
            tally.records.append((due_wall, time.time(), status, (header_value(head, b"location") or b"").decode()))

    await asyncio.sleep(max(0.0, start_at - time.time()))
    t0_perf, t0_wall = time.perf_counter(), time.time()
    total = int(rate * duration)
    for i in range(total):
        due = t0_perf + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = loop.create_task(one(due, t0_wall + i / rate))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks, timeout=30)
    return time.perf_counter() - t0_perf


def _child(conn: multiprocessing.connection.Connection, spec: dict[str, Any]) -> None:
    import uvloop

    async def main() -> dict[str, Any]:
        conns = await _open(spec["target"].port, spec["connections"])
        conn.send("ready")
        start_at = conn.recv()
        tally = _Tally()
        run = _open_loop if spec.get("rate") else _closed
        wall = await run(spec, conns, tally, start_at)
        for c in conns:
            if c.transport is not None:
                c.transport.close()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {"wall_s": wall, "latencies_ms": tally.latencies_ms, "statuses": tally.statuses,
                "errors": tally.errors, "records": tally.records, "cpu_s": usage.ru_utime + usage.ru_stime}

    try:
        conn.send(uvloop.run(main()))
    except Exception as exc:  # report, so the parent does not wait forever
        conn.send({"error": f"{type(exc).__name__}: {exc}"})


def run(target: Target, *, processes: int, connections: int, duration_s: float | None = None,
        rate: float | None = None, count: int | None = None, keep_records: bool = False) -> dict[str, Any]:
    """Run the load in ``processes`` processes (``connections``, ``rate`` and ``count`` are totals)."""
    processes = max(1, min(processes, connections))
    pipes, children = [], []
    for index in range(processes):
        share = {
            "target": target,
            "connections": connections // processes + (1 if index < connections % processes else 0),
            "duration_s": duration_s,
            "rate": rate / processes if rate else None,
            "count": (count // processes + (1 if index < count % processes else 0)) if count else None,
            "keep_records": keep_records,
        }
        parent, child = _CTX.Pipe()
        proc = _CTX.Process(target=_child, args=(child, share), daemon=True)
        proc.start()
        pipes.append(parent)
        children.append(proc)
    try:
        for pipe in pipes:
            ready = pipe.recv()
            if ready != "ready":
                raise RuntimeError(f"load client failed: {ready}")
        start_at = time.time() + 0.1
        for pipe in pipes:
            pipe.send(start_at)
        results = [pipe.recv() for pipe in pipes]
    finally:
        for proc in children:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    failed = [r["error"] for r in results if "error" in r]
    if failed:
        raise RuntimeError(f"load client failed: {failed[0]}")
    latencies = [v for r in results for v in r["latencies_ms"]]
    statuses: dict[int, int] = {}
    for r in results:
        for status, n in r["statuses"].items():
            statuses[status] = statuses.get(status, 0) + n
    wall = max(r["wall_s"] for r in results)
    cpu = sum(r["cpu_s"] for r in results)
    summary = latency_summary(latencies)
    return {
        "rps": round(len(latencies) / wall, 1) if wall else 0.0,
        "requests": len(latencies),
        "errors": sum(r["errors"] for r in results) + sum(n for s, n in statuses.items() if s >= 400),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        **{k: v for k, v in summary.items() if k != "n"},
        "loadgen": f"python x{processes}",
        "loadgen_cpu_pct": round(100 * cpu / wall, 1) if wall else 0.0,
        "records": [rec for r in results for rec in r["records"]] if keep_records else None,
    }
