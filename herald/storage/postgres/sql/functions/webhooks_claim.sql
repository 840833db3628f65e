-- PostgreSQL functions, the webhook claim, fair among tenants and, within a tenant, among its
-- targets (SPEC §13). Migrations 9, 10 and 12 tell how it came to read as it does and made
-- the indexes it walks.
-- A repeatable definition (herald/storage/migrations.py): applied, after the numbered
-- migrations, to every database whose record of this file differs; edit it in place.
-- The names in braces are filled in when it is applied (herald/storage/postgres/schema.py).

CREATE OR REPLACE FUNCTION herald_webhook_claim(
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
    SELECT coalesce(array_agg(locked.id), '{}') INTO ids FROM (
        SELECT d.id
          FROM webhook_deliveries d
          JOIN (
            WITH RECURSIVE pending_tenants(tenant) AS (
                SELECT (SELECT min(w.tenant) FROM webhook_deliveries w WHERE w.status = 'pending')
                UNION ALL
                SELECT (SELECT min(w.tenant) FROM webhook_deliveries w
                         WHERE w.status = 'pending' AND w.tenant > t.tenant)
                  FROM pending_tenants t WHERE t.tenant IS NOT NULL
            ), open_tenants AS (
                SELECT t.tenant FROM pending_tenants t
                 WHERE t.tenant IS NOT NULL
                   AND NOT EXISTS (SELECT 1 FROM unnest(p_busy_tenants, p_tenant_counts) AS bt(tenant, n)
                                    WHERE p_per_tenant > 0 AND bt.tenant = t.tenant AND bt.n >= p_per_tenant)
            ), targets(tenant, target) AS (
                SELECT o.tenant, (SELECT min(w.target) FROM webhook_deliveries w
                                   WHERE w.status = 'pending' AND w.tenant = o.tenant)
                  FROM open_tenants o
                UNION ALL
                SELECT t.tenant, (SELECT min(w.target) FROM webhook_deliveries w
                                   WHERE w.status = 'pending' AND w.tenant = t.tenant AND w.target > t.target)
                  FROM targets t WHERE t.target IS NOT NULL
            ), candidates AS (
                SELECT cand.id, cand.tenant, cand.next_attempt_at, cand.seq,
                       greatest(p_per_target - coalesce(b.n, 0), 0) AS room,
                       row_number() OVER (PARTITION BY t.target ORDER BY cand.next_attempt_at, cand.seq) AS target_rank
                  FROM targets t
                  LEFT JOIN unnest(p_busy_targets, p_busy_counts) AS b(target, n) ON b.target = t.target
                 CROSS JOIN LATERAL (
                    SELECT c.id, c.tenant, c.next_attempt_at, c.seq
                      FROM webhook_deliveries c
                      LEFT JOIN webhook_endpoints e ON e.id = c.endpoint_id
                     WHERE c.tenant = t.tenant AND c.target = t.target AND c.status = 'pending'
                       AND c.next_attempt_at <= ts
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
            ), per_target AS (
                -- a target several tenants send to: its room goes to the oldest over them
                SELECT r.id, r.tenant, r.next_attempt_at, r.seq, r.target_rank FROM candidates r WHERE r.target_rank <= r.room
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
