-- PostgreSQL migration 9: the claim read per target.
-- The names in braces are filled in when it is applied (herald/storage/postgres/webhooks.py).

-- The claim of webhooks migration 3, replacing 0007's: the same rules, read per target. The
-- targets with pending deliveries come from a loose index scan (one probe per target), and
-- each target's oldest claimable deliveries from its own range of a partial index, at most
-- the slots it has left (LATERAL ... LIMIT). The window over every pending row, run on every
-- claim, grew with the backlog and was the claim's whole cost (bench/RESULTS.md, issue 14).
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
    SELECT coalesce(array_agg(locked.id), '{}') INTO ids FROM (
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
