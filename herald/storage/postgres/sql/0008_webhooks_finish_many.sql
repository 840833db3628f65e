-- PostgreSQL migration 8: herald_webhook_finish_many.
-- The names in braces are filled in when it is applied (herald/storage/postgres/schema.py).

-- Several attempts recorded in one transaction, one round trip: herald_webhook_finish for
-- each, in the caller's order. The order locks of the whole batch are taken first and
-- sorted, as fan-out takes its own, so a batch and a fan-out cannot deadlock on them.
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
    SELECT coalesce(array_agg(x.ord::INTEGER ORDER BY x.ord), '{}') INTO fast
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
