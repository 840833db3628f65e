"""Webhook endpoints, signing keys and the delivery queue in PostgreSQL.

The decisions are ``herald.delivery_rules``' (the rulebook both stores keep): the plpgsql
functions below make them next to the data, with the rulebook's numbers passed in as
arguments. What this module
adds is how it stays correct without SQLite's single writer, when several gateways and
notifiers on several machines use the same tables at once.

Clock. Every time is ``clock_timestamp()`` of the server, in Unix seconds, so leases
and retry times are judged by one clock. Inside SQL it is read once per statement into a
variable or an uncorrelated sub-select, so that it stays a constant the planner can use
against the indexes (a bare volatile call per row could not be).

Round trips. The hot paths are one statement each, one round trip: ``fan_out``, ``claim``
and ``finish`` call plpgsql functions created by the migration, so their several steps
run next to the data instead of a BEGIN, n statements and a COMMIT over the network.
A plpgsql function in READ COMMITTED also takes a fresh snapshot per statement, which
the claim below depends on. The API's rarer writes (update, delete, rotate) are short
explicit transactions.

Plans. plpgsql caches a generic plan per statement after a few calls, and one made while
the tables were nearly empty (a new deployment, before autovacuum's first ANALYZE) would
keep scanning them as they grow. Every statement of fan-out and finish is an index probe
by design, so those functions run with ``enable_seqscan = off``; the claim, once per batch
and shaped by how much is due, is planned afresh each call (``force_custom_plan``).

Concurrency, and why each lock is there:

* **Claims never overlap.** ``herald_webhook_claim`` picks candidates per target as the
  SQLite version does (per-target cap, oldest first, nothing whose older version of the
  same job is pending for the same target: a LATERAL scan of each target's pending index
  range), locks them in an outer step with ``FOR UPDATE SKIP LOCKED``, and writes the
  lease in a second statement. Rows another notifier holds are skipped, and a
  row it leased meanwhile is re-checked on its newest version and dropped.
* **Order per job and target survives concurrent fan-out.** Two notifiers can fan out v1
  and v2 of one job at the same moment, or v1 while another claims v2. So fan-out takes a
  transaction-scoped advisory lock per (target, job) -- all of them up front, sorted, so
  fan-outs cannot deadlock each other -- and then locks the newer rows of that job and
  target ``FOR UPDATE`` before deciding whether the older event is superseded. The claim
  re-checks the ordering rule after taking its row locks (second statement, newer
  snapshot), so an older delivery committed meanwhile holds the newer one back. ``finish``
  takes the same advisory lock, so its "a newer version exists: superseded" check sees a
  fan-out that ran meanwhile, and two finishes of one delivery number attempts in turn. ``finish_many`` (the
  attempts one notifier saw finish together, in one transaction) takes all its order
  locks first, sorted as fan-out's are.
* **Endpoints deleted or disabled meanwhile.** Fan-out holds the matching endpoints
  ``FOR KEY SHARE`` (which ordinary updates such as ``failing_since`` do not wait for);
  deleting or disabling an endpoint through the API first takes its row ``FOR UPDATE``,
  waiting for fan-outs in flight, then fails or deletes its deliveries in a later
  statement that sees theirs.
* **One current key per owner.** Rotation and create-on-first-use run under an advisory
  lock per key owner, and a partial unique index keeps at most one un-retired key.
* Rare lock cycles (an endpoint disabled by ``finish`` while fan-outs touch its
  deliveries) are resolved by PostgreSQL's deadlock detector; the transactions involved
  are idempotent and retried here.

Schema notes: ``event_types``/``kinds`` are ``TEXT[]``; message bodies are stored once per
event (``webhook_messages``); ``UNIQUE (event_id, target)`` is both the idempotency key of
fan-out and the index that pruning orphaned messages probes.

What callers can see differ from SQLite is stated in ``herald.storage.ports`` (a claim's
rows as leased, and fewer than ``limit`` while another notifier holds the rest).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

import asyncpg
import msgspec

from herald.deliveries import (
    CALLBACK_PREFIX,
    Attempted,
    TEST_EVENT_TYPE,
    TEST_EVENT_WINDOW_S,
    TEST_EVENTS_PER_WINDOW,
    TEST_JOB_END,
    TEST_JOB_PREFIX,
    AttemptRow,
    Claimed,
    DeliveryRow,
    EndpointLimitReached,
    EndpointRow,
    Finished,
    HealthRow,
    Outcome,
    Plan,
    TestEventsLimited,
    callback_owner,
    event_id,
)
from herald.delivery_rules import ENDPOINT_DISABLE_AFTER_S, PROGRESS_INTERVAL_S, RESPONSE_KEEP_BYTES, ROTATION_OVERLAP_S
from herald.sealing import Sealer, key_aad
from herald.storage.postgres.db import NOW_SQL, PgDatabase, unavailable_on_connection_errors
from herald.webhook_signing import HMAC, SigningKey, new_key
from schemas import JobEvent
from schemas.webhooks import WebhookPayload

T = TypeVar("T")

# Advisory lock classes (two-int form, a key space apart from the bigint locks of the
# migrations and the job store): "WHOR" orders deliveries per (target, job), "WHKY"
# serialises an owner's key changes.
ORDER_LOCK_CLASS = 0x57484F52
KEY_LOCK_CLASS = 0x57484B59
ENDPOINT_LOCK_CLASS = 0x57484550  # "WHEP": a tenant's endpoint count (max_endpoints)

# The server's clock once per statement: an InitPlan, a constant for index scans.
NOW = f"(SELECT {NOW_SQL})"

_SCHEMA = """
CREATE TABLE webhook_endpoints (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    url TEXT NOT NULL,
    event_types TEXT[] NOT NULL,
    kinds TEXT[],
    signature TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,
    failing_since DOUBLE PRECISION
);
CREATE INDEX webhook_endpoints_by_tenant ON webhook_endpoints (tenant, created_at DESC, id DESC);

CREATE TABLE webhook_keys (
    owner TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    algorithm TEXT NOT NULL,
    secret BYTEA NOT NULL,
    public_key BYTEA,
    retire_at DOUBLE PRECISION,
    PRIMARY KEY (owner, created_at)
);
-- At most one current key per owner, whatever races.
CREATE UNIQUE INDEX webhook_keys_current ON webhook_keys (owner) WHERE retire_at IS NULL;

CREATE TABLE webhook_messages (
    event_id TEXT PRIMARY KEY,
    body BYTEA NOT NULL,
    created_at DOUBLE PRECISION NOT NULL
);

CREATE TABLE webhook_deliveries (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    target TEXT NOT NULL,
    endpoint_id TEXT,
    url TEXT,
    event_id TEXT NOT NULL,
    job_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    type TEXT NOT NULL,
    status TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    scheduled_at DOUBLE PRECISION NOT NULL,
    next_attempt_at DOUBLE PRECISION,
    lease_owner TEXT,
    lease_until DOUBLE PRECISION,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,
    -- event_id first: the idempotency key of fan-out and the probe of message pruning
    UNIQUE (event_id, target)
);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE status = 'pending';
-- One job's deliveries to one target: superseding, progress throttling, finish.
CREATE INDEX webhook_deliveries_order ON webhook_deliveries (target, job_id, version);
-- The claim's ordering rule looks only at what is pending, per target and job.
CREATE INDEX webhook_deliveries_pending_order ON webhook_deliveries (target, job_id, version)
    WHERE status = 'pending';
CREATE INDEX webhook_deliveries_by_endpoint ON webhook_deliveries (endpoint_id, seq);
CREATE INDEX webhook_deliveries_finished ON webhook_deliveries (updated_at) WHERE status <> 'pending';

CREATE TABLE webhook_attempts (
    delivery_id TEXT NOT NULL,
    n INTEGER NOT NULL,
    at DOUBLE PRECISION NOT NULL,
    status_code INTEGER,
    latency_ms DOUBLE PRECISION,
    error TEXT,
    response BYTEA,
    PRIMARY KEY (delivery_id, n)
);
"""

_KEY_FUNCTIONS = """
-- A new current key; the previous current one signs for the overlap, then retires.
CREATE FUNCTION herald_webhook_add_key(
    p_owner TEXT, p_algorithm TEXT, p_secret BYTEA, p_public_key BYTEA, p_overlap DOUBLE PRECISION
) RETURNS VOID LANGUAGE plpgsql AS $$
DECLARE
    ts DOUBLE PRECISION;
    latest DOUBLE PRECISION;
