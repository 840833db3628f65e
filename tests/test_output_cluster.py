"""Streamed output on a 3-node NATS cluster (SPEC §8, §11): kill -9 the node leading the
output stream while a job emits, and not one acknowledged chunk is lost or repeated."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from herald.constants import OUTPUT_STREAM
from tests.harness import Deployment, NatsCluster, client, wait_for_state, wait_until

PAGES = 80


@pytest.fixture()
def clustered(tmp_path: Path) -> Iterator[tuple[Deployment, NatsCluster]]:
    cluster = NatsCluster(tmp_path / "cluster", max_file_store="8GB")  # Herald reserves 2 GiB for events
    cluster.start()
    deployment = Deployment(tmp_path, env_overrides={
        "HERALD_NATS_URL": cluster.urls,
        "HERALD_NATS_REPLICAS": "3",
        "HERALD_REPORT_PAGE_MS": "50",
    })  # its own single NatsServer is never started: HERALD_NATS_URL names the cluster
    try:
        yield deployment, cluster
    finally:
        deployment.stop()
        cluster.stop()


def chunks(http: object, job_id: str) -> list[dict[str, object]]:
    answer = http.get(f"/jobs/{job_id}/output")  # type: ignore[attr-defined]
    assert answer.status_code == 200, answer.text
    return [json.loads(line) for line in answer.text.splitlines() if line]


def test_output_survives_kill_9_of_the_output_stream_leader(clustered: tuple[Deployment, NatsCluster]) -> None:
    deployment, cluster = clustered
    base = deployment.start_gateway()
    deployment.start_worker()
    with client(base) as http:
        job = http.post("/reports", json={"title": "through an election", "pages": PAGES}).json()
        wait_until(lambda: len(chunks(http, job["id"])) >= 10, timeout=60, interval=0.05, what="the first chunks")
        leader = cluster.stream_leader(OUTPUT_STREAM)
        cluster.kill(leader, signal.SIGKILL)

        done = wait_for_state(http, job["id"], {"succeeded", "failed"}, timeout=120)
        assert done["state"] == "succeeded", done
        kept = chunks(http, job["id"])
    assert [c["n"] for c in kept] == list(range(1, PAGES + 1)), "every chunk once, in order"
    assert [c["data"] for c in kept] == [{"page": n, "pages": PAGES} for n in range(1, PAGES + 1)]
