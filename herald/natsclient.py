"""The NATS client of every Herald process: nats-py's, with a flusher that waits a few turns
of the event loop before it writes.

nats-py queues each command (a publish, an ack, a pull request) and wakes its flusher
task, which writes everything queued so far in one ``sendto`` on the next turn of the loop.
A worker's job makes its writes in a chain of turns, each a step after the other: the
success commits, the run's task acks its message, the relay's task wakes and publishes the
committed events, the freed slot wakes the dispatch loop, which sends the next pull
request. Written as they came, that was about five ``sendto`` per job, a third of a worker's
event-loop time (bench/RESULTS.md, issue 24). Here the flusher lets the loop run up to
``COALESCE_TURNS`` more turns while it has other callbacks due (CPython's loop keeps them in
its ``_ready`` queue), so such a chain leaves in one or two writes, and an idle loop is not
made to spin (a first version that always waited three turns cost asyncio's loop more in turns
than it saved in writes: bench/RESULTS.md, issue 24). uvloop, which workers and notifiers run
on as the gateway does, keeps that queue out of Python's reach: there the flusher always
waits the turns, which cost uvloop a few microseconds each.

Nothing is promised on a write: a message is acked after its job's state is committed and
an event is published from a committed outbox row, whenever the bytes leave. An idle process's
writes leave at once (on uvloop, three quick turns later); a busy one's wait only for work
that was already due to run.

It overrides nats-py's ``Client._flusher`` (a private method, the same body plus the wait):
with a nats-py that no longer has it, the override is simply never called and writes go out
as nats-py makes them.
"""

from __future__ import annotations

import asyncio

from nats.aio.client import DEFAULT_FLUSH_TIMEOUT
from nats.aio.client import Client as NATS
from nats.errors import ConnectionClosedError, ConnectionReconnectingError

COALESCE_TURNS = 3  # at most this many turns of the loop between the first queued command and the write
_UNKNOWN = (True,)  # a loop that does not show its queue of due callbacks (uvloop): taken as busy


class Client(NATS):
    async def flush(self, timeout: int = DEFAULT_FLUSH_TIMEOUT) -> None:
        """What is queued is written first, then the PING: nats-py writes the PING straight to
        the socket, ahead of the queue, which the flusher's wait would otherwise make longer;
        the PONG means the server has read everything published before.

        Disconnected, it raises: nats-py's own flush returns at once then (its read loop is
        gone, so it "flushes" into the reconnect buffer), which would tell the relay that the
        server has messages it may never get."""
        if not self.is_connected:
            raise ConnectionReconnectingError if self.is_reconnecting else ConnectionClosedError
        if self._pending_data_size > 0 and self._transport is not None:
            self._transport.writelines(self._pending[:])
            self._pending = []
            self._pending_data_size = 0
        await super().flush(timeout)

    async def _flusher(self) -> None:
        assert self._transport, "Client.connect must be called first"
        assert self._flush_queue, "Client.connect must be called first"
        while True:
            if not self.is_connected or self.is_connecting:
                break
            future: asyncio.Future[object] = await self._flush_queue.get()
            try:
                # The rest of the chain that queued this command, while it is still running:
                # on asyncio's loop only while it has other callbacks due (an idle loop would
                # only spin); uvloop does not say, and its turns cost little, so it always waits.
                ready = getattr(asyncio.get_running_loop(), "_ready", _UNKNOWN)
                for _ in range(COALESCE_TURNS):
                    if not ready:
                        break
                    await asyncio.sleep(0)
                if self._pending_data_size > 0 and self.is_connected:
                    self._transport.writelines(self._pending[:])
                    self._pending = []
                    self._pending_data_size = 0
                    await self._transport.drain()
            except OSError as e:
                await self._error_cb(e)  # type: ignore[misc]
                await self._process_op_err(e)
                break
            except (asyncio.CancelledError, RuntimeError, AttributeError):
                break  # closing (RuntimeError: the event loop is closed)
            finally:
                if not future.done():
                    future.set_result(None)