BEGIN
    PERFORM pg_advisory_xact_lock({key_lock}, hashtext(p_owner));
    ts := {now};
    DELETE FROM webhook_keys k WHERE k.owner = p_owner AND k.retire_at IS NOT NULL AND k.retire_at <= ts;
    UPDATE webhook_keys k SET retire_at = ts + p_overlap WHERE k.owner = p_owner AND k.retire_at IS NULL;
    SELECT max(k.created_at) INTO latest FROM webhook_keys k WHERE k.owner = p_owner;
    INSERT INTO webhook_keys (owner, created_at, algorithm, secret, public_key)
    -- the key's primary key must move forward
    VALUES (p_owner, greatest(ts, coalesce(latest + 1e-6, ts)), p_algorithm, p_secret, p_public_key);
END $$;

-- The owner's current key; the given one becomes it if there is none (first use).
CREATE FUNCTION herald_webhook_ensure_key(
    p_owner TEXT, p_algorithm TEXT, p_secret BYTEA, p_public_key BYTEA
) RETURNS TABLE (algorithm TEXT, secret BYTEA, public_key BYTEA) LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock({key_lock}, hashtext(p_owner));
    RETURN QUERY SELECT k.algorithm, k.secret, k.public_key FROM webhook_keys k
        WHERE k.owner = p_owner AND k.retire_at IS NULL;
    IF FOUND THEN
        RETURN;
    END IF;
    INSERT INTO webhook_keys (owner, created_at, algorithm, secret, public_key)
    VALUES (p_owner, {now}, p_algorithm, p_secret, p_public_key);
    RETURN QUERY SELECT p_algorithm, p_secret, p_public_key;
END $$;
"""

# delivery_rules.place for each event and target, after the locks (the SQLite queue's
# fan_out and _add_delivery).
_FAN_OUT_FUNCTION = """
CREATE FUNCTION herald_webhook_fan_out(
    p_tenants TEXT[], p_job_ids TEXT[], p_versions INTEGER[], p_types TEXT[], p_kinds TEXT[],
    p_event_ids TEXT[], p_bodies BYTEA[], p_progress_interval DOUBLE PRECISION
) RETURNS INTEGER LANGUAGE plpgsql SET enable_seqscan = off AS $$
#variable_conflict use_column
DECLARE
    ts DOUBLE PRECISION;
    t_ords INTEGER[];
    t_targets TEXT[];
    t_endpoints TEXT[];
    t_urls TEXT[];
    done TEXT[];
    lock_key INTEGER;
    i INTEGER;
    o INTEGER;
    tgt TEXT;
    eid TEXT;
    job TEXT;
    ver INTEGER;
    typ TEXT;
    newer_sent BOOLEAN;
    last_progress DOUBLE PRECISION;
    new_status TEXT;
    due DOUBLE PRECISION;
    pending INTEGER := 0;
