"""Many held connections at once: SSE subscribers or long polls, spread over a few processes.

The same client serves Herald and nginx + nchan, so both pay the same client costs.
Each connection is a plain ``asyncio.Protocol`` (uvloop) that decodes chunked transfer
encoding and splits the event stream into frames; it notes the wall-clock time at which
every data frame arrives (``time.time()``: the processes share the machine's clock, so
the bench can subtract the moment it made the change). A long poll notes when its answer
begins and with which status.

The parent drives the processes over pipes: open every connection and wait until each is
ready (its first ``ready_frames`` frames arrived: Herald's ``retry:`` line, and the
snapshot on a job stream), count how many have seen *k* events, collect, close.

With ``stamps``, each data frame's JSON is read as ``{"i": <number>, "t": <wall clock when
made>}`` (the output scenario's chunks): a connection keeps the numbers, the stamps and the
arrival times in arrays (compact enough for 100 readers of 10 000 chunks each), and the
event type of any other frame (the stream's terminal event).
"""

from __future__ import annotations

import asyncio
import array
import multiprocessing
import multiprocessing.connection
import resource
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import msgspec

_CTX = multiprocessing.get_context("spawn")
CONNECT_CONCURRENCY = 64


class _Stamp(msgspec.Struct):
    i: int
    t: float


_stamp_decoder = msgspec.json.Decoder(_Stamp)


class Subscriber(asyncio.Protocol):
    def __init__(self, request: bytes, mode: str, ready_frames: int, keep_frames: bool = False,
                 stamps: bool = False) -> None:
        self.request = request
        self.keep_frames = keep_frames
        self.stamps = stamps
        self.ids = array.array("q")  # with stamps: each stamped frame's number, its stamp, its arrival
        self.stamped = array.array("d")
        self.arrived = array.array("d")
        self.events: list[str] = []  # with stamps: the event type of every other data frame
        self.kept: list[tuple[float, bytes]] = []
        self.mode = mode  # "sse" or "longpoll"
        self.ready_frames = ready_frames
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.payload = bytearray()
        self.status: int | None = None
        self.chunked = False
        self.chunk_left = -1  # -1: expecting a size line; -2: expecting the CRLF after a chunk
        self.frames = 0
        self.times: list[float] = []
        self.answered_at: float | None = None
        self.ready = asyncio.get_running_loop().create_future()
        self.closed = False
        self.finished = False  # the response's body ended (its last chunk came)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(self.request)  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.ready.done():
            self.ready.set_result(False)

    def data_received(self, data: bytes) -> None:
        now = time.time()
        self.buffer += data
        if self.status is None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buffer[:end])
            del self.buffer[: end + 4]
            self.status = int(head.split(b" ", 2)[1])
            self.chunked = b"transfer-encoding: chunked" in head.lower()
            if self.mode == "longpoll":
                self.answered_at = now
                if not self.ready.done():
                    self.ready.set_result(True)
                return
            if self.status != 200:
                if not self.ready.done():
                    self.ready.set_result(False)
                return
            if self.ready_frames == 0 and not self.ready.done():
                self.ready.set_result(True)
        if self.mode != "sse":
            return
        self._dechunk()
        while True:
            end = self.payload.find(b"\n\n")
            if end < 0:
                break
            frame = bytes(self.payload[:end])
            del self.payload[: end + 2]
            self.frames += 1
            if self.frames <= self.ready_frames:
                if self.frames == self.ready_frames and not self.ready.done():
                    self.ready.set_result(True)
            elif self.stamps:
                self._stamp(frame, now)
            elif frame.startswith(b"data:") or b"\ndata:" in frame:
                self.times.append(now)
                if self.keep_frames:
                    self.kept.append((now, frame))

    @property
    def received(self) -> int:
        return len(self.ids) if self.stamps else len(self.times)

    def _stamp(self, frame: bytes, now: float) -> None:
        event, data = b"message", None
        for line in frame.split(b"\n"):
            if line.startswith(b"data:"):
                data = line[5:].lstrip()
            elif line.startswith(b"event:"):
                event = line[6:].strip()
        if data is None:
            return
        if event in (b"output", b"message"):
            try:
                stamp = _stamp_decoder.decode(data)
            except msgspec.DecodeError:
                pass
            else:
                self.ids.append(stamp.i)
                self.stamped.append(stamp.t)
                self.arrived.append(now)
                return
        self.events.append(event.decode(errors="replace"))

    def _dechunk(self) -> None:
        if not self.chunked:
            self.payload += self.buffer
            self.buffer.clear()
            return
        while self.buffer:
            if self.chunk_left == -1:
                end = self.buffer.find(b"\r\n")
                if end < 0:
                    return
                size = int(bytes(self.buffer[:end]).split(b";")[0] or b"0", 16)
                del self.buffer[: end + 2]
                self.chunk_left = size if size else -3
                if size == 0:
                    self.finished = True
                    return
            elif self.chunk_left == -2:
                if len(self.buffer) < 2:
                    return
                del self.buffer[:2]
                self.chunk_left = -1
            elif self.chunk_left == -3:
                self.buffer.clear()
                return
            else:
                take = min(self.chunk_left, len(self.buffer))
                self.payload += self.buffer[:take]
                del self.buffer[:take]
                self.chunk_left -= take
                if self.chunk_left == 0:
                    self.chunk_left = -2

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


