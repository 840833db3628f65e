-- PostgreSQL functions, the numbering pass that gives committed events their tenant seq, and the relay's batch
-- (migration 13 made the columns they read).
-- A repeatable definition (herald/storage/migrations.py): applied, after the numbered
-- migrations, to every database whose record of this file differs; edit it in place.
-- The names in braces are filled in when it is applied (herald/storage/postgres/schema.py).

-- Every statement of these two functions is an index probe by design: they run with
-- enable_seqscan = off, as the webhook functions do, because plpgsql's cached plans are
-- made again whenever autovacuum analyzes a table, and some made while the outbox or events
-- was small joined by a sequential scan of events or sorted one of the outbox (a tenth to a
-- third of the calls in one e2e run, 1.2 ms each where an index probe takes 0.05).
--
-- Number the tenant's committed unnumbered events, in id order; how many it numbered.
--
-- Passes of a tenant take turns on a transaction-scoped advisory lock keyed by a 64-bit hash
-- of the tenant (so two tenants practically never share one), released after the commit is
-- visible, as a row lock is: a pass reads every number the previous one gave. Not on the
-- tenant_seq row, as first written (migration 13): a row lock is a write, so a relay's pass
-- that waited for another relay's pass, which had then numbered its events already (most
-- passes, under load), still got a transaction id and waited for a WAL flush of its own. A
-- pass that numbers nothing now writes nothing. A capped claim (SPEC §13) still locks the
-- tenant_seq row, which a pass updates last.
CREATE OR REPLACE FUNCTION herald_number_events(p_tenant TEXT) RETURNS INTEGER LANGUAGE plpgsql
SET enable_seqscan = off AS $fn$
DECLARE
    v_last BIGINT;
    v_count INTEGER;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_tenant, {number_lock}));
    -- A statement of its own, so a snapshot taken after the lock: every event committed
    -- before now, and every number the previous pass gave, are seen.
    SELECT s.last INTO v_last FROM tenant_seq s WHERE s.tenant = p_tenant;
    WITH todo AS (
        SELECT e.id, row_number() OVER (ORDER BY e.id) AS n
        FROM events e WHERE e.tenant = p_tenant AND e.seq IS NULL
    ), numbered AS (
        UPDATE events e SET seq = coalesce(v_last, 0) + todo.n FROM todo WHERE e.id = todo.id RETURNING 1
    )
    SELECT count(*) INTO v_count FROM todo;  -- the UPDATE runs whether or not it is read
    IF v_count > 0 THEN
        -- A row retention deleted meanwhile leaves its number unused, as retention does anyway.
        INSERT INTO tenant_seq AS s (tenant, last) VALUES (p_tenant, v_count)
        ON CONFLICT (tenant) DO UPDATE SET last = s.last + v_count;
    END IF;
    RETURN v_count;
END
$fn$;

-- The relay's batch: the oldest unpublished rows this process committed (p_stale_s NULL),
-- or anyone's older than p_stale_s, but not p_skip (published: their delete waits to ride
-- in the process's next statement); their events numbered first, so every event row comes
-- with its complete JobEvent payload. Tenants are numbered in byte order, the order a group
-- commit takes tenants' rows in (Python's sort), so two passes cannot wait on each other's
-- locks, nor a pass and a capped claim's batch on each other's tenant rows, in a cycle.
CREATE OR REPLACE FUNCTION herald_outbox_batch(p_origin TEXT, p_stale_s DOUBLE PRECISION, p_limit INTEGER,
                                               p_skip BIGINT[])
RETURNS TABLE (seq BIGINT, subject TEXT, msg_id TEXT, payload BYTEA, traceparent TEXT, tracestate TEXT)
LANGUAGE plpgsql SET enable_seqscan = off AS $fn$
#variable_conflict use_column
DECLARE
    v_batch BIGINT[];
    v_tenant TEXT;
BEGIN
    IF p_stale_s IS NULL THEN
        SELECT array_agg(b.seq) INTO v_batch FROM (
            SELECT o.seq FROM outbox o WHERE o.origin = p_origin AND o.seq <> ALL (p_skip)
            ORDER BY o.seq LIMIT p_limit) b;
    ELSE
        SELECT array_agg(b.seq) INTO v_batch FROM (
            SELECT o.seq FROM outbox o WHERE o.created_at < {now} - p_stale_s AND o.seq <> ALL (p_skip)
            ORDER BY o.seq LIMIT p_limit) b;
    END IF;
    IF v_batch IS NULL THEN
        RETURN;
    END IF;
    FOR v_tenant IN
        SELECT DISTINCT e.tenant COLLATE "C" FROM outbox o JOIN events e ON e.id = o.event_id
        WHERE o.seq = ANY (v_batch) AND e.seq IS NULL ORDER BY 1
    LOOP
        PERFORM herald_number_events(v_tenant);
    END LOOP;
    -- An event row whose event is not numbered (a row published and deleted meanwhile is
    -- simply gone) waits for the next batch.
    RETURN QUERY
        SELECT o.seq, o.subject, o.msg_id,
               CASE WHEN o.event_id IS NULL THEN o.payload
                    ELSE convert_to('{"seq":' || e.seq || ',', 'UTF8') || o.payload END,
               o.traceparent, o.tracestate
        FROM outbox o LEFT JOIN events e ON e.id = o.event_id
        WHERE o.seq = ANY (v_batch) AND (o.event_id IS NULL OR e.seq IS NOT NULL)
        ORDER BY o.seq;
END
$fn$;