BEGIN
    -- Endpoints that take part are held against deletion and API disabling until commit
    -- (those take the row FOR UPDATE first); routine updates do not wait for this lock.
    PERFORM 1 FROM webhook_endpoints e
        WHERE e.tenant = ANY(p_tenants) AND e.status = 'enabled' ORDER BY e.id FOR KEY SHARE;

    -- Every receiver of every event: matching enabled endpoints, then the job's callback
    -- URL (read from the job's row, never copied into the event stream).
    SELECT coalesce(array_agg(r.ord ORDER BY r.ord, r.cb, r.target), '{{}}'),
           coalesce(array_agg(r.target ORDER BY r.ord, r.cb, r.target), '{{}}'),
           coalesce(array_agg(r.endpoint_id ORDER BY r.ord, r.cb, r.target), '{{}}'),
           coalesce(array_agg(r.url ORDER BY r.ord, r.cb, r.target), '{{}}')
      INTO t_ords, t_targets, t_endpoints, t_urls
      FROM (
        SELECT ev.ord::INTEGER AS ord, e.id AS target, e.id AS endpoint_id, NULL::TEXT AS url, 0 AS cb
          FROM unnest(p_tenants, p_types, p_kinds) WITH ORDINALITY AS ev(tenant, type, kind, ord)
          JOIN webhook_endpoints e
            ON e.tenant = ev.tenant AND e.status = 'enabled' AND ev.type = ANY(e.event_types)
           AND (e.kinds IS NULL OR ev.kind = ANY(e.kinds))
        UNION ALL
        SELECT ev.ord::INTEGER, '{callback_prefix}' || j.callback_url, NULL, j.callback_url, 1
          FROM unnest(p_job_ids, p_types) WITH ORDINALITY AS ev(job_id, type, ord)
          JOIN jobs j ON j.id = ev.job_id
         WHERE ev.type <> 'job.progress' AND j.callback_url IS NOT NULL AND j.callback_url <> ''
      ) r;
    IF cardinality(t_ords) = 0 THEN
        RETURN 0;
    END IF;

    -- One job's deliveries to one target are decided by one fan-out (or finish) at a time.
    -- Sorted, so that two fan-outs sharing keys cannot deadlock.
    FOR lock_key IN
        SELECT DISTINCT hashtext(x.target || chr(10) || p_job_ids[x.ord])
          FROM unnest(t_targets, t_ords) AS x(target, ord) ORDER BY 1
    LOOP
        PERFORM pg_advisory_xact_lock({order_lock}, lock_key);
    END LOOP;
    ts := {now};

    -- The body once per event. A redelivered old event refreshes created_at, so pruning
    -- (which re-checks it under the row lock) cannot drop a body it is about to need.
    INSERT INTO webhook_messages (event_id, body, created_at)
    SELECT DISTINCT ON (p_event_ids[x.ord]) p_event_ids[x.ord], p_bodies[x.ord], ts
      FROM unnest(t_ords) AS x(ord) ORDER BY p_event_ids[x.ord]
    ON CONFLICT (event_id) DO UPDATE SET created_at = EXCLUDED.created_at;

    -- What was fanned out before (a redelivery), read once for the batch, after the locks.
    SELECT coalesce(array_agg(d.event_id || chr(10) || d.target), '{{}}') INTO done
      FROM webhook_deliveries d WHERE d.event_id = ANY(p_event_ids);

    FOR i IN 1 .. cardinality(t_ords) LOOP
        o := t_ords[i];
        tgt := t_targets[i];
        eid := p_event_ids[o];
        job := p_job_ids[o];
        ver := p_versions[o];
        typ := p_types[o];
        -- A redelivered NATS message: already fanned out.
        CONTINUE WHEN eid || chr(10) || tgt = ANY(done);
        -- A newer event of this job can reach us first. If a newer delivery was already
        -- sent or is being sent, this one would go back in time; otherwise it goes first.
        -- The newer rows are locked, so that no claim can lease one while we decide.
        SELECT coalesce(bool_or(n.attempts > 0 OR n.lease_until > ts), FALSE) INTO newer_sent
          FROM (SELECT d.attempts, d.lease_until FROM webhook_deliveries d
                 WHERE d.target = tgt AND d.job_id = job AND d.version > ver
                   FOR UPDATE) n;
        new_status := 'pending';
        due := ts;
        IF newer_sent THEN
            new_status := 'superseded';
        ELSE
            -- Older deliveries waiting for a retry (or a progress slot) say less than this one.
            UPDATE webhook_deliveries d SET status = 'superseded', next_attempt_at = NULL, updated_at = ts
             WHERE d.target = tgt AND d.job_id = job AND d.version < ver
               AND d.status = 'pending' AND (d.lease_until IS NULL OR d.lease_until <= ts)
               AND (d.attempts > 0 OR d.type = 'job.progress');
            IF typ = 'job.progress' THEN
                SELECT max(d.scheduled_at) INTO last_progress FROM webhook_deliveries d
                 WHERE d.target = tgt AND d.job_id = job AND d.type = 'job.progress'
                   AND (d.status <> 'superseded' OR d.attempts > 0);  -- sent, or to be
                IF last_progress IS NOT NULL THEN
                    due := greatest(ts, last_progress + p_progress_interval);
                END IF;
            END IF;
        END IF;
        INSERT INTO webhook_deliveries (id, tenant, target, endpoint_id, url, event_id, job_id, version, type,
                                        status, scheduled_at, next_attempt_at, created_at, updated_at)
        VALUES (gen_random_uuid()::TEXT, p_tenants[o], tgt, t_endpoints[i], t_urls[i], eid, job, ver, typ,
                new_status, due, CASE WHEN new_status = 'pending' THEN due END, ts, ts)
        ON CONFLICT (event_id, target) DO NOTHING;
        IF FOUND AND new_status = 'pending' THEN
            pending := pending + 1;
        END IF;
    END LOOP;
    RETURN pending;
END $$;
"""

# notifier.queue's first claim (a window over everything pending), as migration 1 created it;
# migration 3 replaces it with the claim per target below.
_CLAIM_FUNCTION = """
CREATE FUNCTION herald_webhook_claim(
    p_owner TEXT, p_lease_s DOUBLE PRECISION, p_per_target INTEGER, p_limit INTEGER,
    p_busy_targets TEXT[], p_busy_counts INTEGER[]
) RETURNS TABLE (delivery webhook_deliveries, send_url TEXT, body BYTEA,
                 key_algorithms TEXT[], key_secrets BYTEA[], key_public_keys BYTEA[])
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE
    ts DOUBLE PRECISION := {now};
    ids TEXT[];
BEGIN
    -- Candidates as in SQLite: due, unleased, endpoint enabled, a slot left for the target
    -- in this notifier (p_busy_*: what it has in flight), oldest first, and nothing whose
    -- older version of the same job is pending for the same target. The window query
    -- cannot take row locks, so the outer step locks; rows another notifier holds are
    -- skipped, rows it leased meanwhile are re-checked on their newest version.
    SELECT coalesce(array_agg(locked.id), '{{}}') INTO ids FROM (
        SELECT d.id
          FROM webhook_deliveries d
          JOIN (
            SELECT cand.id, cand.next_attempt_at, cand.seq, coalesce(b.n, 0) AS busy,
                   row_number() OVER (PARTITION BY cand.target ORDER BY cand.next_attempt_at, cand.seq) AS rank
              FROM webhook_deliveries cand
              JOIN webhook_messages m ON m.event_id = cand.event_id
              LEFT JOIN webhook_endpoints e ON e.id = cand.endpoint_id
              LEFT JOIN unnest(p_busy_targets, p_busy_counts) AS b(target, n) ON b.target = cand.target
             WHERE cand.status = 'pending' AND cand.next_attempt_at <= ts
               AND (cand.lease_until IS NULL OR cand.lease_until <= ts)
               AND (cand.endpoint_id IS NULL OR e.status = 'enabled')
               AND coalesce(b.n, 0) < p_per_target
               AND NOT EXISTS (
                   SELECT 1 FROM webhook_deliveries older
                    WHERE older.target = cand.target AND older.job_id = cand.job_id
                      AND older.status = 'pending' AND older.version < cand.version)
          ) c ON c.id = d.id
         WHERE c.rank <= p_per_target - c.busy
           AND d.status = 'pending' AND (d.lease_until IS NULL OR d.lease_until <= ts)
         ORDER BY c.next_attempt_at, c.seq
         -- LIMIT above the row locks: rows another notifier holds are passed over and the
         -- next candidates taken, so concurrent claims split the work instead of colliding.
         LIMIT p_limit
           FOR UPDATE OF d SKIP LOCKED
    ) locked;
    IF cardinality(ids) = 0 THEN
        RETURN;
    END IF;

    -- A new snapshot: an older version committed by a fan-out since the candidates were
    -- read holds its newer one back (fan-out locked the newer row while deciding, so it
    -- either finished before our lock or will see our lease and supersede itself).
    RETURN QUERY
    WITH leased AS (
        UPDATE webhook_deliveries d SET lease_owner = p_owner, lease_until = ts + p_lease_s
         WHERE d.id = ANY(ids)
           AND NOT EXISTS (
               SELECT 1 FROM webhook_deliveries older
                WHERE older.target = d.target AND older.job_id = d.job_id
                  AND older.status = 'pending' AND older.version < d.version)
        RETURNING d
    )
    SELECT l.d, coalesce(e.url, (l.d).url), m.body, k.algorithms, k.secrets, k.public_keys
      FROM leased l
      JOIN webhook_messages m ON m.event_id = (l.d).event_id
      LEFT JOIN webhook_endpoints e ON e.id = (l.d).endpoint_id
     CROSS JOIN LATERAL (
        -- the keys that sign now: the current one first, then any in their overlap
        SELECT array_agg(wk.algorithm ORDER BY wk.created_at DESC) AS algorithms,
               array_agg(wk.secret ORDER BY wk.created_at DESC) AS secrets,
               array_agg(wk.public_key ORDER BY wk.created_at DESC) AS public_keys
          FROM webhook_keys wk
         WHERE wk.owner = coalesce((l.d).endpoint_id, '{callback_prefix}' || (l.d).tenant)
           AND (wk.retire_at IS NULL OR wk.retire_at > ts)
     ) k
     ORDER BY (l.d).next_attempt_at, (l.d).seq;
END $$;
"""

# The claim of migration 3, replacing the one above: the same rules, read per target. The
# targets with pending deliveries come from a loose index scan (one probe per target), and
# each target's oldest claimable deliveries from its own range of a partial index, at most
# the slots it has left (LATERAL ... LIMIT). The window over every pending row, run on every
# claim, grew with the backlog and was the claim's whole cost (bench/RESULTS.md, issue 14).
_CLAIM_BY_TARGET_FUNCTION = """
CREATE INDEX webhook_deliveries_pending_by_target ON webhook_deliveries (target, next_attempt_at, seq)
    WHERE status = 'pending';

-- A new result column (the job's trace context), so dropped and created again.
DROP FUNCTION herald_webhook_claim(TEXT, DOUBLE PRECISION, INTEGER, INTEGER, TEXT[], INTEGER[]);

CREATE FUNCTION herald_webhook_claim(
    p_owner TEXT, p_lease_s DOUBLE PRECISION, p_per_target INTEGER, p_limit INTEGER,
    p_busy_targets TEXT[], p_busy_counts INTEGER[]
) RETURNS TABLE (delivery webhook_deliveries, send_url TEXT, body BYTEA,
                 key_algorithms TEXT[], key_secrets BYTEA[], key_public_keys BYTEA[],
                 job_traceparent TEXT, job_tracestate TEXT)
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE
    ts DOUBLE PRECISION := {now};
    ids TEXT[];
BEGIN
    -- Candidates: per target, due, unleased, endpoint enabled, its message there, nothing
    -- whose older version of the same job is pending for the same target, oldest first, as
    -- many as the slots the target has left in this notifier (p_busy_*: what it has in
    -- flight); then the oldest of them all, locked SKIP LOCKED (rows another notifier holds
    -- are passed over), up to p_limit.
    SELECT coalesce(array_agg(locked.id), '{{}}') INTO ids FROM (
        SELECT d.id
          FROM webhook_deliveries d
          JOIN (
            WITH RECURSIVE targets(target) AS (
                SELECT (SELECT min(w.target) FROM webhook_deliveries w WHERE w.status = 'pending')
                UNION ALL
                SELECT (SELECT min(w.target) FROM webhook_deliveries w
                         WHERE w.status = 'pending' AND w.target > t.target)
                  FROM targets t WHERE t.target IS NOT NULL
            )
            SELECT cand.id, cand.next_attempt_at, cand.seq
              FROM targets t
              LEFT JOIN unnest(p_busy_targets, p_busy_counts) AS b(target, n) ON b.target = t.target
             CROSS JOIN LATERAL (
                SELECT c.id, c.next_attempt_at, c.seq
                  FROM webhook_deliveries c
                  LEFT JOIN webhook_endpoints e ON e.id = c.endpoint_id
                 WHERE c.target = t.target AND c.status = 'pending' AND c.next_attempt_at <= ts
                   AND (c.lease_until IS NULL OR c.lease_until <= ts)
                   AND (c.endpoint_id IS NULL OR e.status = 'enabled')
                   AND EXISTS (SELECT 1 FROM webhook_messages m WHERE m.event_id = c.event_id)
                   -- no older version of the job pending for the target: written as a
                   -- correlated sub-select so that it is one probe of (target, job_id) per
                   -- candidate whatever the statistics say (a fresh table's planner chose a
                   -- scan of the target's whole backlog per candidate for a NOT EXISTS)
                   AND (SELECT min(older.version) FROM webhook_deliveries older
                         WHERE older.target = c.target AND older.job_id = c.job_id
                           AND older.status = 'pending') = c.version
                 ORDER BY c.next_attempt_at, c.seq
                 LIMIT greatest(p_per_target - coalesce(b.n, 0), 0)
             ) cand
             WHERE t.target IS NOT NULL
          ) c ON c.id = d.id
         WHERE d.status = 'pending' AND (d.lease_until IS NULL OR d.lease_until <= ts)
         ORDER BY c.next_attempt_at, c.seq
         LIMIT p_limit
           FOR UPDATE OF d SKIP LOCKED
    ) locked;
    IF cardinality(ids) = 0 THEN
        RETURN;
    END IF;

    -- A new snapshot: an older version committed by a fan-out since the candidates were
    -- read holds its newer one back (fan-out locked the newer row while deciding, so it
    -- either finished before our lock or will see our lease and supersede itself).
    RETURN QUERY
    WITH leased AS (
        UPDATE webhook_deliveries d SET lease_owner = p_owner, lease_until = ts + p_lease_s
         WHERE d.id = ANY(ids)
           AND (SELECT min(older.version) FROM webhook_deliveries older
                 WHERE older.target = d.target AND older.job_id = d.job_id
                   AND older.status = 'pending') = d.version
        RETURNING d
    )
    SELECT l.d, coalesce(e.url, (l.d).url), m.body, k.algorithms, k.secrets, k.public_keys,
           j.traceparent, j.tracestate
      FROM leased l
      JOIN webhook_messages m ON m.event_id = (l.d).event_id
      LEFT JOIN webhook_endpoints e ON e.id = (l.d).endpoint_id
      LEFT JOIN jobs j ON j.id = (l.d).job_id  -- the trace context, with the claim: no second round trip
     CROSS JOIN LATERAL (
        -- the keys that sign now: the current one first, then any in their overlap
        SELECT array_agg(wk.algorithm ORDER BY wk.created_at DESC) AS algorithms,
               array_agg(wk.secret ORDER BY wk.created_at DESC) AS secrets,
               array_agg(wk.public_key ORDER BY wk.created_at DESC) AS public_keys
          FROM webhook_keys wk
         WHERE wk.owner = coalesce((l.d).endpoint_id, '{callback_prefix}' || (l.d).tenant)
           AND (wk.retire_at IS NULL OR wk.retire_at > ts)
     ) k
     ORDER BY (l.d).next_attempt_at, (l.d).seq;
END $$;
"""

# delivery_rules.settle, with the attempt logged and its consequences written, in one
# transaction (the SQLite queue's _finish).
_FINISH_FUNCTION = """
CREATE FUNCTION herald_webhook_finish(
    p_id TEXT, p_target TEXT, p_job_id TEXT, p_owner TEXT, p_started_at DOUBLE PRECISION,
    p_status_code INTEGER, p_latency_ms DOUBLE PRECISION, p_error TEXT, p_response BYTEA, p_ok BOOLEAN,
    p_plan TEXT, p_delay_s DOUBLE PRECISION, p_gone BOOLEAN, p_disable_after DOUBLE PRECISION,
    OUT o_status TEXT, OUT o_next_attempt_at DOUBLE PRECISION, OUT o_endpoint_disabled BOOLEAN
) LANGUAGE plpgsql SET enable_seqscan = off AS $$
#variable_conflict use_column
DECLARE
    ts DOUBLE PRECISION;
    d webhook_deliveries;
    n INTEGER;
    e_status TEXT;
    e_failing DOUBLE PRECISION;
BEGIN
    -- In turn with fan-outs of this job and target (the "newer version" check below) and
    -- with another finish of the same delivery (attempt numbers).
    PERFORM pg_advisory_xact_lock({order_lock}, hashtext(p_target || chr(10) || p_job_id));
    ts := {now};
    o_endpoint_disabled := FALSE;
    SELECT * INTO d FROM webhook_deliveries WHERE id = p_id FOR UPDATE;
    IF NOT FOUND THEN
        o_status := 'dropped';  -- its endpoint was deleted meanwhile
        RETURN;
    END IF;
    SELECT coalesce(max(a.n), 0) + 1 INTO n FROM webhook_attempts a WHERE a.delivery_id = p_id;
    INSERT INTO webhook_attempts (delivery_id, n, at, status_code, latency_ms, error, response)
    VALUES (p_id, n, p_started_at, p_status_code, p_latency_ms, p_error, p_response);

    IF p_plan = 'delivered' OR p_plan = 'failed' THEN
        o_status := p_plan;
    ELSIF EXISTS (SELECT 1 FROM webhook_deliveries x
                   WHERE x.target = d.target AND x.job_id = d.job_id AND x.version > d.version) THEN
        o_status := 'superseded';  -- the newer one carries the whole status: no need to retry this one
    ELSE
        o_status := 'pending';
        o_next_attempt_at := ts + p_delay_s;
    END IF;

    -- Endpoint health: continuous failure is tracked; 410 or 5 days of it disables.
    IF d.endpoint_id IS NOT NULL THEN
        IF p_ok THEN
            UPDATE webhook_endpoints SET failing_since = NULL WHERE id = d.endpoint_id AND failing_since IS NOT NULL;
        ELSE
            UPDATE webhook_endpoints SET failing_since = coalesce(failing_since, ts) WHERE id = d.endpoint_id
            RETURNING status, failing_since INTO e_status, e_failing;
            IF FOUND AND e_status <> 'enabled' THEN
                o_endpoint_disabled := TRUE;
            ELSIF FOUND AND (p_gone OR ts - e_failing >= p_disable_after) THEN
                -- As the API's disable does: FOR UPDATE waits for fan-outs holding the endpoint
                -- (FOR KEY SHARE), so the failing below, a new snapshot, sees what they queued.
                PERFORM 1 FROM webhook_endpoints WHERE id = d.endpoint_id FOR UPDATE;
                UPDATE webhook_endpoints SET status = 'disabled', updated_at = ts WHERE id = d.endpoint_id;
                -- its waiting deliveries end failed; this one is settled just below, with its attempt count
                UPDATE webhook_deliveries SET status = 'failed', next_attempt_at = NULL, lease_owner = NULL,
                       lease_until = NULL, updated_at = ts
                 WHERE endpoint_id = d.endpoint_id AND status = 'pending' AND id <> p_id;
                o_endpoint_disabled := TRUE;
            END IF;
        END IF;
        IF o_endpoint_disabled AND o_status = 'pending' THEN
            o_status := 'failed';
            o_next_attempt_at := NULL;
        END IF;
    END IF;

    UPDATE webhook_deliveries SET status = o_status, attempts = n, next_attempt_at = o_next_attempt_at,
           lease_owner = NULL, lease_until = NULL, updated_at = ts
     WHERE id = p_id AND lease_owner = p_owner;
END $$;
"""


# The claim of migration 4: fair among tenants, and within a tenant among its targets
# (SPEC §13). The candidates are read as in migration 3 (per target, at most the slots the
# target has left in this notifier), minus the targets the notifier holds back (p_held: at
# their cap per origin, or paced by its circuit breaker). Then, instead of "oldest first
# over everything" (which let a tenant's backlog take every slot before another tenant's
# due delivery), each tenant's candidates are ranked round robin over its targets and cut
# at the slots the tenant has left here (p_per_tenant minus p_busy_tenants' counts), and
# the free slots go to the tenant with the fewest in flight first (water-filling: slot k
# of a tenant with n in flight sorts at n + k), oldest first among equals.
_FAIR_CLAIM_FUNCTION = """
DROP FUNCTION herald_webhook_claim(TEXT, DOUBLE PRECISION, INTEGER, INTEGER, TEXT[], INTEGER[]);

CREATE FUNCTION herald_webhook_claim(
    p_owner TEXT, p_lease_s DOUBLE PRECISION, p_per_target INTEGER, p_limit INTEGER,
    p_busy_targets TEXT[], p_busy_counts INTEGER[],
    p_per_tenant INTEGER, p_busy_tenants TEXT[], p_tenant_counts INTEGER[], p_held TEXT[]
) RETURNS TABLE (delivery webhook_deliveries, send_url TEXT, body BYTEA,
                 key_algorithms TEXT[], key_secrets BYTEA[], key_public_keys BYTEA[],
                 job_traceparent TEXT, job_tracestate TEXT)
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE
    ts DOUBLE PRECISION := {now};
    ids TEXT[];
BEGIN
    SELECT coalesce(array_agg(locked.id), '{{}}') INTO ids FROM (
        SELECT d.id
          FROM webhook_deliveries d
          JOIN (
            WITH RECURSIVE targets(target) AS (
                SELECT (SELECT min(w.target) FROM webhook_deliveries w WHERE w.status = 'pending')
                UNION ALL
                SELECT (SELECT min(w.target) FROM webhook_deliveries w
                         WHERE w.status = 'pending' AND w.target > t.target)
                  FROM targets t WHERE t.target IS NOT NULL
            ), per_target AS (
                SELECT cand.id, cand.tenant, cand.next_attempt_at, cand.seq,
                       row_number() OVER (PARTITION BY t.target ORDER BY cand.next_attempt_at, cand.seq) AS target_rank
                  FROM targets t
                  LEFT JOIN unnest(p_busy_targets, p_busy_counts) AS b(target, n) ON b.target = t.target
                 CROSS JOIN LATERAL (
                    SELECT c.id, c.tenant, c.next_attempt_at, c.seq
                      FROM webhook_deliveries c
                      LEFT JOIN webhook_endpoints e ON e.id = c.endpoint_id
                     WHERE c.target = t.target AND c.status = 'pending' AND c.next_attempt_at <= ts
                       AND (c.lease_until IS NULL OR c.lease_until <= ts)
                       AND (c.endpoint_id IS NULL OR e.status = 'enabled')
                       AND EXISTS (SELECT 1 FROM webhook_messages m WHERE m.event_id = c.event_id)
                       -- one probe of (target, job_id) per candidate (see migration 3)
                       AND (SELECT min(older.version) FROM webhook_deliveries older
                             WHERE older.target = c.target AND older.job_id = c.job_id
                               AND older.status = 'pending') = c.version
                     ORDER BY c.next_attempt_at, c.seq
                     LIMIT greatest(p_per_target - coalesce(b.n, 0), 0)
                 ) cand
                 WHERE t.target IS NOT NULL AND NOT (t.target = ANY(p_held))
            ), per_tenant AS (
                SELECT pt.id, pt.next_attempt_at, pt.seq, coalesce(bt.n, 0) AS busy,
                       row_number() OVER (PARTITION BY pt.tenant
                                          ORDER BY pt.target_rank, pt.next_attempt_at, pt.seq) AS tenant_rank
                  FROM per_target pt
                  LEFT JOIN unnest(p_busy_tenants, p_tenant_counts) AS bt(tenant, n) ON bt.tenant = pt.tenant
            )
            SELECT pt.id, pt.next_attempt_at, pt.seq, pt.busy + pt.tenant_rank AS share
              FROM per_tenant pt
             WHERE p_per_tenant <= 0 OR pt.busy + pt.tenant_rank <= p_per_tenant
          ) c ON c.id = d.id
         WHERE d.status = 'pending' AND (d.lease_until IS NULL OR d.lease_until <= ts)
         ORDER BY c.share, c.next_attempt_at, c.seq
         LIMIT p_limit
           FOR UPDATE OF d SKIP LOCKED
    ) locked;
    IF cardinality(ids) = 0 THEN
        RETURN;
    END IF;

    -- A new snapshot: an older version committed by a fan-out since the candidates were
    -- read holds its newer one back (see migration 3).
    RETURN QUERY
    WITH leased AS (
        UPDATE webhook_deliveries d SET lease_owner = p_owner, lease_until = ts + p_lease_s
         WHERE d.id = ANY(ids)
           AND (SELECT min(older.version) FROM webhook_deliveries older
                 WHERE older.target = d.target AND older.job_id = d.job_id
                   AND older.status = 'pending') = d.version
        RETURNING d
    )
    SELECT l.d, coalesce(e.url, (l.d).url), m.body, k.algorithms, k.secrets, k.public_keys,
           j.traceparent, j.tracestate
      FROM leased l
      JOIN webhook_messages m ON m.event_id = (l.d).event_id
      LEFT JOIN webhook_endpoints e ON e.id = (l.d).endpoint_id
      LEFT JOIN jobs j ON j.id = (l.d).job_id
     CROSS JOIN LATERAL (
        SELECT array_agg(wk.algorithm ORDER BY wk.created_at DESC) AS algorithms,
               array_agg(wk.secret ORDER BY wk.created_at DESC) AS secrets,
               array_agg(wk.public_key ORDER BY wk.created_at DESC) AS public_keys
          FROM webhook_keys wk
         WHERE wk.owner = coalesce((l.d).endpoint_id, '{callback_prefix}' || (l.d).tenant)
           AND (wk.retire_at IS NULL OR wk.retire_at > ts)
     ) k
     ORDER BY array_position(ids, (l.d).id);
END $$;
"""


# Several attempts recorded in one transaction, one round trip: herald_webhook_finish for
# each, in the caller's order. The order locks of the whole batch are taken first and
# sorted, as fan-out takes its own, so a batch and a fan-out cannot deadlock on them.
_FINISH_MANY_FUNCTION = """
CREATE FUNCTION herald_webhook_finish_many(
    p_ids TEXT[], p_targets TEXT[], p_job_ids TEXT[], p_owner TEXT, p_started_at DOUBLE PRECISION[],
    p_status_codes INTEGER[], p_latency_ms DOUBLE PRECISION[], p_errors TEXT[], p_responses BYTEA[],
    p_ok BOOLEAN[], p_plans TEXT[], p_delays_s DOUBLE PRECISION[], p_gone BOOLEAN[],
    p_disable_after DOUBLE PRECISION
) RETURNS TABLE (o_ord INTEGER, o_status TEXT, o_next_attempt_at DOUBLE PRECISION, o_endpoint_disabled BOOLEAN)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    lock_key INTEGER;
    i INTEGER;
    f RECORD;
    ts DOUBLE PRECISION;
    fast INTEGER[];
BEGIN
    FOR lock_key IN
        SELECT DISTINCT hashtext(x.target || chr(10) || x.job_id)
          FROM unnest(p_targets, p_job_ids) AS x(target, job_id) ORDER BY 1
    LOOP
        PERFORM pg_advisory_xact_lock({order_lock}, lock_key);
    END LOOP;
    ts := {now};

    -- The common case set-based: a 2xx answer (delivered), each delivery once in the batch.
    -- What herald_webhook_finish does for one such attempt (lock the row, number and log the
    -- attempt, settle the delivery, end its endpoint's failing streak), for all of them in
    -- a few statements instead of seven per attempt.
    SELECT coalesce(array_agg(x.ord::INTEGER ORDER BY x.ord), '{{}}') INTO fast
      FROM unnest(p_ids, p_ok, p_plans) WITH ORDINALITY AS x(id, ok, plan, ord)
     WHERE x.ok AND x.plan = 'delivered'
       AND x.id IN (SELECT y.id FROM unnest(p_ids) AS y(id) GROUP BY y.id HAVING count(*) = 1);
    IF cardinality(fast) > 0 THEN
        PERFORM 1 FROM webhook_deliveries d
         WHERE d.id IN (SELECT p_ids[o] FROM unnest(fast) AS o) ORDER BY d.id FOR UPDATE;
        RETURN QUERY
        WITH fx AS (
            SELECT o AS ord, p_ids[o] AS id FROM unnest(fast) AS o
        ), pr AS (
            SELECT fx.ord, fx.id, d.endpoint_id,
                   coalesce((SELECT max(a.n) FROM webhook_attempts a WHERE a.delivery_id = fx.id), 0) + 1 AS n
              FROM fx JOIN webhook_deliveries d ON d.id = fx.id
        ), logged AS (
            INSERT INTO webhook_attempts (delivery_id, n, at, status_code, latency_ms, error, response)
            SELECT pr.id, pr.n, p_started_at[pr.ord], p_status_codes[pr.ord], p_latency_ms[pr.ord],
                   p_errors[pr.ord], p_responses[pr.ord]
              FROM pr
        ), settled AS (
            UPDATE webhook_deliveries d SET status = 'delivered', attempts = pr.n, next_attempt_at = NULL,
                   lease_owner = NULL, lease_until = NULL, updated_at = ts
              FROM pr WHERE d.id = pr.id AND d.lease_owner = p_owner
        ), healthy AS (
            UPDATE webhook_endpoints e SET failing_since = NULL
             WHERE e.id IN (SELECT pr.endpoint_id FROM pr) AND e.failing_since IS NOT NULL
        )
        SELECT fx.ord, CASE WHEN pr.id IS NULL THEN 'dropped' ELSE 'delivered' END,  -- dropped: endpoint deleted
               NULL::DOUBLE PRECISION, FALSE
          FROM fx LEFT JOIN pr ON pr.ord = fx.ord;
    END IF;

    -- Everything else (failures, retries, a delivery twice in one batch) one by one, in order.
    FOR i IN 1 .. coalesce(cardinality(p_ids), 0) LOOP
        CONTINUE WHEN i = ANY(fast);
        SELECT * INTO f FROM herald_webhook_finish(
            p_ids[i], p_targets[i], p_job_ids[i], p_owner, p_started_at[i], p_status_codes[i], p_latency_ms[i],
            p_errors[i], p_responses[i], p_ok[i], p_plans[i], p_delays_s[i], p_gone[i], p_disable_after);
        o_ord := i;
        o_status := f.o_status;
        o_next_attempt_at := f.o_next_attempt_at;
        o_endpoint_disabled := f.o_endpoint_disabled;
        RETURN NEXT;
    END LOOP;
END $$;
"""


def _ddl(sql: str) -> str:
    """Fill in the shared constants (the clock expression, lock classes, the callback prefix)."""
    return sql.format(now=NOW_SQL, key_lock=KEY_LOCK_CLASS, order_lock=ORDER_LOCK_CLASS,
                      callback_prefix=CALLBACK_PREFIX)


MIGRATIONS: list[tuple[str, str]] = [
    ("webhooks-1-tables", _SCHEMA),
    ("webhooks-1-functions",
     _ddl(_KEY_FUNCTIONS) + _ddl(_FAN_OUT_FUNCTION) + _ddl(_CLAIM_FUNCTION) + _ddl(_FINISH_FUNCTION)),
    ("webhooks-2-finish-many", _ddl(_FINISH_MANY_FUNCTION)),
    ("webhooks-3-claim-by-target", _ddl(_CLAIM_BY_TARGET_FUNCTION)),
    ("webhooks-4-fair-claim", _ddl(_FAIR_CLAIM_FUNCTION)),
]

_FAIL_PENDING_SQL = f"""
UPDATE webhook_deliveries SET status = 'failed', next_attempt_at = NULL, lease_owner = NULL,
       lease_until = NULL, updated_at = {NOW}
 WHERE endpoint_id = $1 AND status = 'pending'
"""

_LIVE_KEYS_SQL = f"""
SELECT algorithm, secret, public_key FROM webhook_keys
 WHERE owner = $1 AND (retire_at IS NULL OR retire_at > {NOW}) ORDER BY created_at DESC
"""

_DEADLOCK_RETRIES = 5
_RETRIED_ERRORS = (asyncpg.exceptions.DeadlockDetectedError, asyncpg.exceptions.SerializationError)

_payload_encoder = msgspec.json.Encoder()


async def _retrying(attempt: Callable[[], Awaitable[T]]) -> T:
    """Run an idempotent transaction again if PostgreSQL broke a lock cycle by aborting it."""
    for n in range(_DEADLOCK_RETRIES):
        try:
            return await attempt()
        except _RETRIED_ERRORS:
            if n == _DEADLOCK_RETRIES - 1:
                raise
            await asyncio.sleep(0.01 * (n + 1))
    raise AssertionError("unreachable")


def _key(sealer: Sealer, owner: str, algorithm: str, secret: bytes, public_key: bytes | None) -> SigningKey:
    """A stored key, its secret opened (the SQL moves sealed bytes only)."""
    public = bytes(public_key) if public_key is not None else None
    return SigningKey(algorithm=algorithm, secret=sealer.open(secret, key_aad(owner, algorithm, public)),
                      public_key=public)


def _sealed(sealer: Sealer, owner: str, key: SigningKey) -> bytes:
    return sealer.seal(key.secret, key_aad(owner, key.algorithm, key.public_key))


async def _ensure_current_key(db: PgDatabase, sealer: Sealer, owner: str, algorithm: str) -> SigningKey:
    """The owner's current key, made now if it has none; concurrent first calls agree on one."""
    candidate = new_key(algorithm)
    row = await db.pool.fetchrow("SELECT * FROM herald_webhook_ensure_key($1, $2, $3, $4)",
                                 owner, candidate.algorithm, _sealed(sealer, owner, candidate), candidate.public_key)
    assert row is not None
    return _key(sealer, owner, row["algorithm"], row["secret"], row["public_key"])


async def _add_key(conn: asyncpg.Connection | asyncpg.Pool, sealer: Sealer, owner: str, algorithm: str) -> SigningKey:
    key = new_key(algorithm)
    await conn.execute("SELECT herald_webhook_add_key($1, $2, $3, $4, $5)",
                       owner, key.algorithm, _sealed(sealer, owner, key), key.public_key, ROTATION_OVERLAP_S)
    return key


@unavailable_on_connection_errors
class PgWebhookStore:
    """Endpoints, keys and the delivery log as the API sees them."""

    def __init__(self, db: PgDatabase, sealer: Sealer) -> None:
        self.db = db
        self.sealer = sealer

    # ----- endpoints ----------------------------------------------------------------

    async def create_endpoint(
        self, tenant: str, *, url: str, event_types: Sequence[str], kinds: Sequence[str] | None, signature: str,
        max_endpoints: int = 0,
    ) -> tuple[EndpointRow, SigningKey]:
        endpoint_id = str(uuid.uuid4())
        key = new_key(signature)  # an unknown scheme fails before anything is written
        # One statement: the endpoint and its first key (nobody can have rotated it yet).
        insert = f"""
            WITH clock AS (SELECT {NOW_SQL} AS ts),
            endpoint AS (
                INSERT INTO webhook_endpoints (id, tenant, url, event_types, kinds, signature, status,
                                               created_at, updated_at)
                SELECT $1, $2, $3, $4, $5, $6, 'enabled', ts, ts FROM clock RETURNING *),
            first_key AS (
                INSERT INTO webhook_keys (owner, created_at, algorithm, secret, public_key)
                SELECT id, created_at, $7, $8, $9 FROM endpoint)
            SELECT * FROM endpoint
            """
        args = (endpoint_id, tenant, url, list(event_types), None if kinds is None else list(kinds), signature,
                key.algorithm, _sealed(self.sealer, endpoint_id, key), key.public_key)
        if max_endpoints <= 0:
            row = await self.db.pool.fetchrow(insert, *args)
        else:
            # The count and the insert under one lock per tenant, so that creations at several
            # gateways at once cannot pass the cap together; the insert, a later statement, sees
            # every endpoint committed before the lock was granted.
            async with self.db.pool.acquire() as conn, conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", ENDPOINT_LOCK_CLASS, tenant)
                count = await conn.fetchval("SELECT count(*) FROM webhook_endpoints WHERE tenant = $1", tenant)
                if count >= max_endpoints:
                    raise EndpointLimitReached(max_endpoints)
                row = await conn.fetchrow(insert, *args)
        assert row is not None
        return EndpointRow.from_mapping(row), key

    async def get_endpoint(self, tenant: str, endpoint_id: str) -> EndpointRow | None:
        row = await self.db.pool.fetchrow("SELECT * FROM webhook_endpoints WHERE id = $1 AND tenant = $2",
                                          endpoint_id, tenant)
        return EndpointRow.from_mapping(row) if row is not None else None

    async def list_endpoints(self, tenant: str, *, before: tuple[float, str] | None, limit: int) -> list[EndpointRow]:
        if before is None:
            rows = await self.db.pool.fetch(
                "SELECT * FROM webhook_endpoints WHERE tenant = $1 ORDER BY created_at DESC, id DESC LIMIT $2",
                tenant, limit)
        else:
            rows = await self.db.pool.fetch(
                "SELECT * FROM webhook_endpoints WHERE tenant = $1 AND (created_at, id) < ($2, $3)"
                " ORDER BY created_at DESC, id DESC LIMIT $4",
                tenant, before[0], before[1], limit)
        return [EndpointRow.from_mapping(r) for r in rows]

    async def update_endpoint(self, tenant: str, endpoint_id: str, changes: Mapping[str, Any]) -> EndpointRow | None:
        """Apply url/event_types/kinds/status. Disabling fails what was waiting."""
        values: dict[str, Any] = {}
        for name in ("url", "status", "event_types", "kinds"):
            if name in changes:
                value = changes[name]
                values[name] = list(value) if name in ("event_types", "kinds") and value is not None else value
        if changes.get("status") == "enabled":
            values["failing_since"] = None  # a fresh start: the 5-day clock restarts
        assignments = ", ".join([f"{column} = ${n}" for n, column in enumerate(values, start=2)]
                                + [f"updated_at = {NOW}"])
        disabling = changes.get("status") == "disabled"

        async def tx() -> EndpointRow | None:
            async with self.db.pool.acquire() as conn, conn.transaction():
                # FOR UPDATE waits for fan-outs holding the endpoint, so the failing below
                # (a later statement, a newer snapshot) also catches what they queued.
                if not await conn.fetchval("SELECT 1 FROM webhook_endpoints WHERE id = $1 AND tenant = $2 FOR UPDATE",
                                           endpoint_id, tenant):
                    return None
                row = await conn.fetchrow(f"UPDATE webhook_endpoints SET {assignments} WHERE id = $1 RETURNING *",
                                          endpoint_id, *values.values())
                if disabling:
                    await conn.execute(_FAIL_PENDING_SQL, endpoint_id)
                return EndpointRow.from_mapping(row)

        return await _retrying(tx)

    async def delete_endpoint(self, tenant: str, endpoint_id: str) -> bool:
        """The endpoint, its keys, its deliveries and their attempts go together."""

        async def tx() -> bool:
            async with self.db.pool.acquire() as conn, conn.transaction():
                # Waits for fan-outs holding the endpoint; the next statement sees their rows.
                if not await conn.fetchval("DELETE FROM webhook_endpoints WHERE id = $1 AND tenant = $2 RETURNING 1",
                                           endpoint_id, tenant):
                    return False
                await conn.execute(
                    """
                    WITH keys AS (DELETE FROM webhook_keys WHERE owner = $1),
                    deliveries AS (DELETE FROM webhook_deliveries WHERE endpoint_id = $1 RETURNING id)
                    DELETE FROM webhook_attempts WHERE delivery_id IN (SELECT id FROM deliveries)
                    """,
                    endpoint_id)
                return True

        return await _retrying(tx)

    async def rotate_endpoint_key(self, tenant: str, endpoint_id: str) -> SigningKey | None:
        async with self.db.pool.acquire() as conn, conn.transaction():
            # Held against a concurrent delete, which would leave the new key orphaned.
            signature = await conn.fetchval(
                "SELECT signature FROM webhook_endpoints WHERE id = $1 AND tenant = $2 FOR KEY SHARE",
                endpoint_id, tenant)
            return await _add_key(conn, self.sealer, endpoint_id, signature) if signature is not None else None

    # ----- the tenant's callback secret ------------------------------------------------

    async def callback_key(self, tenant: str) -> SigningKey:
        """The current callback secret, created on first use."""
        owner = callback_owner(tenant)
        row = await self.db.pool.fetchrow(
            "SELECT algorithm, secret, public_key FROM webhook_keys WHERE owner = $1 AND retire_at IS NULL", owner)
        if row is not None:
            return _key(self.sealer, owner, row["algorithm"], row["secret"], row["public_key"])
        return await _ensure_current_key(self.db, self.sealer, owner, HMAC)

    async def rotate_callback_key(self, tenant: str) -> SigningKey:
        return await _add_key(self.db.pool, self.sealer, callback_owner(tenant), HMAC)

    # ----- the delivery log ----------------------------------------------------------------

    async def list_deliveries(
        self, endpoint_id: str, *, status: str | None, before_seq: int | None, limit: int
    ) -> list[DeliveryRow]:
        """Newest first. The caller has already checked that the endpoint is the tenant's."""
        rows = await self.db.pool.fetch(
            "SELECT * FROM webhook_deliveries WHERE endpoint_id = $1"
            " AND ($2::TEXT IS NULL OR status = $2) AND ($3::BIGINT IS NULL OR seq < $3)"
            " ORDER BY seq DESC LIMIT $4",
            endpoint_id, status, before_seq, limit)
        return [DeliveryRow.from_mapping(r) for r in rows]

    async def attempts(self, delivery_ids: Sequence[str]) -> dict[str, list[AttemptRow]]:
        found: dict[str, list[AttemptRow]] = {d: [] for d in delivery_ids}
        if not delivery_ids:
            return found
        rows = await self.db.pool.fetch(
            "SELECT * FROM webhook_attempts WHERE delivery_id = ANY($1::TEXT[]) ORDER BY delivery_id, n",
            list(delivery_ids))
        for r in rows:
            found[r["delivery_id"]].append(AttemptRow(
                n=r["n"], at=r["at"], status_code=r["status_code"], latency_ms=r["latency_ms"], error=r["error"],
                response=bytes(r["response"]) if r["response"] is not None else None))
        return found

    async def get_delivery(self, endpoint_id: str, delivery_id: str) -> DeliveryRow | None:
        row = await self.db.pool.fetchrow("SELECT * FROM webhook_deliveries WHERE id = $1 AND endpoint_id = $2",
                                          delivery_id, endpoint_id)
        return DeliveryRow.from_mapping(row) if row is not None else None

    async def retry_now(self, endpoint_id: str, delivery_id: str) -> DeliveryRow | None:
        """Make the delivery due now, whatever its status; it keeps its id and webhook-id."""
        row = await self.db.pool.fetchrow(
            f"""
            WITH clock AS (SELECT {NOW_SQL} AS ts)
            UPDATE webhook_deliveries SET status = 'pending', next_attempt_at = clock.ts, updated_at = clock.ts
              FROM clock WHERE id = $1 AND endpoint_id = $2 RETURNING webhook_deliveries.*
            """,
            delivery_id, endpoint_id)
        return DeliveryRow.from_mapping(row) if row is not None else None

    async def recover(self, tenant: str, endpoint_id: str, since: float) -> int:
        """Every failed delivery created since ``since`` due now, as ``retry_now`` does: one statement.

        The endpoint is held ``FOR KEY SHARE`` while enabled, as fan-out holds it, so a
        concurrent disable (which takes it ``FOR UPDATE`` first, then fails what is pending)
        either comes after and fails these again, or came before and this finds nothing.
        """
        count = await self.db.pool.fetchval(
            f"""
            WITH endpoint AS (
                SELECT id FROM webhook_endpoints WHERE id = $1 AND tenant = $2 AND status = 'enabled' FOR KEY SHARE),
            clock AS (SELECT {NOW_SQL} AS ts),
            recovered AS (
                UPDATE webhook_deliveries d SET status = 'pending', next_attempt_at = clock.ts, updated_at = clock.ts
                  FROM endpoint, clock
                 WHERE d.endpoint_id = endpoint.id AND d.status = 'failed' AND d.created_at >= $3
                RETURNING 1)
            SELECT count(*) FROM recovered
            """,
            endpoint_id, tenant, since)
        return int(count)

    async def add_test_delivery(self, tenant: str, endpoint_id: str, event_id: str, job_key: str,
                                body: bytes) -> DeliveryRow | None:
        """One webhook.test delivery, due now, the endpoint held as in ``recover``; at most
        ``TEST_EVENTS_PER_WINDOW`` per endpoint in ``TEST_EVENT_WINDOW_S`` (a lock per endpoint
        makes the count and the insert one step)."""
        async with self.db.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", ENDPOINT_LOCK_CLASS, endpoint_id)
            recent = [r[0] for r in await conn.fetch(
                f"""
                SELECT created_at FROM webhook_deliveries
                 WHERE target = $1 AND job_id >= $2 AND job_id < $3 AND created_at > {NOW_SQL} - $4
                 ORDER BY created_at
                """, endpoint_id, TEST_JOB_PREFIX, TEST_JOB_END, TEST_EVENT_WINDOW_S)]
            if len(recent) >= TEST_EVENTS_PER_WINDOW:
                ts = await conn.fetchval(f"SELECT {NOW_SQL}")
                raise TestEventsLimited(recent[-TEST_EVENTS_PER_WINDOW] + TEST_EVENT_WINDOW_S - ts)
            row = await conn.fetchrow(
                f"""
                WITH endpoint AS (
                    SELECT id FROM webhook_endpoints WHERE id = $1 AND tenant = $2 AND status = 'enabled' FOR KEY SHARE),
                clock AS (SELECT {NOW_SQL} AS ts),
                message AS (
                    INSERT INTO webhook_messages (event_id, body, created_at)
                    SELECT $3, $5, clock.ts FROM endpoint, clock)
                INSERT INTO webhook_deliveries (id, tenant, target, endpoint_id, url, event_id, job_id, version, type,
                                                status, scheduled_at, next_attempt_at, created_at, updated_at)
                SELECT gen_random_uuid()::TEXT, $2, endpoint.id, endpoint.id, NULL, $3, $4, 0, $6,
                       'pending', clock.ts, clock.ts, clock.ts, clock.ts
                  FROM endpoint, clock
                RETURNING *
                """,
                endpoint_id, tenant, event_id, job_key, body, TEST_EVENT_TYPE)
        return DeliveryRow.from_mapping(row) if row is not None else None

    async def messages(self, event_ids: Sequence[str]) -> dict[str, bytes]:
        if not event_ids:
            return {}
        rows = await self.db.pool.fetch(
            "SELECT event_id, body FROM webhook_messages WHERE event_id = ANY($1::TEXT[])", list(event_ids))
        return {r["event_id"]: bytes(r["body"]) for r in rows}

    async def endpoint_health(self, endpoint_ids: Sequence[str], window: int) -> dict[str, HealthRow]:
        """One statement for a page of endpoints: each an index range scan of its newest ``window``."""
        if not endpoint_ids:
            return {}
        rows = await self.db.pool.fetch(
            """
            SELECT e.id AS endpoint_id, recent.delivered, recent.failed, newest AS last
              FROM unnest($1::TEXT[]) AS e(id)
             CROSS JOIN LATERAL (
                SELECT count(*) FILTER (WHERE r.status = 'delivered') AS delivered,
                       count(*) FILTER (WHERE r.status = 'failed') AS failed
                  FROM (SELECT d.status FROM webhook_deliveries d WHERE d.endpoint_id = e.id
                         ORDER BY d.seq DESC LIMIT $2) r) recent
              LEFT JOIN LATERAL (
                SELECT d FROM webhook_deliveries d WHERE d.endpoint_id = e.id ORDER BY d.seq DESC LIMIT 1
              ) latest(newest) ON TRUE
            """,
            list(endpoint_ids), window)
        return {
            r["endpoint_id"]: HealthRow(delivered=int(r["delivered"]), failed=int(r["failed"]),
                                        last=DeliveryRow.from_mapping(r["last"]) if r["last"] is not None else None)
            for r in rows
        }


@unavailable_on_connection_errors
class PgDeliveryQueue:
    """The durable schedule of webhook deliveries, shared by any number of notifiers."""

    def __init__(self, db: PgDatabase, sealer: Sealer) -> None:
        self.db = db
        self.sealer = sealer

    async def fan_out(self, events: Sequence[JobEvent]) -> int:
        """Record the deliveries of ``events`` in one statement (one transaction); returns how many are pending."""
        if not events:
            return 0
        args = (
            [e.tenant for e in events], [e.job_id for e in events], [e.version for e in events],
            [e.type for e in events], [e.kind for e in events], [event_id(e) for e in events],
            [_payload_encoder.encode(WebhookPayload(type=e.type, timestamp=e.at, data=e.data)) for e in events],
            PROGRESS_INTERVAL_S,
        )

        async def call() -> int:
            return int(await self.db.pool.fetchval(
                "SELECT herald_webhook_fan_out($1, $2, $3, $4, $5, $6, $7, $8)", *args))

        return await _retrying(call)

    async def anything_due(self) -> bool:
        """Cheap read: is a claim worth its transaction?"""
        return bool(await self.db.pool.fetchval(
            f"SELECT EXISTS (SELECT 1 FROM webhook_deliveries WHERE status = 'pending' AND next_attempt_at <= {NOW}"
            f" AND (lease_until IS NULL OR lease_until <= {NOW}))"))

    async def next_due_after(self, at: float) -> float | None:
        value = await self.db.pool.fetchval(
            "SELECT min(next_attempt_at) FROM webhook_deliveries WHERE status = 'pending' AND next_attempt_at > $1",
            at)
        return float(value) if value is not None else None

    async def claim(
        self, owner: str, *, lease_s: float, per_target: int, limit: int, in_flight: Mapping[str, int],
        per_tenant: int = 0, tenant_in_flight: Mapping[str, int] | None = None, held: Collection[str] = (),
    ) -> list[Claimed]:
        """Lease up to ``limit`` due deliveries nobody holds, fairly among tenants (see ``DeliveryQueue.claim``)."""
        if limit <= 0:
            return []
        busy = {target: n for target, n in in_flight.items() if n > 0}
        tenants = {tenant: n for tenant, n in (tenant_in_flight or {}).items() if n > 0}
        rows = await self.db.pool.fetch(
            "SELECT * FROM herald_webhook_claim($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
            owner, lease_s, per_target, limit, list(busy), list(busy.values()),
            per_tenant, list(tenants), list(tenants.values()), list(held))
        return [await self._claimed(row) for row in rows]

    async def defer(self, delivery_ids: Sequence[str], owner: str, targets: Sequence[str], delay_s: float) -> None:
        """Reschedule without an attempt: hand back ``delivery_ids`` (leased by ``owner``) due in
        ``delay_s``, and move every due, unleased pending delivery of ``targets`` to then too."""
        if not delivery_ids and not targets:
            return
        await self.db.pool.execute(
            f"""
            WITH clock AS (SELECT {NOW_SQL} AS ts)
            UPDATE webhook_deliveries d
               SET next_attempt_at = greatest(d.next_attempt_at, clock.ts + $4),
                   lease_owner = NULL, lease_until = NULL
              FROM clock
             WHERE d.status = 'pending'
               AND ((d.id = ANY($1::TEXT[]) AND d.lease_owner = $2)
                    OR (d.target = ANY($3::TEXT[]) AND d.next_attempt_at < clock.ts + $4
                        AND (d.lease_until IS NULL OR d.lease_until <= clock.ts)))
            """,
            list(delivery_ids), owner, list(targets), delay_s)

    async def _claimed(self, row: Mapping[str, Any]) -> Claimed:
        delivery = DeliveryRow.from_mapping(row["delivery"])
        owner = delivery.endpoint_id or callback_owner(delivery.tenant)  # the claim's key owner
        keys = tuple(_key(self.sealer, owner, a, s, p)
                     for a, s, p in zip(row["key_algorithms"] or (), row["key_secrets"] or (),
                                        row["key_public_keys"] or (), strict=True))
        if not keys and delivery.endpoint_id is None:
            # The tenant's first callback delivery: its secret is created on first use.
            await _ensure_current_key(self.db, self.sealer, owner, HMAC)
            keys = tuple(_key(self.sealer, owner, r["algorithm"], r["secret"], r["public_key"])
                         for r in await self.db.pool.fetch(_LIVE_KEYS_SQL, owner))
        trace = (row["job_traceparent"], row["job_tracestate"]) if row["job_traceparent"] else None
        return Claimed(delivery=delivery, url=row["send_url"], body=bytes(row["body"]), keys=keys, trace_context=trace)

    async def finish(self, claimed: Claimed, owner: str, started_at: float, outcome: Outcome, plan: Plan) -> Finished:
        """Log the attempt and apply its plan (delivered, retry later, superseded, failed) in one transaction."""
        d = claimed.delivery

        async def call() -> Finished:
            row = await self.db.pool.fetchrow(
                "SELECT * FROM herald_webhook_finish($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)",
                d.id, d.target, d.job_id, owner, started_at, outcome.status_code,
                round(outcome.latency_s * 1000, 3), outcome.error, outcome.response[:RESPONSE_KEEP_BYTES] or None,
                outcome.ok, plan.status, plan.delay_s, plan.disable_endpoint, ENDPOINT_DISABLE_AFTER_S)
            assert row is not None
            return Finished(status=row["o_status"], next_attempt_at=row["o_next_attempt_at"],
                            endpoint_disabled=bool(row["o_endpoint_disabled"]))

        return await _retrying(call)

    async def finish_many(self, attempts: Sequence[Attempted], owner: str) -> list[Finished]:
        """``finish`` for each attempt, in order, in one statement: one transaction, one round trip."""
        if not attempts:
            return []
        ds = [a.claimed.delivery for a in attempts]
        args = (
            [d.id for d in ds], [d.target for d in ds], [d.job_id for d in ds], owner,
            [a.started_at for a in attempts], [a.outcome.status_code for a in attempts],
            [round(a.outcome.latency_s * 1000, 3) for a in attempts], [a.outcome.error for a in attempts],
            [a.outcome.response[:RESPONSE_KEEP_BYTES] or None for a in attempts], [a.outcome.ok for a in attempts],
            [a.plan.status for a in attempts], [a.plan.delay_s for a in attempts],
            [a.plan.disable_endpoint for a in attempts], ENDPOINT_DISABLE_AFTER_S,
        )

        async def call() -> list[Finished]:
            rows = await self.db.pool.fetch(
                "SELECT * FROM herald_webhook_finish_many($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)"
                " ORDER BY o_ord", *args)
            return [Finished(status=r["o_status"], next_attempt_at=r["o_next_attempt_at"],
                             endpoint_disabled=bool(r["o_endpoint_disabled"])) for r in rows]

        return await _retrying(call)

    async def release(self, delivery_ids: Sequence[str], owner: str) -> None:
        """Hand leases back (shutdown), so another notifier need not wait for them to run out."""
        if delivery_ids:
            await self.db.pool.execute(
                "UPDATE webhook_deliveries SET lease_owner = NULL, lease_until = NULL"
                " WHERE id = ANY($1::TEXT[]) AND lease_owner = $2",
                list(delivery_ids), owner)

    async def prune(self, finished_before: float, limit: int = 1000) -> int:
        """Forget finished deliveries (with their attempts) older than the retention period."""
        async with self.db.pool.acquire() as conn, conn.transaction():
            # SKIP LOCKED: two notifiers pruning at once split the work instead of queueing.
            pruned = await conn.fetchval(
                """
                WITH gone AS (
                    DELETE FROM webhook_deliveries WHERE id IN (
                        SELECT id FROM webhook_deliveries WHERE status <> 'pending' AND updated_at < $1
                         LIMIT $2 FOR UPDATE SKIP LOCKED)
                    RETURNING id),
                attempts AS (DELETE FROM webhook_attempts WHERE delivery_id IN (SELECT id FROM gone))
                SELECT count(*) FROM gone
                """,
                finished_before, limit)
            # A later statement, so the deliveries just deleted no longer hold their bodies.
            await conn.execute(
                "DELETE FROM webhook_messages m WHERE m.created_at < $1 AND NOT EXISTS"
                " (SELECT 1 FROM webhook_deliveries d WHERE d.event_id = m.event_id)",
                finished_before)
            return int(pruned)
