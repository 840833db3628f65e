"""What the request handlers need, opened by the app's lifespan and reached through ``app.state``."""

from __future__ import annotations

from dataclasses import dataclass, field

from litestar import Request
from nats.aio.client import Client as NATS

from gateway.answers import WokenAnswers
from gateway.deliverywatch import DeliveryWatch
from gateway.hub import Hub
from gateway.queueing import QueueReasons
from gateway.ratelimit import BacklogGuard, TenantLimits
from herald.directory import Directory
from herald.metrics import Metrics
from herald.resolver import Resolver
from herald.settings import Settings
from herald.signing import UrlSigner
from herald.storage.ports import JobStore, ResultStore, Storage
from herald.tenants import LimitsSource


@dataclass(slots=True)
class Services:
    settings: Settings
    storage: Storage
    store: JobStore  # storage.jobs, the one most handlers need
    results: ResultStore
    signer: UrlSigner
    metrics: Metrics
    limiter: TenantLimits
    limits: LimitsSource  # each tenant's limits (SPEC §13): the tenant directory, or the defaults
    backlog: BacklogGuard
    hub: Hub
    directory: Directory  # tenants, keys and limits, cached (herald.directory)
    queue_reasons: QueueReasons  # why a queued job waits (SPEC §13)
    resolver: Resolver  # the SSRF guard's lookups of webhook and callback hosts (herald.resolver)
    nats: NATS | None = field(default=None)
    watch: DeliveryWatch = field(default_factory=DeliveryWatch)  # the portal's delivery notices
    answers: WokenAnswers = field(default_factory=WokenAnswers)  # shared by the long polls one change wakes


def services(request: Request) -> Services:
    return request.app.state.services  # type: ignore[no-any-return]
