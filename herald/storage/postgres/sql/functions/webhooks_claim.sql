-- PostgreSQL functions, the webhook claim, fair among tenants and, within a tenant, among its
-- targets (SPEC §13). Migrations 9, 10 and 12 tell how it came to read as it does and made
-- the indexes it walks.
-- A repeatable definition (herald/storage/migrations.py): applied, after the numbered
-- migrations, to every database whose record of this file differs; edit it in place.
-- The names in braces are filled in when it is applied (herald/storage/postgres/schema.py).

-- p_only_tenants and p_only_targets, pairwise: claim among these tenants' targets only, not
-- every one with pending deliveries (a fan-out's own, herald_webhook_fan_out_leasing), so that
-- the deliveries one tenant's batch made never wait on a walk of another tenant's backlog. NULL:
-- every tenant and target (the scheduler's claim, herald_webhook_claim below).
CREATE OR REPLACE FUNCTION herald_webhook_claim_among(
    p_owner TEXT, p_lease_s DOUBLE PRECISION, p_per_target INTEGER, p_limit INTEGER,
    p_busy_targets TEXT[], p_busy_counts INTEGER[],
    p_per_tenant INTEGER, p_busy_tenants TEXT[], p_tenant_counts INTEGER[], p_held TEXT[],
    p_only_tenants TEXT[], p_only_targets TEXT[]
) RETURNS TABLE (delivery webhook_deliveries, send_url TEXT, body BYTEA,
                 key_algorithms TEXT[], key_secrets BYTEA[], key_public_keys BYTEA[],
                 job_traceparent TEXT, job_tracestate TEXT)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
#variable_conflict use_column
DECLARE
    ts DOUBLE PRECISION := {now};
    v_tenants TEXT[];
    v_tenant TEXT;
    v_targets TEXT[];
    found_ids TEXT[];
    found_targets TEXT[];
    found_rooms INTEGER[];
    found_due DOUBLE PRECISION[];
    found_seqs BIGINT[];
    c_ids TEXT[] := '{}';
    c_tenants TEXT[] := '{}';
    c_targets TEXT[] := '{}';
    c_rooms INTEGER[] := '{}';
    c_due DOUBLE PRECISION[] := '{}';
    c_seqs BIGINT[] := '{}';
    ids TEXT[];
BEGIN
    -- Statements whose plans do not depend on the caller's counts, so that plpgsql's cached
    -- plans serve every call. The counts enter as array lookups in expressions (a target's
    -- room, a tenant's cap), never as a relation joined in: one query whose plan the counts
    -- shaped had to be planned afresh each call, 1.5-3 ms a call (bench/RESULTS.md), more
    -- than the rest of a delivery's writes together.
    --
    -- Tenants with anything pending (a loose scan of webhook_deliveries_pending_by_tenant, one
    -- probe each), less those at their cap; for each, its targets (a loose scan again), less
    -- those held, and one statement: each target's candidates, at most its room.
    IF p_only_tenants IS NULL THEN
        v_tenants := ARRAY(
            WITH RECURSIVE tenants(tenant) AS (
                SELECT (SELECT min(w.tenant) FROM webhook_deliveries w WHERE w.status = 'pending')
                UNION ALL
                SELECT (SELECT min(w.tenant) FROM webhook_deliveries w
                         WHERE w.status = 'pending' AND w.tenant > t.tenant)
                  FROM tenants t WHERE t.tenant IS NOT NULL
            )
            SELECT t.tenant FROM tenants t WHERE t.tenant IS NOT NULL);
    ELSE
        v_tenants := ARRAY(SELECT DISTINCT t FROM unnest(p_only_tenants) AS t ORDER BY t);
    END IF;
    FOREACH v_tenant IN ARRAY v_tenants LOOP
        CONTINUE WHEN p_per_tenant > 0
            AND coalesce(p_tenant_counts[array_position(p_busy_tenants, v_tenant)], 0) >= p_per_tenant;
        IF p_only_tenants IS NULL THEN
            v_targets := ARRAY(
                WITH RECURSIVE targets(target) AS (
                    SELECT (SELECT min(w.target) FROM webhook_deliveries w
                             WHERE w.status = 'pending' AND w.tenant = v_tenant)
                    UNION ALL
                    SELECT (SELECT min(w.target) FROM webhook_deliveries w
                             WHERE w.status = 'pending' AND w.tenant = v_tenant AND w.target > t.target)
                      FROM targets t WHERE t.target IS NOT NULL
                )
                SELECT t.target FROM targets t WHERE t.target IS NOT NULL);
        ELSE
            v_targets := ARRAY(SELECT DISTINCT x.target FROM unnest(p_only_tenants, p_only_targets) AS x(tenant, target)
                                WHERE x.tenant = v_tenant ORDER BY x.target);
        END IF;
        SELECT array_agg(cand.id), array_agg(t.target), array_agg(r.room),
               array_agg(cand.next_attempt_at), array_agg(cand.seq)
          INTO found_ids, found_targets, found_rooms, found_due, found_seqs
          FROM unnest(v_targets) AS t(target)
         CROSS JOIN LATERAL (
            SELECT greatest(p_per_target - coalesce(p_busy_counts[array_position(p_busy_targets, t.target)], 0),
                            0) AS room
         ) r
         CROSS JOIN LATERAL (
            SELECT c.id, c.next_attempt_at, c.seq
              FROM webhook_deliveries c
              LEFT JOIN webhook_endpoints e ON e.id = c.endpoint_id
             WHERE c.tenant = v_tenant AND c.target = t.target AND c.status = 'pending'
               AND c.next_attempt_at <= ts
               AND (c.lease_until IS NULL OR c.lease_until <= ts)
               AND (c.endpoint_id IS NULL OR e.status = 'enabled')
               AND EXISTS (SELECT 1 FROM webhook_messages m WHERE m.event_id = c.event_id)
               -- one probe of (target, job_id) per candidate (see migration 3)
               AND (SELECT min(older.version) FROM webhook_deliveries older
                     WHERE older.target = c.target AND older.job_id = c.job_id
                       AND older.status = 'pending') = c.version
             ORDER BY c.next_attempt_at, c.seq
             LIMIT r.room
         ) cand
         WHERE r.room > 0 AND NOT (t.target = ANY(p_held));
        IF found_ids IS NOT NULL THEN
            c_ids := c_ids || found_ids;
            c_targets := c_targets || found_targets;
            c_rooms := c_rooms || found_rooms;
            c_due := c_due || found_due;
            c_seqs := c_seqs || found_seqs;
            c_tenants := c_tenants || array_fill(v_tenant, ARRAY[cardinality(found_ids)]);
        END IF;
    END LOOP;
    IF cardinality(c_ids) = 0 THEN
        RETURN;
    END IF;

    -- The fair order over the rows found, on the arrays alone: a target several tenants send
    -- to gives its room to the oldest over them; within a tenant, round robin over its
    -- targets (target_rank first), no more than its cap with what it has in flight.
    SELECT coalesce(array_agg(f.id ORDER BY f.share, f.due, f.seq), '{}') INTO ids FROM (
        WITH ranked AS (
            SELECT x.id, x.tenant, x.due, x.seq, x.room,
                   row_number() OVER (PARTITION BY x.target ORDER BY x.due, x.seq) AS target_rank
              FROM unnest(c_ids, c_tenants, c_targets, c_rooms, c_due, c_seqs)
                   AS x(id, tenant, target, room, due, seq)
        ), per_tenant AS (
            SELECT r.id, r.due, r.seq,
                   coalesce(p_tenant_counts[array_position(p_busy_tenants, r.tenant)], 0) AS busy,
                   row_number() OVER (PARTITION BY r.tenant ORDER BY r.target_rank, r.due, r.seq) AS tenant_rank
              FROM ranked r WHERE r.target_rank <= r.room
        )
        SELECT pt.id, pt.due, pt.seq, pt.busy + pt.tenant_rank AS share
          FROM per_tenant pt
         WHERE p_per_tenant <= 0 OR pt.busy + pt.tenant_rank <= p_per_tenant
    ) f;

    -- Then the row locks, in that order, one index probe each: rows another notifier holds
    -- are skipped, and so are rows leased or sent since they were read.
    SELECT coalesce(array_agg(locked.id), '{}') INTO ids FROM (
        SELECT d.id
          FROM unnest(ids) WITH ORDINALITY AS o(id, ord)
          JOIN webhook_deliveries d ON d.id = o.id
         WHERE d.status = 'pending' AND (d.lease_until IS NULL OR d.lease_until <= ts)
         ORDER BY o.ord
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

-- The scheduler's claim: among every tenant and target with pending deliveries.
CREATE OR REPLACE FUNCTION herald_webhook_claim(
    p_owner TEXT, p_lease_s DOUBLE PRECISION, p_per_target INTEGER, p_limit INTEGER,
    p_busy_targets TEXT[], p_busy_counts INTEGER[],
    p_per_tenant INTEGER, p_busy_tenants TEXT[], p_tenant_counts INTEGER[], p_held TEXT[]
) RETURNS TABLE (delivery webhook_deliveries, send_url TEXT, body BYTEA,
                 key_algorithms TEXT[], key_secrets BYTEA[], key_public_keys BYTEA[],
                 job_traceparent TEXT, job_tracestate TEXT)
LANGUAGE sql AS $$
    SELECT * FROM herald_webhook_claim_among(p_owner, p_lease_s, p_per_target, p_limit, p_busy_targets,
                                             p_busy_counts, p_per_tenant, p_busy_tenants, p_tenant_counts,
                                             p_held, NULL, NULL)
$$;
