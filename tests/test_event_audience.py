"""Only the events some webhook target wants are kept in JetStream (``herald.constants.event_subject``).

Each event's subject ends in its audience, judged as it commits: ``notify`` when a matching
enabled endpoint or the job's callback URL wants it, else ``quiet``. The events stream keeps
only ``notify`` events, which the notifier's durable consumer takes, so the events nobody
subscribed to (an outcome-only endpoint's queued, running and progress) are never stored,
replicated, sent to, parsed by or acked by a notifier. The relay publishes those on core NATS,
where the gateways' hubs take them live.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

import nats
import pytest

from herald import jetstream
from herald.constants import EVENTS_STREAM, JOBS_STREAM, KEPT_EVENT_SUBJECTS, NOTIFIER_CONSUMER
from herald.jobs import NewJob
from herald.relay import Relay
from herald.settings import Settings
from herald.storage import build_storage
from tests.harness import Deployment, NatsServer, client, wait_for_state, wait_until
from tests.test_webhooks import TERMINAL, Receiver


def _notifier_consumer_state(nats_url: str) -> tuple[int, int]:
    """(events in the stream, events the notifier's consumer has sent) as JetStream counts them."""

    async def read() -> tuple[int, int]:
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            stream = await js.stream_info(EVENTS_STREAM)
            consumer = await js.consumer_info(EVENTS_STREAM, NOTIFIER_CONSUMER)
            return stream.state.messages, consumer.delivered.consumer_seq
        finally:
            await nc.close()

    return asyncio.run(read())


def test_an_outcome_only_endpoint_costs_jetstream_and_the_notifier_one_event_per_job(fresh: Deployment) -> None:
    receiver = Receiver().start()
    try:
        base = fresh.start_gateway()
        fresh.start_worker()
        fresh.start_notifier()
        live = _LiveEvents(fresh.nats.url).start()
        with client(base) as http:
            url = receiver.route("/outcomes")
            endpoint = http.post("/webhooks", json={"url": url, "event_types": ["job.succeeded"]})
            assert endpoint.status_code == 201, endpoint.text
            receiver.routes["/outcomes"].hmac.append(endpoint.json()["secret"])
            jobs = [http.post("/exports", json={"format": "csv", "rows": 10}).json()["id"] for _ in range(3)]
            for job_id in jobs:
                wait_for_state(http, job_id, {"succeeded"})
            wait_until(lambda: {h.job_id for h in receiver.hits_for("/outcomes", set(jobs)) if h.type in TERMINAL}
                       == set(jobs), what="the three outcomes delivered")

            # Every event of every job went out live, the quiet ones on core NATS: queued,
            # running and progress before the outcome, in version order.
            wait_until(lambda: {job_id for job_id, _, kind in live.seen() if kind == "notify"} == set(jobs),
                       what="each job's outcome seen live")
        seen = live.stop()
        for job_id in jobs:
            audiences = [audience for seen_id, _, audience in seen if seen_id == job_id]
            versions = [version for seen_id, version, _ in seen if seen_id == job_id]
            assert audiences[-1] == "notify" and set(audiences[:-1]) == {"quiet"} and len(audiences) >= 3, audiences
            assert versions == sorted(versions), versions

        messages, sent_to_notifier = _notifier_consumer_state(fresh.nats.url)
        # The stream keeps the one event per job its endpoint wants, and the notifier got it.
        assert messages == len(jobs)
        assert sent_to_notifier == len(jobs)
        assert not receiver.problems, receiver.problems
    finally:
        receiver.stop()


class _LiveEvents:
    """A gateway hub's view of the events: a core NATS subscription to ``events.>`` in a
    thread of its own; (job id, version, audience) per message, in arrival order."""

    def __init__(self, nats_url: str) -> None:
        self._url = nats_url
        self._seen: list[tuple[str, int, str]] = []
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> _LiveEvents:
        self._thread.start()
        assert self._ready.wait(10), "the live subscription did not start"
        return self

    def seen(self) -> list[tuple[str, int, str]]:
        return list(self._seen)

    def stop(self) -> list[tuple[str, int, str]]:
        assert self._loop is not None and self._done is not None
        self._loop.call_soon_threadsafe(self._done.set)
        self._thread.join(10)
        return self.seen()

    async def _run(self) -> None:
        self._loop, self._done = asyncio.get_running_loop(), asyncio.Event()
        nc = await nats.connect(self._url)

        async def on_message(message: Any) -> None:
            _, _, job_id, audience = message.subject.split(".")
            self._seen.append((job_id, json.loads(message.data)["version"], audience))

        await nc.subscribe("events.>", cb=on_message)
        await nc.flush()
        self._ready.set()
        await self._done.wait()
        await nc.close()


async def test_a_quiet_event_leaves_the_outbox_only_once_the_server_has_it(tmp_path: Path) -> None:
    """A quiet event goes out on core NATS, not into the stream, and like a kept one its
    outbox row stays until NATS has it: while NATS is down the relay keeps it, and after
    NATS is back a hub's subscription gets it."""
    server = NatsServer(tmp_path / "nats")
    server.start()
    settings = Settings(data_dir=tmp_path, nats_url=server.url)
    store = build_storage(settings).jobs
    await store.open()
    nc = await jetstream.connect(settings, name="relay-test")
    hub = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    try:
        await jetstream.ensure_topology(nc.jetstream(), settings)
        heard: asyncio.Queue[str] = asyncio.Queue()

        async def on_event(message: Any) -> None:
            await heard.put(message.subject)

        await hub.subscribe("events.>", cb=on_event)
        await hub.flush()
        relay = Relay(store, nc, sweep_interval_s=60.0, publish_timeout_s=0.5)
        job = NewJob(id="j" + "0" * 31, tenant="t1", kind="echo", collection="/echo", params=b"{}", deadline_s=60.0)

        server.stop()
        await store.accept(job)  # no endpoint, no callback URL: its queued event is quiet
        with pytest.raises(Exception):
            await relay.publish_pending()
        assert sorted(row.subject for row in await store.outbox_batch(10)) == [
            f"events.t1.{job.id}.quiet", "jobs.echo.t1"]

        server.start()
        for _ in range(200):  # both connections back
            if nc.is_connected and hub.is_connected:
                break
            await asyncio.sleep(0.05)
        assert await relay.publish_pending() == 2
        assert await asyncio.wait_for(heard.get(), timeout=5) == f"events.t1.{job.id}.quiet"
        assert await store.outbox_batch(10) == []
        js = nc.jetstream()
        assert (await js.stream_info(EVENTS_STREAM)).state.messages == 0  # nothing kept: live only
        assert (await js.stream_info(JOBS_STREAM)).state.messages == 1
    finally:
        await hub.close()
        await nc.close()
        await store.close()
        server.stop()


async def test_an_older_heralds_events_stream_and_notifier_consumer_are_narrowed(tmp_path: Path) -> None:
    """Upgrading: the events stream and the notifier's consumer on ``events.>`` are narrowed
    by ``ensure_topology`` to the kept events; an event an older Herald published
    (``events.<tenant>.<job>``, no audience) is still kept and reaches the notifier, which
    judges its targets on receipt, and a quiet one is no longer kept."""
    server = NatsServer(tmp_path / "nats")
    server.start()
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        settings = Settings(data_dir=tmp_path, nats_url=server.url)
        for config in jetstream.stream_configs(settings):
            older_stream = dataclasses.replace(config, subjects=["events.>"]) if config.name == EVENTS_STREAM else config
            await js.add_stream(older_stream)
        older = dataclasses.replace(jetstream.notifier_consumer(settings), filter_subject="events.>", filter_subjects=None)
        await js.add_consumer(EVENTS_STREAM, older)
        await jetstream.ensure_topology(js, settings)
        assert sorted((await js.stream_info(EVENTS_STREAM)).config.subjects or []) == sorted(KEPT_EVENT_SUBJECTS)
        info = await js.consumer_info(EVENTS_STREAM, NOTIFIER_CONSUMER)
        assert sorted(info.config.filter_subjects or []) == sorted(KEPT_EVENT_SUBJECTS)

        for subject in ("events.acme.j1", "events.acme.j2.quiet", "events.acme.j3.notify", "events.globex.j4.quiet"):
            await nc.publish(subject, subject.encode())
        await nc.flush()
        subscription = await js.pull_subscribe_bind(NOTIFIER_CONSUMER, EVENTS_STREAM)
        taken = [m.subject for m in await subscription.fetch(10, timeout=2)]
        assert taken == ["events.acme.j1", "events.acme.j3.notify"]
        assert (await js.stream_info(EVENTS_STREAM)).state.messages == 2
        await nc.close()
    finally:
        server.stop()