async def _open_all(spec: dict[str, Any]) -> list[Subscriber]:
    loop = asyncio.get_running_loop()
    gate = asyncio.Semaphore(CONNECT_CONCURRENCY)
    subs: list[Subscriber] = []

    async def one() -> None:
        async with gate:
            try:
                _transport, sub = await loop.create_connection(
                    lambda: Subscriber(spec["request"], spec["mode"], spec["ready_frames"], spec["keep_frames"],
                                   spec["stamps"]),
                    "127.0.0.1", spec["port"])
            except OSError:
                return
            subs.append(sub)
            if spec["mode"] == "sse":
                try:
                    await asyncio.wait_for(asyncio.shield(sub.ready), timeout=spec["timeout_s"])
                except TimeoutError:
                    pass

    await asyncio.gather(*(one() for _ in range(spec["n"])))
    return subs


def _child(pipe: multiprocessing.connection.Connection, spec: dict[str, Any]) -> None:
    import threading

    import uvloop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        subs: list[Subscriber] = []
        done = asyncio.Event()

        async def handle(command: tuple[Any, ...]) -> Any:
            nonlocal subs
            name = command[0]
            if name == "open":
                subs = await _open_all(spec)
                ready = sum(1 for s in subs if s.ready.done() and s.ready.result())
                return {"ready": ready, "opened": len(subs)}
            if name == "count":
                k = command[1]
                if spec["mode"] == "sse":
                    return sum(1 for s in subs if s.received >= k)
                return sum(1 for s in subs if s.answered_at is not None)
            if name == "settled":  # has k data frames (or, with ``ended``, its body ended), or was closed
                k, ended = command[1], command[2]
                return sum(1 for s in subs if s.closed or s.finished or (not ended and s.received >= k))
            usage = resource.getrusage(resource.RUSAGE_SELF)
            if name == "cpu":
                return usage.ru_utime + usage.ru_stime
            if name == "collect":
                return {
                    "times": [list(s.times) for s in subs],
                    "frames": [list(s.kept) for s in subs],
                    "stamps": [(s.ids.tobytes(), s.stamped.tobytes(), s.arrived.tobytes(), s.events) for s in subs]
                    if spec["stamps"] else [],
                    "answered": [s.answered_at for s in subs],
                    "statuses": [s.status for s in subs],
                    "open": sum(1 for s in subs if not s.closed),
                    "cpu_s": usage.ru_utime + usage.ru_stime,
                }
            for s in subs:  # close
                s.close()
            await asyncio.sleep(0.05)
            done.set()
            return "closed"

        def control() -> None:
            # A thread of its own: the pipe stays blocking (uvloop's add_reader would make
            # it non-blocking, and a large answer would then fail half-written).
            while True:
                try:
                    command = pipe.recv()
                except EOFError:
                    command = ("close",)
                answer = asyncio.run_coroutine_threadsafe(handle(command), loop).result()
                pipe.send(answer)
                if command[0] == "close":
                    return

        threading.Thread(target=control, daemon=True).start()
        pipe.send("started")
        await done.wait()

    uvloop.run(main())


