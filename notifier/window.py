"""How many attempts one notifier sends one target (scheme, host, port) at once.

A fixed number traded one tenant's throughput to a busy receiver against the other tenants'
latency while some receiver hangs. A target's throughput is its slots per round trip: with
8, the webhooks of 500 jobs/s to one receiver queued for up to 1.4 s. With 32 for every
target, a tenant's hanging receivers held their slots in larger groups that timed out
together, and another tenant's webhooks waited 7-8 times as long (bench/RESULTS.md).

So each target has a window, grown and shrunk as TCP's congestion window is. It starts at
``FLOOR``, and a target that never answers keeps that (the breaker paces it besides). An
attempt that was answered with a 2xx, while the window was full, adds one, up to
``CEILING``. An attempt that got no answer, a 429 or a 5xx halves it, never below ``FLOOR``.
An attempt holds its slot until the target answers, not until the outcome is committed: the
window bounds what a receiver is asked at once, and a commit that held the slot a store write
longer queued the webhooks of 500 jobs/s behind the commits. A window is kept while its target
idles between claims (nothing in flight for a moment is the normal state under a steady load,
and starting from ``FLOOR`` each time the window hardly grew); a target idle since the
scheduler's prune before last is forgotten, window and all.
"""

from __future__ import annotations

from herald.deliveries import Outcome

FLOOR = 8
CEILING = 32


class Windows:
    """The window of every target this notifier has in flight."""

    def __init__(self) -> None:
        self._sizes: dict[str, int] = {}

    def size(self, origin: str) -> int:
        return self._sizes.get(origin, FLOOR)

    def ended(self, origin: str, outcome: Outcome, *, was_full: bool) -> None:
        """An attempt to ``origin`` ended; ``was_full``: the window was full as it ended."""
        size = self.size(origin)
        code = outcome.status_code
        if code is None or code == 429 or code >= 500:
            size = max(FLOOR, size // 2)
        elif outcome.ok and was_full:
            size = min(CEILING, size + 1)
        else:
            return
        if size == FLOOR:
            self._sizes.pop(origin, None)
        else:
            self._sizes[origin] = size

    def forget(self, origin: str) -> None:
        self._sizes.pop(origin, None)
