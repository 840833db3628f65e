"""Pacing a target that does not answer: a circuit breaker per origin (SPEC §13).

A target is scheme, host and port (an endpoint and a ``callback_url`` at the same origin
are one target). After ``FAILURES_TO_OPEN`` attempts in a row that got no answer at all
(a timeout, a refused or failed connection), the target is *paced*: nothing is sent to it
for a pause (``Settings.webhook_pause_s``, doubling after each failed probe, at most
``MAX_PAUSE_S``), then one delivery goes as the probe, and nothing else until the probe
ends. Any HTTP answer (a 500 too: the target answers) closes the breaker.

A delivery the breaker holds back is rescheduled, not attempted: it is handed back to the
store with a later ``next_attempt_at`` and no attempt is counted against its retry
schedule. That is what keeps a tenant whose receivers hang from holding the notifier's
slots for 15 s each, again and again.

The breaker is per notifier process (its own view); the store shares its effect: when a
target becomes paced, the notifier reschedules every due delivery of it that it knows of,
so other notifiers do not claim them either until the pause ends.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

FAILURES_TO_OPEN = 3
MAX_PAUSE_S = 300.0
MAX_TRACKED = 10_000
DEFAULT_PORTS = {"http": 80, "https": 443}


@functools.lru_cache(maxsize=4096)
def origin_of(url: str) -> str:
    """``scheme://host:port`` of a URL, the default port written out; the URL itself if unparsable."""
    try:
        parts = urlsplit(url)
        port = parts.port or DEFAULT_PORTS.get(parts.scheme.lower(), 0)
        host = (parts.hostname or "").lower()
    except ValueError:
        return url
    if not host:
        return url
    return f"{parts.scheme.lower()}://{host}:{port}"


@dataclass(slots=True)
class _State:
    failures: int = 0  # attempts in a row without an answer
    pause_s: float = 0.0  # the current pause; 0 while closed
    open_until: float = 0.0  # monotonic time the pause ends
    probing: bool = False  # the one probe is in flight


@dataclass(frozen=True, slots=True)
class Admission:
    """What to do with a claimed delivery: send it (``probe``: as the paced target's one probe),
    or hand it back for ``defer_s`` seconds."""

    send: bool
    probe: bool = False
    defer_s: float = 0.0


SEND = Admission(send=True)
PROBE = Admission(send=True, probe=True)


class Breaker:
    def __init__(self, first_pause_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.first_pause_s = first_pause_s
        self._now = clock
        self._states: dict[str, _State] = {}

    def paced(self, origin: str) -> bool:
        state = self._states.get(origin)
        return state is not None and state.pause_s > 0

    def holding(self, origin: str) -> bool:
        """Nothing of this target may be sent now (pausing, or its probe is in flight)."""
        state = self._states.get(origin)
        return state is not None and state.pause_s > 0 and (state.probing or self._now() < state.open_until)

    def admit(self, origin: str) -> Admission:
        state = self._states.get(origin)
        if state is None or state.pause_s <= 0:
            return SEND
        now = self._now()
        if state.probing or now < state.open_until:
            # Until the probe can have ended, or the pause ends; never a busy loop of hand-backs.
            return Admission(send=False, defer_s=max(state.open_until - now, min(self.first_pause_s, 5.0), 1.0))
        state.probing = True
        return PROBE

    def record(self, origin: str, *, answered: bool, unreachable: bool, probe: bool) -> float | None:
        """The outcome of one attempt. Returns the pause if this attempt paced the target
        (it just opened, or its probe failed), else None."""
        state = self._states.get(origin)
        if answered:
            self._states.pop(origin, None)  # it answers: closed, whatever it answered
            return None
        if state is None:
            if not unreachable:
                return None
            if len(self._states) >= MAX_TRACKED:  # bounded memory: forget targets that merely failed once or twice
                self._states = {o: s for o, s in self._states.items() if s.pause_s > 0 or s.probing}
            state = self._states[origin] = _State()
        if probe:
            state.probing = False
        if not unreachable:
            return None  # refused by our own guard, say: says nothing about the target
        state.failures += 1
        if state.pause_s <= 0:
            if state.failures < FAILURES_TO_OPEN:
                return None
            state.pause_s = self.first_pause_s
        elif probe:
            state.pause_s = min(state.pause_s * 2, MAX_PAUSE_S)
        else:
            return None  # an attempt sent before the target was paced: the pause already runs
        state.open_until = self._now() + state.pause_s
        return state.pause_s