@dataclass
class Stamps:
    """What one connection read with ``stamps``: per stamped frame its number, stamp and arrival."""

    ids: array.array[int]
    stamped: array.array[float]
    arrived: array.array[float]
    events: list[str]  # the event types of the other data frames, in order

    @classmethod
    def of(cls, raw: tuple[bytes, bytes, bytes, list[str]]) -> Stamps:
        ids, stamped, arrived = array.array("q"), array.array("d"), array.array("d")
        ids.frombytes(raw[0])
        stamped.frombytes(raw[1])
        arrived.frombytes(raw[2])
        return cls(ids, stamped, arrived, raw[3])


@dataclass
class Result:
    times: list[list[float]]  # per connection: arrival of each data frame after ready
    frames: list[list[tuple[float, bytes]]]  # per connection, with keep_frames: (arrival, frame)
    stamps: list[Stamps]  # per connection, with stamps
    answered: list[float | None]  # long polls: when the answer began
    statuses: list[int | None]
    cpu_s: float
    still_open: int


class Subscribers:
    """``n`` connections sending ``request`` to 127.0.0.1:``port``, over ``processes`` processes."""

    def __init__(self, port: int, request: bytes, n: int, *, mode: str = "sse", ready_frames: int = 0,
                 processes: int | None = None, timeout_s: float = 60.0, keep_frames: bool = False,
                 stamps: bool = False) -> None:
        self.n = n
        self.mode = mode
        if processes is None:
            processes = 1 if n <= 200 else 2 if n <= 2000 else 4
        processes = max(1, min(processes, n))
        self.pipes: list[multiprocessing.connection.Connection] = []
        self.procs: list[Any] = []
        for index in range(processes):
            share = n // processes + (1 if index < n % processes else 0)
            spec = {"port": port, "request": request, "n": share, "mode": mode, "ready_frames": ready_frames,
                    "timeout_s": timeout_s, "keep_frames": keep_frames, "stamps": stamps}
            parent, child = _CTX.Pipe()
            proc = _CTX.Process(target=_child, args=(child, spec), daemon=True)
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)
        for pipe in self.pipes:
            assert pipe.recv() == "started"
        self.opened_at = time.time()

    def __enter__(self) -> Subscribers:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _ask(self, *command: Any) -> list[Any]:
        for pipe in self.pipes:
            pipe.send(command)
        return [pipe.recv() for pipe in self.pipes]

    def open(self) -> int:
        """Open every connection; returns how many are ready (SSE) or sent (long polls)."""
        answers = self._ask("open")
        return sum(a["ready"] if self.mode == "sse" else a["opened"] for a in answers)

    def count(self, k: int = 1) -> int:
        return sum(self._ask("count", k))

    def settled(self, k: int, ended: bool = False) -> int:
        """How many connections are done: closed, their response ended, or (unless ``ended``)
        with at least ``k`` data frames."""
        return sum(self._ask("settled", k, ended))

    def wait_count(self, k: int, target: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        seen = self.count(k)
        while seen < target and time.monotonic() < deadline:
            time.sleep(0.02)
            seen = self.count(k)
        return seen

    def cpu_seconds(self) -> float:
        return sum(self._ask("cpu"))

    def collect(self) -> Result:
        answers = self._ask("collect")
        return Result(
            times=[t for a in answers for t in a["times"]],
            frames=[f for a in answers for f in a["frames"]],
            stamps=[Stamps.of(raw) for a in answers for raw in a["stamps"]],
            answered=[t for a in answers for t in a["answered"]],
            statuses=[s for a in answers for s in a["statuses"]],
            cpu_s=sum(a["cpu_s"] for a in answers),
            still_open=sum(a["open"] for a in answers),
        )

    def close(self) -> None:
        if not self.pipes:
            return
        try:
            self._ask("close")
        except (OSError, EOFError):
            pass
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
        self.pipes, self.procs = [], []
