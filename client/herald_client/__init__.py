"""Herald client library: start jobs, wait for them, stream their events, download
results, cancel; manage webhook endpoints and their deliveries (resend, recover, test
events, portal links), and verify webhook deliveries. ``HeraldAdmin`` (and
``AsyncHeraldAdmin``) is the operator's: tenants, their keys and the audit log.

    from herald_client import HeraldClient

    with HeraldClient("http://127.0.0.1:8000", "dev-key") as herald:
        job = herald.submit("report", {"title": "Q3", "pages": 5})
        done = herald.wait(job, timeout=60)
        herald.download(done, "q3.pdf")

``AsyncHeraldClient`` offers the same methods as coroutines (``stream`` as an async
iterator). Both drive one implementation of the retry, polling and resume logic.
"""

from herald_client._async import AsyncHeraldAdmin, AsyncHeraldClient
from herald_client._endpoints import KEEP
from herald_client._shared import AUTO
from herald_client._sync import HeraldAdmin, HeraldClient
from herald_client.errors import (
    Conflict,
    Forbidden,
    Gone,
    HeraldConnectionError,
    HeraldError,
    IdempotencyKeyMismatch,
    InvalidRequest,
    JobNotSucceeded,
    NotFound,
    ProblemError,
    ProtocolError,
    RateLimited,
    ServerError,
    Unauthorized,
    WaitTimeout,
    WebhookVerificationError,
)
from herald_client.models import (
    TERMINAL_STATES,
    ApiKey,
    Attempt,
    AuditEntry,
    CreatedEndpoint,
    CreatedKey,
    Delivery,
    DeliveryList,
    Download,
    Endpoint,
    EndpointHealth,
    EndpointList,
    FieldError,
    JobEvent,
    OutputChunk,
    JobLinks,
    JobList,
    JobState,
    JobStatus,
    LastDelivery,
    PortalLink,
    Problem,
    Result,
    SigningSecret,
    Tenant,
    TenantLimits,
    WebhookEvent,
    WebhookTestData,
)
from herald_client.policy import Backoff, Policy
from herald_client.webhooks import verify_webhook

__version__ = "0.1.0"

__all__ = [
    "AUTO",
    "ApiKey",
    "AsyncHeraldAdmin",
    "AsyncHeraldClient",
    "Attempt",
    "AuditEntry",
    "Backoff",
    "Conflict",
    "CreatedEndpoint",
    "CreatedKey",
    "Delivery",
    "DeliveryList",
    "Download",
    "Endpoint",
    "EndpointHealth",
    "EndpointList",
    "FieldError",
    "Forbidden",
    "Gone",
    "HeraldAdmin",
    "HeraldClient",
    "HeraldConnectionError",
    "HeraldError",
    "IdempotencyKeyMismatch",
    "InvalidRequest",
    "JobEvent",
    "OutputChunk",
    "JobLinks",
    "JobList",
    "JobNotSucceeded",
    "JobState",
    "JobStatus",
    "KEEP",
    "LastDelivery",
    "NotFound",
    "Policy",
    "PortalLink",
    "Problem",
    "ProblemError",
    "ProtocolError",
    "RateLimited",
    "Result",
    "ServerError",
    "SigningSecret",
    "TERMINAL_STATES",
    "Tenant",
    "TenantLimits",
    "Unauthorized",
    "WaitTimeout",
    "WebhookEvent",
    "WebhookTestData",
    "WebhookVerificationError",
    "verify_webhook",
]
