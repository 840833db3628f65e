"""The notifier receives only the events some webhook target wants (``herald.constants.event_subject``).

Each event's subject ends in its audience, judged as it commits: ``notify`` when a matching
enabled endpoint or the job's callback URL wants it, else ``quiet``. The notifier's durable
consumer filters on it, so the events nobody subscribed to (an outcome-only endpoint's
queued, running and progress) are never sent to, parsed by or acked by a notifier.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import nats

from herald import jetstream
from herald.constants import EVENTS_STREAM, NOTIFIER_CONSUMER, NOTIFIER_EVENT_SUBJECTS
from herald.settings import Settings
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


def test_an_outcome_only_endpoint_costs_the_notifier_one_event_per_job(fresh: Deployment) -> None:
    receiver = Receiver().start()
    try:
        base = fresh.start_gateway()
        fresh.start_worker()
        fresh.start_notifier()
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

        messages, sent_to_notifier = _notifier_consumer_state(fresh.nats.url)
        # queued, running (progress), succeeded: three and more events per job in the stream,
        # of which the notifier got the one its endpoint wants.
        assert messages >= 3 * len(jobs)
        assert sent_to_notifier == len(jobs)
        assert not receiver.problems, receiver.problems
    finally:
        receiver.stop()


async def test_the_notifier_consumer_of_an_older_herald_is_narrowed_and_still_takes_older_events(tmp_path: Path) -> None:
    """Upgrading: the notifier's consumer on ``events.>`` is narrowed by ``ensure_topology``;
    an event an older Herald published (``events.<tenant>.<job>``, no audience) still
    reaches the notifier, which judges its targets on receipt."""
    server = NatsServer(tmp_path / "nats")
    server.start()
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        settings = Settings(data_dir=tmp_path, nats_url=server.url)
        for config in jetstream.stream_configs(settings):
            await js.add_stream(config)
        older = dataclasses.replace(jetstream.notifier_consumer(settings), filter_subject="events.>", filter_subjects=None)
        await js.add_consumer(EVENTS_STREAM, older)
        await jetstream.ensure_topology(js, settings)
        info = await js.consumer_info(EVENTS_STREAM, NOTIFIER_CONSUMER)
        assert sorted(info.config.filter_subjects or []) == sorted(NOTIFIER_EVENT_SUBJECTS)

        for subject in ("events.acme.j1", "events.acme.j2.quiet", "events.acme.j3.notify", "events.globex.j4.quiet"):
            await js.publish(subject, subject.encode())
        subscription = await js.pull_subscribe_bind(NOTIFIER_CONSUMER, EVENTS_STREAM)
        taken = [m.subject for m in await subscription.fetch(10, timeout=2)]
        assert taken == ["events.acme.j1", "events.acme.j3.notify"]
        await nc.close()
    finally:
        server.stop()
