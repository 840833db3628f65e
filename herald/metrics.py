"""Prometheus metrics (SPEC §10), created once per process and passed down.

Under ``herald up`` every child writes to a shared multiprocess directory
(PROMETHEUS_MULTIPROC_DIR, set by the supervisor), so the gateway's ``/metrics`` covers
every component.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

if TYPE_CHECKING:
    from herald.jobs import JobRow
    from herald.storage.ports import StoreStats
    from schemas import JobEvent

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class Metrics:
    def __init__(self) -> None:
        self.jobs_accepted = Counter("herald_jobs_accepted_total", "Jobs accepted (202, not replays)", ["kind"])
        self.jobs_finished = Counter("herald_jobs_finished_total", "Jobs that reached a terminal state", ["kind", "state"])
        self.job_run_seconds = Histogram(
            "herald_job_run_seconds", "Time from acceptance to terminal state", ["kind"],
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900, 3600),
        )
        self.webhook_deliveries = Counter("herald_webhook_deliveries_total", "Webhook delivery attempts", ["outcome"])
        self.webhook_delivery_seconds = Histogram(
            "herald_webhook_delivery_seconds", "Latency of one webhook attempt",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 15),
        )
        self.sse_streams = Gauge("herald_sse_streams", "Open server-sent-event streams", multiprocess_mode="livesum")
        self.long_polls = Gauge("herald_long_polls", "Held long polls", multiprocess_mode="livesum")
        self.http_requests = Counter("herald_http_requests_total", "HTTP requests by route template, method and status",
                                     ["route", "method", "status"])
        self.http_request_seconds = Histogram(
            "herald_http_request_seconds", "Time to answer an HTTP request (streams: until they end)",
            ["route", "method"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.transitions_rejected = Counter("herald_transitions_rejected_total", "Stale or duplicate transitions refused")
        self.sse_dropped = Counter("herald_sse_dropped_total", "Streams dropped because the client stopped reading",
                                   ["reason"])
        self.sse_gap_reads = Counter("herald_sse_gap_reads_total",
                                     "Store reads by streams whose live events arrived with a gap", ["stream"])
        # SPEC §13. No tenant label by default: one series per tenant would grow without bound
        # (Prometheus keeps every series it has seen). HERALD_METRICS_TENANT_LABELS=1 adds the
        # per-tenant counter for deployments with few tenants.
        self.jobs_started = Counter("herald_jobs_started_total", "Runs claimed by a worker", ["kind"])
        self.job_queue_seconds = Histogram(
            "herald_job_queue_seconds", "Time from acceptance to a worker's claim (first attempts)", ["kind"],
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600),
        )
        self.tenant_jobs_started = Counter("herald_tenant_jobs_started_total",
                                           "Runs claimed, per tenant (only with HERALD_METRICS_TENANT_LABELS)",
                                           ["kind", "tenant"])
        self.claims_at_cap = Counter("herald_claims_at_cap_total",
                                     "Claims refused because the tenant ran its max_running already", ["kind"])
        self._zero_known_labels()

    def _zero_known_labels(self) -> None:
        """Every known label set exists at 0 from the start (Prometheus instrumentation
        guidelines), so dashboards and alerts see a series, not a gap, before the first event.
        In multiprocess mode creating the child writes its 0 to this process's file."""
        from herald.deliveries import DELIVERY_OUTCOMES
        from herald.kinds import declared_kinds
        from schemas import TERMINAL_STATES

        for kind in declared_kinds():
            self.jobs_started.labels(kind=kind)
            self.job_queue_seconds.labels(kind=kind)
            self.claims_at_cap.labels(kind=kind)
            self.jobs_accepted.labels(kind=kind)
            self.job_run_seconds.labels(kind=kind)
            for state in TERMINAL_STATES:
                self.jobs_finished.labels(kind=kind, state=state)
        for outcome in DELIVERY_OUTCOMES:
            self.webhook_deliveries.labels(outcome=outcome)


    def job_started(self, job: "JobRow", tenant_labels: bool = False) -> None:
        """A worker claimed ``job`` (the row as claimed)."""
        self.jobs_started.labels(kind=job.kind).inc()
        if job.attempt == 1:
            self.job_queue_seconds.labels(kind=job.kind).observe(max(0.0, job.updated_at - job.created_at))
        if tenant_labels:
            self.tenant_jobs_started.labels(kind=job.kind, tenant=job.tenant).inc()

    def observe(self, job: "JobRow", event: "JobEvent") -> None:
        """Store listener: count every committed terminal transition, whoever made it."""
        if job.terminal and job.finished_at is not None:
            self.jobs_finished.labels(kind=job.kind, state=job.state).inc()
            self.job_run_seconds.labels(kind=job.kind).observe(job.finished_at - job.created_at)


_metrics: Metrics | None = None


def metrics() -> Metrics:
    """The process's metrics (created on first use: prometheus names are process-global)."""
    global _metrics
    if _metrics is None:
        _metrics = Metrics()
    return _metrics


class _StoreGauges:
    """Gauges read from the store at scrape time, so they are right whoever changed it."""

    def __init__(self, stats: StoreStats, queued_ages: Mapping[str, float] | None = None) -> None:
        self._stats = stats
        self._queued_ages = queued_ages

    def collect(self):  # type: ignore[no-untyped-def]
        yield GaugeMetricFamily("herald_queue_oldest_age_seconds", "Age of the oldest queued job",
                                value=self._stats.oldest_queued_age_s)
        if self._queued_ages is not None:
            by_kind = GaugeMetricFamily(
                "herald_kind_queue_oldest_age_seconds",
                "Age of the oldest queued job of each kind (a kind no running worker serves keeps growing)",
                labels=["kind"],
            )
            for kind, age in sorted(self._queued_ages.items()):
                by_kind.add_metric([kind], age)
            yield by_kind
        yield GaugeMetricFamily("herald_outbox_pending", "Committed transitions not yet published",
                                value=self._stats.outbox_pending)
        yield GaugeMetricFamily("herald_outbox_lag_seconds", "Age of the oldest unpublished transition (outbox lag)",
                                value=self._stats.outbox_oldest_age_s)
        yield GaugeMetricFamily("herald_webhook_fan_out_waiting",
                                "Job events waiting for their tenant's share of the webhook fan-out",
                                value=self._stats.fan_out_waiting)
        yield GaugeMetricFamily("herald_webhook_fan_out_lag_seconds",
                                "How long the oldest job event waiting for its tenant's fan-out share has waited",
                                value=self._stats.fan_out_waiting_age_s)


def multiprocess_dir() -> str | None:
    """The shared directory of multiprocess mode, if this process runs in it.

    The prometheus client itself is configured by this variable (read when it is first
    imported), so it is read here rather than passed in through Settings.
    """
    return os.environ.get(MULTIPROC_ENV) or None  # noqa: see above


def process_registry() -> CollectorRegistry:
    """What this process should expose: every process's samples in multiprocess mode, else its own."""
    if multiprocess_dir() is not None:
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return registry
    from prometheus_client import REGISTRY

    return REGISTRY


def mark_process_dead(pid: int, directory: str) -> None:
    """Forget a dead process's live gauges (its counters and histograms keep counting)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, directory)


def exposition(stats: StoreStats | None = None, queued_ages: Mapping[str, float] | None = None) -> bytes:
    output = generate_latest(process_registry())
    if stats is not None:
        extra = CollectorRegistry()
        extra.register(_StoreGauges(stats, queued_ages))  # type: ignore[arg-type]
        output += generate_latest(extra)
    return output
