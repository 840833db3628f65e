"""How big each scenario is: the full run (a few minutes on 2 cores) and the smoke run (seconds)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Sizes:
    rounds: int  # interleaved Herald/baseline rounds of the HTTP scenarios; the median is reported
    http_s: float  # one saturation or fixed-rate run
    connections: int  # saturation connections (wrk -c)
    fixed_connections: int
    poll_jobs: int
    sse_n: tuple[int, ...]
    sse_events: int  # committed transitions per fan-out case
    longpoll_n: int
    webhook_events: int
    webhook_endpoints: int
    webhook_concurrency: int  # the raw senders' concurrency: the notifier's in-flight bound (64)
    e2e_jobs: int
    e2e_rates: tuple[float, ...]  # fixed-load phases (jobs/s); one above 80 % of the saturated rate is skipped
    e2e_fixed_s: float
    e2e_tenants: int  # the second saturation burst spreads its starts over this many tenants
    nats_msgs: int
    noisy_backlog: int  # noisy neighbour: tenant A's queued jobs (each with a callback_url that hangs)
    noisy_hanging: int  # A's receivers that accept and never answer
    noisy_rate: float  # tenant B's starts/s, alone and while A floods
    noisy_s: float  # how long B starts jobs in each phase
    noisy_page_ms: int  # every job's run (1 page): A's and B's jobs are alike
    fair_jobs: int  # fair share's cost: this many trivial jobs from 1 tenant, then spread over fair_tenants
    fair_tenants: int
    fair_rounds: int  # 1 tenant, then spread, this many times (each pair's ratio; their median)
    output_readers: int  # SSE readers of one job's streamed output
    output_chunks: int  # chunks that job emits, at output_rate per second
    output_rate: float
    wait_s: float  # how long a scenario waits for deliveries before calling them lost


FULL = Sizes(
    rounds=2,
    http_s=4,
    connections=64,
    fixed_connections=64,
    poll_jobs=100_000,
    sse_n=(100, 1000, 5000),
    sse_events=3,
    longpoll_n=1000,
    webhook_events=400,
    webhook_endpoints=8,
    webhook_concurrency=64,
    e2e_jobs=1500,
    e2e_rates=(100, 500),
    e2e_fixed_s=5,
    e2e_tenants=10,
    nats_msgs=20_000,
    noisy_backlog=1200,
    noisy_hanging=40,
    noisy_rate=10,
    noisy_s=15,
    noisy_page_ms=200,
    fair_jobs=600,
    fair_tenants=10,
    fair_rounds=5,
    output_readers=100,
    output_chunks=10_000,
    output_rate=1000,
    wait_s=60,
)

SMOKE = Sizes(
    rounds=1,
    http_s=1,
    connections=8,
    fixed_connections=16,
    poll_jobs=500,
    sse_n=(20,),
    sse_events=1,
    longpoll_n=20,
    webhook_events=10,
    webhook_endpoints=2,
    webhook_concurrency=8,
    e2e_jobs=20,
    e2e_rates=(20,),
    e2e_fixed_s=1,
    e2e_tenants=3,
    nats_msgs=500,
    noisy_backlog=40,
    noisy_hanging=4,
    noisy_rate=5,
    noisy_s=1,
    noisy_page_ms=200,
    fair_jobs=20,
    fair_tenants=10,
    fair_rounds=1,
    output_readers=10,
    output_chunks=300,
    output_rate=1000,
    wait_s=30,
)
