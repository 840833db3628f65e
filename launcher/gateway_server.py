"""The gateway's HTTP server: uvicorn's, whose stop on SIGINT or SIGTERM is the end of the process.

uvicorn catches both signals, shuts down gracefully (stops accepting, closes streams after its
grace, runs the lifespan's shutdown) and then raises the signal again with the handler that was
there before it (``Server.capture_signals``), so that a program embedding it dies of the signal
as it would have without uvicorn. For ``herald gateway`` the server is the program, and what
the signal asked for is done by then: re-raised, SIGTERM's default action killed a gateway that
had stopped cleanly (exit -15, which a supervisor cannot tell from a gateway killed mid-request)
and SIGINT ended it in a ``KeyboardInterrupt``. Here the signals are caught as uvicorn catches
them and not raised again: a clean stop exits 0, as a worker's and a notifier's does.

``give_up`` stops it the same way from inside, with another exit status: the gateway found
it cannot serve at all (NATS without JetStream).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

import uvicorn

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GatewayServer(uvicorn.Server):
    exit_status = 0

    def give_up(self, status: int) -> None:
        """Stop as on SIGTERM, then exit with ``status``: the gateway found it cannot serve
        (NATS without JetStream), which no waiting mends."""
        self.exit_status = status
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, without raising the signals again once the server has stopped."""
        if threading.current_thread() is not threading.main_thread():  # only the main thread can
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
