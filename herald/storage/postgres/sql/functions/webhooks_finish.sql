-- PostgreSQL functions, an attempt's outcome, one or a batch of them.
-- A repeatable definition (herald/storage/migrations.py): applied, after the numbered
-- migrations, to every database whose record of this file differs; edit it in place.
-- The names in braces are filled in when it is applied (herald/storage/postgres/schema.py).

-- herald.delivery_rules.settle, next to the data: the attempt logged, what it leaves behind
-- decided and written, in one transaction (SQLite's _finish calls the rulebook itself). Its
-- numbers come in as arguments (p_disable_after: ENDPOINT_DISABLE_AFTER_S), and
-- tests/store_contract/test_rulebook.py holds its decisions to the rulebook's, case by case.
-- p_attempt_id: the attempt's own id (herald.deliveries.Attempted.id); an attempt the delivery's
-- log already holds is not recorded again (NULL: no such check, a caller from before it).
CREATE OR REPLACE FUNCTION herald_webhook_finish(
    p_id TEXT, p_target TEXT, p_job_id TEXT, p_owner TEXT, p_started_at DOUBLE PRECISION,
    p_status_code INTEGER, p_latency_ms DOUBLE PRECISION, p_error TEXT, p_response BYTEA, p_ok BOOLEAN,
    p_plan TEXT, p_delay_s DOUBLE PRECISION, p_gone BOOLEAN, p_disable_after DOUBLE PRECISION,
    p_attempt_id TEXT DEFAULT NULL,
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
    -- Recorded before (herald.delivery_rules.settled_before): the answer to that record was
    -- lost, not the record. Nothing is written again; the delivery is answered as it stands.
    IF p_attempt_id IS NOT NULL AND EXISTS (
        SELECT 1 FROM webhook_attempts a WHERE a.delivery_id = p_id AND a.attempt_id = p_attempt_id
    ) THEN
        o_status := d.status;
        o_next_attempt_at := CASE WHEN d.status = 'pending' THEN d.next_attempt_at END;
        o_endpoint_disabled := NOT p_ok AND EXISTS (
            SELECT 1 FROM webhook_endpoints e WHERE e.id = d.endpoint_id AND e.status <> 'enabled');
        RETURN;
    END IF;
    SELECT coalesce(max(a.n), 0) + 1 INTO n FROM webhook_attempts a WHERE a.delivery_id = p_id;
    INSERT INTO webhook_attempts (delivery_id, n, at, status_code, latency_ms, error, response, attempt_id)
    VALUES (p_id, n, p_started_at, p_status_code, p_latency_ms, p_error, p_response, p_attempt_id);

    IF NOT p_ok AND d.retry_asked_at IS NOT NULL THEN
        -- a retry asked for while this attempt was in flight: sent again now, whatever the plan
        o_status := 'pending';
        o_next_attempt_at := ts;
    ELSIF p_plan = 'delivered' OR p_plan = 'failed' THEN
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
                -- its waiting deliveries end failed (herald.delivery_rules.fails_with_its_endpoint);
                -- those out now are their attempts' to settle, and this one is settled just below,
                -- with its attempt count
                UPDATE webhook_deliveries SET status = 'failed', next_attempt_at = NULL, lease_owner = NULL,
                       lease_until = NULL, updated_at = ts
                 WHERE endpoint_id = d.endpoint_id AND status = 'pending' AND id <> p_id
                   AND (lease_until IS NULL OR lease_until <= ts);
                o_endpoint_disabled := TRUE;
            END IF;
        END IF;
        IF o_endpoint_disabled AND o_status = 'pending' THEN
            o_status := 'failed';
            o_next_attempt_at := NULL;
        END IF;
    END IF;

    UPDATE webhook_deliveries SET status = o_status, attempts = n, next_attempt_at = o_next_attempt_at,
           lease_owner = NULL, lease_until = NULL, retry_asked_at = NULL, updated_at = ts
     WHERE id = p_id AND lease_owner = p_owner;
END $$;

-- Several attempts recorded in one transaction, one round trip: herald_webhook_finish for
-- each, in the caller's order. The order locks of the whole batch are taken first and
-- sorted, as fan-out takes its own, so a batch and a fan-out cannot deadlock on them.
CREATE OR REPLACE FUNCTION herald_webhook_finish_many(
    p_ids TEXT[], p_targets TEXT[], p_job_ids TEXT[], p_owner TEXT, p_started_at DOUBLE PRECISION[],
    p_status_codes INTEGER[], p_latency_ms DOUBLE PRECISION[], p_errors TEXT[], p_responses BYTEA[],
    p_ok BOOLEAN[], p_plans TEXT[], p_delays_s DOUBLE PRECISION[], p_gone BOOLEAN[],
    p_disable_after DOUBLE PRECISION, p_attempt_ids TEXT[] DEFAULT NULL
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

    -- The common case set-based: a 2xx answer (delivered), each delivery once in the batch,
    -- not recorded before (one that was goes to herald_webhook_finish below, which answers it).
    -- What herald_webhook_finish does for one such attempt (lock the row, number and log the
    -- attempt, settle the delivery, end its endpoint's failing streak), for all of them in
    -- a few statements instead of seven per attempt.
    SELECT coalesce(array_agg(x.ord::INTEGER ORDER BY x.ord), '{}') INTO fast
      FROM unnest(p_ids, p_ok, p_plans) WITH ORDINALITY AS x(id, ok, plan, ord)
     WHERE x.ok AND x.plan = 'delivered'
       AND x.id IN (SELECT y.id FROM unnest(p_ids) AS y(id) GROUP BY y.id HAVING count(*) = 1)
       AND NOT EXISTS (SELECT 1 FROM webhook_attempts a
                        WHERE a.delivery_id = x.id AND a.attempt_id = p_attempt_ids[x.ord]);
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
            INSERT INTO webhook_attempts (delivery_id, n, at, status_code, latency_ms, error, response, attempt_id)
            SELECT pr.id, pr.n, p_started_at[pr.ord], p_status_codes[pr.ord], p_latency_ms[pr.ord],
                   p_errors[pr.ord], p_responses[pr.ord], p_attempt_ids[pr.ord]
              FROM pr
        ), settled AS (
            UPDATE webhook_deliveries d SET status = 'delivered', attempts = pr.n, next_attempt_at = NULL,
                   lease_owner = NULL, lease_until = NULL, retry_asked_at = NULL, updated_at = ts
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
            p_errors[i], p_responses[i], p_ok[i], p_plans[i], p_delays_s[i], p_gone[i], p_disable_after,
            p_attempt_ids[i]);
        o_ord := i;
        o_status := f.o_status;
        o_next_attempt_at := f.o_next_attempt_at;
        o_endpoint_disabled := f.o_endpoint_disabled;
        RETURN NEXT;
    END LOOP;
END $$;
