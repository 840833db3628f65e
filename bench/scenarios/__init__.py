"""The scenarios, in the order the issue lists them. Each is ``run(ctx) -> Outcome``."""

from __future__ import annotations

from collections.abc import Callable

from bench.scenario import Context, Outcome
from bench.scenarios import accept, e2e, longpoll, noisy, output, poll, sse, webhooks

SCENARIOS: dict[str, Callable[[Context], Outcome]] = {
    "accept": accept.run,
    "poll": poll.run,
    "sse": sse.run,
    "longpoll": longpoll.run,
    "webhooks": webhooks.run,
    "e2e": e2e.run,
    "noisy": noisy.run,
    "output": output.run,
}

# Scenarios that also run on `herald up --cluster` (``--shape cluster``).
CLUSTER_SHAPED = frozenset({"e2e"})
