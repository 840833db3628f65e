"""Receivers that hang: listening sockets on 127.0.0.1 that accept every connection, read
what is sent and never answer (issue 21's noisy tenant's receivers). One thread in the
bench process serves them all; ``requests`` counts the connections that sent a request.
"""

from __future__ import annotations

import selectors
import socket
import threading
from types import TracebackType


class HangingReceivers:
    def __init__(self, count: int) -> None:
        self._selector = selectors.DefaultSelector()
        self.listeners: list[socket.socket] = []
        self.held: list[socket.socket] = []
        self.requests = 0
        self._stop = threading.Event()
        for _ in range(count):
            listener = socket.socket()
            listener.bind(("127.0.0.1", 0))
            listener.listen(1024)
            listener.setblocking(False)
            self._selector.register(listener, selectors.EVENT_READ, "listener")
            self.listeners.append(listener)
        self._thread = threading.Thread(target=self._run, name="hanging-receivers", daemon=True)

    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{s.getsockname()[1]}/hook" for s in self.listeners]

    def __enter__(self) -> HangingReceivers:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in [*self.listeners, *self.held]:
            sock.close()
        self._selector.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _mask in self._selector.select(timeout=0.1):
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                if key.data == "listener":
                    try:
                        conn, _ = sock.accept()
                    except BlockingIOError:
                        continue
                    conn.setblocking(False)
                    self.held.append(conn)
                    self._selector.register(conn, selectors.EVENT_READ, "fresh")
                    continue
                try:
                    data = sock.recv(65536)
                except (BlockingIOError, ConnectionError):
                    data = b"?"
                if not data:  # the notifier gave up on it
                    self._selector.unregister(sock)
                    self.held.remove(sock)
                    sock.close()
                    continue
                if key.data == "fresh":
                    self.requests += 1
                    self._selector.modify(sock, selectors.EVENT_READ, "seen")
